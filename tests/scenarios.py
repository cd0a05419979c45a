"""Models, data and training runs shared by the equivalence tests.

A :class:`Scenario` is a picklable description of one training run: model shapes,
wrapping, world size, optimizers and the skip set of every step. The same scenario is
run twice: distributed, with FSDP and flatview, in the worker pool
(:func:`run_distributed`), and as the reference, in one process without any wrapper
(:func:`run_reference`), where skipped blocks are simply not executed. Their final
parameters must agree.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from hypothesis import strategies as st
from torch import nn


class Block(nn.Module):
    """A residual block whose inner width differs from the model width, so parameter
    sizes vary and pieces straddle shard boundaries."""

    def __init__(self, width: int, inner: int, norm: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width) if norm else None
        self.up = nn.Linear(width, inner)
        self.down = nn.Linear(inner, width, bias=False)
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x) if self.norm is not None else x
        return x + self.gain * self.down(torch.tanh(self.up(h)))


class Net(nn.Module):
    def __init__(self, scenario: Scenario) -> None:
        super().__init__()
        s = scenario
        self.stem = nn.Linear(s.in_dim, s.width)
        self.body = nn.Sequential(
            *[Block(s.width, inner, norm) for inner, norm in zip(s.inner, s.norms, strict=True)]
        )
        self.head = nn.Linear(s.width, s.classes)
        if s.tie:
            # A tied pair inside one unit: the head's bias is the stem's bias when shapes
            # allow, else an extra module sharing the head's weight.
            self.head_copy = nn.Linear(s.width, s.classes)
            self.head_copy.weight = self.head.weight

    def forward(self, x: torch.Tensor, skip: tuple[int, ...] = ()) -> torch.Tensor:
        x = self.stem(x)
        for index, block in enumerate(self.body):
            if index not in skip:
                x = block(x)
        out = self.head(x)
        if hasattr(self, "head_copy"):
            out = out + 0.5 * self.head_copy(x)
        return out


@dataclass(frozen=True)
class Scenario:
    world_size: int
    in_dim: int = 3
    width: int = 4
    inner: tuple[int, ...] = (5, 3)
    norms: tuple[bool, ...] = (True, False)
    classes: int = 3
    nested: bool = True
    tie: bool = False
    skips: tuple[tuple[int, ...], ...] = ((), (1,), (0,))
    set_to_none: bool = True
    batch_per_rank: int = 3
    seed: int = 0
    backend: str = "fairscale"
    check: bool = True
    frozen: tuple[str, ...] = ()
    """Name prefixes of parameters frozen (``requires_grad_(False)``) before training."""
    options: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


@st.composite
def scenarios(
    draw: st.DrawFn, world_sizes: tuple[int, ...] = (1, 2, 3, 4), backend: str = "fairscale"
) -> Scenario:
    blocks = draw(st.integers(1, 4))
    return Scenario(
        world_size=draw(st.sampled_from(world_sizes)),
        in_dim=draw(st.integers(1, 5)),
        width=draw(st.integers(1, 6)),
        inner=tuple(draw(st.integers(1, 7)) for _ in range(blocks)),
        norms=tuple(draw(st.booleans()) for _ in range(blocks)),
        classes=draw(st.integers(2, 4)),
        nested=draw(st.booleans()),
        tie=draw(st.booleans()),
        skips=tuple(
            tuple(sorted(draw(st.sets(st.integers(0, blocks - 1)))))
            for _ in range(draw(st.integers(2, 4)))
        ),
        set_to_none=draw(st.booleans()),
        batch_per_rank=draw(st.integers(1, 3)),
        seed=draw(st.integers(0, 2**16)),
        backend=backend,
    )


def batch(scenario: Scenario, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one step: rank ``r`` trains on its ``r``-th chunk."""
    g = torch.Generator().manual_seed(scenario.seed * 1000 + step)
    n = scenario.batch_per_rank * scenario.world_size
    return torch.randn(n, scenario.in_dim, generator=g), torch.randint(
        0, scenario.classes, (n,), generator=g
    )


def make_net(scenario: Scenario) -> Net:
    torch.manual_seed(scenario.seed)
    return Net(scenario)


def optimizers(net_like: Any) -> list[torch.optim.Optimizer]:
    """Per-submodule optimizers of different kinds, built from ``.parameters()`` of the
    original submodules (views, once wrapped)."""
    groups = [
        torch.optim.AdamW(net_like.body.parameters(), lr=0.05, weight_decay=0.1),
        torch.optim.SGD(net_like.head.parameters(), lr=0.1, momentum=0.9),
        torch.optim.SGD(net_like.stem.parameters(), lr=0.1),
    ]
    if hasattr(net_like, "head_copy"):
        own = [p for n, p in net_like.head_copy.named_parameters() if n != "weight"]
        groups.append(torch.optim.SGD(own, lr=0.1))
    return groups


def freeze(named: Any, scenario: Scenario) -> None:
    for name, param in named:
        if name.startswith(scenario.frozen) and scenario.frozen:
            param.requires_grad_(False)


def run_reference(scenario: Scenario) -> dict[str, np.ndarray]:
    net = make_net(scenario)
    freeze(net.named_parameters(), scenario)
    opts = optimizers(net)
    for step, skip in enumerate(scenario.skips):
        x, y = batch(scenario, step)
        nn.functional.cross_entropy(net(x, skip), y).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=scenario.set_to_none)
    return {k: v.detach().numpy().copy() for k, v in net.named_parameters()}


# ---------------------------------------------------------------- distributed side


@contextlib.contextmanager
def backend_context(backend: str) -> Iterator[None]:
    if backend == "fairscale":
        from flatview.testing import fairscale_on_cpu

        with fairscale_on_cpu():
            yield
    else:
        yield


def wrap_fsdp(scenario: Scenario, net: Net) -> nn.Module:
    """FSDP-wrap ``net`` as the scenario says (each block its own unit when nested)."""
    if scenario.backend == "fairscale":
        from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

        opts = {"flatten_parameters": True, **scenario.options}
        if scenario.nested:
            for i in range(len(net.body)):
                net.body[i] = FSDP(net.body[i], **opts)
        return FSDP(net, **opts)
    raise ValueError(f"unknown backend {scenario.backend}")


def full_state(model: nn.Module, scenario: Scenario) -> dict[str, np.ndarray] | None:
    """The unsharded parameters by original name, on rank 0 (collective)."""
    state = model.state_dict()
    if dist.get_rank() != 0:
        return None
    names = {k for k, _ in make_net(scenario).named_parameters()}
    return {k: v.detach().float().numpy().copy() for k, v in state.items() if k in names}


def run_distributed(scenario: Scenario) -> dict[str, np.ndarray] | None:
    """Train with FSDP + flatview in the worker pool; rank 0 returns the parameters."""
    import flatview

    rank, world = dist.get_rank(), dist.get_world_size()
    with backend_context(scenario.backend):
        model = wrap_fsdp(scenario, make_net(scenario))
        fv = flatview.wrap(model)
        freeze(fv.named_parameters(), scenario)
        net_like = _original_tree(model)
        opts = optimizers(net_like)
        for step, skip in enumerate(scenario.skips):
            x, y = batch(scenario, step)
            xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
            with fv.step(skip=[f"body.{i}" for i in skip], check=scenario.check):
                nn.functional.cross_entropy(model(xs, skip), ys).backward()
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=scenario.set_to_none)
        return full_state(model, scenario)


def _original_tree(model: nn.Module) -> Any:
    """The user's module inside the outermost wrapper (``model.module`` for both)."""
    inner = model.module
    return getattr(inner, "module", inner)


def compare(
    got: dict[str, np.ndarray], want: dict[str, np.ndarray], tolerance: float = 1e-5
) -> None:
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for name in want:
        np.testing.assert_allclose(
            got[name], want[name], rtol=10 * tolerance, atol=tolerance, err_msg=name
        )
