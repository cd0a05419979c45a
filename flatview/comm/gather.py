"""Masked all-gather: gather only the used segments of a partly skipped flat parameter.

A forward pass reads only the parameters it uses, so the skipped segments of a flat
parameter need not travel. Packing costs a copy on each side, so masking pays only when
enough is skipped, and enough to be worth a few more operations per gather: measured
on 2 processes over gloo (``benchmarks/micro_allgather.py``, 12 MiB), with half the
elements moved it took 0.6-0.75x the plain all-gather's time, with 83% moved about
1.0x, with everything moved 1.2x. :data:`MASK_GATHER_BELOW` is the largest share of the
plain bytes a masked gather may move and still be chosen, and
:data:`~flatview.comm.options.MASK_GATHER_MIN_SAVED` the fewest elements it must save.

Skipped regions of the gathered buffer are filled with NaN: a model that reads a
parameter it declared skipped then produces NaN loudly instead of stale memory quietly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from flatview.comm._compat import all_gather_single
from flatview.comm.ledger import Ledger
from flatview.comm.packing import PlanIndex
from flatview.layout import MaskPlan

MASK_GATHER_BELOW = 0.6


def masking_pays(plan: MaskPlan, min_saved: int) -> bool:
    """Whether a masked all-gather of ``plan`` beats gathering the whole flat parameter:
    it moves at most :data:`MASK_GATHER_BELOW` of the bytes and leaves out at least
    ``min_saved`` elements (:attr:`~flatview.comm.options.ReduceOptions.mask_gather_min_saved`:
    below that, packing and unpacking cost more than the bytes save)."""
    whole = plan.layout.padded_numel
    return plan.padded_total <= MASK_GATHER_BELOW * whole and whole - plan.padded_total >= min_saved


@torch.no_grad()
def masked_all_gather(
    rows: Sequence[torch.Tensor],
    local_shard: torch.Tensor,
    plan: MaskPlan,
    index: PlanIndex,
    rank: int,
    group: dist.ProcessGroup | None,
    ledger: Ledger,
) -> None:
    """Fill ``rows[r]`` (rank ``r``'s part of the unsharded flat parameter) with rank
    ``r``'s used elements, gathered from every rank's ``local_shard``; NaN elsewhere."""
    world = len(rows)
    width = max(plan.counts)
    packed = local_shard.new_zeros(width)
    packed[: plan.counts[rank]] = index.pick(local_shard, rank)
    gathered = local_shard.new_empty(width * world)
    ledger.record("masked_all_gather", gathered)
    all_gather_single(gathered, packed, group=group)
    for r, row in enumerate(rows):
        row.fill_(float("nan"))
        index.place(row, gathered[r * width : r * width + plan.counts[r]], r)
