"""The wrapper internals an adapter relies on, checked at wrap time: every attribute it
reads, calls or replaces must exist before anything is patched, so that a wrapper version
that renamed one is refused with the attribute named instead of failing in the middle of
a backward; and optional wrappers imported only where installed."""

from __future__ import annotations

import importlib
from collections.abc import Iterable

import torch
from torch import nn

from flatview.errors import WrapError


def require_attrs(obj: object, names: Iterable[str], what: str, tested: str) -> None:
    """Refuse to wrap unless ``obj`` has every attribute in ``names``: wrapper internals an
    adapter reads, calls or replaces, checked before anything is patched so that a
    wrapper version that renamed one fails here, not in the middle of a backward.

    ``what`` names ``obj`` in the message, ``tested`` the versions the adapter was checked
    against (and the one found)."""
    missing = [name for name in names if not hasattr(obj, name)]
    if missing:
        raise WrapError(
            f"{what} has no {', '.join(missing)}, which flatview relies on: this version "
            f"is not one flatview supports (checked against {tested})"
        )


def require_autograd_internals(tested: str) -> None:
    """The autograd internals every adapter uses: the running backward's id (a forward
    inside a backward is a recomputation) and the end-of-backward callback queue."""
    require_attrs(torch._C, ("_current_graph_task_id",), "torch._C", tested)
    engine = torch.autograd.Variable
    require_attrs(engine, ("_execution_engine",), "torch.autograd.Variable", tested)
    require_attrs(
        engine._execution_engine, ("queue_callback",), "autograd's execution engine", tested
    )


def optional_class(module: str, name: str) -> type[nn.Module] | None:
    """``module.name`` if that backend can be imported here, else ``None`` (flatview runs
    with either FSDP implementation missing)."""
    try:
        found: type[nn.Module] = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    return found
