"""The reduction shared by adapters of replicating wrappers (DDP, and torch FSDP1 when
every unit is ``NO_SHARD``): every rank holds every parameter whole, the wrapper's own
gradient communication stays idle, and flatview all-reduces the used gradients itself.

How it works (the subclass says how its wrapper is kept quiet and whether the next
backward synchronises; it calls :meth:`ReplicatedAdapter._begin_forward` and
:meth:`ReplicatedAdapter._end_forward` around the root's forward):

* The end of a backward: hooks on the forward's outputs fire when the backward reaches
  them and queue a callback that autograd runs when the whole backward is done.
* The reduction, in a synchronising backward, overlaps the backward as DDP's does: the
  parameters to reduce (used since the last synchronising backward) are cut into
  buckets in the order the backward is expected to produce their gradients (a first
  bucket of DDP's first-bucket size, 1 MiB, then the wrapper's bucket size):
  reverse registration order until the first overlapped backward, then the order that
  one produced them in, rank 0's, broadcast at the next synchronising forward (DDP
  rebuilds its buckets the same way, at the same point); a hook on each parameter marks
  its gradient ready, and the next bucket whose gradients are all ready starts its
  all-reduce (an average, as DDP's: NCCL's ``AVG``, elsewhere divided by the world size
  first), in bucket order on every rank. The end-of-backward callback starts what is
  left and waits for everything. Buckets follow from the skip set alone, so every rank
  forms the same ones, whatever order its backward runs in.
* A gradient accumulated again after its bucket started (a parameter that takes part in
  two graph tasks of one backward, as with reentrant checkpointing) would be reduced
  without its second part: the callback then waits for the buckets in flight, discards
  their results and reduces everything again, whole (``overlap_reduction=False``
  avoids the waste for models that always do this). A forward inside the backward
  (checkpointing around the whole model recomputes it) is not a new iteration.
* Nothing in a step waits for the GPU (as DDP's reducer does not): the flags below are
  made on the device and read back only on a rank that lacks a gradient, and the
  skip-set check reads its fingerprints through a side stream (``comm/agreement.py``).
  ``benchmarks/gpu_smoke.py`` checks it with ``torch.cuda.set_sync_debug_mode``. The
  one exception is the broadcast of the learned bucket order, once.
* Overlap is off by default on CPU (``wrap(overlap_reduction=)``): there the collectives
  compete with the backward for the same cores, and one all-reduce at the end was
  faster.

A parameter not in the skip set is used: if this rank's backward gave it no gradient,
it contributes zeros (some other rank's backward did reach it: DDP's
``find_unused_parameters`` gives the same). If no rank's backward reached it, the
model left it out without declaring it: it keeps ``None`` and every rank raises
:class:`~flatview.errors.UndeclaredUnusedError`, learnt from one flag per parameter that
travels in the same all-reduce, so it costs no extra collective.
"""

from __future__ import annotations

import contextlib
import functools
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from flatview.backends._common import AdapterBase
from flatview.comm.bucketing import FIRST_BUCKET_BYTES, BucketRound, plan_buckets
from flatview.comm.options import ReduceOptions
from flatview.comm.replicated import ReplicatedReduction
from flatview.errors import StateError, UndeclaredUnusedError
from flatview.phase import Phase


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread (a forward now is a
    recomputation for activation checkpointing, not a new iteration)."""
    return bool(torch._C._current_graph_task_id() != -1)


def readiness_order(
    registration: Sequence[int], observed: Sequence[int]
) -> dict[int, tuple[int, int]]:
    """Sort keys, per parameter of ``registration`` (model order), for the order their
    gradients are expected in: ``observed``, the order one backward produced them in,
    first-hand; a parameter it lacks (skipped in that step, say) right after the one
    before it in reverse registration order, the order a backward usually goes in.
    Keys are (position in ``observed`` of that anchor, -1 for none; steps after it)."""
    seen = {index: position for position, index in enumerate(observed)}
    keys: dict[int, tuple[int, int]] = {}
    anchor, after = -1, 0
    for index in reversed(registration):
        if index in seen:
            anchor, after = seen[index], 0
        else:
            after += 1
        keys[index] = (anchor, after)
    return keys


class ReplicatedAdapter(AdapterBase):
    """The reduction and iteration bookkeeping of a replicating wrapper's adapter; a
    subclass calls :meth:`_init_reduction` from its ``__init__``."""

    # The wrapper's forward communicates nothing the skip set decides.
    overlaps_agreement = True
    # ... and the end of a backward inside the forward is found from the gradients.
    trains_inside_forward = True
    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    device: torch.device
    bucket_numel: int
    _reduction: ReplicatedReduction
    """Made at install, with the runtime's ledger."""

    def _init_reduction(
        self,
        params: list[tuple[str, nn.Parameter]],
        reduced: set[int],
        bucket_bytes: int,
        options: ReduceOptions | None,
    ) -> None:
        """``params``: (first name, parameter) in registration order; ``reduced``: ids of
        those flatview all-reduces; ``bucket_bytes``: the wrapper's bucket size."""
        self.options = options if options is not None else ReduceOptions()
        self._params = params
        self._reduced = reduced
        self._first_bucket_bytes = min(FIRST_BUCKET_BYTES, bucket_bytes)
        self._bucket_bytes = bucket_bytes
        self._bucket_plans: OrderedDict[tuple[int, ...], list[list[int]]] = OrderedDict()
        """Per first-bucket size and parameters to reduce: their buckets."""
        self._round: BucketRound | None = None
        overlap = self.options.overlap
        self.overlap = self.device.type != "cpu" if overlap is None else overlap
        """Start each bucket's all-reduce as soon as its gradients are ready (as DDP
        does); ``False``: everything at the end of the backward, in as few collectives
        as the bucket size allows (``ReduceOptions.overlap``). On by default except on
        CPU, where the collectives
        run on the cores the backward computes on: there (2 processes over gloo,
        ``benchmarks/README.md``) overlapping took 1.08-1.20x the ideal's step time
        against 1.02-1.14x without."""
        self._order: dict[int, tuple[int, int]] | None = None
        """Sort keys of the order gradients are expected in (:func:`readiness_order`),
        learned from the first overlapped backward; until then, reverse registration."""
        self._observed: list[int] | None = None
        """Core indices in the order the first overlapped backward made them ready."""
        self._synced = True
        """Whether the backward of the last forward reduces (``no_sync()`` was not on)."""
        self._callback_queued = False
        self._window: set[int] = set()
        """Core indices of parameters used since the last synchronising backward."""
        self._forward_open = False
        """The root's forward runs (not a recomputation inside a backward): a backward
        now runs inside it, through tensors that are not its outputs (Lightning's
        manual optimization), and the gradients show where it begins."""

    def _install_reduction(self) -> None:
        core = self.core
        self._reduction = ReplicatedReduction(
            self.group, self.rank, self.world_size, core.ledger, self.options, self.bucket_numel
        )
        for _, param in self._params:
            index = core.index_of(param)
            if index is not None and id(param) in self._reduced:
                ready = functools.partial(self._grad_ready, index)
                self._hook(param.register_post_accumulate_grad_hook(ready))

    def uninstall(self) -> None:
        super().uninstall()
        self._forward_open = False
        self._window.clear()
        self._round = None
        self._order = self._observed = None

    # -------------------------------------------------------------- lifecycle

    def _begin_forward(self, synced: bool) -> None:
        """The root's forward starts a new iteration (not a recomputation inside a
        backward: the caller checks :func:`in_backward` first); ``synced``: whether its
        backward reduces (the wrapper's ``no_sync()`` is off)."""
        core = self.core
        if self._round is not None or self._callback_queued:
            # The last backward raised before it ended (its end callback never ran):
            # what it started is stale.
            self._round = None
            self._callback_queued = False
            self._reduction.wait_in_flight(discard=True)
        core.begin_compute(outermost=True)
        core.guard_skipped_plain()
        self._synced = synced
        if self._observed is not None and self._synced and torch.is_grad_enabled():
            # A collective: a rank that failed in step() must have been heard first.
            core.settle_agreement()
            self._learn_order(self._observed)

    def _end_forward(self, output: Any) -> bool:
        """The root's forward returned ``output``: whether a backward is to follow."""
        # The skip-set check ran alongside the forward: its errors raise here, from the
        # forward, not from the middle of the backward.
        self.core.settle_agreement()
        if output is None or not torch.is_grad_enabled():
            self.core.end_forward_only()
            return False
        for leaf in tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                # Not kept for uninstall: these die with the output.
                leaf.register_hook(self._backward_starts)
        return True

    @contextlib.contextmanager
    def _root_forward_open(self) -> Iterator[None]:
        """Around the call of the root's forward (the subclass's): while it runs, a
        backward is one inside the forward. Closed however the forward ends,
        ``BaseException`` included."""
        if self._forward_open or in_backward():
            yield
            return
        self._forward_open = True
        try:
            yield
        finally:
            self._forward_open = False

    def _backward_starts(self, grad: torch.Tensor | None) -> None:
        if self._core is None or self._callback_queued:
            return
        self._core.check_backward_binding()
        self._callback_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if self._synced and self.overlap:
            self._round = self._plan_round(self._reduced_now(), self._first_bucket_bytes)
            if self._order is None and self._observed is None:
                self._observed = []  # _grad_ready records this backward's order

    def _reduced_now(self) -> list[int]:
        """Core indices to reduce at this synchronising backward, in model order."""
        used = (i for i in self.core.plain_used() if id(self.core.tensor(i)) in self._reduced)
        return sorted(self._window.union(used))

    def _learn_order(self, observed: list[int]) -> None:
        """Bucket from now on in the order the first overlapped backward produced the
        gradients, as DDP rebuilds its buckets after its first iteration: rank 0's order,
        so that every rank forms the same buckets. Called at the next synchronising
        forward, the same point on every rank (as DDP's rebuild), with one broadcast of
        Python objects: the one time a step waits for the GPU (DDP's rebuild does too)."""
        box: list[Any] = [observed]
        source = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.broadcast_object_list(box, src=source, group=self.group)
        core = self.core
        registration = [i for _, p in self._params if (i := core.index_of(p)) is not None]
        self._order = readiness_order(registration, box[0])
        self._observed = None
        self._bucket_plans.clear()

    def _plan_round(self, indices: list[int], first_cap: int) -> BucketRound:
        """The buckets of ``indices`` (a first one of at most ``first_cap`` bytes), none
        started yet."""
        key = (first_cap, *indices)
        plan = self._bucket_plans.get(key)
        if plan is None:
            # The order the backward produces them in: learned, or until then reverse
            # registration order (roughly that for most models).
            keys = self._order
            order = sorted(indices, key=keys.__getitem__) if keys else indices[::-1]
            sizes = []
            for index in order:
                param = self.core.tensor(index)
                sizes.append((param.numel() * param.element_size(), (param.dtype, param.device)))
            plan = [
                [order[p] for p in bucket]
                for bucket in plan_buckets(sizes, first_cap, self._bucket_bytes)
            ]
            self._bucket_plans[key] = plan
            if len(self._bucket_plans) > 256:  # skip sets vary: recent ones only
                self._bucket_plans.popitem(last=False)
        else:
            self._bucket_plans.move_to_end(key)
        round_ = BucketRound.of(plan)
        # Used only in earlier micro-batches (under no_sync()): ready already.
        used_now = set(self.core.plain_used())
        for index in indices:
            if index not in used_now:
                round_.mark_ready(index)
        return round_

    def _grad_ready(self, index: int, param: torch.Tensor) -> None:
        if self._forward_open and not self._callback_queued and self._core is not None:
            # A backward inside the root's forward, not through its outputs: it ends the
            # iteration as one through them would (its own if an earlier one ended it).
            self._core.bind_inside_forward(index)
            self._backward_starts(None)
        round_ = self._round
        if round_ is None or index not in round_.bucket_of:
            return
        if index in round_.ready:
            if round_.bucket_of[index] < round_.started:
                round_.grew_after_start = True
            return
        if self._observed is not None and self._order is None:
            self._observed.append(index)
        round_.mark_ready(index)
        # The last bucket waits for the end of the backward: the flags travel with it.
        while round_.next_ready():
            self._start_bucket(round_)

    def _start_bucket(self, round_: BucketRound, extra: Sequence[torch.Tensor] = ()) -> None:
        core = self.core
        if round_.started == 0:
            core.settle_agreement()
        grads = []
        for index in round_.buckets[round_.started]:
            param = core.tensor(index)
            if param.grad is None:
                # Used, but this rank's backward did not reach it: zeros (see above).
                param.grad = torch.zeros_like(param)
                round_.zero_filled.add(index)
            grads.append(param.grad)
        self._reduction.start_all_reduce_whole(
            [*grads, *extra], float(self.world_size), slot=round_.started
        )
        round_.started += 1

    def _end_backward(self) -> None:
        self._callback_queued = False
        core = self.core
        round_, self._round = self._round, None
        if core.phase is not Phase.COMPUTING:
            raise StateError(
                "a second backward through a forward whose backward already ran "
                "(retain_graph=True), or the backward of an earlier forward after a later "
                "forward's (several forwards, then their backwards): flatview reduces once "
                "per forward, for the last one; run each forward's backward before the next "
                "forward"
            )
        if self._synced:
            indices = self._reduced_now()
            self._window = set()
            filled: set[int] = set()
            if round_ is not None and round_.grew_after_start:
                # Some gradient grew after its bucket started: start over, whole.
                self._reduction.wait_in_flight(discard=True)
                filled, round_ = round_.zero_filled, None
            if round_ is None:
                # Nothing overlapped: as few buckets as the bucket size allows.
                round_ = self._plan_round(indices, self._bucket_bytes)
            self._finish(indices, round_, filled | round_.zero_filled)
        else:
            self._window.update(self._reduced_now())
        core.end_backward(self._synced)

    # -------------------------------------------------------------- reduction

    @torch.no_grad()
    def _finish(self, indices: list[int], round_: BucketRound, filled: set[int]) -> None:
        """Start what ``round_`` has not started of the reduction (average) of the
        parameters ``indices``, and wait for all of it; ``filled`` are those given zeros
        so far for want of a gradient.

        One flag per parameter travels in the last bucket: whether this rank's backward
        gave it a gradient. A parameter that no rank's did was left out of the model
        without being declared skipped: it keeps ``None`` and every rank raises
        :class:`UndeclaredUnusedError` after the collective (DDP would have hung or
        raised at the next forward)."""
        if not indices:
            return  # everything skipped or frozen, on every rank alike
        core = self.core
        core.settle_agreement()
        params = [core.tensor(index) for index in indices]
        had = [p.grad is not None and i not in filled for p, i in zip(params, indices, strict=True)]
        # In the parameters' dtype, so that they can share the last bucket's all-reduce.
        dtype = params[-1].dtype if params[-1].dtype.is_floating_point else torch.float32
        # Ones, and a fill per missing gradient: a copy from the host would wait for the
        # GPU to finish the backward.
        flags = torch.ones(len(had), dtype=dtype, device=params[-1].device)
        for k, present in enumerate(had):
            if not present:
                flags[k] = 0
        while round_.started < len(round_.buckets) - 1:
            self._start_bucket(round_)
        tail = core.tensor(round_.buckets[-1][-1])
        same = tail.dtype == flags.dtype and tail.device == flags.device
        self._start_bucket(round_, (flags,) if same else ())
        if not same:
            self._reduction.start_all_reduce_whole(
                [flags], float(self.world_size), slot=round_.started
            )
        self._reduction.wait_in_flight()
        if all(had):
            # This rank's own flags make every sum positive; reading them back would only
            # make the host wait for the GPU.
            return
        unused = [k for k, v in enumerate(flags.tolist()) if v == 0]
        if unused:
            for k in unused:
                params[k].grad = None
            names = [core.name(indices[k]) for k in unused]
            raise UndeclaredUnusedError(
                f"parameter(s) {', '.join(repr(n) for n in names)} got no gradient on any "
                "rank in this backward pass, but are not declared skipped. Pass what a step "
                "does not use to FlatView.step(skip=...)."
            )
