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

The adapter is assembled from components beside this module: the wrap-time checks
(:mod:`~flatview.backends.fairscale_checks`), the reduction
(:mod:`~flatview.backends.fairscale_reduce`), the masked all-gather
(:mod:`~flatview.backends.fairscale_gather`) and units without a backward
(:mod:`~flatview.backends.fairscale_settle`).

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
from torch import nn

from flatview.backends.base import Adapter, FlatSpec, PlainSpec, UnitSpec, end_root_forward
from flatview.backends.compute_tensors import set_directly
from flatview.backends.fairscale_checks import (
    LOCAL_LENDING_METHODS,
    FairscaleModel,
    clean_name,
)
from flatview.backends.fairscale_gather import MaskedGatherDist
from flatview.backends.fairscale_reduce import (
    WRAPPER,
    FairscaleReduction,
    install_shim,
    remove_shim,
)
from flatview.backends.fairscale_settle import UnitSettling
from flatview.backends.names import join, nested_unit_message, owners_and_names
from flatview.backends.patches import Patches
from flatview.backends.summoning import forward_in_summon
from flatview.backends.unit_tree import (
    hook_unfinished,
    lending_methods,
    settle_units,
    undeclared_units,
)
from flatview.comm.options import ReduceOptions
from flatview.errors import WrapError
from flatview.layout import FlatLayout
from flatview.views import Owner
from flatview.wrapped_models import mark_stale

if TYPE_CHECKING:
    from flatview.backends.base import Runtime


Places = list[tuple[nn.Module, str, str]]
"""Where fairscale puts each original parameter of a unit: ``(module, attr, name)``."""


class FairscaleAdapter(Adapter):
    """Maps the flatview runtime onto one fairscale FSDP model (root and nested units)."""

    backend = "fairscale"
    clean_name = staticmethod(clean_name)
    flattens = True
    masks_gathers = True

    def __init__(self, model: FairscaleModel, options: ReduceOptions) -> None:
        self.model = model
        self.options = options
        root: Any = model.root
        self.root = root
        self.units = model.units
        self.group = root.process_group
        self.rank: int = root.rank
        self.world_size: int = root.world_size
        # One rank: fairscale reduces nothing (its gradients are final), nor does flatview.
        self.wrapper_reduces = self.world_size > 1
        self.device = torch.device(root.compute_device)
        cap = int(root.bucket_cap_mb * 2**20 // 4)
        self.bucket_numel = max(cap, 1)
        # Per unit, the masks of the masked gather its unsharded buffer holds, if any.
        self._gathered: dict[int, tuple[tuple[int, tuple[bool, ...]], ...]] = {}
        self._patches = Patches()

    # --------------------------------------------------------------- describe

    def describe(self) -> list[UnitSpec]:
        specs = []
        for index, (unit_name, unit) in enumerate(self.units):
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
                self._describe_plain(join(unit_name, clean_name(names[0])), unit, p)
                for names, p in zip(plain_names, plain_params, strict=True)
            )
            group = self.model.groups.get(index)
            specs.append(UnitSpec(unit_name, unit, flats, plain, unit is self.root, group))
        return specs

    def _describe_plain(self, name: str, unit: Any, param: nn.Parameter) -> PlainSpec:
        # fairscale shards a parameter it does not flatten on its own (``_is_sharded``,
        # original size ``_orig_size``), split and padded like a one-segment flat, over
        # the unit's group (an expert unit's may be its own).
        size: torch.Size | None = getattr(param, "_orig_size", None)
        if size is None or not getattr(param, "_is_sharded", False) or unit.world_size == 1:
            return PlainSpec(name, param, tuple(param.shape))
        shape = tuple(int(d) for d in size)
        layout = FlatLayout.packed([shape], unit.world_size)
        return PlainSpec(name, param, shape, layout, unit.rank)

    def _describe_flat(
        self, unit_name: str, unit: Any, fpw: Any, index: int, flat: Any
    ) -> FlatSpec:
        sharded = bool(flat._is_sharded)
        world = unit.world_size if sharded else 1
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
            rank=unit.rank if sharded else 0,
            owners=owners,
            names=names,
            local_shard=local_shard,
        )

    # ---------------------------------------------------------------- install

    def install(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.reduction = FairscaleReduction(self.units, runtime, self.options, self.bucket_numel)
        """Where every gradient fairscale would reduce goes (a shim of its bucketer)."""
        self._settling = UnitSettling(self.root, self.units, self.model.states, runtime)
        patches = self._patches
        for index, (unit_name, unit) in enumerate(self.units):
            patches.hook(
                unit.register_forward_pre_hook(functools.partial(self._pre_forward, index))
            )
            # fairscale's local state-dict pair rebuilds module attributes too.
            methods = lending_methods(unit, self.root) + LOCAL_LENDING_METHODS
            patches.lending(unit, methods, runtime.lend)
            fpw = unit._fsdp_wrapped_module
            # Where fairscale puts each original parameter of the unit (read now: while
            # unflattened, fairscale's own record of it is gone with the flat parameters).
            places = [
                (module, attr, join(unit_name, clean_name(module_name), attr))
                for module_name, module, attr in fpw._param_infos
            ]
            patches.patch(
                unit, "summon_full_params", self._lending_context(places, unit.summon_full_params)
            )
            patches.patch(unit, "forward", self._summonable(unit, unit.forward))
            patches.patch(fpw, "_unflatten_params_as_views", self._guarding(fpw))
            # Public (the first seed was told to use it; summon_full_params goes through it):
            # it takes the flat parameters off the module, which the views have hidden.
            unflatten = _views_list_on_wrapper(fpw, fpw.unflatten_params)
            patches.patch(fpw, "unflatten_params", self._lending_context(places, unflatten))
            patches.patch(unit, "_rebuild_full_params", self._masking_gather(index, unit))
        patches.hook(self.root.register_forward_hook(self._post_forward))
        patches.patch(
            self.root, "_wait_for_post_backward", self._finishing(self.root._wait_for_post_backward)
        )
        patches.patch(
            self.root, "_setup_streams", self._streams_then_shim(self.root._setup_streams)
        )
        if self.root._reducer is not None:
            install_shim(self.root, self.units, self.reduction)
        # A backward inside the root's forward would trip the root's own assertion first.
        hook_unfinished(self.root, self.root.params, WRAPPER, patches)

    def synchronizing(self) -> bool:
        # fairscale's no_sync() clears the flag on every unit; the root's decides.
        return bool(self.root._require_backward_grad_sync)

    def release_unsharded(self) -> None:
        self._settling.release_unsharded()
        self._gathered.clear()

    def uninstall(self) -> None:
        self._patches.remove()
        remove_shim(self.units)

    # -------------------------------------------------------------- lifecycle

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        end_root_forward(self.runtime)

    def _summonable(self, unit: Any, original: Callable[..., Any]) -> Callable[..., Any]:
        """``unit.forward``, except inside ``summon_full_params`` of the unit, where the
        original module holds the full parameters and runs on them directly (see
        :func:`~flatview.backends.summoning.forward_in_summon`)."""

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            if unit.training_state is not self.model.states.SUMMON_FULL_PARAMS:
                return original(*args, **kwargs)
            # The flattening wrapper's own forward would lay views of the (sharded) flat
            # parameters over the summoned ones: run what it wraps.
            return forward_in_summon(unit._fsdp_wrapped_module.module, *args, **kwargs)

        return forward

    def _pre_forward(self, unit_index: int, module: nn.Module, args: Any) -> None:
        if self.root._is_root is False and module is self.root:
            # An outer FSDP's forward is running (its lazy initialisation marked this
            # one nested): wrap was given a nested unit before the first forward.
            raise WrapError(nested_unit_message(self.root, self.model.fsdp, clean_name))
        if self.units[unit_index][1].training_state is self.model.states.SUMMON_FULL_PARAMS:
            return  # a forward inside summon_full_params: not an iteration
        self.runtime.begin_compute(outermost=module is self.root)
        self.runtime.check_unit_forward(unit_index)

    def _lending_context(self, places: Places, method: Callable[..., Any]) -> Callable[..., Any]:
        """A unit's summoning ``method``, with the views stepping aside for it; what
        fairscale put at the unit's ``places`` there is marked lent at its end (an
        optimizer built over it would train nothing: refused at its step). With
        ``mixed_precision`` fairscale summons into a full-precision buffer of its own,
        which the storage check of optimizers cannot recognise afterwards."""

        @contextlib.contextmanager
        @functools.wraps(method)
        def lent(*args: Any, **kwargs: Any) -> Iterator[Any]:
            with self.runtime.lend(), method(*args, **kwargs) as value:
                tensors = [
                    (tensor, name)
                    for module, attr, name in places
                    if isinstance(tensor := getattr(module, attr, None), torch.Tensor)
                    and self.runtime.index_of(tensor) is None
                ]
                yield value
            for tensor, name in tensors:
                mark_stale(tensor, name, lent=True)

        return lent

    def _guarding(self, fpw: Any) -> Callable[[], None]:
        def unflatten_and_guard() -> None:
            _unflatten_as_views(fpw)
            for flat in fpw.flat_params:
                self.runtime.guard_skipped(flat)

        return unflatten_and_guard

    def _masking_gather(self, index: int, unit: Any) -> Callable[..., Any]:
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
                    plan = self.runtime.gather_plan(flat, self.options.mask_gather_min_saved)
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
            module.dist = MaskedGatherDist(real, self.runtime, plans, index)
            try:
                return original(force_full_precision)
            finally:
                module.dist = real

        return rebuild_full_params

    def _streams_then_shim(self, original: Callable[[], None]) -> Callable[[], None]:
        def setup_streams() -> None:
            original()
            install_shim(self.root, self.units, self.reduction)

        return setup_streams

    def _finishing(self, original: Callable[[], None]) -> Callable[[], None]:
        def wait_for_post_backward() -> None:
            runtime = self.runtime
            runtime.check_backward_binding()
            synced = bool(self.root._require_backward_grad_sync)
            # Units that took no part in the backward are brought to the state fairscale's
            # final callback expects, like skipped ones.
            settling = self._settling
            with torch.no_grad():
                undeclared = settle_units(
                    self.units, runtime, synced, settling.took_part, settling.settle
                )
            settling.keep_cpu_grads_of_unreduced()
            # Raised only once fairscale has finished the backward (reductions flushed,
            # gradients finalised, states reset), so that the next iteration is sound.
            original()
            runtime.end_backward(synced=bool(self.root._require_backward_grad_sync))
            if undeclared:
                raise undeclared_units(undeclared)

        return wait_for_post_backward


def _views_list_on_wrapper(fpw: Any, unflatten_params: Callable[..., Any]) -> Callable[..., Any]:
    """``fpw.unflatten_params``, after making sure the list of compute tensors fairscale
    deletes from the wrapped module when it unflattens is the module's own.

    fairscale sets that list on ``fpw._fpw_module`` at construction and at every forward,
    and deletes it there when it unflattens (``state_dict``, ``summon_full_params``) if
    ``hasattr`` finds it. A wrapper put around the module after FSDP was built (torch's
    ``apply_activation_checkpointing``) forwards reads to the module inside, where the
    construction set it, but not deletions: until the unit's first forward sets the list
    on the wrapper, fairscale's unflattening fails ("'CheckpointWrapper' object has no
    attribute", bare fairscale too before its first forward), and a unit that every step
    so far skipped has not run that forward. The list is set on the wrapper as that
    forward would."""

    @functools.wraps(unflatten_params)
    def unflatten(*args: Any, **kwargs: Any) -> Any:
        module = fpw._fpw_module
        name = "_unflattened_param_views"
        if name not in vars(module) and hasattr(module, name):
            setattr(module, name, getattr(module, name))
        return unflatten_params(*args, **kwargs)

    return unflatten


def _unflatten_as_views(fpw: Any) -> None:
    """fairscale's ``FlattenParamsWrapper._unflatten_params_as_views``: each original
    parameter's compute tensor (a view of its flat parameter, from fairscale's own
    ``get_param_views``) set on its submodule, the list of them kept on the wrapped
    module (fairscale's activation checkpointing reads it), then each tied name set to
    its owner's; in one store per tensor where ``setattr`` would come to that
    (:mod:`~flatview.backends.compute_tensors`), once per tensor and forward."""
    assert fpw.is_flattened
    views = list(fpw.get_param_views())
    for (_, module, name), view in zip(fpw._param_infos, views, strict=True):
        if not set_directly(module, name, view):
            setattr(module, name, view)
    fpw._fpw_module._unflattened_param_views = views
    for _, _, module, name, shared_module, shared_name in fpw._shared_param_infos:
        tensor = getattr(shared_module, shared_name)
        if not set_directly(module, name, tensor):
            setattr(module, name, tensor)
