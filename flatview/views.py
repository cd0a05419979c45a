"""Views: one ``nn.Parameter`` per original parameter, aliasing this rank's local shard.

Tensor roles (the names used throughout flatview, defined once here)
--------------------------------------------------------------------
original parameter
    A parameter of the user's model before wrapping. FSDP with flattening deletes it
    from its module; flatview puts a *view* back in its place.
flat parameter
    The wrapper's ``nn.Parameter`` that concatenates one unit's original parameters,
    each flattened (fairscale ``FlatParameter``, torch ``FlatParameter``). Between passes
    its ``.data`` is the local shard.
unsharded flat
    The flat parameter's full, all-gathered value (``numel`` elements plus padding),
    which exists only while the wrapper computes.
local shard
    This rank's ``shard_numel`` elements of the padded flat parameter, in full precision
    (fairscale ``_fp32_shard``, torch ``_local_shard``). The master copy an optimizer
    updates. Layout math: :mod:`flatview.layout`.
view
    An ``nn.Parameter`` whose storage *is* a piece of the local shard: FULL (original
    shape), PARTIAL (1-D) or EMPTY (numel 0). An optimizer step on a view writes
    straight into the local shard.
unsharded gradient
    The gradient autograd produces for the unsharded flat on one rank, before reduction.
packed gradient
    The used elements of the unsharded gradient, grouped by destination rank: what a
    masked reduction communicates (:mod:`flatview.comm`).
sharded gradient
    The reduced gradient of the local shard, ``flat.grad`` between steps.
view gradient
    ``view.grad``: the piece of the sharded gradient under the view (an alias, never a
    copy), or ``None`` when the parameter took no part in the step.

The invariant this module keeps: the sharded gradient equals the view gradients laid
side by side, a ``None`` view gradient standing for zeros.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from flatview.errors import FlatViewError
from flatview.layout import FlatLayout, Piece, PieceKind


class Shown(enum.Enum):
    """Whose tensors the original submodules show under the original names."""

    VIEWS = "views"
    """The views are registered parameters of their submodules (between passes)."""
    WRAPPER = "wrapper"
    """The views stepped aside; the wrapper owns the attributes (while it computes,
    or during one of its own operations such as ``state_dict``)."""


@dataclass(frozen=True)
class Owner:
    """One place an original parameter is registered: ``module.<attr>``."""

    module: nn.Module
    attr: str


class ViewSet:
    """The views of one flat parameter on one rank, and which of the two is shown.

    ``owners[i]`` lists every place original parameter ``i`` is registered (more than one
    when parameters are tied); the same view object is shown at all of them. While the
    views are shown the flat parameter is hidden from its owner, so that no traversal
    (``model.parameters()``, a plain parent's ``.parameters()``) meets both.
    """

    def __init__(
        self,
        flat: nn.Parameter,
        flat_owner: Owner,
        layout: FlatLayout,
        rank: int,
        local_shard: torch.Tensor,
        owners: Sequence[Sequence[Owner]],
    ) -> None:
        if len(owners) != len(layout.segments):
            raise ValueError(f"{len(owners)} owner lists for {len(layout.segments)} segments")
        self.flat = flat
        self.flat_owner = flat_owner
        self.layout = layout
        self.pieces: tuple[Piece, ...] = layout.pieces(rank)
        self.owners = tuple(tuple(o) for o in owners)
        self.views: tuple[nn.Parameter, ...] = tuple(
            nn.Parameter(self._piece_of(local_shard, piece), requires_grad=flat.requires_grad)
            for piece in self.pieces
        )
        self._bound_storage = local_shard.untyped_storage().data_ptr()
        self._shard = local_shard
        # Where each view's data must be: a view found elsewhere was given new data
        # (``view.data = t``), to be written back into the shard.
        self._bound_ptrs = [view.data_ptr() for view in self.views]
        self._split = self._split_sizes()
        # The gradient tensors this set last handed to the views (and their storage),
        # and the sharded gradient they were cut from: anything else found there later
        # was put there by someone else (an optimizer's zero_grad, or the user, also
        # through ``view.grad.data = t``).
        self._exposed: list[torch.Tensor | None] = [None] * len(self.views)
        self._exposed_ptrs: list[int] = [0] * len(self.views)
        self._exposed_from: torch.Tensor | None = None
        # While a forward and its backward run, the wrapper computes a fresh sharded
        # gradient; the one from before (which the views may still alias) waits here.
        self._detached = False
        self._before: torch.Tensor | None = None
        self.shown = Shown.WRAPPER

    def _split_sizes(self) -> list[int] | None:
        """Sizes that ``Tensor.split`` turns into every piece, in order, and the padding
        after them; ``None`` if pieces are not laid end to end (alignment gaps)."""
        sizes, cursor = [], 0
        for piece in self.pieces:
            if piece.numel and piece.shard_offset != cursor:
                return None
            sizes.append(piece.numel)
            cursor += piece.numel
        sizes.append(self.layout.shard_numel - cursor)
        return sizes

    def _pieces_of(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every piece of a shard-shaped tensor: one ``split`` call when possible, since
        this runs for every view after every backward."""
        if self._split is None:
            return [self._piece_of(tensor, piece) for piece in self.pieces]
        chunks = tensor.split(self._split)
        return [
            chunk.view(self.layout.segments[piece.segment].shape)
            if piece.kind is PieceKind.FULL
            else chunk
            for chunk, piece in zip(chunks, self.pieces, strict=False)
        ]

    def _piece_of(self, tensor: torch.Tensor, piece: Piece) -> torch.Tensor:
        start, end = piece.shard_interval
        flat_piece = tensor[start:end]
        if piece.kind is PieceKind.FULL:
            return flat_piece.view(self.layout.segments[piece.segment].shape)
        return flat_piece

    # ----------------------------------------------------------------- placement

    def show(self) -> None:
        """Register the views on their submodules, replacing what the wrapper put there."""
        assert self.shown is Shown.WRAPPER, self.shown
        self.flat_owner.module._parameters.pop(self.flat_owner.attr, None)
        for view, owners in zip(self.views, self.owners, strict=True):
            for owner in owners:
                # The wrapper leaves plain tensors as instance attributes, which would
                # shadow a registered parameter.
                owner.module.__dict__.pop(owner.attr, None)
                # In the place of a parameter the wrapper registered there (DeepSpeed's),
                # so that the module's parameter order stays the model's.
                owner.module._parameters[owner.attr] = view
        self.shown = Shown.VIEWS

    def hide(self) -> None:
        """Step aside so the wrapper can set its own tensors under the original names."""
        assert self.shown is Shown.VIEWS, self.shown
        for owners in self.owners:
            for owner in owners:
                owner.module._parameters.pop(owner.attr, None)
        self.flat_owner.module._parameters[self.flat_owner.attr] = self.flat
        self.shown = Shown.WRAPPER

    def rebind(self, local_shard: torch.Tensor) -> None:
        """Point the views at a new local shard storage (same view objects: optimizers
        keep working). A no-op when the storage did not move."""
        storage = local_shard.untyped_storage().data_ptr()
        self._shard = local_shard
        if storage == self._bound_storage:
            return
        for view, piece in zip(self.views, self.pieces, strict=True):
            view.data = self._piece_of(local_shard, piece)
        self._bound_storage = storage
        self._bound_ptrs = [view.data_ptr() for view in self.views]

    def write_back(
        self, names: Sequence[str], *, replace: bool = True
    ) -> list[tuple[int, nn.Parameter]]:
        """Carry what was written through the views into the shard, as torch does with
        ``use_orig_params=True``: new data (``view.data = t``) and new parameters
        registered in a view's place (``module.weight = nn.Parameter(t)``), which then
        become the views, aliasing the shard. ``names[i]`` names original parameter
        ``i`` in errors.

        Returns ``(segment, parameter)`` for each view replaced by a new parameter.

        Raises:
            FlatViewError: a value of the wrong shape or dtype, or (``replace`` False) a
                new parameter in a view's place, naming the parameter; nothing is
                written then.
        """
        replaced: list[tuple[int, nn.Parameter]] = []
        writes: list[tuple[int, torch.Tensor]] = []
        shown = self.shown is Shown.VIEWS
        for index, view in enumerate(self.views):
            source: nn.Parameter = view
            if shown:
                for owner in self.owners[index]:
                    found = owner.module._parameters.get(owner.attr)
                    if found is not view and isinstance(found, nn.Parameter):
                        source = found
                        break
            if source is view and view.data_ptr() == self._bound_ptrs[index]:
                continue
            writes.append((index, self._checked_source(index, source, names[index])))
            if source is not view:
                if not replace:
                    raise FlatViewError(
                        f"parameter {names[index]!r} was replaced by a new nn.Parameter; "
                        "this backend reduces the gradients of the views it made, so the "
                        "new one would train apart on each rank. Assign values instead "
                        "(module.weight.data = t)."
                    )
                replaced.append((index, source))
        if not writes:
            return replaced
        with torch.no_grad():
            for index, values in writes:
                target = self._piece_of(self._shard, self.pieces[index])
                if target.numel():
                    target.copy_(values)
        views = list(self.views)
        for index, param in replaced:
            # The replaced view leaves the model, as the original parameter would: it
            # must no longer alias the shard (an optimizer still holding it would write
            # into the new parameter's elements).
            old = views[index]
            old.data = old.data.clone()
            if old.grad is not None:
                old.grad = old.grad.clone()
            views[index] = param
            for owner in self.owners[index]:
                owner.module._parameters[owner.attr] = param
        self.views = tuple(views)
        for index, _ in writes:
            self.views[index].data = self._piece_of(self._shard, self.pieces[index])
            self._bound_ptrs[index] = self.views[index].data_ptr()
        return replaced

    def _checked_source(self, index: int, source: torch.Tensor, name: str) -> torch.Tensor:
        """The values of this rank's piece in ``source``: a tensor shaped like the view,
        or like the whole original parameter (this rank's piece is taken from it)."""
        piece = self.pieces[index]
        shape = torch.Size(self.layout.segments[piece.segment].shape)
        dtype = self.flat.dtype
        view_shape = torch.Size([piece.numel]) if piece.kind is not PieceKind.FULL else shape
        if source.dtype != dtype or source.shape not in (view_shape, shape):
            raise FlatViewError(
                f"parameter {name!r} was given a value flatview cannot write back into its "
                f"flat parameter: {source.dtype} of shape {tuple(source.shape)}, expected "
                f"{dtype} of shape {tuple(view_shape)} (this rank's piece) or "
                f"{tuple(shape)} (the whole parameter). Assign values of the parameter's "
                "shape and dtype, or copy them in place (view.data.copy_(t))."
            )
        values = source.detach()
        if source.shape == view_shape:
            return values.reshape(view_shape)
        start, end = piece.param_interval
        return values.reshape(-1)[start:end]

    # ----------------------------------------------------------------- gradients

    def push_grads(self) -> None:
        """Make the sharded gradient agree with the view gradients before a backward.

        Optimizers over views zero or drop *view* gradients; this carries that into the
        sharded gradient, so nothing stale accumulates there. When the sharded gradient
        itself changed since the views last saw it (an optimizer over the flat
        parameter), the flat parameter wins.
        """
        flat = self.flat
        if flat.grad is not self._exposed_from:
            self.pull_grads(used=None)
            return
        grads = [view.grad for view in self.views]
        if self._as_exposed(grads):
            return
        if all(g is None for g in grads):
            flat.grad = None
            self._exposed = [None] * len(self.views)
            self._exposed_from = None
            return
        if flat.grad is None:
            flat.grad = torch.zeros(self.layout.shard_numel, dtype=flat.dtype, device=flat.device)
        flat_grad = flat.grad
        for index, (piece, grad) in enumerate(zip(self.pieces, grads, strict=True)):
            if grad is not None and self._still_exposed(index, grad):
                continue
            start, end = piece.shard_interval
            if grad is None:
                flat_grad[start:end].zero_()
            else:
                flat_grad[start:end].copy_(grad.reshape(-1))
        self.pull_grads(used=[g is not None for g in grads])

    def pull_grads(self, used: Sequence[bool] | None) -> None:
        """Hand each view its piece of the sharded gradient.

        ``used[i]`` says whether original parameter ``i`` took part in the step(s) this
        gradient comes from; one that did not keeps ``grad is None`` unless it already
        had a gradient. ``used=None`` means every parameter did.
        """
        flat_grad = self.flat.grad
        if flat_grad is None:
            for view in self.views:
                view.grad = None
            self._exposed = [None] * len(self.views)
            self._exposed_from = None
            return
        for index, (view, grad) in enumerate(
            zip(self.views, self._pieces_of(flat_grad), strict=True)
        ):
            if used is None or used[index] or view.grad is not None:
                view.grad = grad
            self._exposed[index] = view.grad
            self._exposed_ptrs[index] = view.grad.data_ptr() if view.grad is not None else 0
        self._exposed_from = flat_grad

    def _still_exposed(self, index: int, grad: torch.Tensor | None) -> bool:
        """Whether ``grad`` is the gradient last handed to view ``index``, still on the
        storage it was cut from (``view.grad.data = t`` keeps the object, not the data)."""
        if grad is not self._exposed[index]:
            return False
        return grad is None or grad.numel() == 0 or grad.data_ptr() == self._exposed_ptrs[index]

    def _as_exposed(self, grads: Sequence[torch.Tensor | None]) -> bool:
        return all(self._still_exposed(i, g) for i, g in enumerate(grads))

    def detach_grads(self) -> None:
        """A forward starts: hand the wrapper no gradient to accumulate into (it computes
        a fresh sharded gradient), keeping the views' gradients as they are.

        Whatever happens to view gradients until the backward ends (an optimizer's
        ``zero_grad`` after the forward, say) is then what :meth:`combine_grads` adds
        the new gradient to, as autograd accumulates into the unwrapped model's
        ``.grad``. A no-op while already detached (several forwards, one backward)."""
        if self._detached:
            return
        flat = self.flat
        if flat.grad is not self._exposed_from:
            self.pull_grads(used=None)
        self._before = flat.grad
        flat.grad = None
        self._detached = True

    def combine_grads(self, used: Sequence[bool]) -> None:
        """A synchronising backward ended: the sharded gradient becomes the new one plus
        the view gradients of this moment (a ``None`` one adds nothing), and each view
        gets its piece (one neither used nor holding a gradient keeps ``None``)."""
        if not self._detached:
            self.pull_grads(used=used)
            return
        before, self._before = self._before, None
        self._detached = False
        flat = self.flat
        new = flat.grad
        grads = [view.grad for view in self.views]
        if (
            before is not None
            and before is self._exposed_from
            and all(g is not None for g in grads)
            and self._as_exposed(grads)
        ):
            # Nothing touched the old gradient: one addition instead of one per view.
            if new is None:
                flat.grad = before
            else:
                new.add_(before)
        else:
            held = [(p, g) for p, g in zip(self.pieces, grads, strict=True) if g is not None]
            if held and new is None:
                # A view holding a gradient keeps one, also where this rank holds none of
                # its elements (an empty gradient, as on the unwrapped model a zeroed one).
                new = torch.zeros(self.layout.shard_numel, dtype=flat.dtype, device=flat.device)
                flat.grad = new
            for piece, grad in held:
                if piece.numel:
                    assert new is not None
                    start, end = piece.shard_interval
                    new[start:end].add_(grad.reshape(-1))
        self.pull_grads(used=used)

    def reattach_grads(self) -> None:
        """The forward that detached the gradients had no backward (run without
        autograd): the old sharded gradient is the flat parameter's again."""
        if not self._detached:
            return
        self._detached = False
        before, self._before = self._before, None
        if self.flat.grad is None:
            self.flat.grad = before
            self._exposed_from = before


class WrapperViews:
    """Per-parameter views the wrapper itself keeps and places (torch FSDP with
    ``use_orig_params=True``); every placement and gradient call is a no-op."""

    def __init__(self, views: Sequence[nn.Parameter]) -> None:
        self.views = tuple(views)
        self.shown = Shown.VIEWS

    def show(self) -> None:
        self.shown = Shown.VIEWS

    def hide(self) -> None:
        self.shown = Shown.WRAPPER

    def rebind(self, local_shard: torch.Tensor) -> None:
        pass

    def push_grads(self) -> None:
        pass

    def pull_grads(self, used: Sequence[bool] | None) -> None:
        pass

    # torch keeps the gradients and writes parameters back itself (use_orig_params).
    def detach_grads(self) -> None:
        pass

    def combine_grads(self, used: Sequence[bool]) -> None:
        pass

    def reattach_grads(self) -> None:
        pass

    def write_back(
        self, names: Sequence[str], *, replace: bool = True
    ) -> list[tuple[int, nn.Parameter]]:
        return []
