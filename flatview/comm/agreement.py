"""Checking, before any other collective of a step, that all ranks skip the same set.

Ranks that disagree would pair up the collectives of different FSDP units; when those
units have the same size nothing fails and training is silently corrupted. One tiny
all-gather of a fingerprint per step rules that out.

The all-gather can run while the forward computes (:meth:`Agreement.settle` later), but
only where nothing the skip set decides is communicated before flatview's own
collectives: replicated wrappers (DDP, torch FSDP1 with every unit ``NO_SHARD``), whose
forward communicates nothing the skip set decides. There, every rank settles the check
at the end of the root's forward (earlier if the forward itself communicates: DDP's
buffer broadcast, the broadcast of the learnt bucket order), so a disagreement raises
on every rank from the forward, before the backward and before any collective that
could pair up wrongly. Sharded wrappers gather parameters per unit in the forward, so
they settle at once.

A rank that fails on its own inside ``step()`` (a skip set that does not resolve there)
sends :data:`FAILED` in its slot and settles at once: every rank raises, none waits in a
collective for it. With the check off nothing is exchanged, and such a rank raises
alone while the others wait for it in their next collective.

With the check on (``wrap(check_skip_agreement=True)``), an iteration that runs outside
any ``step()`` takes part too, as one skipping nothing (``outside``): a rank inside a
checked step then pairs its all-gather with this one, not with a collective of the
wrapper's (a hang). Skipping nothing inside a step and running outside one do the same,
so they agree; a step that skips something raises on every rank, naming the ranks that
ran outside a step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flatview import errors
from flatview.comm._compat import all_gather_single
from flatview.comm.ledger import Ledger
from flatview.errors import FrozenMismatchError, SkipSetMismatchError

FAILED = -1
"""The fingerprint slot of a rank that failed locally inside ``FlatView.step()`` (its skip
set did not resolve): every rank then raises, none waits in a collective for it.
Fingerprints are never negative."""


def fingerprint(indices: Iterable[int], frozen: Iterable[int] = ()) -> int:
    """A 63-bit digest of a set of parameter indices (and of the frozen ones: together
    they decide which gradients are reduced), equal on every process."""
    text = b",".join(str(i).encode() for i in sorted(indices))
    frozen_text = b",".join(str(i).encode() for i in sorted(frozen))
    if frozen_text:
        text += b"|" + frozen_text
    return _digest(text)


def combined(prints: Sequence[int]) -> int:
    """One fingerprint of several iterations' fingerprints, in order (the iterations a
    check covers: those under ``no_sync()`` and the synchronising one)."""
    if len(prints) == 1:
        return prints[0]
    return _digest(b";".join(str(p).encode() for p in prints))


def _digest(text: bytes) -> int:
    digest = hashlib.blake2b(text, digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True)
class Declared:
    """What one rank declared for one iteration a check covers, by name, per *slot*: the
    parameters of units on the agreement group (slot 0), and those of units on process
    groups of their own (slot 1, experts), on which only the ranks sharing a group must
    agree."""

    skipped: tuple[tuple[str, ...], ...]
    frozen: tuple[tuple[str, ...], ...]
    outside: bool
    """The iteration ran outside any ``FlatView.step()`` (it skips nothing)."""


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


class Agreement:
    """One started check: every rank's fingerprints (one per slot) are on their way (an
    asynchronous all-gather of 8 bytes per slot and rank); :meth:`settle` waits for them
    and raises :class:`SkipSetMismatchError` on every rank unless the ranks that must
    agree do: all ranks on slot 0, and on slot 1 the ranks each rank shares its units'
    own group with (``peers``, per rank of ``group``).

    ``declared`` gives this rank's :class:`Declared` per iteration the check covers; it is
    only called (and gathered) when the fingerprints differ.

    ``failure``: this rank found an error of its own (a skip set that does not resolve);
    it sends :data:`FAILED` instead of a fingerprint. :meth:`settle` then raises on every
    rank: this one its own error (unless ``raise_own`` is off: it raised it already, in
    a step under ``no_sync()``, and now raises what the others do), the others an error
    of the same class naming the failing rank(s) and their messages (one
    ``all_gather_object``, in that case only).
    """

    def __init__(
        self,
        prints: Sequence[int],
        declared: Callable[[], Sequence[Declared]],
        group: dist.ProcessGroup | None,
        device: torch.device,
        ledger: Ledger,
        *,
        peers: Sequence[Sequence[int]] | None = None,
        failure: BaseException | None = None,
        raise_own: bool = True,
        outside: bool = False,
    ) -> None:
        self._declared = declared
        self._peers = peers
        self._failure = failure
        self._raise_own = raise_own
        self.outside = outside
        """The last iteration it covers runs outside any ``FlatView.step()``."""
        slots = len(prints)
        self._group = group
        # Fills, not a copy from the host: torch.tensor([...], device="cuda") would wait
        # for the GPU to finish everything queued before it.
        mine = torch.empty(slots, dtype=torch.int64, device=device)
        for slot, print_ in enumerate(prints):
            mine[slot].fill_(FAILED if failure is not None else print_)
        world = dist.get_world_size(group)
        self._everyone = torch.empty(world * slots, dtype=torch.int64, device=device)
        self._slots = slots
        ledger.record("agreement", mine)
        self._work = all_gather_single(self._everyone, mine, group=group, async_op=True)
        self._host: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None
        if device.type == "cuda" and dist.get_backend(group) == "nccl":
            # Read the fingerprints through a side stream that waits for the all-gather
            # alone: reading them on the compute stream would wait for all the forward and
            # backward queued by then, and the GPU would idle while the host caught up.
            # (NCCL's wait() only orders streams; gloo's would block the host here.)
            stream = _side_stream(device)
            with torch.cuda.stream(stream):
                self._work.wait()
                self._host = torch.empty_like(self._everyone, device="cpu", pin_memory=True)
                self._host.copy_(self._everyone, non_blocking=True)
                self._copied = torch.cuda.Event()
                self._copied.record(stream)
            self._everyone.record_stream(stream)

    def settle(self) -> None:
        work, self._work = self._work, None
        if work is None:
            return
        if self._copied is not None and self._host is not None:
            self._copied.synchronize()
            flat = self._host.tolist()
        else:
            work.wait()
            flat = self._everyone.tolist()
        prints = [
            flat[r * self._slots : (r + 1) * self._slots] for r in range(len(flat) // self._slots)
        ]
        if any(row[0] == FAILED for row in prints):
            self._raise_failure([row[0] for row in prints])
        disagreeing = _disagreeing(prints, self._peers)
        if disagreeing is None:
            return
        gathered: list[list[Declared]] = [[] for _ in prints]
        dist.all_gather_object(gathered, list(self._declared()), group=self._group)
        raise mismatch(gathered, *disagreeing)

    def _raise_failure(self, prints: Sequence[int]) -> None:
        failure = self._failure
        mine = None if failure is None else (type(failure).__name__, str(failure))
        reports: list[tuple[str, str] | None] = [None] * len(prints)
        dist.all_gather_object(reports, mine, group=self._group)
        if failure is not None and self._raise_own:
            raise failure
        failed = [(r, report) for r, report in enumerate(reports) if report is not None]
        kind = getattr(errors, failed[0][1][0], None)
        if not (isinstance(kind, type) and issubclass(kind, errors.FlatViewError)):
            kind = errors.FlatViewError
        told = "; ".join(f"rank {r}: {name}: {message}" for r, (name, message) in failed)
        raise kind(
            f"rank(s) {[r for r, _ in failed]} failed in FlatView.step() before any "
            f"collective, so every rank raises (none would wait for them): {told}"
        )


def _disagreeing(
    prints: Sequence[Sequence[int]], peers: Sequence[Sequence[int]] | None
) -> tuple[int, tuple[int, ...]] | None:
    """The first slot and ranks that must agree and do not: all ranks on slot 0, each
    group of ``peers`` on slot 1; ``None`` if they all agree."""
    if any(row[0] != prints[0][0] for row in prints):
        return 0, tuple(range(len(prints)))
    if peers is not None:
        for group in peers:
            if any(prints[r][1] != prints[group[0]][1] for r in group):
                return 1, tuple(group)
    return None


def mismatch(
    gathered: Sequence[Sequence[Declared]], slot: int, ranks: Sequence[int]
) -> errors.FlatViewError:
    """The error every rank raises when ``ranks`` disagree on ``slot``, from every rank's
    declarations (the same on every rank)."""
    counts = [len(gathered[r]) for r in ranks]
    if len(set(counts)) > 1:
        told = ", ".join(f"rank {r}: {n}" for r, n in zip(ranks, counts, strict=True))
        return SkipSetMismatchError(
            "ranks ran different numbers of iterations inside no_sync() before the "
            f"synchronising backward ({told}): every rank must run the same iterations, with "
            "the same skip sets"
        )
    prefix = ""
    if slot == 1:
        prefix = (
            f"ranks {list(ranks)} share the process group of their FSDP units on groups of "
            "their own (experts), so they must skip the same parameters of those units: "
        )
    declared = [gathered[r] for r in ranks]
    at = next(
        i
        for i in range(counts[0])
        if any(
            (d[i].skipped[slot], d[i].frozen[slot])
            != (declared[0][i].skipped[slot], declared[0][i].frozen[slot])
            for d in declared
        )
    )
    if counts[0] > 1:
        prefix += (
            f"in iteration {at + 1} of the {counts[0]} this check covers (those under "
            "no_sync() and the synchronising one): "
        )
    sets = [set(d[at].skipped[slot]) for d in declared]
    frozen = [set(d[at].frozen[slot]) for d in declared]
    outside = [r for r, d in zip(ranks, declared, strict=True) if d[at].outside]
    common = set.intersection(*sets)
    if all(s == sets[0] for s in sets):
        everywhere = set.intersection(*frozen)
        lines = [
            f"rank {r} freezes {sorted(f - everywhere) or 'nothing more'}"
            for r, f in zip(ranks, frozen, strict=True)
        ]
        return FrozenMismatchError(
            prefix + "ranks froze different parameters (requires_grad=False) for "
            f"FlatView.step(): {sorted(set.union(*frozen) - everywhere)} are frozen on some "
            "ranks only. Which gradients are reduced depends on it, so every rank must "
            f"freeze the same parameters. Beyond the {len(everywhere)} parameters all ranks "
            "freeze: " + "; ".join(lines)
        )
    lines = [
        f"rank {r} runs outside any FlatView.step() (skips nothing)"
        if r in outside
        else f"rank {r} skips {sorted(s - common) or 'nothing more'}"
        for r, s in zip(ranks, sets, strict=True)
    ]
    if outside:
        return SkipSetMismatchError(
            prefix + f"rank(s) {outside} ran this iteration's forward outside any "
            "FlatView.step() while other ranks ran it inside a step that skips "
            "parameters: every rank must run the same iteration, inside a step with "
            "the same skip set or outside any step on all ranks. Beyond the "
            f"{len(common)} parameters all ranks skip: " + "; ".join(lines)
        )
    return SkipSetMismatchError(
        prefix + "ranks passed different skip sets to FlatView.step(); every rank must skip "
        "the same parameters in the same step (draw them from a seed shared by all ranks). "
        f"Beyond the {len(common)} parameters all ranks skip: " + "; ".join(lines)
    )
