"""A tree of FSDP units, as the two flat-parameter wrappers (fairscale's FSDP and torch's
FSDP1) have it (units on process groups of their own: :mod:`~flatview.backends.unit_groups`):
the wrap-time checks of every unit, the methods of a unit that lend the views, bringing
units that took no part in a backward to the state the wrapper's final callback
expects, and refusing a backward the wrapper would never finish. Functions of the
units; what a unit's state means and what settling one does stay with each wrapper's
adapter, passed in.

A backward that does not go through the root's outputs (one inside the root's forward:
Lightning's Trainer runs ``training_step``, ``manual_backward`` included, inside the
wrapper's forward) is one both wrappers never finish: the root's output hooks queue
their end of the backward (``root._post_backward_callback_queued``, read by
:func:`refuse_unfinished`). Each adapter checks before every reduction, and a hook on
the root's own flat parameters (:func:`hook_unfinished`) checks ahead of the root's
post-backward hook, which would assert there."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from flatview.backends.base import Runtime
from flatview.backends.messages import unfinished_backward
from flatview.backends.patches import LENDING_METHODS, ROOT_LENDING_METHODS, Patches
from flatview.comm.unused import undeclared_unused
from flatview.errors import StateError, UndeclaredUnusedError

Units = Sequence[tuple[str, Any]]
"""``(original name, unit)`` per unit, root first, in module order."""

UnitCheck = Callable[[str, Any], None]
"""A wrapper's own refusal of one unit, given its label (``"<root>"`` for the root)."""


def _no_check(label: str, unit: Any) -> None:
    pass


def label(name: str) -> str:
    """How messages name a unit (``"<root>"`` for the root)."""
    return name or "<root>"


def check_units(units: Units, idle: object, then: UnitCheck = _no_check) -> None:
    """Refuse a unit that is not ``idle`` (mid-iteration); ``then`` runs the wrapper's
    own refusals of each unit."""
    for name, unit in units:
        where = label(name)
        if unit.training_state is not idle:
            raise StateError(
                f"FSDP unit {where!r} is in state {unit.training_state.name}; wrap the "
                "model between iterations"
            )
        then(where, unit)


def lending_methods(unit: Any, root: Any) -> tuple[str, ...]:
    """The methods of ``unit`` that lend the views."""
    return LENDING_METHODS + (ROOT_LENDING_METHODS if unit is root else ())


def settle_units(
    units: Units,
    runtime: Runtime,
    synced: bool,
    took_part: Callable[[Any, bool], bool],
    settle: Callable[[Any, bool], None],
) -> list[str]:
    """Settle every unit that took no part in this backward (``synced``: a synchronising
    one): ``took_part(unit, synced)`` says whether it ran its post-backward (or has
    nothing to train; the wrapper may tidy up every unit there, in unit order),
    ``settle(unit, synced)`` does what that post-backward would have done. Returns the
    names of the units among them that the step does not declare skipped, for the caller
    to raise once the wrapper has finished the backward."""
    undeclared: list[str] = []
    for index, (name, unit) in enumerate(units):
        if took_part(unit, synced):
            continue
        if not runtime.unit_skipped(index):
            undeclared.append(label(name))
        settle(unit, synced)
    return undeclared


def undeclared_units(names: Sequence[str], cause: str = "") -> UndeclaredUnusedError:
    """FSDP units (``names``, ``"<root>"`` for the root) that took no part in a backward
    although their parameters are not all declared skipped (``cause``: what else may
    have kept them out, said after it)."""
    return undeclared_unused(
        "the parameters of FSDP unit(s)",
        names,
        "this rank",
        ": the units took no part in it" + cause,
    )


def refuse_unfinished(root: Any, wrapper: str) -> None:
    """Refuse, on every rank alike, a backward that does not go through ``root``'s outputs
    (see the module docstring); ``wrapper`` names the wrapper in the message."""
    if not getattr(root, "_post_backward_callback_queued", False):
        # (The root's first forward with autograd defines the flag; a wrapper that
        # renamed it refuses every backward here, loudly.)
        raise unfinished_backward(wrapper)


def hook_unfinished(
    root: Any, params: Iterable[torch.Tensor], wrapper: str, patches: Patches
) -> None:
    """Check :func:`refuse_unfinished` when each trainable one of ``params`` (the root's
    own flat parameters) gets its gradient: before the root's post-backward hook."""

    def check(root: weakref.ref[Any], wrapper: str, grad: torch.Tensor) -> None:
        module = root()
        if module is not None:
            refuse_unfinished(module, wrapper)

    # The root held weakly: torch keeps the hook in C++, where a reference back to the
    # model would be a cycle Python's collector never frees.
    for param in params:
        if param.requires_grad:
            hook = functools.partial(check, weakref.ref(root), wrapper)
            patches.hook(param.register_hook(hook))
