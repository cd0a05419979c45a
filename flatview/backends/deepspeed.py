"""Adapter for DeepSpeed's ZeRO engine (stages 1, 2 and 3; DeepSpeed 0.19.x):
``flatview.wrap(engine)``.

DeepSpeed keeps each parameter group (ZeRO 1/2) or each parameter (ZeRO 3) as flat
fp32 partitions, one per rank (:mod:`flatview.backends.deepspeed_zero`); flatview shows
views into this rank's partitions on the original submodules. What DeepSpeed keeps
doing: the forward (ZeRO 3 gathers each submodule's parameters as it runs), parameter
communication after the step, its engine bookkeeping. What flatview does instead:

* **Forward.** A forward pre-hook on ``engine.module`` (prepended: before DeepSpeed's
  own) begins the iteration: the views step aside, DeepSpeed's module parameters are
  registered again (the forward and ZeRO 3's gathering hooks read them), the ones of
  skipped parameters guarded. If the master partitions were written since they were last
  published (values written through views outside ``engine.step()``, or loaded), they are
  published first (ZeRO 3 releases what it keeps gathered, so that publishing gathers it
  again from the new partitions); ``fv.unwrap()`` publishes them too. A forward hook
  settles the skip-set check, ends a forward without autograd and hooks the outputs.
* **Gradients.** DeepSpeed's per-parameter gradient hooks and its end-of-backward
  reduction are made no-ops. When the backward reaches the forward's outputs a callback
  is queued that autograd runs once the whole backward is done: flatview's sharded
  reduction of the used segments, accumulated across micro-steps as the stage does
  (:mod:`~flatview.backends.deepspeed_grads`), into the holders' gradients (what the
  views hold pieces of) at DeepSpeed's accumulation boundary. Skipped parameters'
  gradients never travel and their views keep ``None``.
* **Step.** ``engine.step()`` calls its ZeRO optimizer's ``step``, replaced: ZeRO 3's
  preparation, the config's ``gradient_clipping`` by the global norm of the views'
  gradients (one all-reduce of one number; torch's ``clip_grad_norm_`` formula), the
  engine's optimizer's step (over views: see below), then DeepSpeed's own publishing
  (ZeRO 1/2: copy into the flat buffers and all-gather; ZeRO 3: regather persistent
  parameters). Its ``zero_grad`` (the engine calls it after every step) drops the views'
  gradients too.
* **The engine's optimizer** (the torch optimizer given to ``deepspeed.initialize``)
  has each parameter group pointed from DeepSpeed's flat partition to the views of that
  group's parameters: it steps them one by one, so skipped ones (``grad None``) get no
  weight decay and no momentum. Several optimizers: build the engine with
  :class:`flatview.optim.Deferred` and hand it the real ones after wrapping.
* **Lending.** ``engine.module``'s ``state_dict``, ``load_state_dict`` and ``_apply``,
  the engine's ``module_state_dict`` / ``load_module_state_dict`` and the ZeRO
  optimizer's ``backward_epilogue`` (which runs after flatview's end of the backward;
  ZeRO 3 releases there what the backward left gathered) run with DeepSpeed's
  parameters registered (ZeRO 1/2: a load is copied into the fp32 masters).
* **Checkpoints.** ``engine.save_checkpoint`` / ``load_checkpoint`` run DeepSpeed's own
  code between iterations, lent; the ZeRO optimizer's ``state_dict`` /
  ``load_state_dict`` they reach are :mod:`flatview.backends.deepspeed_checkpoint`'s (this
  rank's masters and the state of the optimizer over its views; a bare DeepSpeed file is
  converted per view).
* **Refused** while wrapped (``StateError``): ``coalesce_grad_reduction``;
  ``deepspeed.zero.GatheredParameters`` over views
  (:mod:`~flatview.backends.deepspeed_gathering`); a backward of a forward flatview did
  not see begin (run before ``flatview.wrap``, or a second backward through one forward),
  on every rank before anything is reduced. At wrap time, every configuration of
  :mod:`flatview.backends.deepspeed_checks`.

Everything changed is an instance attribute or a hook on DeepSpeed's objects, kept in
one :class:`~flatview.backends.patches.Patches`; :meth:`DeepSpeedAdapter.uninstall`
takes it back (the engine's optimizer then steps DeepSpeed's partitions again, with
fresh state). The one change to a class, ``GatheredParameters.__init__``, is shared by
all wrapped engines and undone with the last of them. The adapter is assembled from
components: the layout of ZeRO's partitions and the order DeepSpeed's parameters are
registered back in (:mod:`~flatview.backends.deepspeed_zero`), the step
(:mod:`~flatview.backends.deepspeed_step`), flatview's sharded reduction
(:class:`~flatview.comm.sharded.ShardedReduction`), the one state it keeps between
hooks, :class:`Backward`, and its checkpoints
(:mod:`~flatview.backends.deepspeed_checkpoint`).
"""

from __future__ import annotations

import contextlib
import enum
import functools
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from flatview.autograd import at_end_of_backward, in_backward
from flatview.backends import deepspeed_gathering
from flatview.backends.base import Adapter, UnitSpec
from flatview.backends.deepspeed_checkpoint import ZeroCheckpoint
from flatview.backends.deepspeed_checks import DeepSpeedModel
from flatview.backends.deepspeed_grads import ZeroGrads
from flatview.backends.deepspeed_step import ZeroStep, unseen_backward
from flatview.backends.deepspeed_zero import (
    FlatGroups,
    ModuleOrder,
    ShardedParams,
    ZeroLayout,
    plain_specs,
    registrations,
)
from flatview.backends.names import without_segments
from flatview.backends.patches import Patches
from flatview.comm.options import ReduceOptions
from flatview.comm.sharded import ShardedReduction
from flatview.errors import StateError
from flatview.phase import Phase
from flatview.states import Transitions
from flatview.views import Owner

if TYPE_CHECKING:
    from flatview.backends.base import Runtime

__all__ = ["DeepSpeedAdapter"]

_WRAPPER = "module"
"""The attribute the engine keeps the user's module under (dropped from original names)."""

_REPLACED = (
    "reduce_ready_partitions_and_remove_grads",
    "update_hook_state_and_maybe_run_epilogue",
    "overlapping_partition_gradients_reduce_epilogue",
    "process_gradients",
    "reduce_gradients",
)
"""The ZeRO optimizer's gradient handling (its per-parameter hooks and its end of the
backward; the stages have different ones), made no-ops: flatview reduces instead."""

_REFUSED = (
    (
        "engine",
        "coalesce_grad_reduction",
        "accumulate with gradient_accumulation_steps (or engine.no_sync() on ZeRO 1)",
    ),
)
"""(object, method, what to do instead): DeepSpeed operations that would be wrong on a
wrapped engine (its windows accumulate nothing)."""


_BETWEEN_ITERATIONS = (
    "save_checkpoint",
    "load_checkpoint",
    "save_16bit_model",
    "_zero3_consolidated_16bit_state_dict",
)
"""The engine's collective saving and loading calls (also what accelerate's
``get_state_dict`` calls under ZeRO 3): run lent, between iterations."""


_SECOND_BACKWARD = (
    "a second backward through a forward whose backward already ran (retain_graph=True), "
    "or the backward of an earlier forward after a later forward's: flatview reduces once "
    "per forward, for the last one"
)


def clean_name(name: str) -> str:
    """An original name from a name in the engine's tree (``module.`` dropped)."""
    if name == _WRAPPER:
        return ""
    head, _, rest = name.partition(".")
    return without_segments(rest if head == _WRAPPER else name)


def _noop(*args: Any, **kwargs: Any) -> None:
    """Stands in for DeepSpeed's gradient handling: flatview reduces instead."""


def _never(*args: Any, **kwargs: Any) -> bool:
    return False


class Backward(enum.Enum):
    """Whether the end of a backward is queued: a backward reached the last forward's
    outputs and flatview's reduction waits for it to finish."""

    NONE_QUEUED = "no backward of the last forward has begun (or its end has run)"
    QUEUED = "a backward reached the forward's outputs; its end runs once it is done"


_BACKWARD_MOVES = {
    Backward.NONE_QUEUED: (Backward.QUEUED,),
    # Back when the end runs, or at the next forward after a backward that raised (its
    # end never ran).
    Backward.QUEUED: (Backward.NONE_QUEUED,),
}


class DeepSpeedAdapter(Adapter):
    """Maps the flatview runtime onto one DeepSpeed ZeRO engine (see the module
    docstring)."""

    backend = "deepspeed"
    clean_name = staticmethod(clean_name)
    # ZeRO 1/2 keep parameters in flat buffers, ZeRO 3 in per-rank partitions, and the
    # optimizer holds views: torch's checkpoint functions would take a view's optimizer
    # state for a whole parameter's (and name everything ``module.*``), so the handle
    # routes them to flatview.checkpoint's.
    flattens = True

    def __init__(self, model: DeepSpeedModel, options: ReduceOptions) -> None:
        # DeepSpeed is untyped: its objects are reached through ``Any``.
        self.engine: Any = model.engine
        self.stage = model.stage
        self.zero: Any = model.zero
        self.options = options
        self.group = model.group
        self.rank = model.rank
        self.world_size = model.world_size
        # At world size 1 ZeRO communicates no gradient.
        self.wrapper_reduces = self.world_size > 1
        module: nn.Module = self.engine.module
        places = registrations(module)
        # What DeepSpeed computes in (its parameters and gradients; the masters are fp32).
        computed = torch.bfloat16 if self.engine.bfloat16_enabled() else torch.float32
        self.layout: ZeroLayout = (
            ShardedParams(self.zero, places, self.world_size, module, computed)
            if self.stage == 3
            else FlatGroups(self.zero, places, self.world_size, computed)
        )
        self._plain = plain_specs(module, self.layout, places)
        first = self.layout.flats[0].holder if self.layout.flats else None
        self.device = first.device if first is not None else torch.device("cpu")
        self.bucket_numel = max(int(self.engine.zero_reduce_bucket_size()), 1)
        # Where the holders are registered while DeepSpeed computes: outside the model.
        self._holders = nn.Module()
        self._installed: Runtime | None = None
        self._patches = Patches()
        self._backward = Transitions(Backward.NONE_QUEUED, _BACKWARD_MOVES)
        self._depth = 0  # forwards of the engine's module in flight, one inside another
        self._order = ModuleOrder(self.layout)
        self.grads = ZeroGrads(self.engine, self.stage, self.layout, self.world_size)
        self.zero_step = ZeroStep(
            self.engine, self.layout, self.group, self.world_size, self._lent, self.grads.drop
        )
        self.checkpoint = ZeroCheckpoint(
            self.zero, self.layout, self.stage, self.group, self.rank, self.world_size
        )

    @property
    def runtime(self) -> Runtime:
        assert self._installed is not None, "adapter used before install()"
        return self._installed

    # --------------------------------------------------------------- describe

    def describe(self) -> list[UnitSpec]:
        flats = tuple(
            flat.spec(Owner(self._holders, f"flat_{k}"), self.rank)
            for k, flat in enumerate(self.layout.flats)
        )
        return [UnitSpec("", self.engine, flats, self._plain, True)]

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse an optimizer over DeepSpeed's own parameters or partitions: the engine
        overwrites the former from its masters at every step, and the latter would step
        skipped parameters too."""
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for compute, _ in self.layout.compute_params():
            if id(compute) in held:
                raise StateError(
                    f"optimizer {type(optimizer).__name__} holds DeepSpeed's own module "
                    "parameters (built before flatview.wrap): the engine overwrites them "
                    "after every step. Build optimizers from views after wrapping "
                    "(engine.module.<submodule>.parameters() or FlatView.parameters())"
                )
        partitions = [*self.layout.masters(), *(flat.holder for flat in self.layout.flats)]
        if any(id(p) in held for p in partitions):
            raise StateError(
                f"optimizer {type(optimizer).__name__} holds one of DeepSpeed's flat fp32 "
                "partitions: it would step skipped parameters too. Build optimizers from "
                "views (engine.module.<submodule>.parameters() or FlatView.parameters())"
            )

    # ---------------------------------------------------------------- install

    def install(self, runtime: Runtime) -> None:
        self._installed = runtime
        reduction = ShardedReduction(
            self.group, self.rank, self.world_size, runtime.ledger, self.options, self.bucket_numel
        )
        self.grads.install(runtime, reduction)
        self.zero_step.install(runtime, self._point_optimizer(self._view_indices()))
        module, zero, engine = self.engine.module, self.zero, self.engine
        patches = self._patches
        patches.hook(module.register_forward_pre_hook(self._pre_forward, prepend=True))
        patches.hook(module.register_forward_hook(self._post_forward))
        patches.hook(module.register_forward_hook(self._forward_left, always_call=True))
        patches.lending(module, ("state_dict", "_apply"), self._lent)
        patches.patch(module, "load_state_dict", self._loading(module.load_state_dict))
        patches.lending(engine, ("module_state_dict",), self._lent)
        patches.patch(
            engine, "load_module_state_dict", self._loading(engine.load_module_state_dict)
        )
        # The end of the backward is flatview's (an autograd callback): DeepSpeed's own
        # reduction, in its gradient hooks and at its end of backward, does nothing.
        patches.patch(engine, "allreduce_gradients", _noop)
        for name in _REPLACED:
            if hasattr(zero, name):
                patches.patch(zero, name, _noop)
        patches.patch(zero, "should_refresh_expected_hook_count", _never)
        # DeepSpeed's hook at the start of every backward through engine(...)'s outputs.
        patches.patch(engine, "_backward_prologue", self._seen(engine._backward_prologue))
        # Runs after flatview's end of the backward (ZeRO 3 releases what its backward
        # left gathered, reading the submodules' parameters): with DeepSpeed's own.
        patches.lending(zero, ("backward_epilogue",), self._lent)
        patches.patch(zero, "step", self.zero_step.step)
        patches.patch(zero, "zero_grad", self.zero_step.zero_grad)
        patches.patch(engine, "zero_grad", self._engine_zero_grad(engine.zero_grad))
        # DeepSpeed's checkpoints: its files, with flatview's state in the ZeRO ones.
        self.checkpoint.install(runtime)
        patches.patch(zero, "state_dict", self.checkpoint.state_dict)
        patches.patch(zero, "load_state_dict", self.checkpoint.load_state_dict)
        for name in _BETWEEN_ITERATIONS:
            if hasattr(engine, name):
                patches.patch(engine, name, self._between_iterations(getattr(engine, name)))
        deepspeed_gathering.watch(self)
        owners = {"engine": engine, "zero": zero}
        for owner, name, instead in _REFUSED:
            if hasattr(owners[owner], name):
                patches.patch(owners[owner], name, _refusing(name, instead))

    def synchronizing(self) -> bool:
        return self.grads.communicates()

    def view_name(self, tensor: torch.Tensor) -> str | None:
        """The original name of ``tensor`` if it is one of this engine's views (not one
        of DeepSpeed's own parameters): what ``GatheredParameters`` refuses."""
        if self._installed is None or hasattr(tensor, "ds_id"):
            return None
        index = self._installed.index_of(tensor)
        return None if index is None else self._installed.name(index)

    def _view_indices(self) -> dict[int, int]:
        """Per DeepSpeed parameter (by id), the table index of its view (the views are
        shown now, where the parameters were registered)."""
        index: dict[int, int] = {}
        for compute, owners in self.layout.compute_params():
            owner = owners[0]
            view = owner.module._parameters[owner.attr]
            found = None if view is None else self.runtime.index_of(view)
            assert found is not None, owner
            index[id(compute)] = found
        return index

    def _point_optimizer(self, index: dict[int, int]) -> list[int]:
        """Point each of the engine's optimizer's parameter groups at the views of its
        parameters (see the module docstring); the table indices of those views."""
        groups = self.zero.optimizer.param_groups
        members = self.layout.client_params()
        trained: list[int] = []
        for group, params in zip(groups, members, strict=True):
            group["params"] = [self.runtime.tensor(index[id(p)]) for p in params]
            trained.extend(index[id(p)] for p in params)
        return trained

    def uninstall(self) -> None:
        deepspeed_gathering.unwatch(self)
        self._patches.remove()
        client = self.zero.optimizer
        for group, params in zip(client.param_groups, self.layout.client_restore(), strict=True):
            group["params"] = params
        # Its state is per view; DeepSpeed's is per partition (and skipped parameters
        # stepped fewer times): it starts afresh, as a new optimizer would.
        client.state = defaultdict(dict)
        for flat in self.layout.flats:
            flat.holder.grad = None
        self._order.register()
        if self.zero_step.changed():
            # Written through views since the last publishing: bare DeepSpeed computes
            # from its own copies, which nothing would update again. (Its parameters
            # are registered: ZeRO 3 releases them by walking the modules.)
            self.zero_step.publish_written()

    # ------------------------------------------------------------- lifecycle

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if in_backward():
            return  # a recomputation (activation checkpointing): not a new iteration
        self._depth += 1
        if self._depth > 1:
            # A forward of the module inside its own (Lightning's DeepSpeedStrategy runs
            # training_step in the engine's forward, and ``self(x)`` there goes through
            # the engine again): part of the iteration in flight.
            return
        runtime = self.runtime
        if self._backward.state is Backward.QUEUED:
            # The last backward raised before it ended: its end never ran.
            self._backward.move(Backward.NONE_QUEUED)
        runtime.begin_compute(outermost=True)
        # DeepSpeed's own parameters back on the submodules (the views stepped aside):
        # what its forward and its hooks read.
        self._order.register()
        if not self.grads.keeps_local():
            # Gradients DeepSpeed's parameters hold now were left by a backward that
            # raised (flatview's end of the backward takes them): not to add to this one.
            for param, _ in self.layout.compute_params():
                param.grad = None
        if self.zero_step.changed():
            self.zero_step.publish_written()
        for flat in self.layout.flats:
            runtime.guard_skipped(flat.holder)
        runtime.guard_skipped_plain()

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if in_backward() or self._depth > 1:
            return
        runtime = self.runtime
        runtime.settle_agreement()
        if not torch.is_grad_enabled():
            runtime.end_forward_only()
            return
        for leaf in tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                # Not kept for uninstall: these die with the output.
                leaf.register_hook(self._backward_starts)

    def _forward_left(self, module: nn.Module, args: Any, output: Any) -> None:
        """After every forward, also one that raised (``always_call``)."""
        if not in_backward():
            self._depth -= 1

    def _backward_starts(self, grad: torch.Tensor) -> None:
        if self._installed is None or self._backward.state is Backward.QUEUED:
            return
        if self._installed.phase is not Phase.COMPUTING:
            # Before DeepSpeed's own backward hooks (ZeRO 3's would gather the views).
            raise StateError(_SECOND_BACKWARD)
        self._installed.check_backward_binding()
        self._backward.move(Backward.QUEUED)
        at_end_of_backward(self._end_backward)

    def _seen(self, prologue: Callable[[], None]) -> Callable[[], None]:
        """DeepSpeed's start of a backward, refused unless flatview saw its forward
        begin: a forward that ran before ``flatview.wrap`` registered none of flatview's
        hooks (its gradients would reach no view: a step lost without a word under ZeRO
        1/2, a crash inside DeepSpeed's backward hooks under ZeRO 3), and a second
        backward through one forward would reduce twice. Every rank ran the same
        forward, so every rank raises, before any collective."""

        @functools.wraps(prologue)
        def checked() -> None:
            if self.runtime.phase is not Phase.COMPUTING:
                raise StateError(unseen_backward("DeepSpeed's hook at the start of the backward"))
            prologue()

        return checked

    def _end_backward(self) -> None:
        self._backward.move(Backward.NONE_QUEUED)
        runtime = self.runtime
        if runtime.phase is not Phase.COMPUTING:
            raise StateError(_SECOND_BACKWARD)
        runtime.end_backward(synced=self.grads.end_backward())

    # ---------------------------------------------------------------- lending

    @contextlib.contextmanager
    def _lent(self) -> Iterator[None]:
        with self.runtime.lend():
            if self.runtime.phase is Phase.LENT:
                self._order.register()
            yield

    def _loading(self, method: Callable[..., Any]) -> Callable[..., Any]:
        """A load into DeepSpeed's module parameters, carried into the fp32 masters
        (ZeRO 1/2; under ZeRO 3 the parameters are empty between passes, as without
        flatview)."""

        @functools.wraps(method)
        def load(*args: Any, **kwargs: Any) -> Any:
            with self._lent():
                result = method(*args, **kwargs)
                if isinstance(self.layout, FlatGroups):
                    self.zero.refresh_fp32_params()
                    self.zero_step.mark_published()
            return result

        return load

    def _engine_zero_grad(self, method: Callable[[], None]) -> Callable[[], None]:
        """The engine's ``zero_grad`` (its module's parameters: the views), dropping also
        what was accumulated towards DeepSpeed's boundary, as ``zero_grad`` on the
        unwrapped model drops what it accumulated."""

        @functools.wraps(method)
        def zero_grad() -> None:
            method()
            self.zero_step.zero_grad()

        return zero_grad

    def _between_iterations(self, method: Callable[..., Any]) -> Callable[..., Any]:
        """One of the engine's collective saving and loading calls (every rank makes
        it), between iterations only (every rank is in the same phase: all raise before
        DeepSpeed's first collective), with values written through views published
        first and DeepSpeed's parameters registered, as its code reads them."""

        @functools.wraps(method)
        def between(*args: Any, **kwargs: Any) -> Any:
            phase = self.runtime.phase
            if phase is Phase.LENT:  # inside another of them
                return method(*args, **kwargs)
            if phase is not Phase.IDLE:
                raise StateError(
                    f"engine.{method.__name__}() while the model is {phase.name}: save and "
                    "load between iterations"
                )
            with self._lent():
                if self.zero_step.changed():
                    # What they read of DeepSpeed's parameters must hold what views wrote.
                    self.zero_step.publish_written()
                return method(*args, **kwargs)

        return between


def _refusing(name: str, instead: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise StateError(
            f"{name} is not supported while flatview wraps the DeepSpeed engine: {instead}"
        )

    return refuse
