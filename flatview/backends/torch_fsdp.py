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
  adapter sets per unit so that the hook knows whose gradient it reduces.
* After a backward the root's final callback waits for the reductions, calls
  ``next_iter()`` on the execution-order record ``unit._exec_order_data`` (one object
  shared by every unit), and only then finalises each unit (the sharded gradient moves
  from ``flat._saved_grad_shard`` to ``flat.grad``). Wrapping ``next_iter`` on that
  object gives the point "every backward hook ran, nothing finalised yet", like
  fairscale's ``_wait_for_post_backward``. A unit that took no part in the backward
  still has ``handle._training_state`` other than ``BACKWARD_POST`` there.
* Forward prefetching (``forward_prefetch=True``) follows the pre-forward order of the
  *first* iteration, ``_exec_order_data.handles_pre_forward_order``, through
  ``get_handle_to_forward_prefetch``: with skip sets that change per step it
  all-gathers units the step skips. Backward prefetching follows the post-forward order
  of the current iteration (``handles_post_forward_order``, through
  ``get_handle_to_backward_prefetch``), which holds no skipped unit, except after a
  forward that no backward followed: torch then keeps that forward's order and stale
  ``handle._post_forward_index`` values, and prefetches units the next step skips. Both
  choices are replaced by the same walk with this step's skipped units left out.
* Summoning (``summon_full_params``, which is a static method, and the full and sharded
  ``state_dict`` / ``load_state_dict`` hooks) unshards through ``handle.pre_unshard()``
  with ``handle._training_state == SUMMON_FULL_PARAMS`` before it touches any module
  attribute, and ends with ``handle.post_reshard()`` after the flat parameter is
  registered again: views step aside between the two.

* Two of torch's assumptions break once units or parameters sit out a step, and the
  adapter makes up for both: ``SHARD_GRAD_OP`` frees a unit's unsharded flat parameter
  only in that unit's post-backward (a skipped unit kept it from an earlier forward,
  stale after the next optimizer step: :meth:`TorchFSDPAdapter._holds_stale_unsharded`),
  and with ``use_orig_params=True`` the ``flat._is_grad_none_mask`` marks are cleared
  only in a synchronising backward (a parameter handed ``None`` would lose what
  ``no_sync()`` accumulated for it: :meth:`TorchFSDPAdapter._unmark_accumulated_grads`).

Everything this adapter changes is an instance attribute, a hook or a unit's
communication hook, removed by :meth:`TorchFSDPAdapter.uninstall`.

Wrapping runs torch's lazy initialisation (it would otherwise run at the first forward).
Before that every unit's ``_is_root`` is ``None``; a unit that another FSDP was
constructed around carries that constructor's ``_is_fsdp_managed_module`` mark in its
own ``__dict__`` and is refused. One that an auto-wrap policy created is not marked:
torch would take it for the root (``docs/limitations.md``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.utils import _to_kwargs

from flatview.backends._common import (
    AdapterBase,
    forward_in_summon,
    join,
    nested_unit_message,
    optional_class,
    owners_and_names,
    without_segments,
)
from flatview.backends.base import FlatSpec, PlainSpec, UnitSpec
from flatview.checkpoint_guard import guard_torch_checkpoint
from flatview.comm.options import ReduceOptions
from flatview.comm.packing import plan_index
from flatview.comm.replicated import ReplicatedReduction
from flatview.comm.sharded import ShardedReduction
from flatview.errors import StateError, UndeclaredUnusedError, WrapError
from flatview.layout import FlatLayout, MaskPlan, Segment
from flatview.registry import check_not_wrapped
from flatview.views import Owner

if TYPE_CHECKING:
    from flatview.backends.base import Runtime

TESTED_TORCH = ((2, 13),)
"""``(major, minor)`` versions of torch whose FSDP1 internals this adapter was checked
against."""

UNTESTED_TORCH_ENV = "FLATVIEW_ALLOW_UNTESTED_TORCH"
"""Set to ``1`` to wrap torch FSDP1 models on a torch outside :data:`TESTED_TORCH` (with a
warning): the internals read are checked attribute by attribute at wrap time, so a torch
that moved them still fails there, but one that changed their meaning would not."""

_WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module"})
_FLAT_PARAM = "_flat_param"
_LENDING_METHODS = ("state_dict", "load_state_dict", "_apply")
# Views stepped aside also for the root's gradient clipping: FSDP adds the norm of every
# parameter of `self.parameters()` it does not manage, and views would count twice.
_ROOT_LENDING_METHODS = ("clip_grad_norm_",)
_FLAT_ATTRS = (
    "_param_infos",
    "_shared_param_infos",
    "_shapes",
    "_contiguities",
    "_numels_with_padding",
    "_is_padding_mask",
    "_unpadded_unsharded_size",
    "_local_shard",
)
# The hook reduces at once, so nothing waits in the reductions' buckets between units (see
# TorchFSDPAdapter.reduce); the bucket size only has to exceed any one gradient.
_NO_BUCKETING = 2**62

FSDP2_MESSAGE = (
    "flatview.wrap was given a model sharded with FSDP2 (torch.distributed.fsdp.fully_shard). "
    "FSDP2 keeps every original parameter as its own sharded DTensor and has no flat "
    "parameters, so there is nothing for flatview to give back: build optimizers from "
    "submodule.parameters() directly. FSDP2 already reduce-scatters only the parameters "
    "that received a gradient."
)


def _fsdp_class() -> type[nn.Module] | None:
    if not dist.is_available():
        return None
    return optional_class("torch.distributed.fsdp", "FullyShardedDataParallel")


def is_torch_fsdp(model: object) -> bool:
    """Whether ``model`` is a torch FSDP1 ``FullyShardedDataParallel`` module."""
    cls = _fsdp_class()
    return cls is not None and isinstance(model, cls)


def is_fsdp2(model: object) -> bool:
    """Whether ``model`` or one of its submodules was sharded with FSDP2 ``fully_shard``."""
    if not isinstance(model, nn.Module) or not dist.is_available():
        return False
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def torch_version() -> tuple[int, int]:
    """``(major, minor)`` of the running torch."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def clean_name(name: str) -> str:
    """An original name from a name in the wrapped tree (wrapper levels dropped)."""
    return without_segments(name, _WRAPPER_SEGMENTS)


def flat_layout(flat: Any, world_size: int) -> FlatLayout:
    """The layout of a torch ``FlatParameter`` sharded over ``world_size`` ranks.

    Alignment padding between parameters (``use_orig_params=True``) becomes gaps between
    segments; the padding at the end that makes the flat divisible by the world size is
    the layout's own.
    """
    shapes = iter(flat._shapes)
    segments = []
    offset = 0
    for numel, is_padding in zip(flat._numels_with_padding, flat._is_padding_mask, strict=True):
        if not is_padding:
            segments.append(Segment(offset, int(numel), tuple(next(shapes))))
        offset += int(numel)
    return FlatLayout(tuple(segments), int(flat._unpadded_unsharded_size.numel()), world_size)


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


class SummonLending:
    """Views step aside for the length of a summoning (``summon_full_params``, full or
    sharded ``state_dict``): torch unshards each unit through ``handle.pre_unshard()``
    with ``handle._training_state == SUMMON_FULL_PARAMS`` before it touches any module
    attribute, and ends with ``handle.post_reshard()`` after the flat parameter is
    registered again. The views step aside at the first unit's entry and come back at
    the last unit's exit, through ``lend``."""

    def __init__(self, state: Any, lend: Callable[[], AbstractContextManager[None]]) -> None:
        self._state = state
        self._lend = lend
        self._units: set[int] = set()
        self._lent = contextlib.ExitStack()

    def patch(self, handle: Any, patch: Callable[[object, str, Callable[..., Any]], None]) -> None:
        """Shadow ``handle``'s two methods with bracketing ones (through ``patch``, which
        records them for removal)."""
        patch(handle, "pre_unshard", self._entry(handle))
        patch(handle, "post_reshard", self._exit(handle))

    def close(self) -> None:
        self._units.clear()
        self._lent.close()

    def _entry(self, handle: Any) -> Callable[[], bool]:
        original = handle.pre_unshard

        def pre_unshard() -> bool:
            if handle._training_state is self._state and id(handle) not in self._units:
                if not self._units:
                    self._lent.enter_context(self._lend())
                self._units.add(id(handle))
            result: bool = original()
            return result

        return pre_unshard

    def _exit(self, handle: Any) -> Callable[[], None]:
        original = handle.post_reshard

        def post_reshard() -> None:
            original()
            # torch registered the flat parameter again before resharding: the summoning
            # of this unit is over.
            if handle._training_state is self._state and id(handle) in self._units:
                self._units.discard(id(handle))
                if not self._units:
                    self._lent.close()

        return post_reshard


class TorchFSDPAdapter(AdapterBase):
    """Maps the flatview core onto one torch FSDP1 model (root and nested units)."""

    backend = "torch"
    _sharded: ShardedReduction
    _replicated: ReplicatedReduction
    """The reductions of sharded and of ``NO_SHARD`` units' gradients, made at
    :meth:`install` with the runtime's ledger."""

    def __init__(self, model: nn.Module, options: ReduceOptions | None = None) -> None:
        super().__init__()
        self.options = options if options is not None else ReduceOptions()
        version = torch_version()
        if version not in TESTED_TORCH:
            tested = ", ".join(f"{a}.{b}.x" for a, b in TESTED_TORCH)
            message = (
                f"flatview's torch FSDP backend relies on FSDP1 internals checked against "
                f"torch {tested}; found torch {torch.__version__}"
            )
            if os.environ.get(UNTESTED_TORCH_ENV) != "1":
                raise WrapError(f"{message} (set {UNTESTED_TORCH_ENV}=1 to try it anyway)")
            warnings.warn(f"{message}; going ahead ({UNTESTED_TORCH_ENV}=1)", stacklevel=3)
        from torch.distributed.fsdp import ShardingStrategy
        from torch.distributed.fsdp import _runtime_utils as runtime
        from torch.distributed.fsdp._common_utils import HandleTrainingState, TrainingState

        fsdp = _fsdp_class()
        assert fsdp is not None
        self._runtime: Any = runtime
        self._forward_backward = TrainingState.FORWARD_BACKWARD
        self._idle = TrainingState.IDLE
        self._handle_idle = HandleTrainingState.IDLE
        self._backward_pre = HandleTrainingState.BACKWARD_PRE
        self._backward_post = HandleTrainingState.BACKWARD_POST
        self._summoning_state = HandleTrainingState.SUMMON_FULL_PARAMS
        self._summoning_unit = TrainingState.SUMMON_FULL_PARAMS
        # torch's FSDP internals are untyped: they are reached through ``Any``.
        root: Any = model
        self.root = root
        # Before lazy initialisation every unit has `_is_root` None; a unit constructed
        # before another FSDP around it is marked by that one's constructor (for Dynamo;
        # in the unit's own __dict__: FSDP forwards missing attributes to the wrapped
        # module, which its own constructor marks). A unit that an auto-wrap policy
        # created is not marked (see docs/limitations.md).
        if root._is_root is False or vars(root).get("_is_fsdp_managed_module", False):
            raise WrapError(nested_unit_message(root, fsdp, clean_name))
        self.units: list[tuple[str, Any]] = [
            (clean_name(name), m) for name, m in root.named_modules() if isinstance(m, fsdp)
        ]
        hybrid = {ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2}
        for name, unit in self.units:
            label = name or "<root>"
            if unit.training_state is not TrainingState.IDLE:
                raise StateError(
                    f"FSDP unit {label!r} is in state {unit.training_state.name}; wrap the "
                    "model between iterations"
                )
            # torch turns a hybrid strategy whose shard group has one rank into NO_SHARD
            # but keeps the replica group; either way two groups would need reducing.
            if unit.sharding_strategy in hybrid or hasattr(unit, "_inter_node_pg"):
                raise WrapError(
                    f"FSDP unit {label!r} uses hybrid sharding; flatview's torch "
                    "backend supports FULL_SHARD, SHARD_GRAD_OP and NO_SHARD (hybrid sharding "
                    "reduces over two process groups, which torch's communication hooks "
                    "do not cover)"
                )
            if unit.process_group is not root.process_group:
                raise WrapError(
                    f"FSDP unit {label!r} uses its own process group; flatview needs all "
                    "units on the root's group"
                )
            if unit.cpu_offload.offload_params:
                raise WrapError(
                    f"FSDP unit {label!r} offloads parameters to CPU (CPUOffload("
                    "offload_params=True)); flatview's torch backend does not support that"
                )
            # flatview's own hook means flatview wrapped it already: say that instead.
            check_not_wrapped([unit])
            if unit._comm_hook is not None:
                raise WrapError(
                    f"FSDP unit {label!r} already has a communication hook; flatview reduces "
                    "gradients through its own hook and cannot combine with another"
                )
        # Lazy initialisation creates the local shards the views alias and the shared
        # execution-order record; torch would run it at the first forward anyway.
        root.check_is_root()
        self._check_no_pending_backward()
        for name, unit in self.units:
            if unit._handle is not None:
                self._check_flat(name, unit._handle)
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
        self._undeclared: list[str] = []
        self._grads_at_forward: list[tuple[Any, torch.Tensor | None]] = []
        # use_orig_params=True: torch gives every original parameter of a reduced flat
        # parameter a gradient, zeros for the skipped ones; those that had none when the
        # first forward since the last synchronising backward began get None back (see
        # _restore_none_grads).
        self._accumulating = False
        self._none_before: set[int] = set()
        # Taken again at the window's first backward: a zero_grad between the forward
        # and its backward decides which parameters had no gradient.
        self._none_at_backward = False
        self._masked: list[tuple[Any, int]] = []
        # Flat parameters whose gradient hook waits for an in-place reduction in flight.
        self._in_place_guarded: set[int] = set()

    def _check_no_pending_backward(self) -> None:
        """Refuse to wrap between a forward and its backward: torch registered that
        forward's backward hooks for a model without flatview (and without views),
        whose gradients flatview would then never see. torch marks each unit whose
        forward registered pre-backward hooks until its backward (or the end of the
        backward) runs."""
        for name, unit in self.units:
            handle = unit._handle
            if handle is not None and getattr(handle, "_needs_pre_backward_unshard", False):
                raise WrapError(
                    f"flatview.wrap was called between a forward and its backward (FSDP unit "
                    f"{name or '<root>'!r} waits for the backward of a forward that ran with "
                    "autograd on); wrap the model between iterations: after the backward, or "
                    "before the forward (run evaluation passes under torch.no_grad())"
                )

    def _check_flat(self, unit_name: str, handle: Any) -> None:
        flat = handle.flat_param
        label = unit_name or "<root>"
        missing = [attr for attr in _FLAT_ATTRS if not hasattr(flat, attr)]
        if missing:
            raise WrapError(
                f"the flat parameter of FSDP unit {label!r} lacks {', '.join(missing)}; this "
                f"torch ({torch.__version__}) is not one flatview's torch backend supports"
            )
        if not handle._use_orig_params and not all(flat._contiguities):
            names = [fqn for fqn, c in zip(flat._fqns, flat._contiguities, strict=True) if not c]
            raise WrapError(
                f"FSDP unit {label!r} flattened non-contiguous parameters ({', '.join(names)}); "
                "flatview's views assume a contiguous layout: make them contiguous before "
                "wrapping in FSDP"
            )
        if any(ext is not None for ext in getattr(flat, "_param_extensions", ())):
            raise WrapError(
                f"FSDP unit {label!r} uses FSDP extensions (tensor parallelism); flatview's "
                "torch backend does not support them"
            )

    @staticmethod
    def clean_name(name: str) -> str:
        return clean_name(name)

    # --------------------------------------------------------------- describe

    def describe(self) -> list[UnitSpec]:
        specs = []
        for unit_name, unit in self.units:
            handle = unit._handle
            flats = () if handle is None else (self._describe_flat(unit_name, unit, handle),)
            plain = self._plain_params(unit_name, unit)
            specs.append(UnitSpec(unit_name, unit, flats, plain, unit is self.root))
        return specs

    def _describe_flat(self, unit_name: str, unit: Any, handle: Any) -> FlatSpec:
        flat = handle.flat_param
        sharded = bool(handle.uses_sharded_strategy)
        layout = flat_layout(flat, self.world_size if sharded else 1)
        if flat._local_shard.numel() != layout.shard_numel:
            raise WrapError(
                f"the flat parameter of FSDP unit {unit_name or '<root>'!r} holds "
                f"{flat._local_shard.numel()} elements per rank, but its layout says "
                f"{layout.shard_numel}"
            )
        owners, names = owners_and_names(
            unit_name,
            ((name, m, a) for a, m, name in flat._param_infos),
            ((name, m, a, pm, pa) for a, m, name, pa, pm, _ in flat._shared_param_infos),
            clean_name,
        )

        def local_shard() -> torch.Tensor:
            shard: torch.Tensor = flat._local_shard
            return shard

        return FlatSpec(
            flat=flat,
            flat_owner=Owner(unit.module, _FLAT_PARAM),
            layout=layout,
            rank=self.rank if sharded else 0,
            owners=owners,
            names=names,
            local_shard=local_shard,
            wrapper_views=tuple(flat._params) if handle._use_orig_params else None,
        )

    def _plain_params(self, unit_name: str, unit: Any) -> tuple[PlainSpec, ...]:
        """Parameters under ``unit`` (not under a nested unit) that FSDP did not flatten:
        those it was told to ignore."""
        handle = unit._handle
        managed: set[int] = set()
        if handle is not None:
            flat = handle.flat_param
            managed.add(id(flat))
            managed.update(id(p) for p in flat._params or ())
            managed.update(id(p) for p in flat._shared_params or ())
        plain = []
        for module_name, module in self._own_modules(unit):
            for attr, param in module._parameters.items():
                if param is None or id(param) in managed:
                    continue
                managed.add(id(param))
                name = join(unit_name, clean_name(module_name), attr)
                plain.append(PlainSpec(name, param, tuple(param.shape)))
        return tuple(plain)

    def _own_modules(self, unit: nn.Module) -> Iterator[tuple[str, nn.Module]]:
        """``unit`` and its submodules, without descending into nested units."""
        stack: list[tuple[str, nn.Module]] = [("", unit)]
        while stack:
            name, module = stack.pop()
            yield name, module
            for child_name, child in reversed(list(module.named_children())):
                if id(child) not in self._unit_index:
                    stack.append((join(name, child_name), child))

    # ---------------------------------------------------------------- install

    def install(self, core: Runtime) -> None:
        self._core = core
        # NO_SHARD units' gradients go to the replicated reduction, the others' to the
        # sharded one; a model may mix both.
        reduction = (self.group, self.rank, self.world_size, core.ledger, self.options)
        self._sharded = ShardedReduction(*reduction, self.bucket_numel)
        self._replicated = ReplicatedReduction(*reduction, self.bucket_numel)
        self.root.register_comm_hook(None, _reduce_hook)
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
            self._patch(unit, "forward", self._summonable(unit, unit.forward))
            methods = _LENDING_METHODS + (_ROOT_LENDING_METHODS if unit is self.root else ())
            for method in methods:
                self._patch(unit, method, self._lending(getattr(unit, method)))
            handle = unit._handle
            if handle is not None:
                self._summon.patch(handle, self._patch)
                if handle._use_orig_params:
                    prepare = handle.prepare_gradient_for_backward
                    self._patch(handle, "prepare_gradient_for_backward", self._noting_none(prepare))
        self._hook(self.root.register_forward_hook(self._post_forward))
        order = self.root._exec_order_data
        self._patch(order, "next_iter", self._finishing(order.next_iter))
        self._patch(order, "get_handle_to_forward_prefetch", self._forward_prefetch_target)
        self._patch(order, "get_handle_to_backward_prefetch", self._backward_prefetch_target)
        guard_torch_checkpoint(self)

    def uninstall(self) -> None:
        super().uninstall()
        for _, unit in self.units:
            unit._comm_hook = None
            unit._comm_hook_state = None
        self._summon.close()
        self._in_place_guarded.clear()

    # -------------------------------------------------------------- lifecycle

    def _summonable(self, unit: Any, original: Callable[..., Any]) -> Callable[..., Any]:
        """``unit.forward``, except inside ``summon_full_params`` of the unit, where its
        submodules hold the full parameters and the wrapped module runs on them directly
        (see :func:`~flatview.backends._common.forward_in_summon`)."""

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            if unit.training_state is not self._summoning_unit:
                return original(*args, **kwargs)
            if unit is self.root and self.device.type != "cpu":
                moved_args, moved_kwargs = _to_kwargs(args, kwargs, self.device, False)
                args = moved_args[0] if moved_args else ()
                kwargs = moved_kwargs[0] if moved_kwargs else {}
            return forward_in_summon(unit._fsdp_wrapped_module, *args, **kwargs)

        return forward

    def _pre_forward(self, unit_index: int, module: nn.Module, args: Any) -> None:
        if self.units[unit_index][1].training_state is self._summoning_unit:
            return  # a forward inside summon_full_params: not an iteration
        outermost = module is self.root
        if outermost and self._backward_aborted():
            self._abandon_backward()
        if outermost and not self._accumulating:
            self._note_none_grads()
            self._none_at_backward = True
            # torch re-derives the mask from the gradients it finds (and resets it only
            # after a synchronising backward): a stale entry would make it drop what
            # no_sync() accumulates for that parameter.
            for flat, index in self._masked:
                flat._is_grad_none_mask[index] = False
            self._masked.clear()
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

    def _note_none_grads(self) -> None:
        self._none_before = {
            id(p) for flat in self._wrapper_flats() for p in flat._params if p.grad is None
        }

    def _noting_none(self, original: Callable[[], None]) -> Callable[[], None]:
        """torch's pre-backward preparation of a flat gradient, after noting (at the first
        of a window's backward) which original parameters have no gradient then."""

        def prepare_gradient_for_backward() -> None:
            if self._none_at_backward:
                self._none_at_backward = False
                self._note_none_grads()
            original()

        return prepare_gradient_for_backward

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

    def _forward_prefetch_target(self, current: Any) -> Any:
        """Torch's forward-prefetch choice (the unit ``limit`` steps ahead in the first
        iteration's order) with the units this step skips left out."""
        order = self.root._exec_order_data
        index = current._pre_forward_order_index
        if index is None:
            return None
        ahead = order.handles_pre_forward_order[index + 1 :]
        return self._prefetch_target(ahead, order._forward_prefetch_limit)

    def _backward_prefetch_target(self, current: Any) -> Any:
        """Torch's backward-prefetch choice (the unit ``limit`` steps back in this
        iteration's post-forward order) with the units this step skips left out.

        The order normally holds only units that ran, but after a forward that no
        backward followed it still holds that forward's units, under stale indices."""
        order = self.root._exec_order_data
        index = current._post_forward_index
        if index is None:
            return None
        behind = order.handles_post_forward_order[index - 1 :: -1] if index > 0 else []
        return self._prefetch_target(behind, order._backward_prefetch_limit)

    def _prefetch_target(self, candidates: list[Any], limit: int) -> Any:
        target = None
        for candidate in candidates:
            if limit <= 0:
                break
            unit = self._handle_unit.get(id(candidate))
            if unit is not None and self.core.unit_skipped(unit):
                continue
            target = candidate
            limit -= 1
        return target

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

    @torch.no_grad()
    def _settle_units_without_backward(self) -> None:
        """Note units that took no part in this backward without being declared skipped,
        and reduce what earlier ``no_sync()`` micro-batches accumulated in units this
        synchronising backward skipped."""
        synced = bool(self.root._sync_gradients)
        self._undeclared = []
        for index, (name, unit) in enumerate(self.units):
            handle = unit._handle
            if handle is None or not handle.flat_param.requires_grad:
                continue
            if handle._training_state is self._backward_post:
                continue
            if not self.core.unit_skipped(index):
                self._undeclared.append(name or "<root>")
            flat = handle.flat_param
            pending = (
                synced
                and flat.grad is not None
                and (
                    not handle.uses_sharded_strategy
                    or flat.grad.shape == flat._unpadded_unsharded_size
                )
                and self.core.flat_used_so_far(flat)
            )
            if pending:
                # What the unit's own post-backward hook would have done; torch resets
                # both states when it finalises the unit right after this.
                unit.training_state = self._forward_backward
                handle._training_state = self._backward_pre
                self._runtime._post_backward_hook(unit, handle, flat)
            elif self._holds_stale_unsharded(unit, handle):
                self._runtime._reshard(unit, handle, True)

    def _holds_stale_unsharded(self, unit: Any, handle: Any) -> bool:
        """Whether a unit that took no part in this backward still holds an unsharded
        flat parameter that torch would have freed in its post-backward.

        After a forward that no backward followed (an evaluation with autograd on),
        ``SHARD_GRAD_OP`` keeps the unsharded storage and points the flat parameter back
        at its shard, so torch's catch-all reshard takes the unit for resharded and
        keeps the storage. The optimizer then moves the shard, and the unit's next
        forward (or a full ``state_dict``) reuses the storage instead of gathering:
        stale parameters. A unit that runs in every backward never gets there; one
        that a skip set leaves out does.
        """
        return (
            handle.uses_sharded_strategy
            and not handle.needs_unshard()
            and bool(self._runtime._should_free_in_backward(unit, handle))
        )

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
            raise UndeclaredUnusedError(
                f"FSDP unit(s) {', '.join(repr(n) for n in undeclared)} took no part in this "
                "backward pass, but their parameters are not all declared skipped. Pass the "
                "layers a step does not use to FlatView.step(skip=...)."
            )

    def _wrapper_flats(self) -> Iterator[Any]:
        for _, unit in self.units:
            handle = unit._handle
            if handle is not None and handle._use_orig_params:
                yield handle.flat_param

    def _unmark_accumulated_grads(self) -> None:
        """After a ``no_sync()`` backward, clear torch's "gradient is None" mark of the
        original parameters used since the window opened.

        With ``use_orig_params=True`` torch marks a parameter whose ``.grad`` it finds
        ``None`` while the flat gradient exists (which :meth:`_restore_none_grads`, or
        per-submodule optimizers zeroing differently, leave behind), and clears the mark
        only in a synchronising backward. Until then every reshard hands the parameter
        ``None`` again and the next unshard zeroes its part of the flat gradient: what
        the earlier micro-batches accumulated for it would be lost. A parameter used in
        the window received a gradient, so it is unmarked, as torch's own post-backward
        does for every parameter it reduces.
        """
        for flat in self._wrapper_flats():
            plan = self.core.reduction_plan(flat)
            if plan is None:
                continue
            for index, used in enumerate(plan.used):
                if used:
                    flat._is_grad_none_mask[index] = False

    @torch.no_grad()
    def _restore_none_grads(self) -> None:
        """With ``use_orig_params=True`` torch hands every original parameter of a reduced
        flat parameter its piece of the sharded gradient, zeros for skipped ones: give
        back ``None`` to those skipped since the window opened that had none then."""
        for flat in self._wrapper_flats():
            plan = self.core.reduction_plan(flat)
            if plan is None or plan.all_used:
                continue
            tied = [
                (id(prim_module), prim_attr, param)
                for (_, _, _, prim_attr, prim_module, _), param in zip(
                    flat._shared_param_infos, flat._shared_params, strict=True
                )
            ]
            for index, (used, param, info) in enumerate(
                zip(plan.used, flat._params, flat._param_infos, strict=True)
            ):
                if used or id(param) not in self._none_before:
                    continue
                param.grad = None
                # So that torch keeps it None when it hands out gradients again before
                # the next forward (state_dict, summon_full_params).
                flat._is_grad_none_mask[index] = True
                self._masked.append((flat, index))
                attr, module, _ = info
                for prim_id, prim_attr, other in tied:
                    if prim_id == id(module) and prim_attr == attr:
                        other.grad = None

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
