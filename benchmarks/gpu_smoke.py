"""GPU smoke check: flatview on real CUDA streams and NCCL, world size 1.

The CPU test suite cannot reach the CUDA code paths of the wrappers (side streams,
NCCL, the overlapped DDP buckets that are off by default on CPU). This script trains the
stochastic-depth model of ``bench_skip.py`` for a few steps under each wrapper with
flatview, on the GPU (torch FSDP1 at world size 1 is ``NO_SHARD``: once computed on
views, once on torch's runtime), and compares the result with the same training
without any wrapper; then it times flatview + DDP against DDP ``find_unused_parameters=True``.
Without a GPU it runs the same on CPU over gloo, so that it can be checked anywhere.

    python benchmarks/gpu_smoke.py                 # prints a report, writes --out JSON

Exit status 1 if any wrapper's parameters or ``None`` gradients differ from the
reference, a wrapper raised, the skip-set check read wrong fingerprints or waited for
the compute queued after it, or flatview made the host wait for the GPU inside a step
(``torch.cuda.set_sync_debug_mode``; waits elsewhere, the wrappers' and the model's, are
reported apart).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import socket
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import bench_skip as bench

import flatview


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def recording_syncs(device: torch.device) -> Iterator[dict[str, int]]:
    """Count each host-device synchronisation made inside, by the line that made it (the
    innermost flatview or benchmark frame, else the innermost frame). Counts nothing on
    CPU."""
    seen: dict[str, int] = {}
    if device.type != "cuda":
        yield seen
        return

    def record(*args: Any, **kwargs: Any) -> None:
        frames = [f for f in traceback.extract_stack()[:-2] if "warnings" not in f.filename]
        ours = [f for f in frames if "/flatview/" in f.filename or "bench_skip" in f.filename]
        where = ours[-1] if ours else frames[-1]
        if "set_sync_debug_mode" in (where.line or ""):
            return  # turning the mode off is reported as one
        key = f"{where.filename.split('/flatview/')[-1]}:{where.lineno} {where.line}"
        seen[key] = seen.get(key, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield seen
        finally:
            torch.cuda.set_sync_debug_mode("default")


def _step(
    model: nn.Module,
    fv: Any,
    opt: torch.optim.Optimizer,
    x: Any,
    y: Any,
    skip: list[int],
    check: bool | None = None,
) -> None:
    """One training step, through flatview unless ``fv`` is None (``check``: the skip-set
    check, as ``FlatView.step`` takes it)."""
    names = [f"blocks.{i}" for i in skip]
    step = fv.step(skip=names, check=check) if fv is not None else nullcontext()
    with step:
        F.cross_entropy(model(x, skip), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def start_one_process() -> torch.device:
    """This process as rank 0 of 1 (NCCL on the first GPU, else gloo on CPU)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    return device


_WRAP_OPTIONS: dict[str, dict[str, Any]] = {
    "ddp": {"overlap_reduction": True},  # the CUDA default, also on CPU
    "torch_fsdp1_per_block": {"overlap_reduction": True},  # computed on views: as DDP
    "torch_fsdp1_per_block_runtime": {"compute_on_views": False},
}
"""flatview.wrap options per wrapper of :func:`_wrappers`."""


def _wrappers(device: torch.device) -> dict[str, Callable[[nn.Module], nn.Module]]:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [device.index or 0] if device.type == "cuda" else None

    def per_block(net: nn.Module) -> nn.Module:
        return TorchFSDP(
            net,
            auto_wrap_policy=ModuleWrapPolicy({bench.Block}),
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            device_id=device,
        )

    def fsdp2_per_block(net: nn.Module) -> nn.Module:
        # FSDP2 keeps the original parameters (DTensors): skip sets, no views.
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (1,))
        for block in net.blocks:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh)
        fully_shard(net, mesh=mesh)
        return net

    wrappers: dict[str, Callable[[nn.Module], nn.Module]] = {
        "ddp": lambda net: DDP(net, device_ids=ids),
        # NO_SHARD at world size 1: computed on flatview's views, and on torch's runtime
        # (wrapped with compute_on_views=False, see _WRAP_OPTIONS).
        "torch_fsdp1_per_block": per_block,
        "torch_fsdp1_per_block_runtime": per_block,
        "fsdp2_per_block": fsdp2_per_block,
    }
    if device.type == "cuda":
        try:
            from fairscale.nn import FullyShardedDataParallel as FairscaleFSDP
        except ImportError:
            pass
        else:

            def fairscale(net: nn.Module) -> nn.Module:
                for index, block in enumerate(net.blocks):  # type: ignore[arg-type]
                    net.blocks[index] = FairscaleFSDP(block, flatten_parameters=True)  # type: ignore[index, operator]
                return FairscaleFSDP(net, flatten_parameters=True)

            wrappers["fairscale_per_block"] = fairscale
    return wrappers


def _full_values(fv: Any) -> dict[str, torch.Tensor]:
    """``fv``'s parameters by name, whole (FSDP2's are DTensors: their full values)."""
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
        for n, p in fv.named_parameters()
    }


def _worst_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest element difference over the parameters of ``want`` that ``got`` holds
    with as many elements (flattened: views may be 1-D)."""
    return max(
        float((got[n].detach().reshape(-1) - want[n].reshape(-1)).abs().max())
        for n in want
        if got[n].numel() == want[n].numel()
    )


def _failed(exc: Exception) -> dict[str, Any]:
    """A check's report of the exception it caught."""
    return {
        "ok": False,
        "error": f"{type(exc).__name__}: {exc}",
        "traceback": traceback.format_exc(limit=-4),
    }


def check_equivalence(cfg: bench.Config, device: torch.device, steps: int) -> dict[str, Any]:
    """Each wrapper + flatview against the unwrapped model, same data and skips."""
    masks = bench.skip_masks(cfg, steps)
    batches = [(x.to(device), y.to(device)) for x, y in bench.make_batches(cfg, steps, 0)]
    reference = bench.make_net(cfg).to(device)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=cfg.lr, momentum=0.9)
    none_ref = []
    for (x, y), skip in zip(batches, masks, strict=True):
        F.cross_entropy(reference(x, skip), y).backward()
        none_ref.append(sorted(n for n, p in reference.named_parameters() if p.grad is None))
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    want = {n: p.detach() for n, p in reference.named_parameters()}
    results: dict[str, Any] = {}
    for name, wrap in _wrappers(device).items():
        try:
            model = wrap(bench.make_net(cfg).to(device))
            fv = flatview.wrap(model, **_WRAP_OPTIONS.get(name, {}))
            opt = torch.optim.SGD(fv.parameters(), lr=cfg.lr, momentum=0.9)
            none_got = []
            syncs: dict[str, int] = {}
            for step, ((x, y), skip) in enumerate(zip(batches, masks, strict=True)):
                # Once buffers are made (step 0) and DDP's bucket order is learned (step 1:
                # one broadcast of Python objects, which waits, once, as DDP's rebuild
                # does), a step should not wait for the GPU.
                watch = recording_syncs(device) if step >= 2 else contextlib.nullcontext({})
                with watch as seen, fv.step(skip=[f"blocks.{i}" for i in skip]):
                    F.cross_entropy(model(x, skip), y).backward()
                for where, count in seen.items():
                    syncs[where] = syncs.get(where, 0) + count
                none_got.append(sorted(n for n, p in fv.named_parameters() if p.grad is None))
                opt.step()
                opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            got = _full_values(fv)
            worst = _worst_diff(got, want)
            ours = {k: v for k, v in syncs.items() if not k.startswith("/")}
            ok = none_got == none_ref and worst < 1e-4 and got.keys() == want.keys()
            results[name] = {
                "ok": ok and not ours,
                "max_abs_diff": worst,
                "none_grads_match": none_got == none_ref,
                "flatview_syncs": ours,
                "other_syncs": {k: v for k, v in syncs.items() if k.startswith("/")},
            }
        except Exception as exc:  # reported, not raised: the other wrappers still run
            results[name] = _failed(exc)
    return results


def _evaluating_steps(
    model: nn.Module, fv: Any, opt: torch.optim.Optimizer, batches: Any, masks: Any
) -> None:
    """Training steps with an evaluation under ``no_grad`` between each backward and
    its optimizer step, and after each step an evaluation, then every parameter scaled
    by 0.9 in place (a moving average copied in): FSDP keeps the root's unsharded
    parameters after a forward, which flatview frees before the next training forward
    (flatview.leftovers)."""
    for (x, y), skip in zip(batches, masks, strict=True):
        step = fv.step(skip=[f"blocks.{i}" for i in skip]) if fv is not None else nullcontext()
        with step:
            F.cross_entropy(model(x, skip), y).backward()
        with torch.no_grad():
            model(x, [])
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            model(x, [])
            for p in fv.parameters() if fv is not None else model.parameters():
                p.mul_(0.9)


def check_evaluation_before_step(
    cfg: bench.Config, device: torch.device, steps: int
) -> dict[str, Any]:
    """Each wrapper + flatview against the unwrapped model, evaluating between backward and
    step and writing after an evaluation (:func:`_evaluating_steps`): on CUDA the release
    of the unsharded copy frees storage the evaluation's kernels may still read."""
    masks = bench.skip_masks(cfg, steps)
    batches = [(x.to(device), y.to(device)) for x, y in bench.make_batches(cfg, steps, 0)]
    reference = bench.make_net(cfg).to(device)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=cfg.lr, momentum=0.9)
    _evaluating_steps(reference, None, ref_opt, batches, masks)
    want = {n: p.detach() for n, p in reference.named_parameters()}
    results: dict[str, Any] = {}
    for name, wrap in _wrappers(device).items():
        try:
            model = wrap(bench.make_net(cfg).to(device))
            fv = flatview.wrap(model, **_WRAP_OPTIONS.get(name, {}))
            opt = torch.optim.SGD(fv.parameters(), lr=cfg.lr, momentum=0.9)
            _evaluating_steps(model, fv, opt, batches, masks)
            if device.type == "cuda":
                torch.cuda.synchronize()
            got = _full_values(fv)
            worst = _worst_diff(got, want)
            ok = worst < 1e-4 and got.keys() == want.keys()
            results[name] = {"ok": ok, "max_abs_diff": worst}
        except Exception as exc:  # reported, not raised: the other wrappers still run
            results[name] = _failed(exc)
    return results


def check_mixed_precision(cfg: bench.Config, device: torch.device, steps: int) -> dict[str, Any]:
    """torch FSDP1 per block in bf16 (``MixedPrecision``), with flatview against without:
    skipped blocks are not called, so bare FSDP1 leaves their gradients ``None`` too and
    both runs must agree (up to the order of the bf16 reduction)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    masks = bench.skip_masks(cfg, steps)
    batches = [(x.to(device), y.to(device)) for x, y in bench.make_batches(cfg, steps, 0)]
    finals = []
    try:
        for with_flatview in (False, True):
            model = TorchFSDP(
                bench.make_net(cfg).to(device),
                auto_wrap_policy=ModuleWrapPolicy({bench.Block}),
                mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
                device_id=device,
            )
            fv = flatview.wrap(model) if with_flatview else None
            opt = torch.optim.SGD((fv or model).parameters(), lr=cfg.lr, momentum=0.9)
            for (x, y), skip in zip(batches, masks, strict=True):
                _step(model, fv, opt, x, y, skip)
            if fv is not None:
                fv.unwrap()
            with TorchFSDP.summon_full_params(model):
                finals.append([p.detach().clone().float().reshape(-1) for p in model.parameters()])
        plain, ours = (torch.cat(f) for f in finals)
        worst = float((plain - ours).abs().max())
        return {"ok": worst < 1e-3, "max_abs_diff": worst}
    except Exception as exc:  # reported, not raised
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def check_cast_after_wrap(cfg: bench.Config, device: torch.device, steps: int) -> dict[str, Any]:
    """Each wrapper + flatview with the model cast to bfloat16 after ``flatview.wrap``
    (``model.to(torch.bfloat16)``, as torch allows between building a wrapper and its
    first forward), optimizers built before the cast: the views are bfloat16 and the
    training ends where the unwrapped model cast alike does (up to bfloat16 rounding)."""
    masks = bench.skip_masks(cfg, steps)
    batches = [
        (x.to(device, torch.bfloat16), y.to(device)) for x, y in bench.make_batches(cfg, steps, 0)
    ]
    reference = bench.make_net(cfg).to(device, torch.bfloat16)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=cfg.lr)
    for (x, y), skip in zip(batches, masks, strict=True):
        _step(reference, None, ref_opt, x, y, skip)
    want = {n: p.detach().float() for n, p in reference.named_parameters()}
    results: dict[str, Any] = {}
    for name, wrap in _wrappers(device).items():
        try:
            model = wrap(bench.make_net(cfg).to(device))
            fv = flatview.wrap(model, **_WRAP_OPTIONS.get(name, {}))
            opt = torch.optim.SGD(fv.parameters(), lr=cfg.lr)
            model.to(torch.bfloat16)
            dtypes = sorted({str(p.dtype) for p in fv.parameters()})
            for (x, y), skip in zip(batches, masks, strict=True):
                _step(model, fv, opt, x, y, skip)
            got = {n: p.float() for n, p in _full_values(fv).items()}
            worst = max(float((got[n] - want[n]).abs().max()) for n in want)
            ok = dtypes == ["torch.bfloat16"] and worst < 5e-2
            results[name] = {"ok": ok, "max_abs_diff": worst, "dtypes": dtypes}
        except Exception as exc:  # reported, not raised: the other wrappers still run
            results[name] = _failed(exc)
    return results


def check_ddp_comm_hooks(cfg: bench.Config, device: torch.device, steps: int) -> dict[str, Any]:
    """DDP with torch's fp16 and bf16 compression hooks registered before the wrap:
    flatview + DDP against bare DDP with the same hook, nothing skipped (bare DDP would
    need ``find_unused_parameters``). flatview reproduces the hook's arithmetic, so they
    must agree exactly. torch's bf16 hook needs NCCL."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [device.index or 0] if device.type == "cuda" else None
    batches = [(x.to(device), y.to(device)) for x, y in bench.make_batches(cfg, steps, 0)]
    hooks = ["fp16_compress_hook"] + (["bf16_compress_hook"] if device.type == "cuda" else [])
    results: dict[str, Any] = {}
    for hook in hooks:
        try:
            finals = []
            for with_flatview in (False, True):
                net = bench.make_net(cfg).to(device)
                model = DDP(net, device_ids=ids)
                model.register_comm_hook(None, getattr(default_hooks, hook))
                fv = flatview.wrap(model) if with_flatview else None
                opt = torch.optim.SGD(net.parameters(), lr=cfg.lr, momentum=0.9)
                for x, y in batches:
                    _step(model, fv, opt, x, y, [])
                finals.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
            worst = float((finals[0] - finals[1]).abs().max())
            results[hook] = {"ok": worst == 0.0, "max_abs_diff": worst}
        except Exception as exc:  # reported, not raised
            results[hook] = _failed(exc)
    return results


def check_fsdp2_accumulation(
    cfg: bench.Config, device: torch.device, steps: int, hsdp: bool, mixed: bool
) -> dict[str, Any]:
    """FSDP2 accumulating two micro-batches per step that skip different blocks, against
    the unwrapped model accumulating the same: the same parameters (to bf16 rounding
    where ``mixed``), and no gradient exactly where it has none. ``hsdp``: a 1 x 1 HSDP
    mesh, the first micro-batch under ``set_requires_all_reduce(False)`` (FSDP2 still
    keeps its reduce-scatter sum and all-reduces it over the replica dimension); else
    under ``set_requires_gradient_sync(False)``. ``mixed``: bf16 parameters, float32
    reduction (FSDP2 accumulates in float32)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    micros = 2 * steps
    masks = bench.skip_masks(cfg, micros)
    batches = [(x.to(device), y.to(device)) for x, y in bench.make_batches(cfg, micros, 0)]

    def train(model: nn.Module, fv: Any, params: Any) -> list[list[str]]:
        opt = torch.optim.SGD(params, lr=cfg.lr, momentum=0.9)
        nones = []
        for micro, ((x, y), skip) in enumerate(zip(batches, masks, strict=True)):
            closing = micro % 2 == 1
            if fv is not None:
                setting = "set_requires_all_reduce" if hsdp else "set_requires_gradient_sync"
                getattr(model, setting)(closing)
            names = [f"blocks.{i}" for i in skip]
            with fv.step(skip=names) if fv is not None else nullcontext():
                F.cross_entropy(model(x, skip), y).backward()
            if closing:
                named = fv.named_parameters() if fv is not None else model.named_parameters()
                nones.append(sorted(n for n, p in named if p.grad is None))
                opt.step()
                opt.zero_grad(set_to_none=True)
        return nones

    try:
        reference = bench.make_net(cfg).to(device)
        none_ref = train(reference, None, reference.parameters())
        want = {n: p.detach() for n, p in reference.named_parameters()}
        net = bench.make_net(cfg).to(device)
        shape, dims = ((1, 1), ("replicate", "shard")) if hsdp else ((1,), ("shard",))
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=dims)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        kwargs: dict[str, Any] = {"mesh": mesh, "mp_policy": policy} if mixed else {"mesh": mesh}
        for block in net.blocks:  # type: ignore[union-attr]
            fully_shard(block, **kwargs)
        fully_shard(net, **kwargs)
        fv = flatview.wrap(net)
        none_got = train(net, fv, fv.parameters())
        if device.type == "cuda":
            torch.cuda.synchronize()
        got = _full_values(fv)
        worst = max(float((got[n] - want[n]).abs().max()) for n in want)
        ok = worst < (5e-2 if mixed else 1e-4) and none_got == none_ref
        return {"ok": ok, "max_abs_diff": worst, "none_grads_match": none_got == none_ref}
    except Exception as exc:  # reported, not raised
        return _failed(exc)


def check_agreement_readback(device: torch.device) -> dict[str, Any]:
    """The skip-set check reads its fingerprints through a side stream: right values, and
    without waiting for compute queued after the check started (as a forward is). At
    world size 1 the fingerprints always agree, so the training runs cannot tell."""
    if device.type != "cuda":
        return {"ok": True, "skipped": "no GPU"}
    from flatview.comm.agreement import Agreement
    from flatview.comm.ledger import Ledger

    a = torch.randn(8192, 8192, device=device)
    torch.cuda.synchronize()
    agreement = Agreement(123456789, list, None, device, Ledger())
    busy = [a @ a for _ in range(20)]  # tens of milliseconds queued behind the check
    done = torch.cuda.Event()
    done.record()
    agreement.settle()
    compute_finished = done.query()
    host = agreement._host
    value = host.tolist() if host is not None else None
    torch.cuda.synchronize()
    del busy
    return {
        "ok": value == [123456789] and not compute_finished,
        "value": value,
        "waited_for_compute": compute_finished,
    }


def time_ddp(cfg: bench.Config, device: torch.device, steps: int) -> dict[str, float]:
    """Median step times of flatview + DDP (buckets overlapped with the backward or not)
    and of DDP ``find_unused_parameters=True``, measured side by side."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [device.index or 0] if device.type == "cuda" else None
    masks = bench.skip_masks(cfg, steps)
    batches = [(x.to(device), y.to(device)) for x, y in bench.make_batches(cfg, steps, 0)]
    times: dict[str, float] = {}
    for label in ("flatview_ddp", "flatview_ddp_no_overlap", "ddp_find_unused"):
        net = bench.make_net(cfg).to(device)
        model = DDP(net, device_ids=ids, find_unused_parameters=label == "ddp_find_unused")
        fv = None
        if label.startswith("flatview"):
            fv = flatview.wrap(model, overlap_reduction=label == "flatview_ddp")
        opt = torch.optim.SGD((fv or model).parameters(), lr=cfg.lr, momentum=0.9)
        samples = []
        for i, ((x, y), skip) in enumerate(zip(batches, masks, strict=True)):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            _step(model, fv, opt, x, y, skip)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= 3:
                samples.append(time.perf_counter() - start)
        times[label] = sorted(samples)[len(samples) // 2] * 1e3
        if fv is not None:
            fv.unwrap()
    times["ratio"] = times["flatview_ddp"] / times["ddp_find_unused"]
    times["ratio_no_overlap"] = times["flatview_ddp_no_overlap"] / times["ddp_find_unused"]
    times["overlap_vs_not"] = times["flatview_ddp"] / times["flatview_ddp_no_overlap"]
    return times


def check_whole_muon(cfg: bench.Config, device: torch.device, steps: int) -> dict[str, Any]:
    """``flatview.optim.Whole(torch.optim.Muon, ...)`` over torch FSDP1 per block against
    ``torch.optim.Muon`` on the unwrapped model (world size 1: every view full, so Whole
    steps them in place and communicates nothing; what runs is its CUDA path)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    import flatview.optim

    if device.type != "cuda":
        # Muon's bfloat16 matrix products are slow on CPUs: a small model there.
        cfg = dataclasses.replace(cfg, width=min(cfg.width, 64))
    masks = bench.skip_masks(cfg, steps)
    batches = [(x.to(device), y.to(device)) for x, y in bench.make_batches(cfg, steps, 0)]
    try:
        reference = bench.make_net(cfg).to(device)
        matrices = [p for p in reference.parameters() if p.ndim == 2]
        ref_opt = torch.optim.Muon(matrices, lr=0.02, momentum=0.95)
        for (x, y), skip in zip(batches, masks, strict=True):
            _step(reference, None, ref_opt, x, y, skip)
        model = TorchFSDP(
            bench.make_net(cfg).to(device),
            auto_wrap_policy=ModuleWrapPolicy({bench.Block}),
            device_id=device,
        )
        fv = flatview.wrap(model)
        views = [p for p in fv.parameters() if fv.shape_of(p).ndim == 2]
        opt = flatview.optim.Whole(torch.optim.Muon, fv, views, lr=0.02, momentum=0.95)
        for (x, y), skip in zip(batches, masks, strict=True):
            _step(model, fv, opt, x, y, skip)
        if device.type == "cuda":
            torch.cuda.synchronize()
        got = dict(fv.named_parameters())
        worst = max(
            float((got[n].detach().reshape(-1) - p.detach().reshape(-1)).abs().max())
            for n, p in reference.named_parameters()
        )
        return {"ok": worst < 1e-4, "max_abs_diff": worst, "moved": dict(opt.ledger.bytes)}
    except Exception as exc:  # reported, not raised
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def check_coalesced(cfg: bench.Config, device: torch.device, steps: int) -> dict[str, Any]:
    """``flatview.optim.Coalesced`` (runs of adjacent views stepped as one tensor) against
    the same torch optimizer stepping each view, on two copies of one torch FSDP1 per-block
    model, same data and skips: on CUDA the foreach and fused kernels are the ones that
    run, and each must give the same parameters (``bitwise`` says whether exactly)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    import flatview.optim

    masks = bench.skip_masks(cfg, steps)
    batches = [(x.to(device), y.to(device)) for x, y in bench.make_batches(cfg, steps, 0)]
    results: dict[str, Any] = {}
    kinds: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
        "sgd_foreach": (torch.optim.SGD, {"lr": cfg.lr, "momentum": 0.9, "foreach": True}),
        "adamw_foreach": (torch.optim.AdamW, {"lr": 1e-3, "foreach": True}),
        "adamw_fused": (torch.optim.AdamW, {"lr": 1e-3, "fused": True}),
    }
    for name, (kind, options) in kinds.items():
        try:
            trained = []
            for coalesced in (False, True):
                model = TorchFSDP(
                    bench.make_net(cfg).to(device),
                    auto_wrap_policy=ModuleWrapPolicy({bench.Block}),
                    device_id=device,
                )
                fv = flatview.wrap(model)
                opt = (
                    flatview.optim.Coalesced(kind, fv.parameters(), **options)
                    if coalesced
                    else kind(fv.parameters(), **options)
                )
                for (x, y), skip in zip(batches, masks, strict=True):
                    _step(model, fv, opt, x, y, skip)
                trained.append({n: p.detach().clone() for n, p in fv.named_parameters()})
            if device.type == "cuda":
                torch.cuda.synchronize()
            plain, got = trained
            worst = max(float((got[n] - p).abs().max()) for n, p in plain.items() if p.numel())
            results[name] = {"ok": worst <= 1e-6, "max_abs_diff": worst, "bitwise": worst == 0}
        except Exception as exc:  # reported, not raised
            results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return results


# ======================================================================================
# Frameworks (issue #23): flatview where users train, through Lightning and accelerate.
#
# What needs a GPU runs here: Lightning's FSDPStrategy (FlatViewFSDPStrategy: torch
# builds no FSDP without a device on CPU), Fabric's FSDPStrategy (refused on CPU), and
# accelerate's FSDP plugins (which on CPU silently become DDP, and flatview refuses
# that), each with flatview against the same training without any wrapper; plus the
# Trainer's DDP with manual optimization on CUDA streams. The CPU suite covers the rest
# (tests/test_integrations.py). On CPU, or without the frameworks, every check here
# reports "skipped"; a check that ran and differs, or raised, fails the script.
# ======================================================================================

FRAMEWORK_CLIP = 1.0
"""Gradient clipping by total norm in the framework checks (where each framework
would clip)."""


def _framework_groups(net: nn.Module) -> list[dict[str, Any]]:
    """One optimizer's groups per submodule: the idiom the integrations exist for."""
    return [
        {"params": list(net.blocks.parameters()), "momentum": 0.9},  # type: ignore[union-attr]
        {"params": list(net.head.parameters())},  # type: ignore[union-attr]
    ]


def _framework_data(
    cfg: bench.Config, device: torch.device, steps: int
) -> tuple[list[list[int]], list[tuple[torch.Tensor, torch.Tensor]]]:
    masks = bench.skip_masks(cfg, steps)
    batches = [(x.to(device), y.to(device)) for x, y in bench.make_batches(cfg, steps, 0)]
    return masks, batches


def _framework_reference(
    cfg: bench.Config, device: torch.device, steps: int, clip: bool
) -> dict[str, torch.Tensor]:
    masks, batches = _framework_data(cfg, device, steps)
    net = bench.make_net(cfg).to(device)
    opt = torch.optim.SGD(_framework_groups(net), lr=cfg.lr)
    for (x, y), skip in zip(batches, masks, strict=True):
        F.cross_entropy(net(x, skip), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(list(net.parameters()), FRAMEWORK_CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in net.named_parameters()}


@contextlib.contextmanager
def _launched() -> Iterator[str]:
    """What a launcher sets for rank 0 of 1 (the process group is up already), and a
    directory to work in; restored and removed afterwards."""
    import shutil
    import tempfile

    saved = dict(os.environ)
    os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    tmp = tempfile.mkdtemp(prefix="gpu_smoke_frameworks_")
    try:
        yield tmp
    finally:
        os.environ.clear()
        os.environ.update(saved)
        shutil.rmtree(tmp, ignore_errors=True)


def _full_params(model: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    if isinstance(model, TorchFSDP):
        config = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
        with TorchFSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            state = model.state_dict()
    else:
        state = {
            n: p.full_tensor() if hasattr(p, "full_tensor") else p
            for n, p in model.named_parameters()
        }
    return {n.removeprefix(prefix): t.detach() for n, t in state.items() if n.startswith(prefix)}


def _lightning_trainer(
    cfg: bench.Config, device: torch.device, steps: int, strategy: str
) -> dict[str, torch.Tensor]:
    """FlatViewCallback on the Trainer: FlatViewFSDPStrategy (flat parameters, views in
    configure_optimizers, Lightning's clipping routed), or DDP with manual optimization."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from flatview.integrations.lightning import FlatViewCallback, FlatViewFSDPStrategy

    masks, batches = _framework_data(cfg, device, steps)
    manual = strategy == "ddp"

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = bench.make_net(cfg)
            self.automatic_optimization = not manual

        def forward(self, x: torch.Tensor, skip: list[int]) -> torch.Tensor:
            out: torch.Tensor = self.net(x, skip)
            return out

        def training_step(self, batch: Any, index: int) -> Any:
            x, y = batches[index]
            loss = F.cross_entropy(self(x, masks[index]), y)
            if not manual:
                return loss
            opt = self.optimizers()
            opt.zero_grad()  # type: ignore[union-attr]
            self.manual_backward(loss)
            opt.step()  # type: ignore[union-attr]
            return None

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(_framework_groups(self.net), lr=cfg.lr)

    with _launched() as tmp:
        chosen: Any = (
            "ddp"
            if manual
            else FlatViewFSDPStrategy(use_orig_params=False, auto_wrap_policy={bench.Block})
        )
        lit = Lit()
        trainer = pl.Trainer(
            accelerator="gpu" if device.type == "cuda" else "cpu",
            devices=1,
            strategy=chosen,
            max_epochs=1,
            gradient_clip_val=None if manual else FRAMEWORK_CLIP,
            callbacks=[
                FlatViewCallback(skip=lambda m, b, i: [f"net.blocks.{j}" for j in masks[i]])
            ],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
            num_sanity_val_steps=0,
            default_root_dir=tmp,
        )
        trainer.fit(lit, DataLoader(list(range(steps)), batch_size=None))
        return _full_params(trainer.strategy.model if not manual else lit, "net.")


def _fabric_fsdp1(cfg: bench.Config, device: torch.device, steps: int) -> dict[str, torch.Tensor]:
    """flatview.wrap(fabric.setup_module(net)) under FSDPStrategy(use_orig_params=False),
    optimizers over views through flatview's setup_optimizers."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import FSDPStrategy

    from flatview.integrations.lightning import setup_optimizers

    masks, batches = _framework_data(cfg, device, steps)
    with _launched():
        fabric = Fabric(
            accelerator=device.type,
            devices=1,
            strategy=FSDPStrategy(use_orig_params=False, auto_wrap_policy={bench.Block}),
        )
        fabric.launch()
        net = bench.make_net(cfg)
        model = fabric.setup_module(net)
        fv = flatview.wrap(model)
        opt = setup_optimizers(fabric, fv, torch.optim.SGD(_framework_groups(net), lr=cfg.lr))
        for (x, y), skip in zip(batches, masks, strict=True):
            with fv.step(skip=[f"blocks.{i}" for i in skip]):
                fabric.backward(F.cross_entropy(model(x, skip), y))
            fabric.clip_gradients(model, opt, max_norm=FRAMEWORK_CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return _full_params(model._forward_module)


def _accelerate_fsdp(
    cfg: bench.Config, device: torch.device, steps: int, version: int
) -> dict[str, torch.Tensor]:
    """flatview.integrations.accelerate.prepare under either FSDP plugin, with
    accelerator.clip_grad_norm_ over the optimizer's parameters."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import FullyShardedDataParallelPlugin

    from flatview.integrations.accelerate import prepare

    masks, batches = _framework_data(cfg, device, steps)
    with _launched():
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=version, **({"use_orig_params": False} if version == 1 else {})
        )
        try:
            accelerator = Accelerator(fsdp_plugin=plugin, cpu=device.type != "cuda")
            net = bench.make_net(cfg)
            model, fv, (opt,) = prepare(
                accelerator, net, lambda m: torch.optim.SGD(_framework_groups(m), lr=cfg.lr)
            )
            for (x, y), skip in zip(batches, masks, strict=True):
                with fv.step(skip=[f"blocks.{i}" for i in skip]):
                    accelerator.backward(F.cross_entropy(model(x, skip), y))
                params = [p for group in opt.param_groups for p in group["params"]]
                accelerator.clip_grad_norm_(params, FRAMEWORK_CLIP)
                opt.step()
                opt.zero_grad(set_to_none=True)
            return _full_params(model)
        finally:
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()


class _TrainerNet(nn.Module):
    """The benchmark's net as a Hugging Face ``Trainer`` takes one: inputs by keyword,
    the loss out; the step index in the inputs says which blocks it skips."""

    def __init__(self, cfg: bench.Config, masks: list[list[int]]) -> None:
        super().__init__()
        self.net = bench.make_net(cfg)
        self.masks = masks

    def forward(
        self, x: torch.Tensor, labels: torch.Tensor, step: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        skip = self.masks[int(step[0])]
        return {"loss": F.cross_entropy(self.net(x, skip), labels)}


def _hf_trainer_reference(
    cfg: bench.Config, device: torch.device, steps: int
) -> dict[str, torch.Tensor]:
    """What the ``Trainer`` below does, written out: SGD over every parameter at a
    constant rate, clipped by the total norm."""
    masks, batches = _framework_data(cfg, device, steps)
    net = bench.make_net(cfg).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=cfg.lr)
    for (x, y), skip in zip(batches, masks, strict=True):
        F.cross_entropy(net(x, skip), y).backward()
        torch.nn.utils.clip_grad_norm_(list(net.parameters()), FRAMEWORK_CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {f"net.{n}": p.detach().clone() for n, p in net.named_parameters()}


def _fsdp_arguments(version: int, orig: bool = True) -> dict[str, Any]:
    """``TrainingArguments`` of accelerate's FSDP plugin (version 1 or 2), a unit per block."""
    config = {
        "version": version,
        "transformer_layer_cls_to_wrap": ["Block"],
        **({"use_orig_params": orig} if version == 1 else {}),
    }
    return {"fsdp": True, "fsdp_config": config}


def _deepspeed_arguments(stage: int) -> dict[str, Any]:
    """``TrainingArguments`` of DeepSpeed ZeRO ``stage``, the rest filled by the Trainer."""
    auto = ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps")
    config = {"zero_optimization": {"stage": stage}, "gradient_clipping": "auto"}
    return {"deepspeed": {**config, **dict.fromkeys(auto, "auto")}}


def _hf_trainer(
    cfg: bench.Config, device: torch.device, steps: int, backend: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """flatview.integrations.hf_trainer.attach on a Hugging Face Trainer under ``backend``
    (:func:`_fsdp_arguments` or :func:`_deepspeed_arguments`), skipping the benchmark's
    blocks."""
    from accelerate.state import AcceleratorState, GradientState
    from transformers import Trainer, TrainingArguments

    from flatview.integrations.hf_trainer import attach

    masks, batches = _framework_data(cfg, torch.device("cpu"), steps)
    rows = [
        {"x": x[i], "labels": y[i], "step": torch.tensor(step)}
        for step, (x, y) in enumerate(batches)
        for i in range(len(y))
    ]
    with _launched() as tmp:
        args = TrainingArguments(
            output_dir=tmp,
            per_device_train_batch_size=cfg.batch,
            learning_rate=cfg.lr,
            optim="sgd",
            weight_decay=0.0,
            lr_scheduler_type="constant",
            max_grad_norm=FRAMEWORK_CLIP,
            num_train_epochs=1,
            train_sampling_strategy="sequential",
            remove_unused_columns=False,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            **backend,
        )
        try:
            trainer = Trainer(model=_TrainerNet(cfg, masks), args=args, train_dataset=rows)
            attached = attach(
                trainer,
                skip=lambda model, inputs: [
                    f"net.blocks.{i}" for i in masks[int(inputs["step"][0])]
                ],
            )
            trainer.train()
            attached.remove()
            if not trainer.is_deepspeed_enabled:
                return _full_params(trainer.model)
            from deepspeed.utils import safe_get_full_fp32_param

            attached.fv.unwrap()  # DeepSpeed's own parameters again: read its fp32 masters
            return {
                n: safe_get_full_fp32_param(p).detach() for n, p in trainer.model.named_parameters()
            }
        finally:
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()


def check_frameworks(cfg: bench.Config, device: torch.device, steps: int) -> dict[str, Any]:
    """Each framework path that needs a GPU, against the plain model."""
    # clip: the reference of the framework checks with or without clipping; None: the
    # Trainer's (its SGD over every parameter, clipped).
    checks: dict[str, tuple[str, Callable[[], dict[str, torch.Tensor]], bool | None]] = {
        "lightning_trainer_flatview_fsdp1_clip": (
            "lightning",
            lambda: _lightning_trainer(cfg, device, steps, "fsdp1"),
            True,
        ),
        "lightning_trainer_ddp_manual": (
            "lightning",
            lambda: _lightning_trainer(cfg, device, steps, "ddp"),
            False,
        ),
        "fabric_fsdp1_flat_views": ("lightning", lambda: _fabric_fsdp1(cfg, device, steps), True),
        "accelerate_fsdp1": ("accelerate", lambda: _accelerate_fsdp(cfg, device, steps, 1), True),
        "accelerate_fsdp2": ("accelerate", lambda: _accelerate_fsdp(cfg, device, steps, 2), True),
        "hf_trainer_fsdp2": (
            "transformers",
            lambda: _hf_trainer(cfg, device, steps, _fsdp_arguments(2)),
            None,
        ),
        "hf_trainer_fsdp1_flat_views": (
            "transformers",
            lambda: _hf_trainer(cfg, device, steps, _fsdp_arguments(1, orig=False)),
            None,
        ),
        "hf_trainer_fsdp1_orig": (
            "transformers",
            lambda: _hf_trainer(cfg, device, steps, _fsdp_arguments(1)),
            None,
        ),
        "hf_trainer_deepspeed_zero2": (
            "deepspeed",
            lambda: _hf_trainer(cfg, device, steps, _deepspeed_arguments(2)),
            None,
        ),
        "hf_trainer_deepspeed_zero3": (
            "deepspeed",
            lambda: _hf_trainer(cfg, device, steps, _deepspeed_arguments(3)),
            None,
        ),
    }
    import importlib.util

    results: dict[str, Any] = {}
    for name, (package, run, clip) in checks.items():
        if device.type != "cuda":
            results[name] = {"ok": True, "skipped": "needs CUDA"}
            continue
        if importlib.util.find_spec(package) is None:
            results[name] = {"ok": True, "skipped": f"{package} is not installed"}
            continue
        try:
            got = run()
            if clip is None:
                want = _hf_trainer_reference(cfg, device, steps)
            else:
                want = _framework_reference(cfg, device, steps, clip)
            worst = max(float((got[n].reshape(-1) - want[n].reshape(-1)).abs().max()) for n in want)
            results[name] = {
                "ok": got.keys() == want.keys() and worst < 1e-4,
                "max_abs_diff": worst,
            }
        except Exception as exc:  # reported, not raised: the other checks still run
            results[name] = {
                "ok": False,
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(limit=-4),
            }
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=6, help="steps of the equivalence check")
    parser.add_argument("--timed-steps", type=int, default=30)
    parser.add_argument("--out", default="results/gpu_smoke.json")
    args = parser.parse_args(argv)
    device = start_one_process()
    cuda = device.type == "cuda"
    cfg = bench.Config(blocks=args.blocks, width=args.width, world_size=1)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "backend": dist.get_backend(),
    }
    try:
        report["equivalence"] = check_equivalence(cfg, device, args.steps)
        report["equivalence"]["torch_fsdp1_bf16_vs_plain"] = check_mixed_precision(
            cfg, device, args.steps
        )
        report["equivalence"]["whole_muon_torch_fsdp1"] = check_whole_muon(cfg, device, args.steps)
        for name, found in check_evaluation_before_step(cfg, device, args.steps).items():
            report["equivalence"][f"evaluation_before_step_{name}"] = found
        for kind, found in check_coalesced(cfg, device, args.steps).items():
            report["equivalence"][f"coalesced_{kind}_torch_fsdp1"] = found
        for name, found in check_cast_after_wrap(cfg, device, args.steps).items():
            report["equivalence"][f"cast_after_wrap_{name}"] = found
        for hook, found in check_ddp_comm_hooks(cfg, device, args.steps).items():
            report["equivalence"][f"ddp_{hook}"] = found
        for label, hsdp, mixed in [
            ("fsdp2_hsdp_all_reduce_window", True, False),
            ("fsdp2_bf16_accumulation", False, True),
            ("fsdp2_hsdp_bf16_all_reduce_window", True, True),
        ]:
            found = check_fsdp2_accumulation(cfg, device, args.steps, hsdp, mixed)
            report["equivalence"][label] = found
        report["agreement_readback"] = check_agreement_readback(device)
        report["frameworks"] = check_frameworks(cfg, device, args.steps)
        report["timing_ms"] = time_ddp(cfg, device, args.timed_steps)
    finally:
        dist.destroy_process_group()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    ok = all(r["ok"] for r in report["equivalence"].values())
    ok = ok and all(r["ok"] for r in report["frameworks"].values())
    return 0 if ok and report["agreement_readback"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
