"""Clipping gradients by their global norm over whole parameters (what
:meth:`flatview.FlatView.clip_grad_norm_` does): the total of the whole norms
:func:`flatview.norms.grad_norms` takes, computed the same on every rank, every
gradient scaled as ``torch.nn.utils.clip_grad_norm_`` scales it on the unwrapped model.

With expert units on process groups of their own, ranks of different expert groups hold
different experts under the same names: the total then covers the shared parameters
and the experts of every group, each group's counted once, so that every rank clips
the shared gradients alike, by the norm the unwrapped model holding every group's
experts would clip by.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from flatview.comm.norms import reduce_within
from flatview.errors import NormError
from flatview.norms import ParamSelection, check_norm_type, checked_everywhere, grad_norms, select

if TYPE_CHECKING:
    from flatview.runtime import Runtime


def clip_grad_norm(
    rt: Runtime,
    max_norm: float,
    norm_type: float,
    params: ParamSelection,
    *,
    error_if_nonfinite: bool,
) -> torch.Tensor:
    """See :meth:`flatview.FlatView.clip_grad_norm_`."""
    # Refused on one rank, refused on every rank: the others are about to all-reduce.
    with checked_everywhere(rt):
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
            raise NormError(f"max_norm must be a number, got {type(max_norm).__name__}")
        if not max_norm >= 0:
            # inf is fine (measure without clipping); nan would scale by nan.
            raise NormError(f"max_norm must be non-negative, got {max_norm}")
        p = check_norm_type(norm_type)
        indices = select(rt.table, params)
    found = grad_norms(rt, params, p)
    own = {rt.table.name(i) for i in rt.table.own_group_params}
    total = _total([n for name, n in found.items() if n is not None and name not in own], p, rt)
    if own:
        experts = [n for name, n in found.items() if n is not None and name in own]
        total = _with_every_groups_experts(rt, total, experts, p)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise NormError(
            f"the total {p}-norm of the gradients is {total.item()}: not finite "
            "(error_if_nonfinite=True)"
        )
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for index in indices:
        grad = rt.table.tensor(index).grad
        if grad is not None:
            grad.mul_(scale.to(grad.device, grad.dtype))
    return total


def _total(norms: list[torch.Tensor], p: float, rt: Runtime) -> torch.Tensor:
    """The ``p``-norm of parameters of whole norms ``norms`` (zero for none)."""
    if not norms:
        return torch.zeros((), device=rt.adapter.device)
    stacked = torch.stack(norms)
    return stacked.max() if math.isinf(p) else torch.linalg.vector_norm(stacked, p)


def _with_every_groups_experts(
    rt: Runtime, shared: torch.Tensor, experts: list[torch.Tensor], p: float
) -> torch.Tensor:
    """The total norm over the shared parameters (``shared``: their total, the same on
    every rank) and the experts of every expert group (``experts``: this group's, whole;
    other groups hold other experts under the same names): what the unwrapped model
    holding every group's experts clips by, the same on every rank. Each group's total
    is sent by its first rank alone, so that it counts once, in one all-reduce over
    every rank (a maximum for ``inf``)."""
    group = rt.table.expert_group
    assert group is not None
    maximum = math.isinf(p)
    mine = _total(experts, p, rt)
    if group.rank != 0:
        mine = torch.zeros_like(mine)
    share = (mine if maximum else mine.pow(p)).reshape(1)
    every = reduce_within(share, rt.adapter.agreement_group, maximum, rt.ledger)[0]
    if maximum:
        return torch.maximum(shared, every.to(shared.dtype))
    return (shared.pow(p) + every.to(shared.dtype)).pow(1.0 / p)
