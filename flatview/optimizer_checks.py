"""Checks of the optimizers built over a wrapped model's views: :class:`OptimizerChecks`.

* Parameter groups must train every piece of a parameter alike on every rank:
  :meth:`OptimizerChecks.check_param_groups` compares them across ranks (exact, a
  collective); :meth:`OptimizerChecks.warn_shape_grouping` warns, at an optimizer's first
  step, where this rank alone sees groups decided by the view's shape (``p.ndim``).
* An optimizer must not hold a flat parameter, alone or beside the views inside it
  (:meth:`OptimizerChecks.check_optimizer`, before every first step), nor a tensor
  the wrapper lent inside ``summon_full_params`` / ``unflatten_params`` (it shares the
  storage of the model's parameters without being one: the model no longer reads it).

Registered with :mod:`flatview.wrapped_models`, whose step pre-hook calls the last two.
"""

from __future__ import annotations

import operator
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from flatview import wrapped_models
from flatview.backends.base import Adapter
from flatview.backends.messages import double_count
from flatview.backends.unit_tree import label
from flatview.comm.collectives import gather_objects
from flatview.errors import OptimStateError, ParamGroupError, listing
from flatview.layout import Placement
from flatview.table import ParamTable
from flatview.view_hooks import refuse_view_hooks


class OptimizerChecks:
    """The optimizer checks of one wrapped model (see the module docstring)."""

    def __init__(
        self, table: ParamTable, adapter: Adapter, lent: Callable[[], bool] = lambda: False
    ) -> None:
        self.table = table
        self.adapter = adapter
        self._lent = lent
        """Whether the model is lent to one of the wrapper's operations right now (inside
        ``summon_full_params``, where the wrapper's tensors are the model's)."""
        # Optimizers whose groups were looked at for shape-decided grouping (once each).
        self._shape_checked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._by_name: set[int] = set()
        """Matrices grouped apart by name on purpose (:meth:`exempt_by_name`)."""

    def settled(self) -> bool:
        """See :meth:`flatview.wrapped_models.Watcher.settled`: a step inside a
        summoning is not checked for lent tensors, so the next one is checked again."""
        return not self._lent()

    def exempt_by_name(self, index: int) -> None:
        """Parameter ``index`` (a matrix) is grouped apart by name on purpose: its 1-D
        pieces in a group with the biases are not taken for grouping by ``p.ndim``."""
        self._by_name.add(index)

    def check_param_groups(self, optimizer: torch.optim.Optimizer) -> None:
        """See :meth:`flatview.FlatView.check_param_groups`."""
        signature = self._shape_signature(optimizer)
        local = (self._group_keys(optimizer), signature.suspicious(), bool(signature.whole))
        adapter = self.adapter
        # Every rank of the run: under hybrid sharding replicas too, beyond the group.
        group = adapter.agreement_group
        size = adapter.world_size if adapter.replicas == 1 else dist.get_world_size(group)
        everyone: list[Any] = gather_objects(local, group) if size > 1 else [local]
        gathered = [keys for keys, _, _ in everyone]
        position = self.table.index_of_name
        names = sorted(set().union(*gathered), key=lambda n: position(n) or 0)
        split, partly = [], []
        for name in names:
            keys = [g.get(name) for g in gathered]
            if any(k is None for k in keys):
                held = [r for r, k in enumerate(keys) if k is not None]
                partly.append(f"{name} (ranks {held})")
            elif len(set(keys)) > 1:
                dicts = [dict(key) for key in keys]
                differ = sorted(
                    {k for d in dicts for k in d if any(o.get(k) != d[k] for o in dicts)}
                )
                values = "; ".join(
                    f"rank {r}: " + ", ".join(f"{k}={d.get(k)}" for k in differ)
                    for r, d in enumerate(dicts)
                )
                split.append(f"{name} ({values})")
        # No split, but no rank holds a matrix in its own shape (torch's 1-D pieces with
        # use_orig_params=True): a rule by view shape then groups every matrix like the
        # biases on every rank, consistently; nothing whole contradicts it.
        misled = []
        if not split and not any(whole for _, _, whole in everyone):
            misled = sorted({n for _, names_, _ in everyone for n in names_})
        if misled:
            raise ParamGroupError(
                f"optimizer {type(optimizer).__name__} groups every matrix like the biases "
                f"and norms although it has other groups: {_list(misled)} are 1-D pieces "
                "on every rank here, so a rule by p.ndim (timm's param_groups_weight_decay) "
                "exempts them all, unlike on the unwrapped model. Decide by "
                "FlatView.shape_of(p) and names, e.g. flatview.optim.param_groups(fv, "
                "weight_decay=...)."
            )
        if split or partly:
            found = []
            if split:
                found.append(f"different hyperparameters on different ranks for {_list(split)}")
            if partly:
                found.append(f"held on some ranks only: {_list(partly)}")
            raise ParamGroupError(
                f"optimizer {type(optimizer).__name__}'s parameter groups split original "
                f"parameters across ranks: {'; '.join(found)}. The usual cause is groups "
                "decided by the view's shape: p.ndim <= 1 is true of the empty and partial "
                "views of a matrix, so such a rule also exempts every matrix cut between "
                "ranks, on each of them. Decide by FlatView.shape_of(p) and names, e.g. "
                "flatview.optim.param_groups(fv, weight_decay=...)."
            )

    def _group_keys(self, optimizer: torch.optim.Optimizer) -> dict[str, tuple[Any, ...]]:
        """Per original parameter ``optimizer`` holds, its group's hyperparameters."""
        keys = {}
        for group in optimizer.param_groups:
            key = tuple(sorted((k, repr(v)) for k, v in group.items() if k != "params"))
            for tensor in group["params"]:
                index = self.table.index_of(tensor)
                if index is not None:
                    keys[self.table.name(index)] = key
        return keys

    def _shape_signature(self, optimizer: torch.optim.Optimizer) -> Signature:
        """How ``optimizer``'s groups on this rank treat matrices and their pieces."""
        sig = Signature(groups=len({hyperparameters(g) for g in optimizer.param_groups}))
        for group in optimizer.param_groups:
            key = hyperparameters(group)
            for tensor in group["params"]:
                index = self.table.index_of(tensor)
                if index is None:
                    continue
                shape = self.table.placement_of(index).shape
                if len(shape) <= 1:
                    sig.low.add(key)
                    continue
                sig.matrices.add(key)
                if tuple(tensor.shape) == shape:
                    sig.whole.add(key)
                elif tensor.numel() and index not in self._by_name:
                    sig.pieces.append((self.table.name(index), key))
        return sig

    def warn_shape_grouping(self, optimizer: torch.optim.Optimizer) -> None:
        """At an optimizer's first step: warn if its groups look decided by view shape.

        What this rank alone can see: a matrix's piece whose local tensor has lost the
        matrix's shape (partial views are 1-D) sits in a group like those of ``ndim <= 1``
        parameters, while the whole matrices this rank holds get other hyperparameters;
        or, where no local tensor keeps a matrix's shape (torch ``use_orig_params=True``
        shards into 1-D pieces), every matrix is grouped like the biases although other
        groups exist. A rule by name or original shape treats pieces and whole matrices
        alike, so it does neither (unless it sets apart by name exactly the matrices cut
        here: :meth:`check_param_groups` tells)."""
        if optimizer in self._shape_checked:
            return
        self._shape_checked.add(optimizer)
        suspicious = self._shape_signature(optimizer).suspicious()
        if suspicious:
            warnings.warn(
                f"optimizer {type(optimizer).__name__} puts this rank's pieces of the "
                f"matrices {listing(suspicious)} (1-D views) in a parameter group "
                "like the biases and norms, not like whole matrices: groups decided by "
                "p.ndim (timm's param_groups_weight_decay, create_optimizer_v2) see the "
                "piece, not the parameter, and train it unlike the unwrapped model. Decide "
                "by FlatView.shape_of(p) and names: flatview.optim.param_groups(fv, "
                "weight_decay=...). If this grouping by name is intended, "
                "FlatView.check_param_groups(optimizer) confirms it.",
                stacklevel=4,
            )

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse an optimizer that holds a flat parameter (beside its views: double
        counting; alone: it would step skipped parameters too), and what the backend
        refuses."""
        self.adapter.check_optimizer(optimizer)
        table = self.table
        if type(optimizer).__name__ == _ZERO:
            self._refuse_zero_over_shards(optimizer)
        if type(optimizer).__name__ in _WHOLE_TENSOR_MATH:
            self._refuse_whole_tensor_math(optimizer)
        refuse_view_hooks(table, self.adapter, self._held(optimizer))
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for flat in table.flats:
            if id(flat.spec.flat) not in held:
                continue
            unit = label(table.units[flat.unit].name)
            for index in flat.params:
                if id(table.tensor(index)) in held:
                    raise double_count(
                        type(optimizer).__name__, unit, view=table.name(index), or_flats=True
                    )
            # An optimizer over a flat parameter steps all of it: it cannot leave skipped
            # parameters alone (weight decay, momentum on zero gradients), and gradients
            # live in the views while the model is wrapped.
            names = ", ".join(repr(table.name(i)) for i in flat.params[:4])
            more = ", ..." if len(flat.params) > 4 else ""
            raise OptimStateError(
                f"optimizer {type(optimizer).__name__} holds the flat parameter of FSDP "
                f"unit {unit!r} (holding {names}{more}): it would step every parameter in "
                "it, skipped ones too, and it does not see gradients zeroed through the "
                "views. Build optimizers from views (submodule.parameters() or "
                "FlatView.parameters()), or call FlatView.unwrap() to train on bare FSDP. "
                "(model.parameters() shows flat parameters from a forward until its "
                "backward, or until the next forward where no backward came.)"
            )
        if not self._lent():
            foreign = [
                p
                for group in optimizer.param_groups
                for p in group["params"]
                if table.index_of(p) is None
            ]
            if foreign:
                self._refuse_lent_tensors(optimizer, foreign)
                self._refuse_added_parameters(optimizer, foreign)

    def _refuse_added_parameters(
        self, optimizer: torch.optim.Optimizer, foreign: list[torch.Tensor]
    ) -> None:
        """Parameters registered on the model after the wrap (a module added, adapters
        injected): the wrapper did not take them in when it was built, nor flatview when
        it wrapped, so nobody reduces their gradients and each rank trains its own copy
        (measured before this check: 0.08 apart after 3 steps; the bare wrappers leave
        them unreduced alike).
        Known as tensors the optimizer holds that are none of the model's parameters
        flatview knows (``foreign``) but are registered in its tree. Every rank holds the
        same tree, so every rank raises, before the step."""
        held = {id(p) for p in foreign}
        root = next(unit for unit in self.table.units if unit.is_root)
        added = [
            repr(self.adapter.clean_name(name))
            for name, param in root.module.named_parameters()
            if id(param) in held
        ]
        if added:
            raise OptimStateError(
                f"optimizer {type(optimizer).__name__} holds parameters registered on the "
                f"model after it was wrapped ({_list(added, 4)}): neither the wrapper nor "
                "flatview reduces their gradients, so each rank would train its own copy. "
                "Add them before wrapping (before DDP or FSDP too), then call "
                "flatview.wrap"
            )

    def _refuse_lent_tensors(
        self, optimizer: torch.optim.Optimizer, foreign: list[torch.Tensor]
    ) -> None:
        """An optimizer built inside ``summon_full_params`` or ``unflatten_params`` (the
        first seed's example) holds the tensors the wrapper put on the submodules for the
        length of the context: views of its full or flat buffers, which the model no
        longer reads once the context ends, and which get no gradient. Its steps would
        train nothing, on bare FSDP too. Known by storage: such a tensor shares the
        storage of the model's parameters without being one of them. Looked at only for
        tensors that are not the model's parameters (``foreign``; other models' are not,
        and share none of its storage)."""
        units = self._units_by_storage()
        for tensor in foreign:
            unit = units.get(storage_key(tensor))
            if unit is None:
                continue
            raise wrapped_models.lent_tensor_error(
                optimizer,
                f"a tensor of shape {tuple(tensor.shape)} that shares the storage of FSDP "
                f"unit {unit!r}'s parameters without being one of the model's parameters",
            )

    def _units_by_storage(self) -> dict[int | None, str]:
        """The name of the unit whose parameters or flat buffers (every tensor a flat
        parameter carries: its shard, its unsharded buffer) live in each storage."""
        table = self.table
        units: dict[int | None, str] = {}
        for param in table.params:
            units[storage_key(param.tensor)] = label(table.units[param.unit].name)
        for flat in table.flats:
            name = label(table.units[flat.unit].name)
            buffers = [flat.spec.flat, *vars(flat.spec.flat).values()]
            for buffer in buffers:
                if isinstance(buffer, torch.Tensor):
                    units[storage_key(buffer)] = name
        units.pop(None, None)
        return units

    def _held(self, optimizer: torch.optim.Optimizer) -> list[int]:
        """Indices of the model's parameters ``optimizer`` holds, in its order."""
        found = (self.table.index_of(p) for g in optimizer.param_groups for p in g["params"])
        return [index for index in found if index is not None]

    def _first_held(
        self, optimizer: torch.optim.Optimizer, where: Callable[[Placement], bool]
    ) -> str | None:
        """The name of the first parameter ``optimizer`` holds whose placement is
        ``where``, if any."""
        table = self.table
        found = (i for i in self._held(optimizer) if where(table.placement_of(i)))
        index = next(found, None)
        return None if index is None else table.name(index)

    def _refuse_zero_over_shards(self, optimizer: torch.optim.Optimizer) -> None:
        """torch's ``ZeroRedundancyOptimizer`` steps each parameter on one owner rank and
        broadcasts it to the others: it assumes every rank holds the same tensor. A view
        of a sharded parameter holds other elements on each rank, so the broadcasts
        differ in size across ranks (gloo aborted) or overwrite other ranks' pieces.
        Decided from the model's layout alone: every rank raises, before the step's
        first collective."""
        name = self._first_held(optimizer, operator.attrgetter("sharded"))
        if name is not None:
            raise OptimStateError(
                f"{_ZERO} over the views of a sharded model (such as {name!r}): it "
                "broadcasts each parameter from the rank that steps it, but each rank's "
                "view holds other elements of the parameter. The wrapper already shards "
                "the optimizer state with the parameters: use the plain optimizer "
                f"({_ZERO}'s optimizer_class) over the views"
            )

    def _refuse_whole_tensor_math(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer known to compute per-parameter quantities over the whole tensor
        (:data:`_WHOLE_TENSOR_MATH`): over a view that holds a piece of its parameter on
        some rank, it takes the piece's norms or statistics for the parameter's, a
        different training in silence. Decided from the layout (whether any rank holds
        a piece), so every rank raises alike, before the step."""
        if type(optimizer).__module__.startswith("flatview"):
            return  # flatview's own (LARC) take whole-parameter norms
        name = self._first_held(optimizer, operator.attrgetter("has_partial_piece"))
        if name is not None:
            raise OptimStateError(
                f"optimizer {type(optimizer).__name__} computes per-parameter norms or "
                f"statistics over the whole tensor, but {name!r} is split across ranks: "
                "over its views each rank would take its piece's for the parameter's. Use "
                "an elementwise optimizer, flatview.optim.LARC, the norms of "
                "FlatView.param_norms / tensor_norms (docs: recipes, per-parameter norms), "
                "or flatview.optim.Whole for optimizers over whole matrices"
            )


_WHOLE_TENSOR_MATH = frozenset(
    {
        "Adafactor",
        "FusedLAMB",
        "FusedLamb",
        "FusedNovoGrad",
        "LAMB",
        "LAMB8bit",
        "LAMB32bit",
        "LARC",
        "LARS",
        "LARS8bit",
        "LARS32bit",
        "Lamb",
        "Lars",
        "NovoGrad",
        "NvNovoGrad",
        "OnebitLamb",
        "SOAP",
        "Shampoo",
    }
)
"""Optimizer classes (torch's ``Adafactor``; timm's, apex's, bitsandbytes', DeepSpeed's,
torch-optimizer's) known to compute whole-tensor quantities per parameter: LAMB's and
LARS's trust ratios, NovoGrad's per-layer gradient norms, Adafactor's factored moments,
Shampoo's and SOAP's preconditioners. Known by name: flatview imports none of them."""

_ZERO = "ZeroRedundancyOptimizer"
"""torch's (``torch.distributed.optim``), known by name: flatview does not import it."""


@dataclass
class Signature:
    """One rank's view of an optimizer's groups: the hyperparameters (keys) of groups
    holding ``ndim <= 1`` originals, matrices, matrices in their own shape, and the
    matrices of which this rank holds a piece that lost the shape."""

    groups: int
    low: set[str] = field(default_factory=set)
    matrices: set[str] = field(default_factory=set)
    whole: set[str] = field(default_factory=set)
    pieces: list[tuple[str, str]] = field(default_factory=list)

    def suspicious(self) -> list[str]:
        """Pieces grouped as a rule by the view's ndim would group them."""
        if self.whole:
            return [n for n, k in self.pieces if k in self.low and k not in self.whole]
        if self.groups > 1 and self.matrices <= self.low:
            return [n for n, _ in self.pieces]
        return []


def storage_key(tensor: torch.Tensor) -> int | None:
    """Which storage ``tensor`` lives in, the same across resizes (FSDP frees its
    unsharded buffers by resizing their storage to nothing); ``None`` for tensors
    without one of their own (tensor subclasses such as ``DTensor``)."""
    try:
        return int(tensor.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return None


def hyperparameters(group: dict[str, Any]) -> str:
    """A parameter group's hyperparameters (all but its parameters), comparable across
    groups and ranks."""
    return repr(sorted((k, repr(v)) for k, v in group.items() if k != "params"))


def _list(items: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")
