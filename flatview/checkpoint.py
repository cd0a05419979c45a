"""Checkpoints with ``torch.distributed.checkpoint`` (DCP) for models wrapped by flatview.

torch's own ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizers)``
cannot read optimizers built over flatview's views by itself: on torch FSDP1 it hands
their state to ``FSDP.optim_state_dict``, which takes every state tensor for the state of
a whole flat parameter's shard (and fails in a collective); fairscale it does not know,
and it would save each rank's piece as if it were the whole parameter. This module has
the same functions with ``fv`` first, the same options and the same kind of result,
keyed by original names (:mod:`flatview.dcp_state`); and torch's own functions, called
on a model wrapped by flatview, are routed to the same state
(:mod:`flatview.checkpoint_routing`), so that frameworks that checkpoint with them save
and resume the same dicts:

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

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from flatview.dcp_state import (
    IncompatibleKeys,
    load_model_state,
    load_optimizers_state,
    model_state,
    optimizers_state,
    refuse_options,
)
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
    return model_state(fv.runtime, info), optimizers_state(fv.runtime, opts, info)


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

    Raises:
        flatview.FlatViewError: an unsupported option (before any collective).
        flatview.OptimStateError: the optimizer dict does not fit the optimizers.
    """
    opts = _as_tuple(optimizers)
    info = _options(fv, model, options)
    result = load_model_state(fv.runtime, model_state_dict, info)
    load_optimizers_state(fv.runtime, opts, optim_state_dict)
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
    load_optimizers_state(fv.runtime, opts, optim_state_dict)


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
    refuse_options(info)
    return info
