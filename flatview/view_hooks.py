"""Autograd hooks users register on views: refused where they would never run.

A view aliases this rank's shard of a flat parameter, but the wrapped model computes on
the wrapper's own tensors (the unsharded flat parameter, cut into compute tensors), and
flatview hands each view its gradient piece at the end of the backward by assignment.
So autograd never reaches a view: ``view.register_hook(fn)`` (a gradient transform, say
per-parameter clamping) and ``view.register_post_accumulate_grad_hook(fn)`` (an
optimizer stepped inside the backward) would never run, and training would go on
without them, in silence. Bare FSDP runs a hook on its flat parameter.

Registering one raises at once: :func:`arm` gives each view hook dicts of its own
(torch keeps a tensor's hooks in ``_backward_hooks`` and ``_post_accumulate_grad_hooks``
and registers into them) that refuse an entry, naming the view. Nothing is added to any
step. :func:`refuse_view_hooks` names the views that carry hooks anyway (put there
before the view was armed: a parameter the user set in a view's place). It runs where
flatview looks at the views anyway, off the per-step path: at the first step of a
wrapped model, and before each optimizer's first step (over that optimizer's
parameters). Where the model computes on the views themselves (torch ``NO_SHARD``
computed on views), autograd runs their hooks, and nothing is refused.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import torch

from flatview.backends.base import Adapter
from flatview.errors import StateError
from flatview.table import ParamTable


def refuse_view_hooks(
    table: ParamTable,
    adapter: Adapter,
    indices: Iterable[int] | None = None,
    *,
    first_step: bool = True,
) -> None:
    """Raise :class:`~flatview.errors.StateError` if a view among ``indices`` (every
    parameter by default) carries an autograd hook that would never run; plain
    parameters (the model's own tensors) may. Looks only at a ``first_step``, and only
    where ``adapter`` does not compute on the views."""
    if not first_step or adapter.computes_on_views:
        return
    hooked = []
    for index in range(len(table.params)) if indices is None else indices:
        if not table.own_view(index):
            continue
        view = table.tensor(index)
        if view._backward_hooks or getattr(view, "_post_accumulate_grad_hooks", None):
            hooked.append(table.name(index))
    if hooked:
        raise _refusal(hooked)


def arm(view: torch.Tensor, name: str) -> None:
    """Make registering an autograd hook on ``view`` raise at once, naming ``name`` (a
    view that carries hooks already is left to :func:`refuse_view_hooks`)."""
    if view._backward_hooks is None:
        view._backward_hooks = _Refusing(name)
    if getattr(view, "_post_accumulate_grad_hooks", None) is None:
        view._post_accumulate_grad_hooks = _Refusing(name)


class _Refusing(OrderedDict[Any, Any]):
    """A view's hook dict: empty, and an entry raises (autograd calls it, as any hook
    dict, if a user's own computation reaches the view: it holds nothing to run)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def __setitem__(self, key: Any, value: Any) -> None:
        raise _refusal([self.name])


def _refusal(names: list[str]) -> StateError:
    shown = ", ".join(repr(n) for n in names[:4]) + (", ..." if len(names) > 4 else "")
    return StateError(
        f"autograd hooks are registered on flatview's views ({shown}): the model "
        "computes on the wrapper's unsharded tensors, not on the views, so "
        "register_hook and register_post_accumulate_grad_hook hooks on them would "
        "never run. Transform gradients between the backward and the optimizer step "
        "(each view's .grad is its reduced piece then), or step the optimizers after "
        "the backward"
    )
