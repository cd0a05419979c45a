"""The exchange domains of :class:`flatview.optim.Whole`: the ranks among which a set of
matrices is owned and exchanged.

A parameter's pieces live on the ranks of the process group its FSDP unit shards over.
For most parameters that is the root unit's group; an expert unit on a process group of
its own (:attr:`flatview.backends.base.UnitSpec.group`) shards its parameters over that
group, whose other ranks hold the same experts while ranks of other groups hold other
experts under the same names. So each matrix is owned by a rank of its parameter's
group and travels only within it:

* the *root domain* holds the parameters of units on the root's group;
* an *expert domain* holds those of units on this rank's own group (every such unit on
  a rank shares one group, checked at wrap time): on a one-rank group every expert
  matrix is whole here and is stepped in place, with no communication; on a group of
  several ranks its owners are ranks of that group, and its flags and slices go over
  that group only.

A :class:`Domain` holds its members, their matrices and owners, and runs the
collectives of a step over its own group: the agreement on which members have a
gradient or changed (:meth:`Domain.agree_on_flags`) and the transfers of slices
(:meth:`Domain.transfer`, :meth:`Domain.exchange`). Every rank of a domain's group
holds the same members (the same names, shapes and layouts), so its collectives pair
up; a rank runs its domains in one order, the root domain first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from flatview.comm.collectives import all_reduce_max
from flatview.comm.ledger import Ledger
from flatview.whole_exchange import Kind, Transfer, buckets
from flatview.whole_members import Matrix, Member, assign_owners, checksum


@dataclass(eq=False)
class Domain:
    """The ranks among which some members' matrices are owned and exchanged (see the
    module docstring)."""

    group: dist.ProcessGroup | None
    rank: int
    """This rank, in ``group``."""
    world: int
    sharded: bool
    """Some member's elements are split over the ranks of ``group`` (otherwise every
    rank holds and steps every matrix alike, and nothing is exchanged)."""
    expert: bool
    """The group is an expert unit's own, not the root unit's."""
    members: list[Member] = field(default_factory=list)
    matrices: list[Matrix] = field(default_factory=list)
    travelling: list[Matrix] = field(default_factory=list)
    """Matrices whose owner lacks some of them (see :mod:`flatview.whole_members`)."""
    travelling_members: list[Member] = field(default_factory=list)
    buckets: list[list[Matrix]] = field(default_factory=list)
    """The travelling matrices in the buckets a pipelined step exchanges one by one."""
    owner_costs: list[int] = field(default_factory=list)

    def settle(self, overlap: bool) -> None:
        """Owners, travelling matrices and buckets, once every member is cut into
        matrices; the same on every rank of the group."""
        self.matrices = [m for member in self.members for m in member.matrices]
        self.owner_costs = assign_owners(self.matrices, self.world)
        self.travelling = [m for m in self.matrices if m.travels]
        self.travelling_members = [p for p in self.members if any(m.travels for m in p.matrices)]
        self.buckets = buckets(self.travelling, self.world) if overlap else [self.travelling]

    def agree_on_flags(self, ledger: Ledger, device: torch.device) -> list[Matrix]:
        """All-reduce over the group, per member with travelling matrices, (has a gradient
        here, its piece changed outside the optimizer); refresh the whole copies of
        changed ones. Returns the travelling matrices of members with a gradient on some
        rank of the group."""
        members = self.travelling_members
        flags = torch.zeros(2 * len(members), dtype=torch.int32, device=device)
        for position, member in enumerate(members):
            flags[2 * position] = member.tensor.grad is not None
            piece = member.local(member.tensor)
            # A rank holding nothing of it has nothing that could have changed.
            changed = piece is not None and piece.numel() > 0 and member.checksum != checksum(piece)
            flags[2 * position + 1] = changed
        ledger.record("all_reduce", flags)
        all_reduce_max(flags, self.group)
        found = flags.tolist()
        with_grad = {id(p) for i, p in enumerate(members) if found[2 * i]}
        stale = {id(p) for i, p in enumerate(members) if found[2 * i + 1]}
        if stale:
            refresh = [m for m in self.travelling if id(m.member) in stale]
            self.exchange(refresh, Kind.VALUE, ledger)
        return [m for m in self.travelling if id(m.member) in with_grad]

    def transfer(self, matrices: Sequence[Matrix], kind: Kind, ledger: Ledger) -> Transfer:
        """One asynchronous transfer of one bucket (one dtype) over the group."""
        return Transfer(matrices, kind, self.rank, self.world, self.group, ledger, async_op=True)

    def exchange(self, matrices: Sequence[Matrix], kind: Kind, ledger: Ledger) -> None:
        """Transfer ``matrices`` now, one all-to-all per dtype."""
        by_dtype: dict[str, list[Matrix]] = {}
        for m in matrices:
            by_dtype.setdefault(str(m.member.tensor.dtype), []).append(m)
        transfers = [
            Transfer(chunk, kind, self.rank, self.world, self.group, ledger, async_op=False)
            for _, chunk in sorted(by_dtype.items())
        ]
        for transfer in transfers:
            transfer.finish()

    def note_checksums(self) -> None:
        for member in self.travelling_members:
            piece = member.local(member.tensor)
            member.checksum = checksum(piece) if piece is not None else None
