"""The user's handle on a wrapped model: :class:`FlatView`.

What :func:`flatview.wrap` returns and users hold: the original parameters
(:meth:`FlatView.parameters`, :meth:`FlatView.named_parameters`), skip sets
(:meth:`FlatView.step`), whole-parameter shapes and norms, optimizer checks and state,
step statistics, and :meth:`FlatView.unwrap`. It assembles at wrap time, and keeps, the
pieces that do the work:

* the parameter table (:class:`flatview.table.ParamTable`, :attr:`FlatView.table`);
* the runtime the backend adapter drives (:class:`flatview.runtime.Runtime`,
  :attr:`FlatView.runtime`), handed to ``adapter.install``;
* the optimizer checks (:class:`flatview.optimizer_checks.OptimizerChecks`), registered
  with :mod:`flatview.wrapped_models`;
* the routing of torch's own checkpoint functions (:mod:`flatview.checkpoint_routing`),
  and of fairscale's optimizer-state methods (:mod:`flatview.checkpoint_fairscale`)
  where the wrapper flattens: installed here, as adapters import no feature module.

Norms (:mod:`flatview.norms`) and optimizer state (:mod:`flatview.optim_state`) are
plain functions over the table and the runtime: the handle calls them, they never
import it. The module is one concept past the line cap: the public API, most of its
length the docstrings users read; each method only delegates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from flatview import clipping as _clipping
from flatview import norms as _norms
from flatview import wrapped_models
from flatview.backends.base import Adapter
from flatview.backends.patches import Patches
from flatview.checkpoint_fairscale import loadable, route_fairscale_optim_state
from flatview.checkpoint_optim import consolidated, load_consolidated
from flatview.checkpoint_routing import RoutingSite, route_torch_checkpoint
from flatview.comm.ledger import Ledger
from flatview.errors import NormError, ParameterError
from flatview.layout import Placement, Shape
from flatview.optimizer_checks import OptimizerChecks
from flatview.phase import Phase
from flatview.runtime import Runtime
from flatview.skip import SkipSet
from flatview.stats import StepStats
from flatview.table import ParamTable


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
    ) -> None:
        self.model = model
        self.adapter = adapter
        units = adapter.describe()
        self._modules = [unit.module for unit in units]
        wrapped_models.check_not_wrapped(self._modules)
        self.table = ParamTable(units, model, adapter.clean_name, adapter.describe_flat)
        """Every original parameter and its lookups (for flatview's own modules)."""
        self.runtime = Runtime(
            model,
            adapter,
            self.table,
            check_skip_agreement=check_skip_agreement,
        )
        """What the backend adapter drives (for flatview's own modules and adapters)."""
        self._checks = OptimizerChecks(
            self.table, adapter, lent=lambda: self.runtime.phase is Phase.LENT
        )
        self.runtime.views.show_initial()
        # With the views shown, a walk of the module tree meets the parameters in the
        # unwrapped model's order.
        self.table.settle_order(model)
        wrapped_models.register(self, model, self._modules, self._checks)
        adapter.install(self.runtime)
        self._patches = Patches()  # the handle's own, beside the adapter's
        # On every backend: torch's own functions would take a view's state for a flat
        # parameter's, key every expert group's experts alike, and prime an optimizer
        # that has no state yet with a zero step (see checkpoint_routing).
        route_torch_checkpoint(RoutingSite(self.runtime, self._patches.patch, self._patches.hook))
        if adapter.flattens:
            route_fairscale_optim_state(self.runtime, self._modules, self._patches.patch)

    @property
    def phase(self) -> Phase:
        """Where the model is in its lifecycle: views are registered only in ``IDLE``."""
        return self.runtime.phase

    @property
    def check_skip_agreement(self) -> bool:
        """The default of :meth:`step`'s ``check`` (``wrap(check_skip_agreement=...)``)."""
        return self.runtime.check_skip_agreement

    @check_skip_agreement.setter
    def check_skip_agreement(self, value: bool) -> None:
        self.runtime.check_skip_agreement = value

    @property
    def ledger(self) -> Ledger:
        """Bytes and calls of flatview's own collectives in the current iteration."""
        return self.runtime.ledger

    # -------------------------------------------------------------- public API

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Every original parameter once, as a view or plain parameter, under the name
        the unwrapped model's ``named_parameters()`` gives it (tied parameters under
        their first name). A parameter set in a view's place
        (``module.weight = nn.Parameter(t)``) is the view from then on."""
        if self.phase is Phase.IDLE:
            self.runtime.write_back()
        for index in self.table.order:
            param = self.table.params[index]
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
        return _norms.param_norms(self.runtime, params, norm_type)

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
        return _norms.grad_norms(self.runtime, params, norm_type)

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
        return _norms.tensor_norms(self.runtime, tensors, norm_type)

    # ------------------------------------------------ whole parameters (shapes, clipping)

    def _lookup(self, param: torch.Tensor | str, method: str) -> int:
        try:
            (index,) = _norms.indices_of(self.table, [param], "param")
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
        return Shape(self.table.placement_of(self._lookup(param, "shape_of")).shape)

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
            indices: Iterable[int] = self.table.order
        elif isinstance(params, (torch.Tensor, str)):
            indices = [self._lookup(params, "numel")]
        else:
            indices = {self._lookup(p, "numel") for p in params}
        total = 0
        for index in indices:
            param = self.table.params[index]
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
        rank's pieces only (as it does on bare FSDP): each rank would clip by a different,
        too small norm. This takes the norm of every whole gradient in ``params`` with
        one all-reduce (:meth:`grad_norms`), combines them into the total norm, and
        scales every gradient in ``params`` by ``min(1, max_norm / (total + 1e-6))``.
        Parameters without a gradient (skipped, frozen) count as zeros and stay ``None``.

        A collective: every rank calls it with the same arguments, between the backward
        and the optimizer step. Works on every backend, for any subset of parameters.
        With expert units on process groups of their own, the total covers the shared
        parameters and the experts of every expert group, each once (one more tiny
        all-reduce): what the unwrapped model holding every group's experts clips by.

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
        return _clipping.clip_grad_norm(
            self.runtime, max_norm, norm_type, params, error_if_nonfinite=error_if_nonfinite
        )

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
        self._checks.check_param_groups(optimizer)

    def exempt_by_name(self, param: torch.Tensor | str) -> None:
        """Record that ``param`` (a matrix) is grouped apart by name on purpose (as
        :func:`flatview.optim.param_groups` does for ``no_decay`` and embeddings), so that
        its 1-D pieces in a group with the biases are not taken for grouping by
        ``p.ndim``."""
        self._checks.exempt_by_name(self._lookup(param, "exempt_by_name"))

    def resolve(self, skip: SkipSet) -> list[str]:
        """The original names of the parameters a skip set stands for, in model order."""
        indices = self.table.resolve(skip)
        return [self.table.name(i) for i in self.table.order if i in indices]

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
                defaults to the ``check_skip_agreement`` given to ``wrap``. Under the
                wrapper's ``no_sync()`` (fairscale, torch FSDP1, DDP) the default check
                waits for the window's synchronising step, so that a micro-step has
                exactly the wrapper's collectives; ``check=True`` given explicitly checks
                this micro-step at once (one tiny all-gather more), which also catches
                ranks that would call different units before the wrapper's gathers pair
                up wrongly.

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

        A step may be entered inside the wrapped model's forward (Lightning's Trainer
        runs ``training_step``, manual optimization included, inside the wrapper's
        forward) on DDP and torch ``NO_SHARD`` computed on views: its skip set binds to
        the iteration in flight, and each backward inside that forward is reduced when
        it ends, exactly. On sharded wrappers such a step raises
        :class:`~flatview.errors.StateError` on every rank before any collective of the
        step (enter it before calling the model), and so does a backward inside the
        root's forward that the wrapper would not finish (see
        :mod:`flatview.binding`).
        If the body raises after the forward (an error of flatview's in the backward,
        say), the iteration is abandoned: the next forward starts afresh.
        """
        checked = self.check_skip_agreement if check is None else check
        with self.runtime.step(skip, checked, at_once=check is True):
            yield self

    def placement(self, tensor: torch.Tensor) -> Placement:
        """Where the elements of original parameter ``tensor`` (a view or plain
        parameter) live across ranks; :class:`~flatview.errors.OptimStateError` if it is
        not one."""
        return self.table.placement(tensor, self)

    def unwrap(self) -> None:
        """Detach flatview: the model is bare FSDP again.

        Views leave the submodules, flat parameters are registered again, and every hook
        and patch flatview installed is removed. What was written through the views
        (values, zeroed or dropped gradients) is carried into the flat parameters first,
        so the model trains on exactly as if it had never been wrapped. Optimizers built
        over views hold stale handles: their next step raises
        :class:`~flatview.errors.StateError`; build new ones over ``model.parameters()``
        (or wrap again and build them over the new views).

        Call it between optimizer steps: inside an accumulation window (between the
        micro-batches of one step, under ``no_sync()``, FSDP2's
        ``set_requires_gradient_sync(False)`` or ``set_requires_all_reduce(False)``, or
        before DeepSpeed's boundary) it raises :class:`~flatview.errors.StateError`,
        because the flat parameters then hold the window's gradients apart from what the
        views accumulated before it; finish the step with its synchronising backward,
        then unwrap.
        """
        self.runtime.detach()
        self._patches.remove()
        wrapped_models.unregister(self.model, self._modules, self._checks)
        # Views the model no longer holds are stale handles: an optimizer over them
        # would step tensors nothing reads.
        # torch's use_orig_params parameters are the wrapper's, never stale: a
        # SHARD_GRAD_OP unit left unsharded by a forward without backward registers
        # non-leaf views in their place until its next reshard.
        registered = {id(p) for p in self.model.parameters()}
        for index, param in enumerate(self.table.params):
            wrappers = param.flat is not None and not self.table.own_view(index)
            if not wrappers and id(param.tensor) not in registered:
                wrapped_models.mark_stale(param.tensor, param.name)
        wrapped_models.bump_generation()

    # ------------------------------------------------------------------ stats

    @property
    def stats(self) -> StepStats | None:
        """Communication figures of the last backward pass (``None`` before the first)."""
        return self.runtime.stats

    def __repr__(self) -> str:
        return (
            f"FlatView(backend={self.adapter.backend}, units={len(self.table.units)}, "
            f"params={len(self.table)}, numel={self.numel()}, "
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
        optimizer), including parameters FSDP does not flatten. On a model with experts
        (units on process groups of their own) each rank's dict holds the shared
        parameters and its own expert group's experts, and names that group: save it on
        every rank (:mod:`flatview.expert_state`).

        A collective: every rank must call it, with its counterpart of the same
        optimizer, between iterations. It all-gathers a small description of each
        rank's state, then the per-element state of sharded parameters, packed, one
        collective per bucket and dtype. When every rank holds every parameter (torch
        ``NO_SHARD``, DDP) only the descriptions are exchanged, so that a rank refusing
        its optimizer raises on every rank; on one rank nothing is communicated.

        Args:
            optimizer: an optimizer over views and other parameters of this model
                (:meth:`parameters`, ``submodule.parameters()``).
            rank0_only: assemble the full tensors on rank 0 only (the others join the
                collectives and receive nothing); other ranks get the same
                ``param_groups`` and an empty ``state``. Under hybrid sharding rank 0
                is global rank 0 (not every replica's first shard rank).

        Returns:
            The consolidated state dict, for :meth:`load_optim_state_dict`.

        Raises:
            flatview.OptimStateError: the optimizer holds a tensor that is
                not one of this model's parameters (a flat parameter, say), or state
                that cannot be cut into pieces (neither per-element nor scalar), on any
                rank; or ranks hold different parameters or state, disagree on a
                scalar such as ``step``, or pass different ``rank0_only``; or
                ``rank0_only=True`` on a model with experts (units on process groups of
                their own, whose dicts differ by expert group and name it:
                :mod:`flatview.expert_state`). Raised on every rank alike (the message
                names the rank), after the exchange of descriptions and before any state
                tensor moves.
        """
        return consolidated(self.runtime, optimizer, rank0_only=rank0_only)

    def load_optim_state_dict(
        self,
        optimizer: torch.optim.Optimizer,
        state_dict: dict[str, Any],
        *,
        regroup: bool = False,
    ) -> None:
        """Load a state from :meth:`optim_state_dict` into an optimizer over this model's
        views: each rank takes its piece of every per-element tensor, then calls
        ``optimizer.load_state_dict``.

        The state may come from any world size and any backend or sharding strategy;
        training resumes exactly where it was saved. Parameters are matched by name
        within each parameter group (hyperparameters come from the state dict, as with
        ``optimizer.load_state_dict``). Every rank needs the full dict (load the same
        file everywhere); nothing is communicated.

        On fairscale it also takes what bare fairscale's ``gather_full_optim_state_dict``
        saved before the model was wrapped (a state by position, one parameter group):
        positions are those of fairscale's units in module order, converted to names,
        so a run that fairscale alone started resumes under flatview. The model must
        have the units it was saved with.

        Args:
            optimizer: an optimizer built like the saved one, over this model's views.
            state_dict: the consolidated state.
            regroup: take only the per-parameter state from the dict, by name, and keep
                the optimizer's own parameter groups and hyperparameters: a state saved
                with other groups loads, such as one group (bare fairscale's) into an
                optimizer that exempts biases from weight decay, or one optimizer's
                state over the whole model into per-submodule optimizers (each takes the
                parameters it holds). Every parameter the optimizer holds must be listed
                in the dict's groups.

        Raises:
            flatview.OptimStateError: the optimizer holds a tensor that is
                not one of this model's parameters; the dict names parameters this model
                does not have, lacks ones the optimizer holds, or has a different number
                of parameter groups (unless ``regroup``); or a per-element tensor does
                not have its parameter's shape; or a state by position (fairscale's)
                does not fit this model's fairscale units; or it was saved on another
                expert group than this rank's. Nothing is loaded then.
        """
        state_dict = loadable(self.table, self._modules, self.adapter.backend, state_dict)
        load_consolidated(self.table, optimizer, state_dict, regroup=regroup)
