"""Which parameters some rank's backward, or every rank's, gave no gradient although no
step declared them skipped."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from flatview.comm.ledger import Ledger


class FlagExchange:
    """The flags of the parameters some rank's backward gave no gradient although they are
    not skipped (``missing``) and of those this rank gave one (``got``): one asynchronous
    all-reduce (a sum) of two flags per parameter over ``group``, started as soon as the
    last parameter group's ``post_backward`` has set them, so that it runs alongside the
    wrapper's last reduce-scatter; :meth:`result` waits for it."""

    def __init__(
        self,
        missing: Sequence[int],
        got: set[int],
        count: int,
        group: Any,
        ledger: Ledger,
        device: torch.device,
    ) -> None:
        flags = torch.zeros(2, count, dtype=torch.int32, device=device)
        if missing:
            flags[0, list(missing)] = 1
        if got:
            flags[1, sorted(got)] = 1
        ledger.record("flags", flags)
        self._flags = flags
        self._work = dist.all_reduce(flags, group=group, async_op=True)

    def result(self) -> tuple[list[int], list[int]]:
        """(parameters some rank gave no gradient although not skipped, those no rank gave
        one)."""
        self._work.wait()
        flags = self._flags.cpu()
        found = [int(i) for i in flags[0].nonzero().flatten().tolist()]
        return found, [i for i in found if int(flags[1, i]) == 0]
