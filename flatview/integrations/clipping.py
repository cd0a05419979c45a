"""Gradient clipping by norm where a framework would take the norm of this rank's pieces.

Lightning's precision plugins and accelerate's ``clip_grad_norm_`` (outside the one case
each hands to FSDP itself) call ``torch.nn.utils.clip_grad_norm_`` on the parameters
they are given. Over flatview's views of a sharded wrapper that is the norm of this
rank's pieces: each rank clips by a different, too small norm. Over whole parameters
(DDP, ``NO_SHARD``, one rank) it is the norm of the whole gradients, already exact.

:func:`clips_locally` says which case a parameter list is, the same on every rank (it
asks the layout, not this rank's pieces); :func:`clip_whole` clips by the norm of the
whole gradients (:meth:`flatview.FlatView.clip_grad_norm_`, one all-reduce).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from flatview.errors import OptimStateError
from flatview.handle import FlatView


def clips_locally(fv: FlatView, params: Iterable[torch.Tensor]) -> bool:
    """Whether torch's ``clip_grad_norm_`` over ``params`` would miss elements other ranks
    hold: some parameter of ``fv`` among them is sharded across ranks."""
    for param in params:
        try:
            placement = fv.placement(param)
        except OptimStateError:
            continue  # not one of this model's parameters: torch's norm sees it whole
        if placement.sharded:
            return True
    return False


def clip_whole(
    fv: FlatView, params: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Clip ``params``' gradients by the norm of the whole gradients, as torch's
    ``clip_grad_norm_`` does on the unwrapped model; the total norm before clipping.

    A collective: every rank calls it with the same parameters (its own pieces of
    them). Raises :class:`~flatview.errors.NormError` (on every rank) if ``params``
    holds a tensor that is not one of ``fv``'s parameters."""
    # Parameters without a gradient (skipped, frozen) count as zeros, as torch's do.
    return fv.clip_grad_norm_(float(max_norm), float(norm_type), list(params))
