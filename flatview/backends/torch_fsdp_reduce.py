"""The torch FSDP1 adapter's reduction (:class:`TorchFSDPReduction`): the communication
hook every unit calls with its gradient, which sends it through flatview's masked
reductions (:mod:`flatview.comm.sharded` for sharded units, :mod:`flatview.comm.replicated`
for ``NO_SHARD`` ones; a model may mix both), bucketed or started at once.

torch's public ``register_comm_hook`` replaces the reduce-scatter
(``hook(state, padded_unsharded_grad, sharded_out)``, which must fill ``sharded_out``
before returning) and the ``NO_SHARD`` all-reduce (``hook(state, grad)``, in place) of
every unit. torch passes each unit's own ``unit._comm_hook_state``, which is set per unit
so that the hook knows whose gradient it reduces (also under hybrid sharding, where
``register_comm_hook`` refuses and the hook is set directly:
:mod:`~flatview.backends.torch_hybrid`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from flatview.autograd import weakly
from flatview.backends.base import Runtime
from flatview.backends.patches import Patches
from flatview.backends.torch_fsdp_checks import TorchFSDPModel
from flatview.backends.torch_hybrid import replica_of, set_comm_hook
from flatview.backends.unit_tree import refuse_unfinished
from flatview.comm.options import ReduceOptions
from flatview.comm.packing import plan_index
from flatview.comm.replicated import ReplicatedReduction
from flatview.comm.sharded import ShardedReduction
from flatview.errors import StateError
from flatview.layout import MaskPlan

WRAPPER = "torch FSDP"
"""How messages name the wrapper."""

NO_BUCKETING = 2**62
"""The hook reduces at once, so nothing waits in the reductions' buckets between units
(see :meth:`TorchFSDPReduction.reduce`); the bucket size only has to exceed any one
gradient."""


class _UnitHookState:
    """The communication-hook state torch hands back for one unit."""

    def __init__(self, reduction: TorchFSDPReduction, unit: Any) -> None:
        self.reduction = reduction
        self.unit = unit


def _reduce_hook(
    state: _UnitHookState, grad: torch.Tensor, output: torch.Tensor | None = None
) -> None:
    """The communication hook registered on every unit (both of torch's signatures)."""
    state.reduction.reduce(state.unit, grad, output)


@dataclass(frozen=True)
class _Pair:
    """The two reductions of one process group."""

    sharded: ShardedReduction
    replicated: ReplicatedReduction


class TorchFSDPReduction:
    """Every unit's communication hook, and the two reductions it feeds: made at the
    adapter's install, with the runtime's ledger."""

    def __init__(
        self, model: TorchFSDPModel, options: ReduceOptions, runtime: Runtime, patches: Patches
    ) -> None:
        self.model = model
        self.runtime = runtime
        self._patches = patches
        # Per process group (the root's first, then those of units on groups of their
        # own: every rank finishes them in this order), NO_SHARD units' gradients go to
        # the replicated reduction, the others' to the sharded one; a model may mix both.
        self._pairs: dict[int, _Pair] = {}
        self._pair_of: dict[int, _Pair] = {}
        for index, (_, unit) in enumerate(model.units):
            own = model.groups.get(index)
            group = model.group if own is None else own.group
            pair = self._pairs.get(id(group))
            if pair is None:
                where = (group, unit.rank, unit.world_size, runtime.ledger, options)
                # torch reduce-scatters each unit on its own.
                sharded = ShardedReduction(
                    *where, NO_BUCKETING, replica_of(model.hybrid), wrapper_buckets=False
                )
                pair = self._pairs[id(group)] = _Pair(
                    sharded, ReplicatedReduction(*where, NO_BUCKETING)
                )
            self._pair_of[id(unit)] = pair
        # Flat parameters whose gradient hook waits for an in-place reduction in flight.
        self._in_place_waiting: set[int] = set()
        set_comm_hook(model.root, model.units, _reduce_hook, model.hybrid)
        for _, unit in model.units:
            # register_comm_hook gives every unit the same state; each gets its own so
            # that the hook knows whose gradient it is given.
            unit._comm_hook_state = _UnitHookState(self, unit)

    def _settle_first(
        self,
        pair: tuple[ReplicatedReduction, weakref.ref[torch.Tensor]],
        _: torch.Tensor,
    ) -> None:
        """Before autograd accumulates into a flat parameter's gradient again: wait for
        its in-place reduction (``pair``: the reduction, the flat parameter), if still
        in flight."""
        replicated, flat = pair
        tensor = flat()
        if tensor is not None and replicated.in_flight(tensor.grad):
            self.wait_in_flight()

    def uninstall(self) -> None:
        for _, unit in self.model.units:
            unit._comm_hook = None
            unit._comm_hook_state = None
        self._in_place_waiting.clear()

    def finish(self) -> None:
        """Every backward hook has run: per group, the replicated buckets' collectives
        first, then the sharded ones."""
        for pair in self._pairs.values():
            pair.replicated.finish()
            pair.sharded.finish()

    def abandon(self) -> None:
        """Drop what an aborted backward queued."""
        for pair in self._pairs.values():
            pair.replicated.abandon()
            pair.sharded.abandon()

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
        refuse_unfinished(self.model.root, WRAPPER)
        runtime = self.runtime
        runtime.settle_agreement()
        handle = unit._handle
        plan: MaskPlan | None = (
            None if handle is None else runtime.reduction_plan(handle.flat_param)
        )
        if plan is None:
            raise StateError(
                f"torch FSDP asked flatview to reduce a gradient of unit "
                f"{type(unit).__name__} that flatview does not know"
            )
        flat = handle.flat_param
        predivide = float(unit._gradient_predivide_factor)
        postdivide = float(unit._gradient_postdivide_factor)
        pair = self._pair_of[id(unit)]
        replicated, sharded = pair.replicated, pair.sharded
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
            if id(flat) not in self._in_place_waiting:
                self._in_place_waiting.add(id(flat))
                settle_first = weakly(self._settle_first, (replicated, weakref.ref(flat)))
                self._patches.hook(flat.register_hook(settle_first))
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
            self.wait_in_flight()
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

        rows = grad.view(sharded.world_size, -1).unbind(0)
        sharded.add(rows, plan, add_sharded, padded=grad)
        queued = False

    def wait_in_flight(self) -> None:
        """Wait for every reduction started whole and still in flight, of both kinds."""
        for pair in self._pairs.values():
            pair.replicated.wait_in_flight()
            pair.sharded.wait_in_flight()
