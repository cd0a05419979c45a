"""Worker functions of ``test_integrations``: the Lightning Trainer, Fabric and accelerate,
run inside the suite's worker pools.

The frameworks normally start their own processes; here they join the pool's gloo
group instead (:func:`framework_env`: the variables a launcher would set, so that
Lightning's default environment and accelerate's state see an already started
multi-process run, restored afterwards, with every file written to a temporary
directory). Each training function returns rank 0's final parameters (by name relative
to the user's model, as :class:`tests.scenarios.Net` names them) for comparison with
:func:`reference` (one process, no wrapper, the same Lightning/accelerate semantics:
zeroing, loss scaling under accumulation, clipping).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from tests.scenarios import GATED, Net, Scenario, batch, local_batch, loss_of, make_net, skip_names

SCENARIO = GATED
"""Four gated blocks and an aux layer; every kind of skip occurs across its 5 batches."""
EVEN = replace(GATED, skips=GATED.skips[:4])
"""Its first 4 batches: two optimizer steps of 2 batches each."""


@dataclass(frozen=True)
class Run:
    """One training run: what the reference and the frameworks do alike."""

    scenario: Scenario = SCENARIO
    manual: bool = False
    """Manual optimization (several optimizers, one step per batch); else one optimizer
    with parameter groups per submodule, stepped every ``accumulate`` batches."""
    accumulate: int = 1
    clip: float | None = None
    """Clip gradients by their total norm (over the optimizer's parameters)."""
    epochs: int = 1
    """Epochs the batches are split into (a checkpoint is taken between them)."""
    validate: bool = False
    """Lightning's Trainer: a validation loop after every training batch (a loss logged
    with ``sync_dist``), its sanity check before training too; the reference does not
    validate: validation must change nothing."""

    @property
    def batches(self) -> int:
        return len(self.scenario.skips)

    @property
    def per_epoch(self) -> int:
        assert self.batches % self.epochs == 0, self
        return self.batches // self.epochs


# --------------------------------------------------------------------- the reference


def param_groups(net: Net) -> list[dict[str, Any]]:
    """One optimizer's parameter groups, per submodule (the ``self.<sub>.parameters()``
    idiom the integrations exist for)."""
    body = net.body
    rest = [*net.stem.parameters(), *net.head.parameters()]
    if net.aux is not None:
        rest += list(net.aux.parameters())
    return [
        {"params": list(body[0::2].parameters()), "lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
        {"params": list(body[1::2].parameters()), "lr": 0.05, "momentum": 0.5},
        {"params": rest, "lr": 0.1},
    ]


def make_optimizers(net: Net, run: Run) -> list[torch.optim.Optimizer]:
    if run.manual:
        return [
            torch.optim.AdamW(net.body.parameters(), lr=0.05, weight_decay=0.1),
            torch.optim.SGD(
                [*net.stem.parameters(), *net.head.parameters(), *net.aux.parameters()],
                lr=0.1,
                momentum=0.9,
            ),
        ]
    return [torch.optim.SGD(param_groups(net))]


def reference(run: Run) -> dict[str, np.ndarray]:
    """The run in one process on whole batches; skipped parts do not run."""
    scenario = run.scenario
    net = make_net(scenario)
    opts = make_optimizers(net, run)
    for micro in range(run.batches):
        x, y = batch(scenario, micro)
        loss = loss_of(net(x, skip_names(scenario, micro)), y) / run.accumulate
        if micro % run.accumulate == 0:
            for opt in opts:
                opt.zero_grad()
        loss.backward()
        if (micro + 1) % run.accumulate == 0:
            if run.clip is not None:
                for opt in opts:
                    params = [p for group in opt.param_groups for p in group["params"]]
                    torch.nn.utils.clip_grad_norm_(params, run.clip)
            for opt in opts:
                opt.step()
    return {name: p.detach().numpy().copy() for name, p in net.named_parameters()}


# --------------------------------------------------------------- the environment


def call(module: str, name: str, *args: Any, **kwargs: Any) -> Any:
    """Run ``module.name(*args, **kwargs)``: the pool task for framework workers, so that
    only the workers import the frameworks (seconds each), never the test process."""
    return getattr(importlib.import_module(module), name)(*args, **kwargs)


@contextlib.contextmanager
def framework_env() -> Iterator[str]:
    """A launcher's variables for this pool rank, a temporary directory to work in, quiet
    framework loggers; everything restored on exit."""
    saved_env = dict(os.environ)
    saved_cwd = os.getcwd()
    threads = torch.get_num_threads()
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(
        LOCAL_RANK=str(rank),
        RANK=str(rank),
        NODE_RANK="0",
        GROUP_RANK="0",
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
    )
    quiet = [logging.getLogger(n) for n in ("lightning", "pytorch_lightning", "accelerate")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    # One directory for all ranks (checkpoints are written by rank 0 and read by all),
    # made by rank 0 and removed by it once every rank is done.
    box = [tempfile.mkdtemp(prefix="flatview_integrations_") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    tmp = box[0]
    assert tmp is not None
    try:
        os.chdir(tmp)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield tmp
        dist.barrier()  # not after an error: the others may wait in another collective
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        torch.set_num_threads(threads)
        for logger, level in zip(quiet, levels, strict=True):
            logger.setLevel(level)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)


def local_batches(run: Run) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's chunk of every batch, in order."""
    return [local_batch(run.scenario, micro) for micro in range(run.batches)]


def params_of(module: nn.Module) -> dict[str, np.ndarray]:
    """Full parameters by name (FSDP2's DTensors gathered; a torch FSDP1 model's full
    state dict), on every rank."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if isinstance(module, FSDP):
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType

        config = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
        with FSDP.state_dict_type(module, StateDictType.FULL_STATE_DICT, config):
            state = module.state_dict()
        return {name: value.detach().cpu().numpy().copy() for name, value in state.items()}
    out = {}
    for name, param in module.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        out[name] = full.detach().cpu().numpy().copy()
    return out


def without_prefix(params: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {name.removeprefix(prefix): value for name, value in params.items()}


def names(skip: Sequence[str], prefix: str) -> list[str]:
    return [prefix + name for name in skip]


# ------------------------------------------- accelerate's FSDP1 order, without accelerate


class FakeFSDP1Accelerator:
    """What :func:`flatview.integrations.accelerate.prepare` uses of an ``Accelerator``
    under FSDP1, which accelerate runs only on GPUs: ``prepare`` wraps a model in torch
    FSDP1 (on CPU here: flat parameters, a unit per block) and returns optimizers as
    they are; ``clip_grad_norm_`` is accelerate's fallback (torch's, on the pieces)."""

    distributed_type = "FSDP"
    is_fsdp2 = False
    num_processes = 2

    def prepare(self, *objs: Any) -> Any:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        from tests.scenarios import Block

        out = [
            FSDP(
                obj,
                device_id=torch.device("cpu"),
                use_orig_params=False,
                auto_wrap_policy=ModuleWrapPolicy({Block}),
            )
            if isinstance(obj, nn.Module)
            else obj
            for obj in objs
        ]
        return tuple(out) if len(out) > 1 else out[0]

    def unscale_gradients(self) -> None:
        pass

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        return torch.nn.utils.clip_grad_norm_(list(parameters), max_norm, norm_type)


def accelerate_fsdp1_order(run: Run) -> dict[str, np.ndarray] | None:
    """Train ``run`` through ``prepare`` on :class:`FakeFSDP1Accelerator`: the optimizers
    are built over views (FSDP1's flat parameters would be all they could get before),
    and ``accelerator.clip_grad_norm_`` over them is routed to the whole norm."""
    from flatview.integrations.accelerate import prepare

    accelerator = FakeFSDP1Accelerator()
    net = make_net(run.scenario)
    model, fv, opts = prepare(accelerator, net, lambda m: make_optimizers(m, run))
    for micro, (x, y) in enumerate(local_batches(run)):
        skip = skip_names(run.scenario, micro)
        with fv.step(skip=skip):
            loss_of(model(x, skip), y).backward()
        if run.clip is not None:
            for opt in opts:
                params = [p for group in opt.param_groups for p in group["params"]]
                accelerator.clip_grad_norm_(params, run.clip)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    params = params_of(model)
    return params if dist.get_rank() == 0 else None


# ------------------------------------------------------------------ Muon through Whole


class MuonNet(nn.Module):
    """Three bias-free layers (Muon steps matrices only); ``mid`` is a residual block
    that a micro-batch may skip (:func:`skips_mid`)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.inp = nn.Linear(6, 8, bias=False)
        self.mid = nn.Linear(8, 8, bias=False)
        self.out = nn.Linear(8, 3, bias=False)

    def forward(self, x: torch.Tensor, skip_mid: bool) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if not skip_mid:
            h = h + torch.tanh(self.mid(h))
        out: torch.Tensor = self.out(h)
        return out


MUON_OPTIONS = {"lr": 0.05, "momentum": 0.9}


def muon_batch(micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * micro + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def skips_mid(micro: int) -> bool:
    return micro % 2 == 1


def muon_reference(micros: int, accumulate: int) -> dict[str, torch.Tensor]:
    """``torch.optim.Muon`` on the unwrapped :class:`MuonNet` over ``micros``
    micro-batches, a step every ``accumulate``: each gradient the mean of the ranks'
    (this process group's size), divided by ``accumulate`` (as accelerate's backward
    divides the loss). Call inside ``whole_workers.newton_schulz`` as the run does."""
    net = MuonNet()
    opt = torch.optim.Muon(net.parameters(), **MUON_OPTIONS)
    world = dist.get_world_size()
    for start in range(0, micros, accumulate):
        opt.zero_grad()
        for micro in range(start, start + accumulate):
            batches = [muon_batch(micro, r) for r in range(world)]
            losses = [nn.functional.mse_loss(net(x, skips_mid(micro)), y) for x, y in batches]
            (torch.stack(losses).sum() / (world * accumulate)).backward()
        opt.step()
    return {n: p.detach() for n, p in net.named_parameters()}


def worst_difference(mine: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """The largest difference, relative to each parameter's largest value."""
    return max(float((mine[n] - expected[n]).abs().max() / expected[n].abs().max()) for n in mine)
