"""Per-element tensors of sharded parameters as torch ``ShardedTensor`` s, and back.

flatview's sharded checkpoint form (:mod:`flatview.checkpoint`) stores each per-element
tensor of a sharded parameter (the parameter itself, or its optimizer state) as a
``ShardedTensor`` of the original shape whose local shards are this rank's elements:
a rank's piece is a range of the flattened parameter, which :func:`boxes` cuts into a
few rectangular blocks. :func:`sharded_value` builds one; :func:`local_of_sharded` reads
this rank's elements back (what :func:`flatview.optim_state.local_part` does for a full
tensor). torch's sharded-tensor modules are imported only when used.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from flatview.comm.collectives import broadcast_tensor
from flatview.errors import FlatViewError, OptimStateError
from flatview.layout import Placement

if TYPE_CHECKING:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""``(offsets, sizes)`` of a rectangular block of a tensor."""


def boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """The elements ``[start, end)`` of a row-major tensor of ``shape``, flattened, as
    rectangular blocks in element order; each block is contiguous, so a range of the
    flattened local tensor viewed with the block's sizes holds exactly its elements."""
    if end <= start:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))]
    inner = math.prod(shape[1:])
    first, first_col = divmod(start, inner)
    last, last_col = divmod(end, inner)
    rest = tuple(shape[1:])
    if first == last:
        return [((first, *o), (1, *s)) for o, s in boxes(rest, first_col, last_col)]
    out: list[Box] = []
    if first_col:
        out += [((first, *o), (1, *s)) for o, s in boxes(rest, first_col, inner)]
        first += 1
    if last > first:
        out.append(((first, *(0 for _ in rest)), (last - first, *rest)))
    if last_col:
        out += [((last, *o), (1, *s)) for o, s in boxes(rest, 0, last_col)]
    return out


def group_rank(adapter: Any, rank: int) -> int:
    """The global rank of ``rank`` in the adapter's group (ShardedTensor placements)."""
    return global_rank(adapter.group, rank)


def global_rank(group: dist.ProcessGroup | None, rank: int) -> int:
    """The global rank of ``rank`` in ``group`` (``None``: the default group)."""
    if group is None or group == dist.GroupMember.WORLD:
        return rank
    return int(dist.get_global_rank(group, rank))


def sharded_value(
    home: Placement,
    local: torch.Tensor | None,
    dtype: torch.dtype,
    adapter: Any,
    cpu_offload: bool,
) -> Any:
    """The per-element tensor ``local`` (this rank's local tensor of ``home``, or
    ``None`` where it holds none of it) as a tensor of the original shape that
    torch.distributed.checkpoint saves once, whoever holds which elements."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
        TensorProperties,
    )

    device = torch.device("cpu") if cpu_offload or local is None else local.device
    if home.numel == 0:
        return torch.zeros(home.shape, dtype=dtype, device=device)
    if len(home.shape) == 0:
        # One element, on one rank: sent to all (a ShardedTensor has no 0-dim form).
        assert home.layout is not None
        owner = next(r for r in range(home.layout.world_size) if home.piece(r).numel)
        value = torch.zeros((), dtype=dtype, device=adapter.device)
        if local is not None and home.piece(home.rank).numel:
            lo, _ = home.local_interval
            value.copy_(local.reshape(-1)[lo])
        broadcast_tensor(value, group_rank(adapter, owner), adapter.group)
        return value.to(device)
    assert home.layout is not None
    metadata = []
    local_shards = []
    # A rank holding none of the parameter gets an empty block: torch's load planner
    # drops a ShardedTensor without local shards from the keys it expects. It sits past
    # the end, where no real block starts: the save planner takes blocks with the same
    # offsets for copies of one block.
    end_row = (home.shape[0], *(0 for _ in home.shape[1:]))
    nothing: Box = (end_row, (0,) * len(home.shape))
    for rank in range(home.layout.world_size):
        start, end = home.piece(rank).param_interval
        placement = f"rank:{group_rank(adapter, rank)}/{device}"
        for offsets, sizes in boxes(home.shape, start, end) or [nothing]:
            metadata.append(ShardMetadata(list(offsets), list(sizes), placement))
    start, end = home.piece(home.rank).param_interval
    if end <= start:
        placement = f"rank:{group_rank(adapter, home.rank)}/{device}"
        empty = torch.empty(nothing[1], dtype=dtype, device=device)
        local_shards.append(
            Shard(empty, ShardMetadata(list(nothing[0]), list(nothing[1]), placement))
        )
    else:
        assert local is not None, home.name
        lo, _ = home.local_interval
        flat = local.detach().reshape(-1)
        if cpu_offload:
            flat = flat.to("cpu")
        cursor = lo
        for offsets, sizes in boxes(home.shape, start, end):
            numel = math.prod(sizes)
            block = flat[cursor : cursor + numel].view(sizes)
            cursor += numel
            shard_meta = ShardMetadata(
                list(offsets), list(sizes), f"rank:{group_rank(adapter, home.rank)}/{device}"
            )
            local_shards.append(Shard(block, shard_meta))
    properties = TensorProperties(dtype=dtype, requires_grad=False)
    global_metadata = ShardedTensorMetadata(metadata, torch.Size(home.shape), properties)
    sharded: ShardedTensor = ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, global_metadata, process_group=adapter.group
    )
    return sharded


def is_sharded(value: Any) -> bool:
    """Whether ``value`` is a ``ShardedTensor`` (without importing torch's module)."""
    if "torch.distributed._shard.sharded_tensor" not in sys.modules:
        return False
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return isinstance(value, ShardedTensor)


def local_of_sharded(home: Placement, value: Any, like: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's part of a ``ShardedTensor`` made by :func:`flatview.checkpoint.get_state_dict` on
    this model (and filled by ``torch.distributed.checkpoint.load``), shaped as
    :func:`flatview.optim_state.local_part` shapes it. A copy."""
    shards = value.local_shards()
    if home.layout is None:
        return as_full(value).detach().clone()
    start, end = home.piece(home.rank).param_interval
    inner = [math.prod(home.shape[i + 1 :]) for i in range(len(home.shape))]
    out = torch.zeros(home.local_numel, dtype=value.dtype, device=_shard_device(shards))
    lo, _ = home.local_interval
    covered = 0
    for shard in shards:
        offsets = shard.metadata.shard_offsets
        first = sum(o * s for o, s in zip(offsets, inner, strict=True))
        numel = shard.tensor.numel()
        if numel == 0:
            continue
        if first < start or first + numel > end:
            raise OptimStateError(
                f"the ShardedTensor given for {home.name!r} holds elements "
                f"[{first}, {first + numel}) on this rank, which holds [{start}, {end}): "
                "load the sharded form into the dict flatview.checkpoint.get_state_dict "
                "returned for this model (torch.distributed.checkpoint.load reshards it)"
            )
        out[lo + first - start : lo + first - start + numel] = shard.tensor.reshape(-1)
        covered += numel
    if covered != end - start:
        raise OptimStateError(
            f"the ShardedTensor given for {home.name!r} holds {covered} of this rank's "
            f"{end - start} elements: load the sharded form into the dict "
            "flatview.checkpoint.get_state_dict returned for this model"
        )
    if home.padded_shard:
        return out
    if like is not None and like.numel() == out.numel():
        return out.view(like.shape)
    return out


def _shard_device(shards: Sequence[Any]) -> torch.device:
    return shards[0].tensor.device if shards else torch.device("cpu")


def as_full(value: Any) -> torch.Tensor:
    if is_sharded(value):
        shards = value.local_shards()
        if len(shards) != 1 or tuple(shards[0].tensor.shape) != tuple(value.shape):
            raise FlatViewError("a replicated value came as a ShardedTensor of several shards")
        result: torch.Tensor = shards[0].tensor
        return result
    tensor: torch.Tensor = value
    return tensor
