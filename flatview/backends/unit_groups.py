"""Units on process groups of their own: experts (:class:`~flatview.backends.base.UnitGroup`).

A mixture-of-experts model often wraps each rank's experts in an FSDP unit of their own,
on a process group other than the root's: one group per rank (torch's and fairscale's
own MoE tests: each rank trains its own experts, whose gradients are not averaged across
ranks), or one group per set of ranks (expert groups, whose ranks shard and average the
experts between them). Each such unit gathers and reduces in its own group; skip sets of
its parameters need to agree only among the ranks that share the group.

:func:`own_groups` finds those units at wrap time and checks, with one
``all_gather_object`` over the root's group (only when a unit has a group of its own),
that every rank holds the same such units, that each group is a group of ranks of the
root's group on all of its members alike, and that all of them split the ranks the same
way (one *partition*: the groups of every such unit on rank ``r`` hold the same ranks).
One partition keeps the order of collectives safe: the ranks that share a group skip
alike, so they issue the same collectives in the same order on the root's group and on
theirs, and no two ranks wait for each other on different groups. Every rank decides
the same from the same gathered descriptions, so a refusal is raised on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from flatview.backends.base import UnitGroup
from flatview.comm.collectives import gather_objects
from flatview.errors import WrapError


def own_groups(
    units: Sequence[tuple[str, dist.ProcessGroup | None]], root: dist.ProcessGroup | None
) -> dict[int, UnitGroup]:
    """Per index into ``units`` (``(name, process group)``, root first), the group of each
    unit whose group is not ``root`` (the root unit's): checked as the module docstring
    says, a collective over ``root`` when there are any."""
    own = [(i, name, group) for i, (name, group) in enumerate(units) if group is not root]
    if not own:
        return {}
    mine: dict[str, Any]
    try:
        members = tuple(_ranks_in(group, root, name) for _, name, group in own)
        mine = {"units": tuple(name for _, name, _ in own), "members": members}
    except WrapError as err:
        mine = {"error": str(err)}
    peers = partition(gather_objects(mine, root))
    return {
        i: UnitGroup(group, dist.get_rank(group), dist.get_world_size(group), peers)
        for i, _, group in own
        if group is not None
    }


def _ranks_in(
    group: dist.ProcessGroup | None, root: dist.ProcessGroup | None, unit: str
) -> tuple[int, ...]:
    """The ranks of ``group``, numbered as ranks of ``root``."""
    if group is None:
        raise WrapError(
            f"FSDP unit {unit or '<root>'!r} is on the default process group while the root "
            "unit is on another: flatview needs every unit on the root's group or on a group "
            "of its ranks"
        )
    found = []
    for global_rank in dist.get_process_group_ranks(group):
        in_root = global_rank if root is None else dist.get_group_rank(root, global_rank)
        if in_root < 0:
            raise WrapError(
                f"FSDP unit {unit!r} is on a process group holding global rank {global_rank}, "
                "which the root unit's group does not hold"
            )
        found.append(in_root)
    return tuple(sorted(found))


def partition(everyone: Sequence[dict[str, Any]]) -> tuple[tuple[int, ...], ...]:
    """The ranks each rank shares its units' own groups with (per rank of the root's
    group), from every rank's description; :class:`~flatview.errors.WrapError` (the same
    on every rank) if they do not form one partition held alike by all ranks."""
    failed = [f"rank {r}: {d['error']}" for r, d in enumerate(everyone) if "error" in d]
    if failed:
        raise WrapError("units on process groups of their own refused: " + "; ".join(failed))
    names = everyone[0]["units"]
    if any(d["units"] != names for d in everyone):
        held = "; ".join(f"rank {r}: {list(d['units'])}" for r, d in enumerate(everyone))
        raise WrapError(
            "ranks hold different FSDP units on process groups of their own (every rank must "
            f"wrap the same modules the same way): {held}"
        )
    peers = []
    for rank, description in enumerate(everyone):
        groups = set(description["members"])
        if len(groups) != 1:
            raise WrapError(
                f"on rank {rank} the FSDP units {list(names)} are on process groups of "
                f"different ranks ({sorted(groups)}); flatview supports units on their own "
                "groups that all split the ranks the same way (one group per rank, or one "
                "set of expert groups)"
            )
        (group,) = groups
        if rank not in group:
            raise WrapError(f"rank {rank}'s own process group {list(group)} does not hold it")
        peers.append(group)
    for rank, group in enumerate(peers):
        for other in group:
            if peers[other] != group:
                raise WrapError(
                    f"the own process groups of FSDP units {list(names)} differ between ranks "
                    f"{rank} ({list(group)}) and {other} ({list(peers[other])}), which share "
                    "one: every rank of a group must be on the same group"
                )
    return tuple(peers)
