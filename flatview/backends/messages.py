"""Error texts more than one adapter raises, written once: a unit that took no part in
a backward without being declared skipped, an optimizer that holds a flat parameter
together with views inside it, and a backward inside the root's forward that the
wrapper would never finish or reduce."""

from __future__ import annotations

from collections.abc import Iterable

from flatview.errors import DoubleCountError, StateError, UndeclaredUnusedError


def undeclared_units(names: Iterable[str]) -> UndeclaredUnusedError:
    """FSDP units (``names``, ``"<root>"`` for the root) that took no part in a backward
    although their parameters are not all declared skipped."""
    return UndeclaredUnusedError(
        f"FSDP unit(s) {', '.join(repr(n) for n in names)} took no part in this backward "
        "pass, but their parameters are not all declared skipped. Pass the layers a step "
        "does not use to FlatView.step(skip=...)."
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
