"""The optimizer half of :mod:`flatview.checkpoint`: the state of optimizers over a
wrapped model's views in the forms ``torch.distributed.checkpoint`` saves, keyed by
original names, and loading it back; what torch's own optimizer-state functions are
routed to on a wrapped model (:mod:`flatview.checkpoint_routing`). Over the runtime (its
table, adapter and model), so that the routing, installed by the handle, reaches it. The
formats are described in :mod:`flatview.checkpoint`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from flatview import expert_state, fresh_state, optim_state, wrapped_models
from flatview.backends.base import is_rank0
from flatview.checkpoint_experts import expert_keys, group_view
from flatview.checkpoint_model import offload
from flatview.comm import collectives
from flatview.errors import FlatViewError, OptimStateError
from flatview.sharded_tensors import sharded_value

if TYPE_CHECKING:
    from flatview.runtime import Runtime
    from flatview.table import ParamTable


@runtime_checkable
class ShardsItself(Protocol):
    """An optimizer that builds both forms of its state itself
    (:class:`flatview.optim.Whole`): never primed, its state is made eagerly."""

    def consolidated_state_dict(self, *, rank0_only: bool = False) -> dict[str, Any]:
        """The full form (what :meth:`flatview.FlatView.optim_state_dict` returns)."""

    def sharded_state_dict(self, *, cpu_offload: bool = False) -> dict[str, Any]:
        """The sharded form, ``ShardedTensor`` s over its own state tensors."""


def optimizers_state(
    runtime: Runtime, optimizers: Sequence[torch.optim.Optimizer], info: Any
) -> dict[str, Any]:
    """The state of ``optimizers`` merged, in the form ``info`` (the checked options)
    asks for: the optimizer half of :func:`flatview.checkpoint.get_state_dict`."""
    merged: dict[str, Any] = {"state": {}, "param_groups": []}
    for optimizer in optimizers:
        if isinstance(optimizer, ShardsItself):
            # flatview.optim.Whole: its state is made eagerly (priming it would run a
            # step), and it lives on the owners, whole: it builds both forms itself.
            if info.full_state_dict:
                part = optimizer.consolidated_state_dict(rank0_only=info.cpu_offload)
            else:
                part = optimizer.sharded_state_dict(cpu_offload=info.cpu_offload)
            merged["state"].update(part["state"])
            merged["param_groups"].extend(part["param_groups"])
            continue
        part = _optimizer_part(runtime, optimizer, info)
        merged["state"].update(part["state"])
        merged["param_groups"].extend(part["param_groups"])
    if info.full_state_dict and info.cpu_offload and not is_rank0(runtime.adapter):
        # torch's convention: with cpu_offload the full dict lives on rank 0 only.
        return {}
    return expert_keys(runtime).optim_out(merged)


def _optimizer_part(
    runtime: Runtime, optimizer: torch.optim.Optimizer, info: Any
) -> dict[str, Any]:
    """One optimizer's state by name, with a placeholder for every parameter it holds
    without state (see :mod:`flatview.fresh_state`). What this rank finds wrong before
    the exchange of descriptions (a refused priming step, say) travels in it."""
    failure: BaseException | None = None
    keys: dict[int, tuple[Any, ...]] = {}
    # Agreed before anything can fail: a collective every rank joins.
    started = _started(runtime, optimizer)
    try:
        if not started:
            _prime(optimizer)
        lacking = fresh_state.stateless(optimizer)
        found = fresh_state.fresh_keys(optimizer, lacking)
        keys = {id(t): k for t, k in zip(lacking, found, strict=True) if k}
    except Exception as err:
        failure = err
    if info.full_state_dict:
        part = optim_state.consolidate(
            runtime.table, runtime.adapter, optimizer, rank0_only=info.cpu_offload, failure=failure
        )
    else:
        part = _sharded_optim_state(runtime, optimizer, info.cpu_offload, failure)
    if info.full_state_dict and info.cpu_offload and not is_rank0(runtime.adapter):
        return part
    for group in optimizer.param_groups:
        for tensor in group["params"]:
            index = runtime.table.index_of(tensor)
            assert index is not None  # agreed_facts refused foreign tensors
            name = runtime.table.name(index)
            if name not in part["state"] and id(tensor) in keys:
                part["state"][name] = fresh_state.placeholder(keys[id(tensor)])
    return part


def _started(runtime: Runtime, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` (or the optimizer it steps, :func:`fresh_state.stepper`)
    has state, has stepped before (or was loaded by flatview), or holds a gradient, on
    any rank: then :func:`_prime` leaves it alone. Where some
    rank holds none of a parameter's elements its view gets no gradient and no state
    (see :mod:`flatview.view_grads`), so a rank whose optimizer holds only such views
    would otherwise decide alone; the ranks then agree with one all-reduce of one flag."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    # A Lookahead-style wrapper keeps no state of its own, and torch records its steps
    # only from its first zero_grad where its __init__ is not torch's: the optimizer it
    # steps says whether it has started.
    inner = fresh_state.stepper(optimizer, strict=False)
    started = (
        bool(optimizer.state)
        or bool(inner.state)
        or wrapped_models.has_history(optimizer)
        or wrapped_models.has_history(inner)
        or any(p.grad is not None for p in params)
    )
    adapter = runtime.adapter
    if not runtime.table.empty_somewhere():
        return started
    flag = torch.tensor([float(started)], device=adapter.device)
    collectives.all_reduce_max(flag, adapter.agreement_group)
    return bool(flag.item())


def _prime(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer (no state, never stepped or loaded, no gradient on any
    rank: :func:`_started`) its zero state (one step with zero gradients at learning
    rate 0), so that a dict from :func:`get_state_dict` has every entry a checkpoint
    fills. Like torch's own, left alone if it has state or any gradient; unlike torch's,
    also if it has stepped before (its parameters without state have never had a
    gradient: priming would give them a ``step`` the uninterrupted run does not have)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    rates = []
    for group in optimizer.param_groups:
        rates.append(group.get("lr"))
        if "lr" in group:
            lr = group["lr"]
            group["lr"] = torch.tensor(0.0) if isinstance(lr, torch.Tensor) else 0.0
    try:
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, rates, strict=True):
            if lr is not None:
                group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)


def _sharded_optim_state(
    runtime: Runtime,
    optimizer: torch.optim.Optimizer,
    cpu_offload: bool,
    failure: BaseException | None = None,
) -> dict[str, Any]:
    """The optimizer's state by name, per-element state of sharded parameters as
    ``ShardedTensor`` s over this rank's own state tensors: the ranks agree on what
    exists (one small exchange of descriptions, as consolidation does), no state moves."""
    adapter, table = runtime.adapter, runtime.table
    homes = [param.placement for param in table.params]
    groups, saved, order, plan, _ = optim_state.agreed_facts(
        table, adapter, optimizer, failure=failure, request={"sharded": True}
    )
    states: dict[int, dict[Any, Any]] = saved["state"]

    out_state: dict[str, dict[Any, Any]] = {}
    for position, index in enumerate(order):
        home = homes[index]
        local = states.get(position, {})
        if home.layout is None:
            if position in states:
                out_state[home.name] = {
                    key: offload(
                        value.reshape(home.shape)
                        if optim_state.kind_of(home, key, value)[0] == "elem"
                        else value,
                        cpu_offload,
                    )
                    for key, value in local.items()
                }
            continue
        if position not in plan:
            continue
        entry: dict[Any, Any] = {}
        for key, kind in plan[position].items():
            if kind[0] == "elem":
                # An expert's pieces are its own group's.
                over = group_view(table, index, adapter.device) or adapter
                entry[key] = sharded_value(home, local.get(key), kind[1], over, cpu_offload)
            else:
                entry[key] = optim_state.snapshot(kind[1])
        out_state[home.name] = entry

    out_groups = []
    for group, saved_group in zip(groups, saved["param_groups"], strict=True):
        out_group = {k: v for k, v in saved_group.items() if k != "params"}
        out_group["params"] = [homes[index].name for index in group]
        out_groups.append(out_group)
    return {"state": out_state, "param_groups": out_groups}


def load_optimizers_state(
    runtime: Runtime, optimizers: Sequence[torch.optim.Optimizer], state_dict: Mapping[str, Any]
) -> None:
    """Load a state of :func:`optimizers_state` (either form) into ``optimizers``: the
    optimizer half of :func:`flatview.checkpoint.set_state_dict`."""
    state_dict = expert_keys(runtime).optim_in(state_dict)
    if not (
        isinstance(state_dict, Mapping)
        and isinstance(state_dict.get("state"), Mapping)
        and isinstance(state_dict.get("param_groups"), Sequence)
    ):
        raise OptimStateError(
            "not an optimizer state dict of flatview.checkpoint.get_state_dict: expected a "
            "mapping with 'state' (name -> state) and 'param_groups'"
        )
    groups = list(state_dict["param_groups"])
    taken = 0
    for optimizer in optimizers:
        count = len(optimizer.param_groups)
        mine = groups[taken : taken + count]
        taken += count
        names = {name for group in mine for name in group.get("params", ())}
        # Placeholders stand for "no state yet": dropped, the parameter gets none.
        state = fresh_state.without_placeholders(state_dict["state"])
        part = {
            "state": {k: v for k, v in state.items() if k in names},
            "param_groups": mine,
        }
        load_consolidated(runtime.table, optimizer, part)
        wrapped_models.record_history(optimizer)
    if taken != len(groups):
        raise OptimStateError(
            f"the optimizer state dict has {len(groups)} parameter group(s), the "
            f"{len(optimizers)} optimizer(s) given have {taken} together"
        )


def refuse_options(info: Any) -> None:
    """Raise :class:`FlatViewError` for the ``StateDictOptions`` flatview does not
    support (``info``: torch's options, or torch's per-call copy of them)."""
    if info.broadcast_from_rank0:
        raise FlatViewError(
            "StateDictOptions(broadcast_from_rank0=True) is not supported for models "
            "wrapped by flatview: load the same full state dict on every rank "
            "(full_state_dict=True), or use the sharded form (full_state_dict=False), "
            "which torch.distributed.checkpoint.load reshards"
        )
    if info.flatten_optimizer_state_dict:
        raise FlatViewError(
            "StateDictOptions(flatten_optimizer_state_dict=True) is not supported for "
            "models wrapped by flatview: use the nested form (the default); "
            "torch.distributed.checkpoint saves and reshards it as well"
        )


def consolidated(
    runtime: Runtime, optimizer: torch.optim.Optimizer, *, rank0_only: bool
) -> dict[str, Any]:
    """One optimizer's consolidated state (what
    :meth:`flatview.FlatView.optim_state_dict` returns)."""
    if isinstance(optimizer, optim_state.ConsolidatesItself):
        # flatview.optim.Whole keeps whole tensors on owner ranks: it consolidates itself.
        return optimizer.consolidated_state_dict(rank0_only=rank0_only)
    failure: OptimStateError | None = None
    if rank0_only:
        try:
            expert_state.refuse_rank0_only(runtime.table, "optim_state_dict")
        except OptimStateError as err:
            failure = err  # raised on every rank, in the exchange of descriptions
    found = optim_state.consolidate(
        runtime.table, runtime.adapter, optimizer, rank0_only=rank0_only, failure=failure
    )
    return expert_state.tagged(found, runtime.table)


def load_consolidated(
    table: ParamTable,
    optimizer: torch.optim.Optimizer,
    state_dict: dict[str, Any],
    *,
    regroup: bool = False,
) -> None:
    """Load one optimizer's consolidated state (what
    :meth:`flatview.FlatView.load_optim_state_dict` does)."""
    expert_state.check(state_dict, table)
    if isinstance(optimizer, optim_state.ConsolidatesItself):
        if regroup:
            raise OptimStateError(
                f"{type(optimizer).__name__} loads its own state with its own groups: "
                "regroup=True is for torch optimizers"
            )
        optimizer.load_consolidated_state_dict(state_dict)
        return
    optim_state.load(table, optimizer, state_dict, regroup=regroup)
