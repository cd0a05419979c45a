"""torch FSDP1 units that took no part in a backward, settled as their own post-backward
would have (:func:`flatview.backends.unit_tree.settle_units` runs it over the units).

A unit that took no part still has ``handle._training_state`` other than
``BACKWARD_POST`` at ``next_iter``: what earlier ``no_sync()`` micro-batches accumulated
for it is reduced as its own post-backward hook would have, and ``SHARD_GRAD_OP``, which
frees a unit's unsharded flat parameter only in that unit's post-backward (a skipped unit
kept it from an earlier forward, stale after the next optimizer step:
:meth:`UnitSettling.holds_stale_unsharded`), is made to free it. What forwards without a
backward leave unsharded is freed before the next forward that trains
(:meth:`UnitSettling.release_unsharded`, :mod:`flatview.leftovers`).

A unit whose pre-backward ran but which torch gave no post-backward hook (several forwards
before their backwards: :meth:`UnitSettling.missed_post_backward`) is refused with a
:class:`~flatview.errors.StateError` naming the pattern. torch privates read for it (torch
versions gated by :mod:`flatview.backends.torch_versions`): the flat parameter's
``_post_backward_hook_handle`` / ``_post_backward_hook_state`` (set in a forward, removed
when torch finalises a backward) and ``HandleTrainingState.BACKWARD_PRE``."""

from __future__ import annotations

from typing import Any

from flatview.backends.base import Runtime
from flatview.errors import StateError


class UnitSettling:
    """What torch's post-backward does for one unit, for units that skipped it."""

    def __init__(self, runtime: Runtime) -> None:
        from torch.distributed.fsdp import _runtime_utils
        from torch.distributed.fsdp._common_utils import HandleTrainingState, TrainingState

        self.runtime = runtime
        self._fsdp_runtime = _runtime_utils
        self._forward_backward = TrainingState.FORWARD_BACKWARD
        self._backward_pre = HandleTrainingState.BACKWARD_PRE
        self._backward_post = HandleTrainingState.BACKWARD_POST

    def took_part(self, unit: Any, synced: bool) -> bool:
        """Whether ``unit`` ran its post-backward in this backward, or has nothing to train."""
        handle = unit._handle
        return (
            handle is None
            or not handle.flat_param.requires_grad
            or handle._training_state is self._backward_post
        )

    def missed_post_backward(self, unit: Any) -> bool:
        """Whether ``unit``'s pre-backward hook ran in this backward while torch had no
        post-backward hook on its flat parameter: torch removes that hook when it
        finalises a backward and registers it again only in a forward, so the backward
        of a forward that ran before an earlier backward ended (several forwards, then
        their backwards) reaches the parameters with no hook to reduce or finalise their
        gradient (plain torch then fails in a later backward, or trains on a gradient
        never reduced)."""
        handle = unit._handle
        if handle is None or not handle.flat_param.requires_grad:
            return False
        flat = handle.flat_param
        hooked = hasattr(flat, "_post_backward_hook_handle") or hasattr(
            flat, "_post_backward_hook_state"
        )
        return handle._training_state is self._backward_pre and not hooked

    def settle(self, unit: Any, synced: bool) -> None:
        """What ``unit``'s post-backward would have done: start the reduction of what
        earlier ``no_sync()`` micro-batches accumulated for it (``synced``), or free a
        stale unsharded flat parameter."""
        handle = unit._handle
        flat = handle.flat_param
        pending = (
            synced
            and flat.grad is not None
            and (
                not handle.uses_sharded_strategy or flat.grad.shape == flat._unpadded_unsharded_size
            )
            and self.runtime.flat_used_so_far(flat)
        )
        if pending:
            # What the unit's own post-backward hook would have done; torch resets
            # both states when it finalises the unit right after this.
            unit.training_state = self._forward_backward
            handle._training_state = self._backward_pre
            self._fsdp_runtime._post_backward_hook(unit, handle, flat)
        elif self.holds_stale_unsharded(unit, handle):
            self._fsdp_runtime._reshard(unit, handle, True)

    def release_unsharded(self, units: list[tuple[str, Any]]) -> None:
        """Free every unsharded flat parameter the units hold between passes: the root's
        after a forward without backward (``FULL_SHARD`` and hybrid sharding keep it for
        the backward that usually follows), every unit's under ``SHARD_GRAD_OP``. torch's
        next forward would reuse it as gathered (``needs_unshard()`` is false while its
        storage is allocated) however the shard moved since (:mod:`flatview.leftovers`)."""
        for _, unit in units:
            handle = unit._handle
            if handle is not None and _holds_unsharded(handle):
                self._fsdp_runtime._reshard(unit, handle, True)

    def holds_stale_unsharded(self, unit: Any, handle: Any) -> bool:
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
        return _holds_unsharded(handle) and bool(
            self._fsdp_runtime._should_free_in_backward(unit, handle)
        )


def _holds_unsharded(handle: Any) -> bool:
    """Whether a sharded ``handle`` keeps its unsharded flat parameter's storage, which
    torch's next forward then reuses without gathering (``needs_unshard()`` is false)."""
    return bool(handle.uses_sharded_strategy and not handle.needs_unshard())


def forwards_before_backwards(units: list[str]) -> StateError:
    """The error of a backward whose forward ran before an earlier backward ended
    (:meth:`UnitSettling.missed_post_backward` of ``units``)."""
    shown = ", ".join(repr(u or "<root>") for u in units)
    return StateError(
        f"the backward of FSDP unit(s) {shown} ran without torch FSDP1's post-backward "
        "hook: its forward ran before an earlier backward ended (several forwards, then "
        "their backwards: forward, forward, backward, backward, the pipelining pattern), "
        "which torch FSDP1 does not support (torch removes the hook when it finalises a "
        "backward; without flatview it fails later, in its own backward). Run each "
        "forward's backward before the next forward (accumulate with no_sync() between)"
    )
