"""What :attr:`flatview.FlatView.stats` reports for a backward, and how it is computed.

The runtime records a :class:`StatsSource` at the end of every backward (cheap: a few
references and two small dicts); :func:`step_stats` turns it into
:class:`~flatview.stats.StepStats` only when someone asks (most steps nobody does).
"""

from __future__ import annotations

from dataclasses import dataclass

from flatview.comm.ledger import REPLICA_ALL_REDUCE, Ledger
from flatview.iteration import Iteration
from flatview.stats import StepStats
from flatview.table import ParamTable

REDUCE_KINDS = ("reduce_scatter", "all_to_all", "all_reduce", REPLICA_ALL_REDUCE)
"""The ledger kinds that count as gradient reduction."""


@dataclass(frozen=True)
class StatsSource:
    """What :attr:`flatview.FlatView.stats` of one backward is computed from."""

    skipped: frozenset[int]
    units_skipped: int
    ledger_bytes: dict[str, int]
    ledger_calls: dict[str, int]
    synced: bool

    @classmethod
    def of(cls, iteration: Iteration | None, ledger: Ledger, synced: bool) -> StatsSource:
        """What the backward of ``iteration`` that just ended leaves to compute from."""
        return cls(
            skipped=iteration.skipped if iteration is not None else frozenset(),
            units_skipped=len(iteration.skipped_units) if iteration is not None else 0,
            ledger_bytes=dict(ledger.bytes),
            ledger_calls=dict(ledger.calls),
            synced=synced,
        )


def step_stats(
    table: ParamTable, source: StatsSource, *, wrapper_reduces: bool, replicas: int = 1
) -> StepStats:
    """The figures of the backward ``source`` describes; ``replicas`` > 1: hybrid
    sharding, where the wrapper also all-reduces every shard across the replica group."""
    skipped, synced = source.skipped, source.synced
    dense = used = skipped_bytes = 0
    for flat in table.flats:
        layout = flat.spec.layout
        size = flat.spec.flat.element_size()
        dense += layout.padded_numel * size
        if replicas > 1:
            dense += layout.shard_numel * size
        for segment, index in zip(layout.segments, flat.params, strict=True):
            if index in skipped:
                skipped_bytes += segment.numel * size
            else:
                used += segment.numel * size
    for index in table.reduced_plain:
        tensor = table.tensor(index)
        size = tensor.numel() * tensor.element_size()
        dense += size
        if index in skipped:
            skipped_bytes += size
        elif tensor.requires_grad:
            used += size
    return StepStats(
        reduced_bytes=sum(source.ledger_bytes.get(k, 0) for k in REDUCE_KINDS),
        reduce_calls=sum(source.ledger_calls.get(k, 0) for k in REDUCE_KINDS),
        dense_bytes=dense if synced and wrapper_reduces else 0,
        used_bytes=used if synced and wrapper_reduces else 0,
        skipped_bytes=skipped_bytes,
        params_skipped=len(skipped),
        units_skipped=source.units_skipped,
        units=len(table.units),
        agreement_bytes=source.ledger_bytes.get("agreement", 0),
        synced=synced,
        replica_bytes=source.ledger_bytes.get(REPLICA_ALL_REDUCE, 0),
    )
