"""Whole-parameter optimizers over sharded views: :class:`Whole`.

An elementwise optimizer (SGD, Adam) is exact on a piece of a parameter; an
orthogonalising one is not. ``torch.optim.Muon`` runs a Newton-Schulz iteration on each
weight matrix, Shampoo-style preconditioners factor it: they need the whole matrix,
and a partial view holds a 1-D slice of one rank's shard. :class:`Whole` runs an
unmodified torch optimizer on whole parameters over the shards:

* Every parameter has one *owner* rank. A parameter whose elements all live on one rank
  (a FULL view, or a replicated one: DDP, ``NO_SHARD``) is stepped where it lives, on the
  view itself: nothing is communicated. A parameter split over several ranks goes to
  the rank with the least owned elements so far (largest parameters first), which keeps
  a *whole copy* of it, and the inner optimizer's state for it: memory stays sharded,
  each rank holding the state of about ``1/world`` of the elements.
* A step sends each holder's piece of every split parameter's gradient to its owner
  (one ``all_to_all_single`` per dtype for all of them), the owner steps the inner
  optimizer on its whole copies, and sends every holder its piece of the updated values
  (a second ``all_to_all_single``). The owner's own piece never travels, so each
  gradient and update element crosses the network at most once each way. A tiny
  all-reduce first tells every rank which split parameters have a gradient anywhere
  (skipped and frozen ones have none: no communication, the inner optimizer leaves them
  alone, as torch's would) and whether any holder's piece changed outside this
  optimizer since its last step (a model ``load_state_dict``, a write through
  ``.data``): the owner then refreshes its whole copy from the pieces in the same
  exchange, instead of training on stale values.

Tensor roles (beside those of :mod:`flatview.views`)
----------------------------------------------------
whole copy
    The owner's full-shape tensor of a split parameter: what the inner optimizer steps.
whole gradient
    Its gradient for one step, assembled from every holder's piece, freed after the step.
piece
    One rank's elements of the parameter, as its view (or torch's) holds them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from flatview.backends.base import is_rank0
from flatview.comm.collectives import all_reduce_max, all_to_all, gather_objects
from flatview.comm.ledger import Ledger
from flatview.errors import OptimStateError
from flatview.layout import Interval
from flatview.local_tensors import local_tensor
from flatview.optim_state import snapshot
from flatview.whole_members import (
    EVERY_RANK,
    Member,
    assign_owners,
    checksum,
    probe,
    requires_closure,
    whole_shaped,
)

if TYPE_CHECKING:
    from flatview.handle import FlatView


class Whole(torch.optim.Optimizer):
    """A torch optimizer run on whole original parameters over flat shards.

    ``Whole(torch.optim.Muon, fv, matrices, lr=0.02, momentum=0.95)`` behaves like
    ``torch.optim.Muon(matrices, lr=0.02, momentum=0.95)`` on the unwrapped model:
    each parameter is stepped whole by one owner rank (see the module docstring), and
    every rank's view is updated in place. Any optimizer whose state is per parameter
    works (Muon, Adafactor, AdamW, SGD, ...); one that needs a closure (LBFGS) is
    refused.

    Construction, :meth:`step`, :meth:`state_dict` and :meth:`load_state_dict` are
    collectives where the model is sharded: every rank calls them, with the same
    parameters in the same groups. On DDP, ``NO_SHARD`` and one rank (every view
    full) it is the inner optimizer itself, with no communication.

    Args:
        optimizer_cls: the torch optimizer class (``torch.optim.Muon``).
        fv: the wrapped model the parameters belong to.
        params: views or parameters of ``fv`` (``fv.parameters()``,
            ``submodule.parameters()``), or parameter groups (dicts with ``"params"``).
        **optimizer_kwargs: the inner optimizer's arguments.

    Raises:
        flatview.OptimStateError: a tensor that is not an original parameter of ``fv``
            (a parameter of another model or FlatView, a flat parameter), a parameter
            given twice, a parameter the inner optimizer refuses (Muon: not 2-D; named),
            an optimizer that needs a closure, or ranks that passed different
            parameters.
    """

    def __init__(
        self,
        optimizer_cls: type[torch.optim.Optimizer],
        fv: FlatView,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        **optimizer_kwargs: Any,
    ) -> None:
        if requires_closure(optimizer_cls):
            raise OptimStateError(
                f"{optimizer_cls.__name__} needs a closure and keeps state across "
                "parameters; flatview.optim.Whole runs optimizers whose state is per "
                "parameter"
            )
        self.fv = fv
        self.optimizer_cls = optimizer_cls
        self.ledger = Ledger()
        """Bytes and calls of the last :meth:`step`'s collectives."""
        adapter = fv.adapter
        self._group = adapter.group
        self._rank = adapter.rank
        self._rank0 = is_rank0(adapter)
        self._world = adapter.world_size
        self._device = adapter.device
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
        by_group: list[list[tuple[str, torch.Size, torch.dtype]]] = [[] for _ in groups]
        for m in self._members:
            by_group[m.group].append((m.name, m.shape, m.tensor.dtype))
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in user_groups]
        probe(optimizer_cls, by_group, hyper, optimizer_kwargs)
        self._assign_owners()
        self._split = [m for m in self._members if m.split]
        for m in self._split:
            if m.owner == self._rank:
                m.whole = nn.Parameter(
                    torch.zeros(m.shape, dtype=m.tensor.dtype, device=m.tensor.device)
                )
        # The inner optimizer over what this rank steps: whole copies of the split
        # parameters it owns, and the views of those wholly on this rank.
        inner_groups = [
            {**h, "params": [t for m in self._members if m.group == i for t in self._run(m)]}
            for i, h in enumerate(hyper)
        ]
        failure: Exception | None = None
        try:
            self.inner = optimizer_cls(inner_groups, **optimizer_kwargs)
            """The torch optimizer this rank steps (over whole copies and whole views)."""
        except Exception as err:  # raised below, on every rank
            failure = err
        # Sharded models exchange with every step; the same on every rank (the layouts
        # are), so every rank takes part in the check of the parameter lists, which also
        # carries what failed on one rank only.
        self._sharded = self._world > 1 and any(
            fv.placement(p).sharded for _, p in fv.named_parameters()
        )
        if self._sharded:
            self._check_same_everywhere(failure)
        if failure is not None:
            raise OptimStateError(
                f"{optimizer_cls.__name__} could not be built over this rank's part: {failure}"
            ) from failure
        # param_groups over the views, with the inner optimizer's defaults filled in (LR
        # schedulers change them there; every step copies them to the inner groups).
        super().__init__(user_groups, self.inner.defaults)
        if self._split:
            self._exchange(resync=list(self._split), grads=[], update=False)

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
        placement = fv.placement(tensor)
        if placement.sharded:
            pieces = tuple(placement.piece(r).param_interval for r in range(self._world))
        else:
            pieces = ((0, placement.numel),) * self._world
        split = placement.sharded and sum(1 for s, e in pieces if e > s) > 1
        assert isinstance(tensor, nn.Parameter)
        return Member(fv.table.name(index), tensor, placement, group, EVERY_RANK, pieces, split)

    def _assign_owners(self) -> None:
        """Owners for every member (see :func:`flatview.whole_members.assign_owners`)."""
        assign_owners(self._members, self._world)

    def _check_same_everywhere(self, failure: Exception | None) -> None:
        description = repr(
            [(m.name, tuple(m.shape), m.group, str(m.tensor.dtype)) for m in self._members]
        )
        digest = hashlib.blake2b(description.encode(), digest_size=8).hexdigest()
        mine = (digest, None if failure is None else f"{type(failure).__name__}: {failure}")
        everyone = gather_objects(mine, self._group)
        failed = [(r, message) for r, (_, message) in enumerate(everyone) if message]
        if failed:
            rank, message = failed[0]
            raise OptimStateError(
                f"{self.optimizer_cls.__name__} could not be built on rank {rank}: {message}"
            ) from failure
        digests = [d for d, _ in everyone]
        if len(set(digests)) > 1:
            differ = [r for r, d in enumerate(digests) if d != digests[0]]
            raise OptimStateError(
                f"ranks built flatview.optim.Whole over different parameters (rank(s) "
                f"{differ} differ from rank 0); every rank must pass the same parameters "
                "in the same groups"
            )

    def _run(self, m: Member) -> list[torch.Tensor]:
        """What this rank's inner optimizer steps for ``m``."""
        if m.whole is not None:
            return [m.whole]
        if m.owner not in (EVERY_RANK, self._rank) or m.split:
            return []
        local = local_tensor(m.tensor)
        if local is m.tensor and m.tensor.shape == m.shape:
            return [m.tensor]
        # FSDP2's DTensor, though wholly here, would communicate in every operation
        # the inner optimizer runs on it (on this rank only: a hang): its local tensor.
        if m.alias is None:
            m.alias = local.detach().view(m.shape)
        return [m.alias]

    def _bind_aliases(self) -> None:
        """Point each alias at its view's current storage and gradient (the storage can
        move, as on ``.to()``)."""
        for m in self._members:
            if m.alias is not None:
                m.alias.data = local_tensor(m.tensor).detach().view(m.shape)
                grad = m.tensor.grad
                m.alias.grad = None if grad is None else local_tensor(grad).detach().view(m.shape)

    # ---------------------------------------------------------------- stepping

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One step of the inner optimizer on every whole parameter (a collective where
        the model is sharded)."""
        if closure is not None:
            raise OptimStateError("flatview.optim.Whole.step takes no closure")
        self.ledger.reset()
        for group, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            for key, value in group.items():
                if key != "params":
                    inner[key] = value
        grads: list[Member] = []
        if self._split:
            flags = torch.zeros(2 * len(self._split), dtype=torch.int32, device=self._device)
            for position, m in enumerate(self._split):
                flags[2 * position] = m.tensor.grad is not None
                piece = m.local(m.tensor)
                # A rank holding nothing of it has nothing that could have changed.
                changed = piece is not None and piece.numel() > 0 and m.checksum != checksum(piece)
                flags[2 * position + 1] = changed
            self.ledger.record("all_reduce", flags)
            all_reduce_max(flags, self._group)
            found = flags.tolist()
            grads = [m for i, m in enumerate(self._split) if found[2 * i]]
            stale = [m for i, m in enumerate(self._split) if found[2 * i + 1]]
            self._exchange(resync=stale, grads=grads, update=False)
        self._bind_aliases()
        self.inner.step()
        if self._split:
            self._exchange(resync=[], grads=grads, update=True)
            for m in grads:
                if m.whole is not None:
                    m.whole.grad = None

    def _exchange(self, resync: list[Member], grads: list[Member], update: bool) -> None:
        """One ``all_to_all_single`` per dtype. Inbound (``update=False``): every holder
        sends each owner its pieces of the values of ``resync`` and of the gradients of
        ``grads``. Outbound: each owner sends every holder its piece of the updated
        values of ``grads``. A rank's pieces of what it owns are copied, not sent."""
        moves: list[tuple[Member, str]] = [(m, "value") for m in resync]
        moves += [(m, "update" if update else "grad") for m in grads]
        for dtype in sorted({str(m.tensor.dtype) for m, _ in moves}):
            self._exchange_dtype([(m, k) for m, k in moves if str(m.tensor.dtype) == dtype])

    def _exchange_dtype(self, moves: list[tuple[Member, str]]) -> None:
        rank, world = self._rank, self._world
        send: list[list[torch.Tensor]] = [[] for _ in range(world)]
        receive: list[list[tuple[Member, str, int, Interval]]] = [[] for _ in range(world)]
        for m, kind in moves:
            if kind == "update":
                # Owner -> holders.
                if m.owner == rank:
                    assert m.whole is not None
                    values = m.whole.detach().reshape(-1)
                    for r, (start, end) in enumerate(m.pieces):
                        if end > start and r != rank:
                            send[r].append(values[start:end])
                    self._write_own(m)
                else:
                    start, end = m.pieces[rank]
                    if end > start:
                        receive[m.owner].append((m, kind, end - start, (start, end)))
                continue
            # Holders -> owner.
            start, end = m.pieces[rank]
            if m.owner != rank:
                if end > start:
                    send[m.owner].append(self._outgoing(m, kind))
                continue
            for r, (lo, hi) in enumerate(m.pieces):
                if hi > lo and r != rank:
                    receive[r].append((m, kind, hi - lo, (lo, hi)))
            if end > start:
                self._place(m, kind, (start, end), self._outgoing(m, kind))
        # The local tensor: slicing FSDP2's DTensor would communicate, on the ranks with
        # nothing to send only (a hang).
        template = local_tensor(moves[0][0].tensor)
        in_splits = [sum(t.numel() for t in chunk) for chunk in send]
        out_splits = [sum(n for _, _, n, _ in chunk) for chunk in receive]
        # Every rank joins, also one with nothing to send or receive: which parameters
        # move is the same everywhere, what each rank holds of them is not.
        outgoing = torch.cat([t.reshape(-1) for chunk in send for t in chunk] or [template[:0]])
        incoming = outgoing.new_empty(sum(out_splits))
        self.ledger.record("all_to_all", outgoing)
        all_to_all(incoming, outgoing, out_splits, in_splits, self._group)
        offset = 0
        for chunk in receive:
            for m, kind, numel, interval in chunk:
                self._place(m, kind, interval, incoming[offset : offset + numel])
                offset += numel

    def _outgoing(self, m: Member, kind: str) -> torch.Tensor:
        """This rank's piece of ``m``'s value or gradient, 1-D."""
        source = m.tensor if kind == "value" else m.tensor.grad
        piece = m.local(source)
        if piece is None:
            # A holder without a gradient where another rank has one (torch's views
            # outside the shard): its part counts as zeros.
            start, end = m.pieces[self._rank]
            return torch.zeros(end - start, dtype=m.tensor.dtype, device=m.tensor.device)
        if kind == "value":
            m.checksum = checksum(piece)
        return piece

    def _place(self, m: Member, kind: str, interval: Interval, values: torch.Tensor) -> None:
        start, end = interval
        if kind == "update":
            piece = m.local(m.tensor)
            assert piece is not None
            piece.copy_(values)
            m.checksum = checksum(piece)
            return
        assert m.whole is not None
        if kind == "value":
            m.whole.detach().reshape(-1)[start:end].copy_(values)
            return
        if m.whole.grad is None:
            m.whole.grad = torch.zeros_like(m.whole)
        m.whole.grad.reshape(-1)[start:end].copy_(values)

    def _write_own(self, m: Member) -> None:
        """The owner's own piece of an updated whole copy, written into its view."""
        assert m.whole is not None
        start, end = m.pieces[self._rank]
        piece = m.local(m.tensor)
        if end > start and piece is not None:
            piece.copy_(m.whole.detach().reshape(-1)[start:end])
            m.checksum = checksum(piece)

    # ---------------------------------------------------------------- state

    def state_dict(self, *, rank0_only: bool = False) -> dict[str, Any]:
        """The state by original name, whole tensors, as
        :meth:`flatview.FlatView.optim_state_dict` gives for any optimizer over views
        (loadable at any world size and backend, into a :class:`Whole` or a plain
        optimizer). A collective where the model is sharded."""
        inner = self.inner.state
        mine: dict[str, dict[Any, Any]] = {}
        for m in self._members:
            if m.owner not in (self._rank, EVERY_RANK) or (
                m.owner == EVERY_RANK and self._sharded and self._rank != 0
            ):
                continue
            tensors = self._run(m)
            state = inner.get(tensors[0]) if tensors else None
            if state:
                mine[m.name] = {k: snapshot(v) for k, v in state.items()}
        everything = mine
        if self._sharded:
            gathered = gather_objects(mine, self._group)
            everything = {k: v for part in gathered for k, v in part.items()}
        if rank0_only and not self._rank0:
            everything = {}
        names = {id(m.tensor): m.name for m in self._members}
        groups = [
            {
                **{k: v for k, v in inner_group.items() if k != "params"},
                "params": [names[id(t)] for t in group["params"]],
            }
            for group, inner_group in zip(self.param_groups, self.inner.param_groups, strict=True)
        ]
        order = [m.name for m in self._members]
        return {
            "state": {n: everything[n] for n in order if n in everything},
            "param_groups": groups,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state from :meth:`state_dict` or :meth:`flatview.FlatView.optim_state_dict`
        (any world size or backend): each owner takes the whole state of what it steps.
        Every rank needs the full dict; nothing is communicated."""
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or len(groups) != len(self.param_groups):
            raise OptimStateError(
                f"the state dict has {len(groups) if isinstance(groups, list) else 'no'} "
                f"parameter groups, this optimizer {len(self.param_groups)}"
            )
        names = {id(m.tensor): m.name for m in self._members}
        for number, (saved, group) in enumerate(zip(groups, self.param_groups, strict=True)):
            want = [names[id(t)] for t in group["params"]]
            if list(saved.get("params", ())) != want:
                raise OptimStateError(
                    f"parameter group {number} of the state dict holds {saved.get('params')}, "
                    f"this optimizer's {want}"
                )
        states: Mapping[str, Mapping[Any, Any]] = state_dict.get("state", {})
        unknown = sorted(set(states) - set(names.values()))
        if unknown:
            raise OptimStateError(f"the state dict has state for unknown parameters {unknown}")
        inner_state: dict[int, dict[Any, Any]] = {}
        position = 0
        for m in self._members:
            for tensor in self._run(m):
                state = states.get(m.name)
                if state is not None:
                    inner_state[position] = {
                        k: whole_shaped(v, tensor, m.name, k) for k, v in state.items()
                    }
                position += 1
        inner_groups = []
        position = 0
        for saved, inner_group in zip(groups, self.inner.param_groups, strict=True):
            count = len(inner_group["params"])
            inner_groups.append(
                {
                    **{k: v for k, v in saved.items() if k != "params"},
                    "params": list(range(position, position + count)),
                }
            )
            position += count
        self.inner.load_state_dict({"state": inner_state, "param_groups": inner_groups})
        for saved, group in zip(groups, self.param_groups, strict=True):
            for key, value in saved.items():
                if key != "params":
                    group[key] = value

    def consolidated_state_dict(self, *, rank0_only: bool = False) -> dict[str, Any]:
        """What :meth:`flatview.FlatView.optim_state_dict` returns for this optimizer."""
        return self.state_dict(rank0_only=rank0_only)

    def load_consolidated_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """What :meth:`flatview.FlatView.load_optim_state_dict` does for this optimizer."""
        self.load_state_dict(state_dict)

    def __repr__(self) -> str:
        owned = sum(m.placement.numel for m in self._members if m.owner == self._rank)
        return (
            f"Whole({self.optimizer_cls.__name__}, params={len(self._members)}, "
            f"split={len(self._split)}, owned_elements={owned}, rank={self._rank})"
        )
