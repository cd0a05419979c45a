"""Error texts more than one adapter raises, written once: a model wrapped between a
forward and its backward, an optimizer that holds a flat parameter together with views
inside it, a backward inside the root's forward that the wrapper would never finish or
reduce, and a communication hook registered after the wrap. (Parameters that got no
gradient without being declared skipped: :func:`flatview.comm.unused.undeclared_unused`.)"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from flatview.errors import DoubleCountError, StateError, WrapError


def check_no_pending_backward(
    units: Iterable[tuple[str, Any]],
    awaiting: Callable[[str, Any], str | None],
    advice: str = "",
) -> None:
    """Refuse to wrap between a forward and its backward: that backward would run into
    flatview's hooks (or past them) without the forward flatview binds a step to, and the
    views would never learn its gradients. ``awaiting(name, unit)`` says what shows that
    a unit waits for a backward (``None``: nothing); ``advice``: what else to drop. Every
    rank ran the same forward, so every rank raises, before anything collective."""
    for name, unit in units:
        evidence = awaiting(name, unit)
        if evidence is not None:
            raise wrapped_mid_iteration(evidence, advice)


def wrapped_mid_iteration(evidence: str, advice: str = "") -> WrapError:
    """``flatview.wrap`` was called between a forward and its backward, as ``evidence``
    (what the wrapper shows of it) says: that backward would run into flatview's hooks
    without the forward flatview binds a step to. ``advice``: what else to drop."""
    return WrapError(
        f"flatview.wrap was called between a forward and its backward ({evidence}); wrap "
        "the model between iterations: after the backward, or before the forward (run "
        f"evaluation passes under torch.no_grad(){advice})"
    )


def double_count(
    optimizer: str, unit: str, view: str | None = None, or_flats: bool = False
) -> DoubleCountError:
    """``optimizer`` (its type's name) holds the flat parameter of ``unit`` and the view
    ``view`` inside it (``None``: views, unnamed); ``or_flats``: the advice also allows
    building optimizers from the flat parameters alone."""
    held = "views that live" if view is None else f"the view {view!r} that lives"
    alternative = " or from the flat parameters, not both." if or_flats else "."
    return DoubleCountError(
        f"optimizer {optimizer} holds the flat parameter of unit {unit!r} and {held} inside "
        "it: it would update those elements twice. Build optimizers from views "
        f"(submodule.parameters() or FlatView.parameters()){alternative}"
    )


def unfinished_backward(wrapper: str) -> StateError:
    """A backward whose gradients ``wrapper`` (its name) would never finish: it does not
    go through the root's outputs, whose hooks queue the wrapper's end of the backward.
    It ran inside the root's forward (Lightning's Trainer runs ``training_step``,
    ``manual_backward`` included, inside the wrapper's forward)."""
    return StateError(
        f"a backward ran that does not go through the outputs of the wrapped {wrapper} "
        "model, inside its forward (Lightning's Trainer, say, runs training_step, "
        f"manual_backward included, inside the wrapper's forward): {wrapper} never "
        "finishes such a backward (the root's outputs queue its end), so its gradients "
        "would be lost or reduced in part. Run the backward after the forward returns "
        "(loss = model(x); loss.backward())"
    )


def comm_hook_after_wrap(wrapper: str, served: str = "") -> StateError:
    """``register_comm_hook`` on a ``wrapper`` model (its name) that flatview wraps:
    flatview reduces the gradients itself (on torch FSDP1 through its own hook), so the
    user's hook would be bypassed, or trip the wrapper's own check. A model that has one
    is refused at the wrap; ``served``: the hooks a wrap reproduces, if any."""
    if served:
        served = f" ({served}, registered before the wrap, are reproduced by flatview)"
    return StateError(
        f"register_comm_hook on a {wrapper} model wrapped by flatview: flatview reduces the "
        "gradients itself and would bypass the hook (a model that has one is refused at "
        f"the wrap{served}); call fv.unwrap() first to train with it on bare {wrapper}"
    )


def unreduced_inside_forward() -> StateError:
    """FSDP2's root forward returned with gradients it never reduced: a backward ran
    inside it and reached no nested unit, so none of FSDP2's backward hooks ran (they
    hang on the units' inputs and outputs; the root's outputs do not exist yet). Plain
    FSDP2 leaves them to a later backward and trains wrong in silence."""
    return StateError(
        "a backward ran inside the forward of the wrapped FSDP2 model (Lightning's "
        "Trainer, say, runs training_step, manual_backward included, inside the "
        "wrapper's forward) and reached no nested fully_shard unit: FSDP2 reduced "
        "none of its gradients (plain FSDP2 trains wrong there, silently); they were "
        "dropped. Run the backward after the forward returns "
        "(loss = model(x); loss.backward()); with Lightning, ModelParallelStrategy "
        "runs training_step outside the wrapper's forward"
    )
