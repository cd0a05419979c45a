"""The all-to-all that carries slices of whole matrices between their holders and owners
(:mod:`flatview.whole_exchange`).

Each rank sends each other rank a list of 1-D tensors, laid end to end, and receives
from each a known number of elements: one ``all_to_all_single`` for all of them, which
every rank of the group joins, also one with nothing to send or receive (which matrices
move is the same everywhere, what each rank holds of them is not). Started
asynchronously on request, so that compute can run while it travels.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from flatview.comm.ledger import Ledger


def start_all_to_all(
    outgoing: Sequence[Sequence[torch.Tensor]],
    incoming_counts: Sequence[int],
    like: torch.Tensor,
    group: dist.ProcessGroup | None,
    ledger: Ledger,
    *,
    async_op: bool,
) -> tuple[torch.Tensor, dist.Work | None, torch.Tensor]:
    """Send ``outgoing[r]`` (1-D tensors, end to end) to rank ``r`` and receive
    ``incoming_counts[r]`` elements from it, in rank order, into one new 1-D tensor of
    ``like``'s dtype and device. Returns it, the collective's handle (``None`` when done
    already; read the result only after ``wait()``) and the packed input, which the
    caller keeps alive until then."""
    send = torch.cat([t.reshape(-1) for chunk in outgoing for t in chunk] or [like.new_empty(0)])
    receive = send.new_empty(sum(incoming_counts))
    ledger.record("all_to_all", send)
    work = dist.all_to_all_single(
        receive,
        send,
        list(incoming_counts),
        [sum(t.numel() for t in chunk) for chunk in outgoing],
        group=group,
        async_op=async_op,
    )
    return receive, work, send
