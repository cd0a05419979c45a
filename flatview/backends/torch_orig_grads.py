"""torch FSDP1 with ``use_orig_params=True``: the gradients torch hands its original
parameters, kept right once a step skips some of them (:class:`OrigParamGrads`).

* torch hands every original parameter of a reduced flat parameter its piece of the
  sharded gradient, zeros for skipped ones: those skipped since the ``no_sync()`` window
  opened that had no gradient then are given ``None`` back
  (:meth:`OrigParamGrads.restore_none_grads`).
* torch marks a parameter whose ``.grad`` it finds ``None`` while the flat gradient
  exists (``flat._is_grad_none_mask``), and clears the marks only in a synchronising
  backward: a parameter handed ``None`` would lose what ``no_sync()`` accumulated for it
  (:meth:`OrigParamGrads.unmark_accumulated_grads`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from typing import Any

import torch

from flatview.backends.base import Runtime
from flatview.states import Transitions


class Note(enum.Enum):
    """Whether the note of which original parameters have no gradient is to be taken
    again at the next backward's first gradient preparation."""

    TAKEN = "taken, and holds for the window"
    RETAKE_AT_BACKWARD = "taken at the forward; taken again at the window's first backward"


_NOTE_MOVES = {
    Note.TAKEN: (Note.RETAKE_AT_BACKWARD,),
    Note.RETAKE_AT_BACKWARD: (Note.RETAKE_AT_BACKWARD, Note.TAKEN),
}


class OrigParamGrads:
    """The original parameters' gradients of the units whose handle uses original
    parameters (see the module docstring); ``units``: ``(name, unit)``, root first."""

    def __init__(self, units: list[tuple[str, Any]], runtime: Runtime) -> None:
        self.units = units
        self.runtime = runtime
        # Those that had no gradient when the first forward since the last synchronising
        # backward began get None back (see restore_none_grads).
        self._none_before: set[int] = set()
        # Taken again at the window's first backward: a zero_grad between the forward
        # and its backward decides which parameters had no gradient.
        self._note = Transitions(Note.TAKEN, _NOTE_MOVES)
        self._masked: list[tuple[Any, int]] = []

    def window_opens(self) -> None:
        """A root forward outside a ``no_sync()`` window: note which original parameters
        have no gradient (again at the first backward), and forget the marks of the
        last window."""
        self._note_none_grads()
        self._note.move(Note.RETAKE_AT_BACKWARD)
        self._forget_masks()

    def _forget_masks(self) -> None:
        """torch re-derives the mask from the gradients it finds (and resets it only
        after a synchronising backward): a stale entry would make it drop what
        no_sync() accumulates for that parameter."""
        for flat, index in self._masked:
            flat._is_grad_none_mask[index] = False
        self._masked.clear()

    def _note_none_grads(self) -> None:
        self._none_before = {
            id(p) for flat in self._wrapper_flats() for p in flat._params if p.grad is None
        }

    def noting_none(self, original: Callable[[], None]) -> Callable[[], None]:
        """torch's pre-backward preparation of a flat gradient, after noting (at the first
        of a window's backward) which original parameters have no gradient then."""

        def prepare_gradient_for_backward() -> None:
            if self._note.state is Note.RETAKE_AT_BACKWARD:
                self._note.move(Note.TAKEN)
                self._note_none_grads()
            original()

        return prepare_gradient_for_backward

    def _wrapper_flats(self) -> Iterator[Any]:
        for _, unit in self.units:
            handle = unit._handle
            if handle is not None and handle._use_orig_params:
                yield handle.flat_param

    def unmark_accumulated_grads(self) -> None:
        """After a ``no_sync()`` backward, clear torch's "gradient is None" mark of the
        original parameters used since the window opened.

        With ``use_orig_params=True`` torch marks a parameter whose ``.grad`` it finds
        ``None`` while the flat gradient exists (which :meth:`restore_none_grads`, or
        per-submodule optimizers zeroing differently, leave behind), and clears the mark
        only in a synchronising backward. Until then every reshard hands the parameter
        ``None`` again and the next unshard zeroes its part of the flat gradient: what
        the earlier micro-batches accumulated for it would be lost. A parameter used in
        the window received a gradient, so it is unmarked, as torch's own post-backward
        does for every parameter it reduces.
        """
        for flat in self._wrapper_flats():
            plan = self.runtime.reduction_plan(flat)
            if plan is None:
                continue
            for index, used in enumerate(plan.used):
                if used:
                    flat._is_grad_none_mask[index] = False

    @torch.no_grad()
    def restore_none_grads(self) -> None:
        """With ``use_orig_params=True`` torch hands every original parameter of a reduced
        flat parameter its piece of the sharded gradient, zeros for skipped ones: give
        back ``None`` to those skipped since the window opened that had none then."""
        for flat in self._wrapper_flats():
            plan = self.runtime.reduction_plan(flat)
            if plan is None or plan.all_used:
                continue
            tied = [
                (id(prim_module), prim_attr, param)
                for (_, _, _, prim_attr, prim_module, _), param in zip(
                    flat._shared_param_infos, flat._shared_params, strict=True
                )
            ]
            for index, (used, param, info) in enumerate(
                zip(plan.used, flat._params, flat._param_infos, strict=True)
            ):
                if used or id(param) not in self._none_before:
                    continue
                param.grad = None
                # So that torch keeps it None when it hands out gradients again before
                # the next forward (state_dict, summon_full_params).
                flat._is_grad_none_mask[index] = True
                self._masked.append((flat, index))
                attr, module, _ = info
                for prim_id, prim_attr, other in tied:
                    if prim_id == id(module) and prim_attr == attr:
                        other.grad = None
