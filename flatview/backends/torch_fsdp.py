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
* Gradient reduction: the public ``register_comm_hook`` replaces the reduce-scatter
  (``hook(state, padded_unsharded_grad, sharded_out)``, which must fill ``sharded_out``
  before returning) and the ``NO_SHARD`` all-reduce (``hook(state, grad)``, in place)
  of every unit. torch passes each unit's own ``unit._comm_hook_state``, which this
  adapter sets per unit so that the hook knows whose gradient it reduces (also
  under hybrid sharding: :mod:`~flatview.backends.torch_hybrid`).
* After a backward the root's final callback waits for the reductions, calls
  ``next_iter()`` on the execution-order record ``unit._exec_order_data`` (one object
  shared by every unit), and only then finalises each unit (the sharded gradient moves
  from ``flat._saved_grad_shard`` to ``flat.grad``). Wrapping ``next_iter`` on that
  object gives the point "every backward hook ran, nothing finalised yet", like
  fairscale's ``_wait_for_post_backward``. A unit that took no part in the backward
  still has ``handle._training_state`` other than ``BACKWARD_POST`` there.
* The rest of the adapter lives beside this module: what is refused at wrap time,
  torch internals included (:mod:`~flatview.backends.torch_fsdp_checks`), how flat
  parameters become specs (:mod:`~flatview.backends.torch_fsdp_describe`), where torch
  assumes that every unit takes part in every step (prefetching, units without a
  backward, ``use_orig_params`` gradients: :mod:`~flatview.backends.torch_fsdp_skips`)
  and the summoning brackets (:mod:`~flatview.backends.torch_summon`).

Everything this adapter changes is an instance attribute, a hook or a unit's
communication hook, removed by :meth:`TorchFSDPAdapter.uninstall`.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from flatview.backends._common import nested_unit_message
from flatview.backends.base import UnitSpec
from flatview.backends.messages import undeclared_units, unfinished_backward
from flatview.backends.torch_fsdp_checks import (
    FSDP2_MESSAGE,
    check_flat,
    check_initialised,
    check_no_pending_backward,
    check_privates,
    fsdp_class,
    is_fsdp2,
    is_torch_fsdp,
    refuse_unit,
    torch_version,
)
from flatview.backends.torch_fsdp_describe import clean_name, describe_units
from flatview.backends.torch_fsdp_skips import TorchSkipping
from flatview.backends.torch_hybrid import hybrid_groups, replica_of, set_comm_hook
from flatview.backends.torch_summon import SummonLending, summonable
from flatview.checkpoint_guard import guard_torch_checkpoint
from flatview.comm.options import ReduceOptions
from flatview.comm.packing import plan_index
from flatview.comm.replicated import ReplicatedReduction
from flatview.comm.sharded import ShardedReduction
from flatview.errors import StateError, WrapError
from flatview.layout import MaskPlan

if TYPE_CHECKING:
    from flatview.backends.base import Runtime

__all__ = [
    "FSDP2_MESSAGE",
    "TorchFSDPAdapter",
    "clean_name",
    "is_fsdp2",
    "is_torch_fsdp",
    "torch_version",
]

TESTED_TORCH = ((2, 13),)
"""``(major, minor)`` versions of torch whose FSDP1 internals this adapter was checked
against."""

UNTESTED_TORCH_ENV = "FLATVIEW_ALLOW_UNTESTED_TORCH"
"""Set to ``1`` to wrap torch FSDP1 models on a torch outside :data:`TESTED_TORCH` (with a
warning): the internals read are checked attribute by attribute at wrap time, so a torch
that moved them still fails there, but one that changed their meaning would not."""


def check_torch_version(relies: str) -> str:
    """Refuse a torch outside :data:`TESTED_TORCH` (unless :data:`UNTESTED_TORCH_ENV` is
    set: then warn) for the adapter whose ``relies`` (e.g. ``"FSDP2 backend relies on
    fully_shard"``) names what it depends on; return the "checked against ... found ..."
    phrase the internals checks quote."""
    tested = ", ".join(f"{a}.{b}.x" for a, b in TESTED_TORCH)
    found = f"torch {tested}; found torch {torch.__version__}"
    if torch_version() not in TESTED_TORCH:
        message = f"flatview's {relies} internals checked against {found}"
        if os.environ.get(UNTESTED_TORCH_ENV) != "1":
            raise WrapError(f"{message} (set {UNTESTED_TORCH_ENV}=1 to try it anyway)")
        # Points at the user's flatview.wrap call: this function, the adapter's __init__,
        # backends._choose, backends.detect, flatview.wrap, the caller.
        warnings.warn(f"{message}; going ahead ({UNTESTED_TORCH_ENV}=1)", stacklevel=6)
    return found


# The hook reduces at once, so nothing waits in the reductions' buckets between units (see
# TorchFSDPAdapter.reduce); the bucket size only has to exceed any one gradient.
_NO_BUCKETING = 2**62


class _UnitHookState:
    """The communication-hook state torch hands back for one unit."""

    def __init__(self, adapter: TorchFSDPAdapter, unit: Any) -> None:
        self.adapter = adapter
        self.unit = unit


def _reduce_hook(
    state: _UnitHookState, grad: torch.Tensor, output: torch.Tensor | None = None
) -> None:
    """The communication hook registered on every unit (both of torch's signatures)."""
    state.adapter.reduce(state.unit, grad, output)


class TorchFSDPAdapter(TorchSkipping):
    """Maps the flatview core onto one torch FSDP1 model (root and nested units)."""

    backend = "torch"
    clean_name = staticmethod(clean_name)
    _sharded: ShardedReduction
    _replicated: ReplicatedReduction
    """The reductions of sharded and of ``NO_SHARD`` units' gradients, made at
    :meth:`install` with the runtime's ledger."""

    def __init__(self, model: nn.Module, options: ReduceOptions | None = None) -> None:
        super().__init__()
        self.options = options if options is not None else ReduceOptions()
        found = check_torch_version("torch FSDP backend relies on FSDP1")
        fsdp = fsdp_class()
        assert fsdp is not None
        # torch's FSDP internals are untyped: they are reached through ``Any``.
        root: Any = model
        self.root = root
        units: list[tuple[str, Any]] = [
            (clean_name(name), m) for name, m in root.named_modules() if isinstance(m, fsdp)
        ]
        check_privates(root, units, found)
        from torch.distributed.fsdp import ShardingStrategy
        from torch.distributed.fsdp import _runtime_utils as runtime
        from torch.distributed.fsdp._common_utils import HandleTrainingState, TrainingState

        self._runtime = runtime
        self._init_skipping()
        self._idle = TrainingState.IDLE
        self._handle_idle = HandleTrainingState.IDLE
        self._summoning_state = HandleTrainingState.SUMMON_FULL_PARAMS
        self._summoning_unit = TrainingState.SUMMON_FULL_PARAMS
        # Before lazy initialisation every unit has `_is_root` None; a unit constructed
        # before another FSDP around it is marked by that one's constructor (for Dynamo;
        # in the unit's own __dict__: FSDP forwards missing attributes to the wrapped
        # module, which its own constructor marks). A unit that an auto-wrap policy
        # created is not marked (see docs/limitations.md).
        if root._is_root is False or vars(root).get("_is_fsdp_managed_module", False):
            raise WrapError(nested_unit_message(root, fsdp, clean_name))
        self.units = units
        self._check_units(TrainingState.IDLE, then=refuse_unit)
        self.hybrid = hybrid_groups(root, units, found)  # collective: before any other
        self.replicas = 1 if self.hybrid is None else self.hybrid.replica_size
        # Lazy initialisation creates the local shards the views alias and the shared
        # execution-order record; torch would run it at the first forward anyway.
        root.check_is_root()
        check_initialised(root, units, found)
        check_no_pending_backward(units)
        for name, unit in self.units:
            if unit._handle is not None:
                check_flat(name, unit._handle)
        self.group: dist.ProcessGroup | None = root.process_group
        self.rank: int = root.rank
        self.world_size: int = root.world_size
        self.device = torch.device(root.compute_device)
        self.bucket_numel = _NO_BUCKETING
        # NO_SHARD everywhere: forward and backward gather nothing, and the only
        # gradient collectives are flatview's (reduce, next_iter), which settle the
        # skip-set check first; so it can run alongside the forward.
        self.overlaps_agreement = all(
            unit.sharding_strategy is ShardingStrategy.NO_SHARD for _, unit in self.units
        )
        self._unit_index: dict[int, int] = {id(unit): i for i, (_, unit) in enumerate(self.units)}
        self._handle_unit: dict[int, int] = {
            id(unit._handle): i for i, (_, unit) in enumerate(self.units) if unit._handle
        }
        self._summon = SummonLending(self._summoning_state, self._lend)
        self._grads_at_forward: list[tuple[Any, torch.Tensor | None]] = []
        # Whether a no_sync() window is open (the last backward did not synchronise).
        self._accumulating = False
        # Flat parameters whose gradient hook waits for an in-place reduction in flight.
        self._in_place_guarded: set[int] = set()

    # ------------------------------------------------------------ summoning

    def summon_lending(self, lend: Callable[[], AbstractContextManager[None]]) -> SummonLending:
        """Brackets for this model's summonings (``summon_full_params``, full and sharded
        ``state_dict``) that lend through ``lend``: ``patch`` each handle with it."""
        return SummonLending(self._summoning_state, lend)

    def summoning(self, unit: Any) -> bool:
        """Whether ``unit`` is inside ``summon_full_params`` (its submodules hold the
        full parameters)."""
        return bool(unit.training_state is self._summoning_unit)

    # --------------------------------------------------------------- describe

    def describe(self) -> list[UnitSpec]:
        return describe_units(self.units, self.root, self.rank, self.world_size)

    # ---------------------------------------------------------------- install

    def install(self, core: Runtime) -> None:
        self._core = core
        # NO_SHARD units' gradients go to the replicated reduction, the others' to the
        # sharded one; a model may mix both.
        reduction = (self.group, self.rank, self.world_size, core.ledger, self.options)
        # torch reduce-scatters each unit on its own.
        self._sharded = ShardedReduction(
            *reduction, self.bucket_numel, replica_of(self.hybrid), wrapper_buckets=False
        )
        self._replicated = ReplicatedReduction(*reduction, self.bucket_numel)
        set_comm_hook(self.root, self.units, _reduce_hook, self.hybrid)
        for index, (_, unit) in enumerate(self.units):
            # register_comm_hook gives every unit the same state; each gets its own so
            # that the hook knows whose gradient it is given.
            unit._comm_hook_state = _UnitHookState(self, unit)
            self._hook(unit.register_forward_pre_hook(functools.partial(self._pre_forward, index)))
            self._hook(
                unit._fsdp_wrapped_module.register_forward_pre_hook(
                    functools.partial(self._guard_skipped, index)
                )
            )
            device = self.device if unit is self.root else None
            self.patch(unit, "forward", summonable(unit, unit.forward, self.summoning, device))
            self._patch_lending(unit, self._lending_methods(unit))
            handle = unit._handle
            if handle is not None:
                self._summon.patch(handle, self.patch)
                if handle._use_orig_params:
                    prepare = handle.prepare_gradient_for_backward
                    self.patch(handle, "prepare_gradient_for_backward", self._noting_none(prepare))
        self._hook(self.root.register_forward_hook(self._post_forward))
        if self.root._handle is not None:
            # Ahead of the root's own post-backward hook, which asserts on a backward
            # inside the root's forward.
            flat = self.root._handle.flat_param
            self._hook(flat.register_hook(self._refuse_unfinished))
        order = self.root._exec_order_data
        self.patch(order, "next_iter", self._finishing(order.next_iter))
        self.patch(order, "get_handle_to_forward_prefetch", self._forward_prefetch_target)
        self.patch(order, "get_handle_to_backward_prefetch", self._backward_prefetch_target)
        guard_torch_checkpoint(self)

    def uninstall(self) -> None:
        super().uninstall()
        for _, unit in self.units:
            unit._comm_hook = None
            unit._comm_hook_state = None
        self._summon.close()
        self._in_place_guarded.clear()

    # -------------------------------------------------------------- lifecycle

    def _pre_forward(self, unit_index: int, module: nn.Module, args: Any) -> None:
        if self.units[unit_index][1].training_state is self._summoning_unit:
            return  # a forward inside summon_full_params: not an iteration
        outermost = module is self.root
        if outermost and self._backward_aborted():
            self._abandon_backward()
        if outermost and not self._accumulating:
            self._note_none_grads()
            self._none_at_backward = True
            self._forget_masks()
        self.core.begin_compute(outermost=outermost)
        if outermost and torch._C._current_graph_task_id() == -1:
            # What the gradients were before this iteration's backward touches them: what
            # an aborted backward gives back (references only).
            self._grads_at_forward = [
                (unit._handle.flat_param, unit._handle.flat_param.grad)
                for _, unit in self.units
                if unit._handle is not None
            ]
        self.core.check_unit_forward(unit_index)

    def _backward_aborted(self) -> bool:
        """Whether the last backward raised before torch's final callback reset the
        units (an error of flatview's inside it): a unit is still in a backward state
        as a new iteration's root forward starts (not a recomputation inside one)."""
        if torch._C._current_graph_task_id() != -1:
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
        self._replicated.abandon()
        self._sharded.abandon()
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
                self._runtime._catch_all_reshard(unit)
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
            self.core.guard_skipped(handle.flat_param)

    def _finishing(self, original: Callable[[], None]) -> Callable[[], None]:
        def next_iter() -> None:
            # Every backward hook has run; torch finalises the gradients after this.
            self.core.settle_agreement()
            self.core.check_backward_binding()
            self._settle_units_without_backward()
            # The replicated buckets' collectives first, then the sharded ones.
            self._replicated.finish()
            self._sharded.finish()
            original()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

        return next_iter

    def _refuse_unfinished(self, grad: torch.Tensor | None = None) -> None:
        """Refuse a backward that does not go through the root's outputs (one inside the
        root's forward): their hooks queue torch's end of the backward, which would
        never run. Checked before each reduction and before the root's own gradient."""
        if not getattr(self.root, "_post_backward_callback_queued", False):
            # (The root's first forward with autograd defines the flag; a torch that
            # renamed it refuses every backward here, loudly.)
            raise unfinished_backward("torch FSDP")

    def _end_backward(self) -> None:
        synced = bool(self.root._sync_gradients)
        if synced:
            self._restore_none_grads()
        else:
            self._unmark_accumulated_grads()
        self.core.end_backward(synced=synced)
        self._accumulating = not synced
        undeclared, self._undeclared = self._undeclared, []
        if undeclared:
            raise undeclared_units(undeclared)

    # -------------------------------------------------------------- reduction

    @torch.no_grad()
    def reduce(self, unit: Any, grad: torch.Tensor, output: torch.Tensor | None) -> None:
        """Queue one unit's gradient for masked reduction; the reductions' buckets are
        reduced together, one collective per bucket instead of one per unit.

        ``output is None``: ``NO_SHARD``, where ``grad`` is the flat gradient, reduced in
        place. Otherwise ``grad`` is the padded unsharded gradient and ``output`` the
        sharded gradient torch expects back: it is zero when the hook returns, torch
        accumulates it into ``flat._saved_grad_shard``, and the reduced values are
        added there when the bucket is flushed (at the latest in ``next_iter``, after
        every backward hook and before torch finalises gradients). Both average over the
        group as torch does (pre- and post-division).

        A gradient a reduction takes whole (``reduces_in_place``: all
        or nearly all used, large enough) skips the bucket where torch would not read it
        before ``next_iter``: it is all-reduced in place (``NO_SHARD``) or reduce-scattered
        straight into ``output`` by an asynchronous collective started now, which the
        flush in ``next_iter`` waits for.
        """
        self._refuse_unfinished()
        core = self.core
        core.settle_agreement()
        handle = unit._handle
        plan: MaskPlan | None = None if handle is None else core.reduction_plan(handle.flat_param)
        if plan is None:
            raise StateError(
                f"torch FSDP asked flatview to reduce a gradient of unit "
                f"{type(unit).__name__} that flatview does not know"
            )
        flat = handle.flat_param
        predivide = float(unit._gradient_predivide_factor)
        postdivide = float(unit._gradient_postdivide_factor)
        replicated, sharded = self._replicated, self._sharded
        # Reduced without packing, the collective may still run when the hook returns,
        # unless an optimizer steps in backward (it reads the gradient at once).
        late_ok = not getattr(handle, "_has_optim_in_backward", False)
        if (
            late_ok
            and output is None
            and grad is flat.grad
            # torch casts the gradient to the parameter dtype right after the hook
            # returns, reading it: only without that cast may the reduction still run.
            and (grad.dtype == flat.dtype or handle._keep_low_precision_grads)
            and replicated.reduces_in_place(grad, plan)
        ):
            # All (or nearly all) of it is used: all-reduced whole and in place, while
            # the backward goes on; the flush in next_iter waits for it. Should autograd
            # accumulate into it again before then (reentrant checkpointing), a hook on
            # the flat parameter waits for the reduction first.
            if id(flat) not in self._in_place_guarded:
                self._in_place_guarded.add(id(flat))

                def settle_first(_: torch.Tensor) -> None:
                    if replicated.in_flight(flat.grad):
                        self._wait_in_flight()

                self._hook(flat.register_hook(settle_first))
            replicated.all_reduce_in_place(
                grad, plan, predivide, postdivide if postdivide > 1 else 1.0
            )
            return
        index = plan_index(plan, grad.device)
        if output is None:

            def place_replicated(values: torch.Tensor) -> None:
                # Resolved now, not when queued: torch may have cast the gradient since.
                # Divided on the way back: one pass, the values torch's div_ would give.
                index.place(flat.grad, values, 0, postdivide if postdivide > 1 else 1.0)

            replicated.add(grad, plan, place_replicated, predivide)
            return
        saved = getattr(flat, "_saved_grad_shard", None)
        if sharded.in_flight(saved):
            # A second reduction of this unit in one backward (reentrant checkpointing):
            # torch is about to add to the shard the first one still writes.
            self._wait_in_flight()
        if predivide > 1 and not plan.none_used:
            grad.div_(predivide)
        if (
            late_ok
            and saved is None
            # torch keeps `output` as the sharded gradient without reading it (nothing to
            # accumulate into, no cast to the parameter dtype): it may still be written.
            and output.dtype == flat.dtype
            and sharded.reduces_in_place(grad, plan)
        ):
            sharded.reduce_scatter_in_place(
                grad, output, plan, postdivide if postdivide > 1 else 1.0
            )
            return
        output.zero_()
        queued = True

        def add_sharded(shard: torch.Tensor) -> None:
            if postdivide > 1:
                shard.div_(postdivide)
            # A bucket that fills up flushes inside add(), before torch has taken
            # `output`: then the result goes there; later it goes to the accumulator.
            target = output if queued else flat._saved_grad_shard
            target.add_(shard)

        sharded.add(grad.view(self.world_size, -1).unbind(0), plan, add_sharded, whole=grad)
        queued = False

    def _wait_in_flight(self) -> None:
        """Wait for every reduction started whole and still in flight, of both kinds."""
        self._replicated.wait_in_flight()
        self._sharded.wait_in_flight()
