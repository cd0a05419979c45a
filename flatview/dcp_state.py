"""The state of a wrapped model in the forms ``torch.distributed.checkpoint`` (DCP)
saves, keyed by original names: what :mod:`flatview.checkpoint`'s functions return and
load, and what torch's own checkpoint functions, called on a wrapped model, are routed to
(:mod:`flatview.checkpoint_routing`). The formats are described in
:mod:`flatview.checkpoint`; these functions take the runtime (its table, adapter and
model) and the checked ``StateDictOptions`` (torch's, or torch's per-call copy of them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from flatview import optim_state
from flatview.backends.base import Adapter, is_rank0
from flatview.errors import FlatViewError, OptimStateError
from flatview.layout import Placement
from flatview.sharded_tensors import as_full, is_sharded, sharded_value

if TYPE_CHECKING:
    from flatview.runtime import Runtime
    from flatview.table import ParamTable


class IncompatibleKeys(NamedTuple):
    """What a model-state load did not match (as ``load_state_dict`` reports it)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def refuse_options(info: Any) -> None:
    """Raise :class:`FlatViewError` for the ``StateDictOptions`` flatview does not support
    (called before any collective)."""
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


# ------------------------------------------------------------------------- optimizer


def consolidated(
    table: ParamTable, adapter: Adapter, optimizer: torch.optim.Optimizer, *, rank0_only: bool
) -> dict[str, Any]:
    """One optimizer's consolidated state by original name (what
    :meth:`flatview.FlatView.optim_state_dict` returns)."""
    if isinstance(optimizer, optim_state.ConsolidatesItself):
        # flatview.optim.Whole keeps whole tensors on owner ranks: it consolidates itself.
        return optimizer.consolidated_state_dict(rank0_only=rank0_only)
    return optim_state.consolidate(table, adapter, optimizer, rank0_only=rank0_only)


def load_consolidated(
    table: ParamTable, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
) -> None:
    """Load a state of :func:`consolidated` into one optimizer (what
    :meth:`flatview.FlatView.load_optim_state_dict` does)."""
    if isinstance(optimizer, optim_state.ConsolidatesItself):
        optimizer.load_consolidated_state_dict(state_dict)
        return
    optim_state.load(table, optimizer, state_dict)


def optimizers_state(
    runtime: Runtime, optimizers: Sequence[torch.optim.Optimizer], info: Any
) -> dict[str, Any]:
    """The optimizer state of ``optimizers`` merged, in the form ``info`` (the checked
    options) asks for: :func:`flatview.checkpoint.get_optimizer_state_dict`."""
    merged: dict[str, Any] = {"state": {}, "param_groups": []}
    for optimizer in optimizers:
        _prime(optimizer)
        if info.full_state_dict:
            part = consolidated(
                runtime.table, runtime.adapter, optimizer, rank0_only=info.cpu_offload
            )
        else:
            part = _sharded_optim_state(runtime, optimizer, info.cpu_offload)
        merged["state"].update(part["state"])
        merged["param_groups"].extend(part["param_groups"])
    if info.full_state_dict and info.cpu_offload and not is_rank0(runtime.adapter):
        # torch's convention: with cpu_offload the full dict lives on rank 0 only.
        return {}
    return merged


def _prime(optimizer: torch.optim.Optimizer) -> None:
    """Give an optimizer without state its zero state (one step with zero gradients at
    learning rate 0), so that a dict from :func:`get_state_dict` has every entry a
    checkpoint fills. Like torch's own, left alone if it has state or any gradient."""
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(p.grad is not None for p in params):
        return
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
    runtime: Runtime, optimizer: torch.optim.Optimizer, cpu_offload: bool
) -> dict[str, Any]:
    """The optimizer's state by name, per-element state of sharded parameters as
    ``ShardedTensor`` s over this rank's own state tensors: the ranks agree on what
    exists (one small exchange of descriptions, as consolidation does), no state moves."""
    adapter, table = runtime.adapter, runtime.table
    homes = [param.placement for param in table.params]
    groups, saved, order, plan, _ = optim_state.agreed_facts(table, adapter, optimizer)
    states: dict[int, dict[Any, Any]] = saved["state"]

    out_state: dict[str, dict[Any, Any]] = {}
    for position, index in enumerate(order):
        home = homes[index]
        local = states.get(position, {})
        if home.layout is None:
            if position in states:
                out_state[home.name] = {
                    key: _offload(
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
                entry[key] = sharded_value(home, local.get(key), kind[1], adapter, cpu_offload)
            else:
                entry[key] = optim_state.snapshot(kind[1])
        out_state[home.name] = entry

    out_groups = []
    for group, saved_group in zip(groups, saved["param_groups"], strict=True):
        out_group = {k: v for k, v in saved_group.items() if k != "params"}
        out_group["params"] = [homes[index].name for index in group]
        out_groups.append(out_group)
    return {"state": out_state, "param_groups": out_groups}


def _offload(value: Any, cpu_offload: bool) -> Any:
    if cpu_offload and isinstance(value, torch.Tensor):
        return value.detach().to("cpu")
    return value


def load_optimizers_state(
    runtime: Runtime, optimizers: Sequence[torch.optim.Optimizer], state_dict: Mapping[str, Any]
) -> None:
    """Load a state of :func:`optimizers_state` (either form) into ``optimizers``:
    :func:`flatview.checkpoint.set_optimizer_state_dict`."""
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
        part = {
            "state": {k: v for k, v in state_dict["state"].items() if k in names},
            "param_groups": mine,
        }
        load_consolidated(runtime.table, optimizer, part)
    if taken != len(groups):
        raise OptimStateError(
            f"the optimizer state dict has {len(groups)} parameter group(s), the "
            f"{len(optimizers)} optimizer(s) given have {taken} together"
        )


# ------------------------------------------------------------------------------ model


_TORCH_MODEL_STATE = ("ddp", "fsdp2")
"""Backends whose model keeps its own parameters under their own names (DDP's plain
tensors, FSDP2's ``DTensor`` s): torch's model state functions serve them as they are."""


def model_state(runtime: Runtime, info: Any) -> dict[str, Any]:
    """The model state in the form ``info`` (the checked options) asks for:
    :func:`flatview.checkpoint.get_state_dict`'s first half."""
    model, adapter, table = runtime.model, runtime.adapter, runtime.table
    if adapter.backend in _TORCH_MODEL_STATE or (
        info.full_state_dict and adapter.backend == "torch"
    ):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model, options=info)
    if info.full_state_dict:
        # fairscale's default state_dict() is its full one, by original name.
        full = {k: v.detach() for k, v in model.state_dict().items()}
        if info.ignore_frozen_params:
            frozen = {p.name for p in table.params if not p.tensor.requires_grad}
            full = {k: v for k, v in full.items() if k not in frozen}
        if info.cpu_offload:
            return {k: v.to("cpu") for k, v in full.items()} if adapter.rank == 0 else {}
        return full
    out: dict[str, Any] = {}
    for param in table.params:
        if info.ignore_frozen_params and not param.tensor.requires_grad:
            continue
        home = param.placement
        value = param.tensor.detach()
        if home.layout is None:
            entry = _offload(value.reshape(home.shape), info.cpu_offload)
        else:
            entry = sharded_value(home, value, value.dtype, adapter, info.cpu_offload)
        # Under every name, as the unwrapped model's state_dict() lists tied parameters.
        for name in param.names:
            out[name] = entry
    for name, buffer in _persistent_buffers(adapter, model):
        out[name] = _offload(buffer.detach(), info.cpu_offload)
    return out


def _persistent_buffers(adapter: Adapter, model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    found = []
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for attr, buffer in module._buffers.items():
            if buffer is None or attr in module._non_persistent_buffers_set:
                continue
            if id(buffer) in seen:
                continue
            seen.add(id(buffer))
            prefix = adapter.clean_name(module_name)
            found.append((f"{prefix}.{attr}" if prefix else attr, buffer))
    return found


def load_model_state(
    runtime: Runtime, state_dict: Mapping[str, Any], info: Any
) -> IncompatibleKeys:
    """Load a state of :func:`model_state` (either form) into the model:
    :func:`flatview.checkpoint.set_state_dict`'s first half."""
    model, adapter, table = runtime.model, runtime.adapter, runtime.table
    sharded = any(is_sharded(v) for v in state_dict.values())
    if adapter.backend in _TORCH_MODEL_STATE or (not sharded and adapter.backend == "torch"):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        result = set_model_state_dict(model, dict(state_dict), options=info)
        return IncompatibleKeys(list(result.missing_keys), list(result.unexpected_keys))
    if not sharded:
        result = model.load_state_dict(dict(state_dict), strict=info.strict)
        return IncompatibleKeys(list(result.missing_keys), list(result.unexpected_keys))
    expected: dict[str, torch.Tensor] = {}
    homes: dict[str, Placement] = {}
    for param in table.params:
        if info.ignore_frozen_params and not param.tensor.requires_grad:
            continue
        for name in param.names:
            expected[name] = param.tensor
            homes[name] = param.placement
    for name, buffer in _persistent_buffers(adapter, model):
        expected[name] = buffer
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    if info.strict and (missing or unexpected):
        raise FlatViewError(
            f"the model state dict does not fit the model: missing {missing}, "
            f"unexpected {unexpected}"
        )
    with torch.no_grad():
        for name, target in expected.items():
            if name not in state_dict:
                continue
            home = homes.get(name)
            value = state_dict[name]
            if home is None or home.layout is None:
                source = as_full(value)
                target.copy_(source.reshape(target.shape))
            else:
                target.copy_(optim_state.local_part(home, value, target).view(target.shape))
    return IncompatibleKeys(missing, unexpected)
