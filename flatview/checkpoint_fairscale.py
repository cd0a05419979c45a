"""fairscale's own optimizer-state methods on a model wrapped by flatview.

fairscale's ``gather_full_optim_state_dict(optim)`` and
``get_shard_from_optim_state_dict(state)`` (fairseq checkpoints through this pair) know
its flat parameters: ``gather_full_optim_state_dict`` all-gathers every tensor of each
entry of ``optim.state_dict()["state"]`` as the state of one flat parameter. An
optimizer over views has other entries on each rank (one per view, and none where a
view holds nothing of this rank's, or where a step skipped it), so ranks pair different
collectives: rank 0 waited forever on gloo while rank 1 failed an assertion.

* ``gather_full_optim_state_dict(optim)`` is routed to
  :meth:`flatview.FlatView.optim_state_dict` ``(optim, rank0_only=True)``: rank 0 gets
  the consolidated state keyed by original name, the other ranks ``None``, as fairscale
  returns. A training script that saves through it keeps working.
* ``get_shard_from_optim_state_dict(state)`` is refused: it cuts a state for the flat
  parameters, and its result would be loaded by position into an optimizer over views.
  The error names :meth:`flatview.FlatView.load_optim_state_dict`, which loads the
  consolidated state matching parameters by name. The decision is local and the method
  communicates nothing, so no rank waits on another.
* What bare fairscale's ``gather_full_optim_state_dict`` saved (a checkpoint from before
  the model was wrapped) numbers parameters by position: fairscale's units in module
  order, each unit's flat parameters' segments in order. :func:`loadable` converts it
  to the state by original name, so that
  :meth:`flatview.FlatView.load_optim_state_dict` resumes a run that fairscale alone
  started (:data:`POSITIONAL_KEYS` tell the form).

Installed by the handle on every unit that has both methods; ``unwrap()`` removes them.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from flatview.backends.base import is_rank0
from flatview.checkpoint_optim import consolidated
from flatview.checkpoint_routing import Patch
from flatview.errors import OptimStateError
from flatview.runtime import Runtime

if TYPE_CHECKING:
    from flatview.table import ParamTable

_GATHER = "gather_full_optim_state_dict"
_SHARD = "get_shard_from_optim_state_dict"

POSITIONAL_KEYS = ("param_id_map", "uncollected_local_ids")
"""Keys that only fairscale's consolidated optimizer state has: its positional form."""


def route_fairscale_optim_state(runtime: Runtime, units: Sequence[nn.Module], patch: Patch) -> None:
    """On each of ``units`` that has fairscale's two optimizer-state methods, route the
    gathering to flatview's consolidated state and refuse the cutting (see the module
    docstring)."""
    for unit in units:
        if callable(getattr(unit, _GATHER, None)) and callable(getattr(unit, _SHARD, None)):
            patch(unit, _GATHER, functools.partial(_gather, runtime))
            patch(unit, _SHARD, _refuse_shard)


def _gather(
    runtime: Runtime, optim: torch.optim.Optimizer, **ignored: Any
) -> dict[str, Any] | None:
    """fairscale's ``gather_full_optim_state_dict``, on views: rank 0 gets
    :meth:`flatview.FlatView.optim_state_dict` ``(optim, rank0_only=True)``, the others
    ``None``. A collective, as fairscale's."""
    state = consolidated(runtime, optim, rank0_only=True)
    return state if is_rank0(runtime.adapter) else None


def _refuse_shard(full_optim_state_dict: Any, *args: Any, **kwargs: Any) -> Any:
    raise OptimStateError(
        f"fairscale's {_SHARD} cuts an optimizer state into pieces of FSDP's flat "
        "parameters, to be loaded by position; on a model wrapped by flatview the "
        "optimizers hold views. Load the state on every rank with "
        "fv.load_optim_state_dict(optimizer, state) (FlatView.load_optim_state_dict), "
        f"which takes what {_GATHER} returns, on a wrapped model (the consolidated state "
        "by original name, as FlatView.optim_state_dict gives) or on bare fairscale (by "
        "position, converted to names), and matches parameters by name"
    )


def loadable(table: ParamTable, units: Sequence[nn.Module], backend: str, state_dict: Any) -> Any:
    """``state_dict`` in the form :meth:`flatview.FlatView.load_optim_state_dict` takes:
    bare fairscale's consolidated state (by position) converted to names, through the
    positions of this model's ``units`` (fairscale's, in module order, as fairscale
    numbers them); any other dict as it is.

    Raises:
        flatview.OptimStateError: a positional state given to a model on another
            backend, or one that does not fit this model's units: another count of
            parameters, a parameter placed in another unit than at saving (the nesting
            changed), state of units fairscale does not gather (``no_broadcast_optim_state``),
            or per-rank scalars that differ. Nothing is loaded then; nothing is
            communicated, so every rank given the same dict raises alike.
    """
    if not (isinstance(state_dict, Mapping) and all(k in state_dict for k in POSITIONAL_KEYS)):
        return state_dict
    if backend != "fairscale":
        raise OptimStateError(
            f"this optimizer state is fairscale's own (from {_GATHER} on bare fairscale: "
            f"it numbers parameters by position among fairscale's units), but the model is "
            f"wrapped by {backend}. Load it into the fairscale model it was saved from "
            "(same units), wrapped by flatview, and save FlatView.optim_state_dict from "
            "there: that form, by name, loads on any backend"
        )
    positions = _positions(table, units)
    return _by_name(state_dict, positions)


def _positions(table: ParamTable, units: Sequence[nn.Module]) -> list[tuple[str, int]]:
    """Per fairscale position, the original name and the index of its unit among the
    units that hold parameters (fairscale's ``get_fsdp_instances(skip_empty=True)``)."""
    positions: list[tuple[str, int]] = []
    holding = 0
    for unit in units:
        params = unit.non_shared_params()  # type: ignore[operator]
        if not params:
            continue
        for param in params:
            record = table.flat_record(param)
            if record is not None:
                positions.extend((table.name(i), holding) for i in record.params)
                continue
            index = table.index_of(param)
            if index is None:
                raise OptimStateError(
                    f"a parameter of fairscale unit {type(unit).__name__} is not one flatview "
                    "knows: cannot number the saved state's positions"
                )
            positions.append((table.name(index), holding))
        holding += 1
    return positions


def _by_name(state_dict: Mapping[str, Any], positions: list[tuple[str, int]]) -> dict[str, Any]:
    groups = state_dict.get("param_groups")
    state = state_dict.get("state")
    if not isinstance(groups, Sequence) or len(groups) != 1 or not isinstance(state, Mapping):
        raise OptimStateError(
            f"not fairscale's consolidated optimizer state: {_GATHER} saves one parameter "
            "group and a 'state' by position"
        )
    uncollected = list(state_dict["uncollected_local_ids"])
    if uncollected:
        raise OptimStateError(
            f"this fairscale optimizer state holds units {uncollected} (by position among "
            "units with parameters) as rank 0 had them alone (no_broadcast_optim_state: "
            "experts): the other ranks' state of those units is not in it. Resume them "
            "from the per-rank checkpoints they were saved in"
        )
    saved = list(groups[0].get("params", ()))
    units_of: Mapping[Any, Any] = state_dict["param_id_map"]
    if len(saved) != len(positions) or len(units_of) != len(positions):
        raise OptimStateError(
            f"this fairscale optimizer state numbers {len(saved)} parameters, the wrapped "
            f"model's fairscale units hold {len(positions)}: it was saved from another model "
            "or other units"
        )
    moved = [
        name
        for position, (name, unit) in enumerate(positions)
        if units_of.get(position) not in (None, unit)
    ]
    if moved:
        raise OptimStateError(
            "this fairscale optimizer state puts parameters in other units than the "
            f"wrapped model does (the nesting changed since it was saved): {moved[:8]}"
        )
    names = [name for name, _ in positions]
    by_name: dict[str, Any] = {}
    for position, entry in state.items():
        if not isinstance(position, int) or not 0 <= position < len(names):
            raise OptimStateError(
                f"this fairscale optimizer state has an entry at {position!r}: not a "
                f"position among the model's {len(names)} parameters"
            )
        by_name[names[position]] = {
            key: _one_value(names[position], key, value) for key, value in entry.items()
        }
    group = {k: v for k, v in groups[0].items() if k != "params"}
    group["params"] = [names[position] for position in saved]
    return {"state": by_name, "param_groups": [group]}


def _one_value(name: str, key: str, value: Any) -> Any:
    """fairscale keeps a 0-dim tensor state as the list of every rank's; ranks agree on
    it for an optimizer that trains each piece of a parameter alike."""
    if not isinstance(value, list):
        return value
    if value and all(isinstance(v, torch.Tensor) and torch.equal(v, value[0]) for v in value):
        return value[0]
    raise OptimStateError(
        f"state {key!r} of {name!r} in this fairscale optimizer state differs across the "
        "ranks that saved it: it has no single value to load by name"
    )
