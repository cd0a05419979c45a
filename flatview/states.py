"""States with asserted transitions: :class:`Transitions`, the one way an adapter's
state enum changes (as :class:`flatview.phase.Phase` changes only through
:class:`flatview.runtime.Runtime`), so that a move the design does not allow fails at
once, naming both states, instead of leaving a flag set that a later step misreads."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import Generic, TypeVar

S = TypeVar("S", bound=enum.Enum)


class Transitions(Generic[S]):
    """The current state of one enum and the moves allowed out of each state."""

    def __init__(self, start: S, allowed: Mapping[S, Iterable[S]]) -> None:
        self._allowed = {state: frozenset(targets) for state, targets in allowed.items()}
        self._state = start

    @property
    def state(self) -> S:
        """The current state."""
        return self._state

    def move(self, to: S) -> None:
        """Move to ``to``: asserted to be allowed from the current state."""
        assert to in self._allowed.get(self.state, ()), (
            f"{type(to).__name__}: {self._state.name} -> {to.name} is not a transition"
        )
        self._state = to
