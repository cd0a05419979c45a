"""The gradient synchronisation of a replicating wrapper, done by flatview:
:class:`ReplicatedBackward`, the component that the adapters of DDP
(:mod:`flatview.backends.ddp`) and of torch FSDP1 computed on views
(:mod:`flatview.backends.torch_replicated`) are built around. Every rank holds every
parameter whole, the wrapper's own gradient communication stays idle, and flatview
all-reduces the used gradients itself. The adapter keeps its wrapper quiet, says whether
the next backward synchronises, and calls :meth:`ReplicatedBackward.begin_forward` and
:meth:`ReplicatedBackward.end_forward` around the root's forward.

* The end of a backward: hooks on the forward's outputs fire when the backward reaches
  them and queue a callback that autograd runs when the whole backward is done.
* The reduction, in a synchronising backward, overlaps the backward as DDP's does: the
  parameters to reduce (used since the last synchronising backward: the runtime's
  ``no_sync()`` window) are cut into buckets in the order the backward is expected to
  produce their gradients (:mod:`flatview.backends.bucket_order`; a first bucket of DDP's
  first-bucket size, 1 MiB, then the wrapper's bucket size); a hook on each parameter
  marks its gradient ready, and the next bucket whose gradients are all ready starts its
  all-reduce (an average, as DDP's: NCCL's ``AVG``, elsewhere divided by the world size
  first), in bucket order on every rank. The end-of-backward callback starts what is
  left and waits for everything.
* A gradient accumulated again after its bucket started (a parameter that takes part in
  two graph tasks of one backward, as with reentrant checkpointing) would be reduced
  without its second part: the callback then waits for the buckets in flight, discards
  their results and reduces everything again (``overlap_reduction=False``
  avoids the waste for models that always do this). A forward inside the backward
  (checkpointing around the whole model recomputes it) is not a new iteration.
* Nothing in a step waits for the GPU (as DDP's reducer does not): the flags below are
  made on the device and read back only on a rank that lacks a gradient, and the
  skip-set check reads its fingerprints through a side stream (``comm/agreement.py``).
  ``benchmarks/gpu_smoke.py`` checks it with ``torch.cuda.set_sync_debug_mode``. The
  one exception is the broadcast of the learnt bucket order, once.
* A backward inside the root's forward (Lightning's Trainer runs ``training_step``, the
  user's forward and ``manual_backward`` included, inside the wrapper's forward) does not
  go through the forward's outputs: the adapter brackets the call of the root's forward
  with :meth:`ReplicatedBackward.root_forward`, and while it runs the first gradient
  ready binds the iteration (:meth:`flatview.runtime.Runtime.bind_inside_forward`) and
  queues the end of that backward, reduced as any other (one per backward; the forward
  communicated nothing the skip set decides, :mod:`flatview.binding`).
* Overlap is off by default on CPU (``wrap(overlap_reduction=)``): there the collectives
  compete with the backward for the same cores, and one all-reduce at the end was
  faster.

A parameter not in the skip set is used: if this rank's backward gave it no gradient,
it contributes zeros (some other rank's backward did reach it: DDP's
``find_unused_parameters`` gives the same). If no rank's backward reached it, the
model left it out without declaring it: it keeps ``None`` and every rank raises
:class:`~flatview.errors.UndeclaredUnusedError`, learnt from one flag per parameter that
travels in the last bucket (:class:`~flatview.comm.unused.UsageFlags`), so it costs no
extra collective.
"""

from __future__ import annotations

import contextlib
import enum
import operator
from collections.abc import Iterator, Sequence
from itertools import repeat
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from flatview.autograd import at_end_of_backward, in_backward, weakly
from flatview.backends.base import Adapter, Runtime
from flatview.backends.bucket_order import BucketPlans
from flatview.backends.patches import Patches
from flatview.comm.bucketing import FIRST_BUCKET_BYTES, BucketRound
from flatview.comm.options import ReduceOptions
from flatview.comm.replicated import Compression, ReplicatedReduction
from flatview.comm.unused import (
    UsageFlags,
    gradients_taken_in_backward,
    replaced_parameters,
    undeclared_unused,
)
from flatview.errors import FlatViewError, StateError
from flatview.phase import Phase
from flatview.states import Transitions

_KEPT = 256
"""Sets of used parameters whose reduced indices are kept (skip sets vary: recent ones)."""


class Pass(enum.Enum):
    """Where the last forward's iteration is, and whether its backward reduces (the
    wrapper's ``no_sync()`` was off at the forward) or accumulates."""

    REDUCING = "a forward ran; its backward will reduce"
    ACCUMULATING = "a forward ran under no_sync(); its backward will accumulate"
    REDUCING_BACKWARD = "the backward runs and will reduce; its end is queued"
    ACCUMULATING_BACKWARD = "the backward runs and accumulates; its end is queued"

    @property
    def reduces(self) -> bool:
        return self in (Pass.REDUCING, Pass.REDUCING_BACKWARD)

    @property
    def in_backward(self) -> bool:
        return self in (Pass.REDUCING_BACKWARD, Pass.ACCUMULATING_BACKWARD)


_FORWARDS = (Pass.REDUCING, Pass.ACCUMULATING)
_PASS_MOVES = {
    # A forward may follow anything: after a backward that raised (its end never ran),
    # the next forward starts afresh.
    Pass.REDUCING: (*_FORWARDS, Pass.REDUCING_BACKWARD),
    Pass.ACCUMULATING: (*_FORWARDS, Pass.ACCUMULATING_BACKWARD),
    Pass.REDUCING_BACKWARD: _FORWARDS,
    Pass.ACCUMULATING_BACKWARD: _FORWARDS,
}


class RootForward(enum.Enum):
    """Whether the root's forward is running (not a recomputation inside a backward): a
    backward that starts meanwhile runs inside it, through tensors that are not its
    outputs, and the first gradient ready shows where it begins."""

    RETURNED = "no root forward runs"
    RUNNING = "the root's forward runs: a backward now is one inside it"


_ROOT_MOVES = {
    RootForward.RETURNED: (RootForward.RUNNING,),
    RootForward.RUNNING: (RootForward.RETURNED,),
}


class ReplicatedBackward:
    """flatview's reduction of a replicating wrapper's gradients, and the bookkeeping of
    each iteration's end (see the module docstring).

    ``params``: (first name, parameter) in registration order; ``reduced``: ids of
    those flatview all-reduces; ``bucket_bytes``: the wrapper's bucket size; ``adapter``:
    whose group, rank, world size, device and bucket size the reduction works with;
    ``model``: the wrapped model, whose parameters are read only to explain an error."""

    def __init__(
        self,
        params: list[tuple[str, nn.Parameter]],
        reduced: set[int],
        bucket_bytes: int,
        options: ReduceOptions,
        adapter: Adapter,
        model: nn.Module,
        compression: Compression | None = None,
    ) -> None:
        self.params = params
        self.compression = compression
        """How each bucket travels (DDP's communication hook; ``None``: no hook)."""
        self._model = model
        self.reduced = reduced
        self.options = options
        self.group = adapter.group
        self.rank = adapter.rank
        self.world_size = adapter.world_size
        self.bucket_numel = adapter.bucket_numel
        device = adapter.device
        self._first_bucket_bytes = min(FIRST_BUCKET_BYTES, bucket_bytes)
        self._plans = BucketPlans(bucket_bytes)
        self._round: BucketRound | None = None
        overlap = options.overlap
        self.overlap = device.type != "cpu" if overlap is None else overlap
        """Start each bucket's all-reduce as soon as its gradients are ready (as DDP
        does); ``False``: everything at the end of the backward, in as few collectives
        as the bucket size allows (``ReduceOptions.overlap``). On by default except on
        CPU, where the collectives run on the cores the backward computes on: there (2
        processes over gloo, ``benchmarks/README.md``) overlapping took 1.08-1.20x the
        ideal's step time against 1.02-1.14x without."""
        self._pass = Transitions(Pass.REDUCING, _PASS_MOVES)
        self._root = Transitions(RootForward.RETURNED, _ROOT_MOVES)
        self._runtime: Runtime | None = None

    @property
    def runtime(self) -> Runtime:
        assert self._runtime is not None, "ReplicatedBackward used before install()"
        return self._runtime

    @property
    def reduces(self) -> bool:
        """Whether the last forward's backward reduces (``no_sync()`` was off)."""
        return self._pass.state.reduces

    def install(self, runtime: Runtime, patches: Patches) -> None:
        """Make the reduction (with the runtime's ledger) and hook every parameter
        flatview reduces, to learn when its gradient is ready."""
        self._runtime = runtime
        self._reduction = ReplicatedReduction(
            self.group,
            self.rank,
            self.world_size,
            runtime.ledger,
            self.options,
            self.bucket_numel,
            self.compression,
        )
        self._tensors: dict[int, nn.Parameter] = {}
        """Per runtime index of a parameter flatview reduces, the parameter (plain: the
        table never replaces it)."""
        self._patches = patches
        self._unhooked: dict[int, nn.Parameter] = {}
        """Parameters flatview reduces that were frozen at the wrap (LoRA's base, a frozen
        backbone): torch hooks only a tensor that requires grad, so each is hooked once
        it trains (:meth:`_hook_unfrozen`)."""
        self._checked: frozenset[int] | None = None
        """The used set :meth:`_hook_unfrozen` last looked at (the same object while the
        skip set and the frozen parameters stay the same)."""
        for _, param in self.params:
            index = runtime.index_of(param)
            if index is not None and id(param) in self.reduced:
                self._tensors[index] = param
                if param.requires_grad:
                    self._hook(index, param)
                else:
                    self._unhooked[index] = param
        self._reduced_of: dict[frozenset[int], list[int]] = {}
        """Per set of parameters used (a skip set's, or with the window's), those
        flatview reduces, in model order (skip sets repeat)."""

    def _hook(self, index: int, param: nn.Parameter) -> None:
        # Also without overlap: the first gradient ready is what shows a backward inside
        # the root's forward (root_forward), which nothing else sees. It costs one Python
        # call per gradient and backward (about 1-2 µs on this project's 2-core CPU,
        # benchmarks/README.md's scale section).
        ready = weakly(self._grad_ready, index)
        self._patches.hook(param.register_post_accumulate_grad_hook(ready))

    def _hook_unfrozen(self) -> None:
        """Hook the parameters frozen at the wrap that this iteration trains, before its
        backward."""
        used = self.runtime.plain_used()
        if used is self._checked:
            return
        self._checked = used
        for index in [i for i in self._unhooked if i in used]:
            self._hook(index, self._unhooked.pop(index))

    def uninstall(self) -> None:
        self._round = None
        self._plans.forget()

    # -------------------------------------------------------------- lifecycle

    def begin_forward(self, synced: bool) -> None:
        """The root's forward starts a new iteration (not a recomputation inside a
        backward: the caller checks :func:`flatview.autograd.in_backward` first);
        ``synced``: whether its backward reduces (the wrapper's ``no_sync()`` is off)."""
        runtime = self.runtime
        if self._round is not None or self._pass.state.in_backward:
            # The last backward raised before it ended (its end callback never ran):
            # what it started is stale.
            self._round = None
            self._reduction.wait_in_flight(discard=True)
        runtime.begin_compute(outermost=True)
        if self._unhooked:
            self._hook_unfrozen()
        runtime.guard_skipped_plain()
        self._pass.move(Pass.REDUCING if synced else Pass.ACCUMULATING)
        if self._plans.observing and synced and torch.is_grad_enabled():
            # A collective: a rank that failed in step() must have been heard first.
            runtime.settle_agreement()
            registration = [i for _, p in self.params if (i := runtime.index_of(p)) is not None]
            self._plans.learn(registration, self.group)

    def end_forward(self, output: Any) -> bool:
        """The root's forward returned ``output``: whether a backward is to follow."""
        # The skip-set check ran alongside the forward: its errors raise here, from the
        # forward, not from the middle of the backward.
        self.runtime.settle_agreement()
        if output is None or not torch.is_grad_enabled():
            self.runtime.end_forward_only()
            return False
        for leaf in tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                # Not kept for uninstall: these die with the output.
                leaf.register_hook(self._backward_starts)
        return True

    @contextlib.contextmanager
    def root_forward(self) -> Iterator[None]:
        """Around the adapter's call of the root's forward: while it runs, a backward is
        one inside the forward. Returned however the forward ends, ``BaseException``
        included; a recomputation inside a backward (or a nested call) changes nothing."""
        if self._root.state is RootForward.RUNNING or in_backward():
            yield
            return
        self._root.move(RootForward.RUNNING)
        try:
            yield
        finally:
            self._root.move(RootForward.RETURNED)

    def _backward_starts(self, grad: torch.Tensor | None) -> None:
        state = self._pass.state
        if self._runtime is None or state.in_backward:
            return
        self._runtime.check_backward_binding()
        self._pass.move(Pass.REDUCING_BACKWARD if state.reduces else Pass.ACCUMULATING_BACKWARD)
        at_end_of_backward(self._end_backward)
        if state.reduces and self.overlap:
            self._round = self._plans.round(
                *self._reduced_now(), self._first_bucket_bytes, self._tensors
            )
            self._plans.observe_next_backward()  # _grad_ready records this backward's order

    def _reduced_now(self) -> tuple[list[int], frozenset[int]]:
        """Runtime indices to reduce at this synchronising backward, in model order: the
        parameters flatview reduces that were used since the last synchronising one; and
        those this iteration uses (the others were used only in earlier backwards)."""
        runtime = self.runtime
        so_far = runtime.plain_used_so_far()
        found = self._reduced_of.get(so_far)
        if found is None:
            if len(self._reduced_of) >= _KEPT:
                self._reduced_of.clear()  # skip sets vary: recent ones only
            tensors = self._tensors
            found = self._reduced_of[so_far] = sorted(i for i in so_far if i in tensors)
        return found, runtime.plain_used()

    def _grad_ready(self, index: int, param: torch.Tensor) -> None:
        if (
            self._root.state is RootForward.RUNNING
            and not self._pass.state.in_backward
            and self._runtime is not None
        ):
            # A backward inside the root's forward, not through its outputs: it ends the
            # iteration as one through them would (its own if an earlier one ended it).
            self._runtime.bind_inside_forward(index)
            self._backward_starts(None)
        round_ = self._round
        if round_ is None or index not in round_.bucket_of:
            return
        if index in round_.ready:
            if round_.bucket_of[index] < round_.started:
                round_.grew_after_start = True
            return
        self._plans.ready(index)
        round_.mark_ready(index)
        # The last bucket waits for the end of the backward: the flags travel with it.
        while round_.next_ready():
            self._start_bucket(round_)

    def _start_bucket(self, round_: BucketRound, extra: Sequence[torch.Tensor] = ()) -> None:
        if round_.started == 0:
            self.runtime.settle_agreement()
        params = round_.members[round_.started]
        grads = [param.grad for param in params]
        # (By identity: `None in grads` would compare tensors with ==.)
        if any(map(operator.is_, grads, repeat(None))):
            for position, (index, param) in enumerate(
                zip(round_.buckets[round_.started], params, strict=True)
            ):
                if param.grad is None:
                    # Used, but this rank's backward did not reach it: zeros (see above).
                    param.grad = torch.zeros_like(param)
                    round_.zero_filled.add(index)
                    grads[position] = param.grad
        self._reduction.start_all_reduce_tensors(
            [*grads, *extra], float(self.world_size), slot=round_.started
        )
        round_.started += 1

    def _end_backward(self) -> None:
        state = self._pass.state
        self._pass.move(Pass.REDUCING if state.reduces else Pass.ACCUMULATING)
        runtime = self.runtime
        round_, self._round = self._round, None
        if runtime.phase is not Phase.COMPUTING:
            raise StateError(
                "a second backward through a forward whose backward already ran "
                "(retain_graph=True), or the backward of an earlier forward after a later "
                "forward's (several forwards, then their backwards): flatview reduces once "
                "per forward, for the last one; run each forward's backward before the next "
                "forward"
            )
        if state.reduces:
            indices, used = self._reduced_now()
            # Reduced now: should the reduction raise, the next backward starts a window.
            runtime.forget_plain_window()
            filled: set[int] = set()
            if round_ is not None and round_.grew_after_start:
                # Some gradient grew after its bucket started: start over, every bucket.
                self._reduction.wait_in_flight(discard=True)
                filled, round_ = round_.zero_filled, None
            if round_ is None:
                # Nothing overlapped: as few buckets as the bucket size allows.
                round_ = self._plans.round(indices, used, self._plans.bucket_bytes, self._tensors)
            self._finish(indices, round_, filled | round_.zero_filled)
        runtime.end_backward(state.reduces)

    # -------------------------------------------------------------- reduction

    def _unused_error(self, named: dict[str, nn.Parameter]) -> FlatViewError:
        """The error for parameters (by name) no rank's backward gave a gradient, naming
        the cause where it is not a skip left undeclared: a tensor the model no longer
        holds, or a user's post-accumulate-grad hook (beside flatview's own one, see
        :meth:`install`) that took the gradient inside the backward."""
        held = {id(p) for p in self._model.parameters()}
        replaced = [name for name, p in named.items() if id(p) not in held]
        if replaced:
            return replaced_parameters(replaced)
        hooked = [
            name
            for name, p in named.items()
            if len(getattr(p, "_post_accumulate_grad_hooks", None) or ()) > 1
        ]
        if hooked:
            return gradients_taken_in_backward(hooked)
        return undeclared_unused("parameter(s)", list(named), "any rank")

    @torch.no_grad()
    def _finish(self, indices: list[int], round_: BucketRound, filled: set[int]) -> None:
        """Start what ``round_`` has not started of the reduction (average) of the
        parameters ``indices``, and wait for all of it; ``filled`` are those given zeros
        so far for want of a gradient.

        The flags of :class:`~flatview.comm.unused.UsageFlags` travel in the last bucket:
        a parameter that no rank's backward gave a gradient was left out of the model
        without being declared skipped: it keeps ``None`` and every rank raises after the
        collective (DDP would have hung or raised at the next forward)."""
        if not indices:
            return  # everything skipped or frozen, on every rank alike
        runtime = self.runtime
        runtime.settle_agreement()
        tensors = self._tensors
        params = [tensors[index] for index in indices]
        gave = [p.grad is not None for p in params]
        if filled:
            gave = [g and i not in filled for g, i in zip(gave, indices, strict=True)]
        # In the parameters' dtype, so that they can share the last bucket's all-reduce.
        dtype = params[-1].dtype if params[-1].dtype.is_floating_point else torch.float32
        flags = UsageFlags.carried(gave, dtype, params[-1].device)
        while round_.started < len(round_.buckets) - 1:
            self._start_bucket(round_)
        tail = round_.members[-1][-1]
        same = tail.dtype == flags.tensor.dtype and tail.device == flags.tensor.device
        self._start_bucket(round_, (flags.tensor,) if same else ())
        if not same:
            self._reduction.start_all_reduce_tensors(
                [flags.tensor], float(self.world_size), slot=round_.started
            )
        self._reduction.wait_in_flight()
        unused = flags.unused()
        if unused:
            for k in unused:
                params[k].grad = None
            named = {runtime.name(indices[k]): params[k] for k in unused}
            raise self._unused_error(named)
