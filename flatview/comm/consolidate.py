"""The two collectives of optimizer-state consolidation (:mod:`flatview.optim_state`).

First every rank describes the state it holds (keys, kinds, dtypes, scalar values; no
per-element data) and the descriptions are all-gathered as objects, so that every rank
takes the same decisions from the same facts: which state tensors travel, in what
order, and whether ranks disagree (then every rank raises the same error, before any
tensor moves). Then the per-element state travels packed: each rank's pieces laid end
to end and padded to the longest rank's, one all-gather (or a gather to rank 0) per
bucket and dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from flatview.comm._compat import all_gather_single


def exchange(description: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``description`` (a small picklable object), indexed by group rank."""
    world = dist.get_world_size(group)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, description, group=group)
    return everyone


@torch.no_grad()
def gather_packed(
    packed: torch.Tensor, group: dist.ProcessGroup | None, root_only: bool
) -> torch.Tensor | None:
    """Every rank's ``packed`` (1-D, the same length on every rank), laid side by side
    in rank order: on every rank, or only on group rank 0 (``None`` elsewhere)."""
    world = dist.get_world_size(group)
    if not root_only:
        gathered = packed.new_empty(packed.numel() * world)
        all_gather_single(gathered, packed, group=group)
        return gathered
    rank = dist.get_rank(group)
    rows = [packed.new_empty(packed.numel()) for _ in range(world)] if rank == 0 else None
    dst = 0 if group is None else dist.get_global_rank(group, 0)
    dist.gather(packed, rows, dst=dst, group=group)
    return torch.cat(rows) if rows is not None else None
