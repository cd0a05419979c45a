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

from dataclasses import dataclass

from flatview.table import ParamTable


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
    """Units every parameter of which is skipped: neither gathered nor reduced."""
    step: int
    """The number of the ``FlatView.step`` in force when it was bound."""
    plain_used: frozenset[int]
    """Plain parameters trained in this iteration (not skipped, not frozen)."""
    declared: bool = False
    """Bound inside a ``FlatView.step()`` (step ``step``): its skip set covers this
    forward. A backward inside a step must belong to a forward bound in that step."""


def bind(table: ParamTable, skipped: frozenset[int], step: int, *, declared: bool) -> Iteration:
    """The iteration that skips ``skipped`` (see the module docstring)."""
    params = table.params
    used = tuple(
        tuple(i not in skipped and params[i].tensor.requires_grad for i in flat.params)
        for flat in table.flats
    )
    read = tuple(tuple(i not in skipped for i in flat.params) for flat in table.flats)
    skipped_units = frozenset(
        u
        for u, members in enumerate(table.params_of_unit)
        if members and skipped.issuperset(members)
    )
    plain_used = frozenset(
        i for i in table.plain if i not in skipped and params[i].tensor.requires_grad
    )
    return Iteration(skipped, used, read, skipped_units, step, plain_used, declared=declared)
