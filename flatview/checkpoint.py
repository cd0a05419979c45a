"""Checkpoints with ``torch.distributed.checkpoint`` (DCP) for models wrapped by flatview.

torch's own ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizers)``
cannot read optimizers built over flatview's views by itself: on torch FSDP1 it hands
their state to ``FSDP.optim_state_dict``, which takes every state tensor for the state of
a whole flat parameter's shard (and fails in a collective); fairscale it does not know,
and it would save each rank's piece as if it were the whole parameter. This module has
the same functions with ``fv`` first, the same options and the same kind of result,
keyed by original names (its halves: :mod:`flatview.checkpoint_model`,
:mod:`flatview.checkpoint_optim`); and torch's own functions, called on a model wrapped
by flatview, are routed to the same halves (:mod:`flatview.checkpoint_routing`), so
that frameworks that checkpoint with them save and resume the same dicts:

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

Experts (units on process groups of their own, whose ranks in different groups hold
different experts under the same names) are keyed under their group,
``expert_groups.<g>.<name>`` (:mod:`flatview.checkpoint_experts`); such a checkpoint
loads into runs with the same number of expert groups, at any group size. With experts,
``full_state_dict=True`` with ``cpu_offload=True`` (rank 0's alone) is refused, and
torch's own functions are routed here on every backend, FSDP2's included.

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

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from flatview.checkpoint_experts import refuse_rank0_form
from flatview.checkpoint_model import (
    IncompatibleKeys,
    load_model_state_dict,
    model_state_dict,
    torch_loads_model,
)
from flatview.checkpoint_optim import (
    load_optimizers_state,
    optimizers_state,
    refuse_options,
)
from flatview.checkpoint_routing import bypassed
from flatview.comm.refusals import raise_everywhere
from flatview.errors import FlatViewError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from flatview.handle import FlatView

__all__ = [
    "get_optimizer_state_dict",
    "get_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
]


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
    with bypassed():  # checked above: torch's functions inside need no routing
        model_sd = model_state_dict(fv.runtime, info)
    return model_sd, optimizers_state(fv.runtime, opts, info)


def get_optimizer_state_dict(
    fv: FlatView,
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    options: StateDictOptions | None = None,
) -> dict[str, Any]:
    """The optimizer half of :func:`get_state_dict`."""
    opts, info = _checked_call(fv, model, optimizers, options, "get_optimizer_state_dict")
    return optimizers_state(fv.runtime, opts, info)


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
    refuse_options(info)
    refuse_rank0_form(fv.table, info)
    return info


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
            torch_model = torch_loads_model(fv.runtime, model_state_dict)
            if not torch_model:
                result = load_model_state_dict(fv.runtime, model_state_dict, info)
        load_optimizers_state(fv.runtime, opts, optim_state_dict)
    except Exception as err:
        failure = err
    request = None if failure is not None else _request(info, len(opts))
    raise_everywhere(failure, request, fv.adapter.agreement_group, f"flatview.checkpoint.{call}")
    if torch_model:
        assert model_state_dict is not None
        with bypassed():  # checked above: torch's functions inside need no routing
            result = load_model_state_dict(fv.runtime, model_state_dict, info)
    return result
