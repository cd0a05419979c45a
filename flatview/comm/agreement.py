"""Checking, before any other collective of a step, that all ranks skip the same set.

Ranks that disagree would pair up the collectives of different FSDP units; when those
units have the same size nothing fails and training is silently corrupted. One tiny
all-gather of a fingerprint per step rules that out.

The all-gather can run while the forward computes (:meth:`Agreement.settle` later), but
only where nothing the skip set decides is communicated before flatview's own
collectives: replicated wrappers (DDP, torch FSDP1 with every unit ``NO_SHARD``), whose
forward and backward communicate nothing the skip set decides until flatview reduces.
There, every rank settles the check before its first gradient collective, so a
disagreement still raises on every rank before any collective that could pair up
wrongly; it costs a few milliseconds less per step (measured in
``benchmarks/README.md``). Sharded wrappers gather parameters per unit in the forward,
so they settle at once.
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

    ``describe`` lists this rank's skipped names; it is only called (and gathered) when
    the fingerprints differ.
    """

    def __init__(
        self,
        print_: int,
        describe: Callable[[], Sequence[str]],
        group: dist.ProcessGroup | None,
        device: torch.device,
        ledger: Ledger,
    ) -> None:
        self._describe = describe
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
        if all(p == prints[0] for p in prints):
            return
        world = len(prints)
        names: list[Sequence[str] | None] = [None] * world
        dist.all_gather_object(names, list(self._describe()), group=self._group)
        sets = [set(n or ()) for n in names]
        common = set.intersection(*sets)
        lines = [
            f"rank {r} skips {sorted(s - common) or 'nothing more'}" for r, s in enumerate(sets)
        ]
        raise SkipSetMismatchError(
            "ranks passed different skip sets to FlatView.step(); every rank must skip the "
            "same parameters in the same step (draw them from a seed shared by all ranks). "
            f"Beyond the {len(common)} parameters all ranks skip: " + "; ".join(lines)
        )
