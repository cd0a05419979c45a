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
from typing import Any

import torch
from torch import nn

from flatview.errors import FlatViewError
from flatview.layout import FlatLayout, Piece, PieceKind
from flatview.view_grads import ViewGrads, piece_of


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

    Per-step work is kept to what the step must change: the places the views are
    shown at are resolved once (:meth:`show`, :meth:`hide`), writes through views are
    looked for with one comparison per view (:meth:`write_back`), and the gradients
    (:class:`~flatview.view_grads.ViewGrads`) are cut once per gradient storage; an empty
    view gets no gradient.
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
        self.grads = ViewGrads(flat, layout, self.pieces, self.views)
        """The views' gradients, kept in agreement with the sharded gradient."""
        self.shown = Shown.WRAPPER
        self._slots: tuple[tuple[dict[str, Any], dict[str, Any], str, nn.Parameter], ...] = ()
        self._place_slots()

    def _place_slots(self) -> None:
        """Per place a view is shown at: the owner's instance dict, its registered
        parameters, the attribute and the view (what :meth:`show` and :meth:`hide` touch
        every step, resolved once)."""
        self._slots = tuple(
            (owner.module.__dict__, owner.module._parameters, owner.attr, view)
            for view, owners in zip(self.views, self.owners, strict=True)
            for owner in owners
        )

    def _piece_of(self, tensor: torch.Tensor, piece: Piece) -> torch.Tensor:
        return piece_of(tensor, piece, self.layout)

    # ----------------------------------------------------------------- placement

    def show(self) -> None:
        """Register the views on their submodules, replacing what the wrapper put there."""
        assert self.shown is Shown.WRAPPER, self.shown
        self.flat_owner.module._parameters.pop(self.flat_owner.attr, None)
        for instance, params, attr, view in self._slots:
            # The wrapper leaves plain tensors as instance attributes, which would
            # shadow a registered parameter.
            instance.pop(attr, None)
            # In the place of a parameter the wrapper registered there (DeepSpeed's),
            # so that the module's parameter order stays the model's.
            params[attr] = view
        self.shown = Shown.VIEWS

    def hide(self) -> None:
        """Step aside so the wrapper can set its own tensors under the original names."""
        assert self.shown is Shown.VIEWS, self.shown
        for _, params, attr, _ in self._slots:
            params.pop(attr, None)
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

    def _untouched(self) -> bool:
        """Whether every view is where it was bound, and (shown) registered at all its
        places: nothing to write back (the per-step check, in as few Python steps as
        possible)."""
        if [view.data_ptr() for view in self.views] != self._bound_ptrs:
            return False
        if self.shown is not Shown.VIEWS:
            return True
        return all(params.get(attr) is view for _, params, attr, view in self._slots)

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
        if self._untouched():
            return []
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
        if replaced:
            self._place_slots()
            self.grads.views = self.views
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

    # ----------------------------------------------------------------- gradients

    def push_grads(self) -> None:
        """Make the sharded gradient agree with the view gradients (:meth:`ViewGrads.push`)."""
        self.grads.push()

    def pull_grads(self, used: tuple[bool, ...] | None) -> None:
        """Hand each view its piece of the sharded gradient (:meth:`ViewGrads.pull`)."""
        self.grads.pull(used)

    def detach_grads(self) -> None:
        """A forward starts (:meth:`ViewGrads.detach`)."""
        self.grads.detach()

    def combine_grads(self, used: tuple[bool, ...]) -> None:
        """A synchronising backward ended (:meth:`ViewGrads.combine`)."""
        self.grads.combine(used)

    def reattach_grads(self) -> None:
        """The forward had no backward (:meth:`ViewGrads.reattach`)."""
        self.grads.reattach()


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

    def pull_grads(self, used: tuple[bool, ...] | None) -> None:
        pass

    # torch keeps the gradients and writes parameters back itself (use_orig_params).
    def detach_grads(self) -> None:
        pass

    def combine_grads(self, used: tuple[bool, ...]) -> None:
        pass

    def reattach_grads(self) -> None:
        pass

    def write_back(
        self, names: Sequence[str], *, replace: bool = True
    ) -> list[tuple[int, nn.Parameter]]:
        return []
