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
one all-reduce of the packed used elements, packed into a buffer kept between steps.

Packing costs a copy in and a copy out of every used element, and a bucket reduced at
the end of the backward overlaps nothing. So a gradient that is all used (or all but
:data:`IN_PLACE_TOLERANCE` of its bytes) and large enough (:data:`IN_PLACE_MIN_NUMEL`)
skips the bucket (:meth:`MaskedReducer.reduces_in_place`): it is reduced whole, with
no copy, by an asynchronous collective started at once, which :meth:`MaskedReducer.flush`
waits for. A replicated gradient is all-reduced in place
(:meth:`MaskedReducer.all_reduce_in_place`; its unused elements travel too and get their
values back afterwards); a padded unsharded one is reduce-scattered straight into the
caller's shard (:meth:`MaskedReducer.reduce_scatter_in_place`; its unused elements come
out zero, as from a bucket). Bytes counted at the collective are then up to the
tolerance over the used bytes; ``in_place_tolerance = None`` on a reducer turns the rule
off, 0 keeps it to fully used gradients.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from flatview.comm._compat import reduce_scatter_single
from flatview.comm.ledger import Ledger
from flatview.comm.packing import PlanIndex
from flatview.layout import MaskPlan

PAD_TOLERANCE = 0.05
"""Padding overhead of an even reduce-scatter accepted before the exact all-to-all wins."""

IN_PLACE_TOLERANCE = 0.05
"""Default bytes overhead (unused elements over used ones) accepted for reducing a
gradient whole, unpacked, instead of packing its used elements into a bucket; 0 allows
it only for gradients that are all used (``MaskedReducer.in_place_tolerance``)."""

IN_PLACE_MIN_NUMEL = 2**20
"""Default smallest gradient (elements; 4 MiB in float32) reduced unpacked: smaller ones
go to the bucket, where one collective serves many and copying them costs less than a
collective each (``MaskedReducer.in_place_min_numel``). Measured with torch FSDP1
``NO_SHARD`` per block on 2 CPU cores over gloo (``benchmarks/README.md``): with 1 MiB
gradients neither way won (within 10%, either way by load), with 4 MiB the unpacked way
took 0.69-0.78x the time, with 16 MiB 0.53-0.68x."""


KEEP_BUFFER_BYTES = 2**25
"""Largest bucket buffer (bytes) kept from one flush to the next (the reducer's
``keep_buffer_bytes``). On CPU a fresh buffer of a few MiB often comes as new pages
(glibc maps large allocations with ``mmap``), and faulting them in costs more than the
copy into them: measured 2.9 ms for a fresh 6.8 MiB buffer, 0.8 ms for the copy. Larger
buffers are made per flush, so that memory a sharded model saves is not held between
steps."""


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


@dataclass
class _ReplicatedBucket:
    """Replicated gradients queued for one all-reduce: (offset, count, on_done) each,
    packed into the reducer's buffer for their dtype and device."""

    entries: list[tuple[int, int, Callable[[torch.Tensor], None]]] = field(default_factory=list)
    numel: int = 0


@dataclass
class _Whole:
    """A bucket of whole replicated tensors whose all-reduce is still in flight."""

    targets: list[torch.Tensor]
    buffer: torch.Tensor
    """Their values, concatenated: what the collective reduces."""
    work: dist.Work


@dataclass
class _InPlace:
    """A gradient reduced whole, without packing, by a collective still in flight."""

    target: torch.Tensor
    """What the collective writes: the replicated gradient itself, or this rank's shard."""
    work: dist.Work
    postdivide: float
    kept: list[tuple[int, torch.Tensor]]
    """(start, values) of the target's unused runs as they were before the reduction."""
    zeroed: tuple[tuple[int, int], ...] = ()
    """Unused runs of the target that must read zero afterwards (sharded)."""
    source: torch.Tensor | None = None
    """The collective's input, kept alive until it is done (sharded)."""


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
        self._replicated: dict[tuple[torch.dtype, torch.device], _ReplicatedBucket] = {}
        # Per dtype and device, the buffers buckets are packed into (replicated ones, and
        # the send buffer of a reduce-scatter), kept between flushes up to a size.
        self._buffers: dict[tuple[object, ...], torch.Tensor] = {}
        self.keep_buffer_bytes: int = KEEP_BUFFER_BYTES
        """Largest bucket buffer kept from one flush to the next (see
        :data:`KEEP_BUFFER_BYTES` and :meth:`release_buffers`)."""
        self._in_place: list[_InPlace] = []
        self._whole: list[_Whole] = []
        self.in_place_tolerance: float | None = IN_PLACE_TOLERANCE
        """Bytes overhead accepted for reducing a gradient whole, unpacked (see
        :meth:`reduces_in_place`); ``None`` packs every gradient into the bucket."""
        self.in_place_min_numel: int = IN_PLACE_MIN_NUMEL
        """Smallest gradient (elements) reduced unpacked."""
        self._queued_numel = 0
        self._native_average: bool | None = None
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
            self._flush_buckets()

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
        ``index_of(plan, ...).place(target, values, 0)``); they live in a buffer the
        reducer reuses, so ``on_done`` must copy what it keeps. They are divided by
        ``predivide`` before the reduction, as torch FSDP does against overflow.

        The used elements are copied now (divided on the way) straight into the
        bucket's buffer, one per dtype and device: the caller's gradient may change
        before the flush (torch casts it right after its hook returns).
        """
        if plan.layout.world_size != 1:
            raise ValueError(f"add_replicated needs an unsharded plan, got {plan.layout}")
        index = self.index_of(plan, grad.device)
        count = plan.counts[0]
        bucket = self._replicated.get((grad.dtype, grad.device))
        if bucket is None:
            bucket = self._replicated[(grad.dtype, grad.device)] = _ReplicatedBucket()
        offset = bucket.numel
        buffer = self._buffer((grad.dtype, grad.device), grad, offset + count, offset)
        index.pack(grad, buffer[offset : offset + count], 0, predivide)
        bucket.entries.append((offset, count, on_done))
        bucket.numel += count
        self._queued_numel += count
        if self._queued_numel >= self.bucket_numel:
            self._flush_buckets()

    @torch.no_grad()
    def start_all_reduce_whole(
        self, tensors: Sequence[torch.Tensor], predivide: float = 1.0, slot: int = 0
    ) -> None:
        """Start the all-reduce of one bucket of replicated tensors (one dtype and
        device), each divided by ``predivide`` first; :meth:`settle` waits for it and
        copies the results back into the tensors.

        The tensors are copied now (one concatenation into the buffer of ``slot``, kept
        between steps: buckets in flight together need different slots), so they may
        change before :meth:`settle`; that then overwrites them, unless told to discard.
        Nothing follows a plan: one copy in, one collective, one ``_foreach_copy_`` out,
        whatever the number of tensors.
        """
        first = tensors[0]
        numel = sum(t.numel() for t in tensors)
        key = ("whole", slot, first.dtype, first.device)
        buffer = self._buffer(key, first, numel, 0)[:numel]
        torch.cat([t.reshape(-1) for t in tensors], out=buffer)
        op = dist.ReduceOp.SUM
        if predivide == self.world_size and self._averages_natively():
            op = dist.ReduceOp.AVG  # divided inside the collective: one pass less over memory
        elif predivide != 1.0:
            buffer.div_(predivide)
        self.ledger.record("all_reduce", buffer)
        work = dist.all_reduce(buffer, op=op, group=self.group, async_op=True)
        assert work is not None
        self._whole.append(_Whole(list(tensors), buffer, work))

    def _averages_natively(self) -> bool:
        """Whether the group's backend has ``ReduceOp.AVG`` (NCCL; gloo has not)."""
        if self._native_average is None:
            self._native_average = dist.get_backend(self.group) == "nccl"
        return self._native_average

    def _buffer(
        self, key: tuple[object, ...], like: torch.Tensor, numel: int, keep: int
    ) -> torch.Tensor:
        """The reusable buffer ``key`` (of ``like``'s dtype and device), at least ``numel``
        long; when it has to grow, its first ``keep`` elements move to the new one."""
        buffer = self._buffers.get(key)
        if buffer is not None and buffer.numel() >= numel:
            return buffer
        grown = like.new_empty(max(numel, 2 * buffer.numel() if buffer is not None else 0))
        if buffer is not None and keep:
            grown[:keep].copy_(buffer[:keep])
        self._buffers[key] = grown
        return grown

    def release_buffers(self) -> None:
        """Free the bucket buffers kept between flushes (they are made again as needed).
        Only between flushes: nothing may be queued."""
        if self._replicated or self._whole:
            raise RuntimeError("release_buffers() while replicated gradients are queued")
        self._buffers.clear()

    def _trim_buffers(self) -> None:
        for key, buffer in list(self._buffers.items()):
            if buffer.numel() * buffer.element_size() > self.keep_buffer_bytes:
                del self._buffers[key]

    def reduces_in_place(self, grad: torch.Tensor, plan: MaskPlan) -> bool:
        """Whether ``grad`` should be reduced whole, without packing
        (:meth:`all_reduce_in_place` for a replicated gradient, :meth:`reduce_scatter_in_place`
        for a padded unsharded one) rather than queued in a bucket: it is contiguous,
        holds at least :attr:`in_place_min_numel` elements, and all of them cost at most
        :attr:`in_place_tolerance` more bytes than its used ones (the bytes counted at
        the collective are then up to that much over the used bytes)."""
        tolerance = self.in_place_tolerance
        if tolerance is None or grad.numel() < self.in_place_min_numel:
            return False
        if plan.layout.world_size == 1:
            used, size = plan.counts[0], plan.layout.shard_numel
        elif self.strategy is Strategy.ALL_TO_ALL:
            return False  # asked for by name: the bucket path honours it
        else:
            used, size = plan.total, plan.layout.padded_numel
        return (
            used > 0
            and grad.numel() == size
            and size <= used * (1 + tolerance)
            and grad.is_contiguous()
        )

    @torch.no_grad()
    def all_reduce_in_place(
        self,
        grad: torch.Tensor,
        plan: MaskPlan,
        predivide: float = 1.0,
        postdivide: float = 1.0,
    ) -> None:
        """Start an all-reduce of the whole replicated ``grad``, in place; :meth:`flush`
        (or :meth:`settle`) waits for it.

        Divided by ``predivide`` before and ``postdivide`` after, as torch FSDP's own
        ``NO_SHARD`` reduction does. The elements ``plan`` does not use travel too but
        get back the values they had before (a skipped parameter's gradient stays as it
        was). The caller guarantees that nothing reads or writes ``grad`` until then,
        except after :meth:`settle` (a gradient about to be accumulated into).
        """
        if plan.layout.world_size != 1 or grad.numel() != plan.layout.shard_numel:
            raise ValueError(f"all_reduce_in_place needs the whole gradient of {plan.layout}")
        index = self.index_of(plan, grad.device)
        kept = [(start, grad[start:end].clone()) for start, end in index.unused(0)]
        if predivide != 1.0:
            grad.div_(predivide)
        self.ledger.record("all_reduce", grad)
        work = dist.all_reduce(grad, group=self.group, async_op=True)
        assert work is not None
        self._in_place.append(_InPlace(grad, work, postdivide, kept))

    @torch.no_grad()
    def reduce_scatter_in_place(
        self,
        whole: torch.Tensor,
        output: torch.Tensor,
        plan: MaskPlan,
        postdivide: float = 1.0,
    ) -> None:
        """Start a reduce-scatter of one padded unsharded gradient ``whole`` (divided
        already, if at all) straight into ``output``, this rank's shard; :meth:`flush`
        (or :meth:`settle`) waits for it, divides by ``postdivide`` and zeroes the
        elements ``plan`` does not use. The caller guarantees that nothing reads or
        writes ``whole`` or ``output`` until then."""
        layout = plan.layout
        if whole.numel() != layout.padded_numel or output.numel() != layout.shard_numel:
            raise ValueError(
                f"reduce_scatter_in_place needs a padded gradient and a shard of {layout}"
            )
        index = self.index_of(plan, whole.device)
        self.ledger.record("reduce_scatter", whole)
        work = reduce_scatter_single(output, whole, group=self.group, async_op=True)
        assert work is not None
        self._in_place.append(
            _InPlace(output, work, postdivide, [], index.unused(self.rank), whole)
        )

    def in_flight(self, tensor: torch.Tensor | None) -> bool:
        """Whether an in-place reduction still in flight writes ``tensor``."""
        return tensor is not None and any(op.target is tensor for op in self._in_place)

    @torch.no_grad()
    def settle(self, discard: bool = False) -> None:
        """Wait for every in-place reduction started, and finish it (post-division,
        unused elements restored or zeroed), and for every whole bucket, whose results
        are copied back unless ``discard`` (the caller reduces those tensors again)."""
        whole, self._whole = self._whole, []
        try:
            for bucket in whole:
                bucket.work.wait()
                if discard:
                    continue
                sizes = [t.numel() for t in bucket.targets]
                pieces = bucket.buffer.split(sizes)
                views = [p.view(t.shape) for p, t in zip(pieces, bucket.targets, strict=True)]
                torch._foreach_copy_(bucket.targets, views)
        finally:
            self._trim_buffers()
        in_place, self._in_place = self._in_place, []
        for op in in_place:
            op.work.wait()
            target = op.target
            if op.postdivide != 1.0:
                target.div_(op.postdivide)
            for start, values in op.kept:
                target[start : start + values.numel()].copy_(values)
            for start, end in op.zeroed:
                target[start:end].zero_()

    def abandon(self) -> None:
        """A backward was aborted (an error raised inside it): drop what is queued,
        never communicated, and wait for what is in flight, results discarded. Every
        rank aborts at the same point of the same model, so none waits for the rest."""
        self._replicated = {}
        self._entries, self._queued_numel = [], 0
        self.settle(discard=True)

    @torch.no_grad()
    def flush(self) -> None:
        """Reduce everything queued, one collective per kind of bucket, hand out the
        results, and finish the in-place reductions started (:meth:`settle`)."""
        self._flush_buckets()
        self.settle()

    def _flush_buckets(self) -> None:
        try:
            self._reduce_buckets()
        finally:
            self._trim_buffers()

    def _reduce_buckets(self) -> None:
        replicated, self._replicated = self._replicated, {}
        entries, self._entries, self._queued_numel = self._entries, [], 0
        for key, bucket in replicated.items():
            self._all_reduce(self._buffers[key], bucket)
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

    def _all_reduce(self, buffer: torch.Tensor, bucket: _ReplicatedBucket) -> None:
        used = buffer[: bucket.numel]
        if bucket.numel:
            self.ledger.record("all_reduce", used)
            dist.all_reduce(used, group=self.group)
        for offset, count, on_done in bucket.entries:
            on_done(used[offset : offset + count])

    def _parts(self, entries: list[_Entry], rank: int) -> list[torch.Tensor]:
        return [entry.parts[rank] for entry in entries]

    def _reduce_scatter(self, entries: list[_Entry], counts: list[int]) -> torch.Tensor:
        width = max(counts)
        whole = entries[0].whole
        if (
            len(entries) == 1
            and whole is not None
            and whole.numel() == width * self.world_size
            # Gaps between segments (torch's alignment padding) would move used elements
            # off the places the packed layout gives them: only rows whose used elements
            # come first (a tail of padding at most) can be sent as they are.
            and all(entries[0].index.used_is_prefix(rank) for rank in range(self.world_size))
        ):
            # One fully used gradient, already laid out as the collective wants it.
            send = whole.view(self.world_size, width)
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
