"""Masked gradient reduction: only the used elements of an unsharded gradient travel.

For each flat parameter a :class:`~flatview.layout.MaskPlan` says which elements are
used and which rank owns them. Gradients are *packed* (used elements only, in flat
order, which is also destination-rank order), queued in a bucket, and reduced with one
collective per bucket. Two collectives can do it:

* ``reduce_scatter``: every rank's part is padded to the largest part, so when skipped
  spans fall unevenly across shards it moves up to ``world_size`` times the used bytes;
  but it is the collective that communication libraries optimise best.
* ``all_to_all``: uneven splits move exactly the used bytes; each rank then sums the
  ``world_size`` parts it received.

:func:`choose_strategy` picks ``reduce_scatter`` unless its padding would cost more than
:data:`PAD_TOLERANCE` over the exact size. The result handed back is a sharded gradient
with zeros wherever nothing was used.

Wrappers that replicate rather than shard (torch FSDP ``NO_SHARD``: DDP's job) queue
their gradients with :meth:`MaskedReducer.add_replicated`; those buckets are reduced with
one all-reduce of the packed used elements.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flatview.comm._compat import reduce_scatter_single
from flatview.comm.ledger import Ledger
from flatview.layout import MaskPlan

PAD_TOLERANCE = 0.05
"""Padding overhead of an even reduce-scatter accepted before the exact all-to-all wins."""


class Strategy(enum.Enum):
    """Which collective reduces a bucket of packed gradients."""

    AUTO = "auto"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"


def choose_strategy(counts: Sequence[int], requested: Strategy) -> Strategy:
    """The collective for one bucket whose parts, per destination rank, are ``counts``."""
    if requested is not Strategy.AUTO:
        return requested
    exact = sum(counts)
    padded = max(counts, default=0) * len(counts)
    return Strategy.REDUCE_SCATTER if padded <= exact * (1 + PAD_TOLERANCE) else Strategy.ALL_TO_ALL


class PlanIndex:
    """How to pick one mask plan's used elements out of each rank's row, built once.

    Runs of used elements are copied slice by slice (a memcpy each). Only a row with
    many short runs, where a Python loop per run would cost more than the copy, gets an
    index tensor for one gather; it is small precisely because the runs are short.
    """

    MANY_RUNS = 32
    SHORT_RUN = 256

    def __init__(self, plan: MaskPlan, device: torch.device) -> None:
        self.runs: list[tuple[tuple[int, int], ...] | None] = []
        self.indices: list[torch.Tensor | None] = []
        for intervals in plan.per_rank:
            used = sum(end - start for start, end in intervals)
            if len(intervals) > self.MANY_RUNS and used < self.SHORT_RUN * len(intervals):
                self.runs.append(None)
                self.indices.append(
                    torch.cat([torch.arange(s, e, device=device) for s, e in intervals])
                )
            else:
                self.runs.append(intervals)
                self.indices.append(None)

    def pick(self, row: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s used elements of ``row``, packed (a view when one run)."""
        runs = self.runs[rank]
        if runs is None:
            index = self.indices[rank]
            assert index is not None
            return row.index_select(0, index)
        if len(runs) == 1:
            return row[runs[0][0] : runs[0][1]]
        if not runs:
            return row[:0]
        return torch.cat([row[start:end] for start, end in runs])

    def place(self, target: torch.Tensor, values: torch.Tensor, rank: int) -> None:
        """Write packed ``values`` back to rank ``rank``'s used positions of ``target``."""
        runs = self.runs[rank]
        if runs is None:
            index = self.indices[rank]
            assert index is not None
            target.index_copy_(0, index, values)
            return
        offset = 0
        for start, end in runs:
            target[start:end] = values[offset : offset + end - start]
            offset += end - start


@dataclass
class _Entry:
    plan: MaskPlan
    index: PlanIndex
    parts: list[torch.Tensor]
    """Per destination rank, the used elements it gets (views when all are used)."""
    on_done: Callable[[torch.Tensor], None]
    whole: torch.Tensor | None = None
    """The caller's padded gradient as one contiguous tensor, when all of it is used:
    a bucket holding only this entry reduce-scatters it directly, without a copy."""

    @property
    def numel(self) -> int:
        return sum(part.numel() for part in self.parts)


class MaskedReducer:
    """Packs, buckets and reduces the gradients of partly used flat parameters.

    Not thread-safe: one instance per model, driven from the backward pass.
    """

    INDEX_CACHE = 256

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        rank: int,
        world_size: int,
        ledger: Ledger,
        bucket_numel: int,
        strategy: Strategy = Strategy.AUTO,
    ) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.ledger = ledger
        self.bucket_numel = bucket_numel
        self.strategy = strategy
        self._entries: list[_Entry] = []
        self._replicated: list[_Entry] = []
        self._queued_numel = 0
        # Skip sets vary per step (2**blocks patterns for stochastic depth): keep the
        # index of recent plans only.
        self._indices: OrderedDict[int, tuple[MaskPlan, PlanIndex]] = OrderedDict()

    def index_of(self, plan: MaskPlan, device: torch.device) -> PlanIndex:
        """The (cached) index tensors of ``plan``."""
        cached = self._indices.get(id(plan))
        if cached is None or cached[0] is not plan:
            cached = (plan, PlanIndex(plan, device))
            self._indices[id(plan)] = cached
            if len(self._indices) > self.INDEX_CACHE:
                self._indices.popitem(last=False)
        else:
            self._indices.move_to_end(id(plan))
        return cached[1]

    @torch.no_grad()
    def add(
        self,
        rows: Sequence[torch.Tensor],
        plan: MaskPlan,
        on_done: Callable[[torch.Tensor], None],
        whole: torch.Tensor | None = None,
    ) -> None:
        """Queue one flat parameter's unsharded gradient, given as ``world_size`` rows of
        ``shard_numel`` elements (row ``r`` is what rank ``r`` owns, padding included);
        ``on_done`` later receives this rank's sharded gradient. ``whole`` may give the
        same gradient as one contiguous padded tensor (the rows are then its views)."""
        if len(rows) != self.world_size or plan.layout.world_size != self.world_size:
            raise ValueError(
                f"{len(rows)} rows and a plan for world size {plan.layout.world_size} given "
                f"to a reducer of world size {self.world_size}"
            )
        index = self.index_of(plan, rows[0].device)
        if plan.all_used:
            # Views, no copy. Holding them keeps the caller's gradient alive until the
            # flush, which the bucket size bounds since every element is used; wrappers
            # drop their reference to the unsharded gradient once handed over.
            parts = [index.pick(row, rank) for rank, row in enumerate(rows)]
        else:
            # Pack now, so that the (larger) unsharded gradient can be freed at once.
            packed = torch.cat([index.pick(row, rank) for rank, row in enumerate(rows)])
            parts = list(packed.split(list(plan.counts)))
            whole = None
        entry = _Entry(plan, index, parts, on_done, whole)
        self._entries.append(entry)
        self._queued_numel += entry.numel
        if self._queued_numel >= self.bucket_numel:
            self.flush()

    @torch.no_grad()
    def add_replicated(
        self,
        grad: torch.Tensor,
        plan: MaskPlan,
        on_done: Callable[[torch.Tensor], None],
        predivide: float = 1.0,
    ) -> None:
        """Queue one replicated flat gradient for an all-reduce of its used elements.

        ``plan`` is over an unsharded layout (world size 1). ``on_done`` later receives
        the reduced used elements, packed in flat order (place them with
        ``index_of(plan, ...).place(target, values, 0)``). They are divided by
        ``predivide`` before the reduction, as torch FSDP does against overflow.
        """
        if plan.layout.world_size != 1:
            raise ValueError(f"add_replicated needs an unsharded plan, got {plan.layout}")
        index = self.index_of(plan, grad.device)
        # A copy (cat always copies): the caller's gradient may change before the flush.
        packed = torch.cat([index.pick(grad, 0)])
        if predivide != 1.0:
            packed.div_(predivide)
        self._replicated.append(_Entry(plan, index, [packed], on_done))
        self._queued_numel += packed.numel()
        if self._queued_numel >= self.bucket_numel:
            self.flush()

    @torch.no_grad()
    def flush(self) -> None:
        """Reduce everything queued, one collective per kind of bucket, and hand out
        the results."""
        replicated, self._replicated = self._replicated, []
        entries, self._entries, self._queued_numel = self._entries, [], 0
        if replicated:
            self._all_reduce(replicated)
        if not entries:
            return
        world = self.world_size
        counts = [sum(e.plan.counts[r] for e in entries) for r in range(world)]
        if sum(counts) == 0:
            mine = entries[0].parts[0].new_zeros(0)
        elif choose_strategy(counts, self.strategy) is Strategy.REDUCE_SCATTER:
            mine = self._reduce_scatter(entries, counts)
        else:
            mine = self._all_to_all(entries, counts)
        offset = 0
        for entry in entries:
            count = entry.plan.counts[self.rank]
            received = mine[offset : offset + count]
            offset += count
            if entry.index.runs[self.rank] == ((0, entry.plan.layout.shard_numel),):
                # This rank's whole shard was used: what arrived is the shard.
                entry.on_done(received)
                continue
            shard = received.new_zeros(entry.plan.layout.shard_numel)
            entry.index.place(shard, received, self.rank)
            entry.on_done(shard)

    def _all_reduce(self, entries: list[_Entry]) -> None:
        buffer = torch.cat([entry.parts[0] for entry in entries])
        if buffer.numel():
            self.ledger.record("all_reduce", buffer)
            dist.all_reduce(buffer, group=self.group)
        offset = 0
        for entry in entries:
            count = entry.numel
            entry.on_done(buffer[offset : offset + count])
            offset += count

    def _parts(self, entries: list[_Entry], rank: int) -> list[torch.Tensor]:
        return [entry.parts[rank] for entry in entries]

    def _reduce_scatter(self, entries: list[_Entry], counts: list[int]) -> torch.Tensor:
        width = max(counts)
        whole = entries[0].whole
        if len(entries) == 1 and whole is not None and whole.numel() == width * self.world_size:
            # One fully used gradient, already laid out as the collective wants it.
            send = whole.view(self.world_size, width)
        else:
            send = entries[0].parts[0].new_empty(self.world_size, width)
            for rank in range(self.world_size):
                torch.cat(self._parts(entries, rank), out=send[rank, : counts[rank]])
                send[rank, counts[rank] :].zero_()
        out = send.new_empty(width)
        self.ledger.record("reduce_scatter", send)
        reduce_scatter_single(out, send.view(-1), group=self.group)
        return out[: counts[self.rank]]

    def _all_to_all(self, entries: list[_Entry], counts: list[int]) -> torch.Tensor:
        send = torch.cat(
            [part for rank in range(self.world_size) for part in self._parts(entries, rank)]
        )
        mine = counts[self.rank]
        recv = send.new_empty(mine * self.world_size)
        self.ledger.record("all_to_all", send)
        dist.all_to_all_single(
            recv,
            send,
            output_split_sizes=[mine] * self.world_size,
            input_split_sizes=counts,
            group=self.group,
        )
        return recv.view(self.world_size, mine).sum(0)
