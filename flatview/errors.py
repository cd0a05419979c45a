"""Errors flatview raises. Each names the culprit: the parameter, module, unit or rank."""

from __future__ import annotations

from collections.abc import Sequence


def listing(names: Sequence[str], limit: int = 8) -> str:
    """The first ``limit`` names, quoted, and how many more: how a message names its
    culprits."""
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


class FlatViewError(RuntimeError):
    """Base class of every error flatview raises on purpose."""


class WrapError(FlatViewError, TypeError):
    """``flatview.wrap`` was given something it cannot wrap."""


class SkipSetError(FlatViewError, ValueError):
    """A skip set names something that is not part of the wrapped model."""


class SkipSetMismatchError(FlatViewError):
    """Ranks passed different skip sets for the same step."""


class FrozenMismatchError(SkipSetMismatchError):
    """Ranks froze different parameters (``requires_grad=False``) for the same step: which
    gradients are reduced depends on it, as on the skip set."""


class SkippedParameterUsedError(FlatViewError):
    """A parameter declared skipped for a step received a gradient in that step."""


class UndeclaredUnusedError(FlatViewError):
    """An FSDP unit took no part in a backward pass but was not declared skipped."""


class DoubleCountError(FlatViewError):
    """An optimizer holds both a view and the flat parameter the view lives in."""


class StateError(FlatViewError):
    """An operation was called in a phase where it cannot run (e.g. nested steps)."""


class NormError(FlatViewError, ValueError):
    """A per-parameter norm was asked of something that is not an original parameter of
    the model, with an unsupported norm type, or differently on different ranks."""


class OptimStateError(FlatViewError, ValueError):
    """An optimizer, or an optimizer state dict, does not fit the wrapped model."""


class ParameterError(FlatViewError, ValueError):
    """Something given as an original parameter of the wrapped model is not one."""


class ParamGroupError(FlatViewError, ValueError):
    """An optimizer's parameter groups treat the pieces of one original parameter
    differently on different ranks (e.g. groups decided by the view's shape)."""
