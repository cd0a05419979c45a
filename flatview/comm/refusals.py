"""A refusal one rank decides alone, raised on every rank: the exchange that public
collective calls run before their first collective.

A collective call (a checkpoint's state dict, say) checks its arguments on each rank
before it communicates. A rank that refuses them and raises alone leaves the others
waiting in the call's first collective, or in the training step after it, until the
process group times out. :func:`raise_everywhere` instead has every rank join one small
all-gather of what it found (nothing, or its error) and of the options it was called
with (which decide the collectives that follow): every rank raises if any refused, the
refusing rank its own error, the others one of the same class naming it.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from flatview import errors


def raise_everywhere(
    failure: BaseException | None,
    request: Any,
    group: dist.ProcessGroup | None,
    call: str,
) -> None:
    """Exchange ``failure`` (this rank's refusal, or ``None``) and ``request`` (a small
    picklable summary of the call's options) over ``group``; raise on every rank if some
    rank refused, or if ranks made the call with different options.

    Args:
        failure: the error this rank found before any collective of the call.
        request: what every rank must pass alike for the call's collectives to pair up.
        group: every rank of the run (an adapter's ``agreement_group``).
        call: the call's name, for messages.
    """
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        if failure is not None:
            raise failure
        return
    mine = {
        "error": None if failure is None else (type(failure).__name__, str(failure)),
        "request": request,
    }
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    if failure is not None:
        raise failure
    failed = [(rank, told["error"]) for rank, told in enumerate(everyone) if told["error"]]
    if failed:
        kind = getattr(errors, failed[0][1][0], None)
        if not (isinstance(kind, type) and issubclass(kind, errors.FlatViewError)):
            kind = errors.FlatViewError
        told = "; ".join(f"rank {rank}: {name}: {message}" for rank, (name, message) in failed)
        raise kind(
            f"rank(s) {[rank for rank, _ in failed]} refused {call} before any collective, "
            f"so every rank raises (none would wait for them): {told}"
        )
    first = everyone[0]["request"]
    for rank, told in enumerate(everyone):
        if told["request"] != first:
            raise errors.FlatViewError(
                f"ranks called {call} with different options (rank 0: {first}; rank {rank}: "
                f"{told['request']}): every rank must make the same call, or their "
                "collectives would not pair up"
            )
