"""Owners of ``flatview.optim.Whole``'s matrices (pure layout math, no processes): the
longest-processing-time assignment by Newton-Schulz cost keeps every rank within its
bound, balances a llama-shaped model's layers to within 10% of the mean, and the buckets
of a pipelined step hold every travelling matrix once, one dtype each."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from flatview.layout import FlatLayout, Placement
from flatview.whole_exchange import buckets
from flatview.whole_members import BALANCE_SLACK, Member, assign_owners, cut


def _members(shapes: list[tuple[int, ...]], world: int, rank: int = 0) -> list[Member]:
    """One flat parameter of ``shapes`` sharded over ``world`` ranks (fairscale's layout),
    its parameters as members, each cut into its matrices."""
    layout = FlatLayout.packed(shapes, world)
    members = []
    for segment, shape in enumerate(shapes):
        placement = Placement(f"p{segment}", tuple(shape), layout, segment, rank)
        pieces = tuple(placement.piece(r).param_interval for r in range(world))
        tensor = nn.Parameter(torch.zeros(0))
        member = Member(f"p{segment}", tensor, placement, 0, rank, pieces)
        cut(member, 1, world)
        members.append(member)
    return members


def _llama(layers: int, world: int) -> list[Member]:
    """Each layer one flat parameter: attention (grouped key/value heads), SwiGLU MLP,
    4 experts stored 3-D, as benchmarks/bench_whole.py shapes them."""
    dim, kv, ffn, experts, expert_ffn = 192, 64, 520, 4, 96
    layer = [
        (dim, dim),
        (kv, dim),
        (kv, dim),
        (dim, dim),
        (ffn, dim),
        (ffn, dim),
        (dim, ffn),
        (experts, expert_ffn, dim),
        (experts, dim, expert_ffn),
    ]
    members = []
    for number in range(layers):
        for m in _members(layer, world):
            m.name = f"layers.{number}.{m.name}"
            members.append(m)
    return members


@pytest.mark.parametrize("world", [2, 3, 4])
def test_llama_layers_balance_within_ten_percent(world: int) -> None:
    matrices = [m for member in _llama(4, world) for m in member.matrices]
    costs = assign_owners(matrices, world)
    assert max(costs) / (sum(costs) / world) <= 1.10, costs
    assert sum(costs) == sum(m.cost for m in matrices)


@settings(deadline=None)
@given(
    shapes=st.lists(
        st.one_of(
            st.tuples(st.integers(1, 40), st.integers(1, 40)),
            st.tuples(st.integers(1, 4), st.integers(1, 20), st.integers(1, 20)),
        ),
        min_size=1,
        max_size=12,
    ),
    world=st.integers(1, 4),
)
def test_assignment_keeps_its_bound(shapes: list[tuple[int, ...]], world: int) -> None:
    """Every matrix has one owner; no rank owns more than the larger of the slack above
    the mean and the mean plus the largest matrix (greedy longest-processing-time), and
    one that owns a matrix it does not hold at all took it because it was least loaded."""
    matrices = [m for member in _members(shapes, world) for m in member.matrices]
    costs = assign_owners(matrices, world)
    mean = sum(m.cost for m in matrices) / world
    bound = max(mean * (1 + BALANCE_SLACK), mean + max(m.cost for m in matrices))
    assert max(costs) <= bound + 1e-9, (costs, bound)
    assert all(0 <= m.owner < world for m in matrices)
    # Deterministic: the same on every rank.
    again = [m for member in _members(shapes, world, rank=world - 1) for m in member.matrices]
    assert assign_owners(again, world) == costs
    assert [m.owner for m in again] == [m.owner for m in matrices]


def test_buckets_hold_every_travelling_matrix_once() -> None:
    world = 4
    matrices = [m for member in _llama(4, world) for m in member.matrices]
    assign_owners(matrices, world)
    travelling = [m for m in matrices if m.travels]
    cut_up = buckets(travelling, world, count=4)
    flat = [m for bucket in cut_up for m in bucket]
    assert sorted(id(m) for m in flat) == sorted(id(m) for m in travelling)
    assert 1 <= len(cut_up) <= 4
    assert all(len({m.member.tensor.dtype for m in b}) == 1 for b in cut_up)
    # Each bucket a fair share of the work (within one matrix of it).
    share = sum(m.cost for m in travelling) / len(cut_up)
    largest = max(m.cost for m in travelling)
    assert all(sum(m.cost for m in b) <= share + largest for b in cut_up)


def test_heads_cut_rows_and_experts() -> None:
    member = _members([(3, 8, 5)], 2)[0]
    cut(member, 4, 2)
    assert [tuple(m.shape) for m in member.matrices] == [(2, 5)] * 12
    spans = [m.span for m in member.matrices]
    assert spans[0] == (0, 10) and spans[-1] == (110, 120)
    assert sum(m.numel for m in member.matrices) == math.prod((3, 8, 5))
