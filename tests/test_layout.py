"""Property tests of the pure layout math (no processes, no torch.distributed)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flatview.layout import FlatLayout, MaskPlan, PieceKind, Segment, merge_intervals

shapes = st.lists(
    st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple), min_size=1, max_size=7
)


@st.composite
def layouts(draw: st.DrawFn) -> FlatLayout:
    """Layouts with and without gaps between segments (torch FSDP aligns with gaps)."""
    offset = 0
    segments = []
    for shape in draw(shapes):
        offset += draw(st.integers(0, 3))
        numel = math.prod(shape)
        segments.append(Segment(offset, numel, shape))
        offset += numel
    numel = offset + draw(st.integers(0, 3))
    return FlatLayout(tuple(segments), numel, draw(st.integers(1, 6)))


@given(layouts())
def test_pieces_tile_every_segment_exactly(layout: FlatLayout) -> None:
    for index, segment in enumerate(layout.segments):
        covered = []
        for rank in range(layout.world_size):
            piece = layout.piece(index, rank)
            assert piece.segment == index
            if piece.kind is PieceKind.EMPTY:
                assert piece.numel == 0
                continue
            # Where the piece sits in the shard and in the parameter are the same
            # element of the flat parameter.
            shard_start = layout.shard_interval(rank)[0]
            assert shard_start + piece.shard_offset == segment.offset + piece.param_offset
            assert piece.shard_offset >= 0
            assert piece.shard_offset + piece.numel <= layout.shard_numel
            covered.append(piece.param_interval)
        assert merge_intervals(covered) == (((0, segment.numel),) if segment.numel else ())
        assert sum(end - start for start, end in covered) == segment.numel


@given(layouts())
def test_piece_kinds(layout: FlatLayout) -> None:
    for index, segment in enumerate(layout.segments):
        kinds = [layout.piece(index, rank).kind for rank in range(layout.world_size)]
        if segment.numel == 0:
            assert set(kinds) == {PieceKind.EMPTY}
        elif PieceKind.FULL in kinds:
            # A full piece leaves nothing for any other rank.
            assert kinds.count(PieceKind.FULL) == 1
            assert set(kinds) == {PieceKind.FULL, PieceKind.EMPTY} or layout.world_size == 1
        else:
            assert kinds.count(PieceKind.PARTIAL) >= 2


@given(layouts())
def test_sharding_matches_torch_chunk(layout: FlatLayout) -> None:
    """FSDP shards as torch.chunk splits; the layout's pieces must agree with it."""
    flat = torch.arange(layout.numel, dtype=torch.float64)
    chunks = list(flat.chunk(layout.world_size)) if layout.numel else []
    for rank in range(layout.world_size):
        expected = chunks[rank] if rank < len(chunks) else flat[:0]
        shard = torch.full((layout.shard_numel,), -1.0, dtype=torch.float64)
        shard[: expected.numel()] = expected
        for piece in layout.pieces(rank):
            segment = layout.segments[piece.segment]
            start, end = piece.shard_interval
            original = flat[segment.offset : segment.end]
            p_start, p_end = piece.param_interval
            assert torch.equal(shard[start:end], original[p_start:p_end])


@given(layouts(), st.data())
def test_mask_plan_moves_exactly_the_used_elements(layout: FlatLayout, data: st.DataObject) -> None:
    used = data.draw(
        st.lists(st.booleans(), min_size=len(layout.segments), max_size=len(layout.segments))
    )
    plan = MaskPlan.build(layout, used)
    expected = {
        i
        for segment, flag in zip(layout.segments, used, strict=True)
        if flag
        for i in range(segment.offset, segment.end)
    }
    got = set()
    for rank, intervals in enumerate(plan.per_rank):
        base = layout.shard_interval(rank)[0]
        for start, end in intervals:
            assert 0 <= start < end <= layout.shard_numel
            got |= set(range(base + start, base + end))
    assert got == expected
    assert plan.total == len(expected)
    assert plan.padded_total >= plan.total
    assert plan.all_used == all(used) and plan.none_used == (not any(used))


def test_bad_layouts_are_refused() -> None:
    with pytest.raises(ValueError, match="overlaps"):
        FlatLayout((Segment(0, 4, (4,)), Segment(2, 4, (4,))), 8, 2)
    with pytest.raises(ValueError, match="past the flat numel"):
        FlatLayout((Segment(0, 4, (4,)),), 3, 2)
    with pytest.raises(ValueError, match="world_size"):
        FlatLayout.packed([(2,)], 0)
    with pytest.raises(ValueError, match="shape"):
        Segment(0, 5, (2, 2))
    with pytest.raises(ValueError, match="used flags"):
        MaskPlan.build(FlatLayout.packed([(2,), (3,)], 2), [True])


def test_original_shape_reads_like_a_tensor_shape() -> None:
    """``FlatView.shape_of`` gives a :class:`Shape`: equal to the ``torch.Size``, with
    ``ndim`` and ``numel()`` (the issue's recipe picks matrices by ``.ndim == 2``)."""
    import torch

    from flatview.layout import Shape

    shape = Shape((3, 4))
    assert shape == torch.Size([3, 4]) and shape.ndim == 2 and shape.numel() == 12
    assert Shape(()).ndim == 0 and Shape(()).numel() == 1
    assert torch.zeros(shape).shape == shape
