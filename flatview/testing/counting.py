"""Counting communication at the collective calls themselves, whoever issues them.

Wrapping ``torch.distributed`` functions misses collectives issued from C++ (DDP's
reducer calls its process group directly). Every collective, from Python or C++, passes
through the dispatcher as a ``c10d::*`` op (or a functional collective), so a dispatch
mode sees them all. Entering a dispatch mode makes every op go through Python: use this
in tests and in a separate, untimed pass of a benchmark, never around timed code.

Bytes are what each collective moves on this rank in its gathered form: the output of
an all-gather, the input of a reduce-scatter or all-to-all, the tensor of an all-reduce
or broadcast.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Which argument of each c10d op holds the bytes the op is charged for.
_C10D_MEASURE: dict[str, tuple[str, str]] = {
    "allreduce_": ("all_reduce", "tensors"),
    "allreduce_coalesced_": ("all_reduce", "tensors"),
    "reduce_": ("reduce", "tensors"),
    "allgather_": ("all_gather", "output_tensors"),
    "_allgather_base_": ("all_gather", "output_tensor"),
    "allgather_coalesced_": ("all_gather", "output_lists"),
    "allgather_into_tensor_coalesced_": ("all_gather", "outputs"),
    "reduce_scatter_": ("reduce_scatter", "input_tensors"),
    "_reduce_scatter_base_": ("reduce_scatter", "input_tensor"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs"),
    "alltoall_": ("all_to_all", "input_tensors"),
    "alltoall_base_": ("all_to_all", "input"),
    "broadcast_": ("broadcast", "tensors"),
    "gather_": ("gather", "input_tensors"),
    "scatter_": ("scatter", "output_tensors"),
    "send": ("send", "tensors"),
    "recv_": ("recv", "tensors"),
    "barrier": ("barrier", ""),
}
# Functional collectives (used by some torch code paths); what they call underneath runs
# with this mode switched off, so nothing is counted twice.
_FUNCOL_MEASURE: dict[str, tuple[str, str, int]] = {
    "all_reduce": ("all_reduce", "input", 1),
    "all_reduce_coalesced": ("all_reduce", "inputs", 1),
    "all_gather_into_tensor": ("all_gather", "input", -1),
    "all_gather_into_tensor_coalesced": ("all_gather", "inputs", -1),
    "reduce_scatter_tensor": ("reduce_scatter", "input", 1),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "inputs", 1),
    "all_to_all_single": ("all_to_all", "input", 1),
    "broadcast": ("broadcast", "input", 1),
}
GRADIENT_KINDS = ("all_reduce", "reduce_scatter", "all_to_all", "reduce")
"""The kinds that reduce gradients."""


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


class CollectiveCounter(TorchDispatchMode):
    """Counts calls and bytes of every collective dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        namespace = getattr(func, "namespace", "")
        name = func._overloadpacket.__name__
        if namespace == "c10d" and name in _C10D_MEASURE:
            kind, argument = _C10D_MEASURE[name]
            self._record(kind, self._argument(func, args, kwargs, argument))
        elif namespace in ("_c10d_functional", "c10d_functional") and name in _FUNCOL_MEASURE:
            kind, argument, factor = _FUNCOL_MEASURE[name]
            value = self._argument(func, args, kwargs, argument)
            if factor < 0:  # all-gather: output = input x group size
                factor = int(self._argument(func, args, kwargs, "group_size"))
            self._record(kind, value, factor)
        return func(*args, **kwargs)

    @staticmethod
    def _argument(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
        if not name:
            return None
        for index, spec in enumerate(func._schema.arguments):
            if spec.name == name:
                return args[index] if index < len(args) else kwargs.get(name)
        raise KeyError(f"{func} has no argument {name!r}")

    def _record(self, kind: str, value: Any, factor: int = 1) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += _tensor_bytes(value) * factor

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())
