"""Bytes and calls of the collectives flatview issues, recorded where it issues them."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

REPLICA_ALL_REDUCE = "replica_all_reduce"
"""Ledger kind of hybrid sharding's all-reduce across the replica group
(:mod:`flatview.comm.hybrid`)."""


@dataclass
class Ledger:
    """Per-kind totals of collective calls and their input bytes since the last reset."""

    calls: Counter[str] = field(default_factory=Counter)
    bytes: Counter[str] = field(default_factory=Counter)

    def record(self, kind: str, tensor: torch.Tensor) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += tensor.numel() * tensor.element_size()

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()
