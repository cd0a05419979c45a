"""What the adapters of the two flat-parameter FSDP wrappers (fairscale's and torch's
FSDP1) do the same way: both wrap a tree of FSDP units on one process group, lend the
views to the units' own operations, and at the end of a backward bring units that took
no part in it to the state the wrapper's final callback expects.

The wrapper specifics (which state marks a unit busy, what settling a unit means) stay
in each adapter, behind the hooks of :class:`UnitAdapter`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flatview.backends._common import AdapterBase
from flatview.backends.patches import LENDING_METHODS, ROOT_LENDING_METHODS
from flatview.errors import StateError, WrapError

UnitCheck = Callable[[str, Any], None]
"""A wrapper's own refusal of one unit, given its label (``"<root>"`` for the root)."""


def _no_check(label: str, unit: Any) -> None:
    pass


class UnitAdapter(AdapterBase):
    """An adapter for a tree of FSDP units: ``units`` lists ``(original name, unit)``,
    root first, in module order."""

    units: list[tuple[str, Any]]

    def _check_units(
        self, idle: object, first: UnitCheck = _no_check, then: UnitCheck = _no_check
    ) -> None:
        """Refuse a unit that is not ``idle`` (mid-iteration) or that has a process group
        of its own; ``first`` runs the wrapper's refusals that come before the group's,
        ``then`` those after it."""
        for name, unit in self.units:
            label = name or "<root>"
            if unit.training_state is not idle:
                raise StateError(
                    f"FSDP unit {label!r} is in state {unit.training_state.name}; wrap the "
                    "model between iterations"
                )
            first(label, unit)
            if unit.process_group is not self.root.process_group:
                raise WrapError(
                    f"FSDP unit {label!r} uses its own process group; flatview needs all "
                    "units on the root's group"
                )
            then(label, unit)

    def _lending_methods(self, unit: Any) -> tuple[str, ...]:
        """The methods of ``unit`` that lend the views."""
        return LENDING_METHODS + (ROOT_LENDING_METHODS if unit is self.root else ())

    # ------------------------------------------------- units without backward

    def _units_without_backward(self, synced: bool) -> list[str]:
        """Settle every unit that took no part in this backward (``synced``: a
        synchronising one) and return the names of those not declared skipped, for the
        caller to raise once the wrapper has finished the backward."""
        undeclared: list[str] = []
        for index, (name, unit) in enumerate(self.units):
            if self._took_part(unit, synced):
                continue
            if not self.core.unit_skipped(index):
                undeclared.append(name or "<root>")
            self._settle_unit(unit, synced)
        return undeclared

    def _took_part(self, unit: Any, synced: bool) -> bool:
        """Whether ``unit`` ran its post-backward in this backward, or has nothing to
        train (also where the wrapper tidies up every unit, in unit order)."""
        raise NotImplementedError

    def _settle_unit(self, unit: Any, synced: bool) -> None:
        """What the unit's own post-backward would have done: above all, start the
        reduction of what earlier ``no_sync()`` micro-batches accumulated for it."""
        raise NotImplementedError
