"""Where torch FSDP1's runtime assumes that every unit and parameter takes part in every
step, and what :class:`~flatview.backends.torch_fsdp.TorchFSDPAdapter` (which inherits
these methods) does instead:

* Forward prefetching (``forward_prefetch=True``) follows the pre-forward order of the
  *first* iteration, ``_exec_order_data.handles_pre_forward_order``, through
  ``get_handle_to_forward_prefetch``: with skip sets that change per step it
  all-gathers units the step skips. Backward prefetching follows the post-forward order
  of the current iteration (``handles_post_forward_order``, through
  ``get_handle_to_backward_prefetch``), which holds no skipped unit, except after a
  forward that no backward followed: torch then keeps that forward's order and stale
  ``handle._post_forward_index`` values, and prefetches units the next step skips. Both
  choices are replaced by the same walk with this step's skipped units left out.
* A unit that took no part in a backward still has ``handle._training_state`` other
  than ``BACKWARD_POST`` at ``next_iter``: what earlier ``no_sync()`` micro-batches
  accumulated for it is reduced as its own post-backward hook would have, and
  ``SHARD_GRAD_OP``, which frees a unit's unsharded flat parameter only in that unit's
  post-backward (a skipped unit kept it from an earlier forward, stale after the next
  optimizer step: :meth:`TorchSkipping._holds_stale_unsharded`), is made to free it.
* With ``use_orig_params=True`` torch hands every original parameter of a reduced flat
  parameter its piece of the sharded gradient, zeros for skipped ones (given ``None``
  back: :meth:`TorchSkipping._restore_none_grads`), and clears the
  ``flat._is_grad_none_mask`` marks only in a synchronising backward (a parameter
  handed ``None`` would lose what ``no_sync()`` accumulated for it:
  :meth:`TorchSkipping._unmark_accumulated_grads`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from flatview.backends._fsdp1_shared import UnitAdapter


class TorchSkipping(UnitAdapter):
    """The torch FSDP1 adapter's answers to skipped units and parameters; the adapter
    calls :meth:`_init_skipping` from its ``__init__``."""

    root: Any
    _runtime: Any
    """``torch.distributed.fsdp._runtime_utils``."""
    _handle_unit: dict[int, int]
    """Unit index per handle (by id)."""

    def _init_skipping(self) -> None:
        from torch.distributed.fsdp._common_utils import HandleTrainingState, TrainingState

        self._forward_backward = TrainingState.FORWARD_BACKWARD
        self._backward_pre = HandleTrainingState.BACKWARD_PRE
        self._backward_post = HandleTrainingState.BACKWARD_POST
        self._undeclared: list[str] = []
        # use_orig_params=True: torch gives every original parameter of a reduced flat
        # parameter a gradient, zeros for the skipped ones; those that had none when the
        # first forward since the last synchronising backward began get None back (see
        # _restore_none_grads).
        self._none_before: set[int] = set()
        # Taken again at the window's first backward: a zero_grad between the forward
        # and its backward decides which parameters had no gradient.
        self._none_at_backward = False
        self._masked: list[tuple[Any, int]] = []

        # ------------------------------------------------------------- prefetching

    def _forward_prefetch_target(self, current: Any) -> Any:
        """Torch's forward-prefetch choice (the unit ``limit`` steps ahead in the first
        iteration's order) with the units this step skips left out."""
        order = self.root._exec_order_data
        index = current._pre_forward_order_index
        if index is None:
            return None
        ahead = order.handles_pre_forward_order[index + 1 :]
        return self._prefetch_target(ahead, order._forward_prefetch_limit)

    def _backward_prefetch_target(self, current: Any) -> Any:
        """Torch's backward-prefetch choice (the unit ``limit`` steps back in this
        iteration's post-forward order) with the units this step skips left out.

        The order normally holds only units that ran, but after a forward that no
        backward followed it still holds that forward's units, under stale indices."""
        order = self.root._exec_order_data
        index = current._post_forward_index
        if index is None:
            return None
        behind = order.handles_post_forward_order[index - 1 :: -1] if index > 0 else []
        return self._prefetch_target(behind, order._backward_prefetch_limit)

    def _prefetch_target(self, candidates: list[Any], limit: int) -> Any:
        target = None
        for candidate in candidates:
            if limit <= 0:
                break
            unit = self._handle_unit.get(id(candidate))
            if unit is not None and self.core.unit_skipped(unit):
                continue
            target = candidate
            limit -= 1
        return target

    # ----------------------------------------------- units without backward

    @torch.no_grad()
    def _settle_units_without_backward(self) -> None:
        """Note units that took no part in this backward without being declared skipped,
        and reduce what earlier ``no_sync()`` micro-batches accumulated in units this
        synchronising backward skipped."""
        self._undeclared = self._units_without_backward(bool(self.root._sync_gradients))

    def _took_part(self, unit: Any, synced: bool) -> bool:
        handle = unit._handle
        return (
            handle is None
            or not handle.flat_param.requires_grad
            or handle._training_state is self._backward_post
        )

    def _settle_unit(self, unit: Any, synced: bool) -> None:
        handle = unit._handle
        flat = handle.flat_param
        pending = (
            synced
            and flat.grad is not None
            and (
                not handle.uses_sharded_strategy or flat.grad.shape == flat._unpadded_unsharded_size
            )
            and self.core.flat_used_so_far(flat)
        )
        if pending:
            # What the unit's own post-backward hook would have done; torch resets
            # both states when it finalises the unit right after this.
            unit.training_state = self._forward_backward
            handle._training_state = self._backward_pre
            self._runtime._post_backward_hook(unit, handle, flat)
        elif self._holds_stale_unsharded(unit, handle):
            self._runtime._reshard(unit, handle, True)

    def _holds_stale_unsharded(self, unit: Any, handle: Any) -> bool:
        """Whether a unit that took no part in this backward still holds an unsharded
        flat parameter that torch would have freed in its post-backward.

        After a forward that no backward followed (an evaluation with autograd on),
        ``SHARD_GRAD_OP`` keeps the unsharded storage and points the flat parameter back
        at its shard, so torch's catch-all reshard takes the unit for resharded and
        keeps the storage. The optimizer then moves the shard, and the unit's next
        forward (or a full ``state_dict``) reuses the storage instead of gathering:
        stale parameters. A unit that runs in every backward never gets there; one
        that a skip set leaves out does.
        """
        return (
            handle.uses_sharded_strategy
            and not handle.needs_unshard()
            and bool(self._runtime._should_free_in_backward(unit, handle))
        )

    # ------------------------------------------------ use_orig_params=True

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

    def _noting_none(self, original: Callable[[], None]) -> Callable[[], None]:
        """torch's pre-backward preparation of a flat gradient, after noting (at the first
        of a window's backward) which original parameters have no gradient then."""

        def prepare_gradient_for_backward() -> None:
            if self._none_at_backward:
                self._none_at_backward = False
                self._note_none_grads()
            original()

        return prepare_gradient_for_backward

    def _wrapper_flats(self) -> Iterator[Any]:
        for _, unit in self.units:
            handle = unit._handle
            if handle is not None and handle._use_orig_params:
                yield handle.flat_param

    def _unmark_accumulated_grads(self) -> None:
        """After a ``no_sync()`` backward, clear torch's "gradient is None" mark of the
        original parameters used since the window opened.

        With ``use_orig_params=True`` torch marks a parameter whose ``.grad`` it finds
        ``None`` while the flat gradient exists (which :meth:`_restore_none_grads`, or
        per-submodule optimizers zeroing differently, leave behind), and clears the mark
        only in a synchronising backward. Until then every reshard hands the parameter
        ``None`` again and the next unshard zeroes its part of the flat gradient: what
        the earlier micro-batches accumulated for it would be lost. A parameter used in
        the window received a gradient, so it is unmarked, as torch's own post-backward
        does for every parameter it reduces.
        """
        for flat in self._wrapper_flats():
            plan = self.core.reduction_plan(flat)
            if plan is None:
                continue
            for index, used in enumerate(plan.used):
                if used:
                    flat._is_grad_none_mask[index] = False

    @torch.no_grad()
    def _restore_none_grads(self) -> None:
        """With ``use_orig_params=True`` torch hands every original parameter of a reduced
        flat parameter its piece of the sharded gradient, zeros for skipped ones: give
        back ``None`` to those skipped since the window opened that had none then."""
        for flat in self._wrapper_flats():
            plan = self.core.reduction_plan(flat)
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
