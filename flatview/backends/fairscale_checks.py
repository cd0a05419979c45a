"""Which models flatview's fairscale adapter takes, and what it checks at wrap time
(:func:`inspect`): the version first, then every fairscale attribute the adapter reads,
calls or replaces, so that a fairscale that moved one is refused by ``flatview.wrap``
with the attribute named, before anything is patched (not in the middle of a backward);
then the units, and a model caught between a forward and its backward."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from torch import nn

from flatview.backends.base import UnitGroup
from flatview.backends.internals import optional_class, require_attrs, require_autograd_internals
from flatview.backends.messages import check_no_pending_backward
from flatview.backends.names import nested_unit_message, without_segments
from flatview.backends.nesting import inside_another
from flatview.backends.patches import LENDING_METHODS, ROOT_LENDING_METHODS
from flatview.backends.unit_groups import own_groups
from flatview.backends.unit_tree import check_units
from flatview.errors import WrapError

_WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_fpw_module"})


def fsdp_class() -> type[nn.Module] | None:
    """fairscale's ``FullyShardedDataParallel``, if fairscale is installed."""
    return optional_class("fairscale.nn.data_parallel", "FullyShardedDataParallel")


def is_fairscale_fsdp(model: object) -> bool:
    """Whether ``model`` is a fairscale ``FullyShardedDataParallel`` module."""
    cls = fsdp_class()
    return cls is not None and isinstance(model, cls)


def clean_name(name: str) -> str:
    """An original name from a name in the wrapped tree (wrapper levels dropped)."""
    return without_segments(name, _WRAPPER_SEGMENTS)


LOCAL_LENDING_METHODS = ("local_state_dict", "load_local_state_dict")
"""fairscale's own lending methods: its local (sharded) state dicts."""

TESTED = "fairscale 0.4.x"

# The fairscale internals this adapter reads, calls or replaces, checked at wrap time.
_UNIT_PRIVATES = (
    "_is_root",
    "training_state",
    "process_group",
    "_fsdp_wrapped_module",
    "_param_name_groups",
    "_num_flatten_params",
    "params",
    "_rebuild_full_params",
    "_init_param_attributes",
    "_post_backward_hook",
    "_free_full_params",
    "_free_fp16_param_shard",
    "_use_fp32_param_shard",
    "_reducer",
    "reshard_after_forward",
    "mixed_precision",
    "summon_full_params",
    "forward",
    *LENDING_METHODS,
    *LOCAL_LENDING_METHODS,
)
_ROOT_PRIVATES = (
    "_output_pre_backward_hook_registered",
    "_wait_for_post_backward",
    "_setup_streams",
    "_require_backward_grad_sync",
    "process_group_reduce_scatter",
    "bucket_cap_mb",
    "compute_device",
    "rank",
    "world_size",
    *ROOT_LENDING_METHODS,
)
_FPW_PRIVATES = (
    "flat_params",
    "flat_param_names",
    "_unflatten_params_as_views",
    "unflatten_params",
    "module",
    # What flatview's own unflattening reads (fairscale.py: _unflatten_as_views).
    "is_flattened",
    "get_param_views",
    "_fpw_module",
    "_param_infos",
    "_shared_param_infos",
)
_FLAT_PRIVATES = ("_is_sharded", "_param_shapes", "_param_infos", "_shared_param_infos")
_STATES = ("IDLE", "BACKWARD_PRE", "BACKWARD_POST", "SUMMON_FULL_PARAMS")


def check_version() -> str:
    """The running fairscale's version, refused unless tested."""
    import fairscale

    version = tuple(int(x) for x in fairscale.__version__.split(".")[:2])
    if version != (0, 4):
        raise WrapError(
            f"flatview's fairscale backend is tested with fairscale 0.4.x, found "
            f"{fairscale.__version__}"
        )
    found: str = fairscale.__version__
    return found


def check_privates(root: Any, units: list[tuple[str, Any]], states: Any, version: str) -> None:
    """Refuse a fairscale whose internals this adapter touches are not all there."""
    found = f"{TESTED}; found fairscale {version}"
    require_autograd_internals(found)
    require_attrs(states, _STATES, "fairscale's FSDP TrainingState", found)
    require_attrs(root, _ROOT_PRIVATES, "the root FSDP unit", found)
    for name, unit in units:
        what = f"FSDP unit {name or '<root>'!r}"
        require_attrs(unit, _UNIT_PRIVATES, what, found)
        fpw = unit._fsdp_wrapped_module
        require_attrs(fpw, _FPW_PRIVATES, f"the FlattenParamsWrapper of {what}", found)
        for flat in fpw.flat_params:
            require_attrs(flat, _FLAT_PRIVATES, f"a flat parameter of {what}", found)
        # _masking_gather swaps the module's `dist` for the length of a gather.
        module = sys.modules[type(unit).__module__]
        require_attrs(module, ("dist",), f"module {module.__name__}", found)


def _awaiting_backward(name: str, root: Any) -> str | None:
    """What shows that the root waits for a backward: fairscale hooked the outputs of a
    forward for its backward, which would then run without flatview."""
    if root._output_pre_backward_hook_registered:
        return "the root waits for the backward of a forward that ran with autograd on"
    return None


@dataclass(frozen=True)
class FairscaleModel:
    """A fairscale FSDP model that passed every check (:func:`inspect`)."""

    root: Any
    units: list[tuple[str, Any]]
    """``(original name, unit)`` per unit, root first, in module order."""
    fsdp: type
    """fairscale's ``FullyShardedDataParallel``."""
    states: Any
    """fairscale's ``TrainingState``."""
    groups: dict[int, UnitGroup]
    """Per index into :attr:`units`, the group of a unit on a process group of its own."""


def inspect(model: nn.Module) -> FairscaleModel:
    """Check ``model`` (the outermost fairscale unit) for everything the adapter relies
    on, before anything is patched: the version, the internals, every unit, and a model
    caught between a forward and its backward."""
    version = check_version()
    from fairscale.nn.data_parallel.fully_sharded_data_parallel import TrainingState

    fsdp = fsdp_class()
    assert fsdp is not None
    # fairscale is untyped: its attributes are reached through ``Any``.
    root: Any = model
    # Before the first forward every unit has `_is_root` None and fairscale leaves no
    # other trace of nesting on a unit: the root's lazy initialisation marks the
    # others False. Until then an enclosing unit is looked for among live objects
    # (inside_another), so that wrap refuses before it installs anything; the adapter's
    # pre-forward hook still refuses one built around the unit after wrap.
    units: list[tuple[str, Any]] = [
        (clean_name(name), m) for name, m in root.named_modules() if isinstance(m, fsdp)
    ]
    check_privates(root, units, TrainingState, version)
    if root._is_root is False or (root._is_root is None and inside_another(root, fsdp)):
        raise WrapError(nested_unit_message(root, fsdp, clean_name))
    check_units(units, TrainingState.IDLE)
    check_no_pending_backward([("", root)], _awaiting_backward)
    # Collective when a unit has a group of its own: after every check of this rank's.
    groups = own_groups([(name, unit.process_group) for name, unit in units], root.process_group)
    return FairscaleModel(root, units, fsdp, TrainingState, groups)
