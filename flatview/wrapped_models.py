"""The models flatview wraps, process-wide: wrapped modules, live models, stale views, and the
one optimizer step pre-hook that checks optimizers against them.

* Every FSDP unit of a wrapped model maps to its handle, weakly: the model keeps its
  handle (:func:`register`), and a dropped model is freed (:func:`check_not_wrapped`
  refuses wrapping a unit twice).
* Every live model registers a :class:`Watcher`; before an optimizer's step (once per
  optimizer until its parameters or the set of wrapped models change) each watcher
  checks it (:meth:`Watcher.check_optimizer`) and warns about shape-decided groups.
* Views of unwrapped models that the model no longer holds are *stale*, as are the
  tensors a wrapper lent for a summoning that ended: an optimizer holding one raises
  at its step.
* Optimizers that have a history (:func:`has_history`: stepped while a model was
  wrapped, or loaded by flatview): an optimizer without state is fresh only if it has
  none, which decides whether a checkpoint primes it (:mod:`flatview.checkpoint`).

The steady-state cost of the hook is one tuple of ids per group per step (made in C:
``map(id, ...)``): its result is cached per optimizer under a generation number that
wrapping and unwrapping bump.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from flatview.errors import OptimStateError, StateError, WrapError


class Watcher(Protocol):
    """What a live model checks of every optimizer before its first step."""

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Raise if ``optimizer`` cannot train this model as it holds it."""

    def warn_shape_grouping(self, optimizer: torch.optim.Optimizer) -> None:
        """Warn (``stacklevel=4``: the caller of ``optimizer.step``) if its groups look
        decided by view shape."""

    def settled(self) -> bool:
        """Whether checks passed now hold for later steps (not while the model is lent
        to a wrapper operation, where the wrapper's own tensors are the model's)."""


_OWNER = "_flatview_handle"
"""Where a wrapped model keeps its handle (see :func:`register`)."""
_live: weakref.WeakSet[Any] = weakref.WeakSet()
# Unit -> its handle, held weakly both ways: the handle holds its units, so a strong value
# would keep every key alive and no wrapped model would ever be freed (a model dropped
# without unwrap() kept its parameters, gradients and optimizer checks for the process's
# life).
_wrapped: weakref.WeakKeyDictionary[nn.Module, weakref.ref[object]] = weakref.WeakKeyDictionary()
_optimizer_hook: Any = None
_checked: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[object, ...]] = (
    weakref.WeakKeyDictionary()
)
# Tensors the model no longer reads (views of unwrapped models; lent ones, flagged):
# id -> (weak tensor, name, lent).
_stale: dict[int, tuple[weakref.ref[torch.Tensor], str, bool]] = {}
_generation = 0
# Optimizers that stepped or were loaded: their lack of state is not freshness.
_histories: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
# Optimizers flatview builds and steps itself (flatview.optim.Whole's inner one, over its
# own whole copies and aliases of views): the user's optimizer around them is checked.
_own: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def check_not_wrapped(modules: Sequence[nn.Module]) -> None:
    """Refuse modules that belong to a model flatview already wraps."""
    for module in modules:
        owner = wrapping(module)
        if owner is not None:
            raise WrapError(
                f"{type(module).__name__} is already wrapped by {owner!r}; wrap each model once"
            )


def wrapping(module: nn.Module) -> object | None:
    """What wraps ``module`` (one of a wrapped model's units), if anything."""
    ref = _wrapped.get(module)
    return None if ref is None else ref()


def register(
    owner: object, model: nn.Module, modules: Sequence[nn.Module], watcher: Watcher
) -> None:
    """``owner`` wraps ``model``, whose units are ``modules``; ``watcher`` checks
    optimizers for it (held weakly: the owner keeps it alive).

    The model holds its owner (an entry in its instance dictionary) and nothing global
    holds either: the owner, and through it everything flatview installed, lives exactly
    as long as the model, whether or not the user keeps the handle :func:`flatview.wrap`
    returned, and a model dropped without ``unwrap()`` is freed with all of it (the
    hooks torch keeps in C++ hold what they call weakly: :func:`flatview.autograd.weakly`)."""
    vars(model)[_OWNER] = owner
    ref = weakref.ref(owner)
    for module in modules:
        _wrapped[module] = ref
    _live.add(watcher)
    bump_generation()
    _install_optimizer_hook()


def unregister(model: nn.Module, modules: Sequence[nn.Module], watcher: Watcher) -> None:
    """Undo :func:`register` (the model was unwrapped)."""
    vars(model).pop(_OWNER, None)
    for module in modules:
        _wrapped.pop(module, None)
    _live.discard(watcher)


def forget_checks() -> None:
    """A model's parameters changed identity (a view was replaced): check every
    optimizer again."""
    _checked.clear()


def mark_stale(tensor: torch.Tensor, name: str, *, lent: bool = False) -> None:
    """``tensor`` (named ``name``) is one the model no longer reads: a view of an
    unwrapped model, or (``lent``) what the wrapper lent for a summoning that ended."""
    key = id(tensor)

    def forget(_: object) -> None:
        _stale.pop(key, None)

    _stale[key] = (weakref.ref(tensor, forget), name, lent)


def lent_tensor_error(
    optimizer: torch.optim.Optimizer,
    what: str,
    context: str = "summon_full_params() or unflatten_params()",
) -> OptimStateError:
    """The error for ``optimizer`` holding ``what``, a tensor the wrapper lent for the
    length of ``context`` (the first seed's remedy: inside a summoning)."""
    return OptimStateError(
        f"optimizer {type(optimizer).__name__} holds {what}: one the wrapper lent inside "
        f"{context}. The model computes on it there only, and it gets no gradient, so "
        "the step would train nothing. Build the optimizer outside that, from "
        "submodule.parameters() (views, once wrapped) or FlatView.parameters()."
    )


def bump_generation() -> None:
    """A model was wrapped or unwrapped: every optimizer is checked again."""
    global _generation
    _generation += 1


def record_history(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer`` was loaded from a checkpoint: what state it has is its history."""
    _histories.add(optimizer)
    _histories.add(owner(optimizer))


def own_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer`` is one flatview builds and steps itself, over tensors of its own
    (:class:`flatview.optim.Whole`'s inner optimizer): not checked against the models."""
    _own.add(optimizer)


def has_history(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` has stepped since a model was first wrapped, or was loaded
    by flatview: then parameters it holds without state have never had a gradient
    (skipped, or first used later), rather than the optimizer being new."""
    return optimizer in _histories or owner(optimizer) in _histories


def owner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that keeps ``optimizer``'s state and parameter groups as its own
    attributes, and whose step torch's step hooks see: ``optimizer`` itself, or behind
    a wrapper whose class keeps them as properties over the optimizer it wraps in
    ``.optimizer`` (accelerate's ``AcceleratedOptimizer``), that one. A scratch copy of
    the wrapper would write through to the real optimizer, and only the wrapped one's
    steps are recorded (:func:`has_history`)."""
    found = optimizer
    while delegates(type(found)):
        inner = vars(found).get("optimizer")
        if not isinstance(inner, torch.optim.Optimizer):
            break
        found = inner
    return found


def delegates(cls: type) -> bool:
    """Whether optimizers of ``cls`` keep ``state`` or ``param_groups`` as properties."""
    return any(
        isinstance(inspect.getattr_static(cls, name, None), property)
        for name in ("state", "param_groups")
    )


def _install_optimizer_hook() -> None:
    global _optimizer_hook
    if _optimizer_hook is None:
        _optimizer_hook = register_optimizer_step_pre_hook(_before_step)


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    signature = (
        _generation,
        *[tuple(map(id, group["params"])) for group in optimizer.param_groups],
    )
    if _checked.get(optimizer) == signature or optimizer in _own:
        return
    _check_stale(optimizer)
    settled = True
    for watcher in list(_live):
        watcher.check_optimizer(optimizer)
        watcher.warn_shape_grouping(optimizer)
        settled = settled and watcher.settled()
    if settled:
        _checked[optimizer] = signature
    _histories.add(optimizer)


def _check_stale(optimizer: torch.optim.Optimizer) -> None:
    if not _stale:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            found = _stale.get(id(p))
            if found is None:
                continue
            ref, name, lent = found
            if ref() is not p:
                del _stale[id(p)]
                continue
            if lent:
                raise lent_tensor_error(optimizer, f"the tensor that stood for {name!r}")
            raise StateError(
                f"optimizer {type(optimizer).__name__} holds the view {name!r} of a model "
                "that FlatView.unwrap() detached: the model no longer reads it, so the "
                "step would train nothing. Build a new optimizer over the model's "
                "parameters (model.parameters(), or a new FlatView's views after wrapping "
                "again)."
            )
