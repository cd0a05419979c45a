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
    digest = hashlib.blake2b(text, digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


class Agreement:
    """One started check: every rank's fingerprint is on its way (an asynchronous
    all-gather of 8 bytes per rank); :meth:`settle` waits for them and raises
    :class:`SkipSetMismatchError` on every rank unless all are equal.

    ``describe`` lists this rank's skipped names and ``frozen`` its frozen ones; they are
    only called (and gathered) when the fingerprints differ.

    ``failure``: this rank found an error of its own (a skip set that does not resolve);
    it sends :data:`FAILED` instead of a fingerprint. :meth:`settle` then raises on every
    rank: this one its own error, the others an error of the same class naming the
    failing rank(s) and their messages (one ``all_gather_object``, in that case only).

    ``outside``: this rank's iteration runs outside any ``FlatView.step()`` (its
    fingerprint is that of an empty skip set); named as such if the check fails.
    """

    def __init__(
        self,
        print_: int,
        describe: Callable[[], Sequence[str]],
        group: dist.ProcessGroup | None,
        device: torch.device,
        ledger: Ledger,
        *,
        frozen: Callable[[], Sequence[str]] = tuple,
        failure: BaseException | None = None,
        outside: bool = False,
    ) -> None:
        self._describe = describe
        self.outside = outside
        self._frozen = frozen
        self._failure = failure
        if failure is not None:
            print_ = FAILED
        self._group = group
        # A fill, not a copy from the host: torch.tensor([...], device="cuda") would wait
        # for the GPU to finish everything queued before it.
        mine = torch.full((1,), print_, dtype=torch.int64, device=device)
        self._everyone = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=device)
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
            prints = self._host.tolist()
        else:
            work.wait()
            prints = self._everyone.tolist()
        if FAILED in prints:
            self._raise_failure(prints)
        if all(p == prints[0] for p in prints):
            return
        world = len(prints)
        gathered: list[tuple[list[str], list[str], bool] | None] = [None] * world
        mine = (list(self._describe()), list(self._frozen()), self.outside)
        dist.all_gather_object(gathered, mine, group=self._group)
        sets = [set(g[0]) if g else set() for g in gathered]
        frozen = [set(g[1]) if g else set() for g in gathered]
        outside = [r for r, g in enumerate(gathered) if g and g[2]]
        common = set.intersection(*sets)
        if all(s == sets[0] for s in sets):
            everywhere = set.intersection(*frozen)
            lines = [
                f"rank {r} freezes {sorted(f - everywhere) or 'nothing more'}"
                for r, f in enumerate(frozen)
            ]
            raise FrozenMismatchError(
                "ranks froze different parameters (requires_grad=False) for FlatView.step(): "
                f"{sorted(set.union(*frozen) - everywhere)} are frozen on some ranks only. "
                "Which gradients are reduced depends on it, so every rank must freeze the "
                "same parameters. Beyond the "
                f"{len(everywhere)} parameters all ranks freeze: " + "; ".join(lines)
            )
        lines = [
            f"rank {r} runs outside any FlatView.step() (skips nothing)"
            if r in outside
            else f"rank {r} skips {sorted(s - common) or 'nothing more'}"
            for r, s in enumerate(sets)
        ]
        if outside:
            raise SkipSetMismatchError(
                f"rank(s) {outside} ran this iteration's forward outside any "
                "FlatView.step() while other ranks ran it inside a step that skips "
                "parameters: every rank must run the same iteration, inside a step with "
                "the same skip set or outside any step on all ranks. Beyond the "
                f"{len(common)} parameters all ranks skip: " + "; ".join(lines)
            )
        raise SkipSetMismatchError(
            "ranks passed different skip sets to FlatView.step(); every rank must skip the "
            "same parameters in the same step (draw them from a seed shared by all ranks). "
            f"Beyond the {len(common)} parameters all ranks skip: " + "; ".join(lines)
        )

    def _raise_failure(self, prints: Sequence[int]) -> None:
        failure = self._failure
        mine = None if failure is None else (type(failure).__name__, str(failure))
        reports: list[tuple[str, str] | None] = [None] * len(prints)
        dist.all_gather_object(reports, mine, group=self._group)
        if failure is not None:
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
