"""What the sharded and the replicated gradient reduction share: buffers kept between
steps, the bucket being filled, reductions started at once and unpacked, and how a
backward's reductions end.

A reduction object (:class:`~flatview.comm.sharded.ShardedReduction`,
:class:`~flatview.comm.replicated.ReplicatedReduction`) belongs to one adapter, which
builds it at ``install`` with the runtime's :class:`~flatview.comm.ledger.Ledger` (every
collective is recorded there as it is issued) and the adapter's group, rank, world size
and :class:`~flatview.comm.options.ReduceOptions`. A gradient given to it takes one of
two paths:

* **packed**: its used elements are copied into a bucket (``add``), reduced with one
  collective per bucket when the bucket fills
  (:class:`~flatview.comm.bucketing.BucketFill`) or at :meth:`Reduction.finish`;
* **unpacked**: a gradient that is all used (or all but ``in_place_tolerance`` of its
  bytes) and large enough (``in_place_min_numel``) is reduced as it is, with no copy, by an
  asynchronous collective started at once (:meth:`Reduction.reduces_in_place` says which
  path; the subclass starts it). Packing costs a copy in and a copy out of every used
  element, and a bucket reduced at the end of the backward overlaps nothing; this path
  avoids both. Its unused elements travel too (the bytes counted at the collective are
  then up to the tolerance over the used bytes) and are given back their values or
  zeroed afterwards, so the result is what the packed path gives.

How a backward's reductions end, two names for two different waits:

* :meth:`Reduction.wait_in_flight`: wait for the collectives *already started* (unpacked
  gradients, and the tensor buckets of the replicated reduction) and finish them
  (post-division, unused elements restored or zeroed, results copied back). Nothing
  queued is reduced. For a tensor about to be written again (:meth:`Reduction.in_flight`)
  or for reductions to be redone (``discard=True``).
* :meth:`Reduction.finish`: reduce *everything queued* (one collective per bucket), hand
  out the results, then :meth:`Reduction.wait_in_flight`: after it every gradient given
  to the reduction is final. Called once at the end of a synchronising backward.

Not thread-safe: driven from one backward at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flatview.comm.bucketing import BucketFill
from flatview.comm.ledger import Ledger
from flatview.comm.options import ReduceOptions
from flatview.layout import MaskPlan


@dataclass
class InPlace:
    """A gradient reduced unpacked, by a collective still in flight."""

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
    then: Callable[[], None] | None = None
    """What runs once the collective is done, before anything else (hybrid sharding:
    the all-reduce of the shard across the replica group)."""


class Reduction:
    """The part of a gradient reduction both kinds share (see the module docstring);
    subclasses queue, reduce buckets and start unpacked reductions."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        rank: int,
        world_size: int,
        ledger: Ledger,
        options: ReduceOptions,
        bucket_numel: int,
    ) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.ledger = ledger
        self.options = options
        self._fill = BucketFill(bucket_numel)
        # Per dtype and device (and use), the buffers buckets are packed into, kept
        # between reductions up to options.keep_buffer_bytes.
        self._buffers: dict[tuple[object, ...], torch.Tensor] = {}
        self._in_place: list[InPlace] = []

    # ------------------------------------------------------------ for subclasses

    def _reduce_queued(self) -> None:
        """Reduce the queued buckets (one collective each) and hand out the results."""
        raise NotImplementedError

    def _drop_queued(self) -> None:
        """Forget what is queued, uncommunicated."""
        raise NotImplementedError

    def reduces_in_place(self, grad: torch.Tensor, plan: MaskPlan) -> bool:
        """Whether ``grad`` should be reduced unpacked (started at once)
        rather than queued in a bucket: the in-place rule of the module docstring."""
        raise NotImplementedError

    def _wait_buckets(self, discard: bool) -> None:
        """Wait for tensor buckets in flight (replicated only) and copy their results back
        unless ``discard``."""

    def _queued(self, numel: int) -> None:
        """``numel`` more elements were queued: reduce the buckets once they are full."""
        if self._fill.add(numel):
            self._flush_buckets()

    def _flush_buckets(self) -> None:
        try:
            self._reduce_queued()
        finally:
            self._fill.empty()
            self._trim_buffers()

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

    def _trim_buffers(self) -> None:
        for key, buffer in list(self._buffers.items()):
            if buffer.numel() * buffer.element_size() > self.options.keep_buffer_bytes:
                del self._buffers[key]

    def _reduces_unpacked(self, grad: torch.Tensor, used: int, size: int) -> bool:
        """The in-place rule, given ``grad``'s used elements and the size the entire
        gradient has (see :meth:`reduces_in_place`)."""
        tolerance = self.options.in_place_tolerance
        if tolerance is None or grad.numel() < self.options.in_place_min_numel:
            return False
        return (
            used > 0
            and grad.numel() == size
            and size <= used * (1 + tolerance)
            and grad.is_contiguous()
        )

    # ------------------------------------------------------------------ public

    def in_flight(self, tensor: torch.Tensor | None) -> bool:
        """Whether an unpacked reduction still in flight writes ``tensor``."""
        return tensor is not None and any(op.target is tensor for op in self._in_place)

    @torch.no_grad()
    def wait_in_flight(self, discard: bool = False) -> None:
        """Wait for every collective already started and finish it: unpacked gradients
        (post-division, unused elements restored or zeroed) and tensor buckets, whose
        results are copied back unless ``discard`` (the caller reduces those tensors
        again). What is queued stays queued (:meth:`finish` reduces it)."""
        try:
            self._wait_buckets(discard)
        finally:
            self._trim_buffers()
        in_place, self._in_place = self._in_place, []
        for op in in_place:
            op.work.wait()
            if op.then is not None:
                op.then()
            target = op.target
            if op.postdivide != 1.0:
                target.div_(op.postdivide)
            for start, values in op.kept:
                target[start : start + values.numel()].copy_(values)
            for start, end in op.zeroed:
                target[start:end].zero_()

    @torch.no_grad()
    def finish(self) -> None:
        """Reduce everything queued, one collective per bucket, hand out the results,
        and :meth:`wait_in_flight`: every gradient given so far is then final."""
        self._flush_buckets()
        self.wait_in_flight()

    def abandon(self) -> None:
        """A backward was aborted (an error raised inside it): drop what is queued,
        never communicated, and wait for what is in flight, results discarded. Every
        rank aborts at the same point of the same model, so none waits for the rest."""
        self._drop_queued()
        self._fill.empty()
        self.wait_in_flight(discard=True)
