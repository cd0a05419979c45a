"""Adapter for torch's FSDP2 (``torch.distributed.fsdp.fully_shard``), HSDP included.

FSDP2 keeps every original parameter where the user put it, as a ``DTensor`` sharded on
dim 0 (``Shard(0)``) over the mesh's shard dimension: there is nothing to view, and
``fv.parameters()`` are the model's own parameters under their own names. What flatview
adds is the skip set. Measured on torch 2.13 (CPU, gloo), bare FSDP2 with one unit per
block:

* a block whose forward is not called is neither all-gathered nor reduce-scattered, and
  a parameter without a gradient in a unit that ran is left out of that unit's
  reduce-scatter; implicit backward prefetching follows the post-forward order, which
  holds no skipped unit;
* explicit prefetching (``set_modules_to_forward_prefetch`` /
  ``set_modules_to_backward_prefetch``) all-gathers its targets whether they run or not;
* ranks that skip different blocks train on without an error: the blocks' all-gathers
  and reduce-scatters pair up across ranks and the gradients are silently wrong; a
  parameter without a gradient on one rank only shortens that rank's reduce-scatter
  (the same hazard).

The adapter describes each FSDP2 parameter as a plain parameter the wrapper shards
itself (a one-segment layout whose shards are ``ceil(dim0 / shard size)`` rows, of which
the ``DTensor``'s local tensor is this rank's piece), one unit per ``fully_shard`` state,
and maps the skip set onto the runtime:

* a forward pre-hook on every unit, ahead of FSDP's own (so before any all-gather),
  binds the iteration (``begin_compute``) and refuses a wholly skipped unit's forward;
  the root's also steers explicit prefetching away from units the step skips (a skipped
  target is replaced by the next unit that runs, in the prefetch's direction);
* each parameter group's ``post_backward`` is shadowed: before FSDP packs the
  reduce-scatter, a skipped parameter that received a gradient is noted and its
  gradient dropped, and a used parameter without one on this rank gets zeros (so every
  rank's reduce-scatter has the same layout; one tiny all-reduce of flags, started once
  the last group's post_backward has run (before the held reduce-scatters) and waited
  for at the end of the backward, raises
  :class:`~flatview.errors.SkippedParameterUsedError` on every rank if any rank used a
  skipped parameter, then :class:`~flatview.errors.UndeclaredUnusedError` if any rank
  lacked a used one's gradient);
  inside an HSDP window of ``set_requires_all_reduce(False)``, where FSDP2 adds the
  reduce-scatters up by position, every parameter gets zeros instead
  (:func:`~flatview.backends.fsdp2_reduce.reduces_whole`), and the window is kept like
  a ``no_sync()`` one; in mixed precision two faults of FSDP2 (torch 2.13) that skip
  sets reach are worked around there
  (:func:`~flatview.backends.fsdp2_reduce.accumulate_uniformly`,
  :func:`~flatview.backends.fsdp2_reduce.never_unsharded_apart`);
* the root's post-backward final callback is shadowed to end the runtime's backward;
* each group's all-gather and reduce-scatter objects (``set_custom_all_gather`` /
  ``set_custom_reduce_scatter``, public) are wrapped to count bytes in the ledger at the
  collective; for HSDP the all-reduce of the reduce-scatter output across the replicate
  dimension is counted there too. Where :func:`~flatview.backends.fsdp2_reduce.decide_bucketing`
  says so, small reduce-scatters are held and run as one at the end of the backward
  (:mod:`flatview.comm.held`): on CPU a step goes by its number of collectives.

Units on a one-dimensional mesh of their own (experts: ``fully_shard(experts,
mesh=...)`` over an expert group) are described as units on a group of their own
(:class:`~flatview.backends.base.UnitGroup`, found by
:func:`~flatview.backends.unit_groups.own_groups` at wrap time): their parameters are
sharded over that mesh, their skip sets agree among the ranks that share it, and their
reduce-scatters are never held (held ones run as one over the root's mesh only, at the
same point on every rank whichever experts a rank's group skipped).

The skip-set check spans every rank of the mesh (``agreement_group``) and is settled
inside ``step()``: even the root's all-gather, which every rank issues whatever it skips,
cannot run alongside it, since a rank whose skip set fails to resolve raises from
``step()`` without a forward (:mod:`flatview.comm.agreement`). Norms and optimizer-state
consolidation run within the shard group (replicas hold the same pieces).

The adapter is assembled from components beside this module: the wrap-time checks
(:mod:`~flatview.backends.fsdp2_checks`), what each rank contributes to FSDP2's
reduce-scatters, counting them and holding small ones
(:mod:`~flatview.backends.fsdp2_reduce`), and the steering of explicit prefetching
(:mod:`~flatview.backends.fsdp2_prefetch`); the flags are
:class:`~flatview.comm.unused.UsageFlags`. torch privates touched here (checked at wrap
time, torch versions in :data:`flatview.backends.torch_versions.TESTED_TORCH`):
``FSDPState._states_to_forward_prefetch``, ``_states_to_backward_prefetch``,
``_root_post_backward_final_callback``; ``FSDPModule.reset_iter_state``;
``FSDPParamGroup.post_backward``, ``_training_state``, ``reduce_grads``,
``all_reduce_grads``, ``_partial_reduce_output``, ``reduce_scatter_unused_params``,
``_reduce_scatter_comm``, ``_reduce_dtype``; ``FSDPParam.sharded_param``, ``_orig_size``,
``_unsharded_param``, ``reduce_dtype``, ``unsharded_accumulated_grad``.

Everything changed is an instance attribute or a hook, removed by ``uninstall``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from flatview.autograd import in_backward
from flatview.backends.base import Adapter, PlainSpec, UnitSpec, end_root_forward
from flatview.backends.fsdp2_checks import FSDP2Model, clean_name, shard_layout
from flatview.backends.fsdp2_prefetch import PrefetchSteering
from flatview.backends.fsdp2_reduce import (
    Contributions,
    CountingReduceScatter,
    accumulate_uniformly,
    clear_dropped,
    count_collectives,
    decide_bucketing,
    drop_unreduced_grads,
    hold_planner,
    never_unsharded_apart,
    reduces_whole,
    shard_numels,
    stop_counting,
    unreduced,
)
from flatview.backends.messages import unreduced_inside_forward
from flatview.backends.patches import Patches
from flatview.backends.recast import fsdp2_recasting
from flatview.comm.held import HeldReduceScatters
from flatview.comm.options import ReduceOptions
from flatview.comm.unused import UsageFlags, undeclared_unused
from flatview.phase import Phase
from flatview.skip import skipped_used_in_backward
from flatview.states import Transitions
from flatview.wrapped_models import lent_tensor_error

if TYPE_CHECKING:
    from flatview.backends.base import Runtime


class Iteration(enum.Enum):
    """Where the iteration of the last root forward is."""

    IDLE = "no iteration in flight (or its backward ended)"
    FORWARD = "the root forward ran; no parameter group has started its post-backward"
    BACKWARD = "some group's post-backward ran: FSDP's states are mid-backward"


_ITERATION_MOVES = {
    Iteration.IDLE: (Iteration.FORWARD, Iteration.IDLE),
    Iteration.FORWARD: (Iteration.FORWARD, Iteration.BACKWARD, Iteration.IDLE),
    Iteration.BACKWARD: (Iteration.FORWARD, Iteration.BACKWARD, Iteration.IDLE),
}


class FSDP2Adapter(Adapter):
    """Maps the flatview runtime onto one FSDP2 model (root and nested ``fully_shard``
    units)."""

    backend = "fsdp2"
    bucket_numel = 2**62

    def __init__(self, model: FSDP2Model, options: ReduceOptions) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

        self.model = model
        self.options = options
        self.root: Any = model.root
        self.units = model.units
        self.hybrid = model.hybrid
        self.group = model.group
        self.rank = model.rank
        self.world_size = model.world_size
        self.replicas = model.replicas
        self.device = model.device
        self.wrapper_reduces = self.world_size * self.replicas > 1
        self._post_backward_state = TrainingState.POST_BACKWARD
        self._holds = decide_bucketing(self.options, self.device, self.hybrid, self.world_size)
        self._held: HeldReduceScatters | None = None
        self._iteration = Transitions(Iteration.IDLE, _ITERATION_MOVES)
        self._ran: set[int] = set()
        """Units whose forward ran in this iteration."""
        self._prefetch = PrefetchSteering([u.state for u in self.units])
        # In the final callback: the groups whose post_backward FSDP has yet to run, the
        # flags' exchange once the last has run.
        self._unfinished: set[int] | None = None
        self._flags: UsageFlags | None = None
        self._patches = Patches()

    clean_name = staticmethod(clean_name)

    # --------------------------------------------------------------- describe

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse an optimizer built between ``model.unshard()`` and ``reshard()``: it
        holds FSDP2's unsharded parameters, which the model computes on only while
        unsharded and which get no gradient (FSDP2 reduces into the sharded ones), so it
        would train nothing, on bare FSDP2 too. FSDP2 keeps each unsharded parameter
        object across passes (it frees its storage): known by identity."""
        unsharded = {
            id(tensor): index
            for params in self._params_of
            for fsdp_param, index in params
            if (tensor := getattr(fsdp_param, "_unsharded_param", None)) is not None
        }
        for group in optimizer.param_groups:
            for param in group["params"]:
                index = unsharded.get(id(param))
                if index is not None:
                    raise lent_tensor_error(
                        optimizer,
                        f"FSDP2's unsharded parameter of {self.runtime.name(index)!r}",
                        "model.unshard() and reshard(), or registered from a forward until "
                        "the next pass (FSDP2 keeps the root's unsharded parameters after "
                        "its forward: model.parameters() read after an evaluation holds them)",
                    )

    def describe(self) -> list[UnitSpec]:
        managed: set[int] = set()
        specs = []
        for index, unit in enumerate(self.units):
            plain = []
            for group in unit.groups:
                for fsdp_param in group.fsdp_params:
                    param = fsdp_param.sharded_param
                    managed.add(id(param))
                    shape = tuple(int(d) for d in fsdp_param._orig_size)
                    plain.append(self._plain(param, shape, index))
            own = self.model.groups.get(index)
            specs.append(
                UnitSpec(unit.name, unit.module, (), tuple(plain), unit.module is self.root, own)
            )
        # Parameters FSDP2 does not manage (ignored_params): every rank holds them whole.
        # Each belongs to the innermost unit it is under (units are in module order), so
        # that one used keeps that unit callable when the rest of the unit is skipped.
        ignored = {id(p): p for p in self.root.parameters() if id(p) not in managed}
        if not ignored:
            return specs
        owner: dict[int, int] = {}
        for index, unit in enumerate(self.units):
            owner.update((id(p), index) for p in unit.module.parameters() if id(p) in ignored)
        for key, p in ignored.items():
            extra = PlainSpec(
                self.model.names[key],
                p,
                tuple(p.shape),
                aliases=tuple(self.model.aliases[key]),
                ignored=True,
            )
            spec = specs[owner[key]]
            specs[owner[key]] = dataclasses.replace(spec, plain=(*spec.plain, extra))
        return specs

    def _shards(self, unit: int) -> tuple[int, int]:
        """(this rank's rank, the ranks) over which unit ``unit`` shards its parameters:
        its own mesh's (experts), else the root's shard group's."""
        own = self.model.groups.get(unit)
        return (self.rank, self.world_size) if own is None else (own.rank, own.world_size)

    def _plain(self, param: nn.Parameter, shape: tuple[int, ...], unit: int) -> PlainSpec:
        rank, world_size = self._shards(unit)
        layout = shard_layout(shape, world_size) if world_size > 1 else None
        return PlainSpec(
            self.model.names[id(param)],
            param,
            shape,
            layout,
            rank,
            reduced=True,
            aliases=tuple(self.model.aliases[id(param)]),
            padded_shard=False,
        )

    # ---------------------------------------------------------------- install

    def install(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._contributions = Contributions(runtime, (g for u in self.units for g in u.groups))
        patches = self._patches
        for index, unit in enumerate(self.units):
            patches.hook(
                unit.module.register_forward_pre_hook(self._pre_forward_of(index), prepend=True)
            )
            for group in unit.groups:
                patches.patch(group, "post_backward", self._post_backward_of(index, group))
        patches.hook(self.root.register_forward_hook(self._post_forward))
        for unit in self.units:
            for module in unit.state._modules:
                patches.patch(module, "_apply", fsdp2_recasting(unit.groups, module._apply))
        for unit in self.units:
            # FSDP queues the callback of whichever state's pre-backward fires first.
            patches.patch(
                unit.state,
                "_root_post_backward_final_callback",
                self._final_callback_of(unit.state),
            )
        if self._holds is not None:
            self._held = HeldReduceScatters(runtime.ledger)
        self._params_of = [
            [
                (fsdp_param, runtime.index_of(fsdp_param.sharded_param))
                for group in unit.groups
                for fsdp_param in group.fsdp_params
            ]
            for unit in self.units
        ]
        self._numels = {
            id(g): shard_numels(g, self._shards(i)[1])
            for i, u in enumerate(self.units)
            for g in u.groups
        }
        """Per group (by id), its parameters' shard sizes (:class:`HoldPlanner`)."""
        count_collectives(self.units, runtime.ledger, self.hybrid, self._held)

    def release_unsharded(self) -> None:
        # The root keeps its unsharded parameters after a forward (every unit with
        # reshard_after_forward=False): FSDPModule.reshard() frees them, as torch's
        # documentation asks of a user who moves the sharded ones in between.
        for unit in self.units:
            cast(Any, unit.module).reshard()

    def uninstall(self) -> None:
        self._prefetch.restore()
        self._drop_held()
        stop_counting(self.units)
        self._patches.remove()

    # -------------------------------------------------------------- lifecycle

    def _pre_forward_of(self, index: int) -> Any:
        unit = self.units[index]
        outermost = unit.module is self.root

        def pre_forward(module: nn.Module, args: Any) -> None:
            runtime = self.runtime
            if outermost and not in_backward():
                if self._iteration.state is Iteration.BACKWARD:
                    # The last backward raised before FSDP's final callback: FSDP's states
                    # are mid-backward (what reset_iter_state is for).
                    self.root.reset_iter_state()
                    drop_unreduced_grads(f for entries in self._params_of for f, _ in entries)
                    self._reset_round()
                self._iteration.move(Iteration.FORWARD)
                self._ran.clear()
            runtime.begin_compute(outermost)
            runtime.check_unit_forward(index)
            self._ran.add(index)
            if outermost and not in_backward():
                count_collectives(self.units, runtime.ledger, self.hybrid, self._held)
                skipped = {id(u.state) for i, u in enumerate(self.units) if runtime.unit_skipped(i)}
                self._prefetch.steer(skipped)

        return pre_forward

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        # Gradients no FSDP2 hook reduced: a backward inside the root's forward reached
        # no nested unit. Dropped; every rank raises, before any collective of it.
        left = [] if in_backward() else unreduced(self._params_of, self._contributions)
        if left:
            drop_unreduced_grads(left)
            self._reset_round()
            self.runtime.end_forward_only()
            raise unreduced_inside_forward()
        end_root_forward(self.runtime)

    def _post_backward_of(self, index: int, group: Any) -> Any:
        original = group.post_backward

        def post_backward(*unused: Any) -> None:
            if self._iteration.state is not Iteration.IDLE:
                self._iteration.move(Iteration.BACKWARD)
            saved = group.reduce_scatter_unused_params
            comm = group._reduce_scatter_comm
            counting = isinstance(comm, CountingReduceScatter)
            try:
                self.runtime.check_backward_binding()
                # Only the root mesh's reduce-scatters are held: they run as one at the
                # end on every rank alike, whichever experts a rank's group skipped.
                own = index in self.model.groups
                planner = None
                if counting and self._holds is not None and not own and group.reduce_grads:
                    small = self.options.in_place_min_numel
                    numels = self._numels[id(group)]
                    planner = hold_planner(group, comm.inner, numels, small, self._holds)
                ran = index in self._ran
                self._contributions.before_reduce(group, ran, planner)
                if planner is not None:
                    comm.plan = planner.plan()
                unfinished = self._unfinished
                last = unfinished is not None and id(group) in unfinished
                if unfinished is not None and last:
                    unfinished.discard(id(group))
                    last = not unfinished
                self._run_original(group, ran, original, unused)
                if last:
                    # After this group's reduce-scatter, not alongside it: which group
                    # is last differs between ranks of different expert groups (a
                    # skipped expert's runs here), and the flags' all-reduce must follow
                    # the same reduce-scatters of the root's mesh on every rank.
                    self._start_flags()
            except BaseException:
                self._drop_held()  # what is held never runs: its gradients never exist
                raise
            finally:
                group.reduce_scatter_unused_params = saved
                if counting:
                    comm.plan = None

        return post_backward

    def _run_original(self, group: Any, ran: bool, original: Any, args: Any) -> None:
        """FSDP2's own ``post_backward`` of ``group`` (``ran``: its unit's forward ran in
        this iteration), told which parameters without a gradient get zeros and kept
        clear of FSDP2's faults in mixed precision."""
        # flatview decides which unused parameters get zeros: skipped ones don't, but
        # where FSDP2 adds reduce-scatters up by position, all do.
        whole = self.hybrid and group.reduce_grads and reduces_whole(group, ran)
        group.reduce_scatter_unused_params = whole
        closing = whole and group.all_reduce_grads
        stay_none = self._contributions.ungraded_skipped(group) if closing else ()
        mixed = group._reduce_dtype is not None
        if mixed and group.reduce_grads and self.runtime.accumulating:
            accumulate_uniformly(group, whole)
        apart = mixed and not ran and not group.reduce_grads
        with never_unsharded_apart(group) if apart else contextlib.nullcontext():
            original(*args)
        for sharded in stay_none:
            sharded.grad = None

    def _final_callback_of(self, state: Any) -> Any:
        original = state._root_post_backward_final_callback

        def final_callback() -> None:
            # FSDP runs the post_backward of these groups next; the flags are final once
            # the last has run, and are exchanged then.
            self._unfinished = {
                id(g)
                for u in self.units
                for g in u.groups
                if g._training_state is not self._post_backward_state
            }
            try:
                if not self._unfinished:
                    self._start_flags()
                original()
                if self._held is not None:
                    # Before the runtime ends the backward: the gradients are final then.
                    with torch.no_grad():
                        self._held.run()
            finally:
                self._unfinished = None
            self._end_backward()

        return final_callback

    def _end_backward(self) -> None:
        runtime = self.runtime
        groups = [g for u in self.units for g in u.groups]
        synced = all(self._synchronises(g) for g in groups) if groups else True
        self._iteration.move(Iteration.IDLE)
        if runtime.phase is not Phase.COMPUTING:
            return
        lacked: list[int] = []
        used_skipped: list[int] = []
        here = bool(self._contributions.used_skipped)  # read before the reset empties it
        if synced:
            lacked, unused, used_skipped = self._exchange_flags()
            for index in unused:
                # No rank gave it a gradient: as with FSDP2 alone, it keeps none.
                runtime.tensor(index).grad = None
            self._reset_round()
        else:
            self._contributions.accumulated(self._params_of)
        runtime.end_backward(synced=synced)
        if used_skipped:
            names = [runtime.name(i) for i in used_skipped]
            raise skipped_used_in_backward(names, here=here)
        if lacked:
            raise undeclared_unused(
                "parameter(s)",
                [runtime.name(i) for i in lacked],
                "some rank",
                ": FSDP2 would leave them out of that rank's reduce-scatter",
            )

    def _synchronises(self, group: Any) -> bool:
        """Whether ``group``'s backward leaves final gradients: it reduces and, on HSDP,
        all-reduces (``set_requires_all_reduce(False)`` only reduce-scatters, into a sum
        FSDP2 keeps: a window like ``no_sync()``'s)."""
        return bool(group.reduce_grads) and (not self.hybrid or bool(group.all_reduce_grads))

    def _start_flags(self) -> None:
        """Start the flags' all-reduce of a synchronising backward (every rank's last
        post_backward starts it, so all pair up)."""
        runtime = self.runtime
        due = runtime.phase is Phase.COMPUTING and self.wrapper_reduces and self._flags is None
        if not due or not all(self._synchronises(g) for u in self.units for g in u.groups):
            return
        gave = self._contributions.gave
        lacking = sorted(runtime.plain_used_so_far() - gave)
        count = len(self.model.names) + 1
        used_skipped = self._contributions.used_skipped
        self._flags = UsageFlags.exchanged(
            gave, lacking, used_skipped, count, self.agreement_group, runtime.ledger, self.device
        )

    def _exchange_flags(self) -> tuple[list[int], list[int], list[int]]:
        """(parameters some rank gave no gradient although not skipped, those no rank
        gave one, skipped ones some rank gave one)."""
        self._start_flags()
        flags, self._flags = self._flags, None
        contributions = self._contributions
        if flags is None:
            lacking = sorted(self.runtime.plain_used_so_far() - contributions.gave)
            return lacking, lacking, sorted(contributions.used_skipped)
        return flags.lacked(), flags.unused(), flags.used_skipped()

    def _drop_held(self) -> None:
        if self._held is not None:
            clear_dropped(self._held.drop())

    def _reset_round(self) -> None:
        """The window is over: reduced by a synchronising backward, or dropped with an
        aborted one."""
        # Flags an aborted backward started: their all-reduce completes by itself.
        self._flags = None
        self._drop_held()
        self._contributions.reset()
        self.runtime.forget_plain_window()
