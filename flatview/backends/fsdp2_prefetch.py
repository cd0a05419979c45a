"""FSDP2's explicit prefetching steered off the units a step skips: every state's
``_states_to_forward_prefetch`` / ``_states_to_backward_prefetch`` lists (which
``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch`` set) with each
skipped target replaced by the next unit that runs, and the user's lists given back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def steer(
    targets: Sequence[Any], order: Sequence[Any], skipped: set[int], own: Any, direction: int
) -> list[Any]:
    """``targets`` (FSDP states to prefetch) with each skipped one replaced by the next
    state in ``order`` (``direction`` +1: forward, -1: backward) that the step does not
    skip, leaving out ``own``, states already listed and states past the end."""
    steered: list[Any] = []
    position = {id(state): i for i, state in enumerate(order)}
    for target in targets:
        candidate = target
        if id(candidate) in skipped:
            i = position.get(id(candidate))
            candidate = None
            while i is not None:
                i += direction
                if not 0 <= i < len(order):
                    break
                if id(order[i]) not in skipped:
                    candidate = order[i]
                    break
        if candidate is None or candidate is own or any(candidate is s for s in steered):
            continue
        steered.append(candidate)
    return steered


Steered = dict[int, tuple[Any, Any, Any, Any]]
"""Per FSDP state: (the user's forward list, the steered one, backward, steered)."""


def steer_prefetch(order: Sequence[Any], skipped: set[int], saved: Steered) -> None:
    """Point every state's explicit prefetch lists (``_states_to_forward_prefetch``,
    ``_states_to_backward_prefetch``) away from the ``skipped`` states, remembering the
    user's lists in ``saved`` (a list the user set since replaces the saved one)."""
    for state in order:
        before = saved.get(id(state))
        forward = state._states_to_forward_prefetch
        backward = state._states_to_backward_prefetch
        if before is not None:
            forward = before[0] if forward is before[1] else forward
            backward = before[2] if backward is before[3] else backward
        if not forward and not backward:
            continue
        steered_f = steer(forward, order, skipped, state, +1)
        steered_b = steer(backward, order, skipped, state, -1)
        state._states_to_forward_prefetch = steered_f
        state._states_to_backward_prefetch = steered_b
        saved[id(state)] = (forward, steered_f, backward, steered_b)


def restore_prefetch(order: Sequence[Any], saved: Steered) -> None:
    """Give every state back the user's prefetch lists, except where the user set a list
    since :func:`steer_prefetch` steered it; empties ``saved``."""
    for state in order:
        before = saved.get(id(state))
        if before is None:
            continue
        forward, steered_f, backward, steered_b = before
        if state._states_to_forward_prefetch is steered_f:
            state._states_to_forward_prefetch = forward
        if state._states_to_backward_prefetch is steered_b:
            state._states_to_backward_prefetch = backward
    saved.clear()


class PrefetchSteering:
    """The explicit prefetch lists of ``states`` (every unit's FSDP state, in module
    order), steered off each step's skipped units and given back at the end."""

    def __init__(self, states: Sequence[Any]) -> None:
        self.states = states
        self._saved: Steered = {}

    def steer(self, skipped: set[int]) -> None:
        """Steer every list off the states whose ids are in ``skipped``."""
        steer_prefetch(self.states, skipped, self._saved)

    def restore(self) -> None:
        """Give the user's lists back."""
        restore_prefetch(self.states, self._saved)
