"""The backend-neutral core: the :class:`FlatView` handle and its lifecycle.

A FlatView owns the table of original parameters (views and plain parameters), shows
or hides the views as the wrapper's phase requires, resolves and checks skip sets, and
plans the masked gradient reduction. A backend adapter (:mod:`flatview.backends`)
calls it at the wrapper's lifecycle points; it never calls the wrapper itself.

Phases
------
``IDLE``
    Between passes. Views are registered on the original submodules; flat
    parameters are hidden from their owners.
``COMPUTING``
    A forward (and its backward) is in flight. Views stepped aside: the wrapper sets
    its own tensors under the original names. Entered at the first unit forward of an
    iteration, left when the backward ends (or at once after a forward without grad).
``LENT``
    A wrapper operation that rebuilds module attributes runs (``state_dict``,
    ``summon_full_params``, ``load_state_dict``, ``.to()``): views stepped aside.
``DETACHED``
    After :meth:`FlatView.unwrap`: the model is plain FSDP again.
"""

from __future__ import annotations

import contextlib
import enum
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from flatview import norms as _norms
from flatview import optim_state
from flatview.backends.base import Adapter, FlatSpec, UnitSpec
from flatview.comm.agreement import Agreement, fingerprint
from flatview.comm.gather import masked_all_gather, masking_pays
from flatview.comm.ledger import Ledger
from flatview.comm.reduce import MaskedReducer, Strategy
from flatview.errors import (
    DoubleCountError,
    OptimStateError,
    SkippedParameterUsedError,
    StateError,
    WrapError,
)
from flatview.layout import MaskPlan, Placement
from flatview.skip import SkipResolver, SkipSet
from flatview.stats import StepStats
from flatview.views import ViewSet, WrapperViews


class Phase(enum.Enum):
    """Where the wrapped model is in its lifecycle (see the module docstring)."""

    IDLE = "idle"
    COMPUTING = "computing"
    LENT = "lent"
    DETACHED = "detached"


@dataclass(frozen=True)
class _Param:
    """One original parameter: a view into a flat parameter, or a plain parameter."""

    index: int
    names: tuple[str, ...]
    tensor: nn.Parameter
    unit: int
    flat: int | None
    segment: int | None
    placement: Placement
    """Where its elements live across ranks (what whole-parameter operations need)."""

    @property
    def name(self) -> str:
        return self.names[0]


@dataclass
class _Flat:
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
        plan = self.plans.get(used)
        if plan is None:
            plan = self.plans[used] = MaskPlan.build(self.spec.layout, used)
            if len(self.plans) > self.PLAN_CACHE:
                self.plans.popitem(last=False)
        else:
            self.plans.move_to_end(used)
        return plan


@dataclass(frozen=True)
class _Iteration:
    """The skip set bound to one forward/backward, and what it means per flat parameter."""

    skipped: frozenset[int]
    used: tuple[tuple[bool, ...], ...]
    """Per flat parameter, per segment: trained in this iteration (not skipped, not
    frozen): its gradient is reduced."""
    read: tuple[tuple[bool, ...], ...]
    """Per flat parameter, per segment: not skipped, so the forward may read it."""
    skipped_units: frozenset[int]
    step: int
    plain_used: frozenset[int]
    """Plain parameters trained in this iteration (not skipped, not frozen)."""


@dataclass(frozen=True)
class _StatsSource:
    """What :attr:`FlatView.stats` of one backward is computed from."""

    skipped: frozenset[int]
    units_skipped: int
    ledger_bytes: dict[str, int]
    ledger_calls: dict[str, int]
    synced: bool


def _skipped_used(name: str) -> SkippedParameterUsedError:
    return SkippedParameterUsedError(
        f"parameter {name!r} is declared skipped for this step but received a "
        "gradient: the model used it. Remove it from the skip set or don't use it."
    )


def _plain_guard(
    owner: weakref.ref[FlatView], index: int, name: str
) -> Callable[[torch.Tensor], None]:
    """The persistent guard hook of plain parameter ``index`` (weakly bound: a
    parameter that outlives its FlatView must not keep it alive)."""

    def refuse(grad: torch.Tensor) -> None:
        fv = owner()
        if fv is None or fv.phase is not Phase.COMPUTING:
            return
        iteration = fv._iteration
        if iteration is not None and index in iteration.skipped:
            raise _skipped_used(name)

    return refuse


_live: weakref.WeakSet[FlatView] = weakref.WeakSet()
_wrapped: weakref.WeakKeyDictionary[nn.Module, FlatView] = weakref.WeakKeyDictionary()
_optimizer_hook: Any = None


class FlatView:
    """Original-parameter views and skip sets over one FSDP-wrapped model.

    Made by :func:`flatview.wrap`. Each original parameter of the model is reachable
    again, on its original submodule under its original name, as an ``nn.Parameter``
    that aliases this rank's shard of the flat parameter (a *view*); optimizers built
    from ``submodule.parameters()`` update the shard in place. :meth:`step` declares the
    parameters a step does not use, which then get no gradient and no communication.
    """

    def __init__(
        self,
        model: nn.Module,
        adapter: Adapter,
        *,
        check_skip_agreement: bool = True,
        reduce_strategy: Strategy = Strategy.AUTO,
    ) -> None:
        self.model = model
        self.adapter = adapter
        self.check_skip_agreement = check_skip_agreement
        self.ledger = Ledger()
        self.reducer = MaskedReducer(
            adapter.group,
            adapter.rank,
            adapter.world_size,
            self.ledger,
            adapter.bucket_numel,
            reduce_strategy,
        )
        self.phase = Phase.IDLE
        """Where the model is in its lifecycle: views are registered only in ``IDLE``."""
        # What the last backward's StepStats are computed from, when first asked for:
        # most steps nobody reads them.
        self._stats_source: _StatsSource | None = None
        self._stats: StepStats | None = None

        self._units: list[UnitSpec] = adapter.describe()
        check_not_wrapped([unit.module for unit in self._units])
        self._params: list[_Param] = []
        self._flats: list[_Flat] = []
        self._flat_of: dict[int, _Flat] = {}
        self._build_tables()
        # Which original parameter a tensor or a name is: asked per call by the norms and
        # optimizer-state operations (LARC asks every step).
        self._index_of_tensor: dict[int, int] = {id(p.tensor): p.index for p in self._params}
        self._index_of_name: dict[str, int] = {
            name: p.index for p in self._params for name in p.names
        }
        self._plain: tuple[int, ...] = tuple(p.index for p in self._params if p.flat is None)
        # Plain parameters whose gradient flatview all-reduces itself (DDP).
        reduced = {id(plain.param) for unit in self._units for plain in unit.plain if plain.reduced}
        self._reduced_plain: tuple[int, ...] = tuple(
            i for i in self._plain if id(self._params[i].tensor) in reduced
        )
        self._params_of_unit: list[tuple[int, ...]] = [
            tuple(p.index for p in self._params if p.unit == u) for u in range(len(self._units))
        ]

        self._step_skip: frozenset[int] | None = None
        self._agreement: Agreement | None = None
        """The step's skip-set check, while it runs alongside the forward."""
        self._step_count = 0
        self._iteration: _Iteration | None = None
        # Per flat parameter, segments used in the backwards since the last synced one
        # (gradient accumulation under no_sync()).
        self._window: list[tuple[bool, ...]] | None = None
        self._guards: list[torch.utils.hooks.RemovableHandle] = []
        # Per plain parameter index: its guard hook, kept from step to step.
        self._plain_guards: dict[int, torch.utils.hooks.RemovableHandle] = {}
        self._resolver = self._build_resolver()

        for flat in self._flats:
            flat.views.show()
            flat.views.pull_grads(used=None)
        # With the views shown, a walk of the module tree meets the parameters in the
        # unwrapped model's order.
        order = _traversal_order(self.model, self.adapter.clean_name)
        self._order = sorted(
            range(len(self._params)),
            key=lambda i: order.get(self._params[i].name, (len(order), i)),
        )
        for unit in self._units:
            _wrapped[unit.module] = self
        _live.add(self)
        _install_optimizer_hook()
        adapter.install(self)

    # ------------------------------------------------------------------ tables

    def _build_tables(self) -> None:
        seen: dict[int, int] = {}
        for unit_index, unit in enumerate(self._units):
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
                    indices.append(len(self._params))
                    self._params.append(
                        _Param(
                            len(self._params),
                            names,
                            view,
                            unit_index,
                            len(self._flats),
                            segment,
                            placement,
                        )
                    )
                flat = _Flat(len(self._flats), unit_index, spec, views, tuple(indices))
                self._flats.append(flat)
                self._flat_of[id(spec.flat)] = flat
            for plain in unit.plain:
                if id(plain.param) in seen:
                    continue
                seen[id(plain.param)] = len(self._params)
                placement = Placement(
                    plain.name,
                    plain.shape,
                    plain.layout,
                    rank=plain.rank,
                    whole_shard=plain.layout is not None,
                )
                self._params.append(
                    _Param(
                        len(self._params),
                        (plain.name, *plain.aliases),
                        plain.param,
                        unit_index,
                        None,
                        None,
                        placement,
                    )
                )

    def _build_resolver(self) -> SkipResolver:
        modules: dict[str, list[nn.Module]] = {}
        direct: dict[int, list[int]] = {}
        children: dict[int, list[nn.Module]] = {}
        for raw_name, module in self.model.named_modules(remove_duplicate=False):
            modules.setdefault(self.adapter.clean_name(raw_name), []).append(module)
            direct.setdefault(id(module), [])
            children[id(module)] = list(module.children())
        tensors: dict[int, list[int]] = {id(p.tensor): [p.index] for p in self._params}
        for flat in self._flats:
            tensors[id(flat.spec.flat)] = list(flat.params)
            for index, owners in zip(flat.params, flat.spec.owners, strict=True):
                for owner in owners:
                    direct[id(owner.module)].append(index)
        # Plain parameters are registered where they always were.
        plain = {id(p.tensor): p.index for p in self._params if p.flat is None}
        for module in self.model.modules():
            for tensor in module._parameters.values():
                if tensor is not None and id(tensor) in plain:
                    direct[id(module)].append(plain[id(tensor)])
        return SkipResolver(modules, direct, children, [p.names for p in self._params], tensors)

    # -------------------------------------------------------------- public API

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Every original parameter once, as a view or plain parameter, under the name
        the unwrapped model's ``named_parameters()`` gives it (tied parameters under
        their first name)."""
        for index in self._order:
            param = self._params[index]
            yield param.name, param.tensor

    def parameters(self) -> Iterator[nn.Parameter]:
        """Every original parameter once (see :meth:`named_parameters`)."""
        for _, tensor in self.named_parameters():
            yield tensor

    def param_norms(
        self, params: _norms.ParamSelection = None, *, norm_type: float = 2.0
    ) -> dict[str, torch.Tensor]:
        """The norm of each whole original parameter, computed from every rank's piece.

        ``view.norm()`` on a partial view is the norm of this rank's piece; this is the
        norm of the parameter, what LARC, LAMB or weight-norm logging need. Each rank
        takes the norm of its piece and one all-reduce (a sum of ``|x|**p``, or a
        maximum for ``inf``) combines those of all requested parameters.

        A collective: every rank must call it with the same arguments, between
        iterations. Arguments that are not this model's parameters, or an unsupported
        ``norm_type``, raise before the collective; ranks that pass different
        ``params`` or ``norm_type`` all raise after it, naming the parameters.

        Args:
            params: views or parameters of this model, or their names (as in
                :meth:`named_parameters`; e.g. an optimizer's ``group["params"]``);
                ``None`` for every original parameter.
            norm_type: ``p`` of the p-norm (any positive number), or ``inf``.

        Returns:
            ``{name: norm}`` in model order, under the names of :meth:`named_parameters`;
            each norm a 0-dim tensor on the wrapper's device, float32 (float64 for
            float64 parameters), the same on every rank.

        Raises:
            flatview.NormError: ``params`` holds something that is not an original
                parameter of the model (a flat parameter, a gradient, an unknown name),
                ``norm_type`` is not positive, or ranks disagree on the arguments.
            StateError: called while the model computes or inside a wrapper operation.
        """
        return _norms.param_norms(self, params, norm_type)

    def grad_norms(
        self, params: _norms.ParamSelection = None, *, norm_type: float = 2.0
    ) -> dict[str, torch.Tensor | None]:
        """The norm of each whole original parameter's gradient, from every rank's piece:
        for per-parameter gradient clipping, LARC and LAMB trust ratios.

        Like :meth:`param_norms` (one all-reduce, a collective with the same arguments
        on every rank), over ``.grad``. A parameter without a gradient (skipped in this
        step, frozen, or zeroed with ``set_to_none=True``) gets ``None``, on every
        rank: skip sets agree across ranks. A rank that holds no element of a parameter
        counts as holding zeros, whether its ``grad`` is an empty tensor (flatview's
        empty views) or ``None`` (torch's views with ``use_orig_params=True``).

        Args:
            params: as for :meth:`param_norms`.
            norm_type: as for :meth:`param_norms`.

        Returns:
            ``{name: norm or None}`` in model order.

        Raises:
            flatview.NormError: as for :meth:`param_norms`.
            StateError: as for :meth:`param_norms`, and inside a ``no_sync()`` window,
                where gradients are not reduced yet.
        """
        return _norms.grad_norms(self, params, norm_type)

    def tensor_norms(
        self,
        tensors: _norms.TensorsByParam,
        *,
        norm_type: float = 2.0,
    ) -> dict[str, torch.Tensor | None]:
        """The norm of whole tensors laid out like original parameters, from the pieces
        laid out like this rank's views: optimizer state (``exp_avg``) or an update,
        as LAMB's trust ratio ``||w|| / ||update||`` needs.

        Like :meth:`param_norms` (one all-reduce, a collective with the same keys on
        every rank).

        Args:
            tensors: ``{parameter or name: tensor}``, each tensor with as many elements as
                the view on this rank (e.g. ``optimizer.state[view]["exp_avg"]``), or
                ``None`` where this rank has none (its elements count as zeros).
            norm_type: as for :meth:`param_norms`.

        Returns:
            ``{name: norm}`` in model order; ``None`` where no rank gave a tensor.

        Raises:
            flatview.NormError: as for :meth:`param_norms`; also when on some rank
                a tensor has neither the view's number of elements nor the parameter's.
            StateError: as for :meth:`param_norms`.
        """
        return _norms.tensor_norms(self, tensors, norm_type)

    def resolve(self, skip: SkipSet) -> list[str]:
        """The original names of the parameters a skip set stands for, in model order."""
        indices = self._resolver.resolve(skip)
        return [self._params[i].name for i in self._order if i in indices]

    @contextlib.contextmanager
    def step(self, skip: SkipSet = None, *, check: bool | None = None) -> Iterator[FlatView]:
        """Declare the parameters one iteration does not use.

        Wrap one iteration's forward and backward. Parameters in ``skip`` get no
        gradient (``grad`` stays ``None`` if it was, so optimizers leave them alone) and
        cost no communication: partly skipped flat parameters reduce only their used
        segments, and FSDP units whose parameters are all skipped are neither gathered
        nor reduced (the model must not call them).

        Args:
            skip: modules, views, flat parameters or original names (parameter names or
                module paths); see :mod:`flatview.skip`. Must be the same on every rank.
            check: verify with one tiny all-gather that every rank passed the same skip
                set, raising :class:`~flatview.errors.SkipSetMismatchError` on all ranks
                otherwise; defaults to the ``check_skip_agreement`` given to ``wrap``.
        """
        if self._step_skip is not None:
            raise StateError("FlatView.step() contexts cannot be nested")
        if self.phase is Phase.DETACHED:
            raise StateError("FlatView.step() after unwrap()")
        if self.phase is Phase.LENT:
            raise StateError("FlatView.step() entered inside a wrapper operation")
        skipped = self._resolver.resolve(skip)
        self.ledger.reset()
        if self.check_skip_agreement if check is None else check:
            agreement = Agreement(
                fingerprint(skipped),
                lambda: [self._params[i].name for i in sorted(skipped)],
                self.adapter.group,
                self.adapter.device,
                self.ledger,
            )
            if self.adapter.overlaps_agreement:
                self._agreement = agreement
            else:
                agreement.settle()
        self._step_count += 1
        self._step_skip = skipped
        try:
            yield self
        finally:
            self._step_skip = None
            self.settle_agreement()

    def settle_agreement(self) -> None:
        """Wait for the skip-set check of the step in flight if it still runs (adapters
        that overlap it with the forward call this before their first collective),
        raising :class:`~flatview.errors.SkipSetMismatchError` on every rank if ranks
        disagree."""
        agreement, self._agreement = self._agreement, None
        if agreement is not None:
            agreement.settle()

    # --------------------------------------------------------- adapter calls

    def begin_compute(self, outermost: bool) -> None:
        """A unit's forward is about to run: views step aside, the skip set binds.

        ``outermost`` says it is the root unit's forward: a new iteration. When one starts
        while the last is still computing, that one's forward was never followed by a
        backward (a validation pass with autograd on); gradients zeroed since must still
        reach the flat parameters. Inner units start again during backward when
        activation checkpointing recomputes them, and must not touch gradients then.
        """
        if self.phase is Phase.LENT:
            raise StateError(
                "a forward pass started inside a wrapper operation (state_dict, "
                "summon_full_params, ...): finish that first"
            )
        if self.phase is Phase.IDLE:
            self._push_grads()
            for flat in self._flats:
                flat.views.hide()
            self.phase = Phase.COMPUTING
            self._bind_iteration()
        elif outermost:
            self._push_grads()
            if self._iteration is None or self._iteration.step != self._step_count:
                self._bind_iteration()

    def _push_grads(self) -> None:
        # Inside a no_sync() window the flat parameters hold unsharded accumulated
        # gradients that no view can describe; views catch up at the synced backward.
        if self._window is None:
            for flat in self._flats:
                flat.views.push_grads()

    def _bind_iteration(self) -> None:
        skipped = self._step_skip or frozenset()
        if self._step_skip is None:
            self.ledger.reset()
        # A frozen view (requires_grad False) is not trained: like a skipped one, its
        # gradient is neither communicated nor handed out. Unlike a skipped one, the
        # model may still use it.
        params = self._params
        used = tuple(
            tuple(i not in skipped and params[i].tensor.requires_grad for i in flat.params)
            for flat in self._flats
        )
        read = tuple(tuple(i not in skipped for i in flat.params) for flat in self._flats)
        skipped_units = frozenset(
            u
            for u, params in enumerate(self._params_of_unit)
            if params and skipped.issuperset(params)
        )
        plain_used = frozenset(
            i for i in self._plain if i not in skipped and params[i].tensor.requires_grad
        )
        self._iteration = _Iteration(
            skipped, used, read, skipped_units, self._step_count, plain_used
        )

    def check_unit_forward(self, unit: int) -> None:
        """Refuse to run a non-root unit whose parameters are all declared skipped:
        its all-gather would be wasted and its gradient dropped."""
        iteration = self._iteration
        if iteration is None or unit not in iteration.skipped_units or self._units[unit].is_root:
            return
        raise SkippedParameterUsedError(
            f"FSDP unit {self._units[unit].name!r} is declared skipped for this step, but "
            "its forward was called. Don't call skipped units (skipping them is what saves "
            "their communication), or don't put them in the skip set."
        )

    def unit_skipped(self, unit: int) -> bool:
        """Whether every parameter of ``unit`` is skipped in the current iteration."""
        return self._iteration is not None and unit in self._iteration.skipped_units

    def _skipping(self, flat: nn.Parameter) -> tuple[_Iteration, _Flat] | None:
        """The iteration in flight and ``flat``'s record, if anything is skipped now."""
        iteration = self._iteration
        record = self._flat_of.get(id(flat))
        if self.phase is not Phase.COMPUTING or iteration is None or record is None:
            return None
        return (iteration, record) if iteration.skipped else None

    def skipped_segments(self, flat: nn.Parameter) -> list[tuple[int, str]]:
        """(segment, name) of the segments of ``flat`` skipped in the current iteration."""
        found = self._skipping(flat)
        if found is None:
            return []
        iteration, record = found
        return [
            (segment, self._params[index].name)
            for segment, index in enumerate(record.params)
            if index in iteration.skipped
        ]

    def guard_skipped(self, flat: nn.Parameter) -> None:
        """Hook the compute tensors the wrapper just set on the submodules for the
        skipped parameters of ``flat``: if the model uses one, backward raises."""
        record = self._flat_of.get(id(flat))
        if record is None:
            return
        for segment, name in self.skipped_segments(flat):
            seen: set[int] = set()
            for owner in record.spec.owners[segment]:
                # Wrappers set plain tensors, which land in the instance dict while the
                # views are stepped aside; torch with use_orig_params registers its own.
                tensor = owner.module.__dict__.get(owner.attr)
                if tensor is None:
                    tensor = owner.module._parameters.get(owner.attr)
                if isinstance(tensor, torch.Tensor) and id(tensor) not in seen:
                    seen.add(id(tensor))
                    self._guard(tensor, name)

    def _guard(self, tensor: torch.Tensor, name: str) -> None:
        def refuse(grad: torch.Tensor) -> None:
            raise _skipped_used(name)

        if tensor.requires_grad:
            self._guards.append(tensor.register_hook(refuse))

    def guard_skipped_plain(self) -> None:
        """Hook the skipped plain parameters (registered as they are, not flattened):
        if the model uses one in this iteration, backward raises.

        Unlike the compute tensors of flat parameters, which the wrapper makes anew each
        forward, plain parameters persist: each gets one hook, the first time it is
        skipped, that checks the iteration it fires in (registering and removing hooks
        on every skipped parameter every step cost more than a check per gradient)."""
        iteration = self._iteration
        if iteration is None:
            return
        for index in iteration.skipped:
            if index in self._plain_guards:
                continue
            param = self._params[index]
            if param.flat is None and param.tensor.requires_grad:
                hook = _plain_guard(weakref.ref(self), index, param.name)
                self._plain_guards[index] = param.tensor.register_hook(hook)

    def plain_used(self) -> frozenset[int]:
        """Indices of the plain parameters trained in the iteration in flight."""
        return self._iteration.plain_used if self._iteration is not None else frozenset()

    def flat_parameter(self, tensor: object) -> tuple[str, tuple[str, ...]] | None:
        """(unit name, original names it holds) if ``tensor`` is one of the model's flat
        parameters, else ``None``: what error messages name it by."""
        record = self._flat_of.get(id(tensor))
        if record is not None:
            unit = self._units[record.unit].name or "<root>"
            return unit, tuple(self._params[i].name for i in record.params)
        return self.adapter.describe_flat(tensor)

    def index_of(self, tensor: torch.Tensor) -> int | None:
        """The index of the original parameter ``tensor`` is (view or plain), if any."""
        return self._index_of_tensor.get(id(tensor))

    def placement(self, tensor: torch.Tensor) -> Placement:
        """Where the elements of original parameter ``tensor`` (a view or plain
        parameter) live across ranks; :class:`~flatview.errors.OptimStateError` if it is
        not one."""
        index = self.index_of(tensor)
        if index is None:
            raise OptimStateError(
                f"a {type(tensor).__name__} of shape {tuple(tensor.shape)} is not an original "
                f"parameter of {self!r}"
            )
        return self._params[index].placement

    def tensor(self, index: int) -> nn.Parameter:
        """Original parameter ``index``: its view, or the plain parameter itself."""
        return self._params[index].tensor

    def name(self, index: int) -> str:
        """The original name of parameter ``index``."""
        return self._params[index].name

    def reduction_plan(self, flat: nn.Parameter) -> MaskPlan | None:
        """The mask for reducing ``flat``'s gradient now, or ``None`` if it is unknown."""
        record = self._flat_of.get(id(flat))
        if record is None:
            return None
        return record.plan(self._used_so_far(record.index))

    def gather_plan(self, flat: nn.Parameter) -> MaskPlan | None:
        """The mask for all-gathering ``flat`` in this iteration, or ``None`` to gather it
        whole (nothing skipped in it, or too little for masking to pay)."""
        found = self._skipping(flat)
        if found is None:
            return None
        iteration, record = found
        read = iteration.read[record.index]
        if all(read):
            return None
        plan = record.plan(read)
        return plan if masking_pays(plan) else None

    def gather_masked(
        self, rows: Sequence[torch.Tensor], local_shard: torch.Tensor, plan: MaskPlan
    ) -> None:
        """All-gather only ``plan``'s elements into ``rows`` (see :mod:`flatview.comm.gather`)."""
        index = self.reducer.index_of(plan, local_shard.device)
        masked_all_gather(
            rows, local_shard, plan, index, self.adapter.rank, self.adapter.group, self.ledger
        )

    def _used_so_far(self, flat: int) -> tuple[bool, ...]:
        iteration = self._iteration
        now = (
            iteration.used[flat]
            if iteration is not None
            else (True,) * len(self._flats[flat].params)
        )
        if self._window is None:
            return now
        return tuple(a or b for a, b in zip(self._window[flat], now, strict=True))

    def flat_used_so_far(self, flat: nn.Parameter) -> bool:
        """Whether any segment of ``flat`` was used since the last synced backward."""
        record = self._flat_of.get(id(flat))
        return record is not None and any(self._used_so_far(record.index))

    def end_backward(self, synced: bool) -> None:
        """A backward pass finished; ``synced`` is False under ``no_sync()``."""
        if self.phase is not Phase.COMPUTING:
            raise StateError(f"backward ended in phase {self.phase.name}, expected COMPUTING")
        used = [self._used_so_far(flat.index) for flat in self._flats]
        if synced:
            for flat, flags in zip(self._flats, used, strict=True):
                flat.views.pull_grads(used=flags)
            self._window = None
        else:
            self._window = used
        iteration = self._iteration
        self._stats_source = _StatsSource(
            skipped=iteration.skipped if iteration is not None else frozenset(),
            units_skipped=len(iteration.skipped_units) if iteration is not None else 0,
            ledger_bytes=dict(self.ledger.bytes),
            ledger_calls=dict(self.ledger.calls),
            synced=synced,
        )
        self._stats = None
        self._end_compute()

    def end_forward_only(self) -> None:
        """A forward ran without autograd: no backward will follow."""
        if self.phase is Phase.COMPUTING:
            self._end_compute()

    def _end_compute(self) -> None:
        for handle in self._guards:
            handle.remove()
        self._guards.clear()
        self._show_views()
        self.phase = Phase.IDLE

    def _show_views(self) -> None:
        for flat in self._flats:
            flat.views.rebind(flat.spec.local_shard())
            flat.views.show()

    @contextlib.contextmanager
    def lend(self) -> Iterator[None]:
        """Let the wrapper run one of its own operations on the original attributes."""
        if self.phase is not Phase.IDLE:
            yield
            return
        for flat in self._flats:
            flat.views.hide()
        self.phase = Phase.LENT
        try:
            yield
        finally:
            self._show_views()
            self.phase = Phase.IDLE

    def unwrap(self) -> None:
        """Detach flatview: the model is plain FSDP again.

        Views leave the submodules, flat parameters are registered again, and every hook
        and patch flatview installed is removed. Optimizers built over views still hold
        tensors that alias the shards; build new ones over the flat parameters.
        """
        if self.phase is not Phase.IDLE:
            raise StateError(f"unwrap() needs phase IDLE, the model is {self.phase.name}")
        for flat in self._flats:
            flat.views.hide()
        for handle in self._plain_guards.values():
            handle.remove()
        self._plain_guards.clear()
        self.adapter.uninstall()
        for unit in self._units:
            _wrapped.pop(unit.module, None)
        _live.discard(self)
        self.phase = Phase.DETACHED

    # ------------------------------------------------------------------ stats

    @property
    def stats(self) -> StepStats | None:
        """Communication figures of the last backward pass (``None`` before the first)."""
        if self._stats is None and self._stats_source is not None:
            self._stats = self._step_stats(self._stats_source)
        return self._stats

    def _step_stats(self, source: _StatsSource) -> StepStats:
        skipped, synced = source.skipped, source.synced
        dense = used = skipped_bytes = 0
        for flat in self._flats:
            layout = flat.spec.layout
            size = flat.spec.flat.element_size()
            dense += layout.padded_numel * size
            for segment, index in zip(layout.segments, flat.params, strict=True):
                if index in skipped:
                    skipped_bytes += segment.numel * size
                else:
                    used += segment.numel * size
        for index in self._reduced_plain:
            tensor = self._params[index].tensor
            size = tensor.numel() * tensor.element_size()
            dense += size
            if index in skipped:
                skipped_bytes += size
            elif tensor.requires_grad:
                used += size
        reduce_kinds = ("reduce_scatter", "all_to_all", "all_reduce")
        return StepStats(
            reduced_bytes=sum(source.ledger_bytes.get(k, 0) for k in reduce_kinds),
            reduce_calls=sum(source.ledger_calls.get(k, 0) for k in reduce_kinds),
            dense_bytes=dense if synced and self.adapter.wrapper_reduces else 0,
            used_bytes=used if synced and self.adapter.wrapper_reduces else 0,
            skipped_bytes=skipped_bytes,
            params_skipped=len(skipped),
            units_skipped=source.units_skipped,
            units=len(self._units),
            agreement_bytes=source.ledger_bytes.get("agreement", 0),
            synced=synced,
        )

    # --------------------------------------------------------- double counting

    def _check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.adapter.check_optimizer(optimizer)
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for flat in self._flats:
            if id(flat.spec.flat) not in held:
                continue
            for index in flat.params:
                if id(self._params[index].tensor) in held:
                    raise DoubleCountError(
                        f"optimizer {type(optimizer).__name__} holds the flat parameter of "
                        f"unit {self._units[flat.unit].name or '<root>'!r} and the view "
                        f"{self._params[index].name!r} that lives inside it: it would update "
                        "those elements twice. Build optimizers from views "
                        "(submodule.parameters() or FlatView.parameters()) or from the "
                        "flat parameters, not both."
                    )

    def __repr__(self) -> str:
        return (
            f"FlatView(backend={self.adapter.backend}, units={len(self._units)}, "
            f"params={len(self._params)}, rank={self.adapter.rank}/{self.adapter.world_size}, "
            f"phase={self.phase.name})"
        )

    # --------------------------------------------------------- optimizer state

    def optim_state_dict(
        self, optimizer: torch.optim.Optimizer, *, rank0_only: bool = False
    ) -> dict[str, Any]:
        """The consolidated state of an optimizer built over this model's views, keyed by
        original parameter name: the same at any world size, on any backend.

        Shaped like ``optimizer.state_dict()``, with names where that has numbers::

            {"state": {name: {key: value}}, "param_groups": [{..., "params": [name, ...]}]}

        Names are those of :meth:`named_parameters`. Per-element state (``exp_avg``,
        ``momentum_buffer``, ...) comes back as one tensor of the original parameter's
        shape, assembled from every rank's piece; other state (``step``, python
        numbers) as it is, after checking that every rank holding it agrees. Tensors
        are fresh CPU copies: the dict is a snapshot. The optimizer may hold any subset
        of the model's parameters (per-submodule optimizers: call this once per
        optimizer), including parameters FSDP does not flatten.

        A collective: every rank must call it, with its counterpart of the same
        optimizer, between iterations. It all-gathers a small description of each
        rank's state, then the per-element state of sharded parameters, packed, one
        collective per bucket and dtype. Nothing is communicated when every rank holds
        every parameter (torch ``NO_SHARD``, one rank).

        Args:
            optimizer: an optimizer over views and other parameters of this model
                (:meth:`parameters`, ``submodule.parameters()``).
            rank0_only: assemble the full tensors on rank 0 only (the others join the
                collectives and receive nothing); other ranks get the same
                ``param_groups`` and an empty ``state``.

        Returns:
            The consolidated state dict, for :meth:`load_optim_state_dict`.

        Raises:
            flatview.OptimStateError: the optimizer holds a tensor that is
                not one of this model's parameters (a flat parameter, say), or state
                that cannot be cut into pieces (neither per-element nor scalar), on any
                rank; or ranks hold different parameters or state, or disagree on a
                scalar such as ``step``. Raised on every rank alike (the message names
                the rank), after the exchange of descriptions and before any state
                tensor moves.
        """
        whole = getattr(optimizer, "consolidated_state_dict", None)
        if whole is not None:
            # flatview.optim.Whole keeps whole tensors on owner ranks: it consolidates itself.
            consolidated: dict[str, Any] = whole(rank0_only=rank0_only)
            return consolidated
        return optim_state.consolidate(self, optimizer, rank0_only=rank0_only)

    def load_optim_state_dict(
        self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
    ) -> None:
        """Load a state from :meth:`optim_state_dict` into an optimizer over this model's
        views: each rank takes its piece of every per-element tensor, then calls
        ``optimizer.load_state_dict``.

        The state may come from any world size and any backend or sharding strategy;
        training resumes exactly where it was saved. Parameters are matched by name
        within each parameter group (hyperparameters come from the state dict, as with
        ``optimizer.load_state_dict``). Every rank needs the full dict (load the same
        file everywhere); nothing is communicated.

        Args:
            optimizer: an optimizer built like the saved one, over this model's views.
            state_dict: the consolidated state.

        Raises:
            flatview.OptimStateError: the optimizer holds a tensor that is
                not one of this model's parameters; the dict names parameters this model
                does not have, lacks ones the optimizer holds, or has a different number
                of parameter groups; or a per-element tensor does not have its
                parameter's shape. Nothing is loaded then.
        """
        whole = getattr(optimizer, "load_consolidated_state_dict", None)
        if whole is not None:
            whole(state_dict)
            return
        optim_state.load(self, optimizer, state_dict)


def check_not_wrapped(modules: Sequence[nn.Module]) -> None:
    for module in modules:
        if module in _wrapped:
            raise WrapError(
                f"{type(module).__name__} is already wrapped by {_wrapped[module]!r}; "
                "wrap each model once"
            )


def _traversal_order(model: nn.Module, clean_name: Any) -> dict[str, tuple[int, int]]:
    order: dict[str, tuple[int, int]] = {}
    for module_name, module in model.named_modules():
        prefix = clean_name(module_name)
        for attr in module._parameters:
            name = f"{prefix}.{attr}" if prefix else attr
            order.setdefault(name, (len(order), 0))
    return order


# One step pre-hook for all optimizers; the per-optimizer result is cached until the
# optimizer's parameter list changes, so steady-state cost is a length comparison.
_checked: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, ...]] = (
    weakref.WeakKeyDictionary()
)


def _install_optimizer_hook() -> None:
    global _optimizer_hook
    if _optimizer_hook is None:
        _optimizer_hook = register_optimizer_step_pre_hook(_before_step)


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    signature = tuple(len(group["params"]) for group in optimizer.param_groups)
    if _checked.get(optimizer) == signature:
        return
    for view in list(_live):
        view._check_optimizer(optimizer)
    _checked[optimizer] = signature
