"""The exchanges of :class:`flatview.optim.Whole`: slices of travelling matrices between
their holders and their owners, and the buckets that pipeline them.

A :class:`Transfer` is one all-to-all of one :class:`Kind` over travelling matrices
(:func:`flatview.comm.slices.start_all_to_all`):

* ``VALUE`` and ``GRAD`` go in: every holder sends each matrix's owner its slice of the
  parameter's values (to refresh a stale whole copy) or of its gradient (zeros where a
  holder has none while another has one); the owner's own slice is copied, not sent;
* ``UPDATE`` goes out: each owner sends every holder its slice of the stepped whole
  copy, and writes its own slice in place.

Each element crosses the network at most once each way. :func:`buckets` cuts the
travelling matrices into the buckets a pipelined step exchanges one by one: in the
owners' order (largest cost first, so that same-shape matrices sit together and every
bucket gives every owner a share of the work), one dtype per bucket.
:func:`check_same_everywhere` is the construction's one exchange (every rank was given
the same parameters and options).
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from flatview.comm.consolidate import exchange
from flatview.comm.ledger import Ledger
from flatview.comm.slices import start_all_to_all
from flatview.errors import OptimStateError
from flatview.local_tensors import local_tensor
from flatview.whole_members import Matrix

BUCKETS = 4
"""Buckets a pipelined step cuts the travelling matrices into (fewer when there are fewer
than ``BUCKETS`` times the world size): the Newton-Schulz iterations of one overlap the
exchanges of the others; the first inbound and the last outbound one are exposed."""


class Kind(enum.Enum):
    """What a transfer carries."""

    VALUE = "value"
    GRAD = "grad"
    UPDATE = "update"


def buckets(
    travelling: Sequence[Matrix], world: int, count: int | None = None
) -> list[list[Matrix]]:
    """The travelling matrices in buckets of about equal cost (at least ``world`` matrices
    each), one dtype per bucket, in decreasing cost (the order owners were assigned)."""
    count = BUCKETS if count is None else count
    out: list[list[Matrix]] = []
    by_dtype: dict[torch.dtype, list[Matrix]] = {}
    for m in travelling:
        by_dtype.setdefault(m.member.tensor.dtype, []).append(m)
    for _, matrices in sorted(by_dtype.items(), key=lambda item: str(item[0])):
        ordered = sorted(matrices, key=lambda m: (-m.cost, m.member.name, m.number))
        parts = max(1, min(count, len(ordered) // max(world, 1)))
        share = sum(m.cost for m in ordered) / parts
        current: list[Matrix] = []
        filled = 0.0
        for m in ordered:
            current.append(m)
            filled += m.cost
            if filled >= share * (len(out) + 1) - 1e-9 and len(out) < parts - 1:
                out.append(current)
                current = []
        if current:
            out.append(current)
    return out


class Transfer:
    """One all-to-all of ``kind`` over ``matrices`` (see the module docstring), started
    at construction; :meth:`finish` waits for it and puts what arrived in place."""

    def __init__(
        self,
        matrices: Sequence[Matrix],
        kind: Kind,
        rank: int,
        world: int,
        group: dist.ProcessGroup | None,
        ledger: Ledger,
        *,
        async_op: bool,
    ) -> None:
        self.kind = kind
        self.rank = rank
        send: list[list[torch.Tensor]] = [[] for _ in range(world)]
        self._receive: list[list[Matrix]] = [[] for _ in range(world)]
        for m in matrices:
            if kind is Kind.UPDATE:
                self._plan_update(m, send)
            else:
                self._plan_inbound(m, send)
        counts = [
            sum(_width(m, self._slice_of(r)) for m in chunk)
            for r, chunk in enumerate(self._receive)
        ]
        # The local tensor: slicing FSDP2's DTensor would communicate, on the ranks with
        # nothing to send only (a hang).
        like = local_tensor(matrices[0].member.tensor)
        self._incoming, self._work, sent = start_all_to_all(
            send, counts, like, group, ledger, async_op=async_op
        )
        self._sent: torch.Tensor | None = sent

    def _plan_update(self, m: Matrix, send: list[list[torch.Tensor]]) -> None:
        if m.owner == self.rank:
            assert m.whole is not None
            values = m.whole.detach().reshape(-1)
            for r, (start, end) in enumerate(m.slices):
                if end > start and r != self.rank:
                    send[r].append(values[start:end])
            mine = m.local(m.member.tensor)
            start, end = m.slices[self.rank]
            if end > start and mine is not None:
                mine.copy_(values[start:end])
        elif _width(m, self.rank):
            self._receive[m.owner].append(m)

    def _plan_inbound(self, m: Matrix, send: list[list[torch.Tensor]]) -> None:
        if m.owner != self.rank:
            if _width(m, self.rank):
                send[m.owner].append(self._outgoing(m))
            return
        for r in range(len(m.slices)):
            if r != self.rank and _width(m, r):
                self._receive[r].append(m)
        if _width(m, self.rank):
            self._place(m, self.rank, self._outgoing(m))

    def _outgoing(self, m: Matrix) -> torch.Tensor:
        """This rank's slice of ``m``'s value or gradient, 1-D."""
        source = m.member.tensor if self.kind is Kind.VALUE else m.member.tensor.grad
        piece = m.local(source)
        if piece is None:
            # A holder without a gradient where another rank has one (torch's views
            # outside the shard): its part counts as zeros.
            like = local_tensor(m.member.tensor)
            return torch.zeros(_width(m, self.rank), dtype=like.dtype, device=like.device)
        return piece

    def _place(self, m: Matrix, source: int, values: torch.Tensor) -> None:
        start, end = m.slices[source]
        if self.kind is Kind.UPDATE:
            mine = m.local(m.member.tensor)
            assert mine is not None
            mine.copy_(values)
            return
        assert m.whole is not None
        if self.kind is Kind.VALUE:
            m.whole.detach().reshape(-1)[start:end].copy_(values)
            return
        if m.whole.grad is None:
            m.whole.grad = torch.zeros_like(m.whole)
        m.whole.grad.reshape(-1)[start:end].copy_(values)

    def finish(self) -> None:
        """Wait for the all-to-all and put every received slice in place."""
        if self._work is not None:
            self._work.wait()
        self._sent = None
        offset = 0
        for source, chunk in enumerate(self._receive):
            for m in chunk:
                width = _width(m, self._slice_of(source))
                self._place(m, self._slice_of(source), self._incoming[offset : offset + width])
                offset += width

    def _slice_of(self, source: int) -> int:
        """Whose slice arrives from ``source``: its own going in, this rank's coming out."""
        return self.rank if self.kind is Kind.UPDATE else source


def _width(m: Matrix, rank: int) -> int:
    start, end = m.slices[rank]
    return max(end - start, 0)


def check_same_everywhere(
    facts: str, failure: Exception | None, name: str, group: dist.ProcessGroup | None
) -> None:
    """The one exchange of a ``Whole``'s construction: every rank's digest of ``facts``
    (its parameters, groups and options) and what failed on it, so that every rank
    raises alike when one failed or when ranks were given different facts (their
    exchanges would not pair up)."""
    digest = hashlib.blake2b(facts.encode(), digest_size=8).hexdigest()
    mine = (digest, None if failure is None else f"{type(failure).__name__}: {failure}")
    everyone = exchange(mine, group)
    failed = [(r, message) for r, (_, message) in enumerate(everyone) if message]
    if failed:
        rank, message = failed[0]
        raise OptimStateError(f"{name} could not be built on rank {rank}: {message}") from failure
    digests = [d for d, _ in everyone]
    if len(set(digests)) > 1:
        differ = [r for r, d in enumerate(digests) if d != digests[0]]
        raise OptimStateError(
            f"ranks built flatview.optim.Whole over different parameters or options "
            f"(rank(s) {differ} differ from rank 0); every rank must pass the same "
            "parameters in the same groups, with the same heads, overlap and stacked"
        )
