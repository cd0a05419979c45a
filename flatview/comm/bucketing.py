"""Where buckets of gradients are cut: the one place that decides which gradients share
a collective.

Two rules, because the gradients arrive in two ways:

* **Known in advance** (:func:`plan_buckets`): replicating wrappers (DDP, torch FSDP1
  computed on views) know before the backward which parameters it reduces and in what
  order their gradients are expected, so they cut all buckets at once, as DDP does. A
  bucket closes *before* a gradient that would take it over its cap (a larger one gets
  one of its own), and holds one dtype and device. :class:`BucketRound` then follows
  one backward's buckets as their gradients become ready.
* **As they come** (:class:`BucketFill`): sharded wrappers hand flatview one unit's
  gradient at a time from their own hooks; the reduction queues it and reduces the
  bucket once what is queued *reaches* the cap (the gradient that reaches it included).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

FIRST_BUCKET_BYTES = 2**20
"""DDP's first bucket (``dist._DEFAULT_FIRST_BUCKET_BYTES``): small, so that the first
all-reduce starts early in the backward."""


def plan_buckets(sizes: Sequence[tuple[int, object]], first_cap: int, cap: int) -> list[list[int]]:
    """Cut parameters into buckets: ``sizes`` gives per parameter, in the order their
    gradients are expected, its byte size and a key (dtype and device: a bucket holds
    one). Consecutive parameters of one key share a bucket up to ``first_cap`` bytes for
    the first bucket and ``cap`` for the others; a parameter larger than that has one of
    its own. Returns the positions in ``sizes`` of each bucket's parameters."""
    buckets: list[list[int]] = []
    key: object = None
    filled = 0
    for position, (size, kind) in enumerate(sizes):
        limit = first_cap if len(buckets) <= 1 else cap
        if not buckets or kind != key or filled + size > limit:
            buckets.append([])
            key, filled = kind, 0
        buckets[-1].append(position)
        filled += size
    return buckets


@dataclass
class BucketFill:
    """The bucket being filled as gradients come: full once ``queued`` reaches ``cap``."""

    cap: int
    queued: int = 0
    """Elements queued since the bucket was last emptied."""

    def add(self, numel: int) -> bool:
        """Count ``numel`` more queued elements: whether the bucket is full now."""
        self.queued += numel
        return self.queued >= self.cap

    def empty(self) -> None:
        self.queued = 0


@dataclass
class BucketRound:
    """One backward's buckets, planned in advance (:func:`plan_buckets`), as their
    gradients become ready: buckets start in order, each once all of its gradients are."""

    buckets: list[list[int]]
    """The parameters (the adapter's indices) of each bucket, in bucket order."""
    bucket_of: dict[int, int]
    """Per parameter, its bucket."""
    not_ready: list[int] = field(default_factory=list)
    """Per bucket, how many of its gradients are not ready yet."""
    ready: set[int] = field(default_factory=set)
    started: int = 0
    """Buckets whose all-reduce has started (always the first ones)."""
    grew_after_start: bool = False
    """A gradient was accumulated again after its bucket started: what is in flight
    misses that part, so the round must be reduced again."""
    zero_filled: set[int] = field(default_factory=set)
    """Parameters this rank's backward gave no gradient, given zeros when their bucket
    started."""
    members: Sequence[Sequence[Any]] = ()
    """Per bucket, what the adapter resolved its indices to (its parameters), if given."""

    @classmethod
    def of(
        cls,
        buckets: list[list[int]],
        bucket_of: dict[int, int] | None = None,
        members: Sequence[Sequence[Any]] = (),
    ) -> BucketRound:
        """A round of ``buckets``, no gradient ready and none started; ``bucket_of`` (the
        bucket of each index) and ``members`` may be given, worked out once per plan."""
        if bucket_of is None:
            bucket_of = {index: b for b, bucket in enumerate(buckets) for index in bucket}
        return cls(buckets, bucket_of, [len(bucket) for bucket in buckets], members=members)

    def mark_ready(self, index: int) -> None:
        self.ready.add(index)
        self.not_ready[self.bucket_of[index]] -= 1

    def next_ready(self) -> bool:
        """Whether the next bucket may start now during the backward: all its gradients
        are ready, none grew after its bucket started, and it is not the last bucket
        (which waits for the end of the backward)."""
        return (
            not self.grew_after_start
            and self.started < len(self.buckets) - 1
            and self.not_ready[self.started] == 0
        )
