"""A full optimizer state dict that rank 0 alone holds, handed to every rank's pieces:
what lets torch FSDP1's ``optim_state_dict_to_load`` with ``rank0_only`` load over views.

accelerate's FSDP1 plugin (and through it the Hugging Face ``Trainer``) saves a full
optimizer state on rank 0 (``FULL_STATE_DICT``, ``rank0_only=True``, its default), and
loads it back on rank 0 alone: the other ranks pass ``None``. :func:`from_rank0` gives
every rank the same dict with each per-element tensor cut to its pieces, as
``flatview.checkpoint``'s sharded form cuts it (a ``ShardedTensor`` whose local shards
are this rank's elements; the whole tensor where a parameter is not sharded), which
the load then reads as usual.

Rank 0 first broadcasts the dict's skeleton (every value but the per-element tensors,
which it describes by dtype; or the error it found), so that every rank knows which
tensors follow and in what order, or raises with it; then the per-element tensors
travel in buckets of one dtype, one broadcast each, every rank keeping its pieces of
each bucket before the next: no rank holds more of the whole state at once than a
bucket (:data:`flatview.state_gather.BUCKET_NUMEL` elements) or one tensor larger than
that.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from flatview.comm.collectives import broadcast_object, broadcast_tensor
from flatview.errors import OptimStateError
from flatview.reshard import loadable
from flatview.sharded_tensors import global_rank
from flatview.state_gather import BUCKET_NUMEL

if TYPE_CHECKING:
    from flatview.runtime import Runtime

_STEP = "step"


class _Tensor:
    """In the skeleton, a per-element tensor that follows in a bucket."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


def _skeleton(runtime: Runtime, state_dict: Any) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Rank 0's dict with each per-element tensor of a known parameter replaced by a
    :class:`_Tensor`, and those tensors in order."""
    if not (
        isinstance(state_dict, Mapping)
        and isinstance(state_dict.get("state"), Mapping)
        and "param_groups" in state_dict
    ):
        raise OptimStateError(
            "rank 0 was given no optimizer state dict (a mapping with 'state' and "
            "'param_groups') to load on every rank (rank0_only)"
        )
    table = runtime.table
    tensors: list[torch.Tensor] = []
    state: dict[Any, Any] = {}
    for name, entry in state_dict["state"].items():
        index = table.index_of_name(name) if isinstance(name, str) else None
        if index is None or not isinstance(entry, Mapping):
            state[name] = entry  # for the load to name
            continue
        shape = table.params[index].placement.shape
        out: dict[Any, Any] = {}
        for key, value in entry.items():
            elementwise = isinstance(value, torch.Tensor) and (
                value.dim() > 0 or (shape == () and key != _STEP)
            )
            if elementwise and tuple(value.shape) == tuple(shape):
                out[key] = _Tensor(value.dtype)
                tensors.append(value.detach())
            else:
                out[key] = value.detach().cpu() if isinstance(value, torch.Tensor) else value
        state[name] = out
    return {**state_dict, "state": state}, tensors


def from_rank0(runtime: Runtime, state_dict: Any) -> dict[str, Any]:
    """Rank 0's ``state_dict`` (a full optimizer state dict keyed by original name) on
    every rank, its per-element tensors cut to this rank's pieces; what the other ranks
    were given is not read. Collective over the adapter's ``agreement_group``."""
    group = runtime.adapter.agreement_group
    rank0 = torch.distributed.get_rank(group) == 0
    told: Any = None
    tensors: list[torch.Tensor] = []
    if rank0:
        try:
            told, tensors = _skeleton(runtime, state_dict)
        except Exception as err:  # every rank raises it, after the broadcast below
            told = OptimStateError(f"{type(err).__name__}: {err}")
    told = broadcast_object(told, group)
    if isinstance(told, BaseException):
        raise OptimStateError(f"rank 0 could not load its optimizer state dict: {told}")
    slots = [
        (name, key, value.dtype)
        for name, entry in told["state"].items()
        if isinstance(entry, Mapping)
        for key, value in entry.items()
        if isinstance(value, _Tensor)
    ]
    mine = _receive(runtime, slots, tensors if rank0 else None)
    state = {
        name: dict(entry) if isinstance(entry, Mapping) else entry
        for name, entry in told["state"].items()
    }
    for (name, key, _), value in zip(slots, mine, strict=True):
        state[name][key] = value
    return {**told, "state": state}


def _receive(
    runtime: Runtime,
    slots: list[tuple[str, Any, torch.dtype]],
    tensors: list[torch.Tensor] | None,
) -> list[Any]:
    """Each slot's tensor from rank 0 (``tensors``, there; ``None`` elsewhere), as this
    rank loads it, in buckets of one dtype (one broadcast each)."""
    adapter, table = runtime.adapter, runtime.table
    group = adapter.agreement_group
    source = global_rank(group, 0)
    device = adapter.device
    found = [table.index_of_name(name) for name, _, _ in slots]
    indices = [index for index in found if index is not None]
    assert len(indices) == len(slots)  # the skeleton names known parameters only
    homes = [table.params[index].placement for index in indices]
    out: list[Any] = [None] * len(slots)
    order = sorted(range(len(slots)), key=lambda i: str(slots[i][2]))
    start = 0
    while start < len(order):
        dtype = slots[order[start]][2]
        end, total = start, 0
        while end < len(order) and slots[order[end]][2] == dtype:
            numel = homes[order[end]].numel
            if end > start and total + numel > BUCKET_NUMEL:
                break
            total += numel
            end += 1
        chosen = order[start:end]
        if tensors is not None:
            bucket = torch.cat([tensors[i].reshape(-1).to(device, dtype) for i in chosen])
        else:
            bucket = torch.empty(total, dtype=dtype, device=device)
        broadcast_tensor(bucket, source, group)
        cursor = 0
        for i in chosen:
            home = homes[i]
            whole = bucket[cursor : cursor + home.numel]
            cursor += home.numel
            # All of a parameter no rank shards, or of one element (a copy: the bucket
            # goes); else this rank's piece (loadable copies it).
            whole_needed = home.layout is None or not home.shape
            mine = whole.clone() if whole_needed else whole[slice(*home.param_interval)]
            out[i] = loadable(runtime, indices[i], mine)
        start = end
    return out
