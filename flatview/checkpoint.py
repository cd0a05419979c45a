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

Parameters an optimizer holds without state (never had a gradient: skipped in every
step so far) are saved as placeholders, every key ``None``, where torch's functions save
nothing; :func:`set_state_dict` drops them (see :mod:`flatview.fresh_state`). So a run
resumed from fresh optimizers, whose template has state for every parameter, loads and
is exact.

Options flatview refuses (:class:`flatview.FlatViewError`): ``broadcast_from_rank0``
(load the same full dict on every rank, or use the sharded form) and
``flatten_optimizer_state_dict``. Every refusal, even one rank's alone, is raised on
every rank: each function exchanges one small object per rank (what it refused, the
options that decide its collectives) before its first collective
(:func:`flatview.comm.refusals.raise_everywhere`; the set functions after their local
loading, before torch's model half).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from flatview import fresh_state, optim_state, wrapped_models
from flatview.backends.base import is_rank0
from flatview.checkpoint_model import (
    IncompatibleKeys,
    load_model_state_dict,
    model_state_dict,
    offload,
    torch_loads_model,
)
from flatview.comm.refusals import raise_everywhere
from flatview.errors import FlatViewError, OptimStateError
from flatview.sharded_tensors import sharded_value

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from flatview.handle import FlatView

__all__ = [
    "get_optimizer_state_dict",
    "get_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
]


@runtime_checkable
class ShardsItself(Protocol):
    """An optimizer that builds both forms of its state itself
    (:class:`flatview.optim.Whole`): never primed, its state is made eagerly."""

    def consolidated_state_dict(self, *, rank0_only: bool = False) -> dict[str, Any]:
        """The full form (what :meth:`flatview.FlatView.optim_state_dict` returns)."""

    def sharded_state_dict(self, *, cpu_offload: bool = False) -> dict[str, Any]:
        """The sharded form, ``ShardedTensor`` s over its own state tensors."""


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
    between iterations. A fresh optimizer (no state, never stepped or loaded: built to
    load a checkpoint into) is first given zero state by one step with zero gradients
    and learning rate 0, as torch does, so that the returned dict can receive
    ``torch.distributed.checkpoint.load``. A parameter an optimizer that has stepped
    holds without state gets a placeholder entry (every key ``None``), which
    :func:`set_state_dict` drops.

    Args:
        fv: the model's :class:`flatview.FlatView`.
        model: the wrapped model (``fv.model``).
        optimizers: optimizers over views and other parameters of the model.
        options: torch's ``StateDictOptions``; ``full_state_dict`` and ``cpu_offload``
            choose the form, ``ignore_frozen_params`` and ``strict`` apply to the model.

    Raises:
        flatview.FlatViewError: an option flatview does not support, a model that is not
            ``fv.model``, or ranks passing different options; on every rank alike, before
            any collective but one small exchange. :class:`flatview.OptimStateError` as
            :meth:`flatview.FlatView.optim_state_dict` raises it (an optimizer over flat
            parameters, also where only one rank's is).
    """
    opts, info = _checked_call(fv, model, optimizers, options, "get_state_dict")
    model_sd = model_state_dict(fv, model, info)
    return model_sd, _optim_state_dict(fv, opts, info)


def get_optimizer_state_dict(
    fv: FlatView,
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    options: StateDictOptions | None = None,
) -> dict[str, Any]:
    """The optimizer half of :func:`get_state_dict`."""
    opts, info = _checked_call(fv, model, optimizers, options, "get_optimizer_state_dict")
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

    Placeholder entries (parameters saved without state) are dropped: those parameters
    have no state afterwards, as in the run that saved them.

    A collective on every backend: what loads locally (the optimizers, and the model
    where flatview loads it) runs first, then one small exchange raises any rank's
    refusal on every rank, then torch's model half where torch loads the model.

    Raises:
        flatview.FlatViewError: an unsupported option, or ranks passing different ones.
        flatview.OptimStateError: the optimizer dict does not fit the optimizers.
        Either on every rank alike, also where only one rank's arguments are wrong.
    """
    return _load(
        fv, model, optimizers, model_state_dict, optim_state_dict, options, "set_state_dict"
    )


def set_optimizer_state_dict(
    fv: FlatView,
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    optim_state_dict: Mapping[str, Any],
    *,
    options: StateDictOptions | None = None,
) -> None:
    """The optimizer half of :func:`set_state_dict`."""
    _load(fv, model, optimizers, None, optim_state_dict, options, "set_optimizer_state_dict")


# -------------------------------------------------------------------------- options


def _request(info: Any, count: int) -> tuple[Any, ...]:
    """What every rank must pass alike: the options that decide the collectives."""
    return (
        bool(info.full_state_dict),
        bool(info.cpu_offload),
        bool(info.ignore_frozen_params),
        count,
    )


def _checked_call(
    fv: FlatView,
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    options: StateDictOptions | None,
    call: str,
) -> tuple[tuple[torch.optim.Optimizer, ...], Any]:
    """The arguments of a call that reads state, checked on every rank at once: a rank
    that refuses them raises on every rank, before the first collective."""
    failure: BaseException | None = None
    opts: tuple[torch.optim.Optimizer, ...] = ()
    info: Any = None
    try:
        opts = _as_tuple(optimizers)
        info = _options(fv, model, options)
    except Exception as err:
        failure = err
    request = None if failure is not None else _request(info, len(opts))
    raise_everywhere(failure, request, fv.adapter.agreement_group, f"flatview.checkpoint.{call}")
    return opts, info


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
        part = _optimizer_part(fv, optimizer, info)
        merged["state"].update(part["state"])
        merged["param_groups"].extend(part["param_groups"])
    if info.full_state_dict and info.cpu_offload and not is_rank0(fv.adapter):
        # torch's convention: with cpu_offload the full dict lives on rank 0 only.
        return {}
    return merged


def _optimizer_part(fv: FlatView, optimizer: torch.optim.Optimizer, info: Any) -> dict[str, Any]:
    """One optimizer's state by name, with a placeholder for every parameter it holds
    without state (see :mod:`flatview.fresh_state`). What this rank finds wrong before
    the exchange of descriptions (a refused priming step, say) travels in it."""
    failure: BaseException | None = None
    keys: dict[int, tuple[Any, ...]] = {}
    try:
        _prime(optimizer)
        lacking = fresh_state.stateless(optimizer)
        found = fresh_state.fresh_keys(optimizer, lacking)
        keys = {id(t): k for t, k in zip(lacking, found, strict=True) if k}
    except Exception as err:
        failure = err
    if info.full_state_dict:
        part = optim_state.consolidate(
            fv.table, fv.adapter, optimizer, rank0_only=info.cpu_offload, failure=failure
        )
    else:
        part = _sharded_optim_state(fv, optimizer, info.cpu_offload, failure)
    if info.full_state_dict and info.cpu_offload and not is_rank0(fv.adapter):
        return part
    for group in optimizer.param_groups:
        for tensor in group["params"]:
            index = fv.table.index_of(tensor)
            assert index is not None  # agreed_facts refused foreign tensors
            name = fv.table.name(index)
            if name not in part["state"] and id(tensor) in keys:
                part["state"][name] = fresh_state.placeholder(keys[id(tensor)])
    return part


def _prime(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer (no state, never stepped or loaded) its zero state (one
    step with zero gradients at learning rate 0), so that a dict from
    :func:`get_state_dict` has every entry a checkpoint fills. Like torch's own, left
    alone if it has state or any gradient; unlike torch's, also if it has stepped before
    (its parameters without state have never had a gradient: priming would give them
    a ``step`` the uninterrupted run does not have)."""
    if optimizer.state or wrapped_models.has_history(optimizer):
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
    fv: FlatView,
    optimizer: torch.optim.Optimizer,
    cpu_offload: bool,
    failure: BaseException | None = None,
) -> dict[str, Any]:
    """The optimizer's state by name, per-element state of sharded parameters as
    ``ShardedTensor`` s over this rank's own state tensors: the ranks agree on what
    exists (one small exchange of descriptions, as consolidation does), no state moves."""
    adapter = fv.adapter
    homes = [param.placement for param in fv.table.params]
    groups, saved, order, plan, _ = optim_state.agreed_facts(
        fv.table, adapter, optimizer, failure=failure, request={"sharded": True}
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
        # Placeholders stand for "no state yet": dropped, the parameter gets none.
        state = fresh_state.without_placeholders(state_dict["state"])
        part = {
            "state": {k: v for k, v in state.items() if k in names},
            "param_groups": mine,
        }
        fv.load_optim_state_dict(optimizer, part)
        wrapped_models.record_history(optimizer)
    if taken != len(groups):
        raise OptimStateError(
            f"the optimizer state dict has {len(groups)} parameter group(s), the "
            f"{len(optimizers)} optimizer(s) given have {taken} together"
        )


def _load(
    fv: FlatView,
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    model_state_dict: Mapping[str, Any] | None,
    optim_state_dict: Mapping[str, Any],
    options: StateDictOptions | None,
    call: str,
) -> IncompatibleKeys:
    """:func:`set_state_dict` (without the model half when ``model_state_dict`` is
    ``None``). Everything that loads locally runs first, and its refusals on any rank are
    raised on every rank in one exchange, before torch's model half, which communicates
    (a rank raising alone would leave the others waiting there or in the next step)."""
    failure: BaseException | None = None
    result = IncompatibleKeys([], [])
    opts: tuple[torch.optim.Optimizer, ...] = ()
    info: Any = None
    torch_model = False
    try:
        opts = _as_tuple(optimizers)
        info = _options(fv, model, options)
        if model_state_dict is not None:
            torch_model = torch_loads_model(fv, model_state_dict)
            if not torch_model:
                result = load_model_state_dict(fv, model, model_state_dict, info)
        _load_optim_state_dict(fv, opts, optim_state_dict)
    except Exception as err:
        failure = err
    request = None if failure is not None else _request(info, len(opts))
    raise_everywhere(failure, request, fv.adapter.agreement_group, f"flatview.checkpoint.{call}")
    if torch_model:
        assert model_state_dict is not None
        result = load_model_state_dict(fv, model, model_state_dict, info)
    return result
