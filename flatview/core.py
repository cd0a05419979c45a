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
import math
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
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
    FlatViewError,
    NormError,
    OptimStateError,
    ParameterError,
    ParamGroupError,
    SkippedParameterUsedError,
    StateError,
    WrapError,
)
from flatview.layout import MaskPlan, Placement, Shape
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
    declared: bool = False
    """Bound inside a ``FlatView.step()`` (step ``step``): its skip set covers this
    forward. A backward inside a step must belong to a forward bound in that step."""


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


def _in_backward() -> bool:
    """Whether autograd runs a backward on this thread (a forward now recomputes)."""
    return bool(torch._C._current_graph_task_id() != -1)


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
        self._flat_names = [[self._params[i].name for i in flat.params] for flat in self._flats]
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
        # Optimizers whose groups were looked at for shape-decided grouping (once each).
        self._shape_checked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._by_name: set[int] = set()
        """Matrices grouped apart by name on purpose (:meth:`exempt_by_name`)."""
        self._view_owners = _owners_by_module(
            [o for flat in self._flats for owners in flat.spec.owners for o in owners]
            + list(adapter.view_owners())
        )

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
        _bump_generation()
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
                    whole_shard=plain.layout is not None and plain.whole_shard,
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
        # Kept: a parameter set in a view's place becomes the view (_replace_view).
        self._tensor_items = tensors
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
        their first name). A parameter set in a view's place
        (``module.weight = nn.Parameter(t)``) is the view from then on."""
        if self.phase is Phase.IDLE:
            self._write_back()
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
        iterations. Arguments that are not this model's parameters, an unsupported
        ``norm_type`` or a call in the wrong phase raise before any norm is taken, on
        every rank even when only one rank's arguments are bad (that rank still joins
        the one collective, flagged as failed; the others name it and its message);
        ranks that pass different ``params`` or ``norm_type`` all raise after it,
        naming the parameters.

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

    # ------------------------------------------------ whole parameters (shapes, clipping)

    def _lookup(self, param: torch.Tensor | str, method: str) -> int:
        try:
            (index,) = _norms.indices_of(self, [param], "param")
        except NormError as error:
            raise ParameterError(f"FlatView.{method}(): {error}") from None
        return index

    def shape_of(self, param: torch.Tensor | str) -> Shape:
        """The original shape of a view or plain parameter (or of a name, as in
        :meth:`named_parameters`), the same on every rank: a tuple equal to the
        original ``torch.Size``, with ``ndim`` and ``numel()`` as a tensor has them
        (``fv.shape_of(p).ndim == 2`` picks matrices).

        A partial view is 1-D and an empty one has no element, so ``view.shape`` and
        ``view.ndim`` describe this rank's piece; decide anything that depends on the
        parameter (weight decay for matrices, whole-matrix optimizers) by this instead.

        Raises:
            flatview.ParameterError: ``param`` is not an original parameter of the model.
        """
        return Shape(self._params[self._lookup(param, "shape_of")].placement.shape)

    def numel(
        self,
        params: torch.Tensor | str | Iterable[torch.Tensor | str] | None = None,
        *,
        trainable: bool | None = None,
    ) -> int:
        """The number of elements of whole original parameters, the same on every rank
        (``view.numel()`` counts this rank's piece): of one parameter, of several, or of
        the whole model (``None``), each parameter once.

        ``trainable=True`` counts only those with ``requires_grad``, ``False`` only the
        frozen ones: ``fv.numel(trainable=True), fv.numel()`` is what PEFT's
        ``get_nb_trainable_parameters`` reports for the unwrapped model.

        Raises:
            flatview.ParameterError: something in ``params`` is not an original parameter.
        """
        if params is None:
            indices: Iterable[int] = self._order
        elif isinstance(params, (torch.Tensor, str)):
            indices = [self._lookup(params, "numel")]
        else:
            indices = {self._lookup(p, "numel") for p in params}
        total = 0
        for index in indices:
            param = self._params[index]
            if trainable is None or param.tensor.requires_grad is trainable:
                total += param.placement.numel
        return total

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        params: _norms.ParamSelection = None,
        *,
        error_if_nonfinite: bool = False,
    ) -> torch.Tensor:
        """Clip gradients by their global norm over whole parameters, in place, as
        ``torch.nn.utils.clip_grad_norm_`` does on the unwrapped model.

        ``torch.nn.utils.clip_grad_norm_(fv.parameters(), ...)`` takes the norm of this
        rank's pieces only (as it does on plain FSDP): each rank would clip by a different,
        too small norm. This takes the norm of every whole gradient in ``params`` with
        one all-reduce (:meth:`grad_norms`), combines them into the total norm, and
        scales every gradient in ``params`` by ``min(1, max_norm / (total + 1e-6))``.
        Parameters without a gradient (skipped, frozen) count as zeros and stay ``None``.

        A collective: every rank calls it with the same arguments, between the backward
        and the optimizer step. Works on every backend, for any subset of parameters.

        Args:
            max_norm: the largest total norm allowed.
            norm_type: ``p`` of the p-norm, or ``inf``.
            params: as for :meth:`param_norms` (default: every original parameter).
            error_if_nonfinite: raise if the total norm is ``nan`` or ``inf`` (on every
                rank: the total is the same everywhere).

        Returns:
            The total norm of the gradients before clipping (a 0-dim tensor, the same on
            every rank).

        Raises:
            flatview.NormError: as for :meth:`grad_norms` (before the all-reduce);
                ``max_norm`` is not a non-negative number (``inf`` is: it measures without
                clipping); the total norm is not finite and ``error_if_nonfinite`` is set.
            StateError: as for :meth:`grad_norms`.
        """
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
            raise NormError(f"max_norm must be a number, got {type(max_norm).__name__}")
        if not max_norm >= 0:
            # inf is fine (measure without clipping); nan would scale by nan.
            raise NormError(f"max_norm must be non-negative, got {max_norm}")
        p = _norms.check_norm_type(norm_type)
        indices = _norms.select(self, params)
        norms = [n for n in _norms.grad_norms(self, params, p).values() if n is not None]
        if not norms:
            return torch.zeros((), device=self.adapter.device)
        stacked = torch.stack(norms)
        total = stacked.max() if math.isinf(p) else torch.linalg.vector_norm(stacked, p)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise NormError(
                f"the total {p}-norm of the gradients is {total.item()}: not finite "
                "(error_if_nonfinite=True)"
            )
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for index in indices:
            grad = self._params[index].tensor.grad
            if grad is not None:
                grad.mul_(scale.to(grad.device, grad.dtype))
        return total

    def check_param_groups(self, optimizer: torch.optim.Optimizer) -> None:
        """Check that every rank gives each original parameter in ``optimizer`` the same
        hyperparameters: the pieces of one parameter must train alike.

        Groups decided by the view's shape break this silently: a partial view is 1-D
        (an ``ndim <= 1`` rule puts it with the biases) where another rank's full view of
        the same matrix is 2-D. Build groups from :meth:`shape_of` and names instead
        (:func:`flatview.optim.param_groups`). At an optimizer's first step flatview warns
        when this rank alone can see the symptom; this check is exact.

        A collective (one ``all_gather_object`` of each parameter's hyperparameters):
        every rank calls it with its counterpart of the same optimizer.

        Raises:
            flatview.ParamGroupError: on every rank alike, naming the parameters whose
                hyperparameters differ between ranks, or that some ranks' optimizer
                holds and others' do not.
        """
        signature = self._shape_signature(optimizer)
        local = (self._group_keys(optimizer), signature.suspicious(), bool(signature.whole))
        everyone: list[Any] = [None] * self.adapter.world_size
        if self.adapter.world_size > 1:
            dist.all_gather_object(everyone, local, group=self.adapter.group)
        else:
            everyone = [local]
        gathered = [keys for keys, _, _ in everyone]
        names = sorted(set().union(*gathered), key=lambda n: self._index_of_name[n])
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
                index = self._index_of_tensor.get(id(tensor))
                if index is not None:
                    keys[self._params[index].name] = key
        return keys

    def _shape_signature(self, optimizer: torch.optim.Optimizer) -> _Signature:
        """How ``optimizer``'s groups on this rank treat matrices and their pieces."""
        sig = _Signature(groups=len({_hyperparameters(g) for g in optimizer.param_groups}))
        for group in optimizer.param_groups:
            key = _hyperparameters(group)
            for tensor in group["params"]:
                index = self._index_of_tensor.get(id(tensor))
                if index is None:
                    continue
                shape = self._params[index].placement.shape
                if len(shape) <= 1:
                    sig.low.add(key)
                    continue
                sig.matrices.add(key)
                if tuple(tensor.shape) == shape:
                    sig.whole.add(key)
                elif tensor.numel() and index not in self._by_name:
                    sig.pieces.append((self._params[index].name, key))
        return sig

    def exempt_by_name(self, param: torch.Tensor | str) -> None:
        """Record that ``param`` (a matrix) is grouped apart by name on purpose (as
        :func:`flatview.optim.param_groups` does for ``no_decay`` and embeddings), so that
        its 1-D pieces in a group with the biases are not taken for grouping by
        ``p.ndim``."""
        self._by_name.add(self._lookup(param, "exempt_by_name"))

    def _warn_shape_grouping(self, optimizer: torch.optim.Optimizer) -> None:
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
                f"matrices {_norms._listing(suspicious)} (1-D views) in a parameter group "
                "like the biases and norms, not like whole matrices: groups decided by "
                "p.ndim (timm's param_groups_weight_decay, create_optimizer_v2) see the "
                "piece, not the parameter, and train it unlike the unwrapped model. Decide "
                "by FlatView.shape_of(p) and names: flatview.optim.param_groups(fv, "
                "weight_decay=...). If this grouping by name is intended, "
                "FlatView.check_param_groups(optimizer) confirms it.",
                stacklevel=4,
            )

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
                set and froze the same parameters (``requires_grad=False``: frozen
                parameters are not reduced either), raising
                :class:`~flatview.errors.SkipSetMismatchError` (or its subclass
                :class:`~flatview.errors.FrozenMismatchError`) on all ranks otherwise;
                defaults to the ``check_skip_agreement`` given to ``wrap``.

        Errors one rank finds on its own (a skip set that does not resolve there, a step
        entered in the wrong phase) travel in the same all-gather: every rank raises,
        the failing one its own error, the others an error of the same class naming the
        failing rank and its message. With the check off nothing is exchanged: the
        failing rank raises alone and the others wait for it in their next collective
        (a hang, or the wrapper's timeout).

        With ``wrap(check_skip_agreement=True)`` an iteration outside any step (its root
        forward, with autograd on) exchanges as a checked step skipping nothing: the two
        agree, and a rank inside a checked step that skips something while another runs
        outside any step raises :class:`~flatview.errors.SkipSetMismatchError` on every
        rank, naming the ranks outside. A step with ``check=False`` exchanges nothing, so
        pairing it with an outside-step iteration still hangs.

        A backward that runs inside a step must be that of a forward that ran inside the
        same step: the skip set binds to the forward (a backward inside
        ``step(skip=...)`` whose forward ran before it raises
        :class:`~flatview.errors.StateError` before its gradients are communicated).
        If the body raises after the forward (an error of flatview's in the backward,
        say), the iteration is abandoned: the next forward starts afresh.
        """
        checked = self.check_skip_agreement if check is None else check
        failure: FlatViewError | None = None
        skipped: frozenset[int] = frozenset()
        try:
            if self._step_skip is not None:
                raise StateError("FlatView.step() contexts cannot be nested")
            if self.phase is Phase.DETACHED:
                raise StateError("FlatView.step() after unwrap()")
            if self.phase is Phase.LENT:
                raise StateError("FlatView.step() entered inside a wrapper operation")
            skipped = self._resolver.resolve(skip)
        except FlatViewError as err:
            if not checked:
                raise
            failure = err
        if failure is None:
            self.ledger.reset()
        if checked:
            # One left by an outside-step forward that raised: heard before this one.
            self.settle_agreement()
            params = self._params
            frozen = frozenset(p.index for p in params if not p.tensor.requires_grad)
            agreement = Agreement(
                fingerprint(skipped, frozen),
                lambda: [params[i].name for i in sorted(skipped)],
                self.agreement_group(),
                self.adapter.device,
                self.ledger,
                frozen=lambda: [params[i].name for i in sorted(frozen)],
                failure=failure,
            )
            if failure is not None or not self.adapter.overlaps_agreement:
                agreement.settle()
            else:
                self._agreement = agreement
        self._step_count += 1
        self._step_skip = skipped
        try:
            yield self
        except BaseException:
            self._abandon_iteration()
            raise
        finally:
            self._step_skip = None
            self.settle_agreement()

    def _abandon_iteration(self) -> None:
        """The body of a step raised: whatever its forward started (guards on the
        compute tensors, the phase) is dropped, so that the next forward starts afresh."""
        if self.phase is Phase.COMPUTING and not _in_backward():
            self._end_compute()

    def check_backward_binding(self) -> None:
        """Refuse the backward of a forward that ran outside the step in flight: the
        step's skip set would not apply to it (adapters call this before the backward
        communicates)."""
        if self._step_skip is None or self.phase is not Phase.COMPUTING:
            return
        iteration = self._iteration
        if iteration is not None and iteration.declared and iteration.step == self._step_count:
            return
        raise StateError(
            "a backward ran inside FlatView.step(skip=...) but its forward ran outside that "
            "step: the skip set binds to the forward it covers and would be ignored. Run the "
            "forward inside the same step as its backward (with fv.step(skip=...): "
            "loss = model(x); loss.backward())"
        )

    def settle_agreement(self) -> None:
        """Wait for the skip-set check of the step in flight if it still runs (adapters
        that overlap it with the forward call this before their first collective),
        raising :class:`~flatview.errors.SkipSetMismatchError` on every rank if ranks
        disagree."""
        agreement, self._agreement = self._agreement, None
        if agreement is None:
            return
        try:
            agreement.settle()
        except BaseException:
            if agreement.outside:
                # Nothing abandons an iteration outside a step: forget it, so that the
                # next root forward starts (and checks) a new one on every rank alike.
                self._iteration = None
            raise

    # --------------------------------------------------------- adapter calls

    def begin_compute(self, outermost: bool) -> None:
        """A unit's forward is about to run: views step aside, the skip set binds.

        ``outermost`` says it is the root unit's forward: a new iteration. When one starts
        while the last is still computing, that one's forward was never followed by a
        backward (a validation pass with autograd on); gradients zeroed since must still
        reach the flat parameters. Inner units start again during backward when
        activation checkpointing recomputes them, and must not touch gradients then.
        """
        self.check_not_lent()
        agreed = self._agree_outside_step(outermost)
        if self.phase is Phase.IDLE:
            self._check_parametrizations()
            self._write_back()
            self._detach_grads()
            for flat in self._flats:
                flat.views.hide()
            self.phase = Phase.COMPUTING
            self._bind_iteration(reset_ledger=not agreed)
        elif outermost:
            fresh = not _in_backward()
            if fresh:
                # The last iteration never ended (a forward without backward, or a backward
                # that raised): its guards belong to compute tensors no backward will use.
                self._remove_guards()
            self._detach_grads()
            iteration = self._iteration
            if (
                iteration is None
                or iteration.step != self._step_count
                or (fresh and iteration.declared != (self._step_skip is not None))
            ):
                self._bind_iteration(reset_ledger=not agreed)

    def _agree_outside_step(self, outermost: bool) -> bool:
        """An iteration starts outside any step (a root forward with autograd on, not a
        recomputation inside a backward, after a backward or a step): with the check on,
        it takes part in the same all-gather as a checked step, as one skipping nothing,
        so that a rank inside a checked step pairs its check with this one instead of
        with a collective of the wrapper's; every rank raises if they differ. Returns
        whether it was exchanged (its bytes are in the fresh ledger).

        Forwards without autograd (evaluation) exchange nothing: on DDP and ``NO_SHARD``
        they communicate nothing, and a rank may evaluate alone."""
        if (
            not outermost
            or not self.check_skip_agreement
            or self._step_skip is not None
            or not torch.is_grad_enabled()
            or _in_backward()
        ):
            return False
        iteration = self._iteration
        if self.phase is not Phase.IDLE and not (
            iteration is None or iteration.step != self._step_count or iteration.declared
        ):
            return False  # a second forward of the same iteration (no backward between)
        # A check left unsettled by a forward that raised: hear it before the next.
        self.settle_agreement()
        self.ledger.reset()
        params = self._params
        frozen = frozenset(p.index for p in params if not p.tensor.requires_grad)
        agreement = Agreement(
            fingerprint((), frozen),
            list,
            self.agreement_group(),
            self.adapter.device,
            self.ledger,
            frozen=lambda: [params[i].name for i in sorted(frozen)],
            outside=True,
        )
        if self.adapter.overlaps_agreement:
            self._agreement = agreement
        else:
            agreement.settle()
        return True

    def _detach_grads(self) -> None:
        # The wrapper computes a fresh gradient; the views keep theirs until the synced
        # backward adds the two (end_backward), so a zero_grad between forward and
        # backward counts. Inside a no_sync() window the flat parameters hold unsharded
        # accumulated gradients: they were detached when the window opened.
        if self._window is None:
            for flat in self._flats:
                flat.views.detach_grads()

    def _write_back(self) -> None:
        """Carry values written through views (``view.data = t``, a new parameter set in
        a view's place) into the shards before the wrapper reads them; a replacing
        parameter becomes the view."""
        for flat, names in zip(self._flats, self._flat_names, strict=True):
            for segment, param in flat.views.write_back(names):
                self._replace_view(flat.params[segment], param)

    def _replace_view(self, index: int, param: nn.Parameter) -> None:
        old = self._params[index]
        self._params[index] = replace(old, tensor=param)
        self._index_of_tensor.pop(id(old.tensor), None)
        self._index_of_tensor[id(param)] = index
        self._tensor_items.pop(id(old.tensor), None)
        self._tensor_items[id(param)] = [index]
        _checked.clear()

    def check_not_lent(self) -> None:
        """Refuse a unit's forward inside a wrapper operation that does not cover the
        unit (summoned units run on the summoned parameters instead)."""
        if self.phase is Phase.LENT:
            raise StateError(
                "a forward pass started inside a wrapper operation (state_dict, "
                "summon_full_params, ...) through an FSDP unit that operation does not "
                "cover: finish that first, or summon the whole model (summon_full_params "
                "with recurse=True), inside which forwards run on the summoned parameters"
            )

    def _check_parametrizations(self) -> None:
        """Refuse a parametrization (``torch.nn.utils.parametrize``, ``weight_norm``,
        ``spectral_norm``, ...) registered on a view after wrapping: it would compute on
        this rank's piece (a per-piece norm, or a failure on an empty view) and train a
        copy the shard never sees."""
        for module, attrs in self._view_owners:
            found = module._modules.get("parametrizations")
            if found is None:
                continue
            hit = [a for a in attrs if a in found._modules]
            if hit:
                where = next(
                    self.adapter.clean_name(n) for n, m in self.model.named_modules() if m is module
                )
                raise WrapError(
                    f"a parametrization was registered on {', '.join(hit)} of "
                    f"{where or '<root>'!r} ({type(module).__name__}) after flatview.wrap: "
                    "there it acts on this rank's piece of the parameter (a view), not on "
                    "the parameter, and trains a copy the wrapper never sees. Register it "
                    "on the unwrapped model, before FSDP wraps it (torch.nn.utils."
                    "parametrize / parametrizations.weight_norm first, then FSDP, then "
                    "flatview.wrap)."
                )

    def _push_grads(self) -> None:
        """Make the flat gradients say what the view gradients say (before a wrapper
        operation or unwrap reads them)."""
        if self._window is None:
            for flat in self._flats:
                flat.views.push_grads()

    def _bind_iteration(self, *, reset_ledger: bool = True) -> None:
        skipped = self._step_skip or frozenset()
        if self._step_skip is None and reset_ledger:
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
            skipped,
            used,
            read,
            skipped_units,
            self._step_count,
            plain_used,
            declared=self._step_skip is not None,
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
        self.check_backward_binding()
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
        self.check_backward_binding()
        used = [self._used_so_far(flat.index) for flat in self._flats]
        if synced:
            for flat, flags in zip(self._flats, used, strict=True):
                flat.views.combine_grads(used=flags)
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
            if self._window is None:
                for flat in self._flats:
                    flat.views.reattach_grads()
            self._end_compute()

    def _end_compute(self) -> None:
        self._remove_guards()
        self._show_views()
        self.phase = Phase.IDLE

    def _remove_guards(self) -> None:
        for handle in self._guards:
            handle.remove()
        self._guards.clear()

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
        # The wrapper reads the shards (and may read gradients): what was written
        # through the views must be there.
        self._write_back()
        self._push_grads()
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
        and patch flatview installed is removed. What was written through the views
        (values, zeroed or dropped gradients) is carried into the flat parameters first,
        so the model trains on exactly as if it had never been wrapped. Optimizers built
        over views hold stale handles: their next step raises
        :class:`~flatview.errors.StateError`; build new ones over ``model.parameters()``
        (or wrap again and build them over the new views).
        """
        if self.phase is not Phase.IDLE:
            raise StateError(f"unwrap() needs phase IDLE, the model is {self.phase.name}")
        if self._window is not None:
            # The flat parameters hold the window's unsharded gradients, the views what
            # came before it: only the synchronising backward combines the two.
            raise StateError(
                "unwrap() inside a no_sync() window: finish the accumulation with a "
                "synchronising backward first"
            )
        # The flat parameters carry on alone: the values and gradients the views hold
        # (zeroed, dropped, written) must be theirs.
        self._write_back()
        self._push_grads()
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
        # Views the model no longer holds are stale handles: an optimizer over them
        # would step tensors nothing reads.
        registered = {id(p) for p in self.model.parameters()}
        for param in self._params:
            if id(param.tensor) not in registered:
                _mark_stale(param.tensor, param.name)
        _bump_generation()

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
            unit = self._units[flat.unit].name or "<root>"
            for index in flat.params:
                if id(self._params[index].tensor) in held:
                    raise DoubleCountError(
                        f"optimizer {type(optimizer).__name__} holds the flat parameter of "
                        f"unit {unit!r} and the view "
                        f"{self._params[index].name!r} that lives inside it: it would update "
                        "those elements twice. Build optimizers from views "
                        "(submodule.parameters() or FlatView.parameters()) or from the "
                        "flat parameters, not both."
                    )
            # An optimizer over a flat parameter steps all of it: it cannot leave skipped
            # parameters alone (weight decay, momentum on zero gradients), and gradients
            # live in the views while the model is wrapped.
            names = ", ".join(repr(self._params[i].name) for i in flat.params[:4])
            more = ", ..." if len(flat.params) > 4 else ""
            raise OptimStateError(
                f"optimizer {type(optimizer).__name__} holds the flat parameter of FSDP "
                f"unit {unit!r} (holding {names}{more}): it would step every parameter in "
                "it, skipped ones too, and it does not see gradients zeroed through the "
                "views. Build optimizers from views (submodule.parameters() or "
                "FlatView.parameters()), or call FlatView.unwrap() to train on plain FSDP."
            )

    def __repr__(self) -> str:
        return (
            f"FlatView(backend={self.adapter.backend}, units={len(self._units)}, "
            f"params={len(self._params)}, numel={self.numel()}, "
            f"rank={self.adapter.rank}/{self.adapter.world_size}, phase={self.phase.name})"
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

    # --- runtime additions for FSDP2 ---

    def agreement_group(self) -> dist.ProcessGroup | None:
        """The process group the skip-set check spans: every rank whose collectives the
        skip set decides. The adapter's ``group`` unless it names a wider
        ``agreement_group`` (FSDP2 HSDP: ``group`` is the shard group, which norms and
        optimizer state use; the replicas all-reduce gradients too)."""
        group: dist.ProcessGroup | None = getattr(
            self.adapter, "agreement_group", self.adapter.group
        )
        return group


@dataclass
class _Signature:
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


def _hyperparameters(group: dict[str, Any]) -> str:
    """A parameter group's hyperparameters (all but its parameters), comparable across
    groups and ranks."""
    return repr(sorted((k, repr(v)) for k, v in group.items() if k != "params"))


def _list(items: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _owners_by_module(owners: Iterable[Any]) -> tuple[tuple[nn.Module, tuple[str, ...]], ...]:
    attrs: dict[int, tuple[nn.Module, list[str]]] = {}
    for owner in owners:
        attrs.setdefault(id(owner.module), (owner.module, []))[1].append(owner.attr)
    return tuple((module, tuple(names)) for module, names in attrs.values())


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
# optimizer's parameters (by identity) or the set of wrapped models change, so the
# steady-state cost is one tuple of ids per step.
_checked: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, ...]] = (
    weakref.WeakKeyDictionary()
)
# Views of unwrapped models that the model no longer holds: id -> (weak view, name).
_stale: dict[int, tuple[weakref.ref[nn.Parameter], str]] = {}
_generation = 0


def _mark_stale(view: nn.Parameter, name: str) -> None:
    key = id(view)

    def forget(_: object) -> None:
        _stale.pop(key, None)

    _stale[key] = (weakref.ref(view, forget), name)


def _bump_generation() -> None:
    """A model was wrapped or unwrapped: every optimizer is checked again."""
    global _generation
    _generation += 1


def _install_optimizer_hook() -> None:
    global _optimizer_hook
    if _optimizer_hook is None:
        _optimizer_hook = register_optimizer_step_pre_hook(_before_step)


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    signature = (_generation, *(id(p) for group in optimizer.param_groups for p in group["params"]))
    if _checked.get(optimizer) == signature:
        return
    _check_stale(optimizer)
    for view in list(_live):
        view._check_optimizer(optimizer)
        view._warn_shape_grouping(optimizer)
    _checked[optimizer] = signature


def _check_stale(optimizer: torch.optim.Optimizer) -> None:
    if not _stale:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            found = _stale.get(id(p))
            if found is None:
                continue
            ref, name = found
            if ref() is not p:
                del _stale[id(p)]
                continue
            raise StateError(
                f"optimizer {type(optimizer).__name__} holds the view {name!r} of a model "
                "that FlatView.unwrap() detached: the model no longer reads it, so the "
                "step would train nothing. Build a new optimizer over the model's "
                "parameters (model.parameters(), or a new FlatView's views after wrapping "
                "again)."
            )
