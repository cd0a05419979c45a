"""The grid of hybrid sharding: shard within a group, replicate across.

Hybrid sharding (torch FSDP1 ``HYBRID_SHARD`` / ``_HYBRID_SHARD_ZERO2``, FSDP2 on a 2-D
mesh) lays the ranks out as a grid: each *shard group* (a row) splits every flat
parameter among its members; each *replica group* (a column) holds one member of every
shard group, all of one shard rank, hence one shard. torch reduces a gradient with a
reduce-scatter of the padded gradient in the shard group, then an all-reduce of the
shard in the replica group.

flatview's sharded reduction (:class:`~flatview.comm.sharded.ShardedReduction` with a
replica group) moves only the used elements on either group: each bucket's collective
in the shard group, then one all-reduce of this rank's received used elements across
the replica group (ledger kind :data:`REPLICA_ALL_REDUCE`). :func:`check_grid`
validates the grid from every rank's groups: the reduction pairs replica peers by shard
rank, so a layout that is not a grid would mix different shards silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from flatview.comm.ledger import REPLICA_ALL_REDUCE

__all__ = ["REPLICA_ALL_REDUCE", "HybridGroups", "check_grid"]


@dataclass(frozen=True)
class HybridGroups:
    """This rank's place in a hybrid grid: its shard group (``None``: the default group)
    and its rank and size there, and its replica group and that group's size."""

    shard: dist.ProcessGroup | None
    shard_rank: int
    shard_size: int
    replica: dist.ProcessGroup | None
    replica_size: int


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
