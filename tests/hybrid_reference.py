"""A reference implementation of the masked hybrid reduction, for tests only.

One gradient set at a time, with plain collectives and no buckets or in-place paths:
what :class:`flatview.comm.sharded.ShardedReduction` with a replica group must equal, and
itself checked against hand-computed sums (``tests/test_hybrid.py``). It packs the used
elements per destination shard rank, reduces them in the shard group (padded
reduce-scatter or exact all-to-all, as ``choose_strategy`` picks), then all-reduces the
packed used elements of this rank's shard across the replica group.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from flatview.comm._compat import reduce_scatter_single
from flatview.comm.hybrid import HybridGroups
from flatview.comm.ledger import REPLICA_ALL_REDUCE, Ledger
from flatview.comm.options import Strategy
from flatview.comm.packing import PlanIndex
from flatview.comm.sharded import choose_strategy
from flatview.layout import MaskPlan


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

    masked = not all(plan.all_used for plan in plans)
    padded = world > 1 and choose_strategy(counts, strategy, masked) is Strategy.REDUCE_SCATTER
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
