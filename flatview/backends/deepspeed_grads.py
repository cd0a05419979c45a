"""The gradients of a wrapped DeepSpeed engine's backwards, reduced and accumulated as
its ZeRO stage does: :class:`ZeroGrads`.

At the end of every backward DeepSpeed's own reduction is a no-op
(:mod:`flatview.backends.deepspeed`); this reduces instead. Each flat parameter's used
segments (gradients of DeepSpeed's parameters, padded into its layout) go through
flatview's sharded reduction (masked reduce-scatter, bucketed), in the same order on
every rank whatever its backward did, averaged over the world as DeepSpeed averages:
fp32 gradients summed then divided, bf16 ones divided then summed in bf16.

With ``gradient_accumulation_steps`` above 1 DeepSpeed steps only at an accumulation
boundary (``engine.is_gradient_accumulation_boundary()``: every
``gradient_accumulation_steps``-th ``engine.step()``, or as
``set_gradient_accumulation_boundary`` says), and each stage accumulates the
micro-steps before it its own way. flatview does as the stage does, in the same dtype,
so that the sums are DeepSpeed's:

* **ZeRO 1** reduces only at the boundary, and never inside ``engine.no_sync()``. Until
  then DeepSpeed's parameters keep their gradients and autograd adds each micro-step's
  into them; the boundary's backward reduces the sums, masked by what any micro-step of
  the window used. The micro-steps before it communicate nothing, so their skip-set
  checks wait for the boundary's (:meth:`ZeroGrads.communicates`), as under other
  wrappers' ``no_sync()``.
* **ZeRO 2 and 3** reduce every micro-step, each masked by its own skip set, and add the
  averaged shards in the accumulation dtype (DeepSpeed's ``grad_accum_dtype``, which
  flatview requires to be the parameters' own: bf16 under bf16); the boundary's total
  becomes the holder's fp32 gradient.

Until the boundary the views' gradients stay what they were when the window opened
(the runtime's accumulation window, as under ``no_sync()``); at the boundary each view
gets its piece of the sum, ``None`` where no micro-step of the window used its
parameter.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from flatview.backends.deepspeed_zero import ZeroLayout
from flatview.comm.sharded import ShardedReduction
from flatview.layout import MaskPlan

if TYPE_CHECKING:
    from flatview.backends.base import Runtime


def _used_part(padded: torch.Tensor, plan: MaskPlan) -> torch.Tensor:
    """On one rank, the gradient ``plan`` reduces: the used elements of ``padded``, zeros
    elsewhere (unused places hold what an earlier backward left there), as the masked
    reduction returns it on several ranks."""
    shard = padded.new_zeros(plan.layout.shard_numel)
    for start, end in plan.per_rank[0]:
        shard[start:end] = padded[start:end]
    return shard


class ZeroGrads:
    """The end of every backward of one wrapped engine (see the module docstring):
    ``stage`` its ZeRO stage, ``layout`` its partitions."""

    def __init__(self, engine: Any, stage: int, layout: ZeroLayout, world_size: int) -> None:
        self.engine = engine
        self.layout = layout
        self.world_size = world_size
        self.local = stage == 1
        """Whether micro-steps before the boundary accumulate unreduced gradients on
        DeepSpeed's parameters (ZeRO 1) instead of reducing (ZeRO 2/3)."""
        # Per flat parameter (index), the averaged shards of this window's micro-steps
        # summed so far in the accumulation dtype (ZeRO 2/3).
        self._totals: dict[int, torch.Tensor] = {}
        self._installed: tuple[Runtime, ShardedReduction] | None = None

    def install(self, runtime: Runtime, reduction: ShardedReduction) -> None:
        self._installed = (runtime, reduction)

    def at_boundary(self) -> bool:
        """Whether the backward now running (or the next) ends DeepSpeed's accumulation:
        at its boundary, and not inside ``engine.no_sync()`` (ZeRO 1 only: DeepSpeed
        refuses it on ZeRO 2/3), where DeepSpeed reduces nothing."""
        engine = self.engine
        return bool(engine.is_gradient_accumulation_boundary()) and not engine.inside_no_sync_ctxt

    def communicates(self) -> bool:
        """Whether the next backward reduces gradients (the adapter's ``synchronizing``)."""
        return not self.local or self.at_boundary()

    def keeps_local(self) -> bool:
        """Whether DeepSpeed's parameters hold gradients of this window's earlier
        micro-steps, which the next backward adds to (ZeRO 1 before the boundary)."""
        return self.local and self._installed is not None and self._installed[0].accumulating

    def drop(self) -> None:
        """Forget what this window accumulated (``zero_grad``, or a reduction that raised):
        at the boundary only what follows counts, and marks its parameters used."""
        self._totals = {}
        if self._installed is not None:
            self._installed[0].forget_window()

    def end_backward(self) -> bool:
        """Reduce (or keep) the gradients of a backward that has just finished; whether it
        ends the accumulation window (the views then get the sums)."""
        boundary = self.at_boundary()
        if self.local and not boundary:
            return False  # autograd adds the next micro-step's gradients to these
        try:
            self._reduce(boundary)
        finally:
            for param, _ in self.layout.compute_params():
                param.grad = None
        return boundary

    @torch.no_grad()
    def _reduce(self, boundary: bool) -> None:
        assert self._installed is not None, "ZeroGrads used before install()"
        runtime, reduction = self._installed
        world = self.world_size
        try:
            for index, flat in enumerate(self.layout.flats):
                flat.holder.grad = None
                # ZeRO 1 reduces the window's sums (masked by what any of its micro-steps
                # used); ZeRO 2/3 reduce this micro-step's own gradients.
                plan = runtime.reduction_plan(flat.holder, window=self.local)
                if plan is None or plan.none_used:
                    continue
                padded = self.layout.padded_gradient(index, plan.used)
                shard = flat.layout.shard_numel
                done = functools.partial(self._reduced, index)
                if world == 1:
                    done(_used_part(padded, plan))
                    continue
                if padded.dtype != flat.holder.dtype:
                    # As DeepSpeed reduces bf16 gradients: divided first, summed in bf16.
                    padded.div_(world)
                reduction.add(list(padded.view(world, shard)), plan, done, padded=padded)
            reduction.finish()
        except BaseException:
            reduction.abandon()
            self.drop()
            raise
        if boundary:
            totals, self._totals = self._totals, {}
            for index, total in totals.items():
                holder = self.layout.flats[index].holder
                holder.grad = total.to(holder.dtype)

    def _reduced(self, index: int, shard: torch.Tensor) -> None:
        """``shard`` (this rank's, summed over the ranks) averaged into the window's
        total of flat parameter ``index``."""
        holder: nn.Parameter = self.layout.flats[index].holder
        if shard.dtype == holder.dtype and self.world_size > 1:
            shard.div_(self.world_size)  # bf16 ones were divided before the sum
        total = self._totals.get(index)
        if total is None:
            self._totals[index] = shard  # a fresh tensor (the reduction's output)
        else:
            total.add_(shard)
