"""Pure layout math: where each original parameter lives in a sharded flat parameter.

Nothing here touches tensors or ``torch.distributed``; every function is a map from
integers to integers, so it can be property-tested over any layout and world size.

Coordinates
-----------
*Flat coordinates* index the unsharded flat parameter: the concatenation of one unit's
original parameters, each flattened, possibly with gaps between them (alignment padding).
Its length is ``FlatLayout.numel``.

Both fairscale and torch FSDP shard the same way, the way ``torch.chunk`` splits a 1-D
tensor: every rank holds ``shard_numel = ceil(numel / world_size)`` elements of the
flat parameter padded at its end to ``padded_numel = shard_numel * world_size``.
Rank ``r`` owns flat coordinates ``[r * shard_numel, (r + 1) * shard_numel)``; the part
of that range at or past ``numel`` is padding. *Shard coordinates* index one rank's
local shard, ``[0, shard_numel)``.

Pieces
------
The intersection of one original parameter (a *segment*) with one rank's shard is a
*piece*. It is FULL (the whole parameter is on this rank), PARTIAL (a proper, non-empty
part of it) or EMPTY (nothing of it is here). Across all ranks the pieces of a segment
tile it exactly.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

Interval = tuple[int, int]
"""A half-open range ``[start, end)`` of element indices."""


class PieceKind(enum.Enum):
    """How much of an original parameter one rank's shard holds."""

    FULL = "full"
    PARTIAL = "partial"
    EMPTY = "empty"


class Shape(tuple[int, ...]):
    """An original parameter's shape, as :meth:`flatview.FlatView.shape_of` gives it: a
    tuple equal to its ``torch.Size`` (``shape == view_of_full.shape`` holds), with what
    code that picks parameters by shape reads of a tensor: ``ndim`` and ``numel()``.
    (``torch.Size`` itself cannot be extended.)"""

    @property
    def ndim(self) -> int:
        return len(self)

    def numel(self) -> int:
        return math.prod(self)


@dataclass(frozen=True)
class Segment:
    """One original parameter inside a flat parameter, in flat coordinates."""

    offset: int
    numel: int
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.offset < 0 or self.numel < 0:
            raise ValueError(f"segment offset and numel must be >= 0, got {self}")
        if math.prod(self.shape) != self.numel:
            raise ValueError(f"segment shape {self.shape} does not hold {self.numel} elements")

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class Piece:
    """The part of one segment that one rank's shard holds.

    ``shard_offset`` is where the piece starts in the local shard, ``param_offset``
    where it starts in the flattened original parameter; both are 0 for an EMPTY piece.
    """

    segment: int
    kind: PieceKind
    shard_offset: int
    param_offset: int
    numel: int

    @property
    def shard_interval(self) -> Interval:
        return (self.shard_offset, self.shard_offset + self.numel)

    @property
    def param_interval(self) -> Interval:
        return (self.param_offset, self.param_offset + self.numel)


@dataclass(frozen=True)
class FlatLayout:
    """The segments of one flat parameter and how it is sharded over ``world_size`` ranks."""

    segments: tuple[Segment, ...]
    numel: int
    world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        previous_end = 0
        for index, segment in enumerate(self.segments):
            if segment.offset < previous_end:
                raise ValueError(f"segment {index} overlaps the one before it: {segment}")
            previous_end = segment.end
        if previous_end > self.numel:
            raise ValueError(f"segments end at {previous_end}, past the flat numel {self.numel}")

    @classmethod
    def packed(cls, shapes: Iterable[Sequence[int]], world_size: int) -> FlatLayout:
        """A layout of parameters laid end to end with no gaps (fairscale's layout)."""
        segments = []
        offset = 0
        for shape in shapes:
            numel = math.prod(shape)
            segments.append(Segment(offset, numel, tuple(shape)))
            offset += numel
        return cls(tuple(segments), offset, world_size)

    @property
    def shard_numel(self) -> int:
        return -(-self.numel // self.world_size)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    def shard_interval(self, rank: int) -> Interval:
        """Flat coordinates owned by ``rank`` (they may run into the padding)."""
        self._check_rank(rank)
        return (rank * self.shard_numel, (rank + 1) * self.shard_numel)

    def piece(self, segment: int, rank: int) -> Piece:
        seg = self.segments[segment]
        shard_start, shard_end = self.shard_interval(rank)
        start = max(seg.offset, shard_start)
        end = min(seg.end, shard_end)
        if end <= start:
            return Piece(segment, PieceKind.EMPTY, 0, 0, 0)
        kind = PieceKind.FULL if end - start == seg.numel else PieceKind.PARTIAL
        return Piece(segment, kind, start - shard_start, start - seg.offset, end - start)

    def pieces(self, rank: int) -> tuple[Piece, ...]:
        return tuple(self.piece(index, rank) for index in range(len(self.segments)))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")


@dataclass(frozen=True)
class Placement:
    """Where the elements of one original parameter live across ranks, and where this
    rank's elements are in the tensor it holds for the parameter (its *local tensor*:
    a view, a parameter, or optimizer state shaped like either).

    Three cases: every rank holds all of it (``layout`` is ``None``: replicated flat
    parameters, one rank, parameters the wrapper does not manage); the local tensor is
    this rank's piece of a segment of ``layout`` (views); or the local tensor is the
    padded shard of a one-segment layout (``padded_shard``: parameters a wrapper
    shards one by one without flattening, fairscale's ``flatten_parameters=False``).
    """

    name: str
    shape: tuple[int, ...]
    layout: FlatLayout | None = None
    segment: int = 0
    rank: int = 0
    """This rank, in the layout's ranks."""
    padded_shard: bool = False

    def __post_init__(self) -> None:
        if self.padded_shard and (self.layout is None or len(self.layout.segments) != 1):
            raise ValueError(f"{self.name}: a padded-shard placement needs a one-segment layout")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def sharded(self) -> bool:
        """Other ranks hold other elements."""
        return self.layout is not None

    @property
    def has_partial_piece(self) -> bool:
        """Some rank holds part of it, not all and not nothing (a ``PARTIAL`` piece)."""
        layout = self.layout
        if layout is None:
            return False
        return any(
            layout.piece(self.segment, r).kind is PieceKind.PARTIAL
            for r in range(layout.world_size)
        )

    def piece(self, rank: int) -> Piece:
        """The part of the parameter that ``rank`` holds."""
        if self.layout is None:
            return Piece(self.segment, PieceKind.FULL, 0, 0, self.numel)
        return self.layout.piece(self.segment, rank)

    @property
    def local_numel(self) -> int:
        """Elements of this rank's local tensor."""
        if self.layout is not None and self.padded_shard:
            return self.layout.shard_numel
        return self.piece(self.rank).numel

    @property
    def local_interval(self) -> Interval:
        """Where this rank's elements of the parameter lie in its flattened local tensor."""
        piece = self.piece(self.rank)
        return piece.shard_interval if self.padded_shard else (0, piece.numel)

    @property
    def param_interval(self) -> Interval:
        """Where this rank's elements lie in the flattened original parameter."""
        return self.piece(self.rank).param_interval


def merge_intervals(intervals: Iterable[Interval]) -> tuple[Interval, ...]:
    """Sort, drop empty intervals and merge touching or overlapping ones."""
    merged: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return tuple(merged)


def total_length(intervals: Iterable[Interval]) -> int:
    return sum(end - start for start, end in intervals)


@dataclass(frozen=True)
class MaskPlan:
    """Which elements of a flat parameter's gradient a masked reduction must move.

    ``used`` holds one flag per segment. ``per_rank[r]`` lists the used elements that
    rank ``r`` owns, in rank ``r``'s shard coordinates. A reduction packs, for each
    destination rank, its used elements in this order, so ``counts[r]`` elements go to
    rank ``r``; skipped elements and padding never travel.
    """

    layout: FlatLayout
    used: tuple[bool, ...]
    per_rank: tuple[tuple[Interval, ...], ...]

    @classmethod
    def build(cls, layout: FlatLayout, used: Sequence[bool]) -> MaskPlan:
        if len(used) != len(layout.segments):
            raise ValueError(f"{len(used)} used flags for {len(layout.segments)} segments")
        flat_used = merge_intervals(
            (seg.offset, seg.end) for seg, flag in zip(layout.segments, used, strict=True) if flag
        )
        per_rank = tuple(
            _clip_to_shard(flat_used, *layout.shard_interval(rank))
            for rank in range(layout.world_size)
        )
        return cls(layout, tuple(used), per_rank)

    @cached_property
    def counts(self) -> tuple[int, ...]:
        return tuple(total_length(intervals) for intervals in self.per_rank)

    @property
    def total(self) -> int:
        """Used elements over all ranks: what an exact (uneven) exchange moves."""
        return sum(self.counts)

    @property
    def padded_total(self) -> int:
        """What an even reduce-scatter moves: every rank's part padded to the largest."""
        return max(self.counts, default=0) * self.layout.world_size

    @property
    def all_used(self) -> bool:
        return all(self.used)

    @property
    def none_used(self) -> bool:
        return not any(self.used)


def _clip_to_shard(
    flat: Sequence[Interval], shard_start: int, shard_end: int
) -> tuple[Interval, ...]:
    clipped = []
    for start, end in flat:
        lo, hi = max(start, shard_start), min(end, shard_end)
        if hi > lo:
            clipped.append((lo - shard_start, hi - shard_start))
    return tuple(clipped)
