"""Layer-wise adaptive learning rates over views: LARC / LARS with whole-parameter norms.

A torch optimizer over views sees one piece of each parameter, and ``p.norm()`` on a
partial view is the norm of that piece. :class:`LARC` wraps any torch optimizer the way
NVIDIA apex's ``LARC`` does, but takes the norms of whole parameters from
:meth:`flatview.FlatView.param_norms` and :meth:`~flatview.FlatView.grad_norms`: one
all-reduce per step for all of them. :func:`trust_ratios` gives the same local learning
rates for your own optimizer code.

:class:`Coalesced` steps SGD, Adam or AdamW over views at the cost of an optimizer over
a few tensors: neighbouring views of one flat parameter are stepped as one tensor, with
exactly the numbers of the plain optimizer.

:class:`Deferred` stands in for several optimizers that can only be built after
wrapping, where a wrapper takes exactly one when it is built (DeepSpeed's engine).

:func:`param_groups` builds the usual weight-decay groups (no decay for biases, norms and
other ``ndim <= 1`` parameters) by each parameter's original shape: rules that look at
``p.ndim`` see a partial view, which is 1-D.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from flatview import norms
from flatview.coalesced import Coalesced
from flatview.deferred import Deferred
from flatview.whole import Whole

if TYPE_CHECKING:
    from flatview.handle import FlatView

__all__ = ["LARC", "Coalesced", "Deferred", "Whole", "param_and_grad_norms", "trust_ratios"]


def param_groups(
    fv: FlatView,
    weight_decay: float,
    *,
    no_decay: Iterable[str] = (),
    embeddings: bool = False,
    **options: Any,
) -> list[dict[str, Any]]:
    """Optimizer parameter groups with and without weight decay, decided by each
    parameter's original shape and name, so that every rank decides alike.

    The rule of timm's ``param_groups_weight_decay`` (what ``create_optimizer_v2`` uses):
    no decay for parameters of at most one dimension, names ending in ``.bias`` and names
    in ``no_decay``; decay for the rest. Frozen parameters are left out, as timm does.
    Applied to views, timm's rule reads ``p.ndim``, which is 1 for every partial view, so
    it would exempt the pieces of matrices from decay on some ranks and not on others;
    here the dimension is :meth:`FlatView.shape_of`'s.

    Args:
        fv: the wrapped model.
        weight_decay: the decay of the second group.
        no_decay: more parameters without decay: original names (as in
            :meth:`FlatView.named_parameters`), module paths (every parameter under
            them) or ``fnmatch`` patterns (``"*.pos_embed"``); timm's
            ``model.no_weight_decay()`` names fit as they are.
        embeddings: also exempt the weights of ``nn.Embedding`` modules.
        **options: further hyperparameters for both groups (``lr``, ...).

    Returns:
        Two groups for any torch optimizer: the views without decay
        (``"weight_decay": 0.0``) first, then those with ``weight_decay``; ``options`` in
        both.
    """
    patterns = tuple(no_decay)
    embedded: set[int] = set()
    if embeddings:
        for module in fv.model.modules():
            if isinstance(module, nn.Embedding):
                embedded.update(id(p) for p in module._parameters.values() if p is not None)
    exempt: list[nn.Parameter] = []
    decay: list[nn.Parameter] = []
    for name, param in fv.named_parameters():
        if not param.requires_grad:
            continue
        named = any(
            name == pattern or name.startswith(pattern + ".") or fnmatch.fnmatchcase(name, pattern)
            for pattern in patterns
        )
        low = len(fv.shape_of(param)) <= 1
        if low or name.endswith(".bias") or named or id(param) in embedded:
            exempt.append(param)
            if not low:
                # Set apart by name, not by its piece's shape: nothing to warn about.
                fv.exempt_by_name(param)
        else:
            decay.append(param)
    return [
        {**options, "params": exempt, "weight_decay": 0.0},
        {**options, "params": decay, "weight_decay": weight_decay},
    ]


def param_and_grad_norms(
    fv: FlatView, params: norms.ParamSelection = None, *, norm_type: float = 2.0
) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """``(param norm, grad norm)`` of each original parameter in ``params``, by name: what
    :meth:`~flatview.FlatView.param_norms` and :meth:`~flatview.FlatView.grad_norms` give,
    with one all-reduce for both. A collective, like them."""
    p = norms.check_norm_type(norm_type)
    indices = norms.select(fv.table, params)
    norms.check_phase(fv.runtime, "param_and_grad_norms", grads=True)
    columns = [("param", norms.param_column), ("grad", norms.grad_column)]
    rows = norms.whole_norms(fv.runtime, indices, columns, p)
    out = {}
    for index, (weight, grad) in zip(indices, rows, strict=True):
        assert weight is not None
        out[fv.table.name(index)] = (weight, grad)
    return out


def trust_ratios(
    fv: FlatView,
    params: norms.ParamSelection = None,
    *,
    trust_coefficient: float = 0.02,
    weight_decay: float = 0.0,
    eps: float = 1e-8,
) -> dict[str, torch.Tensor | None]:
    """LARC's local learning rate of each original parameter in ``params``, by name:
    ``trust_coefficient * ||w|| / (||g|| + weight_decay * ||w|| + eps)`` over whole
    parameters (2-norms), 1 where either norm is zero, ``None`` where the parameter has
    no gradient. A collective (one all-reduce): every rank calls it with the same
    arguments."""
    out: dict[str, torch.Tensor | None] = {}
    for name, (weight, grad) in param_and_grad_norms(fv, params).items():
        if grad is None:
            out[name] = None
            continue
        ratio = trust_coefficient * weight / (grad + weight_decay * weight + eps)
        out[name] = torch.where((weight != 0) & (grad != 0), ratio, torch.ones_like(ratio))
    return out


class LARC:
    """apex's LARC (layer-wise adaptive rate control) around any torch optimizer over
    views, with the norms of whole parameters.

    Before each ``optimizer.step()``, every parameter with a gradient whose weight and
    gradient norms are both non-zero gets its gradient replaced by
    ``(grad + weight_decay * w) * local_lr``, where ``local_lr = trust_coefficient *
    ||w|| / (||g|| + weight_decay * ||w|| + eps)``, clipped to ``min(local_lr / lr, 1)``
    when ``clip`` (LARC) and used as it is otherwise (LARS-style scaling). Each
    group's ``weight_decay`` is applied here and set to 0 while the wrapped optimizer
    steps, then restored: exactly apex's ``LARC.step``. The norms of all parameters of
    all groups come from one all-reduce, so :meth:`step` is a collective: every rank
    calls it, with an optimizer over the same parameters.

    Args:
        fv: the wrapped model the optimizer's parameters belong to.
        optimizer: any torch optimizer over views or parameters of ``fv``'s model.
        trust_coefficient: LARC's trust coefficient (eta).
        clip: clip the local learning rate at the group's ``lr`` (LARC) or not (LARS).
        eps: added to the denominator.
    """

    def __init__(
        self,
        fv: FlatView,
        optimizer: torch.optim.Optimizer,
        *,
        trust_coefficient: float = 0.02,
        clip: bool = True,
        eps: float = 1e-8,
    ) -> None:
        self.fv = fv
        self.optimizer = optimizer
        self.trust_coefficient = trust_coefficient
        self.clip = clip
        self.eps = eps

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    @torch.no_grad()
    def step(self) -> None:
        """Scale every gradient by its local learning rate, then step the optimizer."""
        groups = self.optimizer.param_groups
        params: list[torch.Tensor] = [p for group in groups for p in group["params"]]
        found = param_and_grad_norms(self.fv, params)
        names = {id(t): name for name, t in self.fv.named_parameters()}
        # One host transfer for all norms (apex reads each one on its own).
        entries = [(name, w, g) for name, (w, g) in found.items() if g is not None]
        values = (
            torch.stack([torch.stack([w, g]) for _, w, g in entries]).tolist() if entries else []
        )
        host = {name: (w, g) for (name, _, _), (w, g) in zip(entries, values, strict=True)}
        decays = []
        for group in groups:
            decay = group.get("weight_decay", 0)
            decays.append(decay)
            group["weight_decay"] = 0
            self._scale(group, decay, [host.get(names[id(p)]) for p in group["params"]])
        try:
            self.optimizer.step()
        finally:
            for group, decay in zip(groups, decays, strict=True):
                group["weight_decay"] = decay

    def _scale(
        self,
        group: dict[str, Any],
        decay: float,
        norms_: Sequence[tuple[float, float] | None],
    ) -> None:
        for param, found in zip(group["params"], norms_, strict=True):
            if found is None or param.grad is None:
                continue
            weight, grad = found
            if weight == 0 or grad == 0:
                continue
            local_lr = self.trust_coefficient * weight / (grad + weight * decay + self.eps)
            if self.clip:
                local_lr = min(local_lr / group["lr"], 1.0)
            param.grad.add_(param, alpha=decay)
            param.grad.mul_(local_lr)

    def __repr__(self) -> str:
        return (
            f"LARC({self.optimizer!r}, trust_coefficient={self.trust_coefficient}, "
            f"clip={self.clip}, eps={self.eps})"
        )
