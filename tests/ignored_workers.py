"""Worker of tests/test_backend_edges.py's parameters the wrapper was told to ignore (torch
FSDP1's ``ignored_modules``, FSDP2's ``ignored_params``, DDP's
``parameters_to_ignore``): nobody gathers or reduces them, so the user all-reduces
their gradients, as with the bare wrapper. Skip sets leave a unit's managed parameters
all skipped while an ignored one under it is used; the run must end where the
single-process reference does."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import flatview

SKIPS: tuple[tuple[str, ...], ...] = (
    (),
    ("head",),
    # The root's managed parameters (side) all skipped, the ignored head used; block 1's
    # managed layer skipped, its ignored aux used: the unit is still called.
    ("side", "body.1.lin"),
    ("head", "body.0"),
    ("body.1",),
    (),
)
IGNORED = ("head", "body.1.aux")
CLIP = 0.3
"""Clipped by the global norm, ignored parameters included (it bites every step)."""


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.aux = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, name: str, skip: Collection[str]) -> torch.Tensor:
        if f"{name}.lin" not in skip:
            x = torch.tanh(self.lin(x))
        if f"{name}.aux" not in skip:
            x = x + 0.5 * torch.tanh(self.aux(x))
        return x


class IgnoringNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(6, 2)
        self.side = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor, skip: Collection[str] = ()) -> torch.Tensor:
        for i, block in enumerate(self.body):
            if f"body.{i}" not in skip:
                x = block(x, f"body.{i}", skip)
        out = self.head(x) if "head" not in skip else x[:, :2]
        return out + self.side(x) if "side" not in skip else out


def _batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(4 * world, 6, generator=g), torch.randn(4 * world, 2, generator=g)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def _ignored(net: IgnoringNet) -> list[nn.Parameter]:
    return [p for name in IGNORED for p in net.get_submodule(name).parameters()]


def _wrap(backend: str, net: IgnoringNet) -> nn.Module:
    ignored = _ignored(net)
    if backend.startswith("torch"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy

        # "torch:NO_SHARD": flatview computes on the views, reducing as for DDP;
        # "torch:orig": use_orig_params=True.
        option = backend.partition(":")[2]
        strategy = ShardingStrategy["FULL_SHARD" if option in ("", "orig") else option]
        kwargs: dict[str, Any] = {
            "device_id": torch.device("cpu"),
            "sharding_strategy": strategy,
            "use_orig_params": option == "orig",
        }
        for i, block in enumerate(net.body):
            inner = [block.aux] if i == 1 else None
            net.body[i] = FSDP(block, ignored_modules=inner, **kwargs)
        return FSDP(net, ignored_modules=[net.head], **kwargs)
    if backend == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for i, block in enumerate(net.body):
            fully_shard(block, ignored_params=set(block.aux.parameters()) if i == 1 else None)
        return fully_shard(net, ignored_params=set(ignored))  # type: ignore[no-any-return]
    from torch.nn.parallel import DistributedDataParallel

    names = [n for n, p in net.named_parameters() if any(p is q for q in ignored)]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(net, names)
    return DistributedDataParallel(net)


def _full(model: nn.Module, backend: str) -> dict[str, np.ndarray]:
    if backend.startswith("torch"):
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        config = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            state = model.state_dict()
    elif backend == "fsdp2":
        state = {
            k: v.full_tensor() if hasattr(v, "full_tensor") else v
            for k, v in model.state_dict().items()
        }
    else:
        state = model.module.state_dict()  # type: ignore[operator]
    return {k: v.detach().numpy().copy() for k, v in state.items()}


def train_ignoring(backend: str) -> dict[str, Any]:
    """Train :class:`IgnoringNet` wrapped by ``backend`` with flatview through
    :data:`SKIPS` (SGD with momentum over ``fv.parameters()``), the ignored gradients
    averaged by hand, clipped by ``fv.clip_grad_norm_``; the full parameters, and per
    step the names whose gradient was ``None`` on this rank."""
    net = IgnoringNet()
    ignored = _ignored(net)
    model = _wrap(backend, net)
    fv = flatview.wrap(model)
    opt = torch.optim.SGD(fv.parameters(), lr=0.1, momentum=0.9)
    world, rank = dist.get_world_size(), dist.get_rank()
    nones, norms = [], []
    for step, skip in enumerate(SKIPS):
        x, y = (t.chunk(world)[rank] for t in _batch(step, world))
        with fv.step(skip=list(skip)):
            _loss(model(x, skip), y).backward()
        for param in ignored:
            if param.grad is not None:
                dist.all_reduce(param.grad)
                param.grad /= world
        nones.append(sorted(n for n, p in fv.named_parameters() if p.grad is None))
        norms.append(float(fv.clip_grad_norm_(CLIP)))
        opt.step()
        opt.zero_grad()
    return {"params": _full(model, backend), "nones": nones, "norms": norms}


def reference(world: int) -> dict[str, np.ndarray]:
    """:func:`train_ignoring`'s training on ``world`` ranks, in one process, unwrapped."""
    net = IgnoringNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step, skip in enumerate(SKIPS):
        x, y = _batch(step, world)
        _loss(net(x, skip), y).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}
