"""The FSDP2 adapter's side of FSDP2's reduction: what this rank contributes to each
reduce-scatter (:class:`Contributions`: zeros for a used parameter its backward did not
reach, an error for a skipped one it did), each parameter group's all-gather and
reduce-scatter objects wrapped to count bytes at the collective, and small
reduce-scatters held and run as one at the end of the backward (:mod:`flatview.comm.held`)
where nothing reads their output before (:class:`HoldPlanner`).

torch privates touched: the ``allocate`` / ``__call__`` protocol of FSDP2's ``AllGather``
and ``ReduceScatter`` objects (``torch.distributed.fsdp._fully_shard._fsdp_api``, which
``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter`` accept); for held
reduce-scatters ``_fsdp_collectives.DefaultReduceScatter``,
``FSDPParamGroup._all_reduce_hook``, ``FSDPParam._orig_size`` and
``unsharded_accumulated_grad``, and the sharded parameters'
``_post_accumulate_grad_hooks``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from flatview.backends.base import Runtime
from flatview.backends.fsdp2_checks import shard_layout
from flatview.comm.held import Accumulate, Held, HeldReduceScatters
from flatview.comm.ledger import REPLICA_ALL_REDUCE, Ledger
from flatview.comm.options import ReduceOptions
from flatview.errors import WrapError
from flatview.local_tensors import local_tensor
from flatview.states import Transitions


def decide_bucketing(
    options: ReduceOptions, device: torch.device, hybrid: bool, world_size: int
) -> type | None:
    """Whether to hold small reduce-scatters and run them as one (:mod:`flatview.comm.held`):
    FSDP2's default reduce-scatter class (only its calls are held), else ``None``.

    ``bucket_all_used=None`` holds them where that gives FSDP2's numbers bit for bit and
    saves time: on CPU (where a step goes by its number of collectives) over a shard
    group of 2 ranks (beyond 2, gloo's summation order follows the position in the
    buffer). ``True`` holds them at any size of group; never on an accelerator, whose
    reduce-scatters FSDP2 runs asynchronously on their own stream, nor with HSDP, whose
    all-reduce reads each reduce-scatter's output at once."""
    wanted = options.bucket_all_used
    if wanted is None:
        bucketing = device.type == "cpu" and not hybrid and world_size == 2
    elif wanted and (device.type != "cpu" or hybrid):
        raise WrapError(
            "ReduceOptions(bucket_all_used=True) cannot bucket FSDP2's reduce-scatters "
            + ("with HSDP (its all-reduce reads each output at once)" if hybrid else "")
            + (" and " if hybrid and device.type != "cpu" else "")
            + (
                f"on {device.type} (FSDP2 overlaps them on their own stream)"
                if device.type != "cpu"
                else ""
            )
            + "; leave bucket_all_used at None or False"
        )
    else:
        bucketing = wanted
    if not bucketing and options.in_place_min_numel != ReduceOptions().in_place_min_numel:
        raise WrapError(
            "ReduceOptions(in_place_min_numel=...) only sets which FSDP2 reduce-scatters "
            "are held and run as one, and this wrap holds none (bucket_all_used="
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
                "ReduceOptions(bucket_all_used=True): this torch's FSDP2 has no "
                f"DefaultReduceScatter, which flatview holds calls of (torch {torch.__version__})"
            ) from None
        return None
    return DefaultReduceScatter


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


class Planning(enum.Enum):
    """Where a :class:`HoldPlanner` is: still taking parameters, or refused for good."""

    OPEN = "taking the group's parameters in order"
    REFUSED = (
        "something would read the output before the held run (a post-accumulate-grad "
        "hook), or the sharded gradients differ in dtype"
    )


class HoldPlanner:
    """Builds one parameter group's :class:`HoldPlan`, parameter by parameter in the
    group's order, from each parameter as its ``post_backward`` will find it (which
    picks those with an unsharded or accumulated gradient): :meth:`add` is the rule,
    called by :meth:`Contributions.before_reduce` as it settles each parameter (one
    pass over them), or by :meth:`scan`."""

    def __init__(self, numels: Sequence[int], small_numel: int) -> None:
        self.numels = numels
        self.small_numel = small_numel
        self.planning = Transitions(Planning.OPEN, {Planning.OPEN: (Planning.REFUSED,)})
        self._accumulate: list[tuple[torch.Tensor, int]] = []
        self._fresh: list[torch.Tensor] = []
        self._dtype: torch.dtype | None = None
        self._start = 0

    def add(self, position: int, fsdp_param: Any, sharded: Any, unsharded: Any, grad: Any) -> None:
        """The group's ``position``-th parameter: its FSDP parameter, sharded parameter,
        unsharded parameter and that one's gradient as they are now. Reads only
        attributes (run under ``DisableTorchFunctionSubclass``, see
        :meth:`Contributions.before_reduce`)."""
        if unsharded is None or self.planning.state is Planning.REFUSED:
            return
        if grad is None and fsdp_param.unsharded_accumulated_grad is None:
            return
        if getattr(sharded, "_post_accumulate_grad_hooks", None):
            self.planning.move(Planning.REFUSED)
            return
        if self._dtype is None:
            self._dtype = sharded.dtype
        elif sharded.dtype != self._dtype:
            self.planning.move(Planning.REFUSED)
            return
        sharded_grad = sharded.grad
        if sharded_grad is not None:
            self._accumulate.append((sharded_grad, self._start))
        else:
            self._fresh.append(sharded)
        self._start += self.numels[position]

    def scan(self, group: Any) -> None:
        """:meth:`add` every parameter of ``group``."""
        with torch._C.DisableTorchFunctionSubclass():
            for position, fsdp_param in enumerate(group.fsdp_params):
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                grad = getattr(unsharded, "grad", None)
                self.add(position, fsdp_param, fsdp_param.sharded_param, unsharded, grad)

    def plan(self) -> HoldPlan | None:
        """The plan, or ``None`` where the call cannot be held."""
        if self.planning.state is Planning.REFUSED or self._dtype is None:
            return None
        return HoldPlan(
            self._start,
            self._dtype,
            tuple(Accumulate(local_tensor(grad), start) for grad, start in self._accumulate),
            tuple(self._fresh),
            self.small_numel,
        )


def hold_planner(
    group: Any, inner: Any, numels: Sequence[int], small_numel: int, default: type
) -> HoldPlanner | None:
    """A planner of ``group``'s coming reduce-scatter, computed just before its
    ``post_backward``, or ``None`` where something would read its output before the held
    run: an all-reduce hook or a custom reduce-scatter (the user's own collective, which
    must not be bypassed); the planner refuses a post-accumulate-grad hook and sharded
    gradients of another dtype. ``inner`` is the reduce-scatter object the counting one
    delegates to, ``default`` FSDP2's own class (:func:`decide_bucketing`); ``numels``,
    per parameter of the group, the elements of its shard (:func:`shard_numels`, worked
    out once)."""
    if type(inner) is not default or group._all_reduce_hook is not None:
        return None
    return HoldPlanner(numels, small_numel)


def shard_numels(group: Any, world_size: int) -> tuple[int, ...]:
    """Per parameter of ``group``, the elements of its shard (what its reduce-scatter
    output holds of it): FSDP2's groups are fixed after its lazy initialisation, which
    runs before the wrap, so this is asked once per group, not every backward."""
    return tuple(
        shard_layout(tuple(int(d) for d in p._orig_size), world_size).shard_numel
        for p in group.fsdp_params
    )


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
    params_of: Iterable[Iterable[tuple[Any, int | None]]], contributions: Contributions
) -> list[Any]:
    """The FSDP parameters whose unsharded gradient is fresh (:meth:`Contributions.fresh`)
    when the root's forward returns: a backward inside that forward reached no nested
    unit, so none of FSDP2's backward hooks ran (they hang on the units' inputs and
    outputs; the root's outputs do not exist yet) and nothing reduces them."""
    found = []
    for entries in params_of:
        for fsdp_param, index in entries:
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is None or index is None:
                continue
            grad = unsharded.grad
            if grad is not None and contributions.fresh(grad, index):
                found.append(fsdp_param)
    return found


def reduces_whole(group: Any, ran: bool) -> bool:
    """Whether an HSDP ``group``'s coming reduce-scatter must carry every parameter that
    requires a gradient (zeros for those without one), ``ran``: its unit's forward ran in
    this iteration (call only for a group that reduces, on HSDP).

    Under ``set_requires_all_reduce(False)`` FSDP2 only reduce-scatters, adding each
    output to the one before (its partial output, by position), and all-reduces the sum
    in the first backward with the all-reduce on that reaches the group. So the layout
    must be the same in every backward of that window whatever each skipped (the
    parameters a micro-batch skips are not known when the first reduce-scatter packs),
    and a unit the closing backward skips must still be reduced there: else FSDP2 keeps
    its sum and adds it to the next step's gradient (bare FSDP2 does, in silence)."""
    summing = group._partial_reduce_output is not None
    if ran:
        return summing or not group.all_reduce_grads
    return summing and bool(group.all_reduce_grads)


def accumulate_uniformly(group: Any, whole: bool) -> None:
    """Before a reducing ``post_backward`` of ``group`` in mixed precision: where FSDP2
    accumulated gradients in the reduce dtype over a ``set_requires_gradient_sync(False)``
    window, move every other gradient of the group there too, cast (and, for a ``whole``
    reduce-scatter, zeros for each parameter without one).

    FSDP2 (torch 2.13, pytorch#196996) packs accumulated gradients (reduce dtype) beside
    fresh ones (parameter dtype) and its reduce-scatter asserts a single dtype: a
    parameter first used by the closing micro-batch, which skip sets make common, raised
    ``expects uniform gradient dtype`` on bare FSDP2 too. Cast as FSDP2 casts what it
    accumulates, the values are those of the parameter's gradient in the reduce dtype."""
    fsdp_params = group.fsdp_params
    if all(f.unsharded_accumulated_grad is None for f in fsdp_params):
        return
    for fsdp_param in fsdp_params:
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        if fsdp_param.unsharded_accumulated_grad is not None or unsharded is None:
            continue
        dtype = fsdp_param.reduce_dtype
        if unsharded.grad is not None:
            fsdp_param.unsharded_accumulated_grad = unsharded.grad.to(dtype)
            unsharded.grad = None
        elif whole and unsharded.requires_grad:
            fsdp_param.unsharded_accumulated_grad = torch.zeros_like(unsharded, dtype=dtype)


@contextlib.contextmanager
def never_unsharded_apart(group: Any) -> Iterator[None]:
    """Around a non-reducing ``post_backward`` of ``group`` in mixed precision, whose
    unit did not run in this iteration: its parameters that were never unsharded (their
    unit never ran) are left out of FSDP2's move of gradients to the reduce dtype, where
    FSDP2 (torch 2.13) reads their unsharded parameter, which does not exist yet, and
    raised ``AttributeError`` (bare FSDP2 too: a unit skipped from the first step on)."""
    never = [f for f in group.fsdp_params if not hasattr(f, "_unsharded_param")]
    saved = [f.reduce_dtype for f in never]
    for fsdp_param in never:
        fsdp_param.reduce_dtype = None  # what FSDP2 reads to skip the move
    try:
        yield
    finally:
        for fsdp_param, dtype in zip(never, saved, strict=True):
            fsdp_param.reduce_dtype = dtype


def count_collectives(
    units: Sequence[Any], ledger: Ledger, hybrid: bool, held: HeldReduceScatters | None
) -> None:
    """Wrap every group's all-gather and reduce-scatter (again, if the user set a custom
    one since) so that the ledger counts them; ``held``: where small reduce-scatters are
    held, if they are."""
    for unit in units:
        for group in unit.groups:
            if not isinstance(group._all_gather_comm, CountingAllGather):
                group._all_gather_comm = CountingAllGather(group._all_gather_comm, ledger)
            if not isinstance(group._reduce_scatter_comm, CountingReduceScatter):
                group._reduce_scatter_comm = CountingReduceScatter(
                    group._reduce_scatter_comm, ledger, group if hybrid else None, held
                )


def stop_counting(units: Sequence[Any]) -> None:
    """Give every group back the all-gather and reduce-scatter objects counted."""
    for unit in units:
        for group in unit.groups:
            for attr in ("_all_gather_comm", "_reduce_scatter_comm"):
                comm = getattr(group, attr)
                if isinstance(comm, (CountingAllGather, CountingReduceScatter)):
                    setattr(group, attr, comm.inner)


class Contributions:
    """What this rank's backward contributes to each used parameter's reduce-scatter,
    decided just before each group's ``post_backward`` packs it: a skipped parameter
    that received a gradient is an error, a used one without a gradient on this rank
    gets zeros (so that every rank's reduce-scatter has the same layout), and the
    parameters this rank gave a gradient since the last synchronising backward are
    noted for the flags (:class:`~flatview.comm.unused.UsageFlags`).

    The error of a skipped parameter used is noted, not raised, and its fresh gradient
    dropped (what the other ranks' reduce-scatters hold of it): the model may use it on
    one rank only, and a rank that raised inside the backward would leave the others
    in the reduce-scatters still to come. The flags carry it, and every rank raises at
    the end of the synchronising backward."""

    def __init__(self, runtime: Runtime, groups: Iterable[Any]) -> None:
        self.runtime = runtime
        self._known: dict[int, tuple[tuple[int, Any, Any, int], ...]] = {}
        """Per group (by id): its FSDP parameters the runtime knows, with their position
        in the group, sharded parameter and runtime index (looked up once: the groups
        are fixed)."""
        self._whole: set[int] = set()
        """The groups (by id) whose every parameter the runtime knows."""
        for group in groups:
            found = tuple(
                (position, f, f.sharded_param, runtime.index_of(f.sharded_param))
                for position, f in enumerate(group.fsdp_params)
            )
            self._known[id(group)] = tuple(
                (position, f, sharded, index)
                for position, f, sharded, index in found
                if index is not None
            )
            if len(self._known[id(group)]) == len(found):
                self._whole.add(id(group))
        self.gave: set[int] = set()
        """Runtime indices of the parameters this rank's backwards gave a gradient since
        the last synchronising one."""
        self.used_skipped: set[int] = set()
        """Runtime indices of the skipped parameters that this rank's backwards gave a
        gradient since the last synchronising one: the error to raise at its end."""
        self._versions: dict[int, tuple[int, int]] = {}
        """Per parameter, its unsharded gradient (identity and version) at the end of
        the last backward under ``no_sync()``."""

    def before_reduce(self, group: Any, ran: bool, planner: HoldPlanner | None = None) -> None:
        """Settle ``group``'s gradients before its ``post_backward`` (``ran``: its unit's
        forward ran in this iteration); with ``planner``, give it each parameter as
        settled (in the same pass where every parameter is known here, else after)."""
        runtime = self.runtime
        used = runtime.plain_used()
        reducing = bool(group.reduce_grads)
        gave = self.gave
        fresh_of = self.fresh
        planning = planner is not None and id(group) in self._whole
        # Once per parameter every backward, the largest per-tensor cost of flatview on
        # FSDP2: each attribute is read once, into a local, and with torch functions off
        # (an attribute of a DTensor otherwise goes through its dispatch: 3x the time).
        # Nothing here calls an operation on a DTensor.
        with torch._C.DisableTorchFunctionSubclass():
            for position, fsdp_param, sharded, param_index in self._known[id(group)]:
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                grad = None if unsharded is None else unsharded.grad
                if sharded.requires_grad:
                    fresh = fresh_of(grad, param_index)
                    if param_index not in used:
                        if fresh:
                            self.used_skipped.add(param_index)
                            if param_index not in self._versions and unsharded is not None:
                                # As the other ranks have it: none accumulated.
                                grad = unsharded.grad = None
                    elif fresh:
                        gave.add(param_index)
                    elif (
                        ran
                        and reducing
                        and unsharded is not None
                        and grad is None
                        and fsdp_param.unsharded_accumulated_grad is None
                        and param_index not in gave
                    ):
                        # Zeros, what this rank contributes: its reduce-scatter keeps the
                        # layout the other ranks give theirs.
                        grad = unsharded.grad = torch.zeros_like(unsharded)
                if planning:
                    assert planner is not None
                    planner.add(position, fsdp_param, sharded, unsharded, grad)
        if planner is not None and not planning:
            planner.scan(group)

    def ungraded_skipped(self, group: Any) -> list[torch.Tensor]:
        """``group``'s sharded parameters that require a gradient, have none and were
        skipped in every backward since the last synchronising one: a whole
        reduce-scatter (:func:`reduces_whole`) gives them zeros, which must not become
        their gradient."""
        used = self.runtime.plain_used_so_far()
        with torch._C.DisableTorchFunctionSubclass():
            return [
                sharded
                for _, _, sharded, index in self._known[id(group)]
                if index not in used and sharded.requires_grad and sharded.grad is None
            ]

    def fresh(self, grad: torch.Tensor | None, index: int) -> bool:
        """Whether ``grad`` (parameter ``index``'s unsharded gradient) is this backward's:
        without mixed precision earlier micro-batches accumulate in the same tensor, so
        only one that changed since the last backward is."""
        return grad is not None and self._versions.get(index) != (id(grad), grad._version)

    def accumulated(self, params_of: Sequence[Sequence[tuple[Any, int | None]]]) -> None:
        """A backward under ``no_sync()`` ended: note each unsharded gradient as it is,
        so that the next backward tells its own from what is accumulated."""
        self._versions = {}
        for entries in params_of:
            for fsdp_param, position in entries:
                grad = getattr(getattr(fsdp_param, "_unsharded_param", None), "grad", None)
                if position is not None and grad is not None:
                    self._versions[position] = (id(grad), grad._version)

    def reset(self) -> None:
        """The window is over (reduced, or dropped by an aborted backward)."""
        self.gave.clear()
        self.used_skipped.clear()
        self._versions = {}
