"""What flatview asks of autograd's engine, in one place: whether a backward is running
on this thread (a forward then is a recomputation for activation checkpointing, not a new
iteration), a callback run once the whole backward is done, and a gradient hook put on a
tensor for one iteration at less cost than ``Tensor.register_hook``.

The first two are torch internals the adapters check at wrap time
(:func:`flatview.backends.internals.require_autograd_internals`); the hook falls back to
``register_hook`` where the internals it uses are missing."""

from __future__ import annotations

import functools
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle


def in_backward() -> bool:
    """Whether autograd runs a backward on this thread (a forward now recomputes)."""
    return bool(torch._C._current_graph_task_id() != -1)


def at_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the backward running now has finished (every gradient
    accumulated, every hook run)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


_KEY = -1
"""The key of :func:`hook_gradient`'s hook in a tensor's hook dictionary (torch's own
keys count up from 0)."""

Hooked = dict[Any, Any] | RemovableHandle
"""Where :func:`hook_gradient` put a hook: the tensor's hook dictionary, or the handle
``register_hook`` returned."""


@functools.cache
def _direct() -> bool:
    """Whether this torch has the internals :func:`hook_gradient` uses (2.x: a tensor's
    ``_backward_hooks`` and its autograd node's ``_register_hook_dict``)."""
    probe = torch.zeros(1, requires_grad=True).view(1)
    return hasattr(probe, "_backward_hooks") and hasattr(probe.grad_fn, "_register_hook_dict")


def hook_gradient(tensor: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> Hooked:
    """Register ``hook`` on the gradient of ``tensor`` as ``Tensor.register_hook`` does
    (a dictionary of hooks that the tensor's autograd node calls with the gradient), but
    without the handle ``register_hook`` makes per call: the compute tensors of skipped
    parameters get one each per forward (:mod:`flatview.guards`). Through
    ``register_hook`` itself for a tensor of another class (``__torch_function__``, a
    parameter), or without those internals. One such hook per tensor: a second keeps
    the first (which would raise first)."""
    if type(tensor) is not torch.Tensor or not _direct():
        return tensor.register_hook(hook)
    hooks = tensor._backward_hooks
    if hooks is None:
        hooks = tensor._backward_hooks = OrderedDict()
        node = tensor.grad_fn
        if node is not None:
            node._register_hook_dict(tensor)
    hooks.setdefault(_KEY, hook)
    return hooks


def unhook_gradient(hooked: Hooked) -> None:
    """Remove a hook :func:`hook_gradient` put (again: a no-op)."""
    if isinstance(hooked, dict):
        hooked.pop(_KEY, None)
    else:
        hooked.remove()


def weakly(method: Callable[..., Any], arg: Any) -> Callable[[Any], Any]:
    """A hook calling ``method(arg, x)`` with what torch passes it (``x``, a gradient
    or the tensor), holding ``method``'s object weakly: once that is gone the hook does
    nothing (returns ``None``, which leaves a gradient as it is).

    For hooks that torch keeps in C++, on a parameter or a flat parameter: Python's
    collector cannot see through them, so a hook holding flatview's objects, which hold
    the model, which holds the tensor, is a cycle it never frees, and a wrapped model
    dropped without ``unwrap()`` would keep its parameters and gradients for the
    process's life. The model holds its handle (:func:`flatview.wrapped_models.register`),
    and through it what the hooks call, for as long as it lives. One argument bound, not
    ``*args`` (which doubles the cost): 99 ns a call against ``functools.partial``'s 91
    (``weakref.WeakMethod``: 600); on DDP at 4,096 tensors, paired, within the noise."""
    ref = weakref.ref(method.__self__)  # type: ignore[attr-defined]
    func = method.__func__  # type: ignore[attr-defined]

    def call(x: Any) -> Any:
        owner = ref()
        return None if owner is None else func(owner, arg, x)

    return call
