"""What flatview's torch FSDP1 adapter refuses at wrap time (which models it takes is
:mod:`~flatview.backends.torch_versions`'s): torch internals it touches that are missing
(every attribute it reads, calls or replaces, checked before anything is patched, so
that a torch that renamed one is refused with the attribute named instead of failing in
the middle of a backward), units it cannot drive (CPU offload, a communication hook of
someone else's), flat parameters whose layout views cannot follow, and a model caught
between a forward and its backward. Hybrid sharding's own checks are in
:mod:`~flatview.backends.torch_hybrid`.

Wrapping runs torch's lazy initialisation (it would otherwise run at the first forward).
Before that every unit's ``_is_root`` is ``None``; a unit that another FSDP was
constructed around carries that constructor's ``_is_fsdp_managed_module`` mark in its
own ``__dict__`` and is refused. One that an auto-wrap policy created is not marked:
torch would take it for the root (``docs/limitations.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import utils as dist_utils

from flatview.backends.base import UnitGroup
from flatview.backends.internals import require_attrs, require_autograd_internals
from flatview.backends.messages import check_no_pending_backward, comm_hook_after_wrap
from flatview.backends.names import nested_unit_message
from flatview.backends.nesting import inside_another
from flatview.backends.patches import Patches
from flatview.backends.torch_fsdp_describe import clean_name
from flatview.backends.torch_hybrid import hybrid_groups, is_hybrid
from flatview.backends.torch_versions import check_torch_version, fsdp_class
from flatview.backends.unit_groups import own_groups
from flatview.backends.unit_tree import check_units, label
from flatview.comm.hybrid import HybridGroups
from flatview.errors import WrapError
from flatview.wrapped_models import check_not_wrapped

_UNIT_PRIVATES = (
    "_is_root",
    "training_state",
    "sharding_strategy",
    "process_group",
    "cpu_offload",
    "mixed_precision",
    "_comm_hook",
    "_comm_hook_state",
    "_handle",
    "_fsdp_wrapped_module",
    "_gradient_predivide_factor",
    "_gradient_postdivide_factor",
    "register_forward_pre_hook",
    "forward",
    "state_dict",
    "load_state_dict",
    "_apply",
)
_ROOT_PRIVATES = (
    "_exec_order_data",
    "_sync_gradients",
    "check_is_root",
    "register_comm_hook",
    "clip_grad_norm_",
    "compute_device",
    "rank",
    "world_size",
)
_RUNTIME_PRIVATES = (
    "_post_backward_hook",
    "_reshard",
    "_should_free_in_backward",
    "_catch_all_reshard",
)
_UNIT_STATES = ("IDLE", "FORWARD_BACKWARD", "SUMMON_FULL_PARAMS")
_HANDLE_STATES = ("IDLE", "BACKWARD_PRE", "BACKWARD_POST", "SUMMON_FULL_PARAMS")
_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
_HANDLE_PRIVATES = (
    "flat_param",
    "_training_state",
    "_use_orig_params",
    "_setattr_tensor",
    "uses_sharded_strategy",
    "needs_unshard",
    "pre_unshard",
    "post_reshard",
    "prepare_gradient_for_backward",
    "_needs_pre_backward_unshard",
    "_has_optim_in_backward",
    "_keep_low_precision_grads",
    "_uses_param_mixed_precision",
    "_pre_forward_order_index",
    "_post_forward_index",
    "_prefetched",
    "init_flat_param_attributes",
)
FLAT_PRIVATES = (
    "_param_infos",
    "_shared_param_infos",
    "_shapes",
    "_contiguities",
    "_numels_with_padding",
    "_is_padding_mask",
    "_unpadded_unsharded_size",
    "_local_shard",
    "_params",
    "_shared_params",
    "_fqns",
    "_is_grad_none_mask",
    "_post_backward_called",
    "_param_extensions",
)
"""What the adapter reads of a ``FlatParameter`` (set by lazy initialisation)."""
_ORDER_PRIVATES = (
    "next_iter",
    "get_handle_to_forward_prefetch",
    "get_handle_to_backward_prefetch",
    "handles_pre_forward_order",
    "handles_post_forward_order",
    "_forward_prefetch_limit",
    "_backward_prefetch_limit",
)


def check_privates(root: Any, units: list[tuple[str, Any]], tested: str) -> None:
    """The torch internals the adapter touches that exist before lazy initialisation:
    the autograd and FSDP runtime functions, the state enums, every unit's attributes.
    ``tested``: the versions checked against and the one found, for the message."""
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp import _runtime_utils as runtime
    from torch.distributed.fsdp._common_utils import HandleTrainingState, TrainingState

    require_autograd_internals(tested)
    require_attrs(dist_utils, ("_to_kwargs",), "torch.distributed.utils", tested)
    require_attrs(runtime, _RUNTIME_PRIVATES, "torch.distributed.fsdp._runtime_utils", tested)
    require_attrs(TrainingState, _UNIT_STATES, "torch FSDP's TrainingState", tested)
    require_attrs(HandleTrainingState, _HANDLE_STATES, "torch FSDP's HandleTrainingState", tested)
    require_attrs(ShardingStrategy, _STRATEGIES, "torch FSDP's ShardingStrategy", tested)
    require_attrs(root, _ROOT_PRIVATES, "the root FSDP unit", tested)
    for name, unit in units:
        require_attrs(unit, _UNIT_PRIVATES, f"FSDP unit {name or '<root>'!r}", tested)


def check_initialised(root: Any, units: list[tuple[str, Any]], tested: str) -> None:
    """The torch internals that lazy initialisation creates: every unit's handle and
    flat parameter, and the execution-order record."""
    require_attrs(root._exec_order_data, _ORDER_PRIVATES, "torch FSDP's _exec_order_data", tested)
    for name, unit in units:
        handle = unit._handle
        if handle is None:
            continue
        what = f"FSDP unit {name or '<root>'!r}"
        require_attrs(handle, _HANDLE_PRIVATES, f"the FlatParamHandle of {what}", tested)
        require_attrs(handle.flat_param, FLAT_PRIVATES, f"the flat parameter of {what}", tested)


def refuse_unit(where: str, unit: Any) -> None:
    """A unit that offloads parameters, that flatview wrapped already, or that has a
    communication hook of its own."""
    if unit.cpu_offload.offload_params:
        raise WrapError(
            f"FSDP unit {where!r} offloads parameters to CPU (CPUOffload("
            "offload_params=True)); flatview's torch backend does not support that"
        )
    # flatview's own hook means flatview wrapped it already: say that instead.
    check_not_wrapped([unit])
    if unit._comm_hook is not None:
        raise WrapError(
            f"FSDP unit {where!r} already has a communication hook; flatview reduces "
            "gradients through its own hook and cannot combine with another"
        )


def refuse_comm_hooks(root: Any, patches: Patches) -> None:
    """A communication hook registered on the wrapped model after the wrap (refused at
    the wrap itself): flatview's own hook, or flatview's own reduction on ``NO_SHARD``
    computed on views, would bypass it or trip torch's assertion."""
    patches.refusing(root, "register_comm_hook", lambda: comm_hook_after_wrap("FSDP"))


def _awaiting_backward(name: str, unit: Any) -> str | None:
    """What shows that ``unit`` waits for a backward: torch registered its forward's
    backward hooks for a model without flatview (and without views), whose gradients
    flatview would then never see. torch marks each unit whose forward registered
    pre-backward hooks until its backward (or the end of the backward) runs."""
    handle = unit._handle
    if handle is not None and handle._needs_pre_backward_unshard:
        return (
            f"FSDP unit {label(name)!r} waits for the backward of a forward that ran "
            "with autograd on"
        )
    return None


def check_flat(unit_name: str, handle: Any) -> None:
    """Refuse a flat parameter whose layout the views cannot follow."""
    flat = handle.flat_param
    where = label(unit_name)
    if not handle._use_orig_params and not all(flat._contiguities):
        names = [fqn for fqn, c in zip(flat._fqns, flat._contiguities, strict=True) if not c]
        raise WrapError(
            f"FSDP unit {where!r} flattened non-contiguous parameters ({', '.join(names)}); "
            "flatview's views assume a contiguous layout: make them contiguous before "
            "wrapping in FSDP"
        )
    if any(ext is not None for ext in flat._param_extensions):
        raise WrapError(
            f"FSDP unit {where!r} uses FSDP extensions (tensor parallelism); flatview's "
            "torch backend does not support them"
        )


@dataclass(frozen=True)
class TorchFSDPModel:
    """A torch FSDP1 model that passed every check, as both torch FSDP1 adapters take it
    (:func:`inspect`)."""

    root: Any
    units: list[tuple[str, Any]]
    """``(original name, unit)`` per unit, root first, in module order."""
    tested: str
    """The "checked against ... found ..." phrase of the internals checks."""
    hybrid: HybridGroups | None
    """This rank's place in the grid of a hybrid model (``None``: not hybrid)."""
    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    device: torch.device
    groups: dict[int, UnitGroup]
    """Per index into :attr:`units`, the group of a unit on a process group of its own."""

    @property
    def replicas(self) -> int:
        return 1 if self.hybrid is None else self.hybrid.replica_size

    @property
    def replicates(self) -> bool:
        """Every unit is ``NO_SHARD``: the forward and backward gather nothing."""
        from torch.distributed.fsdp import ShardingStrategy

        return all(unit.sharding_strategy is ShardingStrategy.NO_SHARD for _, unit in self.units)


def inspect(model: nn.Module) -> TorchFSDPModel:
    """Check ``model`` (the outermost torch FSDP1 unit) for everything either torch
    FSDP1 adapter relies on, before anything is patched: the torch version, its
    internals, every unit, hybrid sharding's grid (a collective, before any other), and
    the lazy initialisation that creates the local shards the views alias (torch would
    run it at the first forward anyway)."""
    tested = check_torch_version("torch FSDP backend relies on FSDP1")
    fsdp = fsdp_class()
    assert fsdp is not None
    # torch's FSDP internals are untyped: they are reached through ``Any``.
    root: Any = model
    units: list[tuple[str, Any]] = [
        (clean_name(name), m) for name, m in root.named_modules() if isinstance(m, fsdp)
    ]
    check_privates(root, units, tested)
    from torch.distributed.fsdp._common_utils import TrainingState

    # Before lazy initialisation every unit has `_is_root` None; a unit constructed
    # before another FSDP around it is marked by that one's constructor (for Dynamo;
    # in the unit's own __dict__: FSDP forwards missing attributes to the wrapped
    # module, which its own constructor marks). A unit that an auto-wrap policy
    # created is not marked: an enclosing unit is looked for among live objects
    # (root.check_is_root below would make it a root the outer model then refuses).
    if (
        root._is_root is False
        or vars(root).get("_is_fsdp_managed_module", False)
        or (root._is_root is None and inside_another(root, fsdp))
    ):
        raise WrapError(nested_unit_message(root, fsdp, clean_name))
    check_units(units, TrainingState.IDLE, then=refuse_unit)
    own = [label(name) for name, unit in units if unit.process_group is not root.process_group]
    if own and is_hybrid(root):
        raise WrapError(
            f"FSDP unit(s) {own} use process groups of their own inside a model that uses "
            "hybrid sharding; flatview supports units on their own groups (experts) with "
            "the other sharding strategies only"
        )
    hybrid = hybrid_groups(root, units, tested)  # collective: before any other
    root.check_is_root()
    check_initialised(root, units, tested)
    check_no_pending_backward(units, _awaiting_backward)
    for name, unit in units:
        if unit._handle is not None:
            check_flat(name, unit._handle)
    # Collective when a unit has a group of its own: after every check of this rank's.
    groups = own_groups([(name, unit.process_group) for name, unit in units], root.process_group)
    return TorchFSDPModel(
        root,
        units,
        tested,
        hybrid,
        root.process_group,
        root.rank,
        root.world_size,
        torch.device(root.compute_device),
        groups,
    )
