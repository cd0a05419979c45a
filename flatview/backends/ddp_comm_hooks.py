"""DDP communication hooks that flatview reproduces in its own reduction.

flatview all-reduces a wrapped DDP model's gradients itself, so a hook registered on DDP
would never run. The hooks torch ships for plain averaging and for compression are
elementwise: each casts a bucket (or not), divides it by the group's size, sums it over
the group and casts the result back into the bucket. flatview's buckets hold other
parameters than DDP's, but the same arithmetic on each element gives each element the
same value (the order gloo adds a sum in can follow the position in the buffer on more
than 2 ranks, as for every bucketed reduction: ``docs/limitations.md``). Those hooks are
therefore served as :class:`Compression`; any other hook (PowerSGD, quantisation, the
user's own) is refused at wrap.

A hook registered through ``register_comm_hook`` is in DDP's ``_comm_hooks``; one of
torch's C++ hooks (``_register_builtin_comm_hook``) leaves a trace only in DDP's logging
data (``comm_hook``), which is read too, so that neither is bypassed in silence.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from flatview.comm.replicated import Compression
from flatview.errors import WrapError

_PYTHON_HOOKS: dict[str, torch.dtype | None] = {
    "allreduce_hook": None,
    "fp16_compress_hook": torch.float16,
    "bf16_compress_hook": torch.bfloat16,
}
"""torch's hooks in ``ddp_comm_hooks.default_hooks`` by name: the dtype each all-reduces
in (``None``: the gradients' own)."""

_BUILTIN_HOOKS: dict[str, torch.dtype | None] = {
    "BuiltinCommHookType.ALLREDUCE": None,
    "BuiltinCommHookType.FP16_COMPRESS": torch.float16,
}
"""torch's C++ hooks, by the name DDP logs for them, and the dtype each all-reduces in."""

_DEFAULT_HOOKS = "torch.distributed.algorithms.ddp_comm_hooks.default_hooks"


def compression_of(ddp: Any) -> Compression | None:
    """The :class:`Compression` that serves ``ddp``'s communication hook (``None``
    without one); :class:`~flatview.errors.WrapError` naming a hook flatview would
    bypass."""
    hooks = list(ddp._comm_hooks)
    if len(hooks) > 1:
        raise WrapError(_refused(f"{len(hooks)} hooks"))
    if hooks:
        hook, state = hooks[0]
        name = getattr(hook, "__name__", repr(hook))
        if getattr(hook, "__module__", None) != _DEFAULT_HOOKS or name not in _PYTHON_HOOKS:
            raise WrapError(_refused(f"{getattr(hook, '__qualname__', name)!r}"))
        group = state if state is not None else dist.group.WORLD
        if not _same_group(group, ddp.process_group):
            raise WrapError(
                f"DDP's communication hook {name} was registered with a process group "
                "other than DDP's own (its state): it would all-reduce over other ranks "
                "than DDP does, which flatview does not reproduce; register it with "
                "state=None on a model over the whole world, or with DDP's process group"
            )
        return Compression(_PYTHON_HOOKS[name], name)
    logged = ddp._get_ddp_logging_data().get("comm_hook")
    if logged:
        if logged not in _BUILTIN_HOOKS:
            raise WrapError(_refused(f"{logged!r}"))
        return Compression(_BUILTIN_HOOKS[logged], logged)
    return None


def _same_group(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(dist.get_process_group_ranks(a) == dist.get_process_group_ranks(b))
    except (RuntimeError, ValueError):
        return False


SERVED = "torch's " + ", ".join([*_PYTHON_HOOKS, *_BUILTIN_HOOKS])
"""The hooks served, for messages."""


def _refused(what: str) -> str:
    return (
        f"DDP has a communication hook flatview does not reproduce ({what}); flatview "
        f"all-reduces the gradients itself and would bypass it. Served: {SERVED}. Train "
        "on bare DDP for another hook"
    )
