"""One iteration's skip set, bound to its forward and backward: :class:`Iteration`.

An iteration starts at the root unit's forward and ends when its backward (or, without
autograd, the forward) ends. :func:`bind` turns the skip set in force then (a
``FlatView.step``'s, or nothing) into what the collectives read per flat parameter and
per segment:

*read*
    not skipped: the forward may read the segment, so the all-gather must bring it
    (:meth:`flatview.runtime.Runtime.gather_plan`);
*used*
    read and trained (``requires_grad``): its gradient is reduced and handed to the
    view (:meth:`flatview.runtime.Runtime.reduction_plan`). A frozen segment is read
    but not used: like a skipped one its gradient is neither communicated nor handed
    out; unlike a skipped one the model may still use it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from flatview.table import ParamTable


@dataclass(frozen=True)
class Binding:
    """What a skip set means per flat parameter, given which parameters are trainable:
    computed once per distinct (skip set, frozen parameters) and kept (skip sets repeat),
    so that binding an iteration costs nothing per original parameter."""

    used: tuple[tuple[bool, ...], ...]
    read: tuple[tuple[bool, ...], ...]
    skipped_units: frozenset[int]
    plain_used: frozenset[int]
    read_all: tuple[bool, ...]
    """Per flat parameter: every segment read (nothing skipped in it)."""
    skipped_segments: tuple[tuple[tuple[int, str], ...], ...]
    """Per flat parameter: ``(segment, name)`` of its skipped segments."""
    uncallable_units: frozenset[int]
    """Skipped units whose forward is refused: every one but the root and those under
    which the step uses a parameter the wrapper ignores (a reason to call them)."""


@dataclass(frozen=True)
class Iteration:
    """The skip set bound to one forward/backward, and what it means per flat parameter."""

    skipped: frozenset[int]
    """Indices of the original parameters skipped in this iteration."""
    used: tuple[tuple[bool, ...], ...]
    """Per flat parameter, per segment: trained in this iteration (not skipped, not
    frozen): its gradient is reduced."""
    read: tuple[tuple[bool, ...], ...]
    """Per flat parameter, per segment: not skipped, so the forward may read it."""
    skipped_units: frozenset[int]
    """Units every managed parameter of which is skipped (``ParamTable.params_of_unit``):
    neither gathered nor reduced."""
    step: int
    """The number of the ``FlatView.step`` in force when it was bound."""
    plain_used: frozenset[int]
    """Plain parameters the wrapper manages (not ignored) trained in this iteration (not
    skipped, not frozen)."""
    declared: bool = False
    """Bound inside a ``FlatView.step()`` (step ``step``): its skip set covers this
    forward. A backward inside a step must belong to a forward bound in that step."""
    binding: Binding = field(kw_only=True, compare=False, repr=False)
    """The cached meaning of its skip set (:class:`Binder`)."""


def _binding(table: ParamTable, skipped: frozenset[int], frozen: frozenset[int]) -> Binding:
    """What skipping ``skipped`` means with the parameters ``frozen`` frozen."""
    off = skipped | frozen
    used = tuple(tuple(i not in off for i in flat.params) for flat in table.flats)
    read = tuple(tuple(i not in skipped for i in flat.params) for flat in table.flats)
    skipped_units = frozenset(
        u
        for u, members in enumerate(table.params_of_unit)
        if members and skipped.issuperset(members)
    )
    plain_used = frozenset(i for i in table.managed_plain if i not in off)
    segments = tuple(
        tuple(
            (segment, table.name(index))
            for segment, index in enumerate(flat.params)
            if index in skipped
        )
        for flat in table.flats
    )
    uncallable = frozenset(
        u
        for u in skipped_units
        if not table.units[u].is_root and skipped.issuperset(table.ignored_of_unit[u])
    )
    return Binding(
        used, read, skipped_units, plain_used, tuple(map(all, read)), segments, uncallable
    )


class Binder:
    """Binds skip sets to iterations for one table, keeping the meaning of recent
    (skip set, frozen parameters) pairs (see :class:`Binding`)."""

    CACHE = 64
    """Distinct pairs kept (skip sets may vary every step: 2**blocks patterns)."""

    def __init__(self, table: ParamTable) -> None:
        self.table = table
        self._cache: OrderedDict[tuple[frozenset[int], frozenset[int]], Binding] = OrderedDict()

    def bind(self, skipped: frozenset[int], step: int, *, declared: bool) -> Iteration:
        """The iteration that skips ``skipped`` (see the module docstring)."""
        key = (skipped, self.table.frozen())
        found = self._cache.get(key)
        if found is None:
            found = self._cache[key] = _binding(self.table, *key)
            if len(self._cache) > self.CACHE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return Iteration(
            skipped,
            found.used,
            found.read,
            found.skipped_units,
            step,
            found.plain_used,
            declared=declared,
            binding=found,
        )
