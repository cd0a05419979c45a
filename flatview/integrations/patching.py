"""Instance-level changes to a framework's objects, undone together.

Where a framework offers no hook, the integrations replace a method on the one object
they were handed (a Trainer's strategy, an ``Accelerator``) by an instance attribute
that shadows the class's method, never on the class: other objects of that class, in
this process or another test, stay untouched. :class:`InstancePatches` remembers what it
set and puts back what was there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_ABSENT = object()


class InstancePatches:
    """Instance attributes set on framework objects, restored by :meth:`remove`."""

    def __init__(self) -> None:
        self._saved: list[tuple[object, str, object]] = []

    def set(self, owner: object, name: str, replacement: Callable[..., Any]) -> None:
        """Shadow ``owner.name`` with ``replacement`` until :meth:`remove`."""
        saved = vars(owner).get(name, _ABSENT)
        object.__setattr__(owner, name, replacement)
        self._saved.append((owner, name, saved))

    def remove(self) -> None:
        """Put back every attribute, the last set first (idempotent)."""
        while self._saved:
            owner, name, saved = self._saved.pop()
            if saved is _ABSENT:
                vars(owner).pop(name, None)
            else:
                object.__setattr__(owner, name, saved)

    def __bool__(self) -> bool:
        return bool(self._saved)
