"""Pieces of the FSDP2 adapter that stand in FSDP2's runtime: counting communication
objects and the steering of explicit prefetching (see :mod:`flatview.backends.fsdp2`).

torch privates touched: the ``allocate`` / ``__call__`` protocol of FSDP2's ``AllGather``
and ``ReduceScatter`` objects (``torch.distributed.fsdp._fully_shard._fsdp_api``, which
``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter`` accept), and
``FSDPParamGroup.all_reduce_grads``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from flatview.comm.ledger import Ledger


class CountingAllGather:
    """Delegates to FSDP2's all-gather object, counting its input in the ledger."""

    def __init__(self, inner: Any, ledger: Ledger) -> None:
        self.inner = inner
        self.ledger = ledger

    def allocate(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        tensor: torch.Tensor = self.inner.allocate(*args, **kwargs)
        return tensor

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        source = kwargs.get("input_tensor", args[1] if len(args) > 1 else None)
        if isinstance(source, torch.Tensor):
            self.ledger.record("all_gather", source)
        return self.inner(*args, **kwargs)


class CountingReduceScatter:
    """Delegates to FSDP2's reduce-scatter object, counting its input in the ledger; with
    ``group`` (HSDP) also the all-reduce FSDP2 runs next over the replicate dimension,
    whose input is this reduce-scatter's output."""

    def __init__(self, inner: Any, ledger: Ledger, group: Any | None) -> None:
        self.inner = inner
        self.ledger = ledger
        self.group = group

    def allocate(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        tensor: torch.Tensor = self.inner.allocate(*args, **kwargs)
        return tensor

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        output = kwargs.get("output_tensor", args[0] if args else None)
        source = kwargs.get("input_tensor", args[1] if len(args) > 1 else None)
        if isinstance(source, torch.Tensor):
            self.ledger.record("reduce_scatter", source)
        if self.group is not None and self.group.all_reduce_grads and output is not None:
            self.ledger.record("all_reduce", output)
        return self.inner(*args, **kwargs)


def steer(
    targets: Sequence[Any], order: Sequence[Any], skipped: set[int], own: Any, direction: int
) -> list[Any]:
    """``targets`` (FSDP states to prefetch) with each skipped one replaced by the next
    state in ``order`` (``direction`` +1: forward, -1: backward) that the step does not
    skip, leaving out ``own``, states already listed and states past the end."""
    steered: list[Any] = []
    position = {id(state): i for i, state in enumerate(order)}
    for target in targets:
        candidate = target
        if id(candidate) in skipped:
            i = position.get(id(candidate))
            candidate = None
            while i is not None:
                i += direction
                if not 0 <= i < len(order):
                    break
                if id(order[i]) not in skipped:
                    candidate = order[i]
                    break
        if candidate is None or candidate is own or any(candidate is s for s in steered):
            continue
        steered.append(candidate)
    return steered
