"""The guards of skipped segments (`flatview.guards.SkipGuards.guard_segments`), without a
wrapper: compute tensors cut from one flat tensor by a split, as fairscale and torch FSDP1
make them (one pre-hook on the split node), or of another make (one hook each). A
backward raises exactly when a skipped segment's compute tensor received a gradient,
naming a skipped parameter that was used; guards of one forward do not outlive it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from flatview.errors import SkippedParameterUsedError
from flatview.guards import SkipGuards
from flatview.views import Owner

MAKES = ("split", "split+view", "one made apart", "parameters")


def _setup(sizes: list[int], make: str, tied: bool) -> tuple[SkipGuards, object, nn.Module]:
    holder = nn.Module()
    subs = [nn.Module() for _ in sizes]
    for index, sub in enumerate(subs):
        holder.add_module(f"m{index}", sub)
    owners = [[Owner(sub, "weight")] for sub in subs]
    if tied:  # segment 0 shown at a second place too
        owners[0].append(Owner(subs[-1], "tied"))
    flat = torch.randn(sum(sizes), requires_grad=True)
    pieces = list(flat.split(sizes))
    for index, (sub, piece) in enumerate(zip(subs, pieces, strict=True)):
        if make == "split+view" and piece.numel() % 2 == 0:
            piece = piece.view(2, -1)
        if make == "one made apart" and index == len(sizes) // 2:
            piece = piece * 1.0  # not a split output (a wrapper of another make)
        if make == "parameters":
            piece = nn.Parameter(piece.detach().clone())
        sub.__dict__["weight"] = piece
    if tied:
        subs[-1].__dict__["tied"] = subs[0].__dict__["weight"]
    record = SimpleNamespace(index=0, spec=SimpleNamespace(owners=owners))
    return SkipGuards(table=None), record, holder  # type: ignore[arg-type]


def _loss(holder: nn.Module, used: set[int]) -> torch.Tensor:
    total = torch.zeros(())
    for index, sub in enumerate(holder.children()):
        if index in used:
            total = total + sub.__dict__["weight"].sum()
    return total


@given(
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=6),
    make=st.sampled_from(MAKES),
    tied=st.booleans(),
    data=st.data(),
)
def test_raises_exactly_when_a_skipped_segment_is_used(
    sizes: list[int], make: str, tied: bool, data: st.DataObject
) -> None:
    indices = st.sets(st.integers(0, len(sizes) - 1))
    skipped, used = data.draw(indices), data.draw(indices)
    guards, record, holder = _setup(sizes, make, tied)
    segments = tuple((s, f"m{s}.weight") for s in sorted(skipped))
    guards.guard_segments(record, segments)  # type: ignore[arg-type]
    loss = _loss(holder, used)
    culprits = skipped & used
    if not used:  # nothing to backward through
        return
    if culprits:
        with pytest.raises(SkippedParameterUsedError) as raised:
            loss.backward()
        assert any(f"'m{s}.weight'" in str(raised.value) for s in culprits)
    else:
        loss.backward()


@pytest.mark.parametrize("make", MAKES)
def test_guards_end_with_their_iteration(make: str) -> None:
    """After `remove()` a backward through the same tensors raises nothing (a hook left
    behind would fail a later step that does not skip the segment)."""
    guards, record, holder = _setup([3, 4, 5], make, tied=False)
    guards.guard_segments(record, ((1, "m1.weight"),))  # type: ignore[arg-type]
    guards.remove()
    _loss(holder, {0, 1, 2}).backward()


def test_learnt_outputs_are_checked_each_forward() -> None:
    """A later forward whose compute tensors are not the split's outputs learnt at the
    first (here: another split's, in another order) is guarded one by one, and still
    raises for the right parameter."""
    guards, record, holder = _setup([2, 3, 4], "split", tied=False)
    guards.guard_segments(record, ((0, "m0.weight"),))  # type: ignore[arg-type]
    guards.remove()
    flat = torch.randn(9, requires_grad=True)
    pieces = flat.split([4, 3, 2])[::-1]  # segment 0 is now output 2
    for sub, piece in zip(holder.children(), pieces, strict=True):
        sub.__dict__["weight"] = piece
    guards.guard_segments(record, ((0, "m0.weight"),))  # type: ignore[arg-type]
    with pytest.raises(SkippedParameterUsedError, match=r"m0\.weight"):
        _loss(holder, {0}).backward()


def test_hooked_split_output_without_gradient_is_not_refused() -> None:
    """A skipped segment whose compute tensor is a split output itself (no view), hooked
    one by one because another segment's tensor is of another make, is not refused when
    the split runs only for that other segment's gradient (its hook is called with
    None then). Found by the thorough profile of the test above."""
    guards, record, holder = _setup([1, 1], "one made apart", tied=False)
    guards.guard_segments(record, ((0, "m0.weight"),))  # type: ignore[arg-type]
    _loss(holder, {1}).backward()
