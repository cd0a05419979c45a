"""The fairscale versions and internals flatview's fairscale adapter relies on, checked
at wrap time: the version first, then every fairscale attribute the adapter reads, calls
or replaces, so that a fairscale that moved one is refused by ``flatview.wrap`` with the
attribute named, before anything is patched (not in the middle of a backward)."""

from __future__ import annotations

import sys
from typing import Any

from flatview.backends.internals import require_attrs, require_autograd_internals
from flatview.backends.patches import LENDING_METHODS, ROOT_LENDING_METHODS
from flatview.errors import WrapError

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
_FPW_PRIVATES = ("flat_params", "flat_param_names", "_unflatten_params_as_views", "module")
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
