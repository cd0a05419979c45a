"""The sharded reduction: only the used elements of an unsharded gradient travel, and
each rank gets back its shard.

For each flat parameter a :class:`~flatview.layout.MaskPlan` says which elements are
used and which rank owns them. Gradients are *packed* (used elements only, in flat
order, which is also destination-rank order), queued in a bucket across units, and
reduced with one collective per bucket. Two collectives can do it:

* ``reduce_scatter``: every rank's part is padded to the largest part, so when skipped
  spans fall unevenly across shards it moves up to ``world_size`` times the used bytes;
  but it is the collective that communication libraries optimise best.
* ``all_to_all``: uneven splits move exactly the used bytes; each rank then sums the
  ``world_size`` parts it received.

:func:`choose_strategy` picks ``reduce_scatter`` unless something in the bucket is masked
and its padding would cost more than :data:`PAD_TOLERANCE` over the exact size. A bucket
with nothing masked always takes the wrapper's own collective: the all-to-all's local sum
adds the ``world_size`` parts in another order than the reduce-scatter (and, in fp16,
another precision), so on 3 or more ranks it rounds differently from bare FSDP, and what
a step that skips nothing computes must be bare FSDP's, bit for bit. The result handed
back is a sharded gradient with zeros wherever nothing was used.

A padded unsharded gradient that the in-place rule takes (:mod:`flatview.comm.reduction`)
is reduce-scattered straight into the caller's shard instead
(:meth:`ShardedReduction.reduce_scatter_in_place`); its unused elements come out zero,
as from a bucket.

Hybrid sharding (:mod:`flatview.comm.hybrid`) gives the reduction a *replica group* too:
what a bucket's collective brought this rank (the used elements of its shard) is then
all-reduced across the replica group before it is placed, and a gradient reduced unpacked
has its shard all-reduced there once its reduce-scatter is done; the ledger records those
bytes under :data:`~flatview.comm.hybrid.REPLICA_ALL_REDUCE`. A rank whose shard holds
no used element skips that all-reduce, and so do its replica peers (they hold the same
shard rank).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flatview.comm._compat import reduce_scatter_single
from flatview.comm.ledger import REPLICA_ALL_REDUCE, Ledger
from flatview.comm.options import ReduceOptions, Strategy
from flatview.comm.packing import PlanIndex, plan_index
from flatview.comm.reduction import InPlace, Reduction
from flatview.layout import MaskPlan

PAD_TOLERANCE = 0.05
"""Padding overhead of an even reduce-scatter accepted before the exact all-to-all wins."""


def choose_strategy(counts: Sequence[int], requested: Strategy, masked: bool = True) -> Strategy:
    """The collective for one bucket whose parts, per destination rank, are ``counts``;
    ``masked``: some element of the bucket's gradients is left out (not only the
    wrapper's padding)."""
    if requested is not Strategy.AUTO:
        return requested
    if not masked:
        return Strategy.REDUCE_SCATTER
    exact = sum(counts)
    padded = max(counts, default=0) * len(counts)
    return Strategy.REDUCE_SCATTER if padded <= exact * (1 + PAD_TOLERANCE) else Strategy.ALL_TO_ALL


@dataclass
class _Entry:
    plan: MaskPlan
    index: PlanIndex
    parts: list[torch.Tensor]
    """Per destination rank, the used elements it gets (views when all are used)."""
    on_done: Callable[[torch.Tensor], None]
    padded: torch.Tensor | None = None
    """The caller's padded gradient as one contiguous tensor, when all of it is used:
    a bucket holding only this entry reduce-scatters it directly, without a copy."""

    @property
    def numel(self) -> int:
        return sum(part.numel() for part in self.parts)


class ShardedReduction(Reduction):
    """Packs, buckets and reduce-scatters (or all-to-alls) the unsharded gradients of
    partly used flat parameters; a bucket is reduced once it holds ``bucket_numel``
    elements, the rest at :meth:`finish`. ``replica``: hybrid sharding's replica group
    and its size (see the module docstring); ``group`` is then the shard group."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        rank: int,
        world_size: int,
        ledger: Ledger,
        options: ReduceOptions,
        bucket_numel: int,
        replica: tuple[dist.ProcessGroup | None, int] | None = None,
        wrapper_buckets: bool = True,
    ) -> None:
        """``wrapper_buckets``: whether the wrapper's own reduction shares buckets across
        units (fairscale's bucketer) or reduces each unit on its own (torch FSDP1): what
        a gradient all used does unless ``options.bucket_all_used`` says otherwise."""
        super().__init__(group, rank, world_size, ledger, options, bucket_numel)
        self._entries: list[_Entry] = []
        chosen = options.bucket_all_used
        self._bucket_all_used = wrapper_buckets if chosen is None else chosen
        self._replica = replica if replica is not None and replica[1] > 1 else None

    @torch.no_grad()
    def add(
        self,
        rows: Sequence[torch.Tensor],
        plan: MaskPlan,
        on_done: Callable[[torch.Tensor], None],
        padded: torch.Tensor | None = None,
    ) -> None:
        """Queue one flat parameter's unsharded gradient, given as ``world_size`` rows of
        ``shard_numel`` elements (row ``r`` is what rank ``r`` owns, padding included);
        ``on_done`` later receives this rank's sharded gradient. ``padded`` may give the
        same gradient as one contiguous padded tensor (the rows are then its views)."""
        if len(rows) != self.world_size or plan.layout.world_size != self.world_size:
            raise ValueError(
                f"{len(rows)} rows and a plan for world size {plan.layout.world_size} given "
                f"to a reduction of world size {self.world_size}"
            )
        index = plan_index(plan, rows[0].device)
        if plan.all_used:
            # Views, no copy. Holding them keeps the caller's gradient alive until the
            # bucket is reduced, which the bucket size bounds since every element is
            # used; wrappers drop their reference to the unsharded gradient once handed
            # over.
            parts = [index.pick(row, rank) for rank, row in enumerate(rows)]
        else:
            # Pack now, so that the (larger) unsharded gradient can be freed at once.
            packed = torch.cat([index.pick(row, rank) for rank, row in enumerate(rows)])
            parts = list(packed.split(list(plan.counts)))
            padded = None
        entry = _Entry(plan, index, parts, on_done, padded)
        if plan.all_used and not self._bucket_all_used:
            named = self.options.strategy is Strategy.ALL_TO_ALL and self.world_size > 1
            if padded is not None and not named:
                self._reduce_unpacked_now(padded, plan, on_done)
            else:
                self._reduce_entries([entry])
            return
        self._entries.append(entry)
        self._queued(entry.numel)

    def _reduce_unpacked_now(
        self, padded: torch.Tensor, plan: MaskPlan, on_done: Callable[[torch.Tensor], None]
    ) -> None:
        """Reduce-scatter one padded gradient all used, now, in the wrapper's layout:
        the very collective :meth:`reduce_scatter_in_place` starts. A caller may choose
        between the two on facts of its own rank only (torch: whether a shard from an
        earlier backward waits to be accumulated), so both must move the same tensors
        in the same order on every rank."""
        shard = padded.new_empty(plan.layout.shard_numel)
        self.ledger.record("reduce_scatter", padded)
        reduce_scatter_single(shard, padded, group=self.group)
        self._across(shard)
        on_done(shard)

    def reduces_in_place(self, grad: torch.Tensor, plan: MaskPlan) -> bool:
        """Whether the padded unsharded ``grad`` should be reduce-scattered unpacked
        (:meth:`reduce_scatter_in_place`) rather than queued: it is contiguous, holds at
        least ``in_place_min_numel`` elements, and all of them (padding included) cost at
        most ``in_place_tolerance`` more bytes than its used ones; or, where gradients
        all used go alone (``bucket_all_used`` off), it is one of them, of any size. Never
        when the all-to-all was asked for by name: the bucket path honours it."""
        # (At world size 1 there is nothing to choose between.)
        if plan.layout.world_size != 1 and self.options.strategy is Strategy.ALL_TO_ALL:
            return False
        if plan.all_used and not self._bucket_all_used:
            # Reduced on its own whatever its size: started at once, it costs no more.
            return (
                self.options.in_place_tolerance is not None
                and plan.total > 0
                and grad.numel() == plan.layout.padded_numel
                and grad.is_contiguous()
            )
        return self._reduces_unpacked(grad, plan.total, plan.layout.padded_numel)

    @torch.no_grad()
    def reduce_scatter_in_place(
        self,
        padded: torch.Tensor,
        output: torch.Tensor,
        plan: MaskPlan,
        postdivide: float = 1.0,
    ) -> None:
        """Start a reduce-scatter of one padded unsharded gradient ``padded`` (divided
        already, if at all) straight into ``output``, this rank's shard;
        :meth:`~flatview.comm.reduction.Reduction.wait_in_flight` (or ``finish``) waits
        for it, divides by ``postdivide`` and zeroes the elements ``plan`` does not use.
        The caller guarantees that nothing reads or writes ``padded`` or ``output`` until
        then."""
        layout = plan.layout
        if padded.numel() != layout.padded_numel or output.numel() != layout.shard_numel:
            raise ValueError(
                f"reduce_scatter_in_place needs a padded gradient and a shard of {layout}"
            )
        index = plan_index(plan, padded.device)
        self.ledger.record("reduce_scatter", padded)
        work = reduce_scatter_single(output, padded, group=self.group, async_op=True)
        assert work is not None
        then = None if self._replica is None else functools.partial(self._across, output)
        self._in_place.append(
            InPlace(output, work, postdivide, [], index.unused(self.rank), padded, then)
        )

    def _across(self, mine: torch.Tensor) -> None:
        """All-reduce ``mine`` (this rank's part of its shard) across the replica group,
        after those of the unpacked reductions still in flight: the replica group then sees
        its all-reduces in the order of the reductions on every rank, whichever of them
        a rank started unpacked and which it reduced at once."""
        if self._replica is not None and self._in_place:
            self.wait_in_flight()
        if self._replica is not None and mine.numel():
            self.ledger.record(REPLICA_ALL_REDUCE, mine)
            dist.all_reduce(mine, group=self._replica[0])

    # -------------------------------------------------------------- buckets

    def _drop_queued(self) -> None:
        self._entries = []

    def _reduce_queued(self) -> None:
        entries, self._entries = self._entries, []
        self._reduce_entries(entries)

    def _reduce_entries(self, entries: list[_Entry]) -> None:
        """One collective for ``entries`` (none if empty), results handed out."""
        if not entries:
            return
        world = self.world_size
        counts = [sum(e.plan.counts[r] for e in entries) for r in range(world)]
        if sum(counts) == 0:
            mine = entries[0].parts[0].new_zeros(0)
        elif (
            choose_strategy(
                counts, self.options.strategy, masked=not all(e.plan.all_used for e in entries)
            )
            is Strategy.REDUCE_SCATTER
        ):
            mine = self._reduce_scatter(entries, counts)
        else:
            mine = self._all_to_all(entries, counts)
        self._across(mine)
        offset = 0
        for entry in entries:
            count = entry.plan.counts[self.rank]
            received = mine[offset : offset + count]
            offset += count
            if entry.index.runs[self.rank] == ((0, entry.plan.layout.shard_numel),):
                # All of this rank's shard was used: what arrived is the shard.
                entry.on_done(received)
                continue
            shard = received.new_zeros(entry.plan.layout.shard_numel)
            entry.index.place(shard, received, self.rank)
            entry.on_done(shard)

    @staticmethod
    def _parts(entries: list[_Entry], rank: int) -> list[torch.Tensor]:
        return [entry.parts[rank] for entry in entries]

    def _reduce_scatter(self, entries: list[_Entry], counts: list[int]) -> torch.Tensor:
        width = max(counts)
        padded = entries[0].padded
        if (
            len(entries) == 1
            and padded is not None
            and padded.numel() == width * self.world_size
            # Gaps between segments (torch's alignment padding) would move used elements
            # off the places the packed layout gives them: only rows whose used elements
            # come first (a tail of padding at most) can be sent as they are.
            and all(entries[0].index.used_is_prefix(rank) for rank in range(self.world_size))
        ):
            # One fully used gradient, already laid out as the collective wants it.
            send = padded.view(self.world_size, width)
        else:
            like = entries[0].parts[0]
            flat_send = self._buffer(
                ("send", like.dtype, like.device), like, self.world_size * width, 0
            )
            send = flat_send[: self.world_size * width].view(self.world_size, width)
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
