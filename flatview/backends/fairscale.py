"""Adapter for fairscale's ``FullyShardedDataParallel`` (0.4.x).

Where fairscale keeps things (see ``docs/internals.md``):

* Each FSDP unit wraps its module in a ``FlattenParamsWrapper`` (FPW) that registers
  one ``FlatParameter`` per parameter group as ``flat_param_<i>`` and records, per
  original parameter, ``(module_name, module, attr)`` in ``_param_infos`` and tied
  parameters in ``_shared_param_infos``.
* Between passes ``flat.data`` is the full-precision local shard ``flat._fp32_shard``,
  padded at its end to a multiple of the world size, laid out as ``torch.chunk`` splits.
* Before computing, FPW sets plain tensor views of the unsharded flat on the
  submodules with ``setattr``; ``nn.Module.__setattr__`` refuses a plain tensor for a
  registered parameter name, so flatview's views step aside while fairscale computes.
* Gradient reduction goes through ``unit._reducer`` (one bucketer the root shares with
  all units), called as ``reduce_scatter_async(chunks, group, callback_fn)`` where the
  callback is ``functools.partial(unit._post_reduction_hook, flat)``.
* The root queues ``_wait_for_post_backward`` once per backward; it asserts that every
  unit with trainable parameters fired its post-backward hook, which a unit that did
  not run cannot do (fairscale crashes there when a nested unit is skipped).

Everything this adapter changes is an instance attribute or a hook, removed by
:meth:`FairscaleAdapter.uninstall`.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from flatview.backends._common import (
    forward_in_summon,
    join,
    nested_unit_message,
    optional_class,
    owners_and_names,
    without_segments,
)
from flatview.backends._fsdp1_shared import UnitAdapter
from flatview.backends.base import FlatSpec, PlainSpec, UnitSpec
from flatview.backends.fairscale_checks import (
    LOCAL_LENDING_METHODS,
    check_privates,
    check_version,
)
from flatview.backends.fairscale_gather import MaskedGatherDist
from flatview.backends.messages import undeclared_units, unfinished_backward
from flatview.checkpoint_guard import guard_torch_checkpoint
from flatview.comm.options import ReduceOptions
from flatview.comm.sharded import ShardedReduction
from flatview.errors import StateError, WrapError
from flatview.layout import FlatLayout, MaskPlan
from flatview.views import Owner

if TYPE_CHECKING:
    from flatview.backends.base import Runtime

_WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_fpw_module"})


def _fsdp_class() -> type[nn.Module] | None:
    return optional_class("fairscale.nn.data_parallel", "FullyShardedDataParallel")


def is_fairscale_fsdp(model: object) -> bool:
    cls = _fsdp_class()
    return cls is not None and isinstance(model, cls)


def clean_name(name: str) -> str:
    """An original name from a name in the wrapped tree (wrapper levels dropped)."""
    return without_segments(name, _WRAPPER_SEGMENTS)


class FairscaleAdapter(UnitAdapter):
    """Maps the flatview core onto one fairscale FSDP model (root and nested units)."""

    backend = "fairscale"
    clean_name = staticmethod(clean_name)
    reduction: ShardedReduction
    """Where every gradient fairscale would reduce goes (:class:`_ReducerShim`); made
    at :meth:`install`, with the runtime's ledger."""

    def __init__(self, model: nn.Module, options: ReduceOptions | None = None) -> None:
        super().__init__()
        self.options = options if options is not None else ReduceOptions()
        version = check_version()
        from fairscale.nn.data_parallel.fully_sharded_data_parallel import TrainingState

        fsdp = _fsdp_class()
        assert fsdp is not None
        # fairscale is untyped: its attributes are reached through ``Any``.
        root: Any = model
        self.root = root
        # Before the first forward every unit has `_is_root` None and fairscale leaves no
        # other trace of nesting on a unit: the root's lazy initialisation marks the
        # others False, which the first forward checks (_pre_forward).
        self._fsdp = fsdp
        units: list[tuple[str, Any]] = [
            (clean_name(name), m) for name, m in root.named_modules() if isinstance(m, fsdp)
        ]
        check_privates(root, units, TrainingState, version)
        self._idle = TrainingState.IDLE
        self._pre = TrainingState.BACKWARD_PRE
        self._post = TrainingState.BACKWARD_POST
        self._summoning = TrainingState.SUMMON_FULL_PARAMS
        if root._is_root is False:
            raise WrapError(nested_unit_message(root, fsdp, clean_name))
        self.units = units
        self._check_units(TrainingState.IDLE)
        if root._output_pre_backward_hook_registered:
            # fairscale hooked the outputs of a forward for its backward, which would then
            # run without flatview and without the views learning its gradients.
            raise WrapError(
                "flatview.wrap was called between a forward and its backward (the root "
                "waits for the backward of a forward that ran with autograd on); wrap the "
                "model between iterations: after the backward, or before the forward (run "
                "evaluation passes under torch.no_grad())"
            )
        self.group: dist.ProcessGroup | None = root.process_group
        self.rank: int = root.rank
        self.world_size: int = root.world_size
        # One rank: fairscale reduces nothing (its gradients are final), nor does flatview.
        self.wrapper_reduces = self.world_size > 1
        self.device = torch.device(root.compute_device)
        cap = int(root.bucket_cap_mb * 2**20 // 4)
        self.bucket_numel = max(cap, 1)
        self._plain_plans: dict[int, MaskPlan] = {}
        # Per unit, the masks of the masked gather its unsharded buffer holds, if any.
        self._gathered: dict[int, tuple[tuple[int, tuple[bool, ...]], ...]] = {}

    # --------------------------------------------------------------- describe

    def describe(self) -> list[UnitSpec]:
        specs = []
        for unit_name, unit in self.units:
            fpw = unit._fsdp_wrapped_module
            flats = tuple(
                self._describe_flat(unit_name, unit, fpw, i, flat)
                for i, flat in enumerate(fpw.flat_params)
            )
            # A unit without parameters of its own still records one (empty) name group
            # (flatten_parameters=True); parameters another unit owns, appended with
            # append_shared_param, come after the unit's own and have no name group:
            # their owner describes them.
            plain_names = [g for g in unit._param_name_groups[unit._num_flatten_params :] if g]
            start = unit._num_flatten_params
            plain_params = unit.params[start : start + len(plain_names)]
            plain = tuple(
                self._describe_plain(join(unit_name, clean_name(names[0])), p)
                for names, p in zip(plain_names, plain_params, strict=True)
            )
            specs.append(UnitSpec(unit_name, unit, flats, plain, unit is self.root))
        return specs

    def _describe_plain(self, name: str, param: nn.Parameter) -> PlainSpec:
        # fairscale shards a parameter it does not flatten on its own (``_is_sharded``,
        # original size ``_orig_size``), split and padded like a one-segment flat.
        size: torch.Size | None = getattr(param, "_orig_size", None)
        if size is None or not getattr(param, "_is_sharded", False) or self.world_size == 1:
            return PlainSpec(name, param, tuple(param.shape))
        shape = tuple(int(d) for d in size)
        return PlainSpec(name, param, shape, FlatLayout.packed([shape], self.world_size), self.rank)

    def _describe_flat(
        self, unit_name: str, unit: Any, fpw: Any, index: int, flat: Any
    ) -> FlatSpec:
        sharded = bool(flat._is_sharded)
        world = self.world_size if sharded else 1
        layout = FlatLayout.packed(flat._param_shapes, world)
        local = getattr(flat, "_fp32_shard", flat.data)
        if local.numel() != layout.shard_numel:
            raise WrapError(
                f"flat parameter {index} of unit {unit_name or '<root>'!r} holds "
                f"{local.numel()} elements, but its layout says {layout.shard_numel} per rank"
            )
        owners, names = owners_and_names(
            unit_name,
            flat._param_infos,
            ((name, m, a, pm, pa) for name, _, m, a, pm, pa in flat._shared_param_infos),
            clean_name,
        )

        def local_shard() -> torch.Tensor:
            shard: torch.Tensor | None = getattr(flat, "_fp32_shard", None)
            return shard if shard is not None else flat.data

        return FlatSpec(
            flat=flat,
            flat_owner=Owner(fpw, fpw.flat_param_names[index]),
            layout=layout,
            rank=self.rank if sharded else 0,
            owners=owners,
            names=names,
            local_shard=local_shard,
        )

    def _lending_methods(self, unit: Any) -> tuple[str, ...]:
        # fairscale's local state-dict pair rebuilds module attributes too.
        return super()._lending_methods(unit) + LOCAL_LENDING_METHODS

    # ---------------------------------------------------------------- install

    def install(self, core: Runtime) -> None:
        self._core = core
        self.reduction = ShardedReduction(
            self.root.process_group_reduce_scatter,
            self.rank,
            self.world_size,
            core.ledger,
            self.options,
            self.bucket_numel,
        )
        for index, (_, unit) in enumerate(self.units):
            self._hook(unit.register_forward_pre_hook(functools.partial(self._pre_forward, index)))
            self._patch_lending(unit, self._lending_methods(unit))
            self.patch(unit, "summon_full_params", self._lending_context(unit.summon_full_params))
            self.patch(unit, "forward", self._summonable(unit, unit.forward))
            fpw = unit._fsdp_wrapped_module
            self.patch(fpw, "_unflatten_params_as_views", self._guarding(fpw))
            self.patch(unit, "_rebuild_full_params", self._masking_gather(unit))
        self._hook(self.root.register_forward_hook(self._post_forward))
        self.patch(
            self.root, "_wait_for_post_backward", self._finishing(self.root._wait_for_post_backward)
        )
        self.patch(self.root, "_setup_streams", self._streams_then_shim(self.root._setup_streams))
        if self.root._reducer is not None:
            self._install_shim()
        for param in self.root.params:
            if param.requires_grad:
                # Ahead of the root's own post-backward hook, which asserts on a backward
                # inside the root's forward.
                self._hook(param.register_hook(self._refuse_unfinished))
        guard_torch_checkpoint(self)

    def uninstall(self) -> None:
        super().uninstall()
        for _, unit in self.units:
            if isinstance(unit._reducer, _ReducerShim):
                unit._reducer = unit._reducer.original

    # -------------------------------------------------------------- lifecycle

    def _summonable(self, unit: Any, original: Callable[..., Any]) -> Callable[..., Any]:
        """``unit.forward``, except inside ``summon_full_params`` of the unit, where the
        original module holds the full parameters and runs on them directly (see
        :func:`~flatview.backends._common.forward_in_summon`)."""

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            if unit.training_state is not self._summoning:
                return original(*args, **kwargs)
            # The flattening wrapper's own forward would lay views of the (sharded) flat
            # parameters over the summoned ones: run what it wraps.
            return forward_in_summon(unit._fsdp_wrapped_module.module, *args, **kwargs)

        return forward

    def _pre_forward(self, unit_index: int, module: nn.Module, args: Any) -> None:
        if self.root._is_root is False and module is self.root:
            # An outer FSDP's forward is running (its lazy initialisation marked this
            # one nested): wrap was given a nested unit before the first forward.
            raise WrapError(nested_unit_message(self.root, self._fsdp, clean_name))
        if self.units[unit_index][1].training_state is self._summoning:
            return  # a forward inside summon_full_params: not an iteration
        self.core.begin_compute(outermost=module is self.root)
        self.core.check_unit_forward(unit_index)

    def _lending_context(self, method: Callable[..., Any]) -> Callable[..., Any]:
        @contextlib.contextmanager
        @functools.wraps(method)
        def lent(*args: Any, **kwargs: Any) -> Iterator[Any]:
            with self.core.lend(), method(*args, **kwargs) as value:
                yield value

        return lent

    def _guarding(self, fpw: Any) -> Callable[[], None]:
        original = fpw._unflatten_params_as_views

        def unflatten_and_guard() -> None:
            original()
            for flat in fpw.flat_params:
                self.core.guard_skipped(flat)

        return unflatten_and_guard

    def _masking_gather(self, unit: Any) -> Callable[..., Any]:
        """Gather only the used segments of partly skipped flat parameters.

        fairscale's ``_rebuild_full_params`` gathers each flat parameter with
        ``dist._all_gather_base`` (or ``dist.all_gather`` into chunks) on its module-level
        ``dist``; for the duration of one call, that name is pointed at a stand-in that
        masks the gathers of this unit's partly skipped flat parameters.
        """
        original = unit._rebuild_full_params
        module: Any = sys.modules[type(unit).__module__]

        def rebuild_full_params(force_full_precision: bool = False) -> Any:
            plans = {}
            if not force_full_precision:
                for flat in unit._fsdp_wrapped_module.flat_params:
                    plan = self.core.gather_plan(flat)
                    if plan is not None:
                        plans[id(flat)] = (flat, plan)
            # fairscale reuses full parameters it still holds (no reshard after forward,
            # no_sync); a masked gather left NaN where its step skipped, so a later gather
            # that needs other segments must really gather.
            held = self._gathered.get(id(unit))
            wanted = tuple(sorted((key, plan.used) for key, (_, plan) in plans.items()))
            if held is not None and held != wanted:
                unit.has_full_params = False
            if not plans:
                self._gathered.pop(id(unit), None)
                return original(force_full_precision)
            self._gathered[id(unit)] = wanted
            real = module.dist
            module.dist = MaskedGatherDist(real, self.core, plans)
            try:
                return original(force_full_precision)
            finally:
                module.dist = real

        return rebuild_full_params

    def _streams_then_shim(self, original: Callable[[], None]) -> Callable[[], None]:
        def setup_streams() -> None:
            original()
            self._install_shim()

        return setup_streams

    def _install_shim(self) -> None:
        current = self.root._reducer
        shim = current if isinstance(current, _ReducerShim) else _ReducerShim(self, current)
        for _, unit in self.units:
            unit._reducer = shim

    def _finishing(self, original: Callable[[], None]) -> Callable[[], None]:
        def wait_for_post_backward() -> None:
            self.core.check_backward_binding()
            # Units that took no part in the backward are brought to the state fairscale's
            # final callback expects, like skipped ones.
            with torch.no_grad():
                undeclared = self._units_without_backward(
                    bool(self.root._require_backward_grad_sync)
                )
            self._keep_cpu_grads_of_unreduced()
            # Raised only once fairscale has finished the backward (reductions flushed,
            # gradients finalised, states reset), so that the next iteration is sound.
            original()
            self.core.end_backward(synced=bool(self.root._require_backward_grad_sync))
            if undeclared:
                raise undeclared_units(undeclared)

        return wait_for_post_backward

    def _took_part(self, unit: Any, synced: bool) -> bool:
        trainable = [p for p in unit.params if p.requires_grad]
        # Every unit, whether it took part or not: parameters no gradient reached.
        self._reshard_unreached(unit, trainable, synced)
        return not trainable or unit.training_state is self._post

    def _settle_unit(self, unit: Any, synced: bool) -> None:
        for p in unit.params:
            unit._init_param_attributes(p)
        # Gradients accumulated under no_sync() in earlier micro-batches still need
        # their reduction, which the unit's own hook would have started.
        pending = [
            p
            for p in unit.params
            if p.requires_grad
            and synced
            and p._is_sharded
            and p.grad is not None
            and p.grad.shape == p._orig_size
            and self.core.flat_used_so_far(p)
        ]
        if pending:
            unit.training_state = self._pre
            for p in pending:
                unit._post_backward_hook(p)
        unit.training_state = self._post

    @torch.no_grad()
    def _keep_cpu_grads_of_unreduced(self) -> None:
        """With ``move_grads_to_cpu`` fairscale's final callback hands every parameter its
        CPU gradient buffer (``p.grad = p._cpu_grad``), which only a reduction refreshes:
        one that no rank reduces in this backward (skipped) would get whatever an earlier
        step left there. Make the buffer what the parameter's gradient is now (zeros for
        ``None``: the views keep ``None``)."""
        if not bool(self.root._require_backward_grad_sync):
            return
        plain_used = self.core.plain_used()
        for _, unit in self.units:
            for p in unit.params:
                buffer = getattr(p, "_cpu_grad", None)
                if buffer is None or not p.requires_grad:
                    continue
                index = self.core.index_of(p)
                if self.core.flat_used_so_far(p) or (index is not None and index in plain_used):
                    continue
                if p.grad is None:
                    buffer.zero_()
                elif p.grad is not buffer and p.grad.shape == buffer.shape:
                    buffer.copy_(p.grad)

    @staticmethod
    def _reshard_unreached(unit: Any, params: list[Any], synced: bool) -> None:
        """A parameter no gradient reached (skipped, in a unit that ran) never got its
        post-backward hook, which frees the full copy and points ``.data`` back at the
        fp32 shard; fairscale's final callback does that for non-root units only. Do what
        the hook would have done."""
        for p in params:
            shard = getattr(p, "_fp32_shard", None)
            if shard is None or p.data.data_ptr() == shard.data_ptr():
                continue
            if synced or unit.reshard_after_forward:
                unit._free_full_params([p])
            if unit.mixed_precision:
                unit._free_fp16_param_shard([p])
            unit._use_fp32_param_shard([p])

    # -------------------------------------------------------------- reduction

    def _refuse_unfinished(self, grad: torch.Tensor | None = None) -> None:
        """Refuse a backward that does not go through the root's outputs (one inside the
        root's forward): their hooks queue fairscale's end of the backward, which would
        never run. Checked before each reduction and before the root's own gradient."""
        if not getattr(self.root, "_post_backward_callback_queued", False):
            # (The root's first forward with autograd defines the flag.)
            raise unfinished_backward("fairscale FSDP")

    def plan_for(self, param: nn.Parameter) -> MaskPlan:
        self._refuse_unfinished()
        plan = self.core.reduction_plan(param)
        if plan is not None:
            return plan
        # A parameter the unit keeps unflattened: one segment, always used when reduced.
        plan = self._plain_plans.get(id(param))
        if plan is None:
            layout = FlatLayout.packed([(param._orig_size.numel(),)], self.world_size)  # type: ignore[attr-defined]
            plan = self._plain_plans[id(param)] = MaskPlan.build(layout, (True,))
        return plan


class _ReducerShim:
    """Stands in for fairscale's ``ReduceScatterBucketer``: routes every gradient through
    the adapter's sharded reduction, so skipped segments never travel."""

    def __init__(self, adapter: FairscaleAdapter, original: Any) -> None:
        self.adapter = adapter
        self.original = original

    def reduce_scatter_async(
        self,
        input_list: list[torch.Tensor],
        group: Any,
        callback_fn: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        if not (isinstance(callback_fn, functools.partial) and callback_fn.args):
            raise StateError(
                "fairscale called its reducer without the per-parameter callback flatview "
                "relies on; this fairscale version is not supported"
            )
        param = callback_fn.args[0]
        self.adapter.reduction.add(input_list, self.adapter.plan_for(param), callback_fn)

    def flush(self) -> None:
        self.adapter.reduction.finish()

    def teardown(self) -> None:
        """Nothing to free: buckets live only between add() and flush()."""
