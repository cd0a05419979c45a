"""This rank's local tensors of FSDP2's ``DTensor`` parameters, and back.

FSDP2 keeps each original parameter as a ``DTensor`` sharded on dim 0; its gradient and
the optimizer state built over it are ``DTensor`` s too. flatview's whole-parameter
operations work on this rank's piece (the layout math of :mod:`flatview.layout` says
where it lies): an operation on the ``DTensor`` itself would communicate.
"""

from __future__ import annotations

from typing import Any

import torch


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's local tensor of a ``DTensor`` (FSDP2's parameters, their gradients and
    optimizer state), else ``tensor``: operations on the ``DTensor`` would communicate."""
    to_local = getattr(tensor, "to_local", None)
    if to_local is not None and type(tensor).__name__ == "DTensor":
        local: torch.Tensor = to_local()
        return local
    return tensor


def like_param(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``local`` as state of ``param``: a ``DTensor`` laid out like it where ``param`` is one
    (FSDP2), else ``local`` itself."""
    if local_tensor(param) is param:
        return local
    from torch.distributed.tensor import DTensor

    dtensor: Any = param
    return DTensor.from_local(
        local.view(dtensor.to_local().shape),
        dtensor.device_mesh,
        dtensor.placements,
        run_check=False,
        shape=dtensor.shape,
        stride=dtensor.stride(),
    )
