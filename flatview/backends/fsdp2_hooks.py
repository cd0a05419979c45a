"""Pieces of the FSDP2 adapter (see :mod:`flatview.backends.fsdp2`): what it checks and
refuses at wrap time, parameter layouts, counting communication objects, the steering of explicit
prefetching and the exchange of unused-parameter flags.

torch privates touched: the ``allocate`` / ``__call__`` protocol of FSDP2's ``AllGather``
and ``ReduceScatter`` objects (``torch.distributed.fsdp._fully_shard._fsdp_api``, which
``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter`` accept);
``FSDPParamGroup.all_reduce_grads``, ``offload_policy``; ``FSDPState``'s
``_states_to_forward_prefetch`` / ``_states_to_backward_prefetch``; ``FSDPParam``'s
``is_dtensor`` and ``fsdp_placement``; ``FSDPParamGroup._post_forward_indices`` and
``FSDPParam._unsharded_param`` (the pending-backward check); for held reduce-scatters
``_fsdp_collectives.DefaultReduceScatter``, ``FSDPParamGroup._all_reduce_hook``,
``FSDPParam._orig_size`` and ``unsharded_accumulated_grad``, and the sharded parameters'
``_post_accumulate_grad_hooks``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import get_gradient_edge

from flatview.comm.held import Accumulate, Held, HeldReduceScatters
from flatview.comm.ledger import REPLICA_ALL_REDUCE, Ledger
from flatview.comm.options import ReduceOptions
from flatview.errors import WrapError
from flatview.layout import FlatLayout, Segment
from flatview.local_tensors import local_tensor

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


def decide_bucketing(
    options: ReduceOptions, device: torch.device, hybrid: bool, world_size: int
) -> type | None:
    """Whether to hold small reduce-scatters and run them as one (:mod:`flatview.comm.held`):
    FSDP2's default reduce-scatter class (only its calls are held), else ``None``.

    ``bucket_whole=None`` holds them where that gives FSDP2's numbers bit for bit and
    saves time: on CPU (where a step goes by its number of collectives) over a shard
    group of 2 ranks (beyond 2, gloo's summation order follows the position in the
    buffer). ``True`` holds them at any size of group; never on an accelerator, whose
    reduce-scatters FSDP2 runs asynchronously on their own stream, nor with HSDP, whose
    all-reduce reads each reduce-scatter's output at once."""
    wanted = options.bucket_whole
    if wanted is None:
        bucketing = device.type == "cpu" and not hybrid and world_size == 2
    elif wanted and (device.type != "cpu" or hybrid):
        raise WrapError(
            "ReduceOptions(bucket_whole=True) cannot bucket FSDP2's reduce-scatters "
            + ("with HSDP (its all-reduce reads each output at once)" if hybrid else "")
            + (" and " if hybrid and device.type != "cpu" else "")
            + (
                f"on {device.type} (FSDP2 overlaps them on their own stream)"
                if device.type != "cpu"
                else ""
            )
            + "; leave bucket_whole at None or False"
        )
    else:
        bucketing = wanted
    if not bucketing and options.in_place_min_numel != ReduceOptions().in_place_min_numel:
        raise WrapError(
            "ReduceOptions(in_place_min_numel=...) only sets which FSDP2 reduce-scatters "
            "are held and run as one, and this wrap holds none (bucket_whole="
            f"{wanted!r}, {device.type}, shard group of {world_size}"
            + (", HSDP" if hybrid else "")
            + "): it would be ignored; leave it at its default"
        )
    if not bucketing:
        return None
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
    except ImportError:
        if wanted:
            raise WrapError(
                "ReduceOptions(bucket_whole=True): this torch's FSDP2 has no "
                f"DefaultReduceScatter, which flatview holds calls of (torch {torch.__version__})"
            ) from None
        return None
    return DefaultReduceScatter


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


class CountingAllGather:
    """Delegates to FSDP2's all-gather object, counting its input in the ledger."""

    def __init__(self, inner: Any, ledger: Ledger) -> None:
        self.inner = inner
        self.ledger = ledger

    def allocate(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        tensor: torch.Tensor = self.inner.allocate(*args, **kwargs)
        return tensor

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        source = kwargs.get("input_tensor", args[1] if len(args) > 1 else None)
        if isinstance(source, torch.Tensor):
            self.ledger.record("all_gather", source)
        return self.inner(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class HoldPlan:
    """How one parameter group's coming reduce-scatter may be held: FSDP2 then only views
    its output (``numel`` elements of ``dtype``), as the new gradients of ``fresh``, and
    adds pieces of it to the gradients that exist already (``accumulate``)."""

    numel: int
    dtype: torch.dtype
    accumulate: tuple[Accumulate, ...]
    fresh: tuple[torch.Tensor, ...]
    small_numel: int
    """Inputs of this many elements or more go at once, on their own."""

    def accepts(self, output: torch.Tensor, source: torch.Tensor, op: Any) -> bool:
        """Whether the call FSDP2 makes is the one planned, and small."""
        return (
            op == dist.ReduceOp.AVG  # no division of the output afterwards
            and output.dtype == self.dtype  # no cast of the output afterwards
            and output.numel() == self.numel
            and source.numel() < self.small_numel
        )


def hold_plan(
    group: Any, inner: Any, world_size: int, small_numel: int, default: type
) -> HoldPlan | None:
    """The plan for ``group``'s reduce-scatter, computed just before its ``post_backward``
    (which picks the same parameters: those with an unsharded or accumulated gradient),
    or ``None`` where something would read its output before the held run: an
    all-reduce hook, a post-accumulate-grad hook, a custom reduce-scatter (the user's own
    collective, which must not be bypassed) or sharded gradients of another dtype.
    ``inner`` is the reduce-scatter object the counting one delegates to, ``default``
    FSDP2's own class (:func:`decide_bucketing`)."""
    if type(inner) is not default or group._all_reduce_hook is not None:
        return None
    accumulate: list[Accumulate] = []
    fresh: list[torch.Tensor] = []
    dtypes: set[torch.dtype] = set()
    start = 0
    for fsdp_param in group.fsdp_params:
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        if unsharded is None or (
            fsdp_param.unsharded_accumulated_grad is None and unsharded.grad is None
        ):
            continue
        sharded = fsdp_param.sharded_param
        if getattr(sharded, "_post_accumulate_grad_hooks", None):
            return None
        dtypes.add(sharded.dtype)
        if sharded.grad is not None:
            accumulate.append(Accumulate(local_tensor(sharded.grad), start))
        else:
            fresh.append(sharded)
        start += shard_layout(tuple(int(d) for d in fsdp_param._orig_size), world_size).shard_numel
    if len(dtypes) != 1:
        return None
    return HoldPlan(start, dtypes.pop(), tuple(accumulate), tuple(fresh), small_numel)


def clear_dropped(held: Sequence[Held]) -> None:
    """Clear the gradients that are views of dropped held outputs (never reduced)."""
    for h in held:
        storage = h.output.untyped_storage().data_ptr()
        for param in h.fresh:
            grad = param.grad
            if grad is not None and local_tensor(grad).untyped_storage().data_ptr() == storage:
                param.grad = None


class CountingReduceScatter:
    """Delegates to FSDP2's reduce-scatter object, counting its input in the ledger; with
    ``group`` (HSDP) also the all-reduce FSDP2 runs next over the replicate dimension,
    whose input is this reduce-scatter's output. With ``held``, a call that meets the
    ``plan`` set for it is held instead (counted when the held ones run)."""

    def __init__(
        self, inner: Any, ledger: Ledger, group: Any | None, held: HeldReduceScatters | None
    ) -> None:
        self.inner = inner
        self.ledger = ledger
        self.group = group
        self.held = held
        self.plan: HoldPlan | None = None

    def allocate(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        tensor: torch.Tensor = self.inner.allocate(*args, **kwargs)
        return tensor

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        output = kwargs.get("output_tensor", args[0] if args else None)
        source = kwargs.get("input_tensor", args[1] if len(args) > 1 else None)
        plan, self.plan = self.plan, None
        group: Any = kwargs.get("group")
        op = kwargs.get("op")
        if (
            self.held is not None
            and plan is not None
            and isinstance(output, torch.Tensor)
            and isinstance(source, torch.Tensor)
            and plan.accepts(output, source, op)
        ):
            # FSDP2 makes this call synchronously and drops what it returns.
            self.held.hold(output, source, group, op, plan.accumulate, plan.fresh)
            return None
        if isinstance(source, torch.Tensor):
            self.ledger.record("reduce_scatter", source)
        if self.group is not None and self.group.all_reduce_grads and output is not None:
            self.ledger.record(REPLICA_ALL_REDUCE, output)
        return self.inner(*args, **kwargs)


def steer(
    targets: Sequence[Any], order: Sequence[Any], skipped: set[int], own: Any, direction: int
) -> list[Any]:
    """``targets`` (FSDP states to prefetch) with each skipped one replaced by the next
    state in ``order`` (``direction`` +1: forward, -1: backward) that the step does not
    skip, leaving out ``own``, states already listed and states past the end."""
    steered: list[Any] = []
    position = {id(state): i for i, state in enumerate(order)}
    for target in targets:
        candidate = target
        if id(candidate) in skipped:
            i = position.get(id(candidate))
            candidate = None
            while i is not None:
                i += direction
                if not 0 <= i < len(order):
                    break
                if id(order[i]) not in skipped:
                    candidate = order[i]
                    break
        if candidate is None or candidate is own or any(candidate is s for s in steered):
            continue
        steered.append(candidate)
    return steered


Steered = dict[int, tuple[Any, Any, Any, Any]]
"""Per FSDP state: (the user's forward list, the steered one, backward, steered)."""


def steer_prefetch(order: Sequence[Any], skipped: set[int], saved: Steered) -> None:
    """Point every state's explicit prefetch lists (``_states_to_forward_prefetch``,
    ``_states_to_backward_prefetch``) away from the ``skipped`` states, remembering the
    user's lists in ``saved`` (a list the user set since replaces the saved one)."""
    for state in order:
        before = saved.get(id(state))
        forward = state._states_to_forward_prefetch
        backward = state._states_to_backward_prefetch
        if before is not None:
            forward = before[0] if forward is before[1] else forward
            backward = before[2] if backward is before[3] else backward
        if not forward and not backward:
            continue
        steered_f = steer(forward, order, skipped, state, +1)
        steered_b = steer(backward, order, skipped, state, -1)
        state._states_to_forward_prefetch = steered_f
        state._states_to_backward_prefetch = steered_b
        saved[id(state)] = (forward, steered_f, backward, steered_b)


def drop_unreduced_grads(fsdp_params: Iterable[Any]) -> None:
    """Drop the gradients an aborted backward left on unsharded parameters.

    reset_iter_state discards FSDP's reduction state but not these: the next backward
    would take them as its own (a skipped parameter's as "used") and reduce them."""
    for fsdp_param in fsdp_params:
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        if unsharded is not None:
            unsharded.grad = None
        fsdp_param.unsharded_accumulated_grad = None


def unreduced(
    params_of: Iterable[Iterable[tuple[Any, int | None]]], fresh: Callable[[Any, int], bool]
) -> list[Any]:
    """The FSDP parameters whose unsharded gradient is ``fresh`` (this iteration's) when
    the root's forward returns: a backward inside that forward reached no nested unit,
    so none of FSDP2's backward hooks ran (they hang on the units' inputs and outputs;
    the root's outputs do not exist yet) and nothing reduces them."""
    return [
        fsdp_param
        for entries in params_of
        for fsdp_param, index in entries
        if index is not None
        and fresh(getattr(getattr(fsdp_param, "_unsharded_param", None), "grad", None), index)
    ]


def restore_prefetch(order: Sequence[Any], saved: Steered) -> None:
    """Give every state back the user's prefetch lists, except where the user set a list
    since :func:`steer_prefetch` steered it; empties ``saved``."""
    for state in order:
        before = saved.get(id(state))
        if before is None:
            continue
        forward, steered_f, backward, steered_b = before
        if state._states_to_forward_prefetch is steered_f:
            state._states_to_forward_prefetch = forward
        if state._states_to_backward_prefetch is steered_b:
            state._states_to_backward_prefetch = backward
    saved.clear()


class FlagExchange:
    """The flags of the parameters some rank's backward gave no gradient although they are
    not skipped (``missing``) and of those this rank gave one (``got``): one asynchronous
    all-reduce (a sum) of two flags per parameter over ``group``, started as soon as the
    last parameter group's ``post_backward`` has set them, so that it runs alongside the
    wrapper's last reduce-scatter; :meth:`result` waits for it."""

    def __init__(
        self,
        missing: Sequence[int],
        got: set[int],
        count: int,
        group: Any,
        ledger: Ledger,
        device: torch.device,
    ) -> None:
        flags = torch.zeros(2, count, dtype=torch.int32, device=device)
        if missing:
            flags[0, list(missing)] = 1
        if got:
            flags[1, sorted(got)] = 1
        ledger.record("flags", flags)
        self._flags = flags
        self._work = dist.all_reduce(flags, group=group, async_op=True)

    def result(self) -> tuple[list[int], list[int]]:
        """(parameters some rank gave no gradient although not skipped, those no rank gave
        one)."""
        self._work.wait()
        flags = self._flags.cpu()
        found = [int(i) for i in flags[0].nonzero().flatten().tolist()]
        return found, [i for i in found if int(flags[1, i]) == 0]
