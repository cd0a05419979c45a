"""Where :class:`flatview.coalesced.Coalesced` may step neighbouring views as one tensor,
and where their state lives: a :class:`RunPlan` per parameter group.

Views *link* when they lie end to end in one storage and their state slices lie end to
end in one :class:`StateBuffer` (one per storage, dtype and device, covering the span of
the optimizer's views there); under ``fused`` a view also has to fill whole work units
of the fused kernels (:data:`FUSED_UNIT_BYTES`), whose scalar tail rounds differently.
Which linked neighbours *join* a run at a step also depends on their gradients and state
(:class:`~flatview.coalesced.Coalesced`).
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat
from typing import Any

import torch
from torch import Tensor

FUSED_UNIT_BYTES = 64
"""Under ``fused``, a view continues a run only if its size is a multiple of this."""
CACHED_PER_VIEW = 4
"""Run aliases and state spans a plan keeps, per view: with skips drawn at random every
step makes runs of its own, and a cache of every run ever stepped would grow with the
number of steps (it is cleared when full; steady runs are kept, and are made again)."""
SOLO = -1
"""A view's state signature when its state cannot join a run (not in the buffers)."""

_PTR = Tensor.data_ptr
_NUMEL = Tensor.numel
_CONTIGUOUS = Tensor.is_contiguous
_NO_GRAD = torch.empty(0)
"""Stands in for a missing gradient in the pointer arithmetic (which it never joins)."""


def eligible(p: Tensor) -> bool:
    """Whether ``p`` can be part of a run: a plain tensor (not a subclass such as FSDP2's
    ``DTensor``, whose memory is its local tensor's), dense, contiguous, real floating
    point, not empty (its state then fits a buffer slice)."""
    return (
        type(p.data) is Tensor
        and p.layout == torch.strided
        and p.numel() > 0
        and p.is_floating_point()
        and p.is_contiguous()
    )


def covers(grad: Tensor, numels: tuple[int, ...]) -> bool:
    """Whether the storage of ``grad``, a run's first gradient, holds the whole run: the
    gradients lying end to end may be tensors of their own that an allocator placed
    side by side (a GPU's caching allocator does), which one alias must not span."""
    end = (grad.storage_offset() + sum(numels)) * grad.element_size()
    return end <= grad.untyped_storage().nbytes()


@dataclass
class StateBuffer:
    """Where the state of one storage's parameters lives: one tensor per state key."""

    length: int
    dtype: torch.dtype
    device: torch.device
    tensors: dict[str, Tensor] = field(default_factory=dict)

    def get(self, key: str) -> Tensor:
        found = self.tensors.get(key)
        if found is None:
            found = self.tensors[key] = torch.zeros(
                self.length, dtype=self.dtype, device=self.device
            )
        return found


@dataclass
class RunPlan:
    """One parameter group: its views that may join runs, in address order, how they
    link, where their state lives, and what was handed out of it (made again when the
    views change size or contiguity: :func:`plan_groups`)."""

    order: list[Tensor]
    """Eligible views, by address."""
    alone: list[Tensor]
    """Views that are never part of a run (empty, non-contiguous, overlapping, ...)."""
    ptrs: tuple[int, ...]
    numels: tuple[int, ...]
    link: list[bool]
    """``link[i]``: views ``i`` and ``i + 1`` are end to end in one storage and buffer."""
    fused_link: list[bool]
    """``link`` where view ``i`` also fills whole fused work units."""
    buffers: list[StateBuffer]
    offsets: list[int]
    """Each view's offset in its buffer."""
    handed: dict[str, list[Any]]
    """Per state key, what each view's state holds as handed out (``None``: nothing)."""
    sig: list[int]
    """Per view, which state keys it holds (a bit each), or :data:`SOLO`."""
    slices: dict[str, list[Tensor | None]]
    """Per elementwise key, each view's slice of its buffer (made when first needed)."""
    members: tuple[int, ...] = ()
    """The identities of the group's parameters when planned."""
    slice_ptrs: dict[str, list[int]] = field(default_factory=dict)
    """Where each slice's data was when made (0: none made): a slice given other data
    since (``state[key].data = t``, as code that moves optimizer state to another device
    does) no longer holds the buffer's elements."""
    runs: dict[tuple[int, int], Tensor] = field(default_factory=dict)
    """Run ``a:b``'s alias of the views' memory, while they stay where they are."""
    spans: dict[tuple[str, int, int], Tensor] = field(default_factory=dict)
    """A run's state ``key``: its span of the buffer."""

    joins: dict[bool, list[bool]] = field(default_factory=dict)
    """Per ``fused``: the links between neighbours with the same state in the buffers."""

    def joinable(self, fused: bool) -> list[bool]:
        found = self.joins.get(fused)
        if found is None:
            sig = self.sig
            found = self.joins[fused] = [
                ok and x == y and x >= 0
                for ok, x, y in zip(
                    self.fused_link if fused else self.link, sig, sig[1:], strict=False
                )
            ]
        return found

    def set_sig(self, i: int, sig: int) -> None:
        if self.sig[i] != sig:
            self.sig[i] = sig
            self.joins.clear()

    def run_alias(self, a: int, b: int) -> Tensor:
        """Run ``a:b``'s alias: one tensor over the views' memory (kept while they stay
        where they are, up to :data:`CACHED_PER_VIEW` per view)."""
        found = self.runs.get((a, b))
        if found is None:
            if len(self.runs) >= CACHED_PER_VIEW * len(self.order):
                self.runs.clear()
            total = sum(self.numels[a:b])
            found = torch.as_strided(self.order[a].detach(), (total,), (1,))
            self.runs[(a, b)] = found
        return found

    def span(self, key: str, a: int, total: int) -> Tensor:
        found = self.spans.get((key, a, total))
        if found is None:
            if len(self.spans) >= CACHED_PER_VIEW * len(self.order) * len(self.handed):
                self.spans.clear()
            start = self.offsets[a]
            found = self.spans[(key, a, total)] = self.buffers[a].get(key)[start : start + total]
        return found

    def slice_of(self, key: str, i: int) -> Tensor:
        found = self.slices[key][i]
        if found is None:
            p = self.order[i]
            start = self.offsets[i]
            found = self.buffers[i].get(key)[start : start + p.numel()].view(p.shape)
            self.slices[key][i] = found
            self.slice_ptrs.setdefault(key, [0] * len(self.order))[i] = found.data_ptr()
        return found

    def moved_slices(self, key: str) -> list[int]:
        """The views whose slice of ``key`` was given other data since it was made; their
        slices are forgotten (the next :meth:`slice_of` makes new ones)."""
        made = self.slice_ptrs.get(key)
        if made is None:
            return []
        slices = self.slices[key]
        now = [0 if t is None else t.data_ptr() for t in slices]
        if now == made:
            return []
        moved = [i for i, (x, y) in enumerate(zip(now, made, strict=True)) if x != y]
        for i in moved:
            slices[i] = None
            made[i] = 0
        return moved

    def moved(self, ptrs: tuple[int, ...]) -> None:
        """The views moved (a new storage): links hold where neighbours moved alike."""
        shift = list(map(operator.sub, ptrs, self.ptrs))
        self.link = [ok and x == y for ok, x, y in zip(self.link, shift, shift[1:], strict=False)]
        self.fused_link = [ok and x for ok, x in zip(self.fused_link, self.link, strict=True)]
        self.ptrs = ptrs
        self.runs.clear()
        self.joins.clear()

    def still_laid_out(self) -> bool:
        """Whether the views keep the sizes and contiguity of the plan (their addresses
        may move: :meth:`moved`)."""
        order = self.order
        return tuple(map(_NUMEL, order)) == self.numels and all(map(_CONTIGUOUS, order))


def plans_hold(plans: list[RunPlan], param_groups: list[dict[str, Any]]) -> bool:
    """Whether ``plans`` still describe ``param_groups``: the same parameters in each
    group (code that re-points an optimizer's groups at other parameters, as wrappers'
    integrations do, must not leave the old ones stepped), laid out as planned."""
    return (
        len(plans) == len(param_groups)
        and all(
            plan.members == tuple(map(id, group["params"]))
            for plan, group in zip(plans, param_groups, strict=True)
        )
        and all(plan.still_laid_out() for plan in plans)
    )


def plan_groups(
    param_groups: list[dict[str, Any]], elementwise: tuple[str, ...], scalars: tuple[str, ...]
) -> list[RunPlan]:
    """A plan per parameter group: state buffers per (storage, dtype, device) covering
    the span of all groups' views in that storage; nothing handed out yet."""
    by_storage: dict[tuple[Any, ...], list[Tensor]] = defaultdict(list)
    for group in param_groups:
        for p in group["params"]:
            if eligible(p):
                by_storage[(p.untyped_storage().data_ptr(), p.dtype, p.device)].append(p)
    home: dict[int, tuple[StateBuffer, int]] = {}
    for (_, dtype, device), members in by_storage.items():
        members.sort(key=Tensor.storage_offset)
        starts = [int(p.storage_offset()) for p in members]
        ends = [s + int(p.numel()) for s, p in zip(starts, members, strict=True)]
        # Overlapping views (aliases) would share state: they keep their own.
        clash: set[int] = set()
        reach = ends[0]
        for i in range(1, len(members)):
            if starts[i] < reach:
                clash.add(i)
                clash.update(j for j in range(i) if ends[j] > starts[i])
            reach = max(reach, ends[i])
        kept = [i for i in range(len(members)) if i not in clash]
        if not kept:
            continue
        low = starts[kept[0]]
        buffer = StateBuffer(max(ends[i] for i in kept) - low, dtype, device)
        for i in kept:
            home[id(members[i])] = (buffer, starts[i] - low)
    plans = []
    for group in param_groups:
        params = group["params"]
        order = sorted((p for p in params if id(p) in home), key=_PTR)
        buffers = [home[id(p)][0] for p in order]
        offsets = [home[id(p)][1] for p in order]
        numels = [int(p.numel()) for p in order]
        link = [
            buffers[i] is buffers[i + 1] and offsets[i] + numels[i] == offsets[i + 1]
            for i in range(len(order) - 1)
        ]
        fused_link = [
            ok and (numels[i] * order[i].element_size()) % FUSED_UNIT_BYTES == 0
            for i, ok in enumerate(link)
        ]
        n = len(order)
        plans.append(
            RunPlan(
                order=order,
                alone=[p for p in params if id(p) not in home],
                members=tuple(map(id, params)),
                ptrs=tuple(map(_PTR, order)),
                numels=tuple(numels),
                link=link,
                fused_link=fused_link,
                buffers=buffers,
                offsets=offsets,
                handed={k: [None] * n for k in (*elementwise, *scalars)},
                sig=[0] * n,
                slices={k: [None] * n for k in elementwise},
            )
        )
    return plans


def shortest_run(fused: bool) -> int:
    """The fewest views worth stepping as one run: a run costs about what two tensors
    cost the fused kernels (~10 µs), so under ``fused`` two views are stepped as they
    are."""
    return 3 if fused else 2


def step_spans(
    plan: RunPlan, grads: list[Tensor | None], ptrs: tuple[int, ...], fused: bool
) -> tuple[list[tuple[int, int]], list[int]]:
    """This step's spans of views ``a:b`` that may step as runs (at least
    :func:`shortest_run` long), and the views with a gradient that step alone.

    Neighbours join where the layout links them with the same kind of state
    (``plan.joinable``) and both have a contiguous gradient at the same distance from
    the view (the gradients lie end to end too). Only the views that can join are
    walked: with half of them skipped, a walk over every view would cost Python per
    skipped one. A span may still be cut where step counts differ
    (:class:`~flatview.coalesced.Coalesced`)."""
    n = len(grads)
    if all(map(operator.is_not, grads, repeat(None))):
        present: list[bool] | None = None
        filled: Sequence[Tensor] = grads  # type: ignore[assignment]
    else:
        present = list(map(operator.is_not, grads, repeat(None)))
        filled = [_NO_GRAD if g is None else g for g in grads]
    shift = list(map(operator.sub, map(_PTR, filled), ptrs))
    joined = map(operator.and_, plan.joinable(fused), map(operator.eq, shift, shift[1:]))
    keep: Sequence[int] = range(n)
    singles: list[int] = []
    if present is not None or not all(map(_CONTIGUOUS, filled)):
        ok = list(map(operator.and_, present or repeat(True), map(_CONTIGUOUS, filled)))
        joined = map(operator.and_, map(operator.and_, joined, ok), ok[1:])
        # A gradient that is there but not contiguous: that view steps alone.
        singles = list(compress(range(n), map(operator.gt, present or repeat(True), ok)))
        keep = list(compress(range(n), ok))
    # Links between kept neighbours: a view between them is not kept, and the link from
    # a view to a skipped neighbour is already False.
    links = list(joined)
    breaks = list(
        compress(range(1, len(keep)), map(operator.not_, map(links.__getitem__, keep[:-1])))
    )
    shortest = shortest_run(fused)
    spans = []
    for ka, kb in zip([0, *breaks], [*breaks, len(keep)], strict=True):
        if kb - ka < shortest:
            singles.extend(keep[ka:kb])
        else:
            spans.append((keep[ka], keep[kb - 1] + 1))
    return spans, singles
