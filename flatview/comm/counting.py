"""Counting communication at the collective calls themselves, whoever issues them.

Wrapping ``torch.distributed`` functions misses collectives issued from C++ (DDP's
reducer calls its process group directly). Every collective, from Python or C++, passes
through the dispatcher as a ``c10d::*`` op, so a dispatch mode sees them all. Entering a
dispatch mode makes every op go through Python: use this in tests and in a separate,
untimed pass of a benchmark, never around timed code.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_GATHERS = ("allgather", "_allgather_base", "allgather_into_tensor_coalesced")
_SCATTERS = ("reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced")


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


def _kind(op_name: str) -> str:
    base = op_name.split("::")[-1].split(".")[0].rstrip("_")
    return base


class CollectiveCounter(TorchDispatchMode):
    """Counts calls and bytes per collective kind while active.

    Bytes are what each collective moves on this rank in its gathered form: the output
    of an all-gather, the input of a reduce-scatter or all-to-all, the tensor of an
    all-reduce or broadcast.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = str(func)
        if name.startswith("c10d."):
            kind = _kind(name.split(".", 1)[1])
            if kind in _GATHERS or kind.startswith("allgather"):
                moved = _nbytes(args[0])
                kind = "all_gather"
            elif kind in _SCATTERS:
                moved = _nbytes(args[1])
                kind = "reduce_scatter"
            elif kind.startswith("alltoall"):
                moved = _nbytes(args[1])
                kind = "all_to_all"
            elif kind.startswith("allreduce"):
                moved = _nbytes(args[0])
                kind = "all_reduce"
            else:
                moved = _nbytes(args[0]) if args else 0
            if not kind.startswith(("barrier", "monitored_barrier")):
                self.calls[kind] += 1
                self.bytes[kind] += moved
        return func(*args, **kwargs)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())
