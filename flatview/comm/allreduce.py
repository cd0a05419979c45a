"""Masked all-reduce: the replicated-gradient counterpart of :mod:`flatview.comm.reduce`.

Wrappers that do not shard (torch FSDP ``NO_SHARD``, which is DDP's job done by FSDP)
all-reduce the whole flat gradient in place. With a skip set only the used segments
need to travel: they are packed into one buffer, all-reduced, and written back. The
skipped segments keep their local values, which are the same on every rank: zeros, or
a gradient an earlier synchronised step left there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flatview.comm.ledger import Ledger
from flatview.layout import MaskPlan


@torch.no_grad()
def masked_all_reduce(
    tensor: torch.Tensor,
    plan: MaskPlan,
    group: dist.ProcessGroup | None,
    ledger: Ledger,
    *,
    predivide: float = 1.0,
    postdivide: float = 1.0,
) -> None:
    """All-reduce (sum) the used elements of ``tensor`` in place over ``group``.

    ``plan`` must be a plan over an unsharded layout (``world_size == 1``): its only
    row lists the used intervals of the flat tensor. The used elements are divided by
    ``predivide`` before and by ``postdivide`` after the reduction (pass the group size
    split between them to average, as torch FSDP does to limit overflow in low
    precision). A plan with nothing used communicates nothing.

    Args:
        tensor: the 1-D flat gradient, ``plan.layout.numel`` elements or more (elements
            past the layout's end are left alone).
        plan: which segments are used.
        group: the process group to reduce over.
        ledger: where the collective's call and bytes are recorded (kind ``all_reduce``).
        predivide: divisor applied before the all-reduce (1 for none).
        postdivide: divisor applied after the all-reduce (1 for none).
    """
    if plan.layout.world_size != 1:
        raise ValueError(
            f"masked_all_reduce needs a plan over an unsharded layout, got world size "
            f"{plan.layout.world_size}"
        )
    if tensor.dim() != 1 or tensor.numel() < plan.layout.numel:
        raise ValueError(
            f"expected a 1-D tensor of at least {plan.layout.numel} elements, got shape "
            f"{tuple(tensor.shape)}"
        )
    intervals = plan.per_rank[0]
    if not intervals:
        return
    whole = len(intervals) == 1 and intervals[0] == (0, tensor.numel())
    # Reducing in place avoids the pack/unpack copies when everything is used.
    packed = tensor if whole else torch.cat([tensor[start:end] for start, end in intervals])
    if predivide > 1:
        packed.div_(predivide)
    ledger.record("all_reduce", packed)
    dist.all_reduce(packed, group=group)
    if postdivide > 1:
        packed.div_(postdivide)
    if whole:
        return
    offset = 0
    for start, end in intervals:
        tensor[start:end].copy_(packed[offset : offset + end - start])
        offset += end - start
