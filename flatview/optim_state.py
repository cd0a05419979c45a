"""Optimizer state by original parameter name: consolidated across ranks, loaded back at
any world size and on any backend.

An optimizer built over views keeps, per view, state tensors shaped like the view: this
rank's piece of the parameter, full, partial (1-D) or empty. The consolidated form is
that of ``torch.optim.Optimizer.state_dict()`` keyed by original parameter names (those
of :meth:`flatview.FlatView.named_parameters`)::

    {"state": {name: {key: value}}, "param_groups": [{..., "params": [name, ...]}]}

Per-element state (Adam's ``exp_avg``, SGD's ``momentum_buffer``, ...) is a tensor of
the original parameter's shape, assembled from every rank's piece; any other state
(``step``, python numbers) is taken as it is, after checking that every rank holding it
agrees. Nothing in it depends on the world size, the backend or the sharding strategy.

Which state is per-element
--------------------------
On a rank, a state tensor is per-element when it has as many elements as the optimizer's
parameter has of the original parameter there (the piece; for fairscale parameters that
are not flattened, the padded shard) and at least one dimension. A 0-dim tensor is a
scalar (``step``), except for a 0-dim parameter, whose 0-dim state is per-element unless
its key is ``step``. In the consolidated dict every tensor with a dimension must have the
original parameter's shape. A state tensor that is neither (a factored second moment, a
per-row statistic) cannot be cut into pieces and is refused with
:class:`OptimStateError`.

Where the elements are
----------------------
Each original parameter has a :class:`~flatview.layout.Placement`: replicated (every
rank holds all of it: torch ``NO_SHARD``, one rank, parameters FSDP does not manage), a
segment of a sharded flat parameter (flatview's views, and torch's own views with
``use_orig_params=True``, whose pieces follow the same layout), or a fairscale parameter
that is not flattened (``flatten_parameters=False``), which fairscale shards on its own,
padded like a flat parameter of one segment. It says which elements each rank holds.

Agreement and hangs
-------------------
Errors that the model and the optimizer alone decide (a parameter the model does not
hold, a state tensor that cannot be consolidated on a replicated parameter) are found
before any collective; the rank that found one sends it in place of its description in
the one small all-gather of descriptions that every rank of the run joins (even where
every rank holds everything and nothing else is exchanged: a rank raising alone would
leave the others waiting for it in their next collective), and every rank raises it.
That exchange (keys, kinds, dtypes and scalar values, no data) lets
every rank check the same facts: that the optimizers on all ranks hold the same
parameters, that every rank holding elements of a parameter has its state, and that
those ranks agree on its keys, dtypes and scalars. Ranks holding none of a parameter
are not asked: torch's ``use_orig_params`` views give them no gradient, so no state, or
after a load state that no longer moves. A disagreement raises the same error on every
rank before any state tensor moves. The state of parameters that every rank holds whole
is this rank's, taken as it is and not compared (FSDP keeps it identical across ranks,
except for parameters torch FSDP is told to ignore, which are each rank's own).
Loading communicates nothing.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from flatview import expert_state, wrapped_models
from flatview.backends.base import Adapter, is_rank0
from flatview.comm.consolidate import exchange
from flatview.errors import OptimStateError
from flatview.layout import Placement
from flatview.local_tensors import like_param, local_tensor
from flatview.sharded_tensors import is_sharded, local_of_sharded
from flatview.state_gather import Kind, by_shard_group, gather, shard_groups
from flatview.state_merge import merge, not_consolidable, raise_reported, same_request
from flatview.table import ParamTable

_STEP = "step"


@runtime_checkable
class ConsolidatesItself(Protocol):
    """An optimizer that keeps whole tensors on owner ranks and consolidates its state
    itself (:class:`flatview.optim.Whole`): :meth:`flatview.FlatView.optim_state_dict`
    and :meth:`~flatview.FlatView.load_optim_state_dict` hand it over."""

    def consolidated_state_dict(self, *, rank0_only: bool = False) -> dict[str, Any]:
        """What :meth:`flatview.FlatView.optim_state_dict` returns for it."""

    def load_consolidated_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """What :meth:`flatview.FlatView.load_optim_state_dict` does for it."""


# ---------------------------------------------------------------- per-element state


def local_part(
    home: Placement, full: torch.Tensor, like: torch.Tensor | None = None
) -> torch.Tensor:
    """This rank's part of a full per-element tensor, shaped like ``like`` (the
    optimizer's parameter) where it holds as many elements, 1-D otherwise. A copy."""
    if is_sharded(full):
        # The sharded form of flatview.checkpoint: this rank's elements are its own.
        return local_of_sharded(home, full, like)
    full = full.detach()
    if home.layout is None:
        return full.clone()
    piece = home.piece(home.rank)
    start, end = piece.param_interval
    values = full.reshape(-1)[start:end]
    if home.padded_shard:
        # Padding only ever gets zero gradients: its state is zero.
        out = full.new_zeros(home.local_numel)
        lo, hi = home.local_interval
        out[lo:hi] = values
        return out
    if like is not None and like.numel() == piece.numel:
        return values.clone().view(like.shape)
    return values.clone()


def kind_of(home: Placement, key: Any, value: Any) -> Kind:
    """How this rank holds the state ``key`` (see the module docstring)."""
    if not isinstance(value, torch.Tensor):
        return ("value", value)
    if not _is_elementwise(home, key, value):
        if value.dim() == 0:
            return ("value", value.detach().to("cpu", copy=True))
        return ("other", tuple(value.shape))
    if value.numel() != home.local_numel:
        return ("other", tuple(value.shape))
    return ("elem", value.dtype)


def _is_elementwise(home: Placement, key: Any, value: Any) -> bool:
    """Whether ``value`` is shaped to be per-element state of this parameter (any
    tensor with a dimension; a 0-dim one only for a 0-dim parameter, not ``step``)."""
    return isinstance(value, torch.Tensor) and (
        value.dim() > 0 or (home.shape == () and key != _STEP)
    )


def _optimizer_params(table: ParamTable, optimizer: torch.optim.Optimizer) -> list[list[int]]:
    """Per parameter group of ``optimizer``, the indices of its parameters; raises
    :class:`OptimStateError` for any tensor that is not one of the model's parameters."""
    groups = []
    for g, group in enumerate(optimizer.param_groups):
        indices = []
        for j, tensor in enumerate(group["params"]):
            index = table.index_of(tensor)
            if index is None:
                raise OptimStateError(
                    f"{type(optimizer).__name__}: parameter {j} of parameter group {g} is "
                    f"{_describe_foreign(tensor, table)}, not one of this "
                    "FlatView's parameters. Optimizer state is saved and loaded by name only "
                    "for optimizers over views and the model's other parameters "
                    "(FlatView.parameters(), submodule.parameters())."
                )
            indices.append(index)
        groups.append(indices)
    return groups


def _describe_foreign(tensor: Any, table: ParamTable) -> str:
    flat = table.flat_parameter(tensor)
    if flat is not None:
        unit, names = flat
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        return f"the flat parameter of FSDP unit {unit!r} (holding {shown})"
    if isinstance(tensor, torch.Tensor):
        return (
            f"a {type(tensor).__name__} of shape {tuple(tensor.shape)} and dtype "
            f"{tensor.dtype} that the model does not hold"
        )
    return f"a {type(tensor).__name__}"


# ------------------------------------------------------------------------ consolidate


def local_facts(
    table: ParamTable, optimizer: torch.optim.Optimizer, homes: Sequence[Placement]
) -> tuple[list[list[int]], dict[str, Any], list[int], dict[int, dict[Any, Kind]]]:
    """What this rank's optimizer holds: its parameter groups (as indices), its
    ``state_dict()``, the indices in state-dict order, and the kind of each state entry
    of sharded parameters. Raises :class:`OptimStateError` for what cannot be
    consolidated whatever the other ranks hold."""
    groups = _optimizer_params(table, optimizer)
    saved = optimizer.state_dict()
    # New dicts: state_dict() shares each parameter's state dict with the optimizer, so
    # writing the local pieces into it would swap the optimizer's own DTensor state
    # (FSDP2) for plain tensors, and its next step would fail.
    saved["state"] = {
        position: {
            key: local_tensor(value) if isinstance(value, torch.Tensor) else value
            for key, value in entry.items()
        }
        for position, entry in saved["state"].items()
    }
    # Optimizer.state_dict() numbers the parameters in group order: position k is the
    # k-th parameter over all groups.
    order = [index for group in groups for index in group]
    described: dict[int, dict[Any, Kind]] = {}
    for position, index in enumerate(order):
        state = saved["state"].get(position)
        if state is None:
            continue
        home = homes[index]
        kinds = {key: kind_of(home, key, value) for key, value in state.items()}
        if home.layout is None:
            # Replicated state is the same on every rank: refused here, on every rank.
            for key, kind in kinds.items():
                if kind[0] == "other":
                    raise not_consolidable(home, key, kind[1], None)
        else:
            described[position] = kinds
    return groups, saved, order, described


def agreed_facts(
    table: ParamTable,
    adapter: Adapter,
    optimizer: torch.optim.Optimizer,
    *,
    failure: BaseException | None = None,
    request: Any = None,
) -> tuple[list[list[int]], dict[str, Any], list[int], dict[int, dict[Any, Kind]], bool]:
    """:func:`local_facts` with the plan the ranks agreed on in one exchange (what state
    each sharded parameter has), and whether there are sharded parameters to gather.

    Every rank of the run takes part in the exchange, even where every rank holds every
    parameter and nothing will be gathered (torch ``NO_SHARD``, DDP): a rank that refuses
    its optimizer (or whose caller hands its own refusal over as ``failure``) would
    otherwise raise alone while the others go on to their next collective and wait for
    it there. So a misuse on one rank raises on every rank of every replica, as do ranks
    whose optimizers hold different parameters, or whose ``request`` (the options of the
    call, which decide the collectives that follow) differs."""
    params = table.params
    homes = [param.placement for param in params]
    sharing = adapter.world_size > 1 and any(home.layout is not None for home in homes)
    exchanging = adapter.world_size * adapter.replicas > 1
    over, members = shard_groups(adapter)
    try:
        if failure is not None:
            raise failure
        groups, saved, order, described = local_facts(table, optimizer, homes)
    except Exception as err:
        if not exchanging:
            raise
        # The others are about to exchange descriptions: tell them, so that all raise.
        told = str(err) if isinstance(err, OptimStateError) else f"{type(err).__name__}: {err}"
        raise_reported(exchange({"error": told}, over), cause=err)
        raise  # not reached: this rank's own report is among them
    plan: dict[int, dict[Any, Kind]] = {}
    if exchanging:
        mine = {
            "params": tuple(order),
            "state": described if sharing else {},
            "members": members,
            "request": request,
            "expert": expert_state.describe(table),
        }
        everyone = exchange({**mine, "shard": adapter.rank}, over)
        raise_reported(everyone)
        same_request(everyone)
        # Every shard group's merge on every rank: all raise the same first error. The
        # experts sharded over groups of their own are merged within those groups.
        experts = expert_state.sharded_experts(table, order, homes) if sharing else frozenset()
        for descriptions in by_shard_group(everyone):
            try:
                merged = merge(
                    [expert_state.restricted(d, experts, keep=False) for d in descriptions],
                    descriptions[0]["params"],
                    homes,
                    params,
                )
            except OptimStateError as err:
                if members is None:
                    raise
                ranks = list(descriptions[0]["members"])
                raise OptimStateError(f"in the shard group of ranks {ranks}: {err}") from err
            if descriptions[0]["members"] == members:
                plan = merged
        if experts:
            plan.update(expert_state.merge_groups(everyone, experts, order, homes, params))
    return groups, saved, order, plan, sharing


def consolidate(
    table: ParamTable,
    adapter: Adapter,
    optimizer: torch.optim.Optimizer,
    *,
    rank0_only: bool = False,
    failure: BaseException | None = None,
) -> dict[str, Any]:
    """The consolidated state of ``optimizer`` (see :meth:`flatview.FlatView.optim_state_dict`);
    ``failure``: what the caller found wrong on this rank, raised on every rank."""
    homes = [param.placement for param in table.params]
    groups, saved, order, plan, gathering = agreed_facts(
        table, adapter, optimizer, failure=failure, request={"rank0_only": rank0_only}
    )
    states: dict[int, dict[Any, Any]] = saved["state"]

    receiving = not rank0_only or is_rank0(adapter)
    fulls: dict[tuple[int, Any], torch.Tensor] = {}
    if gathering:
        experts = expert_state.sharded_experts(table, order, homes)
        shared = {p: kinds for p, kinds in plan.items() if p not in experts}
        fulls = gather(
            shared,
            states,
            order,
            homes,
            adapter.group,
            adapter.world_size,
            adapter.device,
            rank0_only,
        )
        fulls.update(
            expert_state.gathered(plan, experts, states, order, homes, table, adapter.device)
        )

    out_state: dict[str, dict[Any, Any]] = {}
    if receiving:
        for position, index in enumerate(order):
            home = homes[index]
            if home.layout is None:
                state = states.get(position)
                if state is not None:
                    out_state[home.name] = {
                        key: snapshot(value.reshape(home.shape))
                        if kind_of(home, key, value)[0] == "elem"
                        else snapshot(value)
                        for key, value in state.items()
                    }
                continue
            if position not in plan:
                continue
            # Scalars as the first rank holding elements of the parameter has them, the
            # same on every rank.
            out_state[home.name] = {
                key: fulls[(position, key)] if kind[0] == "elem" else snapshot(kind[1])
                for key, kind in plan[position].items()
            }

    out_groups = []
    for group, saved_group in zip(groups, saved["param_groups"], strict=True):
        out_group = {k: copy.deepcopy(v) for k, v in saved_group.items() if k != "params"}
        out_group["params"] = [homes[index].name for index in group]
        out_groups.append(out_group)
    return {"state": out_state, "param_groups": out_groups}


def snapshot(value: Any) -> Any:
    """A state value the caller owns: a tensor as a fresh CPU copy, the rest deep-copied."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return copy.deepcopy(value)


# ---------------------------------------------------------------------------- load


def load(
    table: ParamTable,
    optimizer: torch.optim.Optimizer,
    state_dict: Mapping[str, Any],
    *,
    regroup: bool = False,
) -> None:
    """Load a consolidated state (see :meth:`flatview.FlatView.load_optim_state_dict`)."""
    params = table.params
    homes = [param.placement for param in params]
    groups = _optimizer_params(table, optimizer)
    if not (
        isinstance(state_dict, Mapping)
        and isinstance(state_dict.get("state"), Mapping)
        and isinstance(state_dict.get("param_groups"), Sequence)
    ):
        raise OptimStateError(
            "not a consolidated optimizer state dict: expected a mapping with 'state' "
            "(name -> state) and 'param_groups' (as FlatView.optim_state_dict returns)"
        )
    saved_groups = state_dict["param_groups"]
    saved_state = state_dict["state"]
    by_name = {name: p.index for p in params for name in p.names}
    position_of: dict[int, int] = {}
    for group in groups:
        for index in group:
            position_of[index] = len(position_of)
    match = _regrouped if regroup else _matched
    internal_groups = match(_Matching(table, optimizer, groups, saved_groups, by_name, position_of))
    listed = set(position_of)

    internal_state: dict[int, dict[Any, Any]] = {}
    for name, entry in saved_state.items():
        found = by_name.get(name) if isinstance(name, str) else None
        if found is None:
            raise OptimStateError(
                f"the state dict has optimizer state for {name!r}, which is unknown to this "
                "model (names are those of FlatView.named_parameters())"
            )
        index = found
        if index not in listed:
            if regroup:
                continue  # another optimizer's (regrouping takes what this one holds)
            raise OptimStateError(
                f"the state dict has optimizer state for {name!r}, which none of its "
                "parameter groups lists"
            )
        home = homes[index]
        local: dict[Any, Any] = {}
        for key, value in entry.items():
            if _is_elementwise(home, key, value):
                if tuple(value.shape) != home.shape:
                    raise OptimStateError(
                        f"optimizer state {key!r} of parameter {home.name!r} has shape "
                        f"{tuple(value.shape)}, but the parameter's shape is {home.shape}"
                    )
                local[key] = like_param(
                    local_part(home, value, local_tensor(params[index].tensor)),
                    params[index].tensor,
                )
            else:
                local[key] = snapshot(value)
        internal_state[position_of[index]] = local
    optimizer.load_state_dict({"state": internal_state, "param_groups": internal_groups})
    # Parameters it now holds without state never had a gradient: a checkpoint of it
    # must not prime it as a fresh optimizer.
    wrapped_models.record_history(optimizer)


def _matched(m: _Matching) -> list[dict[str, Any]]:
    """The optimizer's groups as ``load_state_dict`` takes them, from the saved groups:
    group by group, the same parameters (by name), the saved hyperparameters."""
    params, optimizer, groups, saved_groups = m.table.params, m.optimizer, m.held, m.saved
    if len(saved_groups) != len(groups):
        raise OptimStateError(
            f"the state dict has {len(saved_groups)} parameter group(s), "
            f"{type(optimizer).__name__} has {len(groups)}"
        )
    internal_groups = []
    for g, (group, saved) in enumerate(zip(groups, saved_groups, strict=True)):
        indices = _listed(saved, g, m.by_name)
        mine, theirs = set(group), set(indices)
        missing = [params[i].name for i in group if i not in theirs]
        extra = [n for n, i in zip(saved.get("params", ()), indices, strict=True) if i not in mine]
        if missing or extra or len(theirs) != len(indices):
            problems = []
            if missing:
                problems.append(f"missing from the state dict: {missing}")
            if extra:
                problems.append(f"not in the optimizer's group: {extra}")
            if len(theirs) != len(indices):
                problems.append("some parameter is listed twice")
            raise OptimStateError(
                f"parameter group {g} of the state dict does not match parameter group {g} "
                f"of {type(optimizer).__name__}: " + "; ".join(problems)
            )
        internal_groups.append(_internal(saved, group, m.position_of))
    return internal_groups


def _regrouped(m: _Matching) -> list[dict[str, Any]]:
    """The optimizer's own groups and hyperparameters, as they are: regrouping takes
    only per-parameter state from the dict. Every parameter the optimizer holds must
    be listed by some saved group (the saved optimizer held it)."""
    saved = {i for g, group in enumerate(m.saved) for i in _listed(group, g, m.by_name)}
    missing = [m.table.params[i].name for group in m.held for i in group if i not in saved]
    if missing:
        raise OptimStateError(
            f"{type(m.optimizer).__name__} holds {missing}, which no parameter group of the "
            "state dict lists: it was saved without them"
        )
    return [
        _internal(own, group, m.position_of)
        for own, group in zip(m.optimizer.param_groups, m.held, strict=True)
    ]


@dataclass(frozen=True)
class _Matching:
    """What matching an optimizer's groups to a saved state's takes."""

    table: ParamTable
    optimizer: torch.optim.Optimizer
    held: Sequence[Sequence[int]]
    """Per group of the optimizer, the indices of the parameters it holds."""
    saved: Sequence[Mapping[str, Any]]
    """The state dict's groups."""
    by_name: Mapping[str, int]
    position_of: Mapping[int, int]
    """Each held parameter's position in the optimizer (what its state is keyed by)."""


def _internal(
    hyper: Mapping[str, Any], group: Sequence[int], position_of: Mapping[int, int]
) -> dict[str, Any]:
    """A group as ``load_state_dict`` takes it: ``hyper``'s hyperparameters, the positions
    of ``group``'s parameters."""
    internal = {k: copy.deepcopy(v) for k, v in hyper.items() if k not in ("params", "param_names")}
    internal["params"] = [position_of[i] for i in group]
    return internal


def _listed(saved: Mapping[str, Any], g: int, by_name: Mapping[str, int]) -> list[int]:
    """The indices of the parameters saved group ``g`` lists by name."""
    names = list(saved.get("params", ()))
    unknown = [n for n in names if not isinstance(n, str) or n not in by_name]
    if unknown:
        raise OptimStateError(
            f"parameter group {g} of the state dict lists {unknown}: unknown to this "
            "model (names are those of FlatView.named_parameters())"
        )
    return [by_name[n] for n in names]
