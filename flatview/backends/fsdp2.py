"""Adapter for torch's FSDP2 (``torch.distributed.fsdp.fully_shard``), HSDP included.

FSDP2 keeps every original parameter where the user put it, as a ``DTensor`` sharded on
dim 0 (``Shard(0)``) over the mesh's shard dimension: there is nothing to view, and
``fv.parameters()`` are the model's own parameters under their own names. What flatview
adds is the skip set. Measured on torch 2.13 (CPU, gloo), plain FSDP2 with one unit per
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
  reduce-scatter, a skipped parameter that received a gradient raises
  :class:`~flatview.errors.SkippedParameterUsedError`, and a used parameter without one
  on this rank gets zeros (so every rank's reduce-scatter has the same layout; one tiny
  all-reduce of flags, started by the last group's post_backward alongside its
  reduce-scatter and waited for at the end of the backward, raises
  :class:`~flatview.errors.UndeclaredUnusedError` on every rank if any rank lacked it);
* the root's post-backward final callback is shadowed to end the core's backward;
* each group's all-gather and reduce-scatter objects (``set_custom_all_gather`` /
  ``set_custom_reduce_scatter``, public) are wrapped to count bytes in the ledger at the
  collective; for HSDP the all-reduce of the reduce-scatter output across the replicate
  dimension is counted there too. Where :func:`~flatview.backends.fsdp2_hooks.decide_bucketing`
  says so, small reduce-scatters are held and run as one at the end of the backward
  (:mod:`flatview.comm.held`): on CPU a step goes by its number of collectives.

The skip-set check spans every rank of the mesh (``agreement_group``) and is settled
inside ``step()``: even the root's all-gather, which every rank issues whatever it skips,
cannot run alongside it, since a rank whose skip set fails to resolve raises from
``step()`` without a forward (:mod:`flatview.comm.agreement`). Norms and optimizer-state
consolidation run within the shard group (replicas hold the same pieces).

The torch privates touched are listed, and checked at wrap time, in
:mod:`~flatview.backends.fsdp2_hooks` (torch versions in
:data:`flatview.backends.torch_fsdp.TESTED_TORCH`).

Everything changed is an instance attribute or a hook, removed by ``uninstall``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from flatview.backends._common import AdapterBase
from flatview.backends.base import PlainSpec, UnitSpec
from flatview.backends.fsdp2_hooks import (
    STATE_ATTRS,
    CountingAllGather,
    CountingReduceScatter,
    FlagExchange,
    Unit,
    check_attrs,
    check_group,
    check_no_pending_backward,
    clear_dropped,
    decide_bucketing,
    drop_unreduced_grads,
    hold_plan,
    refuse_reduce_options,
    restore_prefetch,
    shard_layout,
    steer_prefetch,
    unreduced,
)
from flatview.backends.messages import unreduced_inside_forward
from flatview.comm.held import HeldReduceScatters
from flatview.comm.options import ReduceOptions
from flatview.errors import SkippedParameterUsedError, StateError, UndeclaredUnusedError, WrapError

if TYPE_CHECKING:
    from flatview.backends.base import Runtime


class FSDP2Adapter(AdapterBase):
    """Maps the flatview core onto one FSDP2 model (root and nested ``fully_shard`` units)."""

    backend = "fsdp2"

    def __init__(self, model: nn.Module, options: ReduceOptions | None = None) -> None:
        super().__init__()
        from flatview.backends.torch_fsdp import check_torch_version

        self.options = options if options is not None else ReduceOptions()
        refuse_reduce_options(self.options)
        check_torch_version("FSDP2 backend relies on fully_shard")
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo, TrainingState

        self._idle = TrainingState.IDLE
        self._post_backward_state = TrainingState.POST_BACKWARD
        if not isinstance(model, FSDPModule):
            raise WrapError(
                "flatview.wrap was given a model whose submodules are sharded with FSDP2 "
                "but which is not itself: call fully_shard(model) on the root too, then "
                "wrap the root"
            )
        root: Any = model
        self.root = root
        check_attrs(root, ("_get_fsdp_state",), "module")
        root_state = root._get_fsdp_state()
        check_attrs(root_state, STATE_ATTRS, "state")
        if root_state._is_root is False:
            raise WrapError(
                "flatview.wrap was given a nested FSDP2 module; wrap the outermost "
                "fully_shard module, the one the training loop calls"
            )
        # Lazy initialisation decides the root and may replace sharded parameters
        # (reset_sharded_param): it must happen before flatview records them.
        root_state._lazy_init()
        self._root_state = root_state
        self.units: list[Unit] = []
        seen: set[int] = set()
        for name, module in root.named_modules():
            if not isinstance(module, FSDPModule):
                continue
            state: Any = module._get_fsdp_state()
            if id(state) in seen:
                continue
            seen.add(id(state))
            check_attrs(state, STATE_ATTRS, "state")
            if state._training_state is not self._idle:
                raise StateError(
                    f"FSDP2 unit {name or '<root>'!r} is in state {state._training_state.name}; "
                    "wrap the model between iterations"
                )
            unit = Unit(name, cast(nn.Module, module), state)
            if len(unit.groups) > 1:
                raise WrapError(
                    f"FSDP2 unit {name or '<root>'!r} has {len(unit.groups)} parameter groups "
                    "(shard_placement_fn with per-parameter meshes); flatview supports one"
                )
            self.units.append(unit)
        groups = [g for u in self.units for g in u.groups]
        for unit in self.units:
            for group in unit.groups:
                check_group(unit.name, group, CPUOffloadPolicy)
        check_no_pending_backward([(u.name, u.groups) for u in self.units])
        # After a forward (under no_grad) FSDP2 keeps the root's unsharded parameters
        # registered (it does not reshard the root after forward): flatview records the
        # sharded ones, which the next forward unshards again (FSDPModule.reshard).
        for unit in self.units:
            cast(Any, unit.module).reshard()
        mesh_infos = [g.mesh_info for g in groups]
        self.hybrid = bool(mesh_infos) and isinstance(mesh_infos[0], HSDPMeshInfo)
        if mesh_infos:
            first = mesh_infos[0]
            if any(m.mesh != first.mesh for m in mesh_infos):
                raise WrapError("FSDP2 units use different device meshes; flatview needs one mesh")
            self.group: dist.ProcessGroup | None = first.shard_process_group
            self.rank: int = int(first.shard_mesh_rank)
            self.world_size: int = int(first.shard_mesh_size)
            replicas = first.replicate_mesh_size if self.hybrid else 1
            if self.hybrid and first.mesh.size() != dist.get_world_size():
                raise WrapError(
                    "FSDP2 HSDP over a mesh that does not span every process: flatview's "
                    "skip-set check needs the mesh to cover the default process group"
                )
            self.device = groups[0].device
        else:
            self.group = None
            self.rank = dist.get_rank()
            self.world_size = dist.get_world_size()
            replicas = 1
            self.device = torch.device("cpu")
        self.replicas = replicas
        self._holds = decide_bucketing(self.options, self.device, self.hybrid, self.world_size)
        self._held: HeldReduceScatters | None = None
        self.wrapper_reduces = self.world_size * replicas > 1
        self.bucket_numel = 2**62
        self._aliases: dict[int, list[str]] = {}
        self._names: dict[int, str] = {}
        for name, param in root.named_parameters(remove_duplicate=False):
            if id(param) in self._names:
                self._aliases[id(param)].append(name)
            else:
                self._names[id(param)] = name
                self._aliases[id(param)] = []
        # Per parameter (by core index, filled at install): whether this rank's backward
        # gave it a gradient since the last synchronising backward.
        self._got: set[int] = set()
        # Parameters not skipped in some backward since the last synchronising one.
        self._window_used: set[int] = set()
        self._versions: dict[int, tuple[int, int]] = {}
        self._ran: set[int] = set()
        self._backward_started = False
        self._in_flight = False
        self._prefetch: dict[int, tuple[Any, Any, Any, Any]] = {}
        # In the final callback: the groups whose post_backward FSDP has yet to run, the
        # flags' exchange once the last has run.
        self._unfinished: set[int] | None = None
        self._flags: FlagExchange | None = None

    @staticmethod
    def clean_name(name: str) -> str:
        return name

    # --------------------------------------------------------------- describe

    def describe(self) -> list[UnitSpec]:
        managed: set[int] = set()
        specs = []
        for unit in self.units:
            plain = []
            for group in unit.groups:
                for fsdp_param in group.fsdp_params:
                    param = fsdp_param.sharded_param
                    managed.add(id(param))
                    plain.append(self._plain(param, tuple(int(d) for d in fsdp_param._orig_size)))
            specs.append(
                UnitSpec(unit.name, unit.module, (), tuple(plain), unit.module is self.root)
            )
        # Parameters FSDP2 does not manage (ignored_params): every rank holds them whole.
        extra = tuple(
            PlainSpec(self._names[id(p)], p, tuple(p.shape), aliases=tuple(self._aliases[id(p)]))
            for p in self.root.parameters()
            if id(p) not in managed
        )
        if extra:
            specs[0] = UnitSpec(
                specs[0].name, specs[0].module, (), specs[0].plain + extra, specs[0].is_root
            )
        return specs

    def _plain(self, param: nn.Parameter, shape: tuple[int, ...]) -> PlainSpec:
        layout = shard_layout(shape, self.world_size) if self.world_size > 1 else None
        return PlainSpec(
            self._names[id(param)],
            param,
            shape,
            layout,
            self.rank,
            reduced=True,
            aliases=tuple(self._aliases[id(param)]),
            whole_shard=False,
        )

    # ---------------------------------------------------------------- install

    def install(self, core: Runtime) -> None:
        self._core = core
        for index, unit in enumerate(self.units):
            self._hook(
                unit.module.register_forward_pre_hook(self._pre_forward_of(index), prepend=True)
            )
            for group in unit.groups:
                self.patch(group, "post_backward", self._post_backward_of(index, group))
        self._hook(self.root.register_forward_hook(self._post_forward))
        for unit in self.units:
            # FSDP queues the callback of whichever state's pre-backward fires first.
            self.patch(
                unit.state,
                "_root_post_backward_final_callback",
                self._final_callback_of(unit.state),
            )
        if self._holds is not None:
            self._held = HeldReduceScatters(core.ledger)
        self._params_of = [
            [
                (fsdp_param, core.index_of(fsdp_param.sharded_param))
                for group in unit.groups
                for fsdp_param in group.fsdp_params
            ]
            for unit in self.units
        ]
        self._count_collectives()

    def uninstall(self) -> None:
        restore_prefetch([u.state for u in self.units], self._prefetch)
        self._drop_held()
        for unit in self.units:
            for group in unit.groups:
                for attr in ("_all_gather_comm", "_reduce_scatter_comm"):
                    comm = getattr(group, attr)
                    if isinstance(comm, (CountingAllGather, CountingReduceScatter)):
                        setattr(group, attr, comm.inner)
        super().uninstall()

    def _count_collectives(self) -> None:
        """Wrap every group's all-gather and reduce-scatter (again, if the user set a
        custom one since) so that the ledger counts them."""
        ledger = self.core.ledger
        for unit in self.units:
            for group in unit.groups:
                if not isinstance(group._all_gather_comm, CountingAllGather):
                    group._all_gather_comm = CountingAllGather(group._all_gather_comm, ledger)
                if not isinstance(group._reduce_scatter_comm, CountingReduceScatter):
                    group._reduce_scatter_comm = CountingReduceScatter(
                        group._reduce_scatter_comm,
                        ledger,
                        group if self.hybrid else None,
                        self._held,
                    )

    # -------------------------------------------------------------- lifecycle

    def _pre_forward_of(self, index: int) -> Any:
        unit = self.units[index]
        outermost = unit.module is self.root

        def pre_forward(module: nn.Module, args: Any) -> None:
            core = self.core
            if outermost and not _in_backward():
                if self._in_flight and self._backward_started:
                    # The last backward raised before FSDP's final callback: FSDP's states
                    # are mid-backward (what reset_iter_state is for).
                    self.root.reset_iter_state()
                    drop_unreduced_grads(f for entries in self._params_of for f, _ in entries)
                    self._reset_round()
                self._in_flight = True
                self._backward_started = False
                self._ran.clear()
            core.begin_compute(outermost)
            core.check_unit_forward(index)
            self._ran.add(index)
            if outermost and not _in_backward():
                self._count_collectives()
                self._steer_prefetch()

        return pre_forward

    def _steer_prefetch(self) -> None:
        skipped = {id(u.state) for i, u in enumerate(self.units) if self.core.unit_skipped(i)}
        steer_prefetch([u.state for u in self.units], skipped, self._prefetch)

    def _post_backward_of(self, index: int, group: Any) -> Any:
        original = group.post_backward

        def post_backward(*unused: Any) -> None:
            self._backward_started = True
            saved = group.reduce_scatter_unused_params
            comm = group._reduce_scatter_comm
            counting = isinstance(comm, CountingReduceScatter)
            try:
                self.core.check_backward_binding()
                self._before_reduce(index, group)
                unfinished = self._unfinished
                if unfinished is not None and id(group) in unfinished:
                    unfinished.discard(id(group))
                    if not unfinished:
                        self._start_flags()
                # flatview decides which unused parameters get zeros (skipped ones don't).
                group.reduce_scatter_unused_params = False
                if counting and self._holds is not None and group.reduce_grads:
                    small = self.options.in_place_min_numel
                    comm.plan = hold_plan(group, comm.inner, self.world_size, small, self._holds)
                original(*unused)
            except BaseException:
                self._drop_held()  # what is held never runs: its gradients never exist
                raise
            finally:
                group.reduce_scatter_unused_params = saved
                if counting:
                    comm.plan = None

        return post_backward

    def _before_reduce(self, index: int, group: Any) -> None:
        core = self.core
        used = core.plain_used()
        ran = index in self._ran
        reducing = bool(group.reduce_grads)
        for fsdp_param in group.fsdp_params:
            param_index = core.index_of(fsdp_param.sharded_param)
            if param_index is None or not fsdp_param.sharded_param.requires_grad:
                continue
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            grad = unsharded.grad if unsharded is not None else None
            fresh = self._fresh(grad, param_index)
            if param_index not in used:
                if fresh:
                    raise SkippedParameterUsedError(
                        f"parameter {core.name(param_index)!r} is declared skipped for this "
                        "step but received a gradient: the model used it. Remove it from "
                        "the skip set or don't use it."
                    )
                continue
            if fresh:
                self._got.add(param_index)
            elif (
                ran
                and reducing
                and unsharded is not None
                and grad is None
                and fsdp_param.unsharded_accumulated_grad is None
                and param_index not in self._got
            ):
                # Zeros, what this rank contributes: its reduce-scatter keeps the layout
                # the other ranks give theirs.
                unsharded.grad = torch.zeros_like(unsharded)

    def _fresh(self, grad: torch.Tensor | None, index: int) -> bool:
        # Without mixed precision micro-batches accumulate in one tensor: changed since?
        return grad is not None and self._versions.get(index) != (id(grad), grad._version)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        # Gradients no FSDP2 hook reduced: a backward inside the root's forward reached
        # no nested unit. Dropped; every rank raises, before any collective of it.
        left = [] if _in_backward() else unreduced(self._params_of, self._fresh)
        if left:
            drop_unreduced_grads(left)
            self._reset_round()
            self.core.end_forward_only()
            raise unreduced_inside_forward()
        super()._post_forward(module, args, output)

    def _final_callback_of(self, state: Any) -> Any:
        original = state._root_post_backward_final_callback

        def final_callback() -> None:
            # FSDP runs the post_backward of these groups next; the flags are final once
            # the last has run, and are exchanged alongside its reduce-scatter.
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
                    # Before the core ends the backward: the gradients are final then.
                    with torch.no_grad():
                        self._held.run()
            finally:
                self._unfinished = None
            self._end_backward()

        return final_callback

    def _end_backward(self) -> None:
        core = self.core
        groups = [g for u in self.units for g in u.groups]
        synced = all(bool(g.reduce_grads) for g in groups) if groups else True
        self._in_flight = False
        self._backward_started = False
        if core.phase.name != "COMPUTING":
            return
        self._window_used |= core.plain_used()
        missing: list[int] = []
        if synced:
            missing, unused = self._exchange_missing()
            for index in unused:
                # No rank gave it a gradient: as with plain FSDP2, it keeps none.
                core.tensor(index).grad = None
            self._reset_round()
        else:
            self._versions = {}
            for entries in self._params_of:
                for fsdp_param, position in entries:
                    grad = getattr(getattr(fsdp_param, "_unsharded_param", None), "grad", None)
                    if position is not None and grad is not None:
                        self._versions[position] = (id(grad), grad._version)
        core.end_backward(synced=synced)
        if missing:
            names = ", ".join(repr(core.name(i)) for i in missing[:8])
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise UndeclaredUnusedError(
                f"parameter(s) {names}{more} received no gradient on some rank in this "
                "backward pass, but are not declared skipped: FSDP2 would leave them out "
                "of that rank's reduce-scatter. Pass what a step does not use to "
                "FlatView.step(skip=...)."
            )

    def _start_flags(self) -> None:
        """Start the flags' all-reduce of a synchronising backward (every rank's last
        post_backward starts it, so all pair up)."""
        core = self.core
        due = core.phase.name == "COMPUTING" and self.wrapper_reduces and self._flags is None
        if not due or not all(bool(g.reduce_grads) for u in self.units for g in u.groups):
            return
        missing = sorted((self._window_used | core.plain_used()) - self._got)
        group, count = self.agreement_group, len(self._names) + 1
        self._flags = FlagExchange(missing, self._got, count, group, core.ledger, self.device)

    def _exchange_missing(self) -> tuple[list[int], list[int]]:
        self._start_flags()
        flags, self._flags = self._flags, None
        if flags is None:
            missing = sorted(self._window_used - self._got)
            return missing, missing
        return flags.result()

    def _drop_held(self) -> None:
        if self._held is not None:
            clear_dropped(self._held.drop())

    def _reset_round(self) -> None:
        # Flags an aborted backward started: their all-reduce completes by itself.
        self._flags = None
        self._drop_held()
        self._got.clear()
        self._window_used = set()
        self._versions = {}


def _in_backward() -> bool:
    return bool(torch._C._current_graph_task_id() != -1)
