"""Adapter for torch's own ``FullyShardedDataParallel`` (FSDP1, ``torch.distributed.fsdp``).

Where torch keeps things (checked against torch 2.13; everything below is private to
torch, which is why :class:`TorchFSDPAdapter` refuses untested versions):

* Each FSDP unit (a ``FullyShardedDataParallel`` instance) has at most one
  ``FlatParamHandle``, ``unit._handle``, whose ``flat_param`` is a ``FlatParameter``
  registered on the wrapped module (``unit.module``) as ``_flat_param``. Per original
  parameter the flat parameter records ``_param_infos`` (attribute, module, module
  name), ``_shapes``, ``_contiguities``, ``_numels_with_padding`` with
  ``_is_padding_mask`` (alignment padding between parameters, only with
  ``use_orig_params=True``), and tied parameters in ``_shared_param_infos``.
* Sharded strategies split the flat parameter like ``torch.chunk``, padded at its end;
  the full-precision local shard is ``flat._local_shard`` (set at lazy initialisation,
  which :class:`TorchFSDPAdapter` forces; ``flat.data`` points at it between passes).
  ``NO_SHARD`` keeps the whole flat parameter on every rank; with a world size of 1
  torch always uses ``NO_SHARD``.
* A unit's ``forward`` unshards, then sets plain tensor views of the unsharded flat on
  the submodules (deleting whatever is registered under the original names), then calls
  ``unit._fsdp_wrapped_module``, so a forward pre-hook there sees the compute tensors.
* Gradient reduction: the public ``register_comm_hook`` replaces torch's reduction of
  every unit (:mod:`~flatview.backends.torch_fsdp_reduce`).
* After a backward the root's final callback waits for the reductions, calls
  ``next_iter()`` on the execution-order record ``unit._exec_order_data`` (one object
  shared by every unit), and only then finalises each unit (the sharded gradient moves
  from ``flat._saved_grad_shard`` to ``flat.grad``). Wrapping ``next_iter`` on that
  object gives the point "every backward hook ran, nothing finalised yet", like
  fairscale's ``_wait_for_post_backward``. A unit that took no part in the backward
  still has ``handle._training_state`` other than ``BACKWARD_POST`` there.
* The adapter is assembled from components beside this module: what is refused at wrap
  time, torch internals included (:mod:`~flatview.backends.torch_fsdp_checks`), how
  flat parameters become specs (:mod:`~flatview.backends.torch_fsdp_describe`), the
  reduction (:mod:`~flatview.backends.torch_fsdp_reduce`), and where torch assumes that
  every unit takes part in every step: prefetching
  (:mod:`~flatview.backends.torch_fsdp_prefetch`), units without a backward
  (:mod:`~flatview.backends.torch_fsdp_settle`), ``use_orig_params`` gradients
  (:mod:`~flatview.backends.torch_orig_grads`); the summoning brackets
  (:mod:`~flatview.backends.torch_summon`). Hybrid sharding:
  :mod:`~flatview.backends.torch_hybrid`.

Everything this adapter changes is an instance attribute, a hook or a unit's
communication hook, removed by :meth:`TorchFSDPAdapter.uninstall`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from flatview.autograd import at_end_of_backward, in_backward
from flatview.backends.base import Adapter, UnitSpec, end_root_forward
from flatview.backends.compute_tensors import set_directly
from flatview.backends.patches import Patches
from flatview.backends.recast import fsdp1_recasting
from flatview.backends.torch_fsdp_checks import TorchFSDPModel, refuse_comm_hooks
from flatview.backends.torch_fsdp_describe import clean_name, describe_units
from flatview.backends.torch_fsdp_prefetch import PrefetchSteering
from flatview.backends.torch_fsdp_reduce import NO_BUCKETING, WRAPPER, TorchFSDPReduction
from flatview.backends.torch_fsdp_settle import UnitSettling, forwards_before_backwards
from flatview.backends.torch_orig_grads import OrigParamGrads
from flatview.backends.torch_summon import SummonLending, summonable, summoning
from flatview.backends.unit_tree import (
    hook_unfinished,
    label,
    lending_methods,
    settle_units,
    undeclared_units,
)
from flatview.comm.options import ReduceOptions

if TYPE_CHECKING:
    from flatview.backends.base import Runtime

_SAFE_SETATTR: Any = None
"""torch's default way of setting compute tensors on the submodules (2.13), if found."""
try:
    from torch.distributed.fsdp._flat_param import _safe_setattr_tensor_or_param

    _SAFE_SETATTR = _safe_setattr_tensor_or_param
except ImportError:  # another torch: its own is left as it is
    pass


def _setattr_stepped_aside(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """torch's ``_safe_setattr_tensor_or_param`` (delete what is there, then set through
    ``nn.Module``'s checks), in one store where that is what they come to
    (:mod:`~flatview.backends.compute_tensors`); with the views stepped aside its
    ``hasattr`` would also raise and catch an ``AttributeError`` per tensor."""
    if set_directly(module, name, tensor):
        return
    if hasattr(module, name):
        delattr(module, name)
    setattr(module, name, tensor)


class TorchFSDPAdapter(Adapter):
    """Maps the flatview runtime onto one torch FSDP1 model (root and nested units),
    driving torch's own unit runtime."""

    backend = "torch"
    clean_name = staticmethod(clean_name)
    flattens = True

    def __init__(self, model: TorchFSDPModel, options: ReduceOptions) -> None:
        from torch.distributed.fsdp import _runtime_utils
        from torch.distributed.fsdp._common_utils import HandleTrainingState, TrainingState

        self.model = model
        self.options = options
        self.root: Any = model.root
        self.units = model.units
        self.group = model.group
        self.rank = model.rank
        self.world_size = model.world_size
        self.device = model.device
        self.replicas = model.replicas
        self.bucket_numel = NO_BUCKETING
        # NO_SHARD everywhere: forward and backward gather nothing, and the only
        # gradient collectives are flatview's (reduce, next_iter), which settle the
        # skip-set check first; so it can run alongside the forward.
        self.overlaps_agreement = model.replicates
        self._fsdp_runtime = _runtime_utils
        self._idle = TrainingState.IDLE
        self._handle_idle = HandleTrainingState.IDLE
        self._handle_unit: dict[int, int] = {
            id(unit._handle): i for i, (_, unit) in enumerate(self.units) if unit._handle
        }
        self._patches = Patches()
        self._summon = SummonLending(self._lend)
        self._grads_at_forward: list[tuple[Any, torch.Tensor | None]] = []
        # Units that took no part in the backward, undeclared: raised at its end.
        self._undeclared: list[str] = []

    def describe(self) -> list[UnitSpec]:
        return describe_units(self.units, self.root, self.model.groups)

    def _lend(self) -> Any:
        return self.runtime.lend()

    # ---------------------------------------------------------------- install

    def install(self, runtime: Runtime) -> None:
        self.runtime = runtime
        patches = self._patches
        self._reduction = TorchFSDPReduction(self.model, self.options, runtime, patches)
        refuse_comm_hooks(self.root, patches)
        self._settling = UnitSettling(runtime)
        self._orig_grads = OrigParamGrads(self.units, runtime)
        for index, (_, unit) in enumerate(self.units):
            patches.hook(
                unit.register_forward_pre_hook(functools.partial(self._pre_forward, index))
            )
            patches.hook(
                unit._fsdp_wrapped_module.register_forward_pre_hook(
                    functools.partial(self._guard_skipped, index)
                )
            )
            device = self.device if unit is self.root else None
            patches.patch(unit, "forward", summonable(unit, unit.forward, device))
            handle = unit._handle
            if handle is not None:
                # Inside the lending below: views are shown again over the new shard.
                patches.patch(unit, "_apply", fsdp1_recasting(handle, unit._apply))
            patches.lending(unit, lending_methods(unit, self.root), self._lend)
            if handle is not None:
                self._summon.patch(handle, patches)
                if handle._setattr_tensor is _SAFE_SETATTR:
                    patches.patch(handle, "_setattr_tensor", _setattr_stepped_aside)
                if handle._use_orig_params:
                    prepare = handle.prepare_gradient_for_backward
                    noting = self._orig_grads.noting_none(prepare)
                    patches.patch(handle, "prepare_gradient_for_backward", noting)
        patches.hook(self.root.register_forward_hook(self._post_forward))
        if self.root._handle is not None:
            # A backward inside the root's forward would trip the root's own assertion
            # first.
            hook_unfinished(self.root, (self.root._handle.flat_param,), WRAPPER, patches)
        order = self.root._exec_order_data
        prefetch = PrefetchSteering(self.root, self._handle_unit, runtime)
        patches.patch(order, "next_iter", self._finishing(order.next_iter))
        patches.patch(order, "get_handle_to_forward_prefetch", prefetch.forward_target)
        patches.patch(order, "get_handle_to_backward_prefetch", prefetch.backward_target)

    def synchronizing(self) -> bool:
        # torch's no_sync() clears the flag on every unit; the root's decides.
        return bool(self.root._sync_gradients)

    def release_unsharded(self) -> None:
        self._settling.release_unsharded(self.units)

    def uninstall(self) -> None:
        self._patches.remove()
        self._reduction.uninstall()
        self._summon.close()

    # -------------------------------------------------------------- lifecycle

    def _pre_forward(self, unit_index: int, module: nn.Module, args: Any) -> None:
        if summoning(self.units[unit_index][1]):
            return  # a forward inside summon_full_params: not an iteration
        runtime = self.runtime
        outermost = module is self.root
        if outermost and self._backward_aborted():
            self._abandon_backward()
        if outermost and not runtime.accumulating:
            self._orig_grads.window_opens()
        runtime.begin_compute(outermost=outermost)
        if outermost and not in_backward():
            # What the gradients were before this iteration's backward touches them: what
            # an aborted backward gives back (references only).
            self._grads_at_forward = [
                (unit._handle.flat_param, unit._handle.flat_param.grad)
                for _, unit in self.units
                if unit._handle is not None
            ]
        runtime.check_unit_forward(unit_index)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        end_root_forward(self.runtime)

    def _backward_aborted(self) -> bool:
        """Whether the last backward raised before torch's final callback reset the
        units (an error of flatview's inside it): a unit is still in a backward state
        as a new iteration's root forward starts (not a recomputation inside one)."""
        if in_backward():
            return False
        return any(
            unit.training_state is not self._idle
            or (unit._handle is not None and unit._handle._training_state is not self._handle_idle)
            for _, unit in self.units
        )

    @torch.no_grad()
    def _abandon_backward(self) -> None:
        """Do what torch's final callback would have done after the aborted backward,
        with what it did to the gradients dropped (none of it was handed out): each flat
        parameter gets back the gradient it had at the forward, flatview's queued
        reductions are dropped, parameters resharded and every state reset, so that the
        next iteration runs as if the aborted one had not. (A gradient tensor that the
        aborted backward accumulated into in place keeps what it added: zero the
        gradients after such an error, as after any failed step.)"""
        self._reduction.abandon()
        self._undeclared = []
        before = {id(flat): grad for flat, grad in self._grads_at_forward}
        self._grads_at_forward = []
        for _, unit in self.units:
            handle = unit._handle
            if handle is not None:
                flat = handle.flat_param
                if hasattr(flat, "_saved_grad_shard"):
                    del flat._saved_grad_shard
                flat._post_backward_called = False
                self._fsdp_runtime._catch_all_reshard(unit)
                flat.grad = before.get(id(flat))
                handle._ran_pre_backward_hook = False
                handle._needs_pre_backward_unshard = False
                handle._post_forward_index = None
                handle._training_state = self._handle_idle
                handle._prefetched = False
            unit.training_state = self._idle
        self.root._post_backward_callback_queued = False
        order = self.root._exec_order_data
        type(order).next_iter(order)

    def _guard_skipped(self, unit_index: int, module: nn.Module, args: Any) -> None:
        """Hook the compute tensors torch just set for skipped parameters, so that a
        model that uses one anyway fails in backward."""
        handle = self.units[unit_index][1]._handle
        if handle is not None:
            self.runtime.guard_skipped(handle.flat_param)

    def _finishing(self, original: Callable[[], None]) -> Callable[[], None]:
        def next_iter() -> None:
            # Every backward hook has run; torch finalises the gradients after this.
            runtime = self.runtime
            runtime.settle_agreement()
            runtime.check_backward_binding()
            settling = self._settling
            # Every rank ran the same forwards and backwards: each raises here alike.
            late = [name for name, unit in self.units if settling.missed_post_backward(unit)]
            if late:
                raise forwards_before_backwards(late)
            # Units that took no part in the backward, settled (those not declared
            # skipped are raised once torch has finished the backward).
            with torch.no_grad():
                synced = bool(self.root._sync_gradients)
                self._undeclared = settle_units(
                    self.units, runtime, synced, settling.took_part, settling.settle
                )
            self._reduction.finish()
            original()
            at_end_of_backward(self._end_backward)

        return next_iter

    def _end_backward(self) -> None:
        synced = bool(self.root._sync_gradients)
        if synced:
            self._orig_grads.restore_none_grads()
        else:
            self._orig_grads.unmark_accumulated_grads()
        self.runtime.end_backward(synced=synced)
        undeclared, self._undeclared = self._undeclared, []
        if undeclared:
            raise undeclared_units(undeclared, self._stale_hooks_cause(undeclared))

    def _stale_hooks_cause(self, undeclared: list[str]) -> str:
        """With a parameter dtype in ``MixedPrecision``, every trainable unit out of the
        backward is what torch does after a forward with autograd that no backward
        followed: the flat parameter's dtype switch replaced the gradient accumulator its
        post-backward hook was left on, and torch does not hook the new one (bare torch
        fails in that backward too, with a size mismatch)."""
        trainable = [
            label(name)
            for name, unit in self.units
            if unit._handle is not None and unit._handle.flat_param.requires_grad
        ]
        mixed = any(
            unit._handle is not None and unit._handle._uses_param_mixed_precision
            for _, unit in self.units
        )
        if not mixed or sorted(undeclared) != sorted(trainable):
            return ""
        return (
            " (with a parameter dtype in MixedPrecision, torch FSDP1 hooks no unit in the "
            "backward after a forward with autograd that no backward followed: compute "
            "losses you do not backward, for validation, under torch.no_grad())"
        )
