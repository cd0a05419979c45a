"""Stochastic depth under data parallelism: what each way of skipping blocks costs.

The model is a residual MLP (``--blocks`` blocks of ``--width`` x ``--width``, each skipped
with probability ``--skip-prob`` per step, the same mask on every rank). Every approach
trains it on the same batches with the same skip sequence, each in fresh worker processes
(``--world-size`` CPU processes over gloo), and is measured twice:

* a timing pass: ``--warmup`` steps, then ``--steps`` timed steps (forward, backward,
  optimizer step). Median step time on rank 0.
* a counting pass: ``--count-steps`` more steps (the same masks for every approach) under
  a ``TorchDispatchMode`` that sees every ``c10d`` collective, whoever issues it (DDP's
  C++ reducer included). Bytes per op: all_gather -> output size, reduce_scatter -> input
  size, all_reduce -> tensor size, all_to_all -> input size, broadcast -> tensor size.
  "Gradient bytes" are the reducing ops (all_reduce, reduce_scatter, all_to_all, reduce);
  "all bytes" add gathers and broadcasts. torch's ``CommDebugMode`` runs alongside and
  its call count is checked against ours. Counting runs apart from timing because
  dispatch through Python slows every op down.
* a memory pass: the counted steps once more, with glibc told to serve every allocation
  of 64 KiB or more by its own mmap (so freed tensors leave the resident set at once) and
  the kernel's peak-RSS mark reset. Peak memory = rank 0's peak resident set size
  (``VmHWM``) in this pass minus its resident set size before the model was built:
  parameters, wrapper buffers, optimizer state, gradients, activations and communication
  buffers at the worst moment of a step.

Each approach runs once per round (``--rounds``), round-robin, so that drift in the load
of a shared machine is spread over all of them. Differences smaller than that noise are
measured as *pairs*: two variants built side by side in the same processes, their steps
interleaved (bare vs flatview-wrapped fairscale with nothing skipped; reduce_scatter vs
all_to_all; skip-set check off vs on).

Run ``python benchmarks/bench_skip.py --quick`` for a one-minute version; results go to
``results/bench/`` (markdown table, JSON, PNG). See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import faulthandler
import gc
import json
import os
import platform
import signal
import socket
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.spawn import ProcessException

from flatview.testing.counting import GRADIENT_KINDS, CollectiveCounter

MIB = 2.0**20

# ----------------------------------------------------------------------------- config


@dataclass(frozen=True)
class Config:
    blocks: int = 12
    width: int = 512
    batch: int = 64
    """Per rank."""
    skip_prob: float = 0.5
    steps: int = 30
    """Timed steps per round."""
    warmup: int = 5
    rounds: int = 3
    """Each approach runs once per round, in fresh processes; step times are pooled."""
    count_steps: int = 8
    world_size: int = 2
    seed: int = 0
    lr: float = 0.01
    timeout: float = 90.0
    """Seconds one run may take before its workers are killed (a normal one takes < 30)."""


# ------------------------------------------------------------------------------ model


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x + scale * F.relu(self.fc(x))


class _ZeroGrad(torch.autograd.Function):
    """Pretends a skipped block's parameters were used: they get zero gradients, so a
    wrapper that expects every gradient (DDP without find_unused_parameters) is happy."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.specs = [(p.shape, p.dtype, p.device) for p in params]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        zeros = [
            torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.specs
        ]
        return (grad, *zeros)


class ResMLP(nn.Module):
    def __init__(self, blocks: int, width: int, classes: int = 10) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor, skip: Sequence[int] = (), how: str = "skip") -> torch.Tensor:
        """``how`` says what happens to a skipped block: ``skip`` (not called),
        ``zero_grad`` (not called, zero gradients faked) or ``times_zero`` (called, its
        output multiplied by zero)."""
        skipped = set(skip)
        for index, block in enumerate(self.blocks):
            if index not in skipped:
                x = block(x)
            elif how == "zero_grad":
                x = _ZeroGrad.apply(x, *block.parameters())
            elif how == "times_zero":
                x = block(x, 0.0)
        return self.head(x)


def make_net(cfg: Config) -> ResMLP:
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    return ResMLP(cfg.blocks, cfg.width)


def skip_masks(cfg: Config, n: int) -> list[list[int]]:
    """The skip sets of steps 0..n-1: one generator, so the same on every rank and in
    every approach."""
    generator = torch.Generator().manual_seed(cfg.seed + 1)
    return [
        [int(i) for i in torch.nonzero(torch.rand(cfg.blocks, generator=generator) < cfg.skip_prob)]
        for _ in range(n)
    ]


def make_batches(cfg: Config, n: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(cfg.seed * 1000 + 17 + rank)
    return [
        (
            torch.randn(cfg.batch, cfg.width, generator=generator),
            torch.randint(0, 10, (cfg.batch,), generator=generator),
        )
        for _ in range(n)
    ]


# -------------------------------------------------------------------- counting collectives

# --------------------------------------------------------------------------- approaches


@dataclass
class Trainer:
    """One approach, built on one rank: ``step(x, y, skip)`` trains one step."""

    step: Callable[[torch.Tensor, torch.Tensor, list[int]], None]
    flatview: Any = None


@dataclass(frozen=True)
class Approach:
    name: str
    label: str
    build: Callable[[Config], Trainer]
    fairscale: bool = False
    """Needs fairscale's FSDP (run under flatview.testing.fairscale_on_cpu on CPU)."""
    expect: str = "ok"
    """``crash`` for approaches known to fail with skipped blocks."""
    min_world: int = 1
    """Fewest processes it runs on (hybrid layouts: shards of 2 and 2+ replicas); left
    out of runs on fewer."""
    deepspeed: bool = False
    """Needs DeepSpeed (run under flatview.testing.deepspeed_on_cpu on CPU)."""


def _sgd(params: Any, cfg: Config) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9)


def _loop(
    model: nn.Module, optimizer: torch.optim.Optimizer, how: str = "skip"
) -> Callable[[torch.Tensor, torch.Tensor, list[int]], None]:
    def step(x: torch.Tensor, y: torch.Tensor, skip: list[int]) -> None:
        F.cross_entropy(model(x, skip, how), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def build_ideal(cfg: Config) -> Trainer:
    """The lower bound: only the used blocks exist for this step; their gradients travel
    in one flat all-reduce issued by hand."""
    net = make_net(cfg)
    optimizer = _sgd(net.parameters(), cfg)
    world = dist.get_world_size()

    def step(x: torch.Tensor, y: torch.Tensor, skip: list[int]) -> None:
        F.cross_entropy(net(x, skip), y).backward()
        grads = [p.grad for p in net.parameters() if p.grad is not None]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        flat /= world
        for grad, reduced in zip(
            grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True
        ):
            grad.copy_(reduced)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Trainer(step)


def _ddp(how: str, find_unused: bool) -> Callable[[Config], Trainer]:
    def build(cfg: Config) -> Trainer:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(make_net(cfg), find_unused_parameters=find_unused)
        return Trainer(_loop(model, _sgd(model.parameters(), cfg), how))

    return build


def _fairscale(per_block: bool, flatten: bool) -> Callable[[Config], Trainer]:
    def build(cfg: Config) -> Trainer:
        model = _fairscale_model(cfg, per_block, flatten)
        return Trainer(_loop(model, _sgd(model.parameters(), cfg)))

    return build


def _fairscale_model(cfg: Config, per_block: bool, flatten: bool) -> nn.Module:
    from fairscale.nn import FullyShardedDataParallel as FSDP

    net = make_net(cfg)
    if per_block:
        for index, block in enumerate(net.blocks):
            net.blocks[index] = FSDP(block, flatten_parameters=flatten)
    return FSDP(net, flatten_parameters=flatten)


def _torch_fsdp1_one_unit(cfg: Config, strategy: str) -> nn.Module:
    """The whole model one unit: DDP-style replication (NO_SHARD) needs nothing finer."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    return FSDP(
        make_net(cfg), sharding_strategy=ShardingStrategy[strategy], device_id=torch.device("cpu")
    )


def _torch_fsdp1(cfg: Config, use_orig_params: bool, strategy: str) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FSDP(
        make_net(cfg),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        use_orig_params=use_orig_params,
        sharding_strategy=ShardingStrategy[strategy],
        device_id=torch.device("cpu"),
    )


def build_torch_fsdp1_orig(cfg: Config) -> Trainer:
    model = _torch_fsdp1(cfg, use_orig_params=True, strategy="FULL_SHARD")
    return Trainer(_loop(model, _sgd(model.parameters(), cfg)))


def _fsdp2_model(cfg: Config, prefetch: bool = False) -> nn.Module:
    """FSDP2 per block: each block its own ``fully_shard`` unit, then the model. With
    ``prefetch``, explicit prefetching as torchtitan sets it: the root's forward prefetches
    block 0, each block's the next block; in backward each block prefetches the one
    before, the root the last (FSDP2 all-gathers these targets whether they run or not)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    net = make_net(cfg)
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    if prefetch:
        blocks: list[Any] = list(net.blocks)
        root: Any = net
        root.set_modules_to_forward_prefetch(blocks[:1])
        root.set_modules_to_backward_prefetch(blocks[-1:])
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 2])
            block.set_modules_to_backward_prefetch(blocks[i - 1 : i] if i else [])
    return net


def _torch_fsdp2(prefetch: bool) -> Callable[[Config], Trainer]:
    def build(cfg: Config) -> Trainer:
        net = _fsdp2_model(cfg, prefetch)
        return Trainer(_loop(net, _sgd(net.parameters(), cfg)))

    return build


build_torch_fsdp2 = _torch_fsdp2(False)


def _flatview_fsdp2(
    check: bool, prefetch: bool = False, held: bool | None = None
) -> Callable[[Config], Trainer]:
    """flatview + FSDP2 per block: no views (FSDP2 keeps the original parameters), skip
    sets, the agreement check and the flags that catch undeclared unused parameters; with
    ``prefetch`` (see :func:`_fsdp2_model`) flatview steers prefetching off skipped blocks.
    ``held``: ``ReduceOptions.bucket_all_used`` (``None``: small reduce-scatters held and run
    as one on 2 shards, ``False``: each unit's on its own, as FSDP2 runs them)."""

    def build(cfg: Config) -> Trainer:
        import flatview

        options = flatview.ReduceOptions(bucket_all_used=held)
        model = _fsdp2_model(cfg, prefetch)
        return _with_flatview(model, cfg, check, "auto", reduce_options=options)

    return build


def _hybrid_mesh() -> Any:
    """A (replicate, shard) mesh with shards of 2 ranks (4 processes: 2 x 2)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world < 4 or world % 2:
        raise RuntimeError(f"hybrid rows need an even world size of at least 4, got {world}")
    return init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))


def _flatview_torch_hybrid(cfg: Config) -> Trainer:
    """flatview + torch FSDP1 HYBRID_SHARD per block over a (replicate, shard) mesh."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = FSDP(
        make_net(cfg),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        device_mesh=_hybrid_mesh(),
        device_id=torch.device("cpu"),
    )
    return _with_flatview(model, cfg, True, "auto")


def _flatview_fsdp2_hsdp(cfg: Config) -> Trainer:
    """flatview + FSDP2 HSDP per block over a (replicate, shard) mesh."""
    from torch.distributed.fsdp import fully_shard

    mesh = _hybrid_mesh()
    net = make_net(cfg)
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return _with_flatview(net, cfg, True, "auto")


def _with_flatview(
    model: nn.Module, cfg: Config, check: bool, strategy: str, **options: Any
) -> Trainer:
    import flatview

    fv = flatview.wrap(model, check_skip_agreement=check, reduce_strategy=strategy, **options)
    optimizer = _sgd(fv.parameters(), cfg)

    def step(x: torch.Tensor, y: torch.Tensor, skip: list[int]) -> None:
        with fv.step(skip=[f"blocks.{i}" for i in skip]):
            F.cross_entropy(model(x, skip), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Trainer(step, fv)


def _flatview_fairscale(check: bool, strategy: str) -> Callable[[Config], Trainer]:
    def build(cfg: Config) -> Trainer:
        return _with_flatview(_fairscale_model(cfg, True, True), cfg, check, strategy)

    return build


def _flatview_torch_one_unit(check: bool, runtime: bool = False) -> Callable[[Config], Trainer]:
    def build(cfg: Config) -> Trainer:
        options = {"compute_on_views": False} if runtime else {}
        model = _torch_fsdp1_one_unit(cfg, "NO_SHARD")
        return _with_flatview(model, cfg, check, "auto", **options)

    return build


def _flatview_torch(
    strategy: str,
    check: bool = True,
    unpacked: bool | None = None,
    runtime: bool = False,
    orig_params: bool = False,
    bucket_all_used: bool | None = None,
) -> Callable[[Config], Trainer]:
    """``bucket_all_used``: ``ReduceOptions.bucket_all_used`` (``None``: torch's layout, each
    fully used gradient reduced on its own). ``runtime``: keep torch's unit runtime
    (``compute_on_views=False``) where flatview would compute on views (NO_SHARD).
    ``orig_params``: ``use_orig_params=True``. ``unpacked`` (torch's runtime only) overrides
    flatview's rule for reducing (nearly) fully used gradients whole, without packing, by
    a collective that runs while the backward goes on: ``True`` for gradients of every
    size, ``False`` never (every gradient packed into one bucket reduced at the end of the
    backward); ``None`` keeps the default rule (only gradients of ``IN_PLACE_MIN_NUMEL``
    elements or more)."""

    def build(cfg: Config) -> Trainer:
        model = _torch_fsdp1(cfg, use_orig_params=orig_params, strategy=strategy)
        import flatview

        options: dict[str, Any] = {"compute_on_views": False} if runtime else {}
        if unpacked is False:
            options["reduce_options"] = flatview.ReduceOptions(
                in_place_tolerance=None, bucket_all_used=True
            )
        elif unpacked:
            options["reduce_options"] = flatview.ReduceOptions(in_place_min_numel=0)
        elif bucket_all_used is not None:
            options["reduce_options"] = flatview.ReduceOptions(bucket_all_used=bucket_all_used)
        return _with_flatview(model, cfg, check, "auto", **options)

    return build


def _flatview_ddp(check: bool) -> Callable[[Config], Trainer]:
    """DDP (``find_unused_parameters=False``) wrapped by flatview: the seed-000 case, DDP
    told the unused parameters before the forward."""

    def build(cfg: Config) -> Trainer:
        from torch.nn.parallel import DistributedDataParallel as DDP

        return _with_flatview(DDP(make_net(cfg)), cfg, check, "auto")

    return build


def _deepspeed(stage: int, wrapped: bool) -> Callable[[Config], Trainer]:
    """A DeepSpeed ZeRO engine (fp32, no clipping) over SGD with momentum; ``wrapped``:
    with flatview (the engine's optimizer steps views, skipped blocks' get no gradient),
    else bare DeepSpeed (skipped blocks' parameters get zero gradients it steps)."""

    def build(cfg: Config) -> Trainer:
        import deepspeed

        net = make_net(cfg)
        config = {
            "train_micro_batch_size_per_gpu": cfg.batch,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        }
        engine, _, _, _ = deepspeed.initialize(
            model=net, optimizer=_sgd(net.parameters(), cfg), config=config
        )
        fv = None
        if wrapped:
            import flatview

            fv = flatview.wrap(engine)

        def step(x: torch.Tensor, y: torch.Tensor, skip: list[int]) -> None:
            declared = (
                fv.step(skip=[f"blocks.{i}" for i in skip])
                if fv is not None
                else contextlib.nullcontext()
            )
            with declared:
                engine.backward(F.cross_entropy(engine(x, skip), y))
            engine.step()

        return Trainer(step, fv)

    return build


def _torch_bare(strategy: str) -> Callable[[Config], Trainer]:
    """torch FSDP1 without flatview, flat parameters (``use_orig_params=False``): trains only
    when nothing is skipped or the skipped units' flat gradients may stay None."""

    def build(cfg: Config) -> Trainer:
        model = _torch_fsdp1(cfg, use_orig_params=False, strategy=strategy)
        return Trainer(_loop(model, _sgd(model.parameters(), cfg)))

    return build


APPROACHES: tuple[Approach, ...] = (
    Approach("ideal", "ideal: used blocks only, one hand-made all-reduce", build_ideal),
    Approach("ddp_find_unused", "DDP find_unused_parameters=True", _ddp("skip", True)),
    Approach("ddp_zero_grad", "DDP + zero-gradient autograd function", _ddp("zero_grad", False)),
    Approach("ddp_times_zero", "DDP, skipped output times zero", _ddp("times_zero", False)),
    Approach(
        "fairscale_one_unit_flat",
        "fairscale FSDP one unit, flatten=True",
        _fairscale(False, True),
        fairscale=True,
    ),
    Approach(
        "fairscale_one_unit_noflat",
        "fairscale FSDP one unit, flatten=False",
        _fairscale(False, False),
        fairscale=True,
    ),
    Approach(
        "fairscale_per_block_flat",
        "fairscale FSDP per block, flatten=True",
        _fairscale(True, True),
        fairscale=True,
        expect="crash",
    ),
    Approach(
        "fairscale_per_block_noflat",
        "fairscale FSDP per block, flatten=False",
        _fairscale(True, False),
        fairscale=True,
        expect="crash",
    ),
    Approach(
        "torch_fsdp1_orig_params",
        "torch FSDP1 per block, use_orig_params=True",
        build_torch_fsdp1_orig,
    ),
    Approach("torch_fsdp2", "torch FSDP2 (fully_shard) per block", build_torch_fsdp2),
    Approach("flatview_fsdp2", "flatview + FSDP2 per block, check on", _flatview_fsdp2(True)),
    Approach(
        "flatview_fsdp2_nocheck", "flatview + FSDP2 per block, check off", _flatview_fsdp2(False)
    ),
    Approach(
        "torch_fsdp2_prefetch",
        "torch FSDP2 per block, explicit prefetching",
        _torch_fsdp2(True),
    ),
    Approach(
        "flatview_fsdp2_prefetch",
        "flatview + FSDP2 per block, explicit prefetching, check on",
        _flatview_fsdp2(True, prefetch=True),
    ),
    Approach(
        "flatview_torch_hybrid",
        "flatview + torch FSDP1 HYBRID_SHARD per block, shards of 2 (4+ processes)",
        _flatview_torch_hybrid,
        min_world=4,
    ),
    Approach(
        "flatview_fsdp2_hsdp",
        "flatview + FSDP2 HSDP per block, shards of 2 (4+ processes)",
        _flatview_fsdp2_hsdp,
        min_world=4,
    ),
    Approach(
        "flatview_fairscale_rs_check",
        "flatview + fairscale per block, reduce_scatter, check on",
        _flatview_fairscale(True, "reduce_scatter"),
        fairscale=True,
    ),
    Approach(
        "flatview_fairscale_rs",
        "flatview + fairscale per block, reduce_scatter, check off",
        _flatview_fairscale(False, "reduce_scatter"),
        fairscale=True,
    ),
    Approach(
        "flatview_fairscale_a2a_check",
        "flatview + fairscale per block, all_to_all, check on",
        _flatview_fairscale(True, "all_to_all"),
        fairscale=True,
    ),
    Approach(
        "flatview_fairscale_a2a",
        "flatview + fairscale per block, all_to_all, check off",
        _flatview_fairscale(False, "all_to_all"),
        fairscale=True,
    ),
    Approach(
        "flatview_torch_no_shard",
        "flatview + torch FSDP1 per block, NO_SHARD, on views, check on",
        _flatview_torch("NO_SHARD"),
    ),
    Approach(
        "flatview_torch_no_shard_nocheck",
        "flatview + torch FSDP1 per block, NO_SHARD, on views, check off",
        _flatview_torch("NO_SHARD", check=False),
    ),
    Approach(
        "flatview_torch_no_shard_orig",
        "flatview + torch FSDP1 per block, NO_SHARD, use_orig_params=True, on views, check on",
        _flatview_torch("NO_SHARD", orig_params=True),
    ),
    Approach(
        "flatview_torch_no_shard_runtime",
        "flatview + torch FSDP1 per block, NO_SHARD, torch's runtime, check on",
        _flatview_torch("NO_SHARD", runtime=True),
    ),
    Approach(
        "flatview_torch_no_shard_one_unit",
        "flatview + torch FSDP1 one unit, NO_SHARD, on views, check on",
        _flatview_torch_one_unit(True),
    ),
    Approach(
        "flatview_torch_no_shard_one_unit_runtime",
        "flatview + torch FSDP1 one unit, NO_SHARD, torch's runtime, check on",
        _flatview_torch_one_unit(True, runtime=True),
    ),
    Approach("flatview_ddp_check", "flatview + DDP, check on", _flatview_ddp(True)),
    Approach("flatview_ddp", "flatview + DDP, check off", _flatview_ddp(False)),
    Approach(
        "flatview_torch_full_shard",
        "flatview + torch FSDP1 per block, FULL_SHARD",
        _flatview_torch("FULL_SHARD"),
    ),
    *(
        Approach(
            f"{'flatview_' if wrapped else ''}deepspeed_zero{stage}",
            f"{'flatview + ' if wrapped else ''}DeepSpeed ZeRO {stage}"
            + ("" if wrapped else " (skipped blocks still stepped)"),
            _deepspeed(stage, wrapped),
            deepspeed=True,
        )
        for stage in (1, 3)
        for wrapped in (False, True)
    ),
)
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch.distributed.fsdp",
    "torch.distributed.tensor.debug",
    "fairscale.nn",
]


def _preload() -> list[str]:
    """What the forkserver imports once: heavy libraries, and every flatview module, so that
    all runs of one benchmark use the flatview of its start even if files change meanwhile
    (a lazily imported module would otherwise come from the newer files)."""
    import importlib.util
    import pkgutil

    import flatview

    names = [m.name for m in pkgutil.walk_packages(flatview.__path__, "flatview.")]
    # DeepSpeed takes 5-30 s to import; on CPU it picks its CPU accelerator then.
    optional = ["deepspeed"] if importlib.util.find_spec("deepspeed") is not None else []
    return [*_PRELOAD, *optional, "flatview", *names]


@dataclass(frozen=True)
class Pair:
    """Two variants trained side by side in the same processes, steps interleaved (ABBA),
    so that the machine's load, which drifts, falls on both alike: for differences
    smaller than the noise between separate runs."""

    name: str
    title: str
    a: tuple[str, Callable[[Config], Trainer]]
    b: tuple[str, Callable[[Config], Trainer]]
    skip: bool
    """Use the skip masks (else nothing is skipped)."""
    deepspeed: bool = False
    """Both variants are DeepSpeed engines (run under deepspeed_on_cpu on CPU)."""


PAIRS: tuple[Pair, ...] = (
    *(
        Pair(
            f"deepspeed_zero{stage}_skipping",
            f"DeepSpeed ZeRO {stage}, skipping: bare DeepSpeed (skipped blocks' parameters "
            "stepped on zero gradients) vs wrapped by flatview (check on)",
            ("bare DeepSpeed", _deepspeed(stage, False)),
            ("flatview", _deepspeed(stage, True)),
            skip=True,
            deepspeed=True,
        )
        for stage in (1, 3)
    ),
    Pair(
        "fsdp2_skipping",
        "FSDP2 per block, skipping: bare FSDP2 (every rank skips the same blocks) vs "
        "wrapped by flatview (check on)",
        ("bare FSDP2", build_torch_fsdp2),
        ("flatview", _flatview_fsdp2(True)),
        skip=True,
    ),
    Pair(
        "fsdp2_nothing_skipped",
        "FSDP2 per block, nothing skipped: bare FSDP2 vs wrapped by flatview (check on)",
        ("bare FSDP2", build_torch_fsdp2),
        ("flatview", _flatview_fsdp2(True)),
        skip=False,
    ),
    Pair(
        "fsdp2_nothing_skipped_nocheck",
        "FSDP2 per block, nothing skipped: bare FSDP2 vs wrapped by flatview (check off)",
        ("bare FSDP2", build_torch_fsdp2),
        ("flatview", _flatview_fsdp2(False)),
        skip=False,
    ),
    Pair(
        "fsdp2_vs_ideal",
        "FSDP2 per block, skipping: the ideal vs flatview + FSDP2 (check on)",
        ("ideal", build_ideal),
        ("flatview + FSDP2", _flatview_fsdp2(True)),
        skip=True,
    ),
    Pair(
        "fsdp2_held_skipping",
        "FSDP2 per block, skipping: flatview with each unit's reduce-scatter on its own "
        "(bucket_all_used=False) vs held and run as one (the default on 2 shards)",
        ("one each", _flatview_fsdp2(True, held=False)),
        ("held", _flatview_fsdp2(True)),
        skip=True,
    ),
    Pair(
        "fsdp2_prefetch_skipping",
        "FSDP2 per block with explicit prefetching, skipping: bare FSDP2 (which all-gathers "
        "prefetched blocks that are skipped) vs wrapped by flatview (check on; prefetching "
        "steered off skipped blocks)",
        ("bare FSDP2", _torch_fsdp2(True)),
        ("flatview", _flatview_fsdp2(True, prefetch=True)),
        skip=True,
    ),
    Pair(
        "fsdp2_prefetch_nothing_skipped",
        "FSDP2 per block with explicit prefetching, nothing skipped: bare FSDP2 vs wrapped "
        "by flatview (check on)",
        ("bare FSDP2", _torch_fsdp2(True)),
        ("flatview", _flatview_fsdp2(True, prefetch=True)),
        skip=False,
    ),
    Pair(
        "views_cost_nothing",
        "Views must cost nothing: fairscale FSDP per block, nothing skipped, bare vs wrapped "
        "by flatview (check off)",
        ("bare fairscale", _fairscale(True, True)),
        ("flatview", _flatview_fairscale(False, "reduce_scatter")),
        skip=False,
    ),
    Pair(
        "views_cost_nothing_torch",
        "Views must cost nothing: torch FSDP1 per block (FULL_SHARD, use_orig_params=False), "
        "nothing skipped, bare vs wrapped by flatview (check off)",
        ("bare torch FSDP1", _torch_bare("FULL_SHARD")),
        ("flatview", _flatview_torch("FULL_SHARD", check=False)),
        skip=False,
    ),
    Pair(
        "replicated_vs_ideal",
        "DDP-style: the ideal vs flatview + torch FSDP1 per block, NO_SHARD on views (check "
        "on), skipping",
        ("ideal", build_ideal),
        ("flatview NO_SHARD", _flatview_torch("NO_SHARD")),
        skip=True,
    ),
    Pair(
        "replicated_vs_ideal_nocheck",
        "DDP-style: the ideal vs flatview + torch FSDP1 per block, NO_SHARD on views (check "
        "off), skipping",
        ("ideal", build_ideal),
        ("flatview NO_SHARD", _flatview_torch("NO_SHARD", check=False)),
        skip=True,
    ),
    Pair(
        "replicated_runtime_vs_views",
        "DDP-style: flatview + torch FSDP1 per block, NO_SHARD (check on), skipping: torch's "
        "runtime (compute_on_views=False) vs computed on views",
        ("torch's runtime", _flatview_torch("NO_SHARD", runtime=True)),
        ("on views", _flatview_torch("NO_SHARD")),
        skip=True,
    ),
    Pair(
        "replicated_vs_ddp",
        "DDP-style: DDP find_unused_parameters=True vs flatview + torch FSDP1 per block, "
        "NO_SHARD on views (check on), skipping",
        ("DDP find_unused", _ddp("skip", True)),
        ("flatview NO_SHARD", _flatview_torch("NO_SHARD")),
        skip=True,
    ),
    Pair(
        "replicated_ddp_vs_ideal",
        "DDP-style: the ideal vs flatview + DDP (check on), skipping",
        ("ideal", build_ideal),
        ("flatview + DDP", _flatview_ddp(True)),
        skip=True,
    ),
    Pair(
        "replicated_ddp_vs_ddp",
        "DDP-style: DDP find_unused_parameters=True vs flatview + DDP (check on), skipping",
        ("DDP find_unused", _ddp("skip", True)),
        ("flatview + DDP", _flatview_ddp(True)),
        skip=True,
    ),
    Pair(
        "replicated_views_cost",
        "DDP-style, what flatview adds: torch FSDP1 per block, NO_SHARD, skipping (skipped units "
        "are not called, so bare torch all-reduces only used units too), bare vs wrapped by "
        "flatview, on views (check off)",
        ("bare torch FSDP1", _torch_bare("NO_SHARD")),
        ("flatview", _flatview_torch("NO_SHARD", check=False)),
        skip=True,
    ),
    Pair(
        "replicated_in_place",
        "flatview + torch FSDP1 per block, NO_SHARD, torch's runtime (check on), skipping: "
        "every gradient packed into one bucket vs every fully used gradient all-reduced in "
        "place, unpacked, while the backward goes on (by default only gradients of 2**20 "
        "elements or more are)",
        ("packed", _flatview_torch("NO_SHARD", unpacked=False, runtime=True)),
        ("unpacked", _flatview_torch("NO_SHARD", unpacked=True, runtime=True)),
        skip=True,
    ),
    Pair(
        "sharded_in_place",
        "flatview + torch FSDP1 per block, FULL_SHARD (check off), nothing skipped: every "
        "gradient packed into one bucket vs every fully used gradient reduce-scattered "
        "unpacked, while the backward goes on (by default only gradients of 2**20 elements "
        "or more are)",
        ("packed", _flatview_torch("FULL_SHARD", check=False, unpacked=False)),
        ("unpacked", _flatview_torch("FULL_SHARD", check=False, unpacked=True)),
        skip=False,
    ),
    Pair(
        "sharded_bucket_all_used",
        "flatview + torch FSDP1 per block, FULL_SHARD (check off), skipping: every fully "
        "used gradient reduce-scattered on its own, as torch does (the default: torch's "
        "rounding bit for bit) vs fully used gradients sharing buckets (bucket_all_used=True)",
        ("alone", _flatview_torch("FULL_SHARD", check=False)),
        ("bucketed", _flatview_torch("FULL_SHARD", check=False, bucket_all_used=True)),
        skip=True,
    ),
    Pair(
        "reduce_strategy",
        "flatview + fairscale per block, skipping, check off: reduce_scatter vs all_to_all",
        ("reduce_scatter", _flatview_fairscale(False, "reduce_scatter")),
        ("all_to_all", _flatview_fairscale(False, "all_to_all")),
        skip=True,
    ),
    Pair(
        "agreement_check",
        "flatview + fairscale per block, skipping, reduce_scatter: skip-set check off vs on",
        ("check off", _flatview_fairscale(False, "reduce_scatter")),
        ("check on", _flatview_fairscale(True, "reduce_scatter")),
        skip=True,
    ),
    Pair(
        "agreement_check_ddp",
        "flatview + DDP, skipping: skip-set check off vs on (on DDP it runs alongside the forward)",
        ("check off", _flatview_ddp(False)),
        ("check on", _flatview_ddp(True)),
        skip=True,
    ),
)


# ------------------------------------------------------------------------------ workers


def _quiet() -> None:
    warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed.fsdp")
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    warnings.filterwarnings("ignore", message="The `NO_SHARD` sharding strategy is deprecated")


def _proc_status_mib(key: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024.0
    raise KeyError(key)


def _libc() -> Any:
    return ctypes.CDLL("libc.so.6")


def _resident_mib() -> float:
    """Resident set size with glibc's free memory handed back first."""
    gc.collect()
    _libc().malloc_trim(0)
    return _proc_status_mib("VmRSS")


def _peak_memory_pass(train: Callable[[int], None], indices: Sequence[int]) -> float:
    """Peak resident set size (MiB) over ``train(i)`` for each index.

    glibc serves large allocations from its heap once it has seen them freed (its mmap
    threshold grows), and keeps freed heap pages resident, so the peak RSS would count
    garbage. A fixed 64 KiB threshold makes every tensor of that size its own mapping,
    returned at free. Used only here: it makes allocation slower, so never when timing.
    """
    m_mmap_threshold = -3
    _libc().mallopt(m_mmap_threshold, 64 * 1024)
    _resident_mib()
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # reset VmHWM to the current RSS
    for index in indices:
        train(index)
    return _proc_status_mib("VmHWM")


@contextlib.contextmanager
def _runtime(fairscale: bool, deepspeed: bool = False) -> Iterator[None]:
    if fairscale and not torch.cuda.is_available():
        from flatview.testing import fairscale_on_cpu

        with fairscale_on_cpu():
            yield
    elif deepspeed and not torch.cuda.is_available():
        from flatview.testing import deepspeed_on_cpu

        with deepspeed_on_cpu():
            yield
    else:
        yield


class _NoModuleTracking:
    """Stands in for CommDebugMode's per-module tracker. In torch 2.13 that tracker adds a
    forward hook at every module call and removes only the last one, so the second call of
    a module inside one CommDebugMode context fails in the hook (IndexError). We only need
    CommDebugMode's total counts, which do not depend on it."""

    name = "Global"
    is_bw = False
    activation_checkpointing = False
    module_parents_dict: dict[str, set[str]] = {"Global": set()}  # noqa: RUF012

    def __enter__(self) -> _NoModuleTracking:
        return self

    def __exit__(self, *args: object) -> None:
        return None


def _comm_debug_mode() -> Any:
    """A CommDebugMode that counts calls, or None if this torch's cannot be used so."""
    try:
        from torch.distributed.tensor.debug import CommDebugMode

        probe = CommDebugMode()
        probe.advanced_module_tracker = _NoModuleTracking()  # type: ignore[assignment]
        with probe:
            dist.all_reduce(torch.zeros(1))
        if probe.get_total_counts() != 1:
            return None
        mode = CommDebugMode()
        mode.advanced_module_tracker = _NoModuleTracking()  # type: ignore[assignment]
        return mode
    except Exception:
        return None


def _counting(train: Callable[[int], None], indices: Sequence[int]) -> dict[str, Any]:
    """Run ``train(i)`` for each index under the collective counter and CommDebugMode."""
    counter = CollectiveCounter()
    cdm = _comm_debug_mode()
    with cdm if cdm is not None else contextlib.nullcontext(), counter:
        for index in indices:
            train(index)
    n = len(indices)
    gradient = sum(counter.bytes.get(k, 0) for k in GRADIENT_KINDS)
    return {
        "per_kind": {
            kind: {"calls_per_step": counter.calls[kind] / n, "bytes_per_step": b / n}
            for kind, b in sorted(counter.bytes.items())
        },
        "gradient_bytes_per_step": gradient / n,
        "all_bytes_per_step": sum(counter.bytes.values()) / n,
        "calls_per_step": sum(v for k, v in counter.calls.items() if k != "barrier") / n,
        "commdebugmode_calls_per_step": None if cdm is None else cdm.get_total_counts() / n,
    }


def _stats_sum(fv: Any, steps: Callable[[], None], n: int) -> dict[str, float]:
    """flatview's own StepStats summed over ``n`` steps, per step."""
    totals: dict[str, float] = defaultdict(float)
    for _ in range(n):
        steps()
        for key, value in asdict(fv.stats).items():
            if isinstance(value, bool):
                continue
            totals[key] += value / n
    return dict(totals)


def approach_worker(rank: int, name: str, cfg: Config, measure: bool, port: int, out: str) -> None:
    # By name: builders are closures, which cannot be pickled to a spawned process.
    approach = next(a for a in APPROACHES if a.name == name)
    _init(rank, cfg, port, out)
    result: dict[str, Any] = {"name": approach.name, "label": approach.label}
    masks = skip_masks(cfg, cfg.warmup + cfg.steps)
    batches = make_batches(cfg, cfg.warmup + cfg.steps, rank)
    step_index = -1
    rss_before_build = _resident_mib()
    try:
        with _runtime(approach.fairscale, approach.deepspeed):
            try:
                trainer = approach.build(cfg)
            except Exception as exc:
                if type(exc).__name__ == "WrapError":
                    result.update(status="unavailable", error=f"WrapError: {exc}")
                    return
                raise

            def train(i: int) -> None:
                nonlocal step_index
                step_index = i
                x, y = batches[i]
                trainer.step(x, y, masks[i])

            for i in range(cfg.warmup):
                train(i)
            times = []
            for i in range(cfg.warmup, cfg.warmup + cfg.steps):
                started = time.perf_counter()
                train(i)
                times.append(time.perf_counter() - started)
            result.update(
                status="ok",
                step_ms=[t * 1e3 for t in times],
                skipped_per_step=statistics.mean(
                    len(m) for m in masks[cfg.warmup : cfg.warmup + cfg.steps]
                ),
            )
            if measure:
                # Counting replays the first timed steps: the same masks for everyone.
                count_indices = list(
                    range(cfg.warmup, cfg.warmup + min(cfg.count_steps, cfg.steps))
                )
                result.update(_counting(train, count_indices))
                if trainer.flatview is not None:
                    replay = iter(count_indices)
                    result["flatview_stats_per_step"] = _stats_sum(
                        trainer.flatview, lambda: train(next(replay)), len(count_indices)
                    )
                result.update(
                    rss_before_build_mib=rss_before_build,
                    rss_peak_mib=_peak_memory_pass(train, count_indices),
                )
        # Both ranks done with every collective (DDP leaves an async all-reduce in flight
        # after a backward) before either tears its process group down.
        dist.barrier()
    except Exception as exc:
        result.pop("step_ms", None)
        result.update(
            status="crashed",
            error=f"{type(exc).__name__}: {exc}",
            crash_step=step_index,
            skipped_at_crash=masks[step_index] if step_index >= 0 else None,
            traceback=traceback.format_exc(limit=-6),
        )
    finally:
        if rank == 0:
            Path(out).write_text(json.dumps(result))
        # After a crash inside a collective-issuing library the group may be unusable;
        # tearing it down is local for gloo and never blocks.
        dist.destroy_process_group()


def paired_worker(rank: int, name: str, cfg: Config, measure: bool, port: int, out: str) -> None:
    """Both variants of a :class:`Pair` in the same processes, steps interleaved (ABBA)."""
    pair = next(p for p in PAIRS if p.name == name)
    _init(rank, cfg, port, out)
    n = cfg.warmup + cfg.steps
    batches = make_batches(cfg, n, rank)
    masks = skip_masks(cfg, n) if pair.skip else [[] for _ in range(n)]
    result: dict[str, Any] = {"name": pair.name, "labels": [pair.a[0], pair.b[0]]}
    try:
        with _runtime(not pair.deepspeed, pair.deepspeed):
            trainers = {"a": pair.a[1](cfg), "b": pair.b[1](cfg)}

            def stepper(key: str) -> Callable[[int], None]:
                def train(i: int) -> None:
                    trainers[key].step(*batches[i], masks[i])

                return train

            times: dict[str, list[float]] = {"a": [], "b": []}
            for i in range(n):
                order = ["a", "b"] if i % 2 == 0 else ["b", "a"]
                for key in order:
                    started = time.perf_counter()
                    stepper(key)(i)
                    if i >= cfg.warmup:
                        times[key].append(time.perf_counter() - started)
            if measure:
                count_indices = list(
                    range(cfg.warmup, cfg.warmup + min(cfg.count_steps, cfg.steps))
                )
                result["counted"] = {
                    key: _counting(stepper(key), count_indices) for key in ("a", "b")
                }
        result.update(
            status="ok", a_ms=[t * 1e3 for t in times["a"]], b_ms=[t * 1e3 for t in times["b"]]
        )
        dist.barrier()  # as in approach_worker: no collective in flight at teardown
    except Exception as exc:
        result.update(
            status="crashed",
            error=f"{type(exc).__name__}: {exc}",
            traceback=traceback.format_exc(limit=-6),
        )
    finally:
        if rank == 0:
            Path(out).write_text(json.dumps(result))
        dist.destroy_process_group()


def _init(rank: int, cfg: Config, port: int, out: str) -> None:
    _quiet()
    # On a timeout the parent sends SIGUSR1 first: every thread's stack goes to a file it
    # reports, so a hang says where it hung.
    stacks = open(f"{out}.rank{rank}.stacks", "w")  # noqa: SIM115 - lives as long as the process
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    # One intra-op thread per process: the workers share the machine's cores.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.world_size))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=cfg.world_size,
        # Half the parent's limit: a stuck collective then fails with gloo's own message.
        timeout=datetime.timedelta(seconds=cfg.timeout / 2),
    )


# ------------------------------------------------------------------------------- parent


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def run_in_fresh_processes(
    fn: Callable[..., None], args: tuple[Any, ...], cfg: Config
) -> dict[str, Any]:
    """Run ``fn(rank, *args, port, out)`` in ``world_size`` fresh processes and return rank
    0's result; after a timeout (rare and not reproducible here: the machine is shared, and
    a hung pair of workers says nothing about the approach), try once more and keep the
    first attempt's stacks."""
    result = _run_once(fn, args, cfg)
    if result["status"] == "timeout":
        print(f"    timed out, retrying once: {args[0]}", flush=True)
        retry = _run_once(fn, args, cfg)
        retry["retried_after"] = result
        result = retry
    return result


def _run_once(fn: Callable[..., None], args: tuple[Any, ...], cfg: Config) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        context = mp.start_processes(
            fn,
            args=(*args, _free_port(), out),
            nprocs=cfg.world_size,
            start_method="forkserver",
            join=False,
        )
        deadline = time.monotonic() + cfg.timeout
        try:
            while not context.join(timeout=1):
                if time.monotonic() > deadline:
                    return _kill_hung(context.processes, out, cfg.timeout)
        except ProcessException as exc:
            if not os.path.exists(out):
                return {"status": "died", "error": str(exc).strip().splitlines()[-1]}
        if not os.path.exists(out):
            return {"status": "died", "error": "rank 0 wrote no result"}
        result: dict[str, Any] = json.loads(Path(out).read_text())
        return result


def _kill_hung(processes: Sequence[Any], out: str, timeout: float) -> dict[str, Any]:
    for process in processes:
        if process.is_alive():
            os.kill(process.pid, signal.SIGUSR1)
    time.sleep(2)
    for process in processes:
        process.kill()
    stacks = {}
    for rank in range(len(processes)):
        path = f"{out}.rank{rank}.stacks"
        if os.path.exists(path):
            stacks[f"rank{rank}"] = Path(path).read_text()[-6000:]
    hung = {"status": "timeout", "error": f"no result after {timeout:.0f} s", "stacks": stacks}
    if os.path.exists(out):
        # Rank 0 finished and reported; a worker hung on the way out, after the work.
        result: dict[str, Any] = json.loads(Path(out).read_text())
        result["hung_on_exit"] = hung
        return result
    return hung


def _merge_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from an approach's rounds: measurements of the first, all step times."""
    merged = dict(rounds[0])
    if merged["status"] == "ok":
        ok = [r for r in rounds if r["status"] == "ok"]
        merged["step_ms"] = [t for r in ok for t in r["step_ms"]]
        merged["round_medians_ms"] = [statistics.median(r["step_ms"]) for r in ok]
        merged["failed_rounds"] = [r for r in rounds if r["status"] != "ok"]
    return merged


def _merge_paired(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    merged = dict(rounds[0])
    ok = [r for r in rounds if r["status"] == "ok"]
    if merged["status"] == "ok":
        for key in ("a_ms", "b_ms"):
            merged[key] = [t for r in ok for t in r[key]]
        ratios = [b / a for a, b in zip(merged["a_ms"], merged["b_ms"], strict=True)]
        merged["ratio_of_medians"] = statistics.median(merged["b_ms"]) / statistics.median(
            merged["a_ms"]
        )
        merged["median_of_step_ratios"] = statistics.median(ratios)
        merged["round_ratios"] = [
            statistics.median(r["b_ms"]) / statistics.median(r["a_ms"]) for r in ok
        ]
        merged["failed_rounds"] = [
            {"status": r["status"], "error": r.get("error", "")} for r in rounds if r not in ok
        ]
    return merged


def summarise(
    results: list[dict[str, Any]], pairs: list[dict[str, Any]], world: int
) -> dict[str, Any]:
    ideal = next((r for r in results if r["name"] == "ideal" and r["status"] == "ok"), None)
    rows = []
    for r in results:
        row: dict[str, Any] = {"name": r["name"], "label": r["label"], "status": r["status"]}
        for key in ("retried_after", "hung_on_exit"):
            if key in r:
                row[key] = {"status": r[key]["status"], "error": r[key].get("error", "")}
        if r["status"] == "ok":
            median = statistics.median(r["step_ms"])
            q = statistics.quantiles(r["step_ms"], n=4) if len(r["step_ms"]) > 1 else [median] * 3
            row.update(
                median_ms=median,
                iqr_ms=[q[0], q[2]],
                gradient_mib=r["gradient_bytes_per_step"] / MIB,
                all_mib=r["all_bytes_per_step"] / MIB,
                calls=r["calls_per_step"],
                commdebugmode_calls=r["commdebugmode_calls_per_step"],
                peak_memory_mib=r["rss_peak_mib"] - r["rss_before_build_mib"],
                per_kind=r["per_kind"],
            )
            if "flatview_stats_per_step" in r:
                row["flatview_stats_per_step"] = r["flatview_stats_per_step"]
            row["failed_rounds"] = [
                {"status": f["status"], "error": f.get("error", "")} for f in r["failed_rounds"]
            ]
            if ideal is not None:
                rounds = zip(r["round_medians_ms"], ideal["round_medians_ms"], strict=False)
                row.update(
                    time_ratio=median / statistics.median(ideal["step_ms"]),
                    time_ratio_per_round=[m / i for m, i in rounds],
                    gradient_ratio=r["gradient_bytes_per_step"] / ideal["gradient_bytes_per_step"],
                    all_ratio=r["all_bytes_per_step"] / ideal["all_bytes_per_step"],
                    # NOTES.md's peer figures charged all-gathers their input (one shard).
                    gather_input_ratio=(
                        r["gradient_bytes_per_step"]
                        + r["per_kind"].get("all_gather", {}).get("bytes_per_step", 0.0) / world
                    )
                    / ideal["gradient_bytes_per_step"],
                )
        else:
            row["error"] = r.get("error", "")
            for key in ("crash_step", "skipped_at_crash", "traceback"):
                if key in r:
                    row[key] = r[key]
        rows.append(row)
    summary: dict[str, Any] = {"rows": rows}
    summary["pairs"] = pairs
    return summary


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(summary: dict[str, Any], cfg: Config, meta: dict[str, Any]) -> str:
    lines = [
        f"Residual MLP, {cfg.blocks} blocks of {cfg.width}x{cfg.width}, skip p={cfg.skip_prob} "
        f"(same mask on all ranks), batch {cfg.batch} per rank, {cfg.world_size} CPU processes "
        f"over gloo, SGD momentum. Step times: {cfg.rounds} round(s) of {cfg.steps} timed steps "
        f"after {cfg.warmup} warmup, fresh processes each round, pooled; bytes over "
        f"{min(cfg.count_steps, cfg.steps)} counted steps. torch {meta['torch']}, "
        f"load average {meta['load_before']:.1f} before / {meta['load_after']:.1f} after.",
        "",
        "| approach | step ms: median (IQR) | x ideal (range over rounds) | grad MiB/step "
        "| x ideal "
        "| all MiB/step | x ideal | x ideal, gathers at input size | collectives/step "
        "| peak memory MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for row in summary["rows"]:
        if "retried_after" in row:
            notes.append(
                f"- {row['label']}: a first attempt timed out ({row['retried_after']['error']}; "
                "stacks in the JSON) and was rerun in fresh processes."
            )
        if "hung_on_exit" in row:
            notes.append(f"- {row['label']}: a worker hung after reporting; it was killed.")
        for failed in row.get("failed_rounds", []):
            notes.append(
                f"- {row['label']}: one round {failed['status']} (left out): "
                f"`{failed.get('error', '')[:300]}`"
            )
        if row["status"] != "ok":
            error = row.get("error", "").splitlines()[0] if row.get("error") else ""
            where = f" at step {row['crash_step']}" if row.get("crash_step", -1) >= 0 else ""
            lines.append(f"| {row['label']} | **{row['status']}**{where} | | | | | | | | |")
            notes.append(f"- {row['label']}: {row['status']}{where}: `{error[:300]}`")
            continue
        calls = _fmt(row["calls"], ".1f")
        if (
            row["commdebugmode_calls"] is not None
            and abs(row["commdebugmode_calls"] - row["calls"]) > 1e-9
        ):
            calls += f" (CommDebugMode: {row['commdebugmode_calls']:.1f})"
        low, high = row["iqr_ms"]
        ratio = _fmt(row.get("time_ratio"), ".2f")
        per_round = row.get("time_ratio_per_round", [])
        if len(per_round) > 1 and row["name"] != "ideal":
            ratio += f" ({min(per_round):.2f}-{max(per_round):.2f})"
        lines.append(
            f"| {row['label']} | {row['median_ms']:.1f} ({low:.0f}-{high:.0f}) "
            f"| {ratio} "
            f"| {row['gradient_mib']:.2f} | {_fmt(row.get('gradient_ratio'), '.2f')} "
            f"| {row['all_mib']:.2f} | {_fmt(row.get('all_ratio'), '.2f')} "
            f"| {_fmt(row.get('gather_input_ratio'), '.2f')} | {calls} "
            f"| {row['peak_memory_mib']:.0f} |"
        )
    for paired in summary["pairs"]:
        pair = next(p for p in PAIRS if p.name == paired["name"])
        a, b = pair.a[0], pair.b[0]
        lines += ["", f"{pair.title}; same processes, steps interleaved:", ""]
        if paired["status"] != "ok":
            lines.append(f"{paired['status']}: `{paired.get('error', '')}`")
            continue
        lines += [
            "| | step ms: median (IQR) | grad MiB/step | all MiB/step | collectives/step |",
            "|---|---:|---:|---:|---:|",
        ]
        for key, label in (("a", a), ("b", b)):
            ms = paired[f"{key}_ms"]
            q = statistics.quantiles(ms, n=4)
            counted = paired.get("counted", {}).get(key)
            figures = (
                f"{counted['gradient_bytes_per_step'] / MIB:.2f} "
                f"| {counted['all_bytes_per_step'] / MIB:.2f} | {counted['calls_per_step']:.1f}"
                if counted
                else "- | - | -"
            )
            lines.append(
                f"| {label} | {statistics.median(ms):.1f} ({q[0]:.0f}-{q[2]:.0f}) | {figures} |"
            )
        for failed in paired.get("failed_rounds", []):
            lines.append(f"One round {failed['status']} (left out): `{failed['error'][:300]}`")
        lines += [
            "",
            f"{b} / {a}: {paired['ratio_of_medians']:.3f} (ratio of medians), "
            f"{paired['median_of_step_ratios']:.3f} (median of per-step ratios); per round: "
            + ", ".join(f"{r:.3f}" for r in paired["round_ratios"])
            + ".",
        ]
    checks = [
        row for row in summary["rows"] if row["status"] == "ok" and "flatview_stats_per_step" in row
    ]
    if checks:
        lines += [
            "",
            "Cross-check: flatview's own `fv.stats` against the bytes counted at the "
            "collective calls (MiB per step):",
            "",
            "| approach | StepStats.reduced_bytes | counted gradient bytes | StepStats.used_bytes "
            "| StepStats.dense_bytes | agree |",
            "|---|---:|---:|---:|---:|---|",
        ]
        for row in checks:
            stats = row["flatview_stats_per_step"]
            reduced = stats["reduced_bytes"] / MIB
            agree = abs(reduced - row["gradient_mib"]) <= 0.01 * max(row["gradient_mib"], 1e-9)
            lines.append(
                f"| {row['label']} | {reduced:.2f} | {row['gradient_mib']:.2f} "
                f"| {stats['used_bytes'] / MIB:.2f} | {stats['dense_bytes'] / MIB:.2f} "
                f"| {'yes' if agree else '**no**'} |"
            )
    if notes:
        lines += ["", "Notes:", "", *notes]
    return "\n".join(lines) + "\n"


def chart(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in summary["rows"] if r["status"] != "ok" or "time_ratio" in r]
    measured = [r for r in rows if r["status"] == "ok"]
    if not measured:
        return
    fig, axes = plt.subplots(1, 2, figsize=(14, 0.42 * len(rows) + 1.8), sharey=True)
    for ax, key, title in (
        (axes[0], "time_ratio", "median step time / ideal"),
        (axes[1], "gradient_ratio", "gradient bytes / ideal (at the collective calls)"),
    ):
        top = max(r[key] for r in measured)
        for i, r in enumerate(rows):
            if r["status"] != "ok":
                ax.text(0.02 * top, i, r["status"], va="center", fontsize=8, color="tab:red")
                continue
            color = (
                "tab:green"
                if r["name"] == "ideal"
                else "tab:blue"
                if r["name"].startswith("flatview")
                else "tab:grey"
            )
            ax.barh(i, r[key], color=color)
            ax.text(r[key], i, f" {r[key]:.2f}", va="center", fontsize=8)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_title(title)
        ax.set_xlim(0, top * 1.18)
    axes[0].set_yticks(range(len(rows)), [r["label"] for r in rows], fontsize=8)
    axes[0].invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None = None) -> tuple[Config, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (about a minute)")
    parser.add_argument("--steps", type=int, help="timed steps per approach and round (30)")
    parser.add_argument("--rounds", type=int, help="runs of each approach, round-robin (3)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default 5)")
    parser.add_argument("--count-steps", type=int, help="steps of the counting pass (default 8)")
    parser.add_argument("--blocks", type=int, default=Config.blocks)
    parser.add_argument("--width", type=int, default=Config.width)
    parser.add_argument("--batch", type=int, default=Config.batch, help="per rank")
    parser.add_argument("--skip-prob", type=float, default=Config.skip_prob)
    parser.add_argument("--world-size", type=int, default=Config.world_size)
    parser.add_argument("--seed", type=int, default=Config.seed)
    parser.add_argument("--timeout", type=float, default=Config.timeout)
    parser.add_argument("--only", help="comma-separated approach and pair names (see --list)")
    parser.add_argument("--list", action="store_true", help="list the approaches and exit")
    parser.add_argument("--out", default="results/bench")
    args = parser.parse_args(argv)
    quick = dict(steps=15, warmup=2, count_steps=2, rounds=1) if args.quick else {}
    cfg = Config(
        blocks=args.blocks,
        width=args.width,
        batch=args.batch,
        skip_prob=args.skip_prob,
        world_size=args.world_size,
        seed=args.seed,
        timeout=args.timeout,
    )
    cfg = replace(cfg, **quick)
    overrides = {
        k: getattr(args, k)
        for k in ("steps", "warmup", "count_steps", "rounds")
        if getattr(args, k) is not None
    }
    return replace(cfg, **overrides), args


def main(argv: Sequence[str] | None = None) -> int:
    cfg, args = parse_args(argv)
    # Workers are forked from a server that imported these once and never ran any
    # computation: fresh processes without paying seconds of imports per approach.
    mp.set_forkserver_preload(_preload())
    if args.list:
        for approach in APPROACHES:
            print(f"{approach.name:32s} {approach.label}")
        for pair in PAIRS:
            print(f"{pair.name:32s} {pair.title}")
        return 0
    only = set(args.only.split(",")) if args.only else None
    chosen = [
        a for a in APPROACHES if (only is None or a.name in only) and cfg.world_size >= a.min_world
    ]
    if only is not None and "ideal" not in only:
        chosen.insert(0, APPROACHES[0])  # ratios need it
    pairs = [p for p in PAIRS if only is None or p.name in only]
    started = time.perf_counter()
    meta: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_before": os.getloadavg()[0],
        "config": asdict(cfg),
        "memory_measure": "rank 0's VmHWM during the memory pass (fixed 64 KiB mmap threshold, "
        "peak reset first) minus its VmRSS before the model was built, in MiB",
    }
    print(
        f"{len(chosen) + len(pairs)} runs per round, {cfg.world_size} processes each: "
        f"{asdict(cfg)}",
        flush=True,
    )
    # Round-robin over the approaches, fresh processes every time: when the machine's
    # load drifts (it is shared), every approach sees a bit of each phase.
    runs: dict[str, list[dict[str, Any]]] = {a.name: [] for a in chosen}
    paired_runs: dict[str, list[dict[str, Any]]] = {p.name: [] for p in pairs}
    for round_index in range(cfg.rounds):
        print(f"round {round_index + 1} of {cfg.rounds}", flush=True)
        for approach in chosen:
            earlier = runs[approach.name]
            if earlier and earlier[0]["status"] != "ok":
                continue  # a crash or a missing backend does not change between rounds
            t0 = time.perf_counter()
            result = run_in_fresh_processes(
                approach_worker, (approach.name, cfg, round_index == 0), cfg
            )
            result.update(name=approach.name, label=approach.label, expected=approach.expect)
            result["wall_s"] = time.perf_counter() - t0
            earlier.append(result)
            brief = (
                f"median {statistics.median(result['step_ms']):7.1f} ms"
                if result["status"] == "ok"
                else f"{result['status']}: {result.get('error', '')[:100]}"
            )
            print(f"  {approach.name:30s} {result['wall_s']:5.1f} s  {brief}", flush=True)
        for pair in pairs:
            t0 = time.perf_counter()
            paired = run_in_fresh_processes(paired_worker, (pair.name, cfg, round_index == 0), cfg)
            paired.setdefault("name", pair.name)
            paired["wall_s"] = time.perf_counter() - t0
            paired_runs[pair.name].append(paired)
            brief = (
                f"{pair.b[0]} / {pair.a[0]}: "
                f"{statistics.median(paired['b_ms']) / statistics.median(paired['a_ms']):.3f}"
                if paired["status"] == "ok"
                else f"{paired['status']}: {paired.get('error', '')[:100]}"
            )
            print(f"  {pair.name:30s} {paired['wall_s']:5.1f} s  {brief}", flush=True)
    results = [_merge_rounds(runs[a.name]) for a in chosen]
    merged_pairs = [_merge_paired(paired_runs[p.name]) for p in pairs]
    meta["load_after"] = os.getloadavg()[0]
    meta["wall_s"] = time.perf_counter() - started

    summary = summarise(results, merged_pairs, cfg.world_size)
    summary["meta"] = meta
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(summary, cfg, meta)
    (out / "bench_skip.md").write_text(table)
    (out / "bench_skip.json").write_text(json.dumps({**summary, "raw": results}, indent=1))
    chart(summary, out / "bench_skip.png")
    print()
    print(table)
    print(
        f"written: {out / 'bench_skip.md'}, {out / 'bench_skip.json'}, "
        f"{out / 'bench_skip.png'} ({meta['wall_s']:.0f} s in all)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
