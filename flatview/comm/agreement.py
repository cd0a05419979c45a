"""Checking, before any other collective of a step, that all ranks skip the same set.

Ranks that disagree would pair up the collectives of different FSDP units; when those
units have the same size nothing fails and training is silently corrupted. One tiny
all-gather of a fingerprint per step rules that out.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from flatview.comm._compat import all_gather_single
from flatview.comm.ledger import Ledger
from flatview.errors import SkipSetMismatchError


def fingerprint(indices: Iterable[int]) -> int:
    """A 63-bit digest of a set of parameter indices, equal on every process."""
    digest = hashlib.blake2b(
        b",".join(str(i).encode() for i in sorted(indices)), digest_size=8
    ).digest()
    return int.from_bytes(digest, "little") >> 1


def check_agreement(
    print_: int,
    describe: Callable[[], Sequence[str]],
    group: dist.ProcessGroup | None,
    device: torch.device,
    ledger: Ledger,
) -> None:
    """Raise :class:`SkipSetMismatchError` on every rank unless all ranks passed ``print_``.

    ``describe`` lists this rank's skipped names; it is only called (and gathered) when
    the fingerprints differ, so the common case costs one 8-byte-per-rank all-gather.
    """
    world = dist.get_world_size(group)
    mine = torch.tensor([print_], dtype=torch.int64, device=device)
    everyone = torch.empty(world, dtype=torch.int64, device=device)
    ledger.record("agreement", mine)
    all_gather_single(everyone, mine, group=group)
    prints = everyone.tolist()
    if all(p == prints[0] for p in prints):
        return
    names: list[Sequence[str] | None] = [None] * world
    dist.all_gather_object(names, list(describe()), group=group)
    sets = [set(n or ()) for n in names]
    common = set.intersection(*sets)
    lines = [f"rank {r} skips {sorted(s - common) or 'nothing more'}" for r, s in enumerate(sets)]
    raise SkipSetMismatchError(
        "ranks passed different skip sets to FlatView.step(); every rank must skip the "
        "same parameters in the same step (draw them from a seed shared by all ranks). "
        f"Beyond the {len(common)} parameters all ranks skip: " + "; ".join(lines)
    )
