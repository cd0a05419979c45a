"""The parameter table: every original parameter of a wrapped model, once.

:class:`ParamTable` owns the records (:class:`ParamRecord` per original parameter,
:class:`FlatRecord` per flat parameter), their names and model order, and every lookup
the rest of flatview asks of them: a tensor or a name to its index, an index to its
tensor, name or :class:`~flatview.layout.Placement`, a flat parameter to its record, a
unit to its parameters, a skip set to indices. Norms, optimizer state, checkpoints and
the runtime read the table through these, never its fields' insides.

It is built once from the adapter's :class:`~flatview.backends.base.UnitSpec` s (which
also creates the views, not yet shown); :meth:`ParamTable.settle_order` fixes the model
order once the views are shown. The only change afterwards is
:meth:`ParamTable.replace_view`: a parameter set in a view's place becomes the view.
"""

from __future__ import annotations

import functools
import operator
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from flatview.backends.base import FlatSpec, UnitGroup, UnitSpec
from flatview.errors import OptimStateError
from flatview.layout import MaskPlan, Placement
from flatview.skip import SkipResolver, SkipSet
from flatview.views import ViewSet, WrapperViews


@dataclass(frozen=True)
class ParamRecord:
    """One original parameter: a view into a flat parameter, or a plain parameter."""

    index: int
    """Its position in the table (construction order: unit by unit, flat by flat)."""
    names: tuple[str, ...]
    """Its original names, the first one canonical (tied parameters have several)."""
    tensor: nn.Parameter
    """What the user holds: the view, or the plain parameter itself."""
    unit: int
    """The index of the FSDP unit that manages it."""
    flat: int | None
    """The index of the flat parameter it is a segment of; ``None`` for a plain one."""
    segment: int | None
    """Its segment in that flat parameter's layout; ``None`` for a plain one."""
    placement: Placement
    """Where its elements live across ranks (what whole-parameter operations need)."""

    @property
    def name(self) -> str:
        return self.names[0]


@dataclass
class FlatRecord:
    """One flat parameter of the wrapper: its spec, its views, and the original
    parameters its segments are.

    Per-segment flags (``tuple[bool, ...]``, one per entry of :attr:`params`) choose
    segments for a :class:`~flatview.layout.MaskPlan`: the *used* flags of an iteration
    (:class:`flatview.iteration.Iteration`) mark segments whose gradient is reduced, the
    *read* flags segments the forward may read, so the all-gather must bring them.
    """

    index: int
    unit: int
    spec: FlatSpec
    views: ViewSet | WrapperViews
    params: tuple[int, ...]
    """Original-parameter index of each segment."""
    plans: OrderedDict[tuple[bool, ...], MaskPlan] = field(default_factory=OrderedDict)

    PLAN_CACHE = 256
    """Skip sets can vary every step (2**blocks patterns): recent plans only."""

    def plan(self, used: tuple[bool, ...]) -> MaskPlan:
        """The mask plan keeping the segments flagged in ``used`` (cached)."""
        plan = self.plans.get(used)
        if plan is None:
            plan = self.plans[used] = MaskPlan.build(self.spec.layout, used)
            if len(self.plans) > self.PLAN_CACHE:
                self.plans.popitem(last=False)
        else:
            self.plans.move_to_end(used)
        return plan


class ParamTable:
    """Every original parameter of one wrapped model, with its lookups (see the
    module docstring)."""

    def __init__(
        self,
        units: Sequence[UnitSpec],
        model: nn.Module,
        clean_name: Callable[[str], str],
        describe_flat: Callable[[object], tuple[str, tuple[str, ...]] | None],
    ) -> None:
        self.units: tuple[UnitSpec, ...] = tuple(units)
        self.params: list[ParamRecord] = []
        """Every original parameter, by index."""
        self.flats: list[FlatRecord] = []
        """Every flat parameter flatview shows views of, by index."""
        self._flat_of: dict[int, FlatRecord] = {}
        self._clean_name = clean_name
        self._describe_flat = describe_flat
        self._build()
        self.flat_names: list[list[str]] = [
            [self.params[i].name for i in flat.params] for flat in self.flats
        ]
        """Per flat parameter, the canonical name of each segment."""
        # Which original parameter a tensor or a name is: asked per call by the norms and
        # optimizer-state operations (LARC asks every step).
        self._index_of_tensor: dict[int, int] = {id(p.tensor): p.index for p in self.params}
        self._index_of_name: dict[str, int] = {
            name: p.index for p in self.params for name in p.names
        }
        self._plain_views = frozenset(
            self._index_of_tensor[id(plain.param)]
            for unit in self.units
            for plain in unit.plain
            if plain.view
        )
        """Plain parameters that are flatview's own views (``PlainSpec.view``)."""
        self.plain: tuple[int, ...] = tuple(p.index for p in self.params if p.flat is None)
        """Indices of the plain parameters (not segments of a flat parameter)."""
        # Plain parameters whose gradient flatview all-reduces itself (DDP).
        reduced = {id(plain.param) for unit in self.units for plain in unit.plain if plain.reduced}
        self.reduced_plain: tuple[int, ...] = tuple(
            i for i in self.plain if id(self.params[i].tensor) in reduced
        )
        """Indices of the plain parameters whose gradient flatview all-reduces (DDP)."""
        ignored = {id(plain.param) for unit in self.units for plain in unit.plain if plain.ignored}
        self.ignored: frozenset[int] = frozenset(
            p.index for p in self.params if id(p.tensor) in ignored
        )
        """Indices of the plain parameters the wrapper was told to ignore
        (:attr:`~flatview.backends.base.PlainSpec.ignored`): nobody gathers or reduces
        them."""
        self.managed_plain: tuple[int, ...] = tuple(i for i in self.plain if i not in self.ignored)
        """Indices of the plain parameters the wrapper gathers or reduces (or flatview,
        for DDP)."""
        managed_of: list[list[int]] = [[] for _ in self.units]
        ignored_of: list[list[int]] = [[] for _ in self.units]
        for p in self.params:  # one pass: models have thousands of units and tensors
            (ignored_of if p.index in self.ignored else managed_of)[p.unit].append(p.index)
        self.params_of_unit: list[tuple[int, ...]] = [tuple(m) for m in managed_of]
        """Per unit, the indices of the parameters it manages: those its collectives
        gather or reduce."""
        self.ignored_of_unit: list[tuple[int, ...]] = [tuple(m) for m in ignored_of]
        """Per unit, the indices of the parameters under it that the wrapper ignores."""
        self.own_group_params: frozenset[int] = frozenset(
            p.index for p in self.params if self.units[p.unit].group is not None
        )
        """Parameters of units on process groups of their own (experts): only the ranks
        that share such a group must skip alike."""
        self.expert_group: UnitGroup | None = next(
            (unit.group for unit in self.units if unit.group is not None), None
        )
        """This rank's expert group: the one process group all its units on groups of
        their own share (checked at wrap time); ``None`` without such units."""
        self.peers: tuple[tuple[int, ...], ...] | None = (
            None if self.expert_group is None else self.expert_group.peers
        )
        """Per rank of the agreement group, the ranks it shares its units' own groups
        with; ``None`` without such units (:class:`~flatview.backends.base.UnitGroup`)."""
        self._resolver = self._build_resolver(model)
        # Resolved skip sets by the hashable form they were given in (skip sets repeat:
        # the same frozenset object each time lets every later cache hash it once).
        self._resolved: OrderedDict[object, frozenset[int]] = OrderedDict()
        # What is trainable is read afresh every step (requires_grad may change any
        # time), in one pass; the frozen set of the last reading is kept.
        self._frozen: tuple[tuple[bool, ...], frozenset[int]] = ((), frozenset())
        self._tensors = [p.tensor for p in self.params]
        self.order: list[int] = list(range(len(self.params)))
        """Indices in the unwrapped model's ``named_parameters()`` order (see
        :meth:`settle_order`)."""

    # ------------------------------------------------------------------ building

    def _build(self) -> None:
        seen: dict[int, int] = {}
        for unit_index, unit in enumerate(self.units):
            for spec in unit.flats:
                views: ViewSet | WrapperViews
                if spec.wrapper_views is not None:
                    views = WrapperViews(spec.wrapper_views)
                else:
                    views = ViewSet(
                        spec.flat,
                        spec.flat_owner,
                        spec.layout,
                        spec.rank,
                        spec.local_shard(),
                        spec.owners,
                    )
                indices = []
                sharded = spec.layout if spec.layout.world_size > 1 else None
                for segment, (view, names) in enumerate(zip(views.views, spec.names, strict=True)):
                    shape = spec.layout.segments[segment].shape
                    placement = Placement(names[0], shape, sharded, segment, spec.rank)
                    indices.append(len(self.params))
                    self.params.append(
                        ParamRecord(
                            len(self.params),
                            names,
                            view,
                            unit_index,
                            len(self.flats),
                            segment,
                            placement,
                        )
                    )
                flat = FlatRecord(len(self.flats), unit_index, spec, views, tuple(indices))
                self.flats.append(flat)
                self._flat_of[id(spec.flat)] = flat
            for plain in unit.plain:
                if id(plain.param) in seen:
                    continue
                seen[id(plain.param)] = len(self.params)
                placement = Placement(
                    plain.name,
                    plain.shape,
                    plain.layout,
                    rank=plain.rank,
                    padded_shard=plain.layout is not None and plain.padded_shard,
                )
                self.params.append(
                    ParamRecord(
                        len(self.params),
                        (plain.name, *plain.aliases),
                        plain.param,
                        unit_index,
                        None,
                        None,
                        placement,
                    )
                )

    def _build_resolver(self, model: nn.Module) -> SkipResolver:
        modules: dict[str, list[nn.Module]] = {}
        direct: dict[int, list[int]] = {}
        children: dict[int, list[nn.Module]] = {}
        for raw_name, module in model.named_modules(remove_duplicate=False):
            modules.setdefault(self._clean_name(raw_name), []).append(module)
            direct.setdefault(id(module), [])
            children[id(module)] = list(module.children())
        tensors: dict[int, list[int]] = {id(p.tensor): [p.index] for p in self.params}
        # Kept: a parameter set in a view's place becomes the view (replace_view).
        self._tensor_items = tensors
        for flat in self.flats:
            tensors[id(flat.spec.flat)] = list(flat.params)
            for index, owners in zip(flat.params, flat.spec.owners, strict=True):
                for owner in owners:
                    direct[id(owner.module)].append(index)
        # Plain parameters are registered where they always were.
        plain = {id(p.tensor): p.index for p in self.params if p.flat is None}
        for module in model.modules():
            for tensor in module._parameters.values():
                if tensor is not None and id(tensor) in plain:
                    direct[id(module)].append(plain[id(tensor)])
        return SkipResolver(modules, direct, children, [p.names for p in self.params], tensors)

    def settle_order(self, model: nn.Module) -> None:
        """Fix :attr:`order` from a walk of the module tree: with the views shown, it
        meets the parameters in the unwrapped model's order."""
        order = _traversal_order(model, self._clean_name)
        self.order = sorted(
            range(len(self.params)),
            key=lambda i: order.get(self.params[i].name, (len(order), i)),
        )

    def replace_view(self, index: int, param: nn.Parameter) -> None:
        """``param`` was set in the place of parameter ``index``'s view: it is the view
        from now on."""
        old = self.params[index]
        self.params[index] = replace(old, tensor=param)
        self._index_of_tensor.pop(id(old.tensor), None)
        self._index_of_tensor[id(param)] = index
        self._tensor_items.pop(id(old.tensor), None)
        self._tensor_items[id(param)] = [index]
        self._resolved.clear()
        self._tensors[index] = param

    # ------------------------------------------------------------------ lookups

    def __len__(self) -> int:
        return len(self.params)

    def resolve(self, skip: SkipSet) -> frozenset[int]:
        """The indices a skip set stands for (:class:`~flatview.errors.SkipSetError`
        naming anything that is not part of the model); the same set given again (as
        a tuple, set or single item: anything hashable; a list as its tuple) resolves
        from a cache of recent ones."""
        key = _cache_key(skip)
        if key is None:
            return self._resolver.resolve(skip)
        found = self._resolved.get(key)
        if found is None:
            found = self._resolved[key] = self._resolver.resolve(skip)
            if len(self._resolved) > RESOLVED_CACHE:
                self._resolved.popitem(last=False)
        else:
            self._resolved.move_to_end(key)
        return found

    def frozen(self) -> frozenset[int]:
        """Indices of the original parameters that are frozen now (``requires_grad``
        False): one pass over the parameters."""
        # Torch functions off: an attribute of a DTensor (FSDP2) otherwise goes through
        # its dispatch, 3x the time of the read itself, twice a step per parameter.
        with torch._C.DisableTorchFunctionSubclass():
            trainable = tuple(map(_requires_grad, self._tensors))
        last, frozen = self._frozen
        if trainable != last:
            frozen = frozenset(i for i, t in enumerate(trainable) if not t)
            self._frozen = (trainable, frozen)
        return frozen

    @functools.cached_property
    def _empty_somewhere(self) -> bool:
        return any(
            (placement := p.placement).layout is not None
            and not placement.padded_shard
            and placement.numel > 0
            and any(not placement.piece(r).numel for r in range(placement.layout.world_size))
            for p in self.params
        )

    def empty_somewhere(self) -> bool:
        """Whether some rank holds none of some parameter's elements (its view there is
        empty, and gets no gradient): the same answer on every rank."""
        return self._empty_somewhere

    def index_of(self, tensor: object) -> int | None:
        """The index of the original parameter ``tensor`` is (view or plain), if any."""
        return self._index_of_tensor.get(id(tensor))

    def index_of_name(self, name: str) -> int | None:
        """The index of the original parameter named ``name`` (any of its names)."""
        return self._index_of_name.get(name)

    def names(self) -> list[str]:
        """Every name of every original parameter (tied ones under each of theirs)."""
        return list(self._index_of_name)

    def tensor(self, index: int) -> nn.Parameter:
        """Original parameter ``index``: its view, or the plain parameter itself."""
        return self.params[index].tensor

    def name(self, index: int) -> str:
        """The original (canonical) name of parameter ``index``."""
        return self.params[index].name

    def placement_of(self, index: int) -> Placement:
        """Where the elements of parameter ``index`` live across ranks."""
        return self.params[index].placement

    def placement(self, tensor: torch.Tensor, owner: object) -> Placement:
        """Where the elements of original parameter ``tensor`` live across ranks;
        :class:`~flatview.errors.OptimStateError` (naming ``owner``) if it is not one."""
        index = self.index_of(tensor)
        if index is None:
            raise OptimStateError(
                f"a {type(tensor).__name__} of shape {tuple(tensor.shape)} is not an original "
                f"parameter of {owner!r}"
            )
        return self.params[index].placement

    def flat_record(self, flat: object) -> FlatRecord | None:
        """The record of flat parameter ``flat``, if flatview shows views of it."""
        return self._flat_of.get(id(flat))

    def own_group(self, index: int) -> UnitGroup | None:
        """The process group of parameter ``index``'s unit if it is the unit's own (an
        expert unit's), else ``None`` (the adapter's group)."""
        return self.units[self.params[index].unit].group

    def flat_parameter(self, tensor: object) -> tuple[str, tuple[str, ...]] | None:
        """(unit name, original names it holds) if ``tensor`` is one of the model's flat
        parameters, else ``None``: what error messages name it by."""
        record = self._flat_of.get(id(tensor))
        if record is not None:
            unit = self.units[record.unit].name or "<root>"
            return unit, tuple(self.params[i].name for i in record.params)
        return self._describe_flat(tensor)

    def own_view(self, index: int) -> bool:
        """Whether parameter ``index`` is one of flatview's own views (not torch's
        ``use_orig_params`` views, not a parameter the wrapper registered)."""
        param = self.params[index]
        if param.flat is None:
            return index in self._plain_views
        return not self.flats[param.flat].spec.wrapper_views


def _cache_key(skip: SkipSet) -> object | None:
    """A hashable key for ``skip`` made of names and modules only (compared by value and
    by identity), or ``None``: tensors compare elementwise, iterators are used up."""
    if isinstance(skip, (str, nn.Module)):
        return skip
    items: tuple[object, ...] | frozenset[object]
    if isinstance(skip, (list, tuple)):
        items = tuple(skip)
    elif isinstance(skip, (set, frozenset)):
        items = frozenset(skip)
    else:
        return None
    if all(isinstance(i, (str, nn.Module)) for i in items):
        return items
    return None


RESOLVED_CACHE = 256
"""Skip sets whose resolution a table keeps (skip sets may vary every step)."""

_requires_grad = operator.attrgetter("requires_grad")


def _traversal_order(
    model: nn.Module, clean_name: Callable[[str], str]
) -> dict[str, tuple[int, int]]:
    order: dict[str, tuple[int, int]] = {}
    for module_name, module in model.named_modules():
        prefix = clean_name(module_name)
        for attr in module._parameters:
            name = f"{prefix}.{attr}" if prefix else attr
            order.setdefault(name, (len(order), 0))
    return order
