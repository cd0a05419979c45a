"""torch FSDP1 units that took no part in a backward, settled as their own post-backward
would have (:func:`flatview.backends.unit_tree.settle_units` runs it over the units).

A unit that took no part still has ``handle._training_state`` other than
``BACKWARD_POST`` at ``next_iter``: what earlier ``no_sync()`` micro-batches accumulated
for it is reduced as its own post-backward hook would have, and ``SHARD_GRAD_OP``, which
frees a unit's unsharded flat parameter only in that unit's post-backward (a skipped unit
kept it from an earlier forward, stale after the next optimizer step:
:meth:`UnitSettling.holds_stale_unsharded`), is made to free it."""

from __future__ import annotations

from typing import Any

from flatview.backends.base import Runtime


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
        return (
            handle.uses_sharded_strategy
            and not handle.needs_unshard()
            and bool(self._fsdp_runtime._should_free_in_backward(unit, handle))
        )
