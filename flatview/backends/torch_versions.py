"""The torch versions flatview's torch adapters were checked against, and which torch
wrapper a model is: torch FSDP1 (``FullyShardedDataParallel``) or FSDP2 (``fully_shard``).
Neutral ground for every torch adapter: they import this, never each other."""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
from torch import nn

from flatview.backends.internals import optional_class
from flatview.errors import WrapError

TESTED_TORCH = ((2, 13),)
"""``(major, minor)`` versions of torch whose internals the torch adapters (FSDP1, FSDP2,
DDP) were checked against."""


UNTESTED_TORCH_ENV = "FLATVIEW_ALLOW_UNTESTED_TORCH"
"""Set to ``1`` to wrap torch FSDP1 models on a torch outside :data:`TESTED_TORCH` (with a
warning): the internals read are checked attribute by attribute at wrap time, so a torch
that moved them still fails there, but one that changed their meaning would not."""


def check_torch_version(relies: str) -> str:
    """Refuse a torch outside :data:`TESTED_TORCH` (unless :data:`UNTESTED_TORCH_ENV` is
    set: then warn) for the adapter whose ``relies`` (e.g. ``"FSDP2 backend relies on
    fully_shard"``) names what it depends on; return the "checked against ... found ..."
    phrase the internals checks quote."""
    found = f"{tested_torch()}; found torch {torch.__version__}"
    if torch_version() not in TESTED_TORCH:
        message = f"flatview's {relies} internals checked against {found}"
        if os.environ.get(UNTESTED_TORCH_ENV) != "1":
            raise WrapError(f"{message} (set {UNTESTED_TORCH_ENV}=1 to try it anyway)")
        # Points at the user's flatview.wrap call: this function, the checks' inspect(),
        # the registry entry's build, registry.detect, backends.detect, flatview.wrap, the
        # caller.
        warnings.warn(f"{message}; going ahead ({UNTESTED_TORCH_ENV}=1)", stacklevel=7)
    return found


def tested_torch() -> str:
    """The tested torch versions, as messages name them (``"torch 2.13.x"``)."""
    return "torch " + ", ".join(f"{a}.{b}.x" for a, b in TESTED_TORCH)


def fsdp_class() -> type[nn.Module] | None:
    """torch's FSDP1 ``FullyShardedDataParallel``, where ``torch.distributed`` is built."""
    if not dist.is_available():
        return None
    return optional_class("torch.distributed.fsdp", "FullyShardedDataParallel")


def is_torch_fsdp(model: object) -> bool:
    """Whether ``model`` is a torch FSDP1 ``FullyShardedDataParallel`` module."""
    cls = fsdp_class()
    return cls is not None and isinstance(model, cls)


def is_fsdp2(model: object) -> bool:
    """Whether ``model`` or one of its submodules was sharded with FSDP2 ``fully_shard``."""
    if not isinstance(model, nn.Module) or not dist.is_available():
        return False
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def torch_version() -> tuple[int, int]:
    """``(major, minor)`` of the running torch."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)
