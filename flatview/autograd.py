"""What flatview asks of autograd's engine, in one place: whether a backward is running
on this thread (a forward then is a recomputation for activation checkpointing, not a new
iteration), and a callback run once the whole backward is done.

Both are torch internals; the adapters check at wrap time that they exist
(:func:`flatview.backends.internals.require_autograd_internals`)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def in_backward() -> bool:
    """Whether autograd runs a backward on this thread (a forward now recomputes)."""
    return bool(torch._C._current_graph_task_id() != -1)


def at_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the backward running now has finished (every gradient
    accumulated, every hook run)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)
