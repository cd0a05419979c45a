"""The one collective of a per-parameter norm call, which also checks that ranks agree.

A call of :meth:`flatview.FlatView.param_norms` (or its siblings) all-reduces one float64
tensor, :class:`NormExchange`, whose length depends only on the number of original
parameters of the model, so ranks that pass different arguments still meet in a
collective of the same shape and cannot hang. Its parts:

``header`` (4 slots)
    A 16-bit code of what the call computes (norm type, which tensors), laid out so that
    the reduced values tell whether every rank sent the same code: ``(c, c * c)`` under a
    sum (equal sums of ``c`` and ``c * c`` force every ``c`` to be equal), ``(c, -c)``
    under a maximum (the largest ``c`` is also the smallest). Then two flags: this rank
    refused its own arguments (a bad name, norm type, phase), and it did not. A rank that
    refused still joins the collective (with zeros, under a sum), so that no rank waits
    for it; a flag reduced to more than zero was set somewhere, under either reduction.
``flags`` (5 slots per parameter)
    Requested by this rank, not requested, bad (a tensor that does not fit the view),
    and, per column, present (this rank has the tensor: a gradient may be ``None``).
    Under a sum or a maximum alike, a flag reduced to more than zero was set on some
    rank, so "requested on some ranks and not requested on others" shows as both set.
``values`` (one slot per parameter and column)
    This rank's share of the norm: the sum of ``|x|**p`` over its elements, or their
    largest ``|x|`` for the infinity norm (then the reduction is a maximum).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flatview.comm.ledger import Ledger

COLUMNS = 2
"""Tensors per parameter one call can take norms of (e.g. the parameter and its
gradient); every call sends this many, so all calls have the same shape."""
FLAGS = 3 + COLUMNS
_REQUESTED, _NOT_REQUESTED, _BAD, _PRESENT = 0, 1, 2, 3
_HEADER = 4


def request_code(description: str) -> int:
    """A code in ``[1, 2**16]`` for what a call computes, equal on every process. Its
    square summed over a million ranks stays exact in float64."""
    digest = hashlib.blake2b(description.encode(), digest_size=2).digest()
    return 1 + int.from_bytes(digest, "little")


@dataclass(frozen=True)
class ArgumentReport:
    """What the reduced flags say about the ranks' arguments."""

    same_request: bool
    """Every rank sent the same request code."""
    disputed: tuple[int, ...]
    """Parameters some ranks asked for and others did not."""
    bad: tuple[int, ...]
    """Parameters for which some rank gave a tensor that does not fit its view."""


class NormExchange:
    """Builds, reduces and reads the tensor of one norm call over ``params`` parameters."""

    def __init__(self, params: int, code: int, maximum: bool) -> None:
        self.params = params
        self.code = code
        self.maximum = maximum
        self.flags = torch.zeros(params, FLAGS, dtype=torch.float64)
        self.flags[:, _NOT_REQUESTED] = 1.0
        self.reduced_flags: torch.Tensor | None = None
        self.failed = False
        """This rank refused its own arguments and only joins the collective."""
        self.some_failed = False
        self.some_ok = False
        """After :meth:`all_reduce`: some rank refused its arguments; some rank did not."""

    def request(self, index: int) -> None:
        self.flags[index, _REQUESTED] = 1.0
        self.flags[index, _NOT_REQUESTED] = 0.0

    def mark_bad(self, index: int) -> None:
        self.flags[index, _BAD] = 1.0

    def mark_present(self, index: int, column: int) -> None:
        self.flags[index, _PRESENT + column] = 1.0

    def all_reduce(
        self,
        values: torch.Tensor,
        group: dist.ProcessGroup | None,
        device: torch.device,
        ledger: Ledger,
        flags_group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        """Reduce this rank's flags and ``values`` (``params x COLUMNS`` shares, on
        ``device``) over ``group`` with one all-reduce; return the reduced values.

        ``flags_group``: where the flags go, ``group`` itself except under hybrid
        sharding (``group`` one shard group of several): then the flags are reduced over
        ``flags_group`` (the world) in a second all-reduce,
        so that a rank refusing its arguments makes every replica raise too (else the
        other shard groups would train on and hang at their next collective), while the
        values stay reduced within the shard group (replicas hold the same pieces)."""
        c = float(self.code)
        header = torch.tensor(
            [c, -c if self.maximum else c * c, float(self.failed), float(not self.failed)],
            dtype=torch.float64,
        )
        host = torch.cat([header, self.flags.reshape(-1)])
        op = dist.ReduceOp.MAX if self.maximum else dist.ReduceOp.SUM
        if flags_group is not group:
            flags = host.to(device)
            ledger.record("norms", flags)
            dist.all_reduce(flags, op=op, group=flags_group)
            shares = values.reshape(-1).to(torch.float64)
            ledger.record("norms", shares)
            dist.all_reduce(shares, op=op, group=group)
            reduced_host = flags.cpu()
            self._world = dist.get_world_size(flags_group)
        else:
            buffer = torch.cat([host.to(device), values.reshape(-1).to(torch.float64)])
            ledger.record("norms", buffer)
            dist.all_reduce(buffer, op=op, group=group)
            reduced_host = buffer[: host.numel()].cpu()
            shares = buffer[host.numel() :]
            self._world = dist.get_world_size(group)
        self._header = reduced_host[:_HEADER]
        self.some_failed = bool(self._header[2] > 0.5)
        self.some_ok = bool(self._header[3] > 0.5)
        self.reduced_flags = reduced_host[_HEADER:].view(self.params, FLAGS)
        return shares.view(self.params, COLUMNS)

    def argument_report(self) -> ArgumentReport:
        """Read the reduced flags (after :meth:`all_reduce`); the same on every rank."""
        flags = self.reduced_flags
        assert flags is not None, "argument_report() before all_reduce()"
        first, second = (float(v) for v in self._header[:2])
        c = float(self.code)
        if self.maximum:
            same = first == c and second == -c
        else:
            same = first == self._world * c and second == self._world * c * c
        set_ = flags > 0.5
        disputed = (set_[:, _REQUESTED] & set_[:, _NOT_REQUESTED]).nonzero().flatten()
        bad = set_[:, _BAD].nonzero().flatten()
        return ArgumentReport(same, tuple(disputed.tolist()), tuple(bad.tolist()))

    def present(self) -> list[list[bool]]:
        """Per parameter and column, whether any rank had the tensor (after
        :meth:`all_reduce`)."""
        flags = self.reduced_flags
        assert flags is not None, "present() before all_reduce()"
        found: list[list[bool]] = (flags[:, _PRESENT:] > 0.5).tolist()
        return found


def reduce_within(
    values: torch.Tensor, group: dist.ProcessGroup | None, maximum: bool, ledger: Ledger
) -> torch.Tensor:
    """``values`` (shares of norms: of parameters sharded over ``group``, a unit's own
    group; or of every expert group's experts, over every rank) summed, or their maximum
    taken, over ``group`` (``None``: the default group)."""
    values = values.clone()
    ledger.record("norms", values)
    dist.all_reduce(values, op=dist.ReduceOp.MAX if maximum else dist.ReduceOp.SUM, group=group)
    return values
