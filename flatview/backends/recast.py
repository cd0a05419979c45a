"""Casting a wrapped model after the wrap (``model.double()``, ``model.to(dtype)``).

torch's FSDP1 and FSDP2 fix some of their state from the parameters' dtype at lazy
initialisation, which they run at the first forward precisely so that a model may be
cast between the wrapper's construction and that forward (torch's comments say so).
flatview runs that initialisation when it wraps (it needs what it creates to lay out the
views), so a cast after ``flatview.wrap`` would meet state fixed for the old dtype: FSDP1
all-gathers the cast shard into a buffer of the old dtype and fails, FSDP2 assigns
gradients of the old dtype and fails. Each function here wraps one unit's ``_apply`` (what
every cast and move runs, on every module it reaches) so that, after the wrapper's own
``_apply``, the part of lazy initialisation that reads the dtype runs again, with torch's
own function, as it would have at the first forward. Views follow the new shards when
they are shown again (:meth:`flatview.views.ViewSet.rebind`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any


def fsdp1_recasting(handle: Any, apply: Callable[..., Any]) -> Callable[..., Any]:
    """``apply`` (a torch FSDP1 unit's ``_apply``), then, when it gave the unit's flat
    parameter another storage while the unit was idle, torch's
    ``FlatParamHandle.init_flat_param_attributes`` again: it re-reads the dtype (keeping
    a mixed-precision policy's), points the local shard at the new storage and
    allocates the all-gather buffers in the new dtype. Moves to another device meet
    its check of the compute device, as before the first forward."""
    from torch.distributed.fsdp._common_utils import HandleTrainingState

    @functools.wraps(apply)
    def recasting(*args: Any, **kwargs: Any) -> Any:
        result = apply(*args, **kwargs)
        flat = handle.flat_param
        if handle._training_state is HandleTrainingState.IDLE and not _same_tensor(
            flat.data, flat._local_shard
        ):
            handle.init_flat_param_attributes()
        return result

    return recasting


def fsdp2_recasting(groups: Iterable[Any], apply: Callable[..., Any]) -> Callable[..., Any]:
    """``apply`` (an FSDP2 module's ``_apply``), then, for each of its parameter groups
    whose parameters no longer have the dtype recorded at lazy initialisation, FSDP2's
    ``_init_mp_dtypes`` again (the original, parameter and reduce dtypes it casts and
    assigns gradients by)."""
    groups = tuple(groups)

    @functools.wraps(apply)
    def recasting(*args: Any, **kwargs: Any) -> Any:
        result = apply(*args, **kwargs)
        for group in groups:
            if any(p.orig_dtype != p.sharded_param.dtype for p in group.fsdp_params):
                group._init_mp_dtypes()
        return result

    return recasting


def _same_tensor(a: Any, b: Any) -> bool:
    return bool(
        a.dtype == b.dtype
        and a.device == b.device
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    )
