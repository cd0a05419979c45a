"""fairscale units that took no part in a backward, settled as fairscale's final
callback expects (:func:`flatview.backends.unit_tree.settle_units` runs it over the
units), and the CPU gradient buffers of parameters no rank reduced.

The root queues ``_wait_for_post_backward`` once per backward; it asserts that every unit
with trainable parameters fired its post-backward hook, which a unit that did not run
cannot do (fairscale crashes there when a nested unit is skipped: ``expected to be in
states [BACKWARD_POST] but current state is IDLE``, or ``'FlatParameter' object has no
attribute '_full_param_padded'`` in the very first iteration)."""

from __future__ import annotations

from typing import Any

import torch

from flatview.backends.base import Runtime


class UnitSettling:
    """What fairscale's post-backward does for one unit, for units that skipped it;
    ``states``: fairscale's ``TrainingState`` enum."""

    def __init__(
        self, root: Any, units: list[tuple[str, Any]], states: Any, runtime: Runtime
    ) -> None:
        self.root = root
        self.units = units
        self._states = states
        self.runtime = runtime

    def took_part(self, unit: Any, synced: bool) -> bool:
        """Whether ``unit`` ran its post-backward in this backward, or has nothing to
        train; every unit's parameters that no gradient reached are resharded here."""
        trainable = [p for p in unit.params if p.requires_grad]
        # Every unit, whether it took part or not: parameters no gradient reached.
        self._reshard_unreached(unit, trainable, synced)
        return not trainable or unit.training_state is self._states.BACKWARD_POST

    def settle(self, unit: Any, synced: bool) -> None:
        """Bring ``unit`` to the state fairscale's final callback expects: its lazily
        created attributes initialised, and what earlier ``no_sync()`` micro-batches
        accumulated for it sent to the reduction (``synced``)."""
        for p in unit.params:
            unit._init_param_attributes(p)
        # Gradients accumulated under no_sync() in earlier micro-batches still need
        # their reduction, which the unit's own hook would have started.
        pending = [
            p
            for p in unit.params
            if p.requires_grad
            and synced
            and p._is_sharded
            and p.grad is not None
            and p.grad.shape == p._orig_size
            and self.runtime.flat_used_so_far(p)
        ]
        if pending:
            unit.training_state = self._states.BACKWARD_PRE
            for p in pending:
                unit._post_backward_hook(p)
        unit.training_state = self._states.BACKWARD_POST

    @torch.no_grad()
    def keep_cpu_grads_of_unreduced(self) -> None:
        """With ``move_grads_to_cpu`` fairscale's final callback hands every parameter its
        CPU gradient buffer (``p.grad = p._cpu_grad``), which only a reduction refreshes:
        one that no rank reduces in this backward (skipped) would get whatever an earlier
        step left there. Make the buffer what the parameter's gradient is now (zeros for
        ``None``: the views keep ``None``)."""
        if not bool(self.root._require_backward_grad_sync):
            return
        plain_used = self.runtime.plain_used()
        for _, unit in self.units:
            for p in unit.params:
                buffer = getattr(p, "_cpu_grad", None)
                if buffer is None or not p.requires_grad:
                    continue
                index = self.runtime.index_of(p)
                if self.runtime.flat_used_so_far(p) or (index is not None and index in plain_used):
                    continue
                if p.grad is None:
                    buffer.zero_()
                elif p.grad is not buffer and p.grad.shape == buffer.shape:
                    buffer.copy_(p.grad)

    def release_unsharded(self) -> None:
        """Free the full parameters units hold between passes (the root's after a forward
        without backward, every unit's with ``reshard_after_forward=False``; the
        low-precision copy of a unit not sharded, at world size 1): fairscale's next
        forward would reuse them (``has_full_params``) however the fp32 shards moved
        since (:mod:`flatview.leftovers`)."""
        for _, unit in self.units:
            if not unit.has_full_params:
                continue
            unit._free_full_params()
            if unit.mixed_precision or unit.move_params_to_cpu:
                unit._free_fp16_param_shard()
            unit._use_fp32_param_shard()

    @staticmethod
    def _reshard_unreached(unit: Any, params: list[Any], synced: bool) -> None:
        """A parameter no gradient reached (skipped, in a unit that ran) never got its
        post-backward hook, which frees the full copy and points ``.data`` back at the
        fp32 shard; fairscale's final callback does that for non-root units only. Do what
        the hook would have done."""
        for p in params:
            shard = getattr(p, "_fp32_shard", None)
            if shard is None or p.data.data_ptr() == shard.data_ptr():
                continue
            if synced or unit.reshard_after_forward:
                unit._free_full_params([p])
            if unit.mixed_precision:
                unit._free_fp16_param_shard([p])
            unit._use_fp32_param_shard([p])
