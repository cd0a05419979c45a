"""What flatview keeps from step to step so that a step costs little per parameter
(issue 25) is made again whenever what it was made from changes: gradient pieces when
the wrapper hands over another gradient tensor or storage (or one handed out is given
other data), the meaning of a skip set when parameters are frozen or unfrozen, a
bucket's layout when its buffer is replaced."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import pytest
import torch
from torch import nn

from flatview.layout import FlatLayout
from flatview.view_grads import ViewGrads, piece_of
from tests import cache_workers as cw
from tests.scenarios import BACKENDS, FLAT_BACKENDS, BackendConfig, Scenario, compare

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

TIMEOUT = 120.0

# A (2, 3) matrix, a 5-vector, a parameter without elements and a 3-vector, over 2
# ranks: rank 0 holds the matrix and 1 element of the first vector, rank 1 the other 4
# and the second vector.
LAYOUT = FlatLayout.packed([(2, 3), (5,), (0,), (3,)], world_size=2)


def _grads(rank: int) -> tuple[nn.Parameter, ViewGrads]:
    flat = nn.Parameter(torch.zeros(LAYOUT.shard_numel))
    pieces = LAYOUT.pieces(rank)
    views = tuple(nn.Parameter(piece_of(flat.data, p, LAYOUT)) for p in pieces)
    return flat, ViewGrads(flat, LAYOUT, pieces, views)


def _aliases(tensor: torch.Tensor, flat_grad: torch.Tensor) -> bool:
    return tensor.untyped_storage().data_ptr() == flat_grad.untyped_storage().data_ptr()


@pytest.mark.parametrize("rank", [0, 1])
def test_pieces_are_cut_again_for_another_gradient_storage(rank: int) -> None:
    """A new gradient tensor, and new data under the same tensor, are cut anew: the view
    gradients alias the sharded gradient the flat parameter holds now (fails if the
    pieces of the first gradient were kept)."""
    flat, grads = _grads(rank)
    bearing = [v for v, p in zip(grads.views, grads.pieces, strict=True) if p.numel]
    flat.grad = torch.randn(LAYOUT.shard_numel)
    grads.pull(None)
    first = [v.grad for v in bearing]
    grads.pull(None)
    assert all(v.grad is g for v, g in zip(bearing, first, strict=True)), "kept for one storage"
    for replace_data in (False, True):
        new = torch.randn(LAYOUT.shard_numel)
        if replace_data:
            flat.grad.data = new  # the same tensor object, another storage
        else:
            flat.grad = new
        grads.pull(None)
        for view, piece in zip(grads.views, grads.pieces, strict=True):
            if not piece.numel:
                continue
            assert view.grad is not None and _aliases(view.grad, flat.grad)
            start, end = piece.shard_interval
            assert torch.equal(view.grad.reshape(-1), new[start:end])


def test_a_piece_given_other_data_is_cut_again() -> None:
    """``view.grad.data = t`` on a handed-out piece: the next push writes ``t`` into the
    sharded gradient and the view aliases the sharded gradient again (the cached piece
    no longer does)."""
    flat, grads = _grads(0)
    flat.grad = torch.zeros(LAYOUT.shard_numel)
    grads.pull(None)
    matrix = grads.views[0]
    assert matrix.grad is not None
    matrix.grad.data = torch.full((2, 3), 0.25)
    grads.push()
    assert torch.equal(flat.grad[:6], torch.full((6,), 0.25))
    assert flat.grad[6] == 0
    assert _aliases(matrix.grad, flat.grad)
    matrix.grad.add_(1.0)
    assert torch.equal(flat.grad[:6], torch.full((6,), 1.25))


@pytest.mark.parametrize("rank", [0, 1])
def test_empty_views_get_no_gradient(rank: int) -> None:
    """A view of a parameter held wholly elsewhere gets ``None``; a parameter without
    any element gets its empty gradient on every rank; the others their piece."""
    flat, grads = _grads(rank)
    flat.grad = torch.randn(LAYOUT.shard_numel)
    grads.pull(None)
    matrix, vector, nothing, last = grads.views
    assert (matrix.grad is None) == (rank == 1)
    assert (last.grad is None) == (rank == 0)
    assert vector.grad is not None
    assert nothing.grad is not None and nothing.grad.numel() == 0
    grads.pull((False, False, False, False))  # skipped now, but they hold gradients: kept
    assert vector.grad is not None


def test_gradients_set_to_none_are_freed() -> None:
    """``zero_grad(set_to_none=True)`` on the views, then a wrapper operation (push) or the
    next forward (detach): the old sharded gradient is freed (kept, by the pieces cut
    from it or as the gradient to add the next one to, it would be one gradient more at
    the backward's peak than the bare wrapper holds), and the next backward's gradient
    is the views' alone."""
    for then in ("push", "detach"):
        flat, grads = _grads(0)
        flat.grad = torch.randn(LAYOUT.shard_numel)
        old = weakref.ref(flat.grad)
        grads.pull(None)
        grads.pull(None)
        for view in grads.views:
            view.grad = None
        getattr(grads, then)()  # before a wrapper operation; before a forward
        assert flat.grad is None, then
        assert old() is None, then
        if then == "detach":
            flat.grad = torch.ones(LAYOUT.shard_numel)  # the backward's gradient
            grads.combine((True, False, True, True))
            assert torch.equal(flat.grad, torch.ones(LAYOUT.shard_numel))
            assert grads.views[1].grad is None


def test_combining_keeps_the_old_storage() -> None:
    """Gradients nobody touched since: the new one is added into the old tensor, whose
    pieces the views keep (values as new + old, bit for bit)."""
    flat, grads = _grads(0)
    old = torch.randn(LAYOUT.shard_numel)
    flat.grad = old.clone()
    grads.pull(None)
    held = [v.grad for v in grads.views]
    grads.detach()
    assert flat.grad is None
    new = torch.randn(LAYOUT.shard_numel)
    flat.grad = new.clone()
    grads.combine((True, True, True, True))
    assert torch.equal(flat.grad, new + old)
    assert all(v.grad is g for v, g in zip(grads.views, held, strict=True))


FREEZING = Scenario(
    inner=(4, 3),
    norms=(True, False),
    gates=(True, False),
    skips=((), (1,), (), ()),
)
# Per step, the parameters frozen for it: a skip set comes back with other parameters
# frozen (step 2 skips what step 0 skipped) and with the same ones (step 3).
FROZEN = ((), ("body.0.up", "head.bias"), ("body.0.up", "head.bias"), ())


@pytest.mark.parametrize("backend", BACKENDS)
def test_freezing_between_steps(dist_pool: PoolFactory, backend: BackendConfig) -> None:
    """Parameters frozen and unfrozen between steps train as on the unwrapped model:
    a skip set's cached meaning is made again when the frozen parameters change (with a
    stale one, a frozen parameter would get a zero gradient, and AdamW's weight decay
    would move it)."""
    scenario = backend.scenario(FREEZING)
    results = dist_pool(scenario.world_size).run(
        cw.freezing_between_steps, scenario, FROZEN, timeout=TIMEOUT
    )
    none, params = cw.freezing_reference(scenario, FROZEN)
    assert results[0][2] is not None
    compare(results[0][2], params)
    for rank, (got, empty, _) in enumerate(results):
        for step, (found, expected) in enumerate(zip(got, none, strict=True)):
            assert set(found) == set(expected) | set(empty), (rank, step)


@pytest.mark.parametrize("keep_bytes", [0, 2**20])
def test_bucket_layouts_follow_their_buffer(dist_pool: PoolFactory, keep_bytes: int) -> None:
    """Buckets of the same shapes reuse their layout over the buffer; one whose buffer
    grew or was dropped in between is made again (the stale one would keep the old
    buffer's memory alive), and every result is right."""
    for checks, current in dist_pool(2).run(cw.bucket_layouts, keep_bytes, timeout=TIMEOUT):
        assert checks == [True] * 4
        assert current


def test_views_follow_a_new_shard_storage() -> None:
    """The wrapper hands over another local shard (``.to()``, a load that replaces the
    tensor): the views (the same objects, which optimizers hold) alias the new storage,
    a step through them writes into it, and the next check for writes through ``.data``
    finds nothing (fails if the bound storage were never made again)."""
    from flatview.views import Owner, ViewSet

    holder = nn.Module()
    layout = FlatLayout.packed([(2, 3), (5,)], world_size=1)
    flat = nn.Parameter(torch.zeros(layout.shard_numel))
    owners = [[Owner(holder, "weight")], [Owner(holder, "bias")]]
    views = ViewSet(flat, Owner(holder, "flat"), layout, 0, flat.data, owners)
    before = views.views
    for _ in range(2):  # a second storage after the first: the cache moves each time
        shard = torch.arange(layout.shard_numel, dtype=torch.float32)
        views.rebind(shard)
        assert all(a is b for a, b in zip(views.views, before, strict=True))
        assert all(_aliases(v, shard) for v in views.views)
        with torch.no_grad():
            views.views[0].add_(1.0)
        assert torch.equal(shard[:6], torch.arange(6, dtype=torch.float32) + 1)
        assert views.write_back(["weight", "bias"]) == []


# One unit (not nested): both blocks' parameters are segments of one flat parameter,
# so the guards of both come from one cached entry.
GUARDED = Scenario(inner=(4, 3), nested=False, skips=((),))
# Per step (declared skipped, left out by the model): correct, body.1 used while
# skipped, body.0 used while skipped, correct, body.1 again.
GUARD_RUNS = ((0, 0), (1, 0), (0, 1), (1, 1), (1, 0))


@pytest.mark.parametrize(
    "backend", [p for p in FLAT_BACKENDS if p.id in ("fairscale", "torch-full-shard")]
)
def test_guards_name_each_steps_culprit(dist_pool: PoolFactory, backend: BackendConfig) -> None:
    """The guard hooks of skipped parameters, whose places and refusing hooks are kept
    from step to step, name the parameter the model used in *this* step's skip set
    (fails if one step's guards were kept for another skip set)."""
    scenario = backend.scenario(GUARDED)
    results = dist_pool(scenario.world_size).run(
        cw.guard_culprits, scenario, GUARD_RUNS, timeout=TIMEOUT
    )
    for got in results:
        assert got[0] == "accepted" and got[3] == "accepted", got
        for step, block in ((1, 1), (2, 0), (4, 1)):
            assert got[step].startswith("SkippedParameterUsedError"), got
            assert f"'body.{block}." in got[step], (step, got[step])
