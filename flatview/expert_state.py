"""Consolidated optimizer state of models with experts: each expert's state assembled in
its own group, and which expert group a dict holds.

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

Experts sharded over groups of several ranks are assembled from the pieces of their own
group's ranks, not the root's: the one exchange of descriptions
(:func:`flatview.optim_state.agreed_facts`) carries each rank's expert group
(:func:`describe`); the root's merge leaves the sharded experts' positions out
(:func:`restricted`), and every expert group's ranks are merged on every rank, so that
all raise alike (:func:`merge_groups`); their per-element state is then gathered over the
expert group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from flatview.errors import OptimStateError
from flatview.layout import Placement
from flatview.state_gather import Kind, gather
from flatview.state_merge import merge
from flatview.table import ParamRecord, ParamTable

KEY = "expert_group"
"""The top-level key of a consolidated state dict that names its expert group's ranks."""


def expert_ranks(table: ParamTable) -> tuple[int, ...] | None:
    """The global ranks of this rank's expert group, ``None`` for a model without units
    on process groups of their own."""
    group = table.expert_group
    return None if group is None else tuple(dist.get_process_group_ranks(group.group))


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


def rank0_alone(table: ParamTable, what: str, instead: str) -> str:
    """Why ``what`` (a state kept on rank 0 alone) is refused on this model with experts,
    and ``instead``: the one wording of the refusals of rank 0's state."""
    return (
        f"{what} would keep rank 0's experts alone: this model has FSDP units on process "
        f"groups of their own (experts, such as {table.name(min(table.own_group_params))!r}), "
        f"which ranks of different groups hold under the same names. {instead}"
    )


def refuse_rank0_only(table: ParamTable, call: str) -> None:
    """Refuse ``rank0_only=True`` on a model with experts (see the module docstring)."""
    if table.own_group_params:
        raise OptimStateError(
            rank0_alone(
                table,
                f"{call}(rank0_only=True)",
                "Save the state on every rank (each holds the shared parameters and its "
                "group's experts)",
            )
        )


def describe(table: ParamTable) -> tuple[tuple[int, ...], int] | None:
    """What a rank adds to its description: (the global ranks of its expert group, its
    rank there), ``None`` without experts."""
    ranks, group = expert_ranks(table), table.expert_group
    return None if ranks is None or group is None else (ranks, group.rank)


def sharded_experts(
    table: ParamTable, order: Sequence[int], homes: Sequence[Placement]
) -> frozenset[int]:
    """The positions (in the optimizer's order) of experts sharded over their group."""
    own = table.own_group_params
    return frozenset(
        position
        for position, index in enumerate(order)
        if index in own and homes[index].layout is not None
    )


def restricted(
    description: Mapping[str, Any], positions: frozenset[int], *, keep: bool
) -> dict[str, Any]:
    """``description`` with the state of ``positions`` alone (``keep``) or without it."""
    state = description["state"]
    chosen = {p: v for p, v in state.items() if (p in positions) == keep}
    return {**description, "state": chosen}


def merge_groups(
    everyone: Sequence[Mapping[str, Any]],
    positions: frozenset[int],
    order: Sequence[int],
    homes: Sequence[Placement],
    params: Sequence[ParamRecord],
) -> dict[int, dict[Any, Kind]]:
    """Every expert group's plan for the sharded experts at ``positions``, merged from its
    ranks' descriptions in group-rank order, on every rank (all raise the first error
    alike); returns this rank's group's."""
    by_group: dict[tuple[int, ...], list[Mapping[str, Any]]] = {}
    for description in everyone:
        by_group.setdefault(tuple(description["expert"][0]), []).append(description)
    plan: dict[int, dict[Any, Kind]] = {}
    for ranks in sorted(by_group):
        members = sorted(by_group[ranks], key=lambda d: d["expert"][1])
        try:
            merged = merge(
                [restricted(d, positions, keep=True) for d in members], order, homes, params
            )
        except OptimStateError as err:
            raise OptimStateError(f"in the expert group of ranks {list(ranks)}: {err}") from err
        if dist.get_rank() in ranks:
            plan = merged
    return plan


def gathered(
    plan: Mapping[int, Mapping[Any, Kind]],
    positions: frozenset[int],
    states: Mapping[int, Mapping[Any, Any]],
    order: Sequence[int],
    homes: Sequence[Placement],
    table: ParamTable,
    device: torch.device,
) -> dict[tuple[int, Any], torch.Tensor]:
    """The per-element state of the sharded experts at ``positions``, assembled over this
    rank's expert group (every rank of it receives it: ``rank0_only`` is refused with
    experts), by (position, key)."""
    if not positions:
        return {}
    group = table.expert_group
    assert group is not None
    own = {p: kinds for p, kinds in plan.items() if p in positions}
    return gather(own, states, order, homes, group.group, group.world_size, device, False)
