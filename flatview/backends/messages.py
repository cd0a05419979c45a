"""Error texts more than one adapter raises, written once: a model wrapped between a
forward and its backward, and an optimizer that holds a flat parameter together with
views inside it. (Parameters that got no gradient without being declared skipped:
:func:`flatview.comm.unused.undeclared_unused`.)"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from flatview.errors import DoubleCountError, WrapError


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
