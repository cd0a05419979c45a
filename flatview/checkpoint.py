"""Checkpoints with ``torch.distributed.checkpoint`` (DCP) for models wrapped by flatview.

torch's own ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizers)``
cannot read optimizers built over flatview's views: on torch FSDP1 it hands their state
to ``FSDP.optim_state_dict``, which takes every state tensor for the state of a whole
flat parameter's shard (and fails in a collective); fairscale it does not know, and it
would save each rank's piece as if it were the whole parameter. flatview therefore
refuses that call (:func:`guard_torch_checkpoint`, raised before any collective, on
every rank alike) and offers the same pair here, with the same options and the same
result, keyed by original names:

>>> model_sd, optim_sd = flatview.checkpoint.get_state_dict(fv, model, opts)  # doctest: +SKIP
>>> dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)     # doctest: +SKIP

and to resume (at any world size, on any backend, or into the unwrapped model with
torch's own functions)::

    model_sd, optim_sd = flatview.checkpoint.get_state_dict(fv, model, opts)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    flatview.checkpoint.set_state_dict(
        fv, model, opts, model_state_dict=model_sd, optim_state_dict=optim_sd
    )

Formats
-------
The optimizer state is that of :meth:`flatview.FlatView.optim_state_dict`, several
optimizers merged (``state`` joined, ``param_groups`` concatenated in optimizer order, as
torch does)::

    {"state": {name: {key: value}}, "param_groups": [{..., "params": [name, ...]}]}

``StateDictOptions(full_state_dict=True)``: per-element state as full tensors of the
original parameter's shape (CPU copies; on rank 0 only with ``cpu_offload=True``), the
same on every rank. ``full_state_dict=False`` (sharded, the default): per-element state of
a sharded parameter as a ``ShardedTensor`` of the original shape whose local shards are
this rank's elements (up to a few rectangular boxes per rank, since a rank's piece is a
range of the flattened parameter), aliasing the optimizer's own state tensors: nothing
is gathered, and DCP reads and writes the optimizer state in place. Scalars (``step``)
are plain values, identical on every rank. DCP reshards either form on load.

The model state: on DDP and FSDP2 torch's (``get_model_state_dict`` /
``set_model_state_dict``, as without flatview; FSDP2's are ``DTensor`` s, which DCP
reshards into any other backend's form). Full form: torch's on torch FSDP1, fairscale's own full
``state_dict()`` on fairscale (torch's functions do not know fairscale). Sharded form on
torch FSDP1 and fairscale: a ``ShardedTensor`` per sharded parameter, built from the views
as for the optimizer state, plain tensors for every other parameter and persistent
buffer. (torch FSDP1's own sharded model state gives a rank that holds no element of a
parameter a ``ShardedTensor`` without local shards, which DCP's load planner leaves out
of the keys it expects; next to an optimizer's ``param_groups`` that makes the load fail.
flatview's blocks give such a rank an empty block.)

Options flatview refuses (:class:`flatview.FlatViewError`, before any collective):
``broadcast_from_rank0`` (load the same full dict on every rank, or use the sharded
form) and ``flatten_optimizer_state_dict``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from flatview import optim_state, state_gather
from flatview.backends.base import is_rank0
from flatview.errors import FlatViewError, OptimStateError
from flatview.layout import Placement
from flatview.sharded_tensors import as_full, is_sharded, sharded_value

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from flatview.handle import FlatView

__all__ = [
    "get_optimizer_state_dict",
    "get_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
]


class IncompatibleKeys(NamedTuple):
    """What :func:`set_state_dict` did not match in the model state (as ``load_state_dict``)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


# ------------------------------------------------------------------------ public API


def get_state_dict(
    fv: FlatView,
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    options: StateDictOptions | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model and optimizer state of a flatview-wrapped model, for
    ``torch.distributed.checkpoint.save``: what
    ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizers)`` returns
    for a plain model, with optimizers over views (see the module docstring for the
    formats).

    A collective: every rank calls it with its counterparts of the same optimizers,
    between iterations. An optimizer without state (freshly built, to load a checkpoint
    into) is first given zero state by one step with zero gradients and learning rate 0,
    as torch does, so that the returned dict can receive ``torch.distributed.checkpoint.load``.

    Args:
        fv: the model's :class:`flatview.FlatView`.
        model: the wrapped model (``fv.model``).
        optimizers: optimizers over views and other parameters of the model.
        options: torch's ``StateDictOptions``; ``full_state_dict`` and ``cpu_offload``
            choose the form, ``ignore_frozen_params`` and ``strict`` apply to the model.

    Raises:
        flatview.FlatViewError: an option flatview does not support (before any
            collective); :class:`flatview.OptimStateError` as
            :meth:`flatview.FlatView.optim_state_dict` raises it.
    """
    opts = _as_tuple(optimizers)
    info = _options(fv, model, options)
    model_sd = _model_state_dict(fv, model, info)
    return model_sd, _optim_state_dict(fv, opts, info)


def get_optimizer_state_dict(
    fv: FlatView,
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    options: StateDictOptions | None = None,
) -> dict[str, Any]:
    """The optimizer half of :func:`get_state_dict`."""
    opts = _as_tuple(optimizers)
    info = _options(fv, model, options)
    return _optim_state_dict(fv, opts, info)


def set_state_dict(
    fv: FlatView,
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    model_state_dict: Mapping[str, Any],
    optim_state_dict: Mapping[str, Any],
    options: StateDictOptions | None = None,
) -> IncompatibleKeys:
    """Load a state from :func:`get_state_dict` (after ``torch.distributed.checkpoint.load``
    filled it, or as it came from any world size in the full form) into the model and
    optimizers; the counterpart of torch's ``set_state_dict``.

    Per-element optimizer state may be full tensors (every rank takes its piece) or the
    ``ShardedTensor`` s of this model's own sharded :func:`get_state_dict`. Parameters are
    matched by name within each parameter group, hyperparameters come from the dict.

    Raises:
        flatview.FlatViewError: an unsupported option (before any collective).
        flatview.OptimStateError: the optimizer dict does not fit the optimizers.
    """
    opts = _as_tuple(optimizers)
    info = _options(fv, model, options)
    result = _load_model_state_dict(fv, model, model_state_dict, info)
    _load_optim_state_dict(fv, opts, optim_state_dict)
    return result


def set_optimizer_state_dict(
    fv: FlatView,
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    optim_state_dict: Mapping[str, Any],
    *,
    options: StateDictOptions | None = None,
) -> None:
    """The optimizer half of :func:`set_state_dict`."""
    opts = _as_tuple(optimizers)
    _options(fv, model, options)
    _load_optim_state_dict(fv, opts, optim_state_dict)


# -------------------------------------------------------------------------- options


def _as_tuple(
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
) -> tuple[torch.optim.Optimizer, ...]:
    if isinstance(optimizers, torch.optim.Optimizer):
        return (optimizers,)
    return tuple(optimizers)


def _options(fv: FlatView, model: nn.Module, options: StateDictOptions | None) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    if model is not fv.model:
        raise FlatViewError(
            f"flatview.checkpoint was given a model ({type(model).__name__}) that is not the "
            f"one {fv!r} wraps: pass the wrapped model (fv.model)"
        )
    info = options or StateDictOptions()
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
    return info


# ------------------------------------------------------------------------- optimizer


def _optim_state_dict(
    fv: FlatView, optimizers: Sequence[torch.optim.Optimizer], info: Any
) -> dict[str, Any]:
    merged: dict[str, Any] = {"state": {}, "param_groups": []}
    for optimizer in optimizers:
        _prime(optimizer)
        if info.full_state_dict:
            part = fv.optim_state_dict(optimizer, rank0_only=info.cpu_offload)
        else:
            part = _sharded_optim_state(fv, optimizer, info.cpu_offload)
        merged["state"].update(part["state"])
        merged["param_groups"].extend(part["param_groups"])
    if info.full_state_dict and info.cpu_offload and not is_rank0(fv.adapter):
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
    fv: FlatView, optimizer: torch.optim.Optimizer, cpu_offload: bool
) -> dict[str, Any]:
    """The optimizer's state by name, per-element state of sharded parameters as
    ``ShardedTensor`` s over this rank's own state tensors: the ranks agree on what
    exists (one small exchange of descriptions, as consolidation does), no state moves."""
    adapter = fv.adapter
    homes = [param.placement for param in fv.table.params]
    groups, saved, order, plan, _ = optim_state.agreed_facts(fv.table, adapter, optimizer)
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


def _load_optim_state_dict(
    fv: FlatView, optimizers: Sequence[torch.optim.Optimizer], state_dict: Mapping[str, Any]
) -> None:
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
        fv.load_optim_state_dict(optimizer, part)
    if taken != len(groups):
        raise OptimStateError(
            f"the optimizer state dict has {len(groups)} parameter group(s), the "
            f"{len(optimizers)} optimizer(s) given have {taken} together"
        )


# ------------------------------------------------------------------------------ model


_TORCH_MODEL_STATE = ("ddp", "fsdp2")
"""Backends whose model keeps its own parameters under their own names (DDP's plain
tensors, FSDP2's ``DTensor`` s): torch's model state functions serve them as they are."""
_VIEWS_MODEL_STATE = ("deepspeed",)
"""Backends whose full model state flatview assembles from the views (DeepSpeed: the
engine's own ``state_dict`` names everything ``module.*`` and, under ZeRO 3, holds empty
parameters between passes), and loads into the views in either form."""


def _model_state_dict(fv: FlatView, model: nn.Module, info: Any) -> dict[str, Any]:
    if fv.adapter.backend in _TORCH_MODEL_STATE or (
        info.full_state_dict and fv.adapter.backend == "torch"
    ):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model, options=info)
    if info.full_state_dict and fv.adapter.backend in _VIEWS_MODEL_STATE:
        return _gathered_model_state(fv, model, info)
    if info.full_state_dict:
        # fairscale's default state_dict() is its full one, by original name.
        full = {k: v.detach() for k, v in model.state_dict().items()}
        if info.ignore_frozen_params:
            frozen = {name for name, p in fv.named_parameters() if not p.requires_grad}
            full = {k: v for k, v in full.items() if k not in frozen}
        if info.cpu_offload:
            return {k: v.to("cpu") for k, v in full.items()} if fv.adapter.rank == 0 else {}
        return full
    out: dict[str, Any] = {}
    for param in fv.table.params:
        if info.ignore_frozen_params and not param.tensor.requires_grad:
            continue
        home = param.placement
        value = param.tensor.detach()
        if home.layout is None:
            entry = _offload(value.reshape(home.shape), info.cpu_offload)
        else:
            entry = sharded_value(home, value, value.dtype, fv.adapter, info.cpu_offload)
        # Under every name, as the unwrapped model's state_dict() lists tied parameters.
        for name in param.names:
            out[name] = entry
    for name, buffer in _persistent_buffers(fv, model):
        out[name] = _offload(buffer.detach(), info.cpu_offload)
    return out


def _gathered_model_state(fv: FlatView, model: nn.Module, info: Any) -> dict[str, Any]:
    """Every parameter whole, assembled from the views (one gathering collective per
    bucket of sharded ones, as the optimizer state), by original name, and the persistent
    buffers; on rank 0 only with ``cpu_offload``."""
    table = fv.table
    chosen = [
        p.index
        for p in table.params
        if not (info.ignore_frozen_params and not p.tensor.requires_grad)
    ]
    homes = [p.placement for p in table.params]
    sharded = [i for i in chosen if homes[i].layout is not None]
    position = {index: k for k, index in enumerate(sharded)}
    plan = {k: {"value": ("elem", table.tensor(i).dtype)} for k, i in enumerate(sharded)}
    states = {k: {"value": table.tensor(i).detach()} for k, i in enumerate(sharded)}
    rank0_only = bool(info.cpu_offload)
    gathered = state_gather.gather(plan, states, sharded, homes, fv.adapter, rank0_only)
    if rank0_only and not is_rank0(fv.adapter):
        return {}
    out: dict[str, Any] = {}
    for index in chosen:
        param = table.params[index]
        if homes[index].layout is None:
            value = param.tensor.detach().reshape(homes[index].shape).clone()
        else:
            value = gathered[(position[index], "value")]
        for name in param.names:
            out[name] = _offload(value, info.cpu_offload)
    for name, buffer in _persistent_buffers(fv, model):
        out[name] = _offload(buffer.detach(), info.cpu_offload)
    return out


def _persistent_buffers(fv: FlatView, model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    found = []
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for attr, buffer in module._buffers.items():
            if buffer is None or attr in module._non_persistent_buffers_set:
                continue
            if id(buffer) in seen:
                continue
            seen.add(id(buffer))
            prefix = fv.adapter.clean_name(module_name)
            found.append((f"{prefix}.{attr}" if prefix else attr, buffer))
    return found


def _load_model_state_dict(
    fv: FlatView, model: nn.Module, state_dict: Mapping[str, Any], info: Any
) -> IncompatibleKeys:
    sharded = any(is_sharded(v) for v in state_dict.values())
    if fv.adapter.backend in _TORCH_MODEL_STATE or (not sharded and fv.adapter.backend == "torch"):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        result = set_model_state_dict(model, dict(state_dict), options=info)
        return IncompatibleKeys(list(result.missing_keys), list(result.unexpected_keys))
    if not sharded and fv.adapter.backend not in _VIEWS_MODEL_STATE:
        result = model.load_state_dict(dict(state_dict), strict=info.strict)
        return IncompatibleKeys(list(result.missing_keys), list(result.unexpected_keys))
    expected: dict[str, torch.Tensor] = {}
    homes: dict[str, Placement] = {}
    for param in fv.table.params:
        if info.ignore_frozen_params and not param.tensor.requires_grad:
            continue
        for name in param.names:
            expected[name] = param.tensor
            homes[name] = param.placement
    for name, buffer in _persistent_buffers(fv, model):
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
