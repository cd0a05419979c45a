"""Collective names across torch versions.

torch 2.13 calls the tensor-in, tensor-out collectives ``all_gather_single`` and
``reduce_scatter_single`` and warns on every call of the older names, which it keeps as
deprecated aliases; older releases (flatview supports torch >= 2.1) have only those.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

all_gather_single: Callable[..., Any] = getattr(
    dist, "all_gather_single", dist.all_gather_into_tensor
)
reduce_scatter_single: Callable[..., Any] = getattr(
    dist, "reduce_scatter_single", dist.reduce_scatter_tensor
)
