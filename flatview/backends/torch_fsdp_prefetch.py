"""torch FSDP1's prefetching steered off the units a step skips.

Forward prefetching (``forward_prefetch=True``) follows the pre-forward order of the
*first* iteration, ``_exec_order_data.handles_pre_forward_order``, through
``get_handle_to_forward_prefetch``: with skip sets that change per step it all-gathers
units the step skips. Backward prefetching follows the post-forward order of the current
iteration (``handles_post_forward_order``, through ``get_handle_to_backward_prefetch``),
which holds no skipped unit, except after a forward that no backward followed: torch then
keeps that forward's order and stale ``handle._post_forward_index`` values, and
prefetches units the next step skips. :class:`PrefetchSteering` replaces both choices by
the same walk with this step's skipped units left out."""

from __future__ import annotations

from typing import Any

from flatview.backends.base import Runtime


class PrefetchSteering:
    """torch's two prefetch choices, skipped units left out (see the module docstring):
    :meth:`forward_target` and :meth:`backward_target` stand in for the execution-order
    record's ``get_handle_to_forward_prefetch`` / ``get_handle_to_backward_prefetch``.
    ``handle_unit``: the unit index of each handle (by id)."""

    def __init__(self, root: Any, handle_unit: dict[int, int], runtime: Runtime) -> None:
        self.root = root
        self.handle_unit = handle_unit
        self.runtime = runtime

    def forward_target(self, current: Any) -> Any:
        """Torch's forward-prefetch choice (the unit ``limit`` steps ahead in the first
        iteration's order) with the units this step skips left out."""
        order = self.root._exec_order_data
        index = current._pre_forward_order_index
        if index is None:
            return None
        ahead = order.handles_pre_forward_order[index + 1 :]
        return self._target(ahead, order._forward_prefetch_limit)

    def backward_target(self, current: Any) -> Any:
        """Torch's backward-prefetch choice (the unit ``limit`` steps back in this
        iteration's post-forward order) with the units this step skips left out.

        The order normally holds only units that ran, but after a forward that no
        backward followed it still holds that forward's units, under stale indices."""
        order = self.root._exec_order_data
        index = current._post_forward_index
        if index is None:
            return None
        behind = order.handles_post_forward_order[index - 1 :: -1] if index > 0 else []
        return self._target(behind, order._backward_prefetch_limit)

    def _target(self, candidates: list[Any], limit: int) -> Any:
        target = None
        for candidate in candidates:
            if limit <= 0:
                break
            unit = self.handle_unit.get(id(candidate))
            if unit is not None and self.runtime.unit_skipped(unit):
                continue
            target = candidate
            limit -= 1
        return target
