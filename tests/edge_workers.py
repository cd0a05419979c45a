"""Worker functions for tests/test_backend_edges.py: wrapper configurations at the edges
of what the backends describe (units without parameters of their own, parameters shared
across units, nested units given to ``wrap``, fairscale's gradient clipping and CPU
offload, summoning on torch ``NO_SHARD`` computed on views).

Each returns plain data (or raises) for the test process to assert on.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Collection
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import flatview
from flatview.errors import FlatViewError
from tests.scenarios import (
    Scenario,
    _original_tree,
    backend_context,
    batch,
    full_state,
    local_batch,
    loss_of,
    make_net,
    optimizers,
    skip_names,
    wrap_fsdp,
)

STEPS = 3


class Chain(nn.Module):
    """Four small layers, any of which a step may leave out by name (``l0`` .. ``l3``)."""

    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l0 = nn.Linear(3, 4)
        self.l1 = nn.Linear(4, 4)
        self.l2 = nn.Linear(4, 4)
        self.l3 = nn.Linear(4, 2)
        if tie:
            # fairscale's shared-weight test shares a weight between l1 and l3 (square).
            self.l3 = nn.Linear(4, 4)
            self.l1.weight = self.l3.weight

    def forward(self, x: torch.Tensor, skip: Collection[str] = ()) -> torch.Tensor:
        for name in ("l0", "l1", "l2", "l3"):
            if name not in skip:
                x = torch.tanh(getattr(self, name)(x))
        return x


def _batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(2 * world, 3, generator=g), torch.randn(2 * world, 1, generator=g)


def _local(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _batch(step, dist.get_world_size())
    rank, world = dist.get_rank(), dist.get_world_size()
    return x.chunk(world)[rank], y.chunk(world)[rank]


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out.sum(dim=1, keepdim=True) - y) ** 2).mean()


def _fairscale_chain(kind: str) -> nn.Module:
    """``all_wrapped``: every layer its own unit, the root holds nothing;
    ``shared``: fairscale's own shared-weight model (unflattened siblings l1 and l3 share
    a weight, registered with ``append_shared_param``; l0 stays in the root)."""
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

    if kind == "all_wrapped":
        net = Chain()
        for name in ("l0", "l1", "l2", "l3"):
            setattr(net, name, FSDP(getattr(net, name)))
        return FSDP(net)
    assert kind == "shared", kind
    net = Chain(tie=True)
    net.l1 = FSDP(net.l1, flatten_parameters=False)
    net.l2 = FSDP(net.l2)
    net.l3 = FSDP(net.l3, flatten_parameters=False)
    net.l3.append_shared_param(net.l1.module.weight)
    return FSDP(net)


def _train(
    model: nn.Module,
    params: list[nn.Parameter],
    fv: flatview.FlatView | None,
    skips: list[tuple[str, ...]],
    local: bool,
) -> list[float]:
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    losses = []
    for step, skip in enumerate(skips):
        x, y = _local(step) if local else _batch(step, dist.get_world_size())
        declared = fv.step(skip=list(skip)) if fv is not None else contextlib.nullcontext()
        with declared:
            loss = _loss(model(x, skip), y)
            loss.backward()
        losses.append(float(loss))
        opt.step()
        opt.zero_grad()
    return losses


def _state(model: nn.Module, names: Collection[str]) -> dict[str, np.ndarray]:
    state = model.state_dict()
    return {k: v.detach().clone().numpy() for k, v in state.items() if k in names}


def fairscale_units_edge(kind: str, skips: list[tuple[str, ...]]) -> dict[str, Any]:
    """Train ``kind`` (see :func:`_fairscale_chain`) three ways: bare fairscale (no
    skips: it cannot skip a nested unit), fairscale + flatview with the same steps, and
    fairscale + flatview with ``skips`` (one tuple of layer names per step); in one process
    the same steps on the unwrapped model. Rank 0 returns every final state."""
    reference: dict[str, dict[str, np.ndarray]] = {}
    for skipping in (False, True):
        net = Chain(tie=kind == "shared")
        _train(net, list(net.parameters()), None, skips if skipping else [()] * STEPS, False)
        reference[str(skipping)] = {n: p.detach().numpy().copy() for n, p in net.named_parameters()}
    names = set(reference["False"])
    out: dict[str, Any] = {"reference": reference}
    with backend_context("fairscale"):
        plain = _fairscale_chain(kind)
        _train(plain, list(plain.parameters()), None, [()] * STEPS, local=True)
        out["plain"] = _state(plain, names)
        for skipping in (False, True):
            model = _fairscale_chain(kind)
            fv = flatview.wrap(model)
            out[f"names-{skipping}"] = [n for n, _ in fv.named_parameters()]
            _train(model, list(fv.parameters()), fv, skips if skipping else [()] * STEPS, True)
            out[f"flatview-{skipping}"] = _state(model, names)
    return out if dist.get_rank() == 0 else {}


def fairscale_clip(scenario: Scenario, norm_type: float, max_norm: float) -> dict[str, Any]:
    """Train ``scenario`` (one fairscale unit, so that bare fairscale can leave blocks
    out too) with ``clip_grad_norm_`` before every step, plain and with flatview. Plain
    SGD: a zero gradient (plain) and ``None`` (flatview, skipped) step alike. Returns
    both runs' norms, and on rank 0 both final states."""
    out: dict[str, Any] = {}
    for use_flatview in (False, True):
        with backend_context("fairscale"):
            model = wrap_fsdp(scenario, make_net(scenario))
            fv = flatview.wrap(model) if use_flatview else None
            params = list(fv.parameters() if fv is not None else model.parameters())
            opt = torch.optim.SGD(params, lr=0.1)
            norms = []
            for micro in range(len(scenario.skips)):
                x, y = local_batch(scenario, micro)
                skip = skip_names(scenario, micro)
                declared = fv.step(skip=list(skip)) if fv is not None else contextlib.nullcontext()
                with declared:
                    loss_of(model(x, skip), y).backward()
                norms.append(float(model.clip_grad_norm_(max_norm, norm_type=norm_type)))
                opt.step()
                opt.zero_grad()
            key = "flatview" if use_flatview else "plain"
            out[f"{key}-norms"] = norms
            out[f"{key}-state"] = full_state(model, scenario)
            if fv is not None:
                out["empty"] = sorted(n for n, p in fv.named_parameters() if p.numel() == 0)
    return out


def no_shard_summon_mid_iteration(scenario: Scenario) -> dict[str, Any]:
    """torch ``NO_SHARD``: per step a forward, ``summon_full_params`` (which writes the
    local shard back onto itself), a second forward, then one backward through both;
    bare FSDP and FSDP + flatview (computed on views). Rank 0 returns both final
    states and the adapter flatview took."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    out: dict[str, Any] = {}
    for use_flatview in (False, True):
        model = wrap_fsdp(scenario, make_net(scenario))
        fv = flatview.wrap(model) if use_flatview else None
        params = list(fv.parameters() if fv is not None else model.parameters())
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        for micro in range(len(scenario.skips)):
            x, y = local_batch(scenario, micro)
            declared = fv.step() if fv is not None else contextlib.nullcontext()
            with declared:
                first = loss_of(model(x), y)
                with TorchFSDP.summon_full_params(model):
                    pass
                second = loss_of(model(2 * x), y)
                (first + second).backward()
            opt.step()
            opt.zero_grad()
        key = "flatview" if use_flatview else "plain"
        out[key] = full_state(model, scenario)
        if fv is not None:
            out["adapter"] = type(fv.adapter).__name__
    return out


def wrap_nested_before_forward(scenario: Scenario) -> str:
    """Give ``wrap`` a nested unit (``body.0``) of a model that has not run a forward
    yet, then train the real root one step: returns where flatview refused ("wrap" or
    "forward") and its message. Raises if nothing refused it."""
    with backend_context(scenario.backend):
        model = wrap_fsdp(scenario, make_net(scenario))
        inner = _original_tree(model).body[0]
        try:
            fv = flatview.wrap(inner)
        except flatview.WrapError as err:
            return f"wrap: {err}"
        x, y = local_batch(scenario, 0)
        try:
            with fv.step():
                loss_of(model(x), y).backward()
        except flatview.WrapError as err:
            return f"forward: {err}"
    raise AssertionError("a nested unit was wrapped and trained")


def fairscale_unflatten_params(scenario: Scenario, alone: bool) -> dict[str, Any]:
    """fairscale's public ``unflatten_params()`` context (the first seed's remedy), on the
    root's flattening wrapper: inside it the head's original parameters (their shapes),
    doubled in place there; then training. Bare fairscale, then fairscale + flatview;
    what either raised instead (unflattening a sharded flat parameter fails). ``alone``:
    each rank's FSDP on a process group of its own (unsharded, as at world size 1, in
    the pool's processes)."""
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FairscaleFSDP

    out: dict[str, Any] = {}
    # Every rank makes every group (new_group is collective), and keeps its own.
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    for use_flatview in (False, True):
        key = "flatview" if use_flatview else "plain"
        with backend_context(scenario.backend):
            if alone:
                own = groups[dist.get_rank()]
                model = FairscaleFSDP(
                    make_net(scenario), flatten_parameters=True, process_group=own
                )
            else:
                model = wrap_fsdp(scenario, make_net(scenario))
            fv = flatview.wrap(model) if use_flatview else None
            head = _original_tree(model).head
            try:
                with model.unflatten_params():
                    out[f"{key}-shapes"] = [tuple(p.shape) for p in head.parameters()]
                    with torch.no_grad():
                        head.weight.mul_(2.0)
            except Exception as error:  # compared with bare fairscale's
                out[f"{key}-error"] = f"{type(error).__name__}: {error}"
                continue
            params = list(fv.parameters() if fv is not None else model.parameters())
            opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
            for micro in range(STEPS):
                x, y = local_batch(scenario, micro)
                with fv.step() if fv is not None else contextlib.nullcontext():
                    loss_of(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            # Alone, each rank trained on its own batch: rank 0's parameters, as they are.
            out[key] = (
                {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
                if alone
                else full_state(model, scenario)
            )
    return out


def cast_after_wrap(scenario: Scenario, optimizers_first: bool) -> dict[str, Any]:
    """The net wrapped in FSDP and flatview, then cast to float64 (``model.double()``:
    torch lets a model be cast between the wrapper's construction and its first
    forward), the scenario's optimizers built before the cast or after it, the scenario
    trained on float64 batches; then ``unwrap()`` and, but on DDP (whose reducer was
    built for float32, see the warning), one more step on the bare wrapper with SGD over
    its own parameters. Returns the views' dtypes right after the cast, the dtypes of
    every gradient the optimizers met, what ``unwrap()`` warned, and (rank 0) the final
    float64 state."""
    with backend_context(scenario.backend):
        model = wrap_fsdp(scenario, make_net(scenario))
        fv = flatview.wrap(model, **scenario.flatview_options)
        opts = optimizers(_original_tree(model)) if optimizers_first else []
        model.double()
        if not optimizers_first:
            opts = optimizers(_original_tree(model))
        after_cast = sorted({str(p.dtype) for p in fv.parameters()})
        grads: set[str] = set()
        for micro in range(len(scenario.skips)):
            x, y = local_batch(scenario, micro)
            skip = skip_names(scenario, micro)
            with fv.step(skip=skip):
                loss_of(model(x.double(), skip), y).backward()
            for opt in opts:
                params = [p for group in opt.param_groups for p in group["params"]]
                grads |= {str(p.grad.dtype) for p in params if p.grad is not None}
                opt.step()
                opt.zero_grad()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fv.unwrap()
        if scenario.backend != "ddp":
            bare = torch.optim.SGD(model.parameters(), lr=0.1)
            x, y = local_batch(scenario, len(scenario.skips))
            loss_of(model(x.double()), y).backward()
            bare.step()
        return {
            "after_cast": after_cast,
            "grads": sorted(grads),
            "unwrap_warnings": [str(w.message) for w in caught],
            "params": full_state(model, scenario),
        }


def cast_reference(scenario: Scenario, bare_step: bool) -> dict[str, np.ndarray]:
    """:func:`cast_after_wrap`'s training in one process on the unwrapped net
    (``bare_step``: with its last SGD step over every parameter)."""
    net = make_net(scenario).double()
    opts = optimizers(net)
    for micro in range(len(scenario.skips)):
        x, y = batch(scenario, micro)
        loss_of(net(x.double(), skip_names(scenario, micro)), y).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    if bare_step:
        x, y = batch(scenario, len(scenario.skips))
        loss_of(net(x.double()), y).backward()
        torch.optim.SGD(net.parameters(), lr=0.1).step()
    return {k: v.detach().numpy().copy() for k, v in net.named_parameters()}


def added_after_wrap(scenario: Scenario) -> str:
    """A module added to the net after the wrap, its parameters given to the optimizer
    beside the views: what the optimizer's first step raises (``"stepped"`` if none)."""
    with backend_context(scenario.backend):
        net = make_net(scenario)
        model = wrap_fsdp(scenario, net)
        fv = flatview.wrap(model, **scenario.flatview_options)
        net.extra = nn.Linear(scenario.width, scenario.width)
        params = [*fv.parameters(), *net.extra.parameters()]
        opt = torch.optim.SGD(params, lr=0.1)
        x, y = local_batch(scenario, 0)
        with fv.step():
            loss_of(model(x), y).backward()
        try:
            opt.step()
        except FlatViewError as err:
            return f"{type(err).__name__}: {err}"
        return "stepped"
