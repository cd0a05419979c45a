"""The pure half of :mod:`flatview.reshard`: blocks of a tensor as runs of its flattened
elements, and the plan that moves runs held one way to the runs ranks need.

The collective half runs in ``tests/test_checkpoint_api.py`` (torch FSDP1's sharded
recipe resumed at 2 and 3 ranks) and ``tests/test_integrations.py`` (Lightning's
``FSDPStrategy`` checkpoints).
"""

from __future__ import annotations

import itertools
import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from flatview.reshard import Run, block_runs, plan
from flatview.sharded_tensors import boxes


@st.composite
def blocks(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=4)))
    offsets = tuple(draw(st.integers(0, n - 1)) for n in shape)
    sizes = tuple(draw(st.integers(0, n - o)) for n, o in zip(shape, offsets, strict=True))
    return shape, offsets, sizes


@given(blocks())
def test_block_runs_list_a_blocks_elements_in_its_order(
    block: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]],
) -> None:
    shape, offsets, sizes = block
    full = torch.arange(math.prod(shape)).view(shape)
    index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
    want = full[index].reshape(-1)
    runs = block_runs(shape, offsets, sizes)
    got = torch.cat([torch.arange(lo, hi) for lo, hi in runs]) if runs else torch.arange(0)
    assert torch.equal(got, want)
    assert all(lo < hi for lo, hi in runs)


@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.data())
def test_block_runs_undo_boxes(shape: list[int], data: st.DataObject) -> None:
    numel = math.prod(shape)
    start = data.draw(st.integers(0, numel))
    end = data.draw(st.integers(start, numel))
    runs = [
        run
        for offsets, sizes in boxes(shape, start, end)
        for run in block_runs(shape, offsets, sizes)
    ]
    covered = [i for lo, hi in runs for i in range(lo, hi)]
    assert covered == list(range(start, end))


@st.composite
def layouts(draw: st.DrawFn) -> tuple[list[list[list[Run]]], list[list[Run | None]]]:
    """1-4 ranks and 1-4 entries of random sizes: each rank needs a cut of each entry of
    its own; the entry is held either cut as needed, or in random runs each on one or
    two random ranks (as replicas hold them)."""
    world = draw(st.integers(1, 4))
    sizes = draw(st.lists(st.integers(0, 12), min_size=1, max_size=4))
    held: list[list[list[Run]]] = [[[] for _ in sizes] for _ in range(world)]
    needed: list[list[Run | None]] = [[None] * len(sizes) for _ in range(world)]
    for e, size in enumerate(sizes):
        bounds = [0, *draw(_cuts(size, world - 1)), size]
        for rank in range(world):
            needed[rank][e] = (bounds[rank], bounds[rank + 1])
        if draw(st.booleans()):
            for rank in range(world):
                lo, hi = bounds[rank], bounds[rank + 1]
                if lo < hi:
                    held[rank][e].append((lo, hi))
            continue
        runs = [0, *draw(_cuts(size, draw(st.integers(0, 4)))), size]
        for lo, hi in itertools.pairwise(runs):
            if lo < hi:
                owners = draw(st.sets(st.integers(0, world - 1), min_size=1, max_size=2))
                for owner in owners:
                    held[owner][e].append((lo, hi))
    return held, needed


def _cuts(size: int, count: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, size), min_size=count, max_size=count).map(sorted)


@given(layouts())
def test_plan_gives_every_rank_exactly_what_it_needs_from_holders(
    layout: tuple[list[list[list[Run]]], list[list[Run | None]]],
) -> None:
    held, needed = layout
    world = len(held)
    decided = plan(held, needed)
    assert not decided.gaps
    received: dict[tuple[int, int], list[int]] = {}
    for t in decided.transfers:
        assert t.entry in decided.moving
        assert any(lo <= t.lo and t.hi <= hi for lo, hi in held[t.source][t.entry])
        received.setdefault((t.target, t.entry), []).extend(range(t.lo, t.hi))
    for e in range(len(needed[0])):
        # An entry stays where every rank holds exactly the elements it needs.
        matches = all(
            sorted(i for lo, hi in held[r][e] for i in range(lo, hi))
            == list(range(*(needed[r][e] or (0, 0))))
            for r in range(world)
        )
        assert (e not in decided.moving) == matches, e
        if e not in decided.moving:
            continue
        for rank in range(world):
            lo, hi = needed[rank][e] or (0, 0)
            assert sorted(received.get((rank, e), [])) == list(range(lo, hi)), (rank, e)


def test_plan_names_what_no_rank_holds() -> None:
    decided = plan([[[(0, 3)]], [[(5, 8)]]], [[(0, 4)], [(4, 8)]])
    assert decided.gaps == [(0, 0, [(3, 4)]), (0, 1, [(4, 5)])]


def test_plan_leaves_entries_cut_as_needed() -> None:
    held = [[[(0, 2), (2, 5)], []], [[(5, 9)], [(0, 4)]]]
    needed: list[list[Run | None]] = [[(0, 5), (0, 0)], [(5, 9), (0, 4)]]
    decided = plan(held, needed)
    assert decided.moving == [] and decided.transfers == []
    assert decided.gaps == []
