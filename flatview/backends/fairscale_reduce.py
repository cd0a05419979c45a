"""The fairscale adapter's reduction: every gradient fairscale would reduce goes through
flatview's :class:`~flatview.comm.sharded.ShardedReduction`, bucketed across units, one
collective per bucket, so that skipped segments never travel.

Gradient reduction goes through ``unit._reducer``, one bucketer the root shares with all
units, called as ``reduce_scatter_async(chunks, group, callback_fn)`` where the callback
is ``functools.partial(unit._post_reduction_hook, flat)``. :class:`ReducerShim` stands in
there (installed after the root's ``_setup_streams``, which creates the bucketer)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from flatview.backends.base import Runtime
from flatview.backends.unit_tree import refuse_unfinished
from flatview.comm.options import ReduceOptions
from flatview.comm.sharded import ShardedReduction
from flatview.errors import StateError
from flatview.layout import FlatLayout, MaskPlan

WRAPPER = "fairscale FSDP"
"""How messages name the wrapper."""


class FairscaleReduction:
    """The sharded reductions every unit's gradients go to (one per reduce-scatter group
    fairscale uses: the root's, and an expert unit's own), and the mask of each."""

    def __init__(
        self,
        units: Sequence[tuple[str, Any]],
        runtime: Runtime,
        options: ReduceOptions,
        bucket_numel: int,
    ) -> None:
        self.runtime = runtime
        self.root = units[0][1]
        # Root first: every rank finishes the reductions in this order (units on their
        # own groups split the ranks one way, so no two ranks wait on different groups).
        self._reductions: dict[int, ShardedReduction] = {}
        for _, unit in units:
            group = unit.process_group_reduce_scatter
            if id(group) not in self._reductions:
                self._reductions[id(group)] = ShardedReduction(
                    group, unit.rank, unit.world_size, runtime.ledger, options, bucket_numel
                )
        self._plain_plans: dict[int, MaskPlan] = {}

    def reduction(self, group: Any) -> ShardedReduction:
        """The reduction of fairscale's reduce-scatter group ``group``."""
        found = self._reductions.get(id(group))
        if found is None:
            raise StateError(
                "fairscale asked flatview to reduce a gradient over a process group that no "
                "FSDP unit of the wrapped model reduces over"
            )
        return found

    def finish(self) -> None:
        """Reduce everything queued, group by group (see the constructor)."""
        for reduction in self._reductions.values():
            reduction.finish()

    def plan_for(self, param: nn.Parameter, world_size: int) -> MaskPlan:
        refuse_unfinished(self.root, WRAPPER)
        plan = self.runtime.reduction_plan(param)
        if plan is not None:
            return plan
        # A parameter the unit keeps unflattened: one segment, always used when reduced.
        plan = self._plain_plans.get(id(param))
        if plan is None:
            layout = FlatLayout.packed([(param._orig_size.numel(),)], world_size)  # type: ignore[attr-defined]
            plan = self._plain_plans[id(param)] = MaskPlan.build(layout, (True,))
        return plan


def install_shim(root: Any, units: list[tuple[str, Any]], reduction: FairscaleReduction) -> None:
    """Point every unit's reducer at one :class:`ReducerShim` of the root's bucketer."""
    current = root._reducer
    shim = current if isinstance(current, ReducerShim) else ReducerShim(reduction, current)
    for _, unit in units:
        unit._reducer = shim


def remove_shim(units: list[tuple[str, Any]]) -> None:
    """Give every unit fairscale's own bucketer back."""
    for _, unit in units:
        if isinstance(unit._reducer, ReducerShim):
            unit._reducer = unit._reducer.original


class ReducerShim:
    """Stands in for fairscale's ``ReduceScatterBucketer``: routes every gradient through
    the adapter's sharded reduction, so skipped segments never travel."""

    def __init__(self, reduction: FairscaleReduction, original: Any) -> None:
        self.reduction = reduction
        self.original = original

    def reduce_scatter_async(
        self,
        input_list: list[torch.Tensor],
        group: Any,
        callback_fn: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        if not (isinstance(callback_fn, functools.partial) and callback_fn.args):
            raise StateError(
                "fairscale called its reducer without the per-parameter callback flatview "
                "relies on; this fairscale version is not supported"
            )
        param = callback_fn.args[0]
        reduction = self.reduction.reduction(group)
        plan = self.reduction.plan_for(param, reduction.world_size)
        reduction.add(input_list, plan, callback_fn)

    def flush(self) -> None:
        self.reduction.finish()

    def teardown(self) -> None:
        """Nothing to free: buckets live only between add() and flush()."""
