"""The gradients of one flat parameter's views: :class:`ViewGrads`.

The invariant kept (:mod:`flatview.views` names the tensor roles): the sharded gradient
equals the view gradients laid side by side, a ``None`` view gradient standing for
zeros. What a step costs here is what it must change:

* the pieces of a sharded gradient under the views are cut once per gradient tensor
  and storage and kept (:meth:`ViewGrads._grad_pieces`): a wrapper that accumulates
  into the gradient it holds, or flatview adding the views' gradients into it, keeps
  them; a new tensor or storage is cut anew, in one call;
* an *empty* view (this rank holds none of its parameter's elements, which other ranks
  hold) never gets a gradient: its gradient would hold nothing, yet an optimizer would
  step it, so an optimizer over views steps only the views with elements here, about
  ``1/W`` of them on ``W`` ranks (torch's ``use_orig_params=True`` views do the same).
  A used parameter still has a gradient on every rank that holds elements of it, and a
  parameter without any element (``numel() == 0``) gets its empty one on every rank;
* which views a step's *used* flags select is worked out once per distinct flags.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import repeat

import torch
from torch import nn

from flatview.layout import FlatLayout, Piece, PieceKind

SELECTIONS = 256
"""Distinct ``used`` flags a view set remembers selections for (skip sets repeat, but
may also vary every step: 2**blocks patterns)."""

_unflatten = torch._utils._unflatten_dense_tensors


def piece_of(tensor: torch.Tensor, piece: Piece, layout: FlatLayout) -> torch.Tensor:
    """``piece`` of a shard-shaped ``tensor``: in the parameter's shape when FULL, else
    1-D (a view)."""
    start, end = piece.shard_interval
    flat_piece = tensor[start:end]
    if piece.kind is PieceKind.FULL:
        return flat_piece.view(layout.segments[piece.segment].shape)
    return flat_piece


class ViewGrads:
    """The gradients of the views ``views`` of ``flat`` on one rank (see the module
    docstring). ``views`` is kept current by the view set (a view replaced by a new
    parameter)."""

    def __init__(
        self,
        flat: nn.Parameter,
        layout: FlatLayout,
        pieces: tuple[Piece, ...],
        views: tuple[nn.Parameter, ...],
    ) -> None:
        self.flat = flat
        self.layout = layout
        self.pieces = pieces
        # The views that take gradients on this rank: those with elements here, and those
        # of parameters without any element. Below, a *position* indexes these.
        self._bearing: tuple[int, ...] = tuple(
            i
            for i, piece in enumerate(pieces)
            if piece.numel or layout.segments[piece.segment].numel == 0
        )
        self._held: list[nn.Parameter] = []
        self.views = views
        # The gradient pieces last cut, the sharded gradient they were cut from and its
        # storage: the next gradient on the same storage reuses them (see _grad_pieces).
        self._cut_from: torch.Tensor | None = None
        self._cut_ptr = 0
        self._cut_bearing: list[torch.Tensor] = []
        self._cut_ptrs: list[int] = []
        self._run = self._bearing_run()
        # Per distinct ``used`` flags (skip sets repeat): the positions used, and those
        # not used (which keep a gradient only if they hold one already).
        self._selections: dict[tuple[bool, ...], tuple[tuple[int, ...], tuple[int, ...]]] = {}
        # The gradient tensors last handed to the bearing views (and their storage), and
        # the sharded gradient they were cut from: anything else found there later was
        # put there by someone else (an optimizer's zero_grad, or the user, also through
        # ``view.grad.data = t``).
        self._exposed: list[torch.Tensor | None] = [None] * len(self._bearing)
        self._exposed_ptrs: list[int] = [0] * len(self._bearing)
        self._exposed_from: torch.Tensor | None = None
        # While a forward and its backward run, the wrapper computes a fresh sharded
        # gradient; the one from before (which the views may still alias) waits here.
        self._detached = False
        self._before: torch.Tensor | None = None

    @property
    def views(self) -> tuple[nn.Parameter, ...]:
        """The views (kept current by the view set: a view replaced by a parameter)."""
        return self._views

    @views.setter
    def views(self, views: tuple[nn.Parameter, ...]) -> None:
        self._views = views
        self._held = [views[i] for i in self._bearing]
        # The dtype of the sharded gradient the views last took (see _admit); a view
        # replaced since takes it anew.
        self._grad_dtype = self.flat.dtype

    def _grad_pieces(self, flat_grad: torch.Tensor) -> list[torch.Tensor]:
        """The pieces of the sharded gradient ``flat_grad`` under the bearing views (by
        position), cut once per tensor and storage: a wrapper
        that accumulates into the gradient it holds, or flatview adding the views'
        gradients into it, keeps them valid; a new tensor or storage is cut anew."""
        ptr = flat_grad.data_ptr()
        if (
            flat_grad is self._cut_from
            and ptr == self._cut_ptr
            # A piece handed out as a gradient may have been given other data since
            # (``view.grad.data = t``): then it no longer aliases the gradient.
            and [c.data_ptr() for c in self._cut_bearing] == self._cut_ptrs
        ):
            return self._cut_bearing
        bearing: list[torch.Tensor]
        if self._run is None:
            bearing = [piece_of(flat_grad, self.pieces[i], self.layout) for i in self._bearing]
        else:
            # The pieces with elements here lie end to end: every view of them in one
            # call (torch's own unflattening, as its DDP and FSDP use: a view each).
            start, numel, shapes = self._run
            bearing = list(_unflatten(flat_grad.narrow(0, start, numel), shapes))
        self._cut_bearing, self._cut_from, self._cut_ptr = bearing, flat_grad, ptr
        self._cut_ptrs = [c.data_ptr() for c in bearing]
        return bearing

    def _bearing_run(self) -> tuple[int, int, list[torch.Tensor]] | None:
        """Where the bearing pieces lie in the shard when they lie end to end (start,
        elements), with one shape prototype each (on the meta device: shapes only);
        ``None`` otherwise (alignment gaps)."""
        chosen = [self.pieces[i] for i in self._bearing]
        filled = [piece for piece in chosen if piece.numel]
        start = filled[0].shard_offset if filled else 0
        cursor = start
        for piece in filled:
            if piece.shard_offset != cursor:
                return None
            cursor += piece.numel
        shapes = [
            torch.empty(
                self.layout.segments[piece.segment].shape
                if piece.kind is PieceKind.FULL
                else (piece.numel,),
                device="meta",
            )
            for piece in chosen
        ]
        return start, cursor - start, shapes

    def _selection(self, used: tuple[bool, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(positions used, positions not used) under the flags ``used``."""
        found = self._selections.get(used)
        if found is None:
            found = (
                tuple(p for p, i in enumerate(self._bearing) if used[i]),
                tuple(p for p, i in enumerate(self._bearing) if not used[i]),
            )
            if len(self._selections) >= SELECTIONS:
                self._selections.clear()  # skip sets vary freely: keep recent ones only
            self._selections[used] = found
        return found

    def _grads(self) -> list[torch.Tensor | None]:
        """The gradients the bearing views hold now (by position)."""
        return [view.grad for view in self._held]

    def _as_exposed(self, grads: Sequence[torch.Tensor | None]) -> bool:
        """Whether ``grads`` (of the bearing views) are the gradients last handed out,
        each still on the storage it was cut from (``view.grad.data = t`` keeps the
        object, not the data)."""
        if not all(map(operator.is_, grads, self._exposed)):
            return False
        ptrs = [g.data_ptr() if g is not None else 0 for g in grads]
        if ptrs == self._exposed_ptrs:
            return True
        return all(self._still_exposed(i, g) for i, g in enumerate(grads))

    def push(self) -> None:
        """Make the sharded gradient agree with the view gradients before a backward.

        Optimizers over views zero or drop *view* gradients; this carries that into the
        sharded gradient, so nothing stale accumulates there. When the sharded gradient
        itself changed since the views last saw it (an optimizer over the flat
        parameter), the flat parameter wins.
        """
        flat = self.flat
        if flat.grad is not self._exposed_from:
            self.pull(used=None)
            return
        grads = self._grads()
        if self._as_exposed(grads):
            return
        if all(g is None for g in grads):
            flat.grad = None
            self._expose(None)
            return
        if flat.grad is None:
            flat.grad = torch.zeros(self.layout.shard_numel, dtype=flat.dtype, device=flat.device)
        flat_grad = flat.grad
        for position, (i, grad) in enumerate(zip(self._bearing, grads, strict=True)):
            if grad is not None and self._still_exposed(position, grad):
                continue
            start, end = self.pieces[i].shard_interval
            if grad is None:
                flat_grad[start:end].zero_()
            else:
                flat_grad[start:end].copy_(grad.reshape(-1))
        used = [False] * len(self.views)
        for i, grad in zip(self._bearing, grads, strict=True):
            used[i] = grad is not None
        self.pull(used=tuple(used))

    def pull(self, used: tuple[bool, ...] | None) -> None:
        """Hand each view its piece of the sharded gradient.

        ``used[i]`` says whether original parameter ``i`` took part in the step(s) this
        gradient comes from; one that did not keeps ``grad is None`` unless it already
        had a gradient. ``used=None`` means every parameter did. Empty views (see the
        class docstring) are left alone: flatview gives them no gradient.
        """
        flat_grad = self.flat.grad
        held = self._held
        if flat_grad is None:
            for view in held:
                view.grad = None
            self._expose(None)
            return
        if flat_grad.dtype is not self._grad_dtype:
            self._admit(flat_grad.dtype)
        pieces = self._grad_pieces(flat_grad)
        chosen, others = ((), ()) if used is None else self._selection(used)
        if not others:
            for view, piece in zip(held, pieces, strict=True):
                view.grad = piece
            # What they hold now is known: no need to read it back.
            self._exposed, self._exposed_ptrs = list(pieces), self._cut_ptrs
            self._exposed_from = flat_grad
            return
        for p in chosen:
            held[p].grad = pieces[p]
        for p in others:
            view = held[p]
            if view.grad is not None:
                view.grad = pieces[p]
        self._expose(flat_grad)

    def _admit(self, dtype: torch.dtype) -> None:
        """Let the views take gradients of ``dtype``: a wrapper that keeps its gradient in
        low precision (torch FSDP1's ``keep_low_precision_grads``) hands full-precision
        parameters a low-precision gradient, as it does its own flat parameter. torch's
        own per-parameter views get theirs through ``.data``; these allow any dtype."""
        if dtype is not self.flat.dtype:
            for view in self._views:
                view.grad_dtype = None
        self._grad_dtype = dtype

    def _expose(self, flat_grad: torch.Tensor | None) -> None:
        """Note what the bearing views now hold, cut from ``flat_grad``."""
        grads = self._grads()
        self._exposed = grads
        self._exposed_ptrs = [g.data_ptr() if g is not None else 0 for g in grads]
        self._exposed_from = flat_grad
        if flat_grad is None:
            # No gradient any more (zero_grad(set_to_none=True)): the pieces cut from the
            # last one must not keep its memory alive through the next backward.
            self._cut_from, self._cut_bearing, self._cut_ptrs = None, [], []

    def _still_exposed(self, position: int, grad: torch.Tensor | None) -> bool:
        """Whether ``grad`` is the gradient last handed to the ``position``-th bearing
        view, still on the storage it was cut from."""
        if grad is not self._exposed[position]:
            return False
        return grad is None or grad.numel() == 0 or grad.data_ptr() == self._exposed_ptrs[position]

    def detach(self) -> None:
        """A forward starts: hand the wrapper no gradient to accumulate into (it computes
        a fresh sharded gradient), keeping the views' gradients as they are.

        Whatever happens to view gradients until the backward ends (an optimizer's
        ``zero_grad`` after the forward, say) is then what :meth:`combine` adds
        the new gradient to, as autograd accumulates into the unwrapped model's
        ``.grad``. A no-op while already detached (several forwards, one backward)."""
        if self._detached:
            return
        flat = self.flat
        if flat.grad is not self._exposed_from:
            self.pull(used=None)
        before = flat.grad
        if before is not None and not any(map(operator.is_not, self._grads(), repeat(None))):
            # Every view's gradient was dropped (zero_grad(set_to_none=True)): the sharded
            # gradient stands for zeros, and kept through the forward and the backward it
            # would be one gradient more at their peak than the bare wrapper holds.
            before = None
            self._expose(None)
        self._before = before
        flat.grad = None
        self._detached = True

    def combine(self, used: tuple[bool, ...]) -> None:
        """A synchronising backward ended: the sharded gradient becomes the new one plus
        the view gradients of this moment (a ``None`` one adds nothing), and each view
        gets its piece (one neither used nor holding a gradient keeps ``None``)."""
        if not self._detached:
            self.pull(used=used)
            return
        before, self._before = self._before, None
        self._detached = False
        flat = self.flat
        new = flat.grad
        grads = self._grads()
        if (
            before is not None
            and before is self._exposed_from
            and not any(map(operator.is_, grads, repeat(None)))
            and self._as_exposed(grads)
        ):
            # Nothing touched the old gradient: one addition instead of one per view,
            # into the old tensor where it can take it (its pieces stay cut: the views
            # keep their gradient tensors). x + y is y + x, bit for bit.
            if new is None:
                _give_back(flat, before)
            elif (
                new.dtype == before.dtype
                and new.device == before.device
                and new.shape == before.shape
            ):
                before.add_(new)
                _give_back(flat, before)
            else:
                new.add_(before)
        else:
            held = [
                (self.pieces[i], g)
                for i, g in zip(self._bearing, grads, strict=True)
                if g is not None
            ]
            if held and new is None:
                # A view holding a gradient keeps one, also a parameter without elements
                # (an empty gradient, as on the unwrapped model a zeroed one).
                new = torch.zeros(self.layout.shard_numel, dtype=flat.dtype, device=flat.device)
                flat.grad = new
            for piece, grad in held:
                if piece.numel:
                    assert new is not None
                    start, end = piece.shard_interval
                    new[start:end].add_(grad.reshape(-1))
        self.pull(used=used)

    def reattach(self) -> None:
        """The forward that detached the gradients had no backward (run without
        autograd): the old sharded gradient is the flat parameter's again."""
        if not self._detached:
            return
        self._detached = False
        before, self._before = self._before, None
        if self.flat.grad is None:
            _give_back(self.flat, before)
            self._exposed_from = before


def _give_back(flat: nn.Parameter, grad: torch.Tensor | None) -> None:
    """``flat.grad = grad``, for a gradient flatview took off the wrapper's parameter. One
    of another dtype is set as the wrapper put it there, through ``.data`` of that dtype
    (torch's setter checks the gradient against the parameter's dtype): fairscale at world
    size 1 with ``mixed_precision`` computes on fp16 ``.data`` and leaves the fp16
    gradient on its fp32 flat parameter."""
    if grad is None or grad.dtype == flat.dtype:
        flat.grad = grad
        return
    data = flat.data
    flat.data = grad
    try:
        flat.grad = grad
    finally:
        flat.data = data
