"""DeepSpeed's own checkpoints on a wrapped engine: ``engine.save_checkpoint`` and
``engine.load_checkpoint`` (what DeepSpeed scripts, Lightning's ``DeepSpeedStrategy`` and
accelerate's ``save_state`` call), and the ZeRO optimizer's ``state_dict`` /
``load_state_dict`` they reach.

DeepSpeed writes its files as always: the model file (module state, lr scheduler,
``client_state``, step counters) through its own code, with its parameters registered
(lent), and one ZeRO file per data-parallel rank holding what the ZeRO optimizer's
``state_dict`` returns. Under flatview that is :meth:`ZeroCheckpoint.state_dict`: this
rank's fp32 master partitions under DeepSpeed's own keys (``zero_to_fp32.py`` and bare
DeepSpeed's weights-only loads read them as theirs), and, under :data:`FLATVIEW`, the
state of the engine's optimizer over this rank's views with the names of its parameters
and where each view lies in the partitions. DeepSpeed's own optimizer state is per
partition, one ``step`` per group: it cannot hold state kept per view (skipped
parameters stepped fewer times), so it is not written; bare DeepSpeed refuses to load
the optimizer state of such a file (a ``KeyError`` on ``base_optimizer_state``).

:meth:`ZeroCheckpoint.load_state_dict` takes back such a file at the same world size
and layout (DeepSpeed's own rule for its files), and also a file bare DeepSpeed wrote
before the engine was wrapped: each view's state is then cut out of the per-partition
state where the view lies (and every view takes its group's ``step``), so that a run
DeepSpeed alone started resumes under flatview exactly. Every check runs before
anything loads and is exchanged (:func:`flatview.comm.refusals.raise_everywhere`), so a
refusal on one rank raises on every rank instead of leaving the others in DeepSpeed's
next collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from flatview.backends.deepspeed_checks import check_version
from flatview.backends.deepspeed_zero import FlatGroups, ZeroLayout
from flatview.comm.refusals import raise_everywhere
from flatview.deferred import Deferred
from flatview.errors import FlatViewError, OptimStateError

if TYPE_CHECKING:
    from flatview.backends.base import Runtime

__all__ = ["FLATVIEW", "ZeroCheckpoint"]

FLATVIEW = "flatview"
"""The key of flatview's part in the ZeRO optimizer's state dict (a ZeRO file's
``optimizer_state_dict``)."""
_VERSION = 1

# DeepSpeed's keys (deepspeed.checkpoint.constants), as its files and scripts spell them.
_STAGE = "zero_stage"
_PARTITION_COUNT = "partition_count"
_DS_VERSION = "ds_version"
_FP32_12 = "single_partition_of_fp32_groups"
_FP32_3 = "fp32_flat_groups"
_PADDINGS = "group_paddings"
_ALIGNMENT = "param_alignment_paddings"
_BASE_12 = "base_optimizer_state"
_BASE_3 = "optimizer_state_dict"

Place = tuple[str, int, int, int]
"""Where one view lies: (original name, master partition, first element, numel)."""


class ZeroCheckpoint:
    """The ZeRO optimizer's ``state_dict`` and ``load_state_dict`` of a wrapped engine
    (see the module docstring). ``runtime`` is read when called (set at install)."""

    def __init__(
        self,
        zero: Any,
        layout: ZeroLayout,
        stage: int,
        group: dist.ProcessGroup | None,
        rank: int,
        world_size: int,
    ) -> None:
        self.zero = zero
        self.layout = layout
        self.stage = stage
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self._runtime: Runtime | None = None

    def install(self, runtime: Runtime) -> None:
        self._runtime = runtime

    # ----------------------------------------------------------------- saving

    def state_dict(self) -> dict[str, Any]:
        """This rank's ZeRO file: DeepSpeed's keys for the fp32 master partitions (as
        ``zero_to_fp32.py`` reads them), and flatview's part (the module docstring)."""
        client = self.zero.optimizer
        masters = self.layout.masters()
        out: dict[str, Any] = {
            _STAGE: self.stage,
            _PARTITION_COUNT: self.zero.partition_count,
            _DS_VERSION: check_version(),
        }
        if isinstance(self.layout, FlatGroups):
            # Without the padding at the end of the last rank's partitions, as DeepSpeed.
            lean = self._lean()
            out[_FP32_12] = [m[:numel] for m, numel in zip(masters, lean, strict=True)]
            out[_PADDINGS] = list(self.zero.groups_padding)
            out[_ALIGNMENT] = self.zero.round_robin_bit16_padding
        else:
            out[_FP32_3] = masters
        out[FLATVIEW] = {
            "version": _VERSION,
            "rank": self.rank,
            "world_size": self.world_size,
            "places": self._places(),
            "params": self._names(client),
            "optimizer": client.state_dict(),
        }
        return out

    # ---------------------------------------------------------------- loading

    def load_state_dict(
        self,
        state_dict_list: Sequence[Any],
        load_optimizer_states: bool = True,
        load_from_fp32_weights: bool = False,
        checkpoint_folder: str | None = None,
        load_serial: Any = None,
        param_shapes: Any = None,
    ) -> None:
        """This rank's ZeRO file into the masters and the engine's optimizer over views:
        one flatview wrote (the same world size and layout) or bare DeepSpeed wrote
        (converted per view)."""
        failure: FlatViewError | None = None
        plan: tuple[list[torch.Tensor], dict[str, Any] | None] | None = None
        try:
            if checkpoint_folder:
                raise OptimStateError(
                    "DeepSpeed's universal checkpoints are not loaded while flatview wraps "
                    "the engine: load the checkpoint it was made from"
                )
            saved = state_dict_list[self.rank]
            if not isinstance(saved, dict):
                raise OptimStateError(f"rank {self.rank} found no ZeRO state in its file")
            plan = self._plan(saved, load_optimizer_states)
        except FlatViewError as err:
            failure = err
        raise_everywhere(failure, bool(load_optimizer_states), self.group, "engine.load_checkpoint")
        assert plan is not None
        partitions, client_state = plan
        with torch.no_grad():
            if isinstance(self.layout, FlatGroups) and not load_from_fp32_weights:
                # DeepSpeed's choice: the masters from the module weights it loaded.
                self.zero._restore_from_bit16_weights()
            else:
                for master, value in zip(self.layout.masters(), partitions, strict=True):
                    master[: value.numel()].copy_(value)
        if client_state is not None:
            self.zero.optimizer.load_state_dict(client_state)

    def _plan(
        self, saved: dict[str, Any], load_optimizer_states: bool
    ) -> tuple[list[torch.Tensor], dict[str, Any] | None]:
        """The partitions and the client's state to load; refused before anything is."""
        masters = self.layout.masters()
        key = _FP32_12 if isinstance(self.layout, FlatGroups) else _FP32_3
        partitions = saved.get(key)
        if not isinstance(partitions, list | tuple):
            raise OptimStateError(
                f"the ZeRO file of rank {self.rank} holds no {key}: was it saved by ZeRO "
                f"stage {self.stage}? (flatview.checkpoint changes stages)"
            )
        if len(partitions) != len(masters):
            raise OptimStateError(
                f"the ZeRO file of rank {self.rank} holds {len(partitions)} master "
                f"partitions, this engine has {len(masters)}: the optimizer's parameter "
                "groups (or ZeRO 3's sub-groups) differ from the run that saved"
            )
        for index, (value, numel) in enumerate(zip(partitions, self._lean(), strict=True)):
            if not isinstance(value, torch.Tensor) or value.numel() != numel:
                found = value.numel() if isinstance(value, torch.Tensor) else type(value).__name__
                raise OptimStateError(
                    f"rank {self.rank}'s saved master partition {index} has {found} "
                    f"elements, this engine's {numel}: saved with another model, parameter "
                    "groups or world size"
                )
        client = self.zero.optimizer
        ours = saved.get(FLATVIEW)
        if ours is None:
            state = self._converted(saved, client) if load_optimizer_states else None
            return list(partitions), state
        self._check_saved_layout(ours)
        if not load_optimizer_states:
            return list(partitions), None
        names = self._names(client)
        if ours["params"] != names:
            raise OptimStateError(
                "the engine's optimizer holds other parameters, or in another order, than "
                f"the one saved: {_first_difference(ours['params'], names)}. Build it as it "
                "was built for the run that saved"
            )
        return list(partitions), ours["optimizer"]

    def _check_saved_layout(self, ours: dict[str, Any]) -> None:
        if ours.get("version") != _VERSION:
            raise OptimStateError(
                f"a ZeRO file of flatview format {ours.get('version')!r}; this flatview "
                f"reads format {_VERSION}"
            )
        if (ours["world_size"], ours["rank"]) != (self.world_size, self.rank):
            raise OptimStateError(
                f"rank {self.rank} of {self.world_size} read the ZeRO file of rank "
                f"{ours['rank']} of {ours['world_size']}: flatview's state in DeepSpeed's "
                "files loads at the world size it was saved at (as DeepSpeed's own); "
                "use flatview.checkpoint to change it"
            )
        places = self._places()
        if ours["places"] != places:
            raise OptimStateError(
                f"rank {self.rank}'s views lie elsewhere in the partitions than when saved: "
                f"{_first_difference(ours['places'], places)}. The model, its parameter "
                "groups or DeepSpeed's configuration changed"
            )

    # ------------------------------------------------------------ conversion

    def _converted(self, saved: dict[str, Any], client: Any) -> dict[str, Any]:
        """Bare DeepSpeed's per-partition state as the state of the client's views."""
        if isinstance(client, Deferred):
            raise OptimStateError(
                "a ZeRO file bare DeepSpeed saved holds the state of the engine's own "
                "optimizer: resume it with that optimizer, not with flatview.optim.Deferred"
            )
        base = saved.get(_BASE_12 if isinstance(self.layout, FlatGroups) else _BASE_3)
        if not isinstance(base, dict) or "state" not in base or "param_groups" not in base:
            raise OptimStateError(
                f"rank {self.rank}'s ZeRO file has neither flatview's state nor bare "
                "DeepSpeed's rigid optimizer state (an elastic checkpoint?)"
            )
        groups = client.param_groups
        if len(base["param_groups"]) != len(groups):
            raise OptimStateError(
                f"bare DeepSpeed saved {len(base['param_groups'])} parameter groups; the "
                f"engine's optimizer has {len(groups)}"
            )
        masters = self.layout.masters()
        positions = self._bare_positions(len(groups))
        state: dict[int, dict[str, Any]] = {}
        param_groups = []
        position = 0
        for saved_group, group in zip(base["param_groups"], groups, strict=True):
            members = []
            for view in group["params"]:
                # A view holding none of this rank's elements takes no state, as one
                # that never had a gradient: there is nothing of it to step.
                entry = None
                if view.numel():
                    master_index, first = self._locate(view, masters)
                    entry = base["state"].get(positions[master_index])
                if entry:
                    state[position] = _cut(entry, masters[master_index], first, view)
                members.append(position)
                position += 1
            hyperparameters = {k: v for k, v in saved_group.items() if k != "params"}
            param_groups.append({**hyperparameters, "params": members})
        return {"state": state, "param_groups": param_groups}

    def _bare_positions(self, groups: int) -> list[int]:
        """Per master partition, its position in bare DeepSpeed's optimizer state."""
        if isinstance(self.layout, FlatGroups):
            return list(range(len(self.layout.masters())))
        owner = self.zero.sub_group_to_group_id
        order = [s for g in range(groups) for s in range(len(owner)) if owner[s] == g]
        positions = [0] * len(order)
        for position, sub_group in enumerate(order):
            positions[sub_group] = position
        return positions

    def _locate(self, view: torch.Tensor, masters: list[torch.Tensor]) -> tuple[int, int]:
        """The master partition ``view`` lies in, and its first element there."""
        storage = view.untyped_storage().data_ptr()
        for index, master in enumerate(masters):
            if master.untyped_storage().data_ptr() != storage:
                continue
            first = int(view.storage_offset() - master.storage_offset())
            if first >= 0 and first + view.numel() <= master.numel():
                return index, first
        raise OptimStateError(
            f"{self._name_of(view)}: the engine's optimizer holds a tensor outside DeepSpeed's "
            "master partitions"
        )

    # ------------------------------------------------------------- the layout

    def _lean(self) -> list[int]:
        """Per master partition, the elements its file holds (ZeRO 1/2 leave out the
        padding at the end of the last rank's)."""
        masters = self.layout.masters()
        if not isinstance(self.layout, FlatGroups):
            return [m.numel() for m in masters]
        paddings = self.zero.groups_padding
        return [m.numel() - pad for m, pad in zip(masters, paddings, strict=True)]

    def _places(self) -> list[Place]:
        """Where each view the engine's optimizer trains lies, in the order it holds
        them: what must not change between saving and loading."""
        masters = self.layout.masters()
        runtime = self._runtime_now()
        places = []
        for index in sorted(self._trained()):
            view = runtime.tensor(index)
            master, first = self._locate(view, masters) if view.numel() else (-1, 0)
            places.append((runtime.name(index), master, first, view.numel()))
        return places

    def _trained(self) -> list[int]:
        runtime = self._runtime_now()
        found = []
        for group in self.zero.optimizer.param_groups:
            for p in group["params"]:
                index = runtime.index_of(p)
                if index is not None:
                    found.append(index)
        return found

    def _names(self, client: Any) -> list[list[list[str]]]:
        """Per optimizer (the client, or those given to its Deferred), per group, the
        names of the parameters it holds."""
        optimizers = client.optimizers if isinstance(client, Deferred) else [client]
        return [
            [[self._name_of(p) for p in group["params"]] for group in optimizer.param_groups]
            for optimizer in optimizers
        ]

    def _name_of(self, tensor: torch.Tensor) -> str:
        runtime = self._runtime_now()
        index = runtime.index_of(tensor)
        if index is None:
            return f"<a tensor of shape {tuple(tensor.shape)}>"
        return runtime.name(index)

    def _runtime_now(self) -> Runtime:
        assert self._runtime is not None, "ZeroCheckpoint used before install()"
        return self._runtime


def _cut(
    entry: dict[str, Any], master: torch.Tensor, first: int, view: torch.Tensor
) -> dict[str, Any]:
    """One view's state, cut out of a partition's state."""
    out: dict[str, Any] = {}
    for key, value in entry.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if value.numel() != master.numel():
                raise OptimStateError(
                    f"bare DeepSpeed's state {key!r} has {value.numel()} elements for a "
                    f"partition of {master.numel()}: not per element"
                )
            piece = value.reshape(-1)[first : first + view.numel()]
            out[key] = piece.reshape(view.shape).clone()
        elif isinstance(value, torch.Tensor):
            out[key] = value.clone()
        else:
            out[key] = value
    return out


def _first_difference(saved: Any, now: Any) -> str:
    flat_saved, flat_now = _flatten(saved), _flatten(now)
    for a, b in zip(flat_saved, flat_now, strict=False):
        if a != b:
            return f"saved {a!r}, now {b!r}"
    return f"saved {len(flat_saved)} entries, now {len(flat_now)}"


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, list) and value and isinstance(value[0], list):
        return [item for part in value for item in _flatten(part)]
    return list(value) if isinstance(value, list) else [value]
