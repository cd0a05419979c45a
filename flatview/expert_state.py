"""Consolidated optimizer state of models with experts: which expert group a dict holds.

Ranks of different expert groups (units on process groups of their own) hold different
experts under the same names, so a consolidated state dict
(:meth:`flatview.FlatView.optim_state_dict`, :meth:`flatview.optim.Whole.state_dict`)
holds the shared parameters and the experts of the saving rank's group only, and differs
between groups. Two habits that are right without experts would then load one group's
experts into another's, silently: saving on rank 0 alone (``rank0_only=True``, or
``torch.save`` on rank 0) and loading that one file on every rank. So:

* such a dict carries :data:`KEY`, the global ranks of the expert group it was saved on,
  and loading it on a rank of another group raises (:func:`check`);
* ``rank0_only=True`` is refused on such models (:func:`refuse_rank0_only`): decided by
  the model alone, so every rank raises alike, before any collective.

A dict without :data:`KEY` (saved by a model without expert units) loads as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from flatview.errors import OptimStateError
from flatview.table import ParamTable

KEY = "expert_group"
"""The top-level key of a consolidated state dict that names its expert group's ranks."""


def expert_ranks(table: ParamTable) -> tuple[int, ...] | None:
    """The global ranks of this rank's expert group, ``None`` for a model without units
    on process groups of their own."""
    own = table.own_group_params
    if not own:
        return None
    group = table.own_group(min(own))
    assert group is not None
    return tuple(dist.get_process_group_ranks(group.group))


def tagged(state_dict: dict[str, Any], table: ParamTable) -> dict[str, Any]:
    """``state_dict`` with :data:`KEY` where the model has experts."""
    ranks = expert_ranks(table)
    if ranks is not None:
        state_dict[KEY] = list(ranks)
    return state_dict


def check(state_dict: Mapping[str, Any], table: ParamTable) -> None:
    """Refuse a dict saved on another expert group than this rank's."""
    saved = state_dict.get(KEY)
    ranks = expert_ranks(table)
    if saved is None or ranks is None or tuple(saved) == ranks:
        return
    raise OptimStateError(
        f"this optimizer state was saved on the expert group of ranks {list(saved)}, and "
        f"this rank ({dist.get_rank()}) is in the expert group of ranks {list(ranks)}: "
        "ranks of different expert groups hold different experts under the same names. "
        "Save the state on every rank and load each rank's own"
    )


def refuse_rank0_only(table: ParamTable, call: str) -> None:
    """Refuse ``rank0_only=True`` on a model with experts (see the module docstring)."""
    own = table.own_group_params
    if own:
        raise OptimStateError(
            f"{call}(rank0_only=True) would keep rank 0's experts alone: this model has "
            f"FSDP units on process groups of their own (experts, such as "
            f"{table.name(min(own))!r}), which ranks of different groups hold under the "
            "same names. Save the state on every rank (each holds the shared parameters "
            "and its group's experts)"
        )
