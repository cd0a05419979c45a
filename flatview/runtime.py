"""The runtime that backend adapters drive: :class:`Runtime`.

One per wrapped model, made by :class:`flatview.FlatView` and handed to the adapter's
``install``. It owns the phase (:class:`~flatview.phase.Phase`) and its transitions, the
step in force and the iteration bound to each forward (:mod:`flatview.iteration`), the
skip-set agreement, the guards on skipped parameters (:mod:`flatview.guards`), the masks
of the reduction and the all-gather, the window of what was used since the last
synchronising backward (gradient accumulation under ``no_sync()``: segments of flat and
plain parameters, every adapter), lending the model to a wrapper operation, carrying what
was written through views back into the shards, and what :attr:`flatview.FlatView.stats`
is computed from. An iteration computes until each of its root forwards has had its
backward (several forwards, then their backwards).

Adapters call only the members of the ``Runtime`` protocol of
:mod:`flatview.backends.base`; the user's handle calls the rest.

How a step's skip set flows: ``FlatView.step(skip)`` -> :meth:`Runtime.step` resolves it
(:meth:`flatview.table.ParamTable.resolve`) and starts its agreement check -> the root
unit's forward calls :meth:`Runtime.begin_compute`, which binds it to the iteration
(:func:`flatview.iteration.bind`: per flat parameter, the *read* and *used* segments) ->
the adapter asks :meth:`Runtime.gather_plan` (read segments) before each all-gather and
:meth:`Runtime.reduction_plan` (used segments, joined with the ``no_sync()`` window)
before each reduction -> :meth:`Runtime.end_backward` hands the used gradients to the
views.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from flatview.accounting import StatsSource, step_stats
from flatview.autograd import in_backward
from flatview.backends.base import Adapter
from flatview.binding import backward_outside_step, backward_without_forward, check_step_entry
from flatview.comm.gather import masked_all_gather, masking_pays
from flatview.comm.ledger import Ledger
from flatview.comm.packing import plan_index
from flatview.errors import FlatViewError, StateError
from flatview.guards import SkipGuards
from flatview.iteration import Binder, Iteration
from flatview.layout import MaskPlan
from flatview.leftovers import Leftovers
from flatview.model_views import ModelViews
from flatview.phase import Phase
from flatview.skip import SkipSet, skipped_unit_called, skipped_used
from flatview.stats import StepStats
from flatview.step_agreement import SkipAgreement
from flatview.table import FlatRecord, ParamTable
from flatview.view_hooks import refuse_view_hooks
from flatview.window import UsedWindow
from flatview.wrapped_models import forget_checks


class Runtime:
    """The lifecycle of one wrapped model, as its adapter drives it (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        adapter: Adapter,
        table: ParamTable,
        *,
        check_skip_agreement: bool,
    ) -> None:
        self.model = model
        self.adapter = adapter
        self.table = table
        self.check_skip_agreement = check_skip_agreement
        self.ledger = Ledger()
        """Bytes and calls of flatview's own collectives since the iteration began."""
        self.phase = Phase.IDLE
        """Where the model is in its lifecycle: views are registered only in ``IDLE``."""
        # The last backward's StepStats, or their source (most steps nobody reads them).
        self._stats: StatsSource | StepStats | None = None

        self._step_skip: frozenset[int] | None = None
        self._agreement = SkipAgreement(table, adapter, self.ledger)
        """The step's skip-set check, while it runs alongside the forward."""
        self._step_count = 0
        self._awaiting = 0  # root forwards (with autograd) still awaiting their backward
        self.iteration: Iteration | None = None
        """The iteration bound to the forward in flight (or the last one)."""
        self._window = UsedWindow()  # what the backwards under no_sync() used
        self._guards = SkipGuards(table)
        self._binder = Binder(table)
        self._leftovers = Leftovers(adapter.release_unsharded)  # flatview.leftovers
        armed = not adapter.computes_on_views  # autograd never reaches the views
        self.views = ModelViews(table, model, adapter.clean_name, adapter.view_owners(), armed)

    # ------------------------------------------------------------------ phases

    def _move(self, expected: Phase, to: Phase) -> None:
        """The one way the phase changes: from ``expected`` (asserted) to ``to``."""
        assert self.phase is expected, f"{expected.name} -> {to.name} in {self.phase.name}"
        self.phase = to

    @property
    def accumulating(self) -> bool:
        """Inside a ``no_sync()`` window: the flat parameters hold unreduced, unsharded
        accumulated gradients that the views do not see yet."""
        return self._window.open

    # -------------------------------------------------------------------- steps

    @contextlib.contextmanager
    def step(self, skip: SkipSet, checked: bool, *, at_once: bool = False) -> Iterator[None]:
        """The body of :meth:`flatview.FlatView.step`, with ``checked`` the agreement
        check's setting; ``at_once``: checked now even under ``no_sync()``."""
        failure: FlatViewError | None = None
        skipped: frozenset[int] = frozenset()
        inside = False  # entered inside the root's forward (flatview.binding)
        try:
            nested = self._step_skip is not None
            inside = check_step_entry(self.phase, nested, self.model, self.adapter)
            skipped = self.table.resolve(skip)
            refuse_view_hooks(self.table, self.adapter, first_step=self._step_count == 0)
        except FlatViewError as err:
            if not checked:
                raise
            failure = err
        if failure is None:
            self.ledger.reset()
        if checked:
            # One left by an outside-step forward that raised: heard before this one.
            self.settle_agreement()
            self._agreement.start(skipped, failure=failure, at_once=at_once)
        self._step_count += 1
        self._step_skip = skipped
        try:
            if inside:
                self.bind_inside_forward()
            yield
        except BaseException:
            self._abandon_iteration()
            raise
        finally:
            self._step_skip = None
            self.settle_agreement()

    def bind_inside_forward(self, first: int | None = None) -> None:
        """Bind the step in force inside the root's forward (:mod:`flatview.binding`): to
        the iteration in flight (a step entered there), or to a new one for a backward
        begun there while none computes (``first``, whose gradient showed it, had its
        guard fire before: a skipped one raises :class:`SkippedParameterUsedError`)."""
        if self.phase is Phase.IDLE:
            self._start_compute()
        elif first is not None:
            return  # the iteration in flight is this backward's
        else:
            self._guards.remove()
            self._detach_grads()
        self._bind_iteration()
        self.guard_skipped_plain()
        if first is not None and self.iteration is not None and first in self.iteration.skipped:
            raise skipped_used(self.table.name(first))

    def _abandon_iteration(self) -> None:
        """The body of a step raised: whatever its forward started (guards on the
        compute tensors, the phase) is dropped, so that the next forward starts afresh."""
        if self.phase is Phase.COMPUTING and not in_backward():
            self._end_compute()

    def check_backward_binding(self) -> None:
        """Refuse the backward of a forward that ran outside the step in flight: the
        step's skip set would not apply to it (adapters call this before it communicates)."""
        self._agreement.cover_deferred()  # a step begun under no_sync() synchronises
        if self._step_skip is None or self.phase is not Phase.COMPUTING:
            return
        iteration = self.iteration
        if iteration is not None and iteration.declared and iteration.step == self._step_count:
            return
        raise backward_outside_step()

    def settle_agreement(self) -> None:
        """Wait for the skip-set check of the step in flight if it still runs (adapters
        that overlap it with the forward call this before their first collective),
        raising :class:`~flatview.errors.SkipSetMismatchError` on every rank if ranks
        disagree."""
        try:
            self._agreement.settle()
        except BaseException:
            if self._agreement.failed_outside:
                # Nothing abandons an iteration outside a step: forget it, so that the
                # next root forward starts (and checks) a new one on every rank alike.
                self.iteration = None
            raise

    # ------------------------------------------------------------ compute begins

    def begin_compute(self, outermost: bool) -> None:
        """A unit's forward is about to run: views step aside, the skip set binds.

        ``outermost`` says it is the root unit's forward: a new iteration. When one starts
        while the last is still computing, that one's forward was never followed by a
        backward (a validation pass with autograd on); gradients zeroed since must still
        reach the flat parameters. Inner units start again during backward when
        activation checkpointing recomputes them, and must not touch gradients then.
        """
        self.check_not_lent()
        trains = outermost and torch.is_grad_enabled() and not in_backward()
        if trains:
            # On the shards as they are, not on a copy left by forwards without backward.
            last = self.iteration
            old = last is not None and last.step != self._step_count
            self._leftovers.release(abandoned=old and self.phase is Phase.COMPUTING)
        agreed = self._agree_outside_step(outermost)
        if trains:
            self._awaiting += 1
        if self.phase is Phase.IDLE:
            self._start_compute()
            self._bind_iteration(reset_ledger=not agreed)
        elif outermost:
            fresh = not in_backward()
            if fresh:
                # The last iteration never ended (a forward without backward, or a backward
                # that raised): its guards belong to compute tensors no backward will use.
                self._guards.remove()
            self._detach_grads()
            iteration = self.iteration
            if (
                iteration is None
                or iteration.step != self._step_count
                or (fresh and iteration.declared != (self._step_skip is not None))
            ):
                self._bind_iteration(reset_ledger=not agreed)

    def _start_compute(self) -> None:
        """IDLE -> COMPUTING: views step aside (what was written through them kept)."""
        self.views.check_parametrizations()
        self.write_back()
        self._detach_grads()
        self.views.hide()
        self._move(Phase.IDLE, Phase.COMPUTING)

    def _agree_outside_step(self, outermost: bool) -> bool:
        """An iteration starts outside any step (a root forward with autograd on, not a
        recomputation inside a backward, after a backward or a step): with the check on,
        it takes part in the same all-gather as a checked step, as one skipping nothing,
        so that a rank inside a checked step pairs its check with this one instead of
        with a collective of the wrapper's; every rank raises if they differ. Returns
        whether it was exchanged (its bytes are in the fresh ledger).

        Forwards without autograd (evaluation) exchange nothing: on DDP and ``NO_SHARD``
        they communicate nothing, and a rank may evaluate alone."""
        if (
            not outermost
            or not self.check_skip_agreement
            or self._step_skip is not None
            or not torch.is_grad_enabled()
            or in_backward()
        ):
            return False
        iteration = self.iteration
        if self.phase is not Phase.IDLE and not (
            iteration is None or iteration.step != self._step_count or iteration.declared
        ):
            return False  # a second forward of the same iteration (no backward between)
        # A check left unsettled by a forward that raised: hear it before the next.
        self.settle_agreement()
        self.ledger.reset()
        return self._agreement.start(frozenset(), outside=True)

    def _detach_grads(self) -> None:
        # The wrapper computes a fresh gradient; the views keep theirs until the synced
        # backward adds the two (so a zero_grad between forward and backward counts).
        # Under no_sync() they were detached when the window opened.
        if not self._window.open:
            self.views.detach_grads()

    def write_back(self) -> None:
        """Carry values written through views (``view.data = t``, a new parameter set in
        a view's place) into the shards before the wrapper reads them; a replacing
        parameter becomes the view."""
        if self.views.write_back():
            # The model's parameters changed identity: check every optimizer again.
            forget_checks()

    def check_not_lent(self) -> None:
        """Refuse a unit's forward inside a wrapper operation that does not cover the
        unit (summoned units run on the summoned parameters instead)."""
        if self.phase is Phase.LENT:
            raise StateError(
                "a forward pass started inside a wrapper operation (state_dict, "
                "summon_full_params, ...) through an FSDP unit that operation does not "
                "cover: finish that first, or summon the whole model (summon_full_params "
                "with recurse=True), inside which forwards run on the summoned parameters"
            )

    def push_grads(self) -> None:
        """Make the flat gradients say what the view gradients say (before a wrapper
        operation or unwrap reads them)."""
        if not self._window.open:
            self.views.push_grads()

    def _bind_iteration(self, *, reset_ledger: bool = True) -> None:
        self._awaiting = 1  # forwards of an earlier iteration get no backward now
        skipped = self._step_skip or frozenset()
        if self._step_skip is None and reset_ledger:
            self.ledger.reset()
        self.iteration = self._binder.bind(
            skipped, self._step_count, declared=self._step_skip is not None
        )

    # -------------------------------------------------------------- skip binding

    def check_unit_forward(self, unit: int) -> None:
        """Refuse to run a non-root unit whose parameters are all declared skipped
        (``Binding.uncallable_units``): its all-gather would be wasted and its gradient
        dropped."""
        iteration = self.iteration
        if iteration is not None and unit in iteration.binding.uncallable_units:
            raise skipped_unit_called(self.table.units[unit].name)

    def unit_skipped(self, unit: int) -> bool:
        """Whether every managed parameter of ``unit`` is skipped now (``skipped_units``)."""
        return self.iteration is not None and unit in self.iteration.skipped_units

    def _skipping(self, flat: nn.Parameter) -> tuple[Iteration, FlatRecord] | None:
        """The iteration in flight and ``flat``'s record, if anything is skipped now."""
        iteration = self.iteration
        record = self.table.flat_record(flat)
        if self.phase is not Phase.COMPUTING or iteration is None or record is None:
            return None
        return (iteration, record) if iteration.skipped else None

    def skipped_segments(self, flat: nn.Parameter) -> Sequence[tuple[int, str]]:
        """(segment, name) of the segments of ``flat`` skipped in the current iteration."""
        found = self._skipping(flat)
        if found is None:
            return ()
        iteration, record = found
        return iteration.binding.skipped_segments[record.index]

    def guard_skipped(self, flat: nn.Parameter) -> None:
        """Hook the compute tensors the wrapper just set on the submodules for the
        skipped parameters of ``flat``: if the model uses one, backward raises."""
        record = self.table.flat_record(flat)
        if record is None:
            return
        self._guards.guard_segments(record, self.skipped_segments(flat))

    def guard_skipped_plain(self) -> None:
        """Hook the skipped plain parameters (registered as they are, not flattened):
        if the model uses one in this iteration, backward raises (see
        :mod:`flatview.guards`)."""
        iteration = self.iteration
        if iteration is None:
            return
        self._guards.guard_plain(self, iteration)

    def plain_used(self) -> frozenset[int]:
        """Indices of the managed plain parameters trained in the iteration in flight
        (``ParamTable.managed_plain``)."""
        return self.iteration.plain_used if self.iteration is not None else frozenset()

    def index_of(self, tensor: torch.Tensor) -> int | None:
        """The index of the original parameter ``tensor`` is (view or plain), if any."""
        return self.table.index_of(tensor)

    def tensor(self, index: int) -> nn.Parameter:
        """Original parameter ``index``: its view, or the plain parameter itself."""
        return self.table.tensor(index)

    def name(self, index: int) -> str:
        """The original name of parameter ``index``."""
        return self.table.name(index)

    # ------------------------------------------------------------ communication

    def reduction_plan(self, flat: nn.Parameter, *, window: bool = True) -> MaskPlan | None:
        """The mask for reducing ``flat``'s gradient now (``window``: what the backwards
        since the last synchronising one used too, as the wrapper reduces their sum), or
        ``None`` if it is unknown."""
        record = self.table.flat_record(flat)
        if record is None:
            return None
        self.check_backward_binding()
        return record.plan(self._used_so_far(record.index, window))

    def gather_plan(self, flat: nn.Parameter, min_saved: int) -> MaskPlan | None:
        """The mask for all-gathering ``flat`` in this iteration, or ``None`` to gather it
        whole (nothing skipped in it, or too little for masking to pay: see
        :func:`~flatview.comm.gather.masking_pays` for ``min_saved``)."""
        found = self._skipping(flat)
        if found is None or self._agreement.deferred:
            return None  # unchecked yet (no_sync()): whole, as the wrapper, on every rank
        iteration, record = found
        if iteration.binding.read_all[record.index]:
            return None
        plan = record.plan(iteration.read[record.index])
        return plan if masking_pays(plan, min_saved) else None

    def gather_masked(
        self, rows: Sequence[torch.Tensor], local_shard: torch.Tensor, plan: MaskPlan, unit: int
    ) -> None:
        """All-gather ``plan``'s elements into ``rows`` in ``unit``'s group (comm.gather)."""
        own = self.table.units[unit].group
        where = (own.rank, own.group) if own else (self.adapter.rank, self.adapter.group)
        masked_all_gather(
            rows, local_shard, plan, plan_index(plan, local_shard.device), *where, self.ledger
        )

    def _used_so_far(self, flat: int, window: bool = True) -> tuple[bool, ...]:
        """The *used* flags of flat parameter ``flat`` in this iteration, joined (with
        ``window``) with those of the backwards since the last synchronising one."""
        iteration = self.iteration
        now = (
            iteration.used[flat]
            if iteration is not None
            else (True,) * len(self.table.flats[flat].params)
        )
        return self._window.join(flat, now) if window else now

    def plain_used_so_far(self) -> frozenset[int]:
        """Indices of the plain parameters used in this iteration or in the backwards
        since the last synchronising one (the ``no_sync()`` window)."""
        return self._window.join_plain(self.plain_used())

    def forget_plain_window(self) -> None:
        """The plain parameters' window is over before the backward ends: reduced now (an
        error there must not leave it to the next backward), or dropped (FSDP2, aborted)."""
        self._window.forget_plain()

    def forget_window(self) -> None:
        """The wrapper dropped what it accumulated (DeepSpeed's ``zero_grad`` before its
        boundary): nothing counts as used in the window any more."""
        self._window.forget()

    def flat_used_so_far(self, flat: nn.Parameter) -> bool:
        """Whether any segment of ``flat`` was used since the last synced backward."""
        record = self.table.flat_record(flat)
        return record is not None and any(self._used_so_far(record.index))

    # ------------------------------------------------------------- compute ends

    def end_backward(self, synced: bool) -> None:
        """A backward pass finished; ``synced`` is False under ``no_sync()``."""
        if self.phase is not Phase.COMPUTING:
            raise backward_without_forward(self.phase.name)
        self.check_backward_binding()
        used = [self._used_so_far(flat.index) for flat in self.table.flats]
        if synced:
            self.views.combine_grads(used)
            self._window.close()
        else:
            self._window.extend(used, self.plain_used_so_far())
        self._stats = StatsSource.of(self.iteration, self.ledger, synced)
        self._awaiting = 0 if synced else self._awaiting - 1
        if self._awaiting <= 0:
            self._end_compute()

    def end_forward_only(self) -> None:
        """A forward ran without autograd: no backward will follow."""
        self._leftovers.left_by_forward()
        if self.phase is Phase.COMPUTING:
            if not self._window.open:
                self.views.reattach_grads()
            self._end_compute()

    def _end_compute(self) -> None:
        self._guards.remove()
        self.views.show()
        self._move(Phase.COMPUTING, Phase.IDLE)

    # ------------------------------------------------------- lending, detaching

    @contextlib.contextmanager
    def lend(self) -> Iterator[None]:
        """Let the wrapper run one of its own operations on the original attributes."""
        if self.phase is not Phase.IDLE:
            yield
            return
        # The wrapper reads the shards (and maybe gradients): views' writes go there first.
        self._leftovers.release()
        self.write_back()
        self.push_grads()
        self.views.hide()
        self._move(Phase.IDLE, Phase.LENT)
        try:
            yield
        finally:
            self.views.show()
            self._move(Phase.LENT, Phase.IDLE)

    def detach(self) -> None:
        """The runtime's part of :meth:`flatview.FlatView.unwrap`: hand the model back
        to the wrapper alone (values and gradients carried into the flat parameters,
        views hidden, every hook removed)."""
        if self.phase is not Phase.IDLE:
            raise StateError(f"unwrap() needs phase IDLE, the model is {self.phase.name}")
        if self._window.open:
            # Flat parameters hold the window's gradients, views the earlier: unmerged.
            raise StateError(
                "unwrap() inside an accumulation window (no_sync(), DeepSpeed before its "
                "boundary): finish the accumulation with a synchronising backward first"
            )
        # The flat parameters carry on alone: what the views hold must be theirs.
        self._leftovers.release()
        self.write_back()
        self.push_grads()
        self.views.hide()
        self._guards.remove_plain()
        self.adapter.uninstall()
        self._move(Phase.IDLE, Phase.DETACHED)

    # -------------------------------------------------------------------- stats

    @property
    def stats(self) -> StepStats | None:
        """Communication figures of the last backward pass (``None`` before the first)."""
        if isinstance(self._stats, StatsSource):
            reduces, replicas = self.adapter.wrapper_reduces, self.adapter.replicas
            self._stats = step_stats(
                self.table, self._stats, wrapper_reduces=reduces, replicas=replicas
            )
        return self._stats
