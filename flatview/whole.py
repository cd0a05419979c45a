"""Whole-matrix optimizers over sharded views: :class:`Whole`.

An elementwise optimizer (SGD, Adam) is exact on a piece of a parameter; an
orthogonalising one is not. ``torch.optim.Muon`` runs a Newton-Schulz iteration on each
weight matrix, Shampoo-style preconditioners factor it: they need the whole matrix,
and a partial view holds a 1-D slice of one rank's shard. :class:`Whole` runs an
unmodified torch optimizer on whole matrices over the shards:

* Each parameter is stepped as one or more matrices (a 3-D expert tensor as one per
  expert, attention projections per head with ``heads=``; see
  :mod:`flatview.whole_members`). Every matrix has one *owner* rank, chosen by the cost
  of its Newton-Schulz iteration (``m * n * min(m, n)``), largest first: the rank that
  holds it (or most of it) while that rank's cost stays near the mean, the least loaded
  rank otherwise. A matrix its owner holds wholly (a FULL view; every matrix on DDP,
  ``NO_SHARD`` or one rank, where each rank steps its own copy) is stepped in place:
  nothing is communicated. A matrix that *travels* (its owner lacks some of it) is
  stepped on a *whole copy* the owner keeps with the inner optimizer's state: memory
  stays sharded.
* A step sends each holder's slices of the travelling matrices' gradients to their
  owners and every holder its slices of the updated values back, by all-to-alls
  (:mod:`flatview.whole_exchange`); an owner's own slice never travels, so each element
  crosses the network at most once each way. With ``overlap`` (the default on
  accelerators) the travelling matrices are cut into buckets: all inbound exchanges
  start at once, matrices held wholly here are stepped while they travel, and while
  the owner steps one bucket the next bucket's gradients and the last bucket's updates
  travel. Without it (the default on CPUs, where measured it gained nothing: gloo's
  threads and the owners' steps share the same cores) one exchange goes each way
  around the whole step.
* Owners step with the inner optimizer's own ``step()``, so each matrix gets torch's
  arithmetic bit for bit. ``stacked=True`` (``torch.optim.Muon`` only) orthogonalises
  same-shape matrices together instead
  (:func:`flatview.whole_stacked.stacked_muon_step`): fewer, larger products, which round
  otherwise than torch's, within bfloat16's rounding.
* Experts (units on process groups of their own) are owned and exchanged within their
  own group, the other parameters within the root's (:mod:`flatview.whole_domains`).
* A tiny all-reduce first tells every rank which parameters with travelling matrices have a
  gradient anywhere (skipped and frozen ones have none: no communication, the inner
  optimizer leaves them alone, as torch's would) and whether any holder's piece changed
  outside this optimizer since its last step (a model ``load_state_dict``, a write
  through ``.data``): the owners then refresh their whole copies first.
* The inner optimizer's state is made eagerly (:mod:`flatview.whole_state`), so that
  distributed checkpoints of it are valid whichever matrices had gradients.

Tensor roles (beside those of :mod:`flatview.views`)
----------------------------------------------------
whole copy
    The owner's full-shape tensor of a travelling matrix: what the inner optimizer steps.
whole gradient
    Its gradient for one step, assembled from every holder's slice, freed after the step.
alias
    A matrix-shaped leaf over this rank's own storage of a matrix it holds wholly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from flatview import expert_state, wrapped_models
from flatview.backends.base import UnitGroup, is_rank0
from flatview.comm.ledger import Ledger
from flatview.errors import OptimStateError
from flatview.local_tensors import local_tensor
from flatview.whole_domains import Domain
from flatview.whole_exchange import Kind, Transfer, check_same_everywhere
from flatview.whole_members import (
    EVERY_RANK,
    Matrix,
    Member,
    cut_all,
    probe,
    requires_closure,
)
from flatview.whole_stacked import stacked_muon_step
from flatview.whole_state import consolidated, knows_fresh_state, load, make_eager
from flatview.whole_state import sharded as sharded_state

if TYPE_CHECKING:
    from flatview.handle import FlatView


class Whole(torch.optim.Optimizer):
    """A torch optimizer run on whole matrices of original parameters over flat shards.

    ``Whole(torch.optim.Muon, fv, matrices, lr=0.02, momentum=0.95)`` behaves like
    ``torch.optim.Muon(matrices, lr=0.02, momentum=0.95)`` on the unwrapped model:
    each matrix is stepped whole by one owner rank (see the module docstring), and
    every rank's view is updated in place. Any optimizer whose state is per parameter
    works (Muon, Adafactor, AdamW, SGD, ...); one that needs a closure (LBFGS) is
    refused. A 3-D parameter ``(n, rows, cols)`` (experts stored as one tensor) is
    stepped as ``n`` matrices, as ``torch.optim.Muon`` over each ``param[i]`` would.
    Experts of units on process groups of their own are stepped within their group.

    Construction, :meth:`step`, :meth:`state_dict` and :meth:`load_state_dict` are
    collectives where the model is sharded: every rank calls them, with the same
    parameters, groups and options. On DDP, ``NO_SHARD`` and one rank (every view
    full) it is the inner optimizer itself, with no communication.

    Args:
        optimizer_cls: the torch optimizer class (``torch.optim.Muon``).
        fv: the wrapped model the parameters belong to.
        params: views or parameters of ``fv`` (``fv.parameters()``,
            ``submodule.parameters()``), or parameter groups (dicts with ``"params"``).
        heads: per parameter (a view or its original name), a number of heads: its
            rows (of each expert, for a 3-D parameter) are cut into that many equal
            blocks, each stepped as a matrix of its own (per-head Muon for query, key and
            value projections, whose rows are heads times head size).
        overlap: pipeline the exchanges with the owners' steps (see the module
            docstring); by default on accelerators, not on CPUs.
        stacked: orthogonalise same-shape matrices together
            (:mod:`flatview.whole_stacked`; ``torch.optim.Muon`` only). Off by default:
            its batched products are not torch's single ones and round otherwise
            (within bfloat16's rounding, up to about ``lr / 30`` per element and step),
            while the default steps ``Muon.step()`` itself, bit for bit.
        **optimizer_kwargs: the inner optimizer's arguments.

    Raises:
        flatview.OptimStateError: a tensor that is not an original parameter of ``fv``
            (a parameter of another model or FlatView, a flat parameter), a parameter
            given twice, a parameter the inner optimizer refuses (Muon: not 2-D or 3-D;
            named), ``heads`` that do not divide a parameter's rows or name no parameter
            given, ``stacked=True`` for another optimizer, an optimizer that needs a
            closure, or ranks that passed different parameters or options.
    """

    def __init__(
        self,
        optimizer_cls: type[torch.optim.Optimizer],
        fv: FlatView,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        *,
        heads: Mapping[torch.Tensor | str, int] | None = None,
        overlap: bool | None = None,
        stacked: bool | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        if requires_closure(optimizer_cls):
            raise OptimStateError(
                f"{optimizer_cls.__name__} needs a closure and keeps state across "
                "parameters; flatview.optim.Whole runs optimizers whose state is per "
                "parameter"
            )
        if stacked and optimizer_cls is not torch.optim.Muon:
            raise OptimStateError(
                f"stacked=True orthogonalises as torch.optim.Muon does; {optimizer_cls.__name__} "
                "is stepped by its own step()"
            )
        self.fv = fv
        self.optimizer_cls = optimizer_cls
        self.overlap = fv.adapter.device.type != "cpu" if overlap is None else overlap
        self.stacked = bool(stacked)
        self.ledger = Ledger()
        """Bytes and calls of the last :meth:`step`'s collectives."""
        adapter = fv.adapter
        self._group = adapter.group
        self._rank = adapter.rank
        self._rank0 = is_rank0(adapter)
        self._world = adapter.world_size
        self._device = adapter.device
        # Sharded models exchange with every step; the same on every rank (the layouts
        # are).
        sharded = self._world > 1 and any(fv.placement(p).sharded for _, p in fv.named_parameters())
        self._root = Domain(self._group, self._rank, self._world, sharded=sharded, expert=False)
        self._domains = [self._root]
        user_groups: list[dict[str, Any]] = []
        self._members: list[Member] = []
        raw = list(params)
        groups = raw if raw and isinstance(raw[0], dict) else [{"params": raw}]
        seen: set[int] = set()
        for number, group in enumerate(groups):
            if not isinstance(group, dict):
                raise OptimStateError("parameter groups must all be dicts, or none of them")
            tensors = group["params"]
            tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
            for tensor in tensors:
                self._members.append(self._member(tensor, number, seen))
            user_groups.append(
                {**{k: v for k, v in group.items() if k != "params"}, "params": tensors}
            )
        if not self._members:
            raise OptimStateError("flatview.optim.Whole got an empty parameter list")
        self._heads = cut_all(self._members, heads or {}, self._world)
        self._matrices = [m for member in self._members for m in member.matrices]
        for domain in self._domains:
            domain.settle(self.overlap)
        by_group: list[list[tuple[str, torch.Size, torch.dtype]]] = [[] for _ in groups]
        for m in self._matrices:
            by_group[m.member.group].append((m.name, m.shape, m.member.tensor.dtype))
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in user_groups]
        probe(optimizer_cls, by_group, hyper, optimizer_kwargs)
        self._travelling = [m for domain in self._domains for m in domain.travelling]
        for m in self._travelling:
            if m.owned_here:
                like = local_tensor(m.member.tensor)
                m.whole = nn.Parameter(torch.zeros(m.shape, dtype=like.dtype, device=like.device))
        # The inner optimizer over what this rank steps: whole copies of the travelling
        # matrices it owns, and aliases of those wholly here.
        inner_groups = [
            {
                **h,
                "params": [t for m in self._matrices if m.member.group == i for t in self._run(m)],
            }
            for i, h in enumerate(hyper)
        ]
        failure: Exception | None = None
        try:
            self.inner = optimizer_cls(inner_groups, **optimizer_kwargs)
            """The torch optimizer this rank steps (over whole copies and aliases)."""
            wrapped_models.own_optimizer(self.inner)
            make_eager(self.inner)
        except Exception as err:  # raised below, on every rank
            failure = err
        # Every rank of a sharded model takes part in the check of the parameter lists,
        # which also carries what failed on one rank only.
        if self._root.sharded:
            facts = (
                [(m.name, tuple(m.shape), m.group, str(m.tensor.dtype)) for m in self._members],
                sorted(self._heads.items()),
                self.overlap,
                self.stacked,
            )
            check_same_everywhere(repr(facts), failure, optimizer_cls.__name__, self._group)
        if failure is not None:
            raise OptimStateError(
                f"{optimizer_cls.__name__} could not be built over this rank's part: {failure}"
            ) from failure
        # param_groups over the views, with the inner optimizer's defaults filled in (LR
        # schedulers change them there; every step copies them to the inner groups).
        super().__init__(user_groups, self.inner.defaults)
        for domain in self._domains:
            if domain.travelling:
                domain.exchange(domain.travelling, Kind.VALUE, self.ledger)
                domain.note_checksums()

    # ---------------------------------------------------------------- building

    def _member(self, tensor: object, group: int, seen: set[int]) -> Member:
        fv = self.fv
        if not isinstance(tensor, torch.Tensor):
            raise OptimStateError(
                f"flatview.optim.Whole takes tensors, got {type(tensor).__name__}: {tensor!r}"
            )
        index = fv.table.index_of(tensor)
        if index is None:
            raise OptimStateError(
                f"flatview.optim.Whole was given a {type(tensor).__name__} of shape "
                f"{tuple(tensor.shape)} that is not an original parameter of {fv!r} (a "
                "parameter of another model or FlatView, or a flat parameter); give it "
                "views from that FlatView's parameters()"
            )
        if id(tensor) in seen:
            raise OptimStateError(
                f"parameter {fv.table.name(index)!r} is given to flatview.optim.Whole twice"
            )
        seen.add(id(tensor))
        unit_group = fv.table.own_group(index)
        domain = self._root if unit_group is None else self._expert_domain(unit_group)
        placement = fv.placement(tensor)
        if placement.sharded:
            assert placement.layout is not None and placement.layout.world_size == domain.world
            pieces = tuple(placement.piece(r).param_interval for r in range(domain.world))
        else:
            pieces = ((0, placement.numel),) * domain.world
        assert isinstance(tensor, nn.Parameter)
        rank = domain.rank if placement.sharded else 0
        member = Member(fv.table.name(index), tensor, placement, group, rank, pieces)
        domain.members.append(member)
        return member

    def _expert_domain(self, unit_group: UnitGroup) -> Domain:
        """The domain of this rank's expert units (one group per rank, checked at wrap)."""
        for domain in self._domains:
            if domain.expert and domain.group is unit_group.group:
                return domain
        world = unit_group.world_size
        domain = Domain(unit_group.group, unit_group.rank, world, sharded=world > 1, expert=True)
        self._domains.append(domain)
        return domain

    def _run(self, m: Matrix) -> list[torch.Tensor]:
        """What this rank's inner optimizer steps for ``m`` (nothing or one tensor)."""
        if m.whole is not None:
            return [m.whole]
        if (m.owner != EVERY_RANK and not m.owned_here) or m.travels:
            return []
        if m.alias is None:
            # Always an alias, also of a plain parameter of the matrix's shape: its
            # gradient is bound only while this optimizer steps it (a bucketed step
            # calls the inner optimizer several times).
            local = m.local(m.member.tensor)
            assert local is not None
            m.alias = local.view(m.shape)
        return [m.alias]

    def _stepped(self, m: Matrix) -> torch.Tensor | None:
        run = self._run(m)
        return run[0] if run else None

    # ---------------------------------------------------------------- stepping

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One step of the inner optimizer on every whole matrix (a collective where
        the model is sharded). ``closure``, as torch's optimizers take it (Lightning's
        automatic optimization passes one): called first, with gradients on; its loss
        is returned."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.ledger.reset()
        for group, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            for key, value in group.items():
                if key != "params":
                    inner[key] = value
        local = [m for m in self._matrices if not m.travels and m.alias is not None]
        self._bind(local)
        if not self._travelling:
            self._step_inner(local)
            return loss
        moving = [
            (domain, domain.agree_on_flags(self.ledger, self._device))
            for domain in self._domains
            if domain.travelling
        ]
        if not self.overlap:
            # Every rank joins the inbound exchanges right after the flags (not after
            # stepping its own matrices first, which would make them wait for the
            # slowest rank's), then steps everything at once (one stack per shape).
            for domain, matrices in moving:
                if matrices:
                    domain.exchange(matrices, Kind.GRAD, self.ledger)
            self._step_inner([*local, *(m for _, matrices in moving for m in matrices)])
            for domain, matrices in moving:
                if matrices:
                    domain.exchange(matrices, Kind.UPDATE, self.ledger)
        else:
            parts: list[tuple[Domain, list[Matrix]]] = []
            for domain, matrices in moving:
                chosen = {id(m.member) for m in matrices}
                for bucket in domain.buckets:
                    part = [m for m in bucket if id(m.member) in chosen]
                    if part:
                        parts.append((domain, part))
            inbound_parts = [domain.transfer(b, Kind.GRAD, self.ledger) for domain, b in parts]
            # Matrices held wholly here are stepped while the first bucket travels.
            self._step_inner(local)
            outbound: list[Transfer] = []
            for (domain, bucket), transfer in zip(parts, inbound_parts, strict=True):
                transfer.finish()
                self._step_inner(bucket)
                outbound.append(domain.transfer(bucket, Kind.UPDATE, self.ledger))
            for transfer in outbound:
                transfer.finish()
        for domain in self._domains:
            domain.note_checksums()
        return loss

    def _bind(self, matrices: Sequence[Matrix]) -> None:
        """Point the aliases of ``matrices`` at their views' storage and gradient (the
        storage can move, as on ``.to()``)."""
        for m in matrices:
            local = m.local(m.member.tensor)
            assert local is not None and m.alias is not None
            m.alias.data = local.view(m.shape)
            grad = m.local(m.member.tensor.grad)
            m.alias.grad = None if grad is None else grad.view(m.shape)

    def _step_inner(self, matrices: Sequence[Matrix]) -> None:
        """Step the inner optimizer on those of ``matrices`` this rank steps and that
        have a gradient, then drop their gradients."""
        tensors = []
        for m in matrices:
            tensor = self._stepped(m)
            if tensor is not None and tensor.grad is not None:
                tensors.append(tensor)
        chosen = {id(t) for t in tensors}
        if self.stacked and tensors:
            stacked_muon_step(self.inner, chosen)
        elif tensors:
            # The inner optimizer steps every tensor with a gradient: others' gradients
            # (whole gradients of buckets still arriving) are set aside meanwhile.
            aside = [
                (p, p.grad)
                for group in self.inner.param_groups
                for p in group["params"]
                if p.grad is not None and id(p) not in chosen
            ]
            for p, _ in aside:
                p.grad = None
            try:
                self.inner.step()
            finally:
                for p, grad in aside:
                    p.grad = grad
        for tensor in tensors:
            tensor.grad = None

    # ---------------------------------------------------------------- state

    @property
    def owner_costs(self) -> list[int]:
        """Per rank of the root's group, the Newton-Schulz cost (``m * n * min(m, n)``
        summed) of the matrices it owns, travelling or held; the same on every rank.
        ``max / mean`` is how evenly the owners' steps are balanced."""
        return list(self._root.owner_costs)

    def state_dict(self, *, rank0_only: bool = False) -> dict[str, Any]:
        """The state by original name, whole tensors, as
        :meth:`flatview.FlatView.optim_state_dict` gives for any optimizer over views
        (loadable at any world size and backend, into a :class:`Whole` or a plain
        optimizer). A collective where the model is sharded. With experts on process
        groups of their own it holds the shared parameters and this rank's group's
        experts, and names that group (:mod:`flatview.expert_state`): save it on every
        rank; ``rank0_only=True`` is refused there."""
        everything = self._by_name(
            lambda d: consolidated(
                d.members, self.inner.state, self._stepped, d.rank, d.group, d.sharded
            )
        )
        if rank0_only:
            # After the exchange, which every rank joined: a rank raising before it
            # would leave the others waiting there.
            expert_state.refuse_rank0_only(self.fv.table, "flatview.optim.Whole.state_dict")
        if rank0_only and not self._rank0:
            everything = {}
        state = {"state": everything, "param_groups": self._groups_by_name()}
        return expert_state.tagged(state, self.fv.table)

    def sharded_state_dict(self, *, cpu_offload: bool = False) -> dict[str, Any]:
        """The state for :mod:`flatview.checkpoint`'s sharded form: per-element tensors
        of sharded parameters as ``ShardedTensor`` s whose local shards are each owner's
        own state tensors (``torch.distributed.checkpoint.load`` writes them in place),
        scalars alike on every rank. A collective where the model is sharded.

        Raises:
            flatview.OptimStateError: the inner optimizer's state is made lazily (not
                ``Muon``, ``Adam`` or ``AdamW``): a fresh optimizer would have no state
                for a checkpoint to load into. Use the full form.
        """
        if not knows_fresh_state(type(self.inner)):
            raise OptimStateError(
                f"flatview.optim.Whole over {self.optimizer_cls.__name__} makes its state "
                "lazily, so a fresh one has nothing a sharded checkpoint could load into: "
                "save the full form (StateDictOptions(full_state_dict=True)); the sharded "
                "form supports torch.optim.Muon, Adam and AdamW"
            )
        # Experts' ShardedTensors span their own group's ranks, keyed by
        # flatview.checkpoint under that group (flatview.checkpoint_experts).
        everything = self._by_name(
            lambda d: sharded_state(
                d.members,
                self.inner.state,
                self._stepped,
                d.rank,
                d.group,
                d.world,
                d.sharded,
                cpu_offload,
            )
        )
        return {"state": everything, "param_groups": self._groups_by_name()}

    def _by_name(self, per_domain: Callable[[Domain], dict[str, Any]]) -> dict[str, Any]:
        """Every domain's states (one collective each where sharded), in the members'
        order."""
        found: dict[str, Any] = {}
        for domain in self._domains:
            found.update(per_domain(domain))
        return {m.name: found[m.name] for m in self._members if m.name in found}

    def _groups_by_name(self) -> list[dict[str, Any]]:
        names = {id(m.tensor): m.name for m in self._members}
        return [
            {
                **{k: v for k, v in inner_group.items() if k != "params"},
                "params": [names[id(t)] for t in group["params"]],
            }
            for group, inner_group in zip(self.param_groups, self.inner.param_groups, strict=True)
        ]

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state from :meth:`state_dict`, :meth:`flatview.FlatView.optim_state_dict`
        (any world size or backend) or :meth:`sharded_state_dict` (filled by
        ``torch.distributed.checkpoint.load``): each owner takes the state of what it
        steps. Every rank needs the dict; nothing is communicated."""
        expert_state.check(state_dict, self.fv.table)
        load(
            self._members,
            self._matrices,
            self.inner,
            self._stepped,
            self.param_groups,
            state_dict,
        )

    def consolidated_state_dict(self, *, rank0_only: bool = False) -> dict[str, Any]:
        """What :meth:`flatview.FlatView.optim_state_dict` returns for this optimizer."""
        return self.state_dict(rank0_only=rank0_only)

    def load_consolidated_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """What :meth:`flatview.FlatView.load_optim_state_dict` does for this optimizer."""
        self.load_state_dict(state_dict)

    def __repr__(self) -> str:
        owned = sum(m.numel for m in self._matrices if m.owned_here)
        return (
            f"Whole({self.optimizer_cls.__name__}, params={len(self._members)}, "
            f"matrices={len(self._matrices)}, travelling={len(self._travelling)}, "
            f"owned_elements={owned}, rank={self._rank})"
        )
