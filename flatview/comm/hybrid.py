"""Masked gradient reduction for hybrid sharding: shard within a group, replicate across.

Hybrid sharding (torch FSDP1 ``HYBRID_SHARD`` / ``_HYBRID_SHARD_ZERO2``, FSDP2 on a 2-D
mesh) lays the ranks out as a grid: each *shard group* (a row) splits every flat
parameter among its members; each *replica group* (a column) holds one member of every
shard group, all of one shard rank, hence one shard. torch reduces a gradient with a
reduce-scatter of the padded gradient in the shard group, then an all-reduce of the
shard in the replica group.

:func:`hybrid_reduce` does the same moving only a :class:`~flatview.layout.MaskPlan`'s
used elements on either group: packed per destination shard rank and reduced in the
shard group (padded reduce-scatter or exact all-to-all, as
:func:`~flatview.comm.sharded.choose_strategy` picks for plain sharding), then the packed
used elements of this rank's shard all-reduced in the replica group. Several gradients
may go together, one collective per group for all. Nothing used: no collective at all;
a shard rank that owns no used element skips the replica all-reduce, as do its peers.
The ledger records the shard group's bytes under their usual kinds
(``reduce_scatter``, ``all_to_all``) and the replica group's under
:data:`REPLICA_ALL_REDUCE`. :func:`check_grid` validates the grid from every rank's
groups: the reduction pairs replica peers by shard rank, so a layout that is not a grid
would mix different shards silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flatview.comm._compat import reduce_scatter_single
from flatview.comm.ledger import REPLICA_ALL_REDUCE, Ledger
from flatview.comm.options import Strategy
from flatview.comm.packing import PlanIndex
from flatview.comm.sharded import choose_strategy
from flatview.layout import MaskPlan

__all__ = ["REPLICA_ALL_REDUCE", "HybridGroups", "check_grid", "hybrid_reduce"]


@dataclass(frozen=True)
class HybridGroups:
    """This rank's place in a hybrid grid: its shard group (``None``: the default group)
    and its rank and size there, and its replica group and that group's size."""

    shard: dist.ProcessGroup | None
    shard_rank: int
    shard_size: int
    replica: dist.ProcessGroup | None
    replica_size: int


@torch.no_grad()
def hybrid_reduce(
    grads: Sequence[torch.Tensor],
    plans: Sequence[MaskPlan],
    groups: HybridGroups,
    ledger: Ledger,
    *,
    predivide: float = 1.0,
    postdivide: float = 1.0,
    strategy: Strategy = Strategy.AUTO,
    indices: Sequence[PlanIndex] | None = None,
) -> list[torch.Tensor]:
    """Reduce padded unsharded gradients over the whole grid; return this rank's shards.

    ``grads[i]``: one flat parameter's padded unsharded gradient (one dtype and device
    for all); ``plans[i]``: its mask, over a layout sharded over the shard group. Per
    gradient the result is this rank's shard (a new tensor) of the sum over the grid,
    divided by ``predivide`` before and ``postdivide`` after (as torch FSDP does against
    overflow), zero where nothing is used. Inputs are not changed. ``indices``: the
    plans' cached :class:`~flatview.comm.packing.PlanIndex`. Every rank of the grid
    calls it with the same plans in the same order.

    Raises:
        ValueError: a bad input, before any collective (alike on every rank).
    """
    world = groups.shard_size
    _check(grads, plans, groups, indices)
    if not grads:
        return []
    first = grads[0]
    if indices is None:
        indices = [PlanIndex(plan, first.device) for plan in plans]
    entries = list(zip(grads, plans, indices, strict=True))
    counts = [sum(plan.counts[r] for plan in plans) for r in range(world)]
    mine_count = counts[groups.shard_rank]
    shards = [first.new_zeros(plan.layout.shard_numel) for plan in plans]
    if sum(counts) == 0:
        return shards

    padded = world > 1 and choose_strategy(counts, strategy) is Strategy.REDUCE_SCATTER
    width = max(counts)
    # Packed in destination-rank order; each rank's part padded to `width` for a
    # reduce-scatter, exact for an all-to-all (and for a shard group of one).
    send = first.new_zeros(world * width) if padded else first.new_empty(sum(counts))
    offset = 0
    for rank in range(world):
        offset = rank * width if padded else offset
        for grad, plan, index in entries:
            count = plan.counts[rank]
            row = grad.view(world, -1)[rank]
            index.pack(row, send[offset : offset + count], rank, predivide)
            offset += count
    if world == 1:
        mine = send
    elif padded:
        received = first.new_empty(width)
        ledger.record("reduce_scatter", send)
        reduce_scatter_single(received, send, group=groups.shard)
        mine = received[:mine_count]
    else:
        received = first.new_empty(mine_count * world)
        ledger.record("all_to_all", send)
        dist.all_to_all_single(
            received,
            send,
            output_split_sizes=[mine_count] * world,
            input_split_sizes=counts,
            group=groups.shard,
        )
        mine = received.view(world, mine_count).sum(0)
    if groups.replica_size > 1 and mine_count:
        # Replica peers share this rank's shard rank, so they skip it exactly when it does.
        ledger.record(REPLICA_ALL_REDUCE, mine)
        dist.all_reduce(mine, group=groups.replica)
    offset = 0
    for shard, (_, plan, index) in zip(shards, entries, strict=True):
        count = plan.counts[groups.shard_rank]
        index.place(shard, mine[offset : offset + count], groups.shard_rank, postdivide)
        offset += count
    return shards


def _check(
    grads: Sequence[torch.Tensor],
    plans: Sequence[MaskPlan],
    groups: HybridGroups,
    indices: Sequence[PlanIndex] | None,
) -> None:
    if len(grads) != len(plans) or (indices is not None and len(indices) != len(plans)):
        raise ValueError(f"{len(grads)} gradients for {len(plans)} plans")
    if not 0 <= groups.shard_rank < groups.shard_size or groups.replica_size < 1:
        raise ValueError(f"not a place in a grid: {groups}")
    for number, (grad, plan) in enumerate(zip(grads, plans, strict=True)):
        layout = plan.layout
        if layout.world_size != groups.shard_size:
            raise ValueError(
                f"gradient {number}: its plan shards over {layout.world_size} ranks, the "
                f"shard group has {groups.shard_size}"
            )
        if grad.numel() != layout.padded_numel or not grad.is_contiguous():
            raise ValueError(
                f"gradient {number}: {grad.numel()} elements, its padded layout has "
                f"{layout.padded_numel} (or it is not contiguous)"
            )
        if (grad.dtype, grad.device) != (grads[0].dtype, grads[0].device):
            raise ValueError(f"gradient {number}: another dtype or device than gradient 0")


def check_grid(places: Sequence[tuple[Sequence[int], Sequence[int]]]) -> tuple[int, int]:
    """Check that the ranks' (shard group, replica group) form a grid; return ``(shard
    size, replica size)``. ``places[r]``: global rank ``r``'s two groups, each as its
    members' global ranks in group-rank order. A grid: each kind of group partitions the
    world, in groups of one size, and each replica group holds one member of every shard
    group, all of the same shard rank.

    Raises:
        ValueError: naming the first rank whose groups break this.
    """
    world = len(places)
    for rank, (shard, replica) in enumerate(places):
        for kind, members in (("shard", shard), ("replica", replica)):
            if rank not in members:
                raise ValueError(f"rank {rank} is not in its own {kind} group {list(members)}")
            if any(not 0 <= m < world for m in members):
                raise ValueError(f"rank {rank}'s {kind} group {list(members)} leaves the world")
            for member in members:
                theirs = list(places[member][0 if kind == "shard" else 1])
                if theirs != list(members):
                    raise ValueError(
                        f"ranks {rank} and {member} disagree on their {kind} group: "
                        f"{list(members)} and {theirs}"
                    )
        for member in replica:
            if list(places[member][0]).index(member) != list(shard).index(rank):
                raise ValueError(
                    f"replica peers {rank} and {member} hold different shards (shard ranks "
                    f"{list(shard).index(rank)} and {list(places[member][0]).index(member)})"
                )
    shard_size, replica_size = len(places[0][0]), len(places[0][1])
    if any((len(s), len(r)) != (shard_size, replica_size) for s, r in places):
        raise ValueError("shard groups (or replica groups) of different sizes")
    if shard_size * replica_size != world:
        raise ValueError(f"{shard_size} x {replica_size} groups do not cover {world} ranks")
    return shard_size, replica_size
