"""Views at real model scale: what flatview costs per step, per parameter tensor.

Models of many tiny parameter tensors (``Linear(8, 8)``: compute is negligible, so the
per-tensor bookkeeping of the wrapper and of flatview is what a step costs), in
``--blocks`` blocks, each block one wrapper unit:

* *dense*: each block a residual stack of ``Linear(8, 8)`` layers (a weight and a bias
  each), at 64, 256, 1,024, 4,096 and 16,384 parameter tensors;
* *moe*: each block a router ``Linear(8, E)`` and ``E`` experts of two bias-free
  ``Linear(8, 8)`` each (mixture-of-experts shaped), at 1,024 and 16,384 tensors.

Every backend (fairscale FSDP via :func:`flatview.testing.fairscale_on_cpu`, torch FSDP1
``use_orig_params=False``, FSDP2, DDP, DeepSpeed ZeRO 2 via
:func:`flatview.testing.deepspeed_on_cpu`, its engine's own SGD over the views, stepped
by ``engine.step()``) trains the model bare and wrapped by flatview,
built side by side in the same processes (``--world-size`` CPU processes over gloo),
their steps interleaved (the order rotates every step), so that the load of a shared
machine falls on both alike; torch FSDP1 also runs bare with ``use_orig_params=True``,
what torch charges for its own views. Two modes, in the same processes: nothing skipped,
and half skipped (half of every block's layers or experts, drawn per step from a family
of four patterns, the same on every rank; the bare wrapper runs the same model with the
same layers left out; bare DDP then needs ``find_unused_parameters=True``).

Per variant and step, rank 0 times the forward + backward (flatview's ``step()`` context
included) and the optimizer step + ``zero_grad`` (SGD, momentum, ``foreach=True``; FSDP2
beyond 4,096 tensors ``foreach=False``, see ``FOREACH_DTENSORS``) apart. Reported per
size: the medians, flatview's extra over bare (median of per-step differences) per
tensor, the ratios of whole steps; per backend, the slope of a
least-squares line through the forward + backward extra over 256-4,096 tensors (µs per
tensor); wrap time, ``optim_state_dict`` time and resident memory added by the wrap, per
tensor. A second study (``--optim-world-size`` processes, torch FSDP1, dense 4,096): the
optimizer step over every view, over only this rank's non-empty views, over every view
through ``flatview.optim.Coalesced`` and over the wrapper's flat parameters, foreach and
fused, interleaved.

    python benchmarks/bench_scale.py [--quick] [--only fairscale,ddp] [--sizes 64,256]
    python benchmarks/bench_scale.py --optim-only     # the optimizer study alone

Results go to ``results/scale/`` (markdown, JSON, PNG). See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import bench_skip as common  # process plumbing shared with bench_skip.py

WIDTH = 8
BACKENDS = ("fairscale", "torch", "fsdp2", "ddp", "deepspeed")
DEEPSPEED_STAGE = 2
"""The ZeRO stage of the ``deepspeed`` backend (the one DeepSpeed users run most: ZeRO 3's
per-parameter all-gathers make its step a different study)."""
FIT_RANGE = (256, 4096)
"""Sizes the per-tensor slope is fitted over (the issue's range)."""


@dataclass(frozen=True)
class Config:
    blocks: int = 8
    dense_sizes: tuple[int, ...] = (64, 256, 1024, 4096, 16384)
    moe_sizes: tuple[int, ...] = (1024, 16384)
    backends: tuple[str, ...] = BACKENDS
    batch: int = 4
    steps: int = 12
    """Timed steps per variant, per mode."""
    warmup: int = 3
    world_size: int = 2
    optim_world_size: int = 4
    optim_size: int = 4096
    optim_steps: int = 20
    seed: int = 0
    lr: float = 0.01
    timeout: float = 900.0
    """Seconds one run (one backend, one model, both modes) may take."""
    coalesced: bool = True
    """Also time flatview with its views stepped by ``flatview.optim.Coalesced``."""


# ------------------------------------------------------------------------------ models


class Stack(nn.Module):
    """One block of the dense model: ``layers`` residual ``Linear(8, 8)`` layers."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(layers))

    def forward(self, x: torch.Tensor, skip: frozenset[int]) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            if index not in skip:
                x = x + 0.5 * torch.tanh(layer(x))
        return x


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(WIDTH, WIDTH, bias=False)
        self.w2 = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(x)))  # type: ignore[no-any-return]


class MoE(nn.Module):
    """One block of the mixture-of-experts model: a router and ``experts`` experts, every
    expert that the step does not skip weighted by its gate."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(WIDTH, experts)
        self.experts = nn.ModuleList(Expert() for _ in range(experts))

    def forward(self, x: torch.Tensor, skip: frozenset[int]) -> torch.Tensor:
        gates = torch.softmax(self.router(x), dim=-1)
        out = x
        for index, expert in enumerate(self.experts):
            if index not in skip:
                out = out + gates[:, index : index + 1] * expert(x)
        return out


class Net(nn.Module):
    def __init__(self, shape: str, size: int, blocks: int) -> None:
        super().__init__()
        per_block = size // blocks
        if shape == "dense":
            made: list[nn.Module] = [Stack(per_block // 2) for _ in range(blocks)]
        else:
            made = [MoE((per_block - 2) // 2) for _ in range(blocks)]
        self.blocks = nn.ModuleList(made)

    def forward(self, x: torch.Tensor, skip: Sequence[frozenset[int]]) -> torch.Tensor:
        for block, skipped in zip(self.blocks, skip, strict=True):
            x = block(x, skipped)
        return x.pow(2).mean()


def block_class(shape: str) -> type[nn.Module]:
    return Stack if shape == "dense" else MoE


def make_net(cfg: Config, shape: str, size: int) -> Net:
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank and variant
    return Net(shape, size, cfg.blocks)


@dataclass(frozen=True)
class Plan:
    """A step's skip set twice: per block the layer indices (for the model) and the
    module names (for flatview), one object per pattern (skip sets repeat)."""

    per_block: tuple[frozenset[int], ...]
    names: tuple[str, ...]


def skip_plans(cfg: Config, shape: str, size: int, steps: int, half: bool) -> list[Plan]:
    """Per step, a pattern drawn from a family of four (the same on every rank): half of
    every block's layers (dense) or experts (moe) skipped; nothing when not ``half``."""
    per_block = size // cfg.blocks
    count = per_block // 2 if shape == "dense" else (per_block - 2) // 2
    child = "layers" if shape == "dense" else "experts"
    if not half:
        empty = Plan(tuple(frozenset() for _ in range(cfg.blocks)), ())
        return [empty] * steps
    generator = torch.Generator().manual_seed(cfg.seed + 7)
    family = []
    for _ in range(4):
        chosen = [
            frozenset(int(i) for i in torch.randperm(count, generator=generator)[: count // 2])
            for _ in range(cfg.blocks)
        ]
        names = tuple(
            f"blocks.{b}.{child}.{i}" for b, skipped in enumerate(chosen) for i in sorted(skipped)
        )
        family.append(Plan(tuple(chosen), names))
    draws = torch.randint(0, len(family), (steps,), generator=generator).tolist()
    return [family[d] for d in draws]


# ---------------------------------------------------------------------------- variants


@dataclass
class Variant:
    """One way of training the model, built on one rank."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    fv: Any = None
    wrap_s: float = 0.0
    wrap_rss_mib: float = 0.0

    def forward_backward(self, x: torch.Tensor, plan: Plan) -> None:
        if self.fv is None:
            self.model(x, plan.per_block).backward()
            return
        with self.fv.step(skip=plan.names):
            self.model(x, plan.per_block).backward()

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class EngineVariant(Variant):
    """A DeepSpeed engine: its own backward and ``step()`` (which steps the optimizer it
    was built with and drops the gradients)."""

    def forward_backward(self, x: torch.Tensor, plan: Plan) -> None:
        engine = self.model
        if self.fv is None:
            engine.backward(engine(x, plan.per_block))
            return
        with self.fv.step(skip=plan.names):
            engine.backward(engine(x, plan.per_block))

    def optimizer_step(self) -> None:
        self.model.step()


def _engine(cfg: Config, shape: str, size: int) -> tuple[Any, torch.optim.Optimizer]:
    """The model in a DeepSpeed engine at ``DEEPSPEED_STAGE``, with SGD (``foreach``)."""
    import deepspeed

    net = make_net(cfg, shape, size)
    optimizer = _optimizer("sgd", net.parameters(), cfg, foreach=True)
    config = {
        "train_micro_batch_size_per_gpu": cfg.batch,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": DEEPSPEED_STAGE},
    }
    engine, *_ = deepspeed.initialize(model=net, optimizer=optimizer, config=config)
    return engine, optimizer


FOREACH_DTENSORS = 4096
"""Above this many tensors FSDP2's variants step with ``foreach=False``: in torch 2.13 the
first two steps of ``foreach`` SGD over DTensors (cold sharding-propagation cache: before
and after the momentum buffers exist) take time growing with the square of their number
(one process, N ``8x8`` DTensors: 0.37 and 0.16 s at 256, 12.7 and 11.3 s at 2,048; later
steps 52-56 ms), bare and with flatview alike: at 16,384 tensors some 13 minutes each,
and the second is a timed step there (one warm-up step)."""


def _foreach(backend: str, size: int) -> bool:
    return not (backend == "fsdp2" and size > FOREACH_DTENSORS)


def _optimizer(
    kind: str, params: Iterable[nn.Parameter], cfg: Config, coalesced: bool = False, **options: Any
) -> Any:
    """Every optimizer the benchmark steps: SGD momentum or AdamW, plain or ``Coalesced``."""
    import flatview.optim

    cls, hyper = (
        (torch.optim.SGD, {"lr": cfg.lr, "momentum": 0.9})
        if kind == "sgd"
        else (torch.optim.AdamW, {"lr": 1e-4})
    )
    if coalesced:
        return flatview.optim.Coalesced(cls, params, **hyper, **options)
    return cls(params, **hyper, **options)


def _wrapped(cfg: Config, shape: str, size: int, backend: str, **options: Any) -> nn.Module:
    """The model in ``backend``'s wrapper, one unit per block (DDP: one for all)."""
    net = make_net(cfg, shape, size)
    if backend == "fairscale":
        from fairscale.nn import FullyShardedDataParallel as FSDP

        for index, block in enumerate(net.blocks):
            net.blocks[index] = FSDP(block, flatten_parameters=True)
        return FSDP(net, flatten_parameters=True)
    if backend == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FSDP(
            net,
            auto_wrap_policy=ModuleWrapPolicy({block_class(shape)}),
            use_orig_params=options.get("use_orig_params", False),
            device_id=torch.device("cpu"),
        )
    if backend == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in net.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(net, mesh=mesh)
        return net
    if backend == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(net, find_unused_parameters=options.get("find_unused", False))
    raise ValueError(backend)


def _bare(name: str, cfg: Config, shape: str, size: int, backend: str, **options: Any) -> Variant:
    if backend == "deepspeed":
        return EngineVariant(name, *_engine(cfg, shape, size))
    model = _wrapped(cfg, shape, size, backend, **options)
    optimizer = _optimizer("sgd", model.parameters(), cfg, foreach=_foreach(backend, size))
    return Variant(name, model, optimizer)


def _flatview(
    cfg: Config, shape: str, size: int, backend: str, *, coalesced: bool = False
) -> Variant:
    """flatview on the wrapper, its views stepped by ``torch.optim.SGD`` or (``coalesced``)
    by ``flatview.optim.Coalesced`` over the same SGD."""
    import flatview

    engine_optimizer = None
    if backend == "deepspeed":
        model, engine_optimizer = _engine(cfg, shape, size)
    else:
        model = _wrapped(cfg, shape, size, backend)
    before = common._resident_mib()
    started = time.perf_counter()
    fv = flatview.wrap(model)
    wrap_s = time.perf_counter() - started
    rss = common._resident_mib() - before
    if engine_optimizer is not None:  # the engine's own, pointed at the views by the wrap
        return EngineVariant("flatview", model, engine_optimizer, fv, wrap_s, rss)
    foreach = _foreach(backend, size)
    optimizer = _optimizer("sgd", fv.parameters(), cfg, coalesced=coalesced, foreach=foreach)
    return Variant("coalesced" if coalesced else "flatview", model, optimizer, fv, wrap_s, rss)


def build_variants(cfg: Config, shape: str, size: int, backend: str) -> dict[str, list[Variant]]:
    """Per mode, the variants built side by side: bare first, then flatview (and flatview
    stepped by ``Coalesced``); torch FSDP1 adds bare ``use_orig_params=True``. Built once
    for both modes, except bare DDP, which needs ``find_unused_parameters=True`` to skip
    anything."""
    bare = _bare("bare", cfg, shape, size, backend)
    variants = [bare, _flatview(cfg, shape, size, backend)]
    if cfg.coalesced and backend != "deepspeed":  # the engine steps the optimizer it has
        variants.append(_flatview(cfg, shape, size, backend, coalesced=True))
    if backend == "torch":
        variants.append(_bare("orig_params", cfg, shape, size, backend, use_orig_params=True))
    half = list(variants)
    if backend == "ddp":
        half[0] = _bare("bare", cfg, shape, size, backend, find_unused=True)
    return {"none": variants, "half": half}


SMALL_STEPS = 4
"""At up to 1,024 tensors a step takes tens of milliseconds, where the other processes'
scheduling moves one step by as much as flatview costs in all: this many times the timed
steps there, for ratios as steady as at 4,096."""


def steps_for(cfg: Config, size: int) -> tuple[int, int]:
    """(warmup, timed) steps at ``size`` tensors: more at up to 1,024 (``SMALL_STEPS``),
    fewer beyond 4,096, where one step of bare FSDP2 takes seconds on a loaded 2-core
    machine."""
    if size <= 1024:
        return cfg.warmup, cfg.steps * SMALL_STEPS
    if size <= 4096:
        return cfg.warmup, cfg.steps
    return max(1, cfg.warmup // 2), max(4, cfg.steps // 3)


# ----------------------------------------------------------------------------- workers


def _timed(
    variants: Sequence[Variant], warmup: int, plans: Sequence[Plan], rank: int, cfg: Config
) -> dict:
    """Steps of every variant, interleaved; rank 0's forward+backward and optimizer
    times per step (ms), after ``warmup`` steps."""
    generator = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
    inputs = [torch.randn(cfg.batch, WIDTH, generator=generator) for _ in plans]
    times: dict[str, dict[str, list[float]]] = {
        v.name: {"fb": [], "opt": [], "fb_cpu": [], "opt_cpu": []} for v in variants
    }
    gc.collect()
    gc.freeze()  # what the build made lives on: not rescanned by every collection
    for step, (x, plan) in enumerate(zip(inputs, plans, strict=True)):
        shift = step % len(variants)
        order = list(variants[shift:]) + list(variants[:shift])
        if step % 2:
            order.reverse()
        for variant in order:
            c0, t0 = time.process_time(), time.perf_counter()
            variant.forward_backward(x, plan)
            c1, t1 = time.process_time(), time.perf_counter()
            variant.optimizer_step()
            c2, t2 = time.process_time(), time.perf_counter()
            if step >= warmup:
                kept = times[variant.name]
                kept["fb"].append((t1 - t0) * 1e3)
                kept["opt"].append((t2 - t1) * 1e3)
                kept["fb_cpu"].append((c1 - c0) * 1e3)
                kept["opt_cpu"].append((c2 - c1) * 1e3)
    gc.unfreeze()
    return times


@contextlib.contextmanager
def _reported(rank: int, result: dict[str, Any], out: str) -> Iterator[None]:
    """A worker's body: ``result`` gets status ok (every rank got there) or crashed with
    the error, rank 0 writes it to ``out``, and the process group ends either way."""
    try:
        yield
        result["status"] = "ok"
        dist.barrier()
    except Exception as exc:
        result.update(
            status="crashed",
            error=f"{type(exc).__name__}: {exc}",
            traceback=traceback.format_exc(limit=-8),
        )
    finally:
        if rank == 0:
            Path(out).write_text(json.dumps(result))
        dist.destroy_process_group()


def scale_worker(
    rank: int, backend: str, shape: str, size: int, cfg: Config, port: int, out: str
) -> None:
    """One backend, one model: the variants built side by side, then both modes."""
    common._init(rank, cfg, port, out)  # type: ignore[arg-type]
    result: dict[str, Any] = {"backend": backend, "shape": shape, "size": size, "modes": {}}
    with _reported(rank, result, out):
        context = common._runtime(backend == "fairscale", backend == "deepspeed")
        with context:
            built = build_variants(cfg, shape, size, backend)
            warmup, steps = steps_for(cfg, size)
            for mode, variants in built.items():
                plans = skip_plans(cfg, shape, size, warmup + steps, mode == "half")
                fv_variant = next(v for v in variants if v.fv is not None)
                tensors = sum(1 for _ in fv_variant.fv.parameters())
                times = _timed(variants, warmup, plans, rank, cfg)
                started = time.perf_counter()
                fv_variant.fv.optim_state_dict(fv_variant.optimizer)
                state_s = time.perf_counter() - started
                result["modes"][mode] = {
                    "tensors": tensors,
                    "times": times,
                    "wrap_s": fv_variant.wrap_s,
                    "wrap_rss_mib": fv_variant.wrap_rss_mib,
                    "optim_state_dict_s": state_s,
                }
                del variants, fv_variant


OPTIMIZERS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("SGD foreach", "sgd", {"foreach": True}),
    ("SGD fused", "sgd", {"fused": True}),
    ("AdamW foreach", "adamw", {"foreach": True}),
    ("AdamW fused", "adamw", {"fused": True}),
)
TARGETS = ("flat parameters", "views, all", "views, non-empty", "Coalesced, all views")
"""What each optimizer steps: stand-ins of the wrapper's flat parameters, every view,
this rank's non-empty views, and every view through ``flatview.optim.Coalesced``."""
COALESCED = "Coalesced, all views"


def optim_worker(rank: int, cfg: Config, port: int, out: str) -> None:
    """torch FSDP1 + flatview, dense model: the optimizer step over each target, timed
    interleaved after one backward per step (every target steps the same gradients)."""
    import flatview

    common._init(rank, cfg, port, out)  # type: ignore[arg-type]
    result: dict[str, Any] = {"world_size": dist.get_world_size(), "size": cfg.optim_size}
    with _reported(rank, result, out):
        model = _wrapped(cfg, "dense", cfg.optim_size, "torch")
        # Stand-ins of the wrapper's flat parameters (same shapes; flatview refuses an
        # optimizer over the flat parameters themselves), with gradients kept throughout.
        flats = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
        for flat in flats:
            flat.grad = torch.zeros_like(flat)
        fv = flatview.wrap(model)
        views = list(fv.parameters())
        targets = {
            "flat parameters": flats,
            "views, all": views,
            "views, non-empty": [p for p in views if p.numel()],
            COALESCED: views,
        }
        result["counts"] = {k: len(v) for k, v in targets.items()}
        plans = skip_plans(cfg, "dense", cfg.optim_size, 1, False)
        x = torch.randn(cfg.batch, WIDTH)
        optimizers = [
            (
                f"{label} | {target}",
                _optimizer(kind, params, cfg, coalesced=target == COALESCED, **options),
            )
            for label, kind, options in OPTIMIZERS
            for target, params in targets.items()
        ]
        times: dict[str, list[float]] = {name: [] for name, _ in optimizers}
        cpu: dict[str, list[float]] = {name: [] for name, _ in optimizers}
        gc.collect()
        gc.freeze()
        for step in range(cfg.warmup + cfg.optim_steps):
            with fv.step():
                model(x, plans[0].per_block).backward()
            shift = step % len(optimizers)
            order = optimizers[shift:] + optimizers[:shift]
            if step % 2:
                order.reverse()
            for name, optimizer in order:
                c0, t0 = time.process_time(), time.perf_counter()
                optimizer.step()
                if step >= cfg.warmup:
                    times[name].append((time.perf_counter() - t0) * 1e3)
                    cpu[name].append((time.process_time() - c0) * 1e3)
            for p in views:
                p.grad = None
        gc.unfreeze()
        result["inner_tensors"] = {
            name: optimizer.stepped_tensors
            for name, optimizer in optimizers
            if name.endswith(COALESCED)
        }
        result.update(times=times, cpu=cpu)


# ------------------------------------------------------------------------------ summary


def _median_diff(b: Sequence[float], a: Sequence[float]) -> float:
    return statistics.median(y - x for x, y in zip(a, b, strict=True))


BOOTSTRAP = 1000
"""Resamples behind each 95% interval. On this 2-core machine one step's CPU time moves by
10-15% (the other rank runs on the sibling core), so a figure of a few µs per tensor is
only as good as its interval: every extra, slope and ratio comes with one."""


def _interval(
    statistic: Callable[[Sequence[int]], float], steps: int, seed: int = 0
) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of ``statistic`` over ``BOOTSTRAP`` resamples of
    the step indices ``0 .. steps - 1`` with replacement (pairs stay pairs: a resampled
    step brings every variant's time of that step)."""
    rng = random.Random(seed)
    values = sorted(
        statistic([rng.randrange(steps) for _ in range(steps)]) for _ in range(BOOTSTRAP)
    )
    return values[int(0.025 * (BOOTSTRAP - 1))], values[int(0.975 * (BOOTSTRAP - 1))]


def _median_of(values: Sequence[float], scale: float) -> Callable[[Sequence[int]], float]:
    """The median of ``values`` over the chosen steps, times ``scale``."""
    return lambda chosen: statistics.median(values[i] for i in chosen) * scale


def _ratio(f: Sequence[float], b: Sequence[float]) -> Callable[[Sequence[int]], float]:
    """The ratio of medians of ``f`` and ``b`` over the chosen steps."""
    return lambda chosen: (
        statistics.median(f[i] for i in chosen) / statistics.median(b[i] for i in chosen)
    )


def _fit(points: Sequence[tuple[int, float]]) -> float | None:
    """Least-squares slope of ``y`` over ``x``."""
    if len(points) < 2:
        return None
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else None


@dataclass
class Row:
    clock: str
    """``cpu``: rank 0's process CPU time (what flatview's host work costs, robust to the
    load of other processes on a shared machine); ``wall``: wall clock."""
    backend: str
    shape: str
    size: int
    mode: str
    tensors: int
    bare_fb_ms: float
    fv_fb_ms: float
    bare_opt_ms: float
    fv_opt_ms: float
    extra_fb_us_per_tensor: float
    extra_opt_us_per_tensor: float
    step_ratio: float
    fb_diffs_us: list[float] = field(default_factory=list)
    """Per timed step, flatview's forward + backward minus bare's (the slope's intervals
    resample them)."""
    extra_fb_interval: tuple[float, float] | None = None
    step_ratio_interval: tuple[float, float] | None = None
    coalesced_step_ratio_interval: tuple[float, float] | None = None
    orig_fb_ms: float | None = None
    orig_extra_fb_us_per_tensor: float | None = None
    coalesced_opt_ms: float | None = None
    coalesced_step_ratio: float | None = None
    """Whole steps of flatview stepped by ``Coalesced`` over bare's."""
    wrap_s: float = 0.0
    wrap_rss_kib_per_tensor: float = 0.0
    optim_state_dict_s: float = 0.0
    notes: list[str] = field(default_factory=list)


def rows_of(result: dict[str, Any], clock: str) -> list[Row]:
    rows = []
    suffix = "_cpu" if clock == "cpu" else ""
    for mode, data in result.get("modes", {}).items():
        t = {
            name: {"fb": v["fb" + suffix], "opt": v["opt" + suffix]}
            for name, v in data["times"].items()
        }
        bare, fv = t["bare"], t["flatview"]
        n = data["tensors"]
        total_p = [a + b for a, b in zip(bare["fb"], bare["opt"], strict=True)]
        total_f = [a + b for a, b in zip(fv["fb"], fv["opt"], strict=True)]
        diffs = [(f - b) * 1e3 for f, b in zip(fv["fb"], bare["fb"], strict=True)]
        steps = len(diffs)
        row = Row(
            clock=clock,
            backend=result["backend"],
            shape=result["shape"],
            size=result["size"],
            mode=mode,
            tensors=n,
            bare_fb_ms=statistics.median(bare["fb"]),
            fv_fb_ms=statistics.median(fv["fb"]),
            bare_opt_ms=statistics.median(bare["opt"]),
            fv_opt_ms=statistics.median(fv["opt"]),
            extra_fb_us_per_tensor=_median_diff(fv["fb"], bare["fb"]) * 1e3 / n,
            extra_opt_us_per_tensor=_median_diff(fv["opt"], bare["opt"]) * 1e3 / n,
            step_ratio=statistics.median(total_f) / statistics.median(total_p),
            wrap_s=data["wrap_s"],
            wrap_rss_kib_per_tensor=data["wrap_rss_mib"] * 1024 / n,
            optim_state_dict_s=data["optim_state_dict_s"],
            fb_diffs_us=diffs,
            extra_fb_interval=_interval(_median_of(diffs, 1 / n), steps),
            step_ratio_interval=_interval(_ratio(total_f, total_p), steps),
        )
        if "coalesced" in t:
            co = t["coalesced"]
            total_c = [a + b for a, b in zip(co["fb"], co["opt"], strict=True)]
            row.coalesced_opt_ms = statistics.median(co["opt"])
            row.coalesced_step_ratio = statistics.median(total_c) / statistics.median(total_p)
            row.coalesced_step_ratio_interval = _interval(_ratio(total_c, total_p), steps)
        if "orig_params" in t:
            orig = t["orig_params"]
            row.orig_fb_ms = statistics.median(orig["fb"])
            row.orig_extra_fb_us_per_tensor = _median_diff(orig["fb"], bare["fb"]) * 1e3 / n
        rows.append(row)
    return rows


def slopes(
    rows: Sequence[Row],
) -> dict[tuple[str, str, str], dict[str, Any]]:
    """Per (clock, backend, mode): µs per tensor, the slope of the dense forward+backward
    extra (per step) over the fit range, with its 95% interval (each size's steps
    resampled on their own); also for torch's ``use_orig_params=True``."""
    found: dict[tuple[str, str, str], dict[str, Any]] = {}
    for key in sorted({(r.clock, r.backend, r.mode) for r in rows}):
        chosen = [
            r
            for r in rows
            if (r.clock, r.backend, r.mode) == key
            and r.shape == "dense"
            and FIT_RANGE[0] <= r.size <= FIT_RANGE[1]
        ]
        fv = _fit([(r.tensors, r.extra_fb_us_per_tensor * r.tensors) for r in chosen])
        interval = None
        if fv is not None and all(r.fb_diffs_us for r in chosen):
            rng = random.Random(1)
            fits = sorted(
                _fit(
                    [
                        (
                            r.tensors,
                            statistics.median(rng.choices(r.fb_diffs_us, k=len(r.fb_diffs_us))),
                        )
                        for r in chosen
                    ]
                )
                or 0.0
                for _ in range(BOOTSTRAP)
            )
            interval = (fits[int(0.025 * (BOOTSTRAP - 1))], fits[int(0.975 * (BOOTSTRAP - 1))])
        orig = _fit(
            [
                (r.tensors, r.orig_extra_fb_us_per_tensor * r.tensors)
                for r in chosen
                if r.orig_extra_fb_us_per_tensor is not None
            ]
        )
        found[key] = {"flatview": fv, "interval": interval, "orig_params": orig}
    return found


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _fi(value: float | None, interval: tuple[float, float] | None, spec: str) -> str:
    """``value`` with its 95% interval in brackets, where it has one."""
    if value is None or interval is None:
        return _f(value, spec)
    return f"{value:{spec}} [{interval[0]:{spec}}, {interval[1]:{spec}}]"


def _table(rows: Sequence[Row]) -> list[str]:
    lines = [
        "| backend | model | tensors | skipped | bare fb ms | flatview fb ms | "
        "extra fb µs/tensor | bare opt ms | flatview opt ms | extra opt µs/tensor | "
        "step ratio | Coalesced opt ms | step ratio, Coalesced | "
        "orig_params extra fb µs/tensor |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.backend} | {r.shape} | {r.tensors} | {r.mode} | {r.bare_fb_ms:.1f} | "
            f"{r.fv_fb_ms:.1f} | {_fi(r.extra_fb_us_per_tensor, r.extra_fb_interval, '.2f')} | "
            f"{r.bare_opt_ms:.2f} | {r.fv_opt_ms:.2f} | {r.extra_opt_us_per_tensor:.2f} | "
            f"{_fi(r.step_ratio, r.step_ratio_interval, '.3f')} | "
            f"{_f(r.coalesced_opt_ms, '.2f')} | "
            f"{_fi(r.coalesced_step_ratio, r.coalesced_step_ratio_interval, '.3f')} | "
            f"{_f(r.orig_extra_fb_us_per_tensor, '.2f')} |"
        )
    return lines


def markdown(
    rows: Sequence[Row],
    failures: Sequence[dict[str, Any]],
    optim: dict[str, Any] | None,
    cfg: Config,
    meta: dict[str, Any],
) -> str:
    lines = [
        f"# bench_scale: {cfg.world_size} processes (gloo), blocks of Linear({WIDTH}, {WIDTH}), "
        f"{cfg.blocks} units, batch {cfg.batch}, {cfg.steps} timed steps per variant and mode "
        f"after {cfg.warmup} ({cfg.steps * SMALL_STEPS} at up to 1,024 tensors, "
        f"{steps_for(cfg, 16384)[1]} beyond 4,096)",
        "",
        f"torch {meta['torch']}, Python {meta['python']}, {meta['cpus']} CPUs, load average "
        f"{meta['load_before']:.1f} before, {meta.get('load_after', 0):.1f} after; "
        f"{meta.get('wall_s', 0):.0f} s",
        "",
        "fb: forward + backward (flatview's step() included), opt: SGD momentum foreach "
        "step + zero_grad; ms are medians of rank 0's per-step times; extra: median of the "
        "per-step differences flatview - bare, per parameter tensor; step ratio: whole "
        "steps (fb + opt), flatview / bare; Coalesced: the same flatview, its views stepped "
        "by flatview.optim.Coalesced over the same SGD (a model of its own, interleaved "
        "alike); orig_params: torch FSDP1 use_orig_params=True over bare "
        "use_orig_params=False. In brackets: 95% bootstrap intervals over the timed steps "
        f"({BOOTSTRAP} resamples; pairs of steps kept together).",
    ]
    for clock, title in (
        ("cpu", "rank 0's CPU time (the host work a step costs)"),
        ("wall", "wall clock"),
    ):
        chosen = [r for r in rows if r.clock == clock]
        lines += ["", f"## {title}", "", *_table(chosen), ""]
        lines += [
            f"Slope of the forward + backward extra over {FIT_RANGE[0]}-{FIT_RANGE[1]} "
            "tensors (dense), µs per tensor:",
            "",
            "| backend | skipped | flatview | torch use_orig_params=True |",
            "|---|---|---:|---:|",
        ]
        for (c, backend, mode), fit in slopes(rows).items():
            if c == clock:
                lines.append(
                    f"| {backend} | {mode} | {_fi(fit['flatview'], fit['interval'], '.2f')} | "
                    f"{_f(fit['orig_params'], '.2f')} |"
                )
    lines += [
        "",
        "## wrapping, optimizer state, memory",
        "",
        "| backend | model | tensors | skipped | wrap s | wrap RSS KiB/tensor | "
        "optim_state_dict s |",
        "|---|---|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        if r.clock == "wall":
            lines.append(
                f"| {r.backend} | {r.shape} | {r.tensors} | {r.mode} | {r.wrap_s:.2f} | "
                f"{r.wrap_rss_kib_per_tensor:.2f} | {r.optim_state_dict_s:.2f} |"
            )
    if failures:
        lines += ["", "Failed runs:", ""]
        for f in failures:
            lines.append(
                f"- {f['backend']} {f['shape']} {f['size']}: {f['status']}: `{f.get('error')}`"
            )
    if optim is not None:
        lines += ["", *optim_markdown(optim)]
    return "\n".join(lines) + "\n"


def optim_markdown(optim: dict[str, Any]) -> list[str]:
    if optim.get("status") != "ok":
        return [f"Optimizer study: {optim.get('status')}: `{optim.get('error')}`"]
    counts = optim["counts"]
    lines = [
        f"## optimizer step alone: torch FSDP1 + flatview, dense {optim['size']} tensors, "
        f"{optim['world_size']} processes",
        "",
        "Rank 0, tensors stepped: "
        + ", ".join(f"{k} {v}" for k, v in counts.items())
        + "; ms of CPU time (wall in brackets), medians of interleaved steps:",
        "",
        "| optimizer | "
        + " | ".join(TARGETS)
        + " | all / non-empty | Coalesced / flat | Coalesced / all | Coalesced's tensors |",
        "|---|" + "---:|" * (len(TARGETS) + 4),
    ]
    times, wall = optim["cpu"], optim["times"]
    inner = optim.get("inner_tensors", {})
    for label, _, _ in OPTIMIZERS:
        meds = [statistics.median(times[f"{label} | {t}"]) for t in TARGETS]
        walls = [statistics.median(wall[f"{label} | {t}"]) for t in TARGETS]
        cells = " | ".join(f"{m:.2f} ({w:.2f})" for m, w in zip(meds, walls, strict=True))
        flat, every, nonempty, coalesced = meds
        lines.append(
            f"| {label} | {cells} | {every / nonempty:.2f} | {coalesced / flat:.2f} | "
            f"{coalesced / every:.3f} | {inner.get(f'{label} | {COALESCED}', '?')} |"
        )
    return lines


def chart(rows: Sequence[Row], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for backend in BACKENDS:
        for mode, style in (("none", "-o"), ("half", "--s")):
            chosen = sorted(
                (
                    r
                    for r in rows
                    if r.clock == "cpu"
                    and r.backend == backend
                    and r.mode == mode
                    and r.shape == "dense"
                ),
                key=lambda r: r.tensors,
            )
            if not chosen:
                continue
            x = [r.tensors for r in chosen]
            label = f"{backend}, {'half skipped' if mode == 'half' else 'nothing skipped'}"
            axes[0].plot(x, [r.extra_fb_us_per_tensor for r in chosen], style, label=label)
            axes[1].plot(x, [r.step_ratio for r in chosen], style, label=label)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("parameter tensors (dense)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("flatview's extra forward+backward CPU, µs per tensor")
    axes[1].set_ylabel("whole step CPU time, flatview / bare")
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[0].axhline(0.0, color="grey", lw=0.8)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------- parent


def parse_args(argv: Sequence[str] | None = None) -> tuple[Config, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI-sized: small models, few steps")
    parser.add_argument(
        "--only", help="comma-separated backends (fairscale,torch,fsdp2,ddp,deepspeed)"
    )
    parser.add_argument("--sizes", help="comma-separated dense sizes ('' for none)")
    parser.add_argument("--moe-sizes", help="comma-separated moe sizes ('' for none)")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--world-size", type=int, default=Config.world_size)
    parser.add_argument("--optim-world-size", type=int, default=Config.optim_world_size)
    parser.add_argument("--no-optim", action="store_true", help="skip the optimizer study")
    parser.add_argument(
        "--optim-only", action="store_true", help="only the optimizer study (no model sizes)"
    )
    parser.add_argument(
        "--no-coalesced", action="store_true", help="no flatview + Coalesced variant"
    )
    parser.add_argument("--timeout", type=float, default=Config.timeout)
    parser.add_argument("--out", default="results/scale")
    args = parser.parse_args(argv)
    cfg = Config(world_size=args.world_size, optim_world_size=args.optim_world_size)
    if args.quick:
        cfg = replace(
            cfg,
            dense_sizes=(64, 256, 1024),
            moe_sizes=(1024,),
            steps=6,
            warmup=2,
            optim_size=1024,
            optim_steps=6,
        )
    if args.only:
        cfg = replace(cfg, backends=tuple(args.only.split(",")))
    if args.sizes is not None:
        cfg = replace(cfg, dense_sizes=tuple(int(s) for s in args.sizes.split(",") if s))
    if args.moe_sizes is not None:
        cfg = replace(cfg, moe_sizes=tuple(int(s) for s in args.moe_sizes.split(",") if s))
    if args.optim_only:
        if args.no_optim:
            parser.error("--optim-only and --no-optim exclude each other")
        cfg = replace(cfg, dense_sizes=(), moe_sizes=())
    for key in ("steps", "warmup"):
        if getattr(args, key) is not None:
            cfg = replace(cfg, **{key: getattr(args, key)})
    return replace(cfg, timeout=args.timeout, coalesced=not args.no_coalesced), args


def main(argv: Sequence[str] | None = None) -> int:
    cfg, args = parse_args(argv)
    mp.set_forkserver_preload(common._preload())
    started = time.perf_counter()
    meta: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_before": os.getloadavg()[0],
        "config": asdict(cfg),
    }
    runs = [("dense", s) for s in cfg.dense_sizes] + [("moe", s) for s in cfg.moe_sizes]
    results, failures = [], []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    partial = out / "bench_scale.partial.jsonl"
    partial.write_text("")
    for shape, size in runs:
        for backend in cfg.backends:
            t0 = time.perf_counter()
            run_cfg = replace(cfg, timeout=cfg.timeout * max(1.0, size / 4096))
            result = common.run_in_fresh_processes(
                scale_worker,
                (backend, shape, size, cfg),
                run_cfg,  # type: ignore[arg-type]
            )
            result.update(backend=backend, shape=shape, size=size)
            wall = time.perf_counter() - t0
            with partial.open("a") as lines:  # kept if the run is stopped before the end
                lines.write(json.dumps(result) + "\n")
            if result.get("status") != "ok":
                failures.append(result)
                print(
                    f"  {backend:9s} {shape:5s} {size:6d} {wall:6.1f} s  "
                    f"{result.get('status')}: {str(result.get('error'))[:200]}",
                    flush=True,
                )
                continue
            results.append(result)
            brief = "  ".join(
                f"{r.mode}: fb +{_fi(r.extra_fb_us_per_tensor, r.extra_fb_interval, '.2f')} "
                f"µs/t, step x{_fi(r.step_ratio, r.step_ratio_interval, '.3f')}"
                + (
                    f" (Coalesced x{r.coalesced_step_ratio:.3f})"
                    if r.coalesced_step_ratio is not None
                    else ""
                )
                + (
                    f", orig +{r.orig_extra_fb_us_per_tensor:.2f}"
                    if r.orig_extra_fb_us_per_tensor is not None
                    else ""
                )
                for r in rows_of(result, "cpu")
            )
            print(f"  {backend:9s} {shape:5s} {size:6d} {wall:6.1f} s  {brief}", flush=True)
    optim = None
    if not args.no_optim:
        optim_cfg = replace(cfg, world_size=cfg.optim_world_size)
        optim = common.run_in_fresh_processes(optim_worker, (optim_cfg,), optim_cfg)  # type: ignore[arg-type]
        print("\n".join(optim_markdown(optim)), flush=True)
    rows = [
        row for result in results for clock in ("cpu", "wall") for row in rows_of(result, clock)
    ]
    meta["load_after"] = os.getloadavg()[0]
    meta["wall_s"] = time.perf_counter() - started
    table = markdown(rows, failures, optim, cfg, meta)
    (out / "bench_scale.md").write_text(table)
    (out / "bench_scale.json").write_text(
        json.dumps(
            {
                "meta": meta,
                "rows": [asdict(r) for r in rows],
                "raw": results,
                "failures": failures,
                "optim": optim,
            },
            indent=1,
        )
    )
    chart(rows, out / "bench_scale.png")
    print()
    print(table)
    print(f"written: {out}/bench_scale.md, .json, .png ({meta['wall_s']:.0f} s in all)")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
