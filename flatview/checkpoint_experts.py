"""Checkpoint keys of experts: :mod:`flatview.checkpoint` over models with units on
process groups of their own.

Ranks of different expert groups hold different experts under the same names, so a
checkpoint keyed by name alone would have every group write the same keys
(``torch.distributed.checkpoint`` keeps one writer's). Each expert group's entries are
keyed under its own prefix instead, ``expert_groups.<g>.<name>``, where ``g`` numbers
the expert groups in the order of their first ranks: the parameters, the persistent
buffers inside expert units, and the optimizer state's ``state`` entries.
``param_groups`` keep the original names, alike for every group (the checkpoint keeps
one copy of what is not a tensor). A checkpoint then holds every group's experts once, as a
stack of per-group models would name them, and loads into any run with the same number
of expert groups, at any group size (``torch.distributed.checkpoint.load`` reshards each
key within its group). Sharded values of experts are ``ShardedTensor`` s over their
group's ranks (:class:`GroupView`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from flatview.errors import FlatViewError
from flatview.expert_state import rank0_alone
from flatview.table import ParamTable

PREFIX = "expert_groups"


@dataclass(frozen=True)
class GroupView:
    """What :func:`flatview.sharded_tensors.sharded_value` reads of an adapter, for an
    expert group: its process group and the device."""

    group: dist.ProcessGroup
    device: torch.device


class ExpertKeys:
    """This rank's expert group's keys: which names are its group's, and their keys."""

    def __init__(self, table: ParamTable, agreement_rank: int) -> None:
        self.index: int | None = None
        self.names: frozenset[str] = frozenset()
        self.units: tuple[str, ...] = ()
        if table.peers is None:
            return
        groups = sorted(set(table.peers))
        self.index = groups.index(table.peers[agreement_rank])
        self.names = frozenset(n for i in table.own_group_params for n in table.params[i].names)
        self.units = tuple(u.name for u in table.units if u.group is not None)

    def is_expert(self, name: str) -> bool:
        """A parameter of an expert unit, or a buffer inside one."""
        return name in self.names or any(name.startswith(f"{u}.") for u in self.units)

    def key(self, name: str) -> str:
        return f"{PREFIX}.{self.index}.{name}" if self.is_expert(name) else name

    def name(self, key: str) -> str:
        """The name a key of this rank's group stands for; refuses another group's."""
        if self.index is None or not key.startswith(f"{PREFIX}."):
            return key
        number, _, name = key[len(PREFIX) + 1 :].partition(".")
        if number != str(self.index):
            raise FlatViewError(
                f"the state dict holds {key!r}, an expert of expert group {number}; this "
                f"rank ({dist.get_rank()}) is in expert group {self.index}: pass each rank "
                "the dict its own get_state_dict made (torch.distributed.checkpoint.load "
                "fills it with its group's experts)"
            )
        return name

    def load_pre_hook(self, module: Any, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
        """A load-state-dict pre-hook of the wrapped model: its experts' keys (this rank's
        group's; another group's are refused) become their names, so that the model's own
        ``load_state_dict`` takes what the routed ``get_model_state_dict`` gave."""
        marker = f"{prefix}{PREFIX}."
        for key in [k for k in state_dict if k.startswith(marker)]:
            state_dict[prefix + self.name(key[len(prefix) :])] = state_dict.pop(key)

    # ------------------------------------------------------------ whole dicts

    def model_out(self, state: dict[str, Any], path: str = "") -> dict[str, Any]:
        """Model state keyed by name (under ``path`` in a module holding the model: its
        other keys stay as they are) keyed by group."""
        if self.index is None:
            return state
        return {_under(k, path, self.key): v for k, v in state.items()}

    def model_in(self, state: Mapping[str, Any], path: str = "") -> dict[str, Any]:
        """What :meth:`model_out` gave, keyed by name again; refuses another group's."""
        if self.index is None:
            return dict(state)
        return {_under(k, path, self.name): v for k, v in state.items()}

    def optim_out(self, state: dict[str, Any]) -> dict[str, Any]:
        if self.index is None or not state:
            return state
        # param_groups keep the names: torch.distributed.checkpoint keeps one copy of a
        # value that is not a tensor, so they must read alike on every rank.
        return {**state, "state": {self.key(k): v for k, v in state["state"].items()}}

    def optim_in(self, state: Mapping[str, Any]) -> Mapping[str, Any]:
        if self.index is None or not isinstance(state, Mapping):
            return state
        inner = state.get("state")
        if not isinstance(inner, Mapping):
            return state
        return {**state, "state": {self.name(k): v for k, v in inner.items()}}


def _under(key: str, path: str, rename: Callable[[str], str]) -> str:
    return f"{path}{rename(key[len(path) :])}" if key.startswith(path) else key


def expert_keys(runtime: Any) -> ExpertKeys:
    """The :class:`ExpertKeys` of a runtime's model on this rank."""
    adapter = runtime.adapter
    return ExpertKeys(runtime.table, dist.get_rank(adapter.agreement_group))


def group_view(table: ParamTable, index: int, device: torch.device) -> GroupView | None:
    """The :class:`GroupView` of parameter ``index``'s own unit group, ``None`` where it
    is on the adapter's."""
    group = table.own_group(index)
    return None if group is None else GroupView(group.group, device)


def refuse_rank0_form(table: ParamTable, info: Any) -> None:
    """Refuse the full form on rank 0 alone (``full_state_dict`` with ``cpu_offload``)
    for a model with experts: rank 0 does not hold every group's."""
    if table.own_group_params and info.full_state_dict and info.cpu_offload:
        raise FlatViewError(
            rank0_alone(
                table,
                "StateDictOptions(full_state_dict=True, cpu_offload=True)",
                "Save the full form without cpu_offload (each rank holds its group's "
                "experts) or the sharded form",
            )
        )
