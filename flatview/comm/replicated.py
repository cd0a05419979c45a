"""The replicated reduction: every rank holds the entire gradient, and flatview
all-reduces what a step used.

Three ways in, one result (the average or sum every rank gets back):

* :meth:`ReplicatedReduction.add`: one flat gradient's used elements, packed into a
  bucket buffer (one per dtype and device, kept between steps) and all-reduced with the
  rest of the bucket (torch FSDP1 ``NO_SHARD`` through torch's runtime);
* :meth:`ReplicatedReduction.all_reduce_in_place`: a gradient the in-place rule takes
  (:mod:`flatview.comm.reduction`), all-reduced unpacked, asynchronously; its unused
  elements travel too and get their values back afterwards;
* :meth:`ReplicatedReduction.start_all_reduce_tensors`: one bucket of plain gradients,
  each entire, cut in advance (:func:`flatview.comm.bucketing.plan_buckets`), concatenated
  into a buffer and all-reduced asynchronously (DDP, torch FSDP1 computed on views).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from flatview.comm.ledger import Ledger
from flatview.comm.options import ReduceOptions
from flatview.comm.packing import plan_index
from flatview.comm.reduction import InPlace, Reduction
from flatview.layout import MaskPlan


@dataclass(frozen=True)
class Compression:
    """How a bucket of entire tensors travels when a communication hook's arithmetic is
    to be reproduced (DDP's: :mod:`flatview.backends.ddp_comm_hooks`): cast to ``dtype``
    (``None``: kept in the gradients' dtype), divided by the group's size in that dtype,
    summed over the group, cast back. The same arithmetic per element as the hook,
    whatever else shares the bucket; without one, a bucket is divided as the backend
    averages best (``ReduceOp.AVG`` on NCCL)."""

    dtype: torch.dtype | None
    hook: str
    """The hook served, by name (for messages)."""


@dataclass
class _Bucket:
    """Gradients queued for one all-reduce: (offset, count, on_done) each, packed into
    the reduction's buffer for their dtype and device."""

    entries: list[tuple[int, int, Callable[[torch.Tensor], None]]] = field(default_factory=list)
    numel: int = 0


@dataclass
class _TensorBucket:
    """A bucket of tensors, each entire, whose all-reduce is still in flight."""

    targets: list[torch.Tensor]
    buffer: torch.Tensor
    """Their values, concatenated: what the collective reduces."""
    work: dist.Work
    pieces: list[torch.Tensor]
    """The buffer's pieces, shaped like the targets."""
    sent: torch.Tensor
    """What the collective reduces: the buffer, or under a :class:`Compression` its cast
    (cast back into the buffer when the collective is done)."""


LAYOUTS = 256
"""Bucket layouts kept (skip sets vary: each set of parameters has its own buckets)."""

_unflatten = torch._utils._unflatten_dense_tensors


class ReplicatedReduction(Reduction):
    """All-reduces replicated gradients: packed used elements in buckets, unpacked
    gradients in place, or buckets of entire plain gradients."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        rank: int,
        world_size: int,
        ledger: Ledger,
        options: ReduceOptions,
        bucket_numel: int,
        compression: Compression | None = None,
    ) -> None:
        super().__init__(group, rank, world_size, ledger, options, bucket_numel)
        self.compression = compression
        """How buckets of entire tensors travel (:meth:`start_all_reduce_tensors`)."""
        self._buckets: dict[tuple[torch.dtype, torch.device], _Bucket] = {}
        self._tensor_buckets: list[_TensorBucket] = []
        self._native_average: bool | None = None
        # Per buffer key and the shapes of a bucket's tensors: the buffer's pieces
        # shaped like them (buckets repeat: made once, not every step).
        self._layouts: dict[tuple[object, ...], tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self._layouts_over: set[int] | None = None
        """The buffers (by id) when the layouts were last looked over (``None``: a
        layout was made since)."""

    @torch.no_grad()
    def add(
        self,
        grad: torch.Tensor,
        plan: MaskPlan,
        on_done: Callable[[torch.Tensor], None],
        predivide: float = 1.0,
    ) -> None:
        """Queue one replicated flat gradient for an all-reduce of its used elements.

        ``plan`` is over an unsharded layout (world size 1). ``on_done`` later receives
        the reduced used elements, packed in flat order (place them with
        ``plan_index(plan, ...).place(target, values, 0)``); they live in a buffer the
        reduction reuses, so ``on_done`` must copy what it keeps. They are divided by
        ``predivide`` before the reduction, as torch FSDP does against overflow.

        The used elements are copied now (divided on the way) straight into the
        bucket's buffer, one per dtype and device: the caller's gradient may change
        before the bucket is reduced (torch casts it right after its hook returns).
        """
        if plan.layout.world_size != 1:
            raise ValueError(f"a replicated reduction needs an unsharded plan, got {plan.layout}")
        index = plan_index(plan, grad.device)
        count = plan.counts[0]
        key = (grad.dtype, grad.device)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket()
        offset = bucket.numel
        buffer = self._buffer(key, grad, offset + count, offset)
        index.pack(grad, buffer[offset : offset + count], 0, predivide)
        bucket.entries.append((offset, count, on_done))
        bucket.numel += count
        self._queued(count)

    def reduces_in_place(self, grad: torch.Tensor, plan: MaskPlan) -> bool:
        """Whether the replicated ``grad`` should be all-reduced unpacked
        (:meth:`all_reduce_in_place`) rather than queued: it is contiguous, holds at
        least ``in_place_min_numel`` elements, and all of them cost at most
        ``in_place_tolerance`` more bytes than its used ones."""
        return self._reduces_unpacked(grad, plan.counts[0], plan.layout.shard_numel)

    @torch.no_grad()
    def all_reduce_in_place(
        self,
        grad: torch.Tensor,
        plan: MaskPlan,
        predivide: float = 1.0,
        postdivide: float = 1.0,
    ) -> None:
        """Start an all-reduce of the entire replicated ``grad``, in place;
        :meth:`~flatview.comm.reduction.Reduction.wait_in_flight` (or ``finish``) waits
        for it.

        Divided by ``predivide`` before and ``postdivide`` after, as torch FSDP's own
        ``NO_SHARD`` reduction does. The elements ``plan`` does not use travel too but
        get back the values they had before (a skipped parameter's gradient stays as it
        was). The caller guarantees that nothing reads or writes ``grad`` until then,
        except after ``wait_in_flight`` (a gradient about to be accumulated into).
        """
        if plan.layout.world_size != 1 or grad.numel() != plan.layout.shard_numel:
            raise ValueError(f"all_reduce_in_place needs the entire gradient of {plan.layout}")
        index = plan_index(plan, grad.device)
        kept = [(start, grad[start:end].clone()) for start, end in index.unused(0)]
        if predivide != 1.0:
            grad.div_(predivide)
        self.ledger.record("all_reduce", grad)
        work = dist.all_reduce(grad, group=self.group, async_op=True)
        assert work is not None
        self._in_place.append(InPlace(grad, work, postdivide, kept))

    @torch.no_grad()
    def start_all_reduce_tensors(
        self, tensors: Sequence[torch.Tensor], predivide: float = 1.0, slot: int = 0
    ) -> None:
        """Start the all-reduce of one bucket of entire tensors (one dtype and device),
        each divided by ``predivide`` first; ``wait_in_flight`` waits for it and copies
        the results back into the tensors.

        The tensors are copied now (one concatenation into the buffer of ``slot``, kept
        between steps: buckets in flight together need different slots), so they may
        change before ``wait_in_flight``; that then overwrites them, unless told to
        discard. Nothing follows a plan: one copy in, one collective, one
        ``_foreach_copy_`` out, whatever the number of tensors.
        """
        first = tensors[0]
        key = ("tensors", slot, first.dtype, first.device)
        shapes = (key, *(t.shape for t in tensors))
        layout = self._layouts.get(shapes)
        if layout is None or layout[0]._base is not self._buffers.get(key):
            # New shapes, or the slot's buffer grew or was dropped since.
            numel = sum(t.numel() for t in tensors)
            whole = self._buffer(key, first, numel, 0)[:numel]
            layout = self._layouts[shapes] = (whole, list(_unflatten(whole, tensors)))
            self._layouts_over = None
        buffer, pieces = layout
        torch._foreach_copy_(pieces, list(tensors))
        op = dist.ReduceOp.SUM
        sent = buffer
        if self.compression is not None:
            # As the hook: cast, divide by the group's size in that dtype, sum.
            sent = buffer.to(self.compression.dtype or buffer.dtype).div_(predivide)
        elif predivide == self.world_size and self._averages_natively():
            op = dist.ReduceOp.AVG  # divided inside the collective: one pass less over memory
        elif predivide != 1.0:
            buffer.div_(predivide)
        self.ledger.record("all_reduce", sent)
        work = dist.all_reduce(sent, op=op, group=self.group, async_op=True)
        assert work is not None
        self._tensor_buckets.append(_TensorBucket(list(tensors), buffer, work, pieces, sent))

    def _averages_natively(self) -> bool:
        """Whether the group's backend has ``ReduceOp.AVG`` (NCCL; gloo has not)."""
        if self._native_average is None:
            self._native_average = dist.get_backend(self.group) == "nccl"
        return self._native_average

    # -------------------------------------------------------------- buckets

    def _drop_queued(self) -> None:
        self._buckets = {}

    def _reduce_queued(self) -> None:
        buckets, self._buckets = self._buckets, {}
        for key, bucket in buckets.items():
            used = self._buffers[key][: bucket.numel]
            if bucket.numel:
                self.ledger.record("all_reduce", used)
                dist.all_reduce(used, group=self.group)
            for offset, count, on_done in bucket.entries:
                on_done(used[offset : offset + count])

    def _wait_buckets(self, discard: bool) -> None:
        buckets, self._tensor_buckets = self._tensor_buckets, []
        for bucket in buckets:
            bucket.work.wait()
            if discard:
                continue
            if bucket.sent is not bucket.buffer:
                bucket.buffer.copy_(bucket.sent)
            torch._foreach_copy_(bucket.targets, bucket.pieces)

    def _trim_buffers(self) -> None:
        super()._trim_buffers()
        # A layout over a buffer dropped (or regrown) would keep its memory alive.
        kept = {id(b) for b in self._buffers.values()}
        if kept == self._layouts_over and len(self._layouts) <= LAYOUTS:
            return  # the same buffers as at the last look: every layout is current
        self._layouts_over = kept
        for shapes, (whole, _) in list(self._layouts.items()):
            if id(whole._base) not in kept:
                del self._layouts[shapes]
        if len(self._layouts) > LAYOUTS:
            self._layouts.clear()
