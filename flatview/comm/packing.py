"""Packing: picking a mask plan's used elements out of a gradient row into a contiguous
buffer, and writing reduced values back to their places.

No collective here: the reductions (:mod:`flatview.comm.sharded`,
:mod:`flatview.comm.replicated`) and the masked all-gather (:mod:`flatview.comm.gather`)
decide what travels; this module only moves elements between their places in a row and
a packed buffer, one pass each way, with the index of each plan built once
(:func:`plan_index`).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from flatview.layout import MaskPlan


class PlanIndex:
    """How to pick one mask plan's used elements out of each rank's row, built once.

    Runs of used elements are copied slice by slice (a memcpy each). Only a row with
    many short runs, where a Python loop per run would cost more than the copy, gets an
    index tensor for one gather; it is small precisely because the runs are short.
    """

    MANY_RUNS = 32
    SHORT_RUN = 256

    def __init__(self, plan: MaskPlan, device: torch.device) -> None:
        self.plan = plan
        self._unused: dict[int, tuple[tuple[int, int], ...]] = {}
        self.runs: list[tuple[tuple[int, int], ...] | None] = []
        self.indices: list[torch.Tensor | None] = []
        for intervals in plan.per_rank:
            used = sum(end - start for start, end in intervals)
            if len(intervals) > self.MANY_RUNS and used < self.SHORT_RUN * len(intervals):
                self.runs.append(None)
                self.indices.append(
                    torch.cat([torch.arange(s, e, device=device) for s, e in intervals])
                )
            else:
                self.runs.append(intervals)
                self.indices.append(None)

    def unused(self, rank: int) -> tuple[tuple[int, int], ...]:
        """The runs of rank ``rank``'s row that the plan does not use (skipped
        segments, gaps between segments, padding), in order."""
        found = self._unused.get(rank)
        if found is None:
            cursor, gaps = 0, []
            for start, end in self.plan.per_rank[rank]:
                if start > cursor:
                    gaps.append((cursor, start))
                cursor = end
            if cursor < self.plan.layout.shard_numel:
                gaps.append((cursor, self.plan.layout.shard_numel))
            found = self._unused[rank] = tuple(gaps)
        return found

    def used_is_prefix(self, rank: int) -> bool:
        """Whether rank ``rank``'s used elements are exactly the start of its row (then
        the row's first ``count`` elements are its packed elements, unmoved)."""
        runs = self.runs[rank]
        return runs is not None and (not runs or (len(runs) == 1 and runs[0][0] == 0))

    def pick(self, row: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s used elements of ``row``, packed (a view when one run)."""
        runs = self.runs[rank]
        if runs is None:
            index = self.indices[rank]
            assert index is not None
            return row.index_select(0, index)
        if len(runs) == 1:
            return row[runs[0][0] : runs[0][1]]
        if not runs:
            return row[:0]
        return torch.cat([row[start:end] for start, end in runs])

    def pack(self, row: torch.Tensor, out: torch.Tensor, rank: int, divisor: float = 1.0) -> None:
        """Write rank ``rank``'s used elements of ``row`` into ``out`` (which holds exactly
        that many), divided by ``divisor`` on the way: one pass over the used elements."""
        runs = self.runs[rank]
        if runs is None:
            index = self.indices[rank]
            assert index is not None
            torch.index_select(row, 0, index, out=out)
            if divisor != 1.0:
                out.div_(divisor)
            return
        offset = 0
        for start, end in runs:
            _copy_divided(out[offset : offset + end - start], row[start:end], divisor)
            offset += end - start

    def place(
        self, target: torch.Tensor, values: torch.Tensor, rank: int, divisor: float = 1.0
    ) -> None:
        """Write packed ``values`` back to rank ``rank``'s used positions of ``target``,
        divided by ``divisor`` on the way (``values`` itself is left as it was unless
        the plan needed an index)."""
        runs = self.runs[rank]
        if runs is None:
            index = self.indices[rank]
            assert index is not None
            if divisor != 1.0:
                values = values / divisor
            target.index_copy_(0, index, values)
            return
        offset = 0
        for start, end in runs:
            _copy_divided(target[start:end], values[offset : offset + end - start], divisor)
            offset += end - start


def _copy_divided(out: torch.Tensor, source: torch.Tensor, divisor: float) -> None:
    """``out[:] = source / divisor`` in one pass (a plain copy when ``divisor`` is 1):
    the values ``source.div_(divisor)`` and a copy would give, cast to ``out``'s dtype
    like ``copy_``."""
    if divisor == 1.0:
        out.copy_(source)
    elif out.dtype == source.dtype:
        torch.div(source, divisor, out=out)
    else:
        out.copy_(source / divisor)


INDEX_CACHE = 256
"""Plans whose :class:`PlanIndex` is kept (the most recently used): skip sets vary per
step (2**blocks patterns for stochastic depth), so only recent ones are worth keeping."""

_indices: OrderedDict[tuple[int, torch.device], tuple[MaskPlan, PlanIndex]] = OrderedDict()


def plan_index(plan: MaskPlan, device: torch.device) -> PlanIndex:
    """The :class:`PlanIndex` of ``plan`` on ``device``, built once and cached: the
    reductions and the masked all-gather of one step share it."""
    key = (id(plan), device)
    cached = _indices.get(key)
    # The cache holds the plan, so an id found here is that plan's while it is cached;
    # the identity check costs nothing and keeps that true should the key ever change.
    if cached is None or cached[0] is not plan:
        cached = (plan, PlanIndex(plan, device))
        _indices[key] = cached
        if len(_indices) > INDEX_CACHE:
            _indices.popitem(last=False)
    else:
        _indices.move_to_end(key)
    return cached[1]
