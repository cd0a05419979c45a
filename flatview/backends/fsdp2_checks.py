"""What the FSDP2 adapter (:mod:`flatview.backends.fsdp2`) finds and refuses at wrap
time (:func:`inspect`): the torch internals it touches, checked attribute by attribute;
the units and their parameter groups; what it cannot serve in a group; a model caught
between a forward and its backward; reduction options FSDP2 would ignore; the mesh; and
the layout of a parameter FSDP2 shards on dim 0.

torch privates touched: ``FSDPModule._get_fsdp_state``; ``FSDPState._lazy_init``,
``_is_root``, ``_fsdp_param_groups``, ``_training_state``; the mesh infos'
``shard_process_group``, ``shard_mesh_size``, ``shard_mesh_rank``,
``replicate_process_group`` (``_fsdp_common.HSDPMeshInfo``); ``FSDPMeshInfo`` (a mesh with
a shard dimension).

torch privates touched here: ``FSDPParamGroup.all_reduce_grads``,
``_partial_reduce_output``, ``offload_policy``,
``_post_forward_indices``; ``FSDPParam``'s ``is_dtensor``, ``fsdp_placement`` and
``_unsharded_param`` (the pending-backward check).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import get_gradient_edge

from flatview.backends.base import UnitGroup
from flatview.backends.messages import check_no_pending_backward
from flatview.backends.names import without_segments
from flatview.backends.nesting import inside_another
from flatview.backends.torch_versions import check_torch_version
from flatview.backends.unit_groups import own_groups
from flatview.comm.options import ReduceOptions
from flatview.errors import StateError, WrapError
from flatview.layout import FlatLayout, Segment

STATE_ATTRS = (
    "_lazy_init",
    "_modules",
    "_is_root",
    "_fsdp_param_groups",
    "_training_state",
    "_states_to_forward_prefetch",
    "_states_to_backward_prefetch",
    "_root_post_backward_final_callback",
)


_GROUP_ATTRS = (
    "fsdp_params",
    "mesh_info",
    "post_backward",
    "_training_state",
    "reduce_grads",
    "all_reduce_grads",
    "reduce_scatter_unused_params",
    "_all_gather_comm",
    "_reduce_scatter_comm",
    "_post_forward_indices",
    "_all_reduce_hook",
    "_init_mp_dtypes",
    "_partial_reduce_output",
    "_reduce_dtype",
)


_PARAM_ATTRS = (
    "sharded_param",
    "_orig_size",
    "fsdp_placement",
    "is_dtensor",
    "offload_to_cpu",
    "unsharded_accumulated_grad",
    "orig_dtype",
    "reduce_dtype",
)


class Unit:
    """One ``fully_shard`` state: its first module, name and parameter groups."""

    def __init__(self, name: str, module: nn.Module, state: Any) -> None:
        self.name = name
        self.module = module
        self.state = state
        self.groups: list[Any] = list(state._fsdp_param_groups)


def refuse_reduce_options(options: ReduceOptions) -> None:
    """FSDP2 reduces gradients in its own collectives, which flatview does not replace, so
    flatview's reduction options but those of its held reduce-scatters (``bucket_all_used``,
    ``in_place_min_numel``: :func:`decide_bucketing`) would be ignored: refuse them rather
    than accept them silently. ``overlap`` is refused by :func:`flatview.backends.detect`."""
    default = ReduceOptions()
    given = [
        f"{f.name}={getattr(getattr(options, f.name), 'value', getattr(options, f.name))!r}"
        for f in dataclasses.fields(options)
        if f.name not in ("overlap", "bucket_all_used", "in_place_min_numel")
        and getattr(options, f.name) != getattr(default, f.name)
    ]
    if given:
        raise WrapError(
            f"FSDP2 models reduce gradients in FSDP2's own collectives, which flatview "
            f"does not replace, so these reduction options would be ignored: "
            f"{', '.join(given)} (reduce_strategy / reduce_options); leave them at their "
            "defaults"
        )


@functools.cache  # frozen and asked again every backward (HoldPlanner)
def shard_layout(shape: tuple[int, ...], shards: int) -> FlatLayout:
    """The layout of a parameter FSDP2 shards on dim 0 over ``shards`` ranks: rank ``r``
    holds rows ``[r * c, (r + 1) * c)`` with ``c = ceil(rows / shards)`` (fewer, or none, at
    the end), which is a one-segment flat layout padded to ``shards * c`` rows."""
    numel = 1
    for d in shape:
        numel *= d
    rows = shape[0] if shape else 1
    per_row = numel // rows if rows else 0
    chunk = -(-rows // shards)
    padded = max(chunk * per_row * shards, numel)
    return FlatLayout((Segment(0, numel, shape),), padded, shards)


def check_attrs(obj: object, attrs: tuple[str, ...], what: str) -> None:
    missing = [a for a in attrs if not hasattr(obj, a)]
    if missing:
        raise WrapError(
            f"this torch's FSDP2 {what} lacks {', '.join(missing)}, which flatview relies on "
            f"(torch {torch.__version__})"
        )


def check_group(unit: str, group: Any, offload: type) -> None:
    """Refuse what flatview cannot serve in one FSDP2 parameter group."""
    check_attrs(group, _GROUP_ATTRS, "parameter group")
    where = unit or "<root>"
    if isinstance(group.offload_policy, offload):
        raise WrapError(
            f"FSDP2 unit {where!r} uses CPUOffloadPolicy, which flatview does not "
            "support (its gradients move to the CPU in the reduction flatview checks)"
        )
    for fsdp_param in group.fsdp_params:
        check_attrs(fsdp_param, _PARAM_ATTRS, "parameter")
        if fsdp_param.is_dtensor:
            raise WrapError(
                f"FSDP2 unit {where!r} shards a parameter that was already a DTensor "
                "(tensor parallelism); flatview supports data-parallel meshes only"
            )
        if fsdp_param.fsdp_placement.dim != 0:
            raise WrapError(
                f"FSDP2 unit {where!r} shards a parameter on dim "
                f"{fsdp_param.fsdp_placement.dim} (shard_placement_fn); flatview "
                "supports Shard(0) only"
            )


_PROBE = "flatview.pending_backward_probe"


def _graph_holds(leaf: torch.Tensor) -> bool:
    """Whether an autograd graph still alive accumulates into ``leaf``. A leaf holds its
    gradient accumulator weakly: one made by the first look-up dies with its last
    reference unless a graph holds it too, so a mark set on it survives to a second
    look-up only then (and is removed again)."""
    # ``metadata`` is a property of torch's C++ nodes (the abstract Node declares a method).
    node: Any = get_gradient_edge(leaf).node
    node.metadata[_PROBE] = True
    del node
    node = get_gradient_edge(leaf).node
    return bool(node.metadata.pop(_PROBE, False))


def _awaiting_backward(name: str, groups: Sequence[Any]) -> str | None:
    """What shows that unit ``name`` (its parameter ``groups``) waits for a backward.
    FSDP2 keeps no flag for it: a group records every forward (``_post_forward_indices``)
    until the backward clears them, and a forward that ran with autograd on left a live
    graph that accumulates into the group's unsharded parameters (one that ran under
    ``torch.no_grad()`` did not). A graph whose backward already ran but that is still
    referenced (a loss kept) looks the same, so after a backward and an evaluation
    forward it is refused too (the message says to drop it): refusing is safe, missing a
    pending backward is not."""
    for group in groups:
        if not group._post_forward_indices:
            continue  # no forward since the last backward
        for fsdp_param in group.fsdp_params:
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if (
                isinstance(unsharded, torch.Tensor)
                and unsharded.requires_grad
                and _graph_holds(unsharded)
            ):
                return (
                    f"FSDP2 unit {name or '<root>'!r} ran a forward since its last backward, "
                    "and an autograd graph that accumulates into its parameters is alive"
                )
    return None


@dataclass(frozen=True)
class FSDP2Model:
    """An FSDP2 model that passed every check (:func:`inspect`)."""

    root: Any
    units: list[Unit]
    """Every ``fully_shard`` state once, root first, in module order."""
    hybrid: bool
    """HSDP: the mesh has a replicate dimension."""
    group: dist.ProcessGroup | None
    """The shard group (``None``: no parameter group at all)."""
    rank: int
    world_size: int
    replicas: int
    device: torch.device
    names: dict[int, str]
    """Per parameter (by id), its first name in ``root.named_parameters()``."""
    aliases: dict[int, list[str]]
    """Per parameter (by id), its further names (tied parameters)."""
    groups: dict[int, UnitGroup]
    """Per index into :attr:`units`, the group of a unit on a mesh of its own (experts)."""


def clean_name(name: str) -> str:
    """An original name from a name in the tree (FSDP2 inserts no level of its own)."""
    return without_segments(name)


def inspect(model: nn.Module, options: ReduceOptions) -> FSDP2Model:
    """Check ``model`` (the outermost ``fully_shard`` module) for everything the adapter
    relies on, before anything is patched, and run FSDP2's lazy initialisation."""
    refuse_reduce_options(options)
    check_torch_version("FSDP2 backend relies on fully_shard")
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        HSDPMeshInfo,
        TrainingState,
    )

    if not isinstance(model, FSDPModule):
        raise WrapError(
            "flatview.wrap was given a model whose submodules are sharded with FSDP2 "
            "but which is not itself: call fully_shard(model) on the root too, then "
            "wrap the root"
        )
    root: Any = model
    check_attrs(root, ("_get_fsdp_state",), "module")
    root_state = root._get_fsdp_state()
    check_attrs(root_state, STATE_ATTRS, "state")
    # Not initialised, no unit knows it is nested: look for an enclosing one.
    if root_state._is_root is False or (
        root_state._is_root is None and inside_another(root, FSDPModule)
    ):
        raise WrapError(
            "flatview.wrap was given a nested FSDP2 module; wrap the outermost "
            "fully_shard module, the one the training loop calls"
        )
    # Lazy initialisation decides the root and may replace sharded parameters
    # (reset_sharded_param): it must happen before flatview records them.
    root_state._lazy_init()
    units: list[Unit] = []
    seen: set[int] = set()
    for name, module in root.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        state: Any = module._get_fsdp_state()
        if id(state) in seen:
            continue
        seen.add(id(state))
        check_attrs(state, STATE_ATTRS, "state")
        if state._training_state is not TrainingState.IDLE:
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
        units.append(unit)
    groups = [g for u in units for g in u.groups]
    for unit in units:
        for param_group in unit.groups:
            check_group(unit.name, param_group, CPUOffloadPolicy)
    check_no_pending_backward(
        [(u.name, u.groups) for u in units],
        _awaiting_backward,
        ", and drop references to earlier iterations' losses",
    )
    # After a forward (under no_grad) FSDP2 keeps the root's unsharded parameters
    # registered (it does not reshard the root after forward): flatview records the
    # sharded ones, which the next forward unshards again (FSDPModule.reshard).
    for unit in units:
        cast(Any, unit.module).reshard()
    unsharded = [
        u.name or "<root>"
        for u in units
        for g in u.groups
        if not isinstance(g.mesh_info, FSDPMeshInfo)
    ]
    if unsharded:
        raise WrapError(
            f"FSDP2 unit(s) {unsharded} replicate without sharding (a mesh with no shard "
            "dimension: torch's replicate built on FSDP2); flatview serves fully_shard, "
            "HSDP included. To replicate, wrap the model in DistributedDataParallel"
        )
    first = _root_mesh_info(units)
    hybrid = isinstance(first, HSDPMeshInfo)
    if first is not None:
        own = _check_meshes(units, first, HSDPMeshInfo)
        group: dist.ProcessGroup | None = first.shard_process_group
        rank = int(first.shard_mesh_rank)
        world_size = int(first.shard_mesh_size)
        replicas = first.replicate_mesh_size if hybrid else 1
        if hybrid and first.mesh.size() != dist.get_world_size():
            raise WrapError(
                "FSDP2 HSDP over a mesh that does not span every process: flatview's "
                "skip-set check needs the mesh to cover the default process group"
            )
        device = groups[0].device
    else:
        own = []
        group = None
        rank = dist.get_rank()
        world_size = dist.get_world_size()
        replicas = 1
        device = torch.device("cpu")
    aliases: dict[int, list[str]] = {}
    names: dict[int, str] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        if id(param) in names:
            aliases[id(param)].append(clean_name(name))
        else:
            names[id(param)] = clean_name(name)
            aliases[id(param)] = []
    # Collective over the root's shard group when a unit has a mesh of its own: after
    # every check of this rank's, so that a refusal of one rank is raised on every rank.
    unit_groups = own_groups(own, group) if own else {}
    return FSDP2Model(
        root, units, hybrid, group, rank, world_size, replicas, device, names, aliases, unit_groups
    )


def _root_mesh_info(units: Sequence[Unit]) -> Any:
    """The mesh information of the root unit's parameter group (of the first unit that
    has one, where the root manages no parameter): the mesh every unit is on unless the
    model gives it one of its own (experts); ``None`` without any parameter group."""
    for unit in units:
        for group in unit.groups:
            return group.mesh_info
    return None


def _check_meshes(units: Sequence[Unit], root: Any, hsdp: type) -> list[tuple[str, Any]]:
    """``(name, process group)`` per unit, root first, for
    :func:`~flatview.backends.unit_groups.own_groups` (the root's shard group for a unit
    on the root's mesh), or ``[]`` when every unit is on the root's mesh. A mesh of a
    unit's own must be a one-dimensional data-parallel mesh beside a one-dimensional
    root mesh (HSDP with experts on meshes of their own is refused)."""
    different = [
        (unit.name, g.mesh_info)
        for unit in units
        for g in unit.groups
        if g.mesh_info.mesh != root.mesh
    ]
    if not different:
        return []
    shown = [name or "<root>" for name, _ in different]
    if isinstance(root, hsdp) or any(isinstance(info, hsdp) for _, info in different):
        raise WrapError(
            f"FSDP2 unit(s) {shown} use device meshes other than the root's, and a mesh "
            "has a replicate dimension (HSDP); flatview supports units on meshes of their "
            "own (experts) beside a one-dimensional mesh only"
        )
    bad = [name or "<root>" for name, info in different if info.mesh.ndim != 1]
    if bad or root.mesh.ndim != 1:
        raise WrapError(
            f"FSDP2 unit(s) {bad or shown} use device meshes of several dimensions beside "
            "the root's; flatview supports units on one-dimensional meshes of their own "
            "(experts) only"
        )
    found = []
    for unit in units:
        infos = [g.mesh_info for g in unit.groups]
        on_own = infos and infos[0].mesh != root.mesh
        found.append(
            (unit.name, infos[0].shard_process_group if on_own else root.shard_process_group)
        )
    return found
