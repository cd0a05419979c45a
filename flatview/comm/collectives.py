"""The collectives other rooms call as they are, with their own inputs: gathering and
broadcasting Python objects, a sum, a maximum or a broadcast of one tensor, and one
all-to-all of tensors of uneven sizes. Every ``torch.distributed`` collective flatview
issues is called in :mod:`flatview.comm` (``tests/test_architecture.py`` checks it)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def gather_objects(mine: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``mine`` (picklable), in group rank order, on every rank of ``group``."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def broadcast_object(value: Any, group: dist.ProcessGroup | None) -> Any:
    """Group rank 0's ``value`` (picklable), on every rank of ``group``."""
    box: list[Any] = [value]
    source = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=source, group=group)
    return box[0]


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """The element-wise sum of ``tensor`` over ``group``, in place."""
    dist.all_reduce(tensor, group=group)


def all_reduce_max(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """The element-wise maximum of ``tensor`` over ``group``, in place."""
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)


def broadcast_tensor(tensor: torch.Tensor, source: int, group: dist.ProcessGroup | None) -> None:
    """``tensor`` of global rank ``source``, in place on every rank of ``group``."""
    dist.broadcast(tensor, src=source, group=group)


def all_to_all(
    incoming: torch.Tensor,
    outgoing: torch.Tensor,
    incoming_splits: list[int],
    outgoing_splits: list[int],
    group: dist.ProcessGroup | None,
) -> None:
    """Send ``outgoing`` cut into ``outgoing_splits`` (one piece per rank) and receive
    ``incoming`` cut into ``incoming_splits``, over ``group``."""
    dist.all_to_all_single(incoming, outgoing, incoming_splits, outgoing_splits, group=group)
