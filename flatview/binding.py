"""Where a step's skip set binds, and the errors of a backward or step it cannot bind.

A step's skip set binds to the forward it covers: a backward inside ``step(skip=...)``
whose forward ran outside that step is refused (:func:`backward_outside_step`) before
it communicates, since the skip set would not apply to it.

Steps and backwards inside the wrapped model's forward: Lightning's Trainer runs
``training_step`` inside the wrapper's forward (its wrapper module is what DDP or FSDP
wraps), so with manual optimization the user's
``with fv.step(skip): loss = self(x); self.manual_backward(loss)`` enters the step while
the root's forward is in flight, and runs a backward that does not go through the
forward's outputs (whose hooks normally mark where a backward begins and ends).

The rule: on adapters that
:attr:`~flatview.backends.base.Adapter.trains_inside_forward` (DDP, torch ``NO_SHARD``
computed on views: the forward communicates nothing the skip set decides) a step entered
inside the forward binds its skip set to the iteration in flight, and each backward
inside the forward is one iteration, reduced when it ends. Elsewhere (the forward has
gathered parameters by the skip set in force when it began, and the wrapper would not
finish such a backward) the step is refused on every rank, by the skip-set check, before
any collective of the step; a backward inside the forward is refused by the adapter
before its first reduction.
"""

from __future__ import annotations

import sys

from torch import nn

from flatview.autograd import in_backward
from flatview.backends.base import Adapter
from flatview.errors import StateError
from flatview.phase import Phase

_CALL = nn.Module._call_impl.__code__


def check_step_entry(phase: Phase, nested: bool, model: nn.Module, adapter: Adapter) -> bool:
    """Refuse a step that cannot bind: ``nested`` in another, after ``unwrap()``, inside
    a wrapper operation, or inside the root's forward of ``model`` where ``adapter`` does
    not :attr:`~flatview.backends.base.Adapter.trains_inside_forward`. Returns whether the
    step is entered inside the root's forward (it then binds to the iteration in flight)."""
    if nested:
        raise StateError("FlatView.step() contexts cannot be nested")
    if phase is Phase.DETACHED:
        raise StateError("FlatView.step() after unwrap()")
    if phase is Phase.LENT:
        raise StateError("FlatView.step() entered inside a wrapper operation")
    inside = not in_backward() and inside_forward_of(model)
    if inside and not adapter.trains_inside_forward:
        raise step_inside_forward(adapter.backend)
    return inside


def inside_forward_of(model: nn.Module) -> bool:
    """Whether the caller runs inside ``model``'s forward (its ``__call__`` is on this
    thread's stack). Read from the stack, which no exception leaves stale (a flag set
    by hooks would stay set after a ``KeyboardInterrupt`` in the forward): a few
    microseconds, once per step. Not from a backward hook (autograd may run those on
    its own threads)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _CALL and frame.f_locals.get("self") is model:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def step_inside_forward(backend: str) -> StateError:
    """The error of a step entered inside the root's forward on ``backend``, whose
    adapter cannot bind it there."""
    return StateError(
        "FlatView.step() was entered inside the forward of the wrapped model (that "
        "forward began before the step: Lightning's Trainer, say, runs training_step "
        f"inside the wrapper's forward). On {backend} the forward has gathered parameters "
        "by the skip set in force when it began, and a backward inside it is not one "
        "flatview can make exact, so the step's skip set cannot apply. Enter the step "
        "before calling the wrapped model (with fv.step(skip=...): loss = model(x); "
        "loss.backward()); on DDP (and torch NO_SHARD computed on views) a step may be "
        "entered inside the forward"
    )


def backward_outside_step() -> StateError:
    """The error of a backward inside a step whose forward ran outside that step."""
    return StateError(
        "a backward ran inside FlatView.step(skip=...) but its forward ran outside that "
        "step: the skip set binds to the forward it covers and would be ignored. Run the "
        "forward inside the same step as its backward (with fv.step(skip=...): "
        "loss = model(x); loss.backward())"
    )


def backward_without_forward(phase: str) -> StateError:
    """The error of a backward that ends while no forward awaits one: its forward's
    iteration was ended by another backward (several forwards, then their backwards)."""
    return StateError(
        f"a backward ended in phase {phase}, while no forward awaits one: several forwards "
        "of the root before their backwards (forward, forward, backward, backward, the "
        "pipelining pattern) are not supported by flatview, which binds each iteration's "
        "skip set and gradients to one forward and its backward. Run each forward's "
        "backward before the next forward (accumulate with no_sync() between them)"
    )
