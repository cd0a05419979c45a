"""Tuning options of flatview's gradient reduction (and of the one gather it masks),
fixed when a model is wrapped.

:class:`ReduceOptions` gathers what the reduction objects (:mod:`flatview.comm.sharded`,
:mod:`flatview.comm.replicated`), the masked all-gather (:mod:`flatview.comm.gather`)
and the adapters that hold them may be told:
``flatview.wrap(model, reduce_options=ReduceOptions(...))`` passes it on, through
:func:`flatview.backends.detect`, to the adapter's constructor. The defaults are what
the measurements quoted below chose; tests and benchmarks change them to force one path.
"""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass


class Strategy(enum.Enum):
    """Which collective reduces a bucket of packed gradients."""

    AUTO = "auto"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"


IN_PLACE_TOLERANCE = 0.05
"""Default bytes overhead (unused elements over used ones) accepted for reducing a
gradient unpacked (all its elements), instead of packing its used elements into a bucket; 0 allows
it only for gradients that are all used (:attr:`ReduceOptions.in_place_tolerance`)."""

IN_PLACE_MIN_NUMEL = 2**20
"""Default smallest gradient (elements; 4 MiB in float32) reduced unpacked: smaller ones
go to the bucket, where one collective serves many and copying them costs less than a
collective each (:attr:`ReduceOptions.in_place_min_numel`). Measured with torch FSDP1
``NO_SHARD`` per block on 2 CPU cores over gloo (``benchmarks/README.md``): with 1 MiB
gradients neither way won (within 10%, either way by load), with 4 MiB the unpacked way
took 0.69-0.78x the time, with 16 MiB 0.53-0.68x."""

MASK_GATHER_MIN_SAVED = 2**18
"""Default fewest elements (1 MiB in float32) a masked all-gather of a partly skipped flat
parameter must leave out to be chosen over gathering it whole
(:attr:`ReduceOptions.mask_gather_min_saved`): packing and unpacking cost a few
operations per gather whatever its size, which a small flat parameter does not repay.
Measured on fairscale, 2 CPU processes over gloo, half of each unit's layers skipped,
masked and whole gathers side by side in the same processes: units of 18 Ki elements
(about 9 Ki saved per gather) took 0.3-0.5 ms more per masked gather, units of 264 Ki
(132 Ki saved) within the noise either way, units of 1 Mi (525 Ki saved) 0.1 ms less;
12 MiB half skipped took 0.6-0.75x (``benchmarks/micro_allgather.py``). Not measured on
an accelerator, where a small gather is bound by its latency more than by its bytes."""

KEEP_BUFFER_BYTES = 2**25
"""Largest bucket buffer (bytes) kept from one reduction to the next
(:attr:`ReduceOptions.keep_buffer_bytes`). On CPU a fresh buffer of a few MiB often comes
as new pages (glibc maps large allocations with ``mmap``), and faulting them in costs
more than the copy into them: measured 2.9 ms for a fresh 6.8 MiB buffer, 0.8 ms for the
copy. Larger buffers are made per reduction, so that memory a sharded model saves is not
held between steps."""


_BUCKET_WHOLE = "ReduceOptions.bucket_whole is deprecated: it is called bucket_all_used now"


@dataclass(frozen=True, init=False)
class ReduceOptions:
    """How flatview reduces gradients; every field has the default of ``flatview.wrap``.

    Attributes:
        strategy: the collective for a bucket of partly skipped sharded gradients:
            ``AUTO`` (even reduce-scatter unless its padding costs more than 5% over the
            exact size, then an exact all-to-all), ``REDUCE_SCATTER`` or ``ALL_TO_ALL``
            (a named all-to-all also keeps every gradient in the bucket). A string is
            converted. ``wrap(reduce_strategy=)`` sets it too.
        overlap: replicating wrappers (DDP, torch FSDP1 computed on views) only: start
            each bucket's all-reduce as soon as the backward has produced its gradients
            (``True``), or reduce everything at the end of the backward (``False``);
            ``None``: overlap unless the model is on CPU. ``wrap(overlap_reduction=)``
            sets it too; other wrappers refuse anything but ``None``.
        in_place_tolerance: a gradient all of whose elements cost at most this much more
            bytes than its used ones (and that is large enough, below) is reduced
            unpacked, by a collective started at once, instead of packed into a
            bucket; ``None`` packs every gradient (see :data:`IN_PLACE_TOLERANCE`).
        in_place_min_numel: the smallest gradient (elements) reduced unpacked
            (see :data:`IN_PLACE_MIN_NUMEL`); 0 lets gradients of any size (FSDP2: the
            smallest reduce-scatter input run on its own, not held). Where
            gradients all used go alone (``bucket_all_used``), those go unpacked at any
            size.
        keep_buffer_bytes: the largest bucket buffer kept from one reduction to the
            next (see :data:`KEEP_BUFFER_BYTES`); 0 keeps none.
        mask_gather_min_saved: fairscale only (the one wrapper whose all-gathers flatview
            masks): the fewest elements a masked all-gather of a partly skipped flat
            parameter must leave out to be chosen (see :data:`MASK_GATHER_MIN_SAVED`);
            0 masks wherever it moves at most 60% of the bytes. Others refuse anything
            but the default.
        bucket_all_used: sharded wrappers only: whether small gradients all used (nothing
            of theirs skipped) share buckets across units (``True``: fewer collectives),
            or each is reduce-scattered on its own, in the wrapper's own layout
            (``False``); ``None``: as the wrapper does (torch FSDP1: on its own;
            fairscale: its bucketer's buckets). Where an element sits in a collective's
            buffer can decide the order its ranks' values are added in (gloo's
            reduce-scatter on 3 or more ranks does), so only the wrapper's layout gives
            the wrapper's rounding bit for bit; bucketing may move a sum by an ulp.
            FSDP2, which reduce-scatters each unit itself: ``True`` holds its
            reduce-scatters of fewer than ``in_place_min_numel`` elements and runs them
            as one at the end of the backward (CPU only, not HSDP); ``None`` does so where
            it keeps FSDP2's numbers bit for bit, on CPU over a shard group of 2 ranks.
            ``bucket_whole``, its name before, is a deprecated alias.
    """

    strategy: Strategy
    overlap: bool | None
    in_place_tolerance: float | None
    in_place_min_numel: int
    keep_buffer_bytes: int
    bucket_all_used: bool | None
    mask_gather_min_saved: int

    def __init__(
        self,
        strategy: Strategy | str = Strategy.AUTO,
        overlap: bool | None = None,
        in_place_tolerance: float | None = IN_PLACE_TOLERANCE,
        in_place_min_numel: int = IN_PLACE_MIN_NUMEL,
        keep_buffer_bytes: int = KEEP_BUFFER_BYTES,
        bucket_all_used: bool | None = None,
        mask_gather_min_saved: int = MASK_GATHER_MIN_SAVED,
        *,
        bucket_whole: bool | None = None,
    ) -> None:
        if bucket_whole is not None:
            warnings.warn(_BUCKET_WHOLE, DeprecationWarning, stacklevel=2)
            if bucket_all_used not in (None, bucket_whole):
                raise ValueError(
                    f"bucket_whole={bucket_whole!r} (the deprecated name of bucket_all_used) "
                    f"contradicts bucket_all_used={bucket_all_used!r}; give one of them"
                )
            bucket_all_used = bucket_whole
        # Frozen: every field is set through object.__setattr__.
        object.__setattr__(self, "strategy", Strategy(strategy))
        object.__setattr__(self, "overlap", overlap)
        object.__setattr__(self, "in_place_tolerance", in_place_tolerance)
        object.__setattr__(self, "in_place_min_numel", in_place_min_numel)
        object.__setattr__(self, "keep_buffer_bytes", keep_buffer_bytes)
        object.__setattr__(self, "bucket_all_used", bucket_all_used)
        object.__setattr__(self, "mask_gather_min_saved", mask_gather_min_saved)
        if self.in_place_tolerance is not None and self.in_place_tolerance < 0:
            raise ValueError(
                f"in_place_tolerance must be >= 0 or None, got {self.in_place_tolerance}"
            )
        if min(self.in_place_min_numel, self.keep_buffer_bytes, self.mask_gather_min_saved) < 0:
            raise ValueError(
                f"in_place_min_numel, keep_buffer_bytes and mask_gather_min_saved must be "
                f">= 0, got {self.in_place_min_numel}, {self.keep_buffer_bytes} and "
                f"{self.mask_gather_min_saved}"
            )

    @property
    def bucket_whole(self) -> bool | None:
        """Deprecated: :attr:`bucket_all_used`."""
        warnings.warn(_BUCKET_WHOLE, DeprecationWarning, stacklevel=2)
        return self.bucket_all_used
