"""Gathering per-element optimizer state across ranks, packed: what
:func:`flatview.optim_state.consolidate` moves.

Every per-element state tensor of a sharded parameter is assembled from the pieces all
ranks hold: per dtype, the entries are split into buckets (:func:`buckets`) whose
gathered size stays within :data:`BUCKET_NUMEL`, each rank packs its pieces of a bucket
end to end (:func:`pack`), one collective gathers the rows
(:func:`flatview.comm.consolidate.gather_packed`), and :func:`unpack` lays every rank's
elements into full tensors of the original shapes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from flatview.backends.base import Adapter
from flatview.comm.consolidate import gather_packed
from flatview.layout import Placement

BUCKET_NUMEL = 2**24
"""Largest number of elements one gathering collective receives (all ranks together),
unless a single state tensor is larger."""

Kind = tuple[Any, ...]
"""How one rank holds one state value: ``("elem", dtype)``, ``("value", value)`` or
``("other", shape)`` (a tensor that is neither)."""


def buckets(counts: Sequence[Sequence[int]], cap: int = BUCKET_NUMEL) -> list[range]:
    """Split entries (``counts[i][r]``: elements entry ``i`` has on rank ``r``) into runs
    whose gathered size, ``world * max over ranks of the run's elements there``, stays
    within ``cap`` (a run of one entry may exceed it)."""
    runs: list[range] = []
    start = 0
    totals: list[int] = []
    for i, row in enumerate(counts):
        grown = [a + b for a, b in zip(totals, row, strict=True)] if totals else list(row)
        if totals and i > start and max(grown) * len(row) > cap:
            runs.append(range(start, i))
            start, grown = i, list(row)
        totals = grown
    if start < len(counts):
        runs.append(range(start, len(counts)))
    return runs


def pack(
    entries: Sequence[tuple[Placement, torch.Tensor | None]],
    width: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """This rank's elements of every entry's state tensor, laid end to end and padded to
    ``width``. A tensor may be ``None`` only where this rank holds none of the parameter."""
    packed = torch.zeros(width, dtype=dtype, device=device)
    cursor = 0
    for home, value in entries:
        start, end = home.local_interval
        if end == start:
            continue
        assert value is not None, home.name
        packed[cursor : cursor + end - start].copy_(value.detach().reshape(-1)[start:end])
        cursor += end - start
    return packed


def unpack(rows: Sequence[torch.Tensor], homes: Sequence[Placement]) -> list[torch.Tensor]:
    """The full tensors of ``homes`` from every rank's packed row (in rank order)."""
    dtype = rows[0].dtype if rows else torch.float32
    fulls = [torch.zeros(home.numel, dtype=dtype) for home in homes]
    for rank, row in enumerate(rows):
        cursor = 0
        for home, full in zip(homes, fulls, strict=True):
            piece = home.piece(rank)
            if piece.numel:
                start, end = piece.param_interval
                full[start:end] = row[cursor : cursor + piece.numel]
                cursor += piece.numel
    return [full.view(home.shape) for full, home in zip(fulls, homes, strict=True)]


def gather(
    plan: Mapping[int, Mapping[Any, Kind]],
    states: Mapping[int, Mapping[Any, Any]],
    order: Sequence[int],
    homes: Sequence[Placement],
    group: dist.ProcessGroup | None,
    world: int,
    device: torch.device,
    rank0_only: bool,
) -> dict[tuple[int, Any], torch.Tensor]:
    """Every per-element tensor of ``plan``, assembled from the pieces of the ``world``
    ranks of ``group`` (the group the parameters are sharded over), on rank 0 only with
    ``rank0_only``, by (position, key)."""
    by_dtype: dict[torch.dtype, list[tuple[int, Any]]] = {}
    for position, kinds in plan.items():
        for key, kind in kinds.items():
            if kind[0] == "elem":
                by_dtype.setdefault(kind[1], []).append((position, key))
    out: dict[tuple[int, Any], torch.Tensor] = {}
    for dtype, entries in by_dtype.items():
        counts = [[homes[order[p]].piece(r).numel for r in range(world)] for p, _ in entries]
        for run in buckets(counts):
            chosen = [entries[i] for i in run]
            width = max(sum(counts[i][r] for i in run) for r in range(world))
            chosen_homes = [homes[order[p]] for p, _ in chosen]
            packed = pack(
                [
                    (home, states.get(p, {}).get(key))
                    for home, (p, key) in zip(chosen_homes, chosen, strict=True)
                ],
                width,
                dtype,
                device,
            )
            gathered = gather_packed(packed, group, rank0_only) if width else packed
            if gathered is None:
                continue
            rows = list(gathered.to("cpu").view(world, width).unbind(0))
            for entry, full in zip(chosen, unpack(rows, chosen_homes), strict=True):
                out[entry] = full
    return out


def shard_groups(adapter: Adapter) -> tuple[dist.ProcessGroup | None, Any]:
    """The group consolidation exchanges descriptions over (every rank of the run, so
    that under hybrid sharding one replica's misuse stops the other replicas too: they
    would train on while it raised) and what each rank adds to its description to tell
    its shard group (its members, ``None`` without replicas)."""
    if adapter.replicas == 1:
        return adapter.group, None
    return adapter.agreement_group, tuple(dist.get_process_group_ranks(adapter.group))


def by_shard_group(everyone: Sequence[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
    """The exchanged descriptions per shard group (by ``"members"``), each in shard-rank
    order (``"shard"``), the groups in order of their first member: what every rank
    merges alike."""
    groups: dict[Any, list[Mapping[str, Any]]] = {}
    for description in everyone:
        groups.setdefault(description["members"], []).append(description)
    return [sorted(groups[key], key=lambda d: d["shard"]) for key in sorted(groups, key=str)]
