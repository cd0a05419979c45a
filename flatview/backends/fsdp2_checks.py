"""What the FSDP2 adapter (:mod:`flatview.backends.fsdp2`) finds and refuses at wrap
time: the torch internals it touches, checked attribute by attribute; the units and their
parameter groups; what it cannot serve in a group; a model caught between a forward and
its backward; reduction options FSDP2 would ignore; and the layout of a parameter FSDP2
shards on dim 0.

torch privates touched here: ``FSDPParamGroup.all_reduce_grads``, ``offload_policy``,
``_post_forward_indices``; ``FSDPParam``'s ``is_dtensor``, ``fsdp_placement`` and
``_unsharded_param`` (the pending-backward check).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from flatview.comm.options import ReduceOptions
from flatview.errors import WrapError
from flatview.layout import FlatLayout, Segment

STATE_ATTRS = (
    "_lazy_init",
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
)


_PARAM_ATTRS = (
    "sharded_param",
    "_orig_size",
    "fsdp_placement",
    "is_dtensor",
    "offload_to_cpu",
    "unsharded_accumulated_grad",
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
    flatview's reduction options but those of its held reduce-scatters (``bucket_whole``,
    ``in_place_min_numel``: :func:`decide_bucketing`) would be ignored: refuse them rather
    than accept them silently. ``overlap`` is refused by :func:`flatview.backends.detect`."""
    default = ReduceOptions()
    given = [
        f"{f.name}={getattr(getattr(options, f.name), 'value', getattr(options, f.name))!r}"
        for f in dataclasses.fields(options)
        if f.name not in ("overlap", "bucket_whole", "in_place_min_numel")
        and getattr(options, f.name) != getattr(default, f.name)
    ]
    if given:
        raise WrapError(
            f"FSDP2 models reduce gradients in FSDP2's own collectives, which flatview "
            f"does not replace, so these reduction options would be ignored: "
            f"{', '.join(given)} (reduce_strategy / reduce_options); leave them at their "
            "defaults"
        )


@functools.cache  # frozen and asked again every backward (hold_plan)
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


def check_no_pending_backward(units: Sequence[tuple[str, Sequence[Any]]]) -> None:
    """Refuse to wrap between a forward and its backward: that backward would run into
    flatview's hooks without the forward flatview binds a step to (and FSDP2 leaves the
    forward's unsharded parameters registered, which flatview would record). FSDP2 keeps
    no flag for it: a group records every forward (``_post_forward_indices``) until the
    backward clears them, and a forward that ran with autograd on left a live graph that
    accumulates into the group's unsharded parameters (one that ran under
    ``torch.no_grad()`` did not). A graph whose backward already ran but that is still
    referenced (a loss kept) looks the same, so after a backward and an evaluation forward
    it is refused too (the message says to drop it): refusing is safe, missing a pending
    backward is not. Every rank ran the same forward, so every rank raises, before
    anything collective."""
    for name, groups in units:
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
                    raise WrapError(
                        "flatview.wrap was called between a forward and its backward "
                        f"(FSDP2 unit {name or '<root>'!r} ran a forward since its last "
                        "backward, and an autograd graph that accumulates into its "
                        "parameters is alive); wrap the model between iterations: after "
                        "the backward, or before the forward (run evaluation passes under "
                        "torch.no_grad(), and drop references to earlier iterations' "
                        "losses)"
                    )
