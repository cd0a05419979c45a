"""One ``FlatView.step`` per batch, entered and left from a framework's hooks.

A training framework runs the forward and the backward of a batch inside its own loop;
what it offers users are hooks before and after (Lightning's ``on_train_batch_start``,
``on_after_backward``, ``on_train_batch_end``, ``on_exception``). :class:`BatchSteps`
enters the step in the first and leaves it in the last, so that the forward and backward
in between run inside it, and the step is left however the batch ends (an exception
abandons the iteration, as leaving ``with fv.step()`` by an exception does).

After every backward it checks that flatview saw that backward through (:meth:`after_backward`):
a backward whose forward never reached the wrapper, or one that ran while the wrapper's
forward was still running (Lightning runs ``training_step`` inside DDP's forward), would
leave its gradients unreduced and each rank would step on its own. Both are raised, on
every rank alike (every rank runs the same code), before the optimizer steps.

Skip sets name parameters and modules relative to the user's module (the
LightningModule); where the wrapped model is not that module, names are mapped
(:class:`Scope`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
from torch import nn

from flatview.errors import SkipSetError, StateError
from flatview.handle import FlatView
from flatview.phase import Phase
from flatview.skip import SkipSet

StepOf: TypeAlias = Callable[[SkipSet], contextlib.AbstractContextManager[Any]]
"""Makes a batch's step from its skip set (names already mapped to the wrapped model)."""


@dataclass(frozen=True)
class Scope:
    """How names relative to the user's module become names of the wrapped model: the
    user's module sits in the wrapped model at path ``inside`` (DDP around a
    LightningModule: ``""``), or the wrapped model sits in the user's module at path
    ``around`` (FSDP2 sharding ``self.model`` of a LightningModule: ``"model"``)."""

    inside: str = ""
    around: str = ""

    def name(self, name: str) -> str:
        """``name`` (relative to the user's module) as the wrapped model names it."""
        if self.around:
            if not name.startswith(self.around + "."):
                raise SkipSetError(
                    f"skip set names {name!r}, which is not inside {self.around!r}, the "
                    "module flatview wraps (the only one whose parameters it can skip)"
                )
            return name[len(self.around) + 1 :]
        return f"{self.inside}.{name}" if self.inside else name

    def skip(self, skip: SkipSet) -> SkipSet:
        """``skip`` with every name mapped (modules and tensors stay as they are)."""
        if skip is None or (not self.inside and not self.around):
            return skip
        if isinstance(skip, str):
            return self.name(skip)
        if isinstance(skip, (nn.Module, torch.Tensor)) or not isinstance(skip, Iterable):
            return skip  # resolved by identity; anything else is refused by the resolver
        return [self.name(item) if isinstance(item, str) else item for item in skip]


def scope_of(fv: FlatView, module: nn.Module) -> Scope:
    """The :class:`Scope` of the user's ``module`` and ``fv``'s model (which holds it,
    or which it holds); names are taken as they are when neither holds the other."""
    for name, candidate in fv.model.named_modules():
        if candidate is module:
            return Scope(inside=fv.adapter.clean_name(name))
    for name, candidate in module.named_modules():
        if candidate is fv.model:
            return Scope(around=name)
    return Scope()


class BatchSteps:
    """Enters and leaves ``fv.step`` around each batch, and checks each backward.

    Args:
        fv: the wrapped model.
        scope: how names relative to the user's module map to ``fv``'s (:func:`scope_of`).
    """

    def __init__(self, fv: FlatView, scope: Scope | None = None) -> None:
        self.fv = fv
        self.scope = scope if scope is not None else Scope()
        self._step: contextlib.AbstractContextManager[Any] | None = None
        self._forwards = 0
        self._hook = fv.model.register_forward_pre_hook(self._count_forward)

    @property
    def open(self) -> bool:
        """Whether a step entered by :meth:`enter` is in force."""
        return self._step is not None

    def _count_forward(self, module: nn.Module, args: Any) -> None:
        self._forwards += 1

    def begin_batch(self) -> None:
        """A batch starts: forwards are counted from here."""
        self._forwards = 0

    def enter(self, skip: SkipSet, step_of: StepOf | None = None) -> None:
        """Enter ``fv.step(skip=...)`` (names relative to the user's module), or what
        ``step_of`` makes of the mapped skip set (a layer drop's step)."""
        if self._step is not None:
            self.leave()  # the last batch ended without its end hook (it was skipped)
        mapped = self.scope.skip(skip)
        step = self.fv.step(skip=mapped) if step_of is None else step_of(mapped)
        step.__enter__()
        self._step = step

    def after_backward(self) -> None:
        """A backward ran: raise unless its forward went through the wrapper, and
        flatview saw the backward end (its gradients were reduced)."""
        forwards, self._forwards = self._forwards, 0
        if self.fv.phase is Phase.COMPUTING:
            raise StateError(
                "a backward ran while the wrapped model's forward was still running (the "
                "loss was computed and backpropagated inside the wrapper's forward): "
                "flatview reduces gradients after the forward returns, so these would stay "
                "unreduced. Compute the loss from the output of the model's forward "
                "(self(...) in training_step) and backpropagate it after that forward "
                "returned"
            )
        if forwards == 0:
            raise StateError(
                "a backward ran, but no forward of the wrapped model ran before it in this "
                "batch: its gradients would not be reduced. Compute the loss through the "
                "model's forward (self(...) in a LightningModule's training_step), not by "
                "calling its submodules directly"
            )

    def leave(self, error: BaseException | None = None) -> None:
        """Leave the step in force (if any); with ``error``, as the body raising it."""
        step, self._step = self._step, None
        if step is None:
            return
        if error is None:
            step.__exit__(None, None, None)
            return
        try:
            step.__exit__(type(error), error, error.__traceback__)
        except BaseException as raised:
            if raised is not error:
                raise

    def remove(self) -> None:
        """Leave the step in force and stop counting forwards."""
        self.leave()
        self._hook.remove()
