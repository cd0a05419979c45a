"""``flatview.optim.Coalesced`` gives exactly what the plain optimizer gives.

In one process (no wrapper needed for the property): a flat storage cut into parameters
of random shapes (some empty, some 2-D), in one or two interleaved parameter groups,
stepped for several steps with random skips (gradient ``None``), gradients cut from one
flat gradient as flatview hands them out (sometimes replaced, or not contiguous), views
moved to new storage as a wrapper may move them, a learning-rate scheduler, and
``load_state_dict`` round trips in both directions: after every step the parameters are
bitwise those of the plain class stepping the same views, and ``state_dict()`` is equal
(values bitwise, same keys). Then, with flatview for real, torch FSDP1 at two ranks
against the unwrapped model in one process (:mod:`tests.coalesced_workers`).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from torch import nn

import flatview.coalesced_check as cc
from flatview.optim import Coalesced
from tests import coalesced_workers as cw
from tests.scenarios import only_on_tested_torch

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

SHAPES = ((8,), (16,), (3,), (4, 4), (2, 8), (3, 5), (0,), (0, 4), (1,), (), (32,))


@dataclass
class Layout:
    """Parameters cut from one flat storage, in groups, and what each step does."""

    shapes: list[tuple[int, ...]]
    groups: list[int]
    """Each parameter's group."""
    skips: list[set[int]]
    """Per step, the parameters without a gradient."""
    odd_grads: list[dict[int, str]]
    """Per step, parameters whose gradient is ``"fresh"`` (a tensor of its own) or
    ``"strided"`` (not contiguous)."""
    moves: list[str]
    """Per step, before it: ``""``, ``"all"`` (every view onto a new storage, same layout)
    or ``"one"`` (one view's ``.data`` replaced)."""
    load: tuple[int, str] | None
    """After which step, which way state is loaded (``"into"`` Coalesced from the plain
    optimizer, ``"from"`` it into the plain one, ``"self"`` its own)."""
    dtype: torch.dtype = torch.float32

    @property
    def sizes(self) -> list[int]:
        return [math.prod(s) for s in self.shapes]


@st.composite
def layouts(draw: st.DrawFn, first_step_whole: bool = False) -> Layout:
    n = draw(st.integers(2, 10))
    shapes = draw(st.lists(st.sampled_from(SHAPES), min_size=n, max_size=n))
    two = draw(st.booleans())
    groups = [draw(st.integers(0, 1)) if two else 0 for _ in range(n)]
    steps = draw(st.integers(2, 5))
    skips, odd, moves = [], [], []
    for step in range(steps):
        skipped = draw(st.sets(st.integers(0, n - 1), max_size=n // 2))
        skips.append(set() if first_step_whole and step == 0 else skipped)
        odd.append(
            draw(
                st.dictionaries(
                    st.integers(0, n - 1), st.sampled_from(["fresh", "strided"]), max_size=2
                )
            )
        )
        moves.append(draw(st.sampled_from(["", "", "", "all", "one"])) if step else "")
    load = None
    if draw(st.booleans()):
        load = (draw(st.integers(0, steps - 2)), draw(st.sampled_from(["into", "from", "self"])))
    dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.float64]))
    return Layout(shapes, groups, skips, odd, moves, load, dtype)


@st.composite
def optimizers(draw: st.DrawFn) -> tuple[type, dict[str, Any]]:
    kind = draw(st.sampled_from([torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW]))
    mode = draw(st.sampled_from([{"foreach": False}, {"foreach": True}, {"fused": True}]))
    if kind is torch.optim.SGD:
        momentum = draw(st.sampled_from([0.0, 0.9]))
        nesterov = momentum > 0 and draw(st.booleans())
        options = {
            "momentum": momentum,
            "dampening": 0.0 if nesterov else draw(st.sampled_from([0.0, 0.1])),
            "nesterov": nesterov,
            "weight_decay": draw(st.sampled_from([0.0, 0.01])),
            "maximize": draw(st.booleans()),
        }
    else:
        options = {
            "amsgrad": draw(st.booleans()),
            "weight_decay": draw(st.sampled_from([0.0, 0.1])),
            "maximize": draw(st.booleans()),
        }
    return kind, {**options, **mode}


def _views(flat: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    out, offset = [], 0
    for shape, size in zip(layout.shapes, layout.sizes, strict=True):
        out.append(flat[offset : offset + size].view(shape))
        offset += size
    return out


def _groups(params: list[nn.Parameter], layout: Layout) -> list[dict[str, Any]]:
    """Interleaved like weight-decay groups: different lr and weight decay."""
    found = [
        {"params": [p for p, g in zip(params, layout.groups, strict=True) if g == k], **extra}
        for k, extra in ((0, {}), (1, {"lr": 0.05, "weight_decay": 0.2}))
    ]
    return [g for g in found if g["params"]]


class Side:
    """One optimizer over its own copy of the parameters."""

    def __init__(self, layout: Layout, make: Any, seed: int) -> None:
        flat = torch.randn(
            sum(layout.sizes), generator=torch.Generator().manual_seed(seed), dtype=layout.dtype
        )
        self.layout = layout
        self.params = [nn.Parameter(v) for v in _views(flat, layout)]
        self.opt = make(_groups(self.params, layout))
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=1, gamma=0.7)

    def move(self, how: str, which: int) -> None:
        if how == "all":
            # A wrapper handing over a new storage with the same layout.
            moved = torch.cat([p.detach().reshape(-1) for p in self.params])
            for p, v in zip(self.params, _views(moved, self.layout), strict=True):
                p.data = v
        elif how == "one":
            self.params[which].data = self.params[which].data.clone()

    def grads(self, step: int, flat: torch.Tensor) -> None:
        layout = self.layout
        pieces = _views(flat.clone(), layout)
        for i, (p, piece) in enumerate(zip(self.params, pieces, strict=True)):
            # Empty views get no gradient under flatview.
            if i in layout.skips[step] or p.numel() == 0:
                p.grad = None
                continue
            odd = layout.odd_grads[step].get(i)
            if odd == "fresh":
                p.grad = piece.clone()
            elif odd == "strided" and p.dim() == 2:
                p.grad = piece.t().contiguous().t()
                assert not p.grad.is_contiguous() or 1 in p.shape
            else:
                p.grad = piece

    def step(self) -> None:
        self.opt.step()
        self.sched.step()


def assert_same(plain: Side, coalesced: Side, where: Any) -> None:
    for i, (a, b) in enumerate(zip(plain.params, coalesced.params, strict=True)):
        assert torch.equal(a, b), (where, i, (a - b).abs().max())
    want, got = plain.opt.state_dict(), coalesced.opt.state_dict()
    assert want["param_groups"] == got["param_groups"], where
    assert sorted(want["state"]) == sorted(got["state"]), where
    for index, entry in want["state"].items():
        mine = got["state"][index]
        assert list(mine) == list(entry) or sorted(mine) == sorted(entry), (where, index)
        for key, value in entry.items():
            assert mine[key].dtype == value.dtype, (where, index, key)
            assert mine[key].shape == value.shape, (where, index, key)
            assert torch.equal(mine[key], value), (where, index, key)


def train_both(layout: Layout, kind: type, options: dict[str, Any]) -> Side:
    """Step the plain class and Coalesced alike, comparing after every step."""
    plain = Side(layout, lambda groups: kind(groups, lr=0.1, **options), seed=1)
    coalesced = Side(layout, lambda groups: Coalesced(kind, groups, lr=0.1, **options), seed=1)
    total = sum(layout.sizes)
    for step in range(len(layout.skips)):
        which = step % len(layout.shapes)
        for side in (plain, coalesced):
            side.move(layout.moves[step], which)
        grad = torch.randn(
            total, generator=torch.Generator().manual_seed(100 + step), dtype=layout.dtype
        )
        for side in (plain, coalesced):
            side.grads(step, grad)
            side.step()
        assert_same(plain, coalesced, (step, kind.__name__, options))
        if layout.load is not None and layout.load[0] == step:
            how = layout.load[1]
            event(f"load {how}")
            if how == "into":
                coalesced.opt.load_state_dict(copy.deepcopy(plain.opt.state_dict()))
            elif how == "from":
                plain.opt.load_state_dict(copy.deepcopy(coalesced.opt.state_dict()))
            else:
                coalesced.opt.load_state_dict(copy.deepcopy(coalesced.opt.state_dict()))
            assert_same(plain, coalesced, (step, "after load", how))
    return coalesced


@settings(max_examples=settings().max_examples * 12)
@given(layout=layouts(), optimizer=optimizers())
def test_coalesced_steps_exactly_like_the_plain_optimizer(
    layout: Layout, optimizer: tuple[type, dict[str, Any]]
) -> None:
    kind, options = optimizer
    if kind is torch.optim.SGD and options.get("fused") and options["momentum"]:
        # torch's fused SGD refuses a step where some parameters have a momentum buffer
        # and others do not yet: every parameter takes part in the first step.
        layout.skips[0] = set()
    coalesced = train_both(layout, kind, options)
    event(f"{kind.__name__} {sorted(options.items())[-1]}")
    event(f"tensors stepped at the end: {coalesced.opt.stepped_tensors}")


def _end_to_end(sizes: list[int]) -> list[nn.Parameter]:
    flat = torch.randn(sum(sizes))
    params = [nn.Parameter(t) for t in flat.split(sizes)]
    grad = torch.randn(sum(sizes))
    for p, g in zip(params, grad.split(sizes), strict=True):
        p.grad = g
    return params


@pytest.mark.parametrize("kind", [torch.optim.SGD, torch.optim.AdamW])
def test_neighbours_are_stepped_as_one_tensor(kind: type) -> None:
    """The point of it: views end to end are one tensor for the inner optimizer; a view
    without a gradient cuts the run, and a run that comes together again is one tensor
    again (Adam: the step counts of its pieces are equal again only where they are)."""
    params = _end_to_end([16, 8, 32, 4, 16, 8])
    opt = Coalesced(kind, params, lr=0.1, foreach=True)
    opt.step()
    assert opt.stepped_tensors == 1
    saved = params[2].grad
    params[2].grad = None
    opt.step()
    assert opt.stepped_tensors == 2
    params[2].grad = saved
    opt.step()
    # Adam: view 2 has one step fewer than its neighbours: three runs (step counts
    # differ); SGD's momentum has no count: one.
    assert opt.stepped_tensors == (1 if kind is torch.optim.SGD else 3)
    if kind is not torch.optim.SGD:
        steps = {id(opt.state[p]["step"]) for p in params}
        assert len(steps) == 3
        assert [float(opt.state[p]["step"]) for p in params] == [3, 3, 2, 3, 3, 3]


def test_fused_runs_end_at_a_partial_vector() -> None:
    """Under ``fused``, a view whose size is not a multiple of 64 bytes ends its run (the
    fused kernels round a tensor's last elements differently), and runs of two views are
    not formed (they would cost more than the two tensors)."""
    params = _end_to_end([16, 16, 8, 16, 4, 16])
    opt = Coalesced(torch.optim.AdamW, params, lr=0.1, fused=True)
    opt.step()
    # [16, 16, 8] [16, 4] [16]: a run of two views is stepped view by view under fused.
    assert opt.stepped_tensors == 4


def test_state_is_per_view_and_step_tensors_are_not_shared_in_state_dict() -> None:
    params = _end_to_end([16, 8, 32])
    opt = Coalesced(torch.optim.Adam, params, lr=0.1)
    opt.step()
    assert opt.stepped_tensors == 1
    for p in params:
        assert opt.state[p]["exp_avg"].shape == p.shape
    assert len({id(opt.state[p]["step"]) for p in params}) == 1
    saved = opt.state_dict()
    assert len({id(entry["step"]) for entry in saved["state"].values()}) == 3
    assert all(float(entry["step"]) == 1 for entry in saved["state"].values())
    # torch's entries are the live state dicts: the copies must not have replaced them.
    assert len({id(opt.state[p]["step"]) for p in params}) == 1


def test_errors_name_the_culprit() -> None:
    params = _end_to_end([4, 4])

    class LARS(torch.optim.SGD):
        pass

    with pytest.raises(
        TypeError, match=r"not 'test_errors_name_the_culprit\.<locals>\.LARS'.*subclass of SGD"
    ):
        Coalesced(LARS, params, lr=0.1)
    with pytest.raises(TypeError, match="not 'RMSprop'"):
        Coalesced(torch.optim.RMSprop, params, lr=0.1)
    with pytest.raises(ValueError, match="differentiable=True"):
        Coalesced(torch.optim.SGD, params, lr=0.1, differentiable=True)
    opt = Coalesced(torch.optim.SGD, params, lr=0.1)
    with pytest.raises(ValueError, match="differentiable=True"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))], "differentiable": True})
    opt.param_groups[0]["differentiable"] = True
    with pytest.raises(ValueError, match="differentiable=True"):
        opt.step()
    opt.param_groups[0]["differentiable"] = False
    # torch's own checks of the hyperparameters, at construction.
    with pytest.raises(ValueError, match="Nesterov"):
        Coalesced(torch.optim.SGD, params, lr=0.1, nesterov=True)


def test_step_takes_a_closure_as_torchs_optimizers_do() -> None:
    """Lightning's automatic optimization passes one: called first, with gradients on
    (the step itself runs without), its loss returned; the same numbers as torch's."""
    params = _end_to_end([4, 4])
    twins = [nn.Parameter(p.detach().clone()) for p in params]
    opt = Coalesced(torch.optim.SGD, params, lr=0.1, momentum=0.9)
    opt.zero_grad()
    plain = torch.optim.SGD(twins, lr=0.1, momentum=0.9)

    def closure_of(tensors: list[nn.Parameter]) -> Any:
        def closure() -> torch.Tensor:
            loss = sum((t * t * t).sum() for t in tensors)
            assert isinstance(loss, torch.Tensor)
            loss.backward()
            return loss

        return closure

    for _ in range(3):
        with torch.no_grad():
            got = opt.step(closure_of(params))
            wanted = plain.step(closure_of(twins))
        assert torch.equal(got, wanted)
        for p, twin in zip(params, twins, strict=True):
            assert torch.equal(p, twin)
        opt.zero_grad()
        plain.zero_grad()


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param(b, marks=[only_on_tested_torch(b)] if b in ("torch", "fsdp2") else [])
        for b in cw.SCENARIOS
    ],
)
def test_coalesced_trains_like_adamw_on_the_unwrapped_model(
    backend: str, dist_pool: PoolFactory, tmp_path: Path
) -> None:
    """A wrapper + flatview at two ranks, skips, ``Coalesced(AdamW)`` over
    ``fv.parameters()``, saved and resumed halfway through ``flatview.checkpoint`` (DCP):
    the parameters of the unwrapped model trained in one process by
    ``torch.optim.AdamW``, and its state by name through ``fv.optim_state_dict``. On
    fairscale and torch FSDP1 runs form; on FSDP2 (DTensors) and DDP (a gradient tensor
    per parameter) nothing joins and every view steps alone."""
    results = dist_pool(2).run(cw.train, backend, str(tmp_path / "ckpt"), timeout=60.0)
    want_params, want_state = cw.reference(backend)
    joins = backend in ("torch", "fairscale")
    for rank, (params, state, stepped, views) in enumerate(results):
        # Runs were formed: fewer tensors than views with elements on this rank.
        if joins:
            assert all(0 < s < v for s, v in zip(stepped, views, strict=True)), (rank, stepped)
        else:
            assert stepped == views, (rank, stepped, views)
        if params is not None:
            assert sorted(params) == sorted(want_params)
            for name, value in want_params.items():
                np.testing.assert_allclose(params[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
        assert state["param_groups"] == want_state["param_groups"]
        assert sorted(state["state"]) == sorted(want_state["state"])
        for name, entry in want_state["state"].items():
            assert sorted(state["state"][name]) == sorted(entry), name
            for key, value in entry.items():
                np.testing.assert_allclose(
                    state["state"][name][key], value, rtol=1e-5, atol=1e-6, err_msg=f"{name} {key}"
                )


def test_a_view_moved_alone_leaves_its_run() -> None:
    """A view given new memory (``view.data = t``) is no longer stepped through its old
    neighbours' run, even where its gradient moved alike (the same distance from it)."""
    sizes = [8, 16, 8]
    total = sum(sizes)
    results = []
    for kind in ("plain", "coalesced"):
        torch.manual_seed(0)
        # Parameters and gradients in one buffer: every gradient at the same distance.
        both = torch.randn(2 * total)
        params = [nn.Parameter(t) for t in both[:total].split(sizes)]
        for p, g in zip(params, both[total:].split(sizes), strict=True):
            p.grad = g
        make = (
            torch.optim.SGD
            if kind == "plain"
            else lambda ps, **kw: Coalesced(torch.optim.SGD, ps, **kw)
        )
        opt = make(params, lr=0.1, momentum=0.9, foreach=True)
        opt.step()
        other = both.clone()
        params[1].data = other[8:24]
        params[1].grad = other[total + 8 : total + 24]
        opt.step()
        results.append([p.detach().clone() for p in params])
        if kind == "coalesced":
            assert opt.stepped_tensors == 3
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", [torch.optim.SGD, torch.optim.AdamW])
def test_fused_numbers_are_the_plain_optimizers(kind: type) -> None:
    """Sizes whose fused tails differ from vector arithmetic: stepped as one tensor,
    they would differ in the last bits."""
    sizes = [7, 9, 31, 33, 100, 65, 16, 32, 5, 48, 16, 3]
    layout = Layout(
        shapes=[(s,) for s in sizes],
        groups=[0] * len(sizes),
        skips=[set(), set(), {2}, set()],
        odd_grads=[{}] * 4,
        moves=[""] * 4,
        load=None,
    )
    options = {"momentum": 0.9} if kind is torch.optim.SGD else {"weight_decay": 0.1}
    coalesced = train_both(layout, kind, {**options, "fused": True})
    assert coalesced.opt.stepped_tensors < len(sizes)


def test_a_group_added_later_takes_the_state_along() -> None:
    """``add_param_group`` after some steps: the state moves to new buffers, unchanged."""
    sizes = [16, 8, 32, 8]
    results = []
    for kind in ("plain", "coalesced"):
        params = _end_to_end(sizes)
        torch.manual_seed(0)
        for p in params:
            p.data.copy_(torch.randn(p.shape))
            p.grad.copy_(torch.randn(p.shape))
        first, later = params[:2], params[2:]
        opt: torch.optim.Optimizer = (
            torch.optim.Adam(first, lr=0.1)
            if kind == "plain"
            else Coalesced(torch.optim.Adam, first, lr=0.1)
        )
        opt.step()
        opt.add_param_group({"params": later, "lr": 0.05})
        opt.step()
        opt.step()
        if kind == "coalesced":
            assert opt.stepped_tensors == 2  # a run per group
        results.append((params, opt.state_dict()))
    (mine, got), (plain, want) = results[1], results[0]
    for a, b in zip(plain, mine, strict=True):
        assert torch.equal(a, b)
    for index, entry in want["state"].items():
        for key, value in entry.items():
            assert torch.equal(got["state"][index][key], value), (index, key)


CANARY_CASES = [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "foreach": True}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1}),
    (torch.optim.Adam, {"lr": 1e-3, "amsgrad": True, "weight_decay": 0.01, "foreach": True}),
    (torch.optim.AdamW, {"lr": 1e-3, "fused": True}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "fused": True}),
]


@pytest.mark.parametrize(("kind", "options"), CANARY_CASES)
def test_canaries_pass_where_runs_are_exact(kind: type, options: dict[str, Any]) -> None:
    """On this CPU grouping is exact (the hypothesis test above): the canaries must say
    so, or Coalesced would quietly step every view alone."""
    for dtype in (torch.float32, torch.float64):
        assert cc._canary(kind, options, options, torch.device("cpu"), dtype)


@pytest.mark.parametrize("kind", [torch.optim.SGD, torch.optim.AdamW])
def test_canaries_see_a_fused_tail_inside_a_run(
    kind: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rounding the fused rule avoids, let into the canaries (runs continued after
    views of any size): they must see it."""
    monkeypatch.setattr(cc, "FUSED_UNIT_BYTES", 4)
    options = {"lr": 0.1, "fused": True, **({"momentum": 0.9} if kind is torch.optim.SGD else {})}
    assert not cc._canary(kind, options, options, torch.device("cpu"), torch.float32)


def test_a_failed_canary_steps_every_view_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the canaries see a difference, no run forms, a warning says so once, and the
    numbers stay the plain optimizer's."""
    monkeypatch.setattr(cc, "_checked", {})
    monkeypatch.setattr(cc, "_canary", lambda *args: False)
    sizes = [16, 8, 32, 4, 16, 8]
    results = []
    for coalesced in (False, True):
        torch.manual_seed(0)
        params = _end_to_end(sizes)
        if coalesced:
            with pytest.warns(RuntimeWarning, match="stepped one by one"):
                opt: torch.optim.Optimizer = Coalesced(torch.optim.AdamW, params, lr=0.1)
                opt.step()
            assert opt.stepped_tensors == len(sizes)
        else:
            opt = torch.optim.AdamW(params, lr=0.1)
            opt.step()
        opt.step()
        results.append(torch.cat([p.detach().reshape(-1) for p in params]))
    assert torch.equal(*results)


def test_gradients_end_to_end_in_separate_storages_are_not_spanned() -> None:
    """Gradients of their own that an allocator placed side by side (a GPU's caching
    allocator may) lie end to end without one storage holding them all: the run is
    stepped view by view, not through an alias that would overrun the first storage."""
    sizes = [16, 8, 32]
    results = []
    for coalesced in (False, True):
        torch.manual_seed(0)
        params = _end_to_end(sizes)
        grad = torch.cat([p.grad.reshape(-1) for p in params])
        # The first gradient's storage is its own 64 bytes; the others follow it.
        first = grad.untyped_storage()[0 : sizes[0] * grad.element_size()]
        params[0].grad = torch.empty(0).set_(first, 0, (sizes[0],), (1,))
        params[1].grad, params[2].grad = grad[16:24], grad[24:]
        opt: torch.optim.Optimizer
        if coalesced:
            opt = Coalesced(torch.optim.SGD, params, lr=0.1, momentum=0.9)
        else:
            opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        opt.step()
        opt.step()
        if isinstance(opt, Coalesced):
            assert opt.stepped_tensors == len(sizes)
        results.append(torch.cat([p.detach().reshape(-1) for p in params]))
    assert torch.equal(*results)


@pytest.mark.parametrize("kind", [torch.optim.SGD, torch.optim.AdamW])
def test_state_given_other_data_is_taken_in(kind: type) -> None:
    """Code that moves optimizer state (``state[key].data = state[key].data.to(...)``, the
    common "optimizer_to(device)" helper) gives the state tensors Coalesced handed out
    other memory: the next step takes their values in, as the plain optimizer steps
    them (here halved on the way, so that stepping the old buffers would show)."""
    sizes = [16, 8, 32, 4]
    results = []
    for coalesced in (False, True):
        torch.manual_seed(0)
        params = _end_to_end(sizes)
        options: dict[str, Any] = {"lr": 0.1, "foreach": True}
        if kind is torch.optim.SGD:
            options["momentum"] = 0.9
        opt: torch.optim.Optimizer = (
            Coalesced(kind, params, **options) if coalesced else kind(params, **options)
        )
        opt.step()
        opt.step()
        if isinstance(opt, Coalesced):
            assert opt.stepped_tensors == 1
        for state in opt.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim():
                    value.data = value.data * 0.5
        opt.step()
        opt.step()
        if isinstance(opt, Coalesced):
            assert opt.stepped_tensors == 1  # taken into the buffers: one run again
        state_values = [v.reshape(-1) for p in params for v in opt.state[p].values() if v.dim()]
        results.append(torch.cat([p.detach().reshape(-1) for p in params] + state_values))
    assert torch.equal(*results)


def test_groups_re_pointed_at_other_parameters_step_those() -> None:
    """Code that re-points an optimizer's group at other parameters after it stepped
    (integrations that swap the optimizer's parameters for a wrapper's do this) must see
    the new ones stepped, as the plain optimizer steps them, not the old ones."""
    sizes = [16, 8, 32, 4]
    results = []
    for coalesced in (False, True):
        torch.manual_seed(0)
        old, new = _end_to_end(sizes), _end_to_end(sizes)
        options = {"lr": 0.1, "momentum": 0.9, "foreach": True}
        opt: torch.optim.Optimizer = (
            Coalesced(torch.optim.SGD, old, **options)
            if coalesced
            else torch.optim.SGD(old, **options)
        )
        opt.step()
        opt.param_groups[0]["params"] = new
        opt.step()
        opt.step()
        results.append(torch.cat([p.detach().reshape(-1) for p in old + new]))
    assert torch.equal(*results)


def test_runs_of_random_skips_keep_a_bounded_cache() -> None:
    """Skips drawn at random every step (layer dropout) make runs never seen before at
    every step: the run aliases and state spans kept must stay bounded, not grow with
    the number of steps, and the numbers stay the plain optimizer's meanwhile. (SGD with
    momentum: under Adam such skips make the step counts of neighbours differ, which
    cuts runs anyway.)"""
    from flatview.coalesced_plan import CACHED_PER_VIEW

    sizes = [4, 2, 3] * 16  # uneven views, each used or not on its own
    start = torch.randn(sum(sizes))
    params = [[nn.Parameter(t) for t in start.clone().split(sizes)] for _ in range(2)]
    grad = torch.randn(sum(sizes))
    options = {"lr": 0.01, "momentum": 0.9}
    opts = [torch.optim.SGD(params[0], **options), Coalesced(torch.optim.SGD, params[1], **options)]
    rng = np.random.default_rng(0)
    for _ in range(300):
        used = rng.random(len(sizes)) < 0.7
        for group in params:
            # A flat gradient per step, as a wrapper's backward leaves one.
            for p, g, u in zip(group, grad.clone().split(sizes), used, strict=True):
                p.grad = g if u else None
        for opt in opts:
            opt.step()
        assert opts[1].stepped_tensors < used.sum()  # type: ignore[attr-defined]
    plan = opts[1]._plans[0]  # type: ignore[attr-defined]
    assert len(plan.runs) <= CACHED_PER_VIEW * len(sizes)
    assert len(plan.spans) <= CACHED_PER_VIEW * len(sizes) * len(plan.handed)
    assert torch.equal(torch.cat(params[0]).detach(), torch.cat(params[1]).detach())
