"""Error texts more than one adapter raises, written once: a unit that took no part in
a backward without being declared skipped, and an optimizer that holds a flat parameter
together with views inside it."""

from __future__ import annotations

from collections.abc import Iterable

from flatview.errors import DoubleCountError, UndeclaredUnusedError


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
