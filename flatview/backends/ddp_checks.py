"""Which models flatview's DDP adapter (:mod:`flatview.backends.ddp`) takes, and what it
checks at wrap time (:func:`inspect`): the autograd internals and every attribute of the
DDP model the adapter reads or sets (a torch that renamed one is refused with it named),
then the configurations flatview cannot drive."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flatview.backends.ddp_comm_hooks import compression_of
from flatview.backends.internals import optional_class, require_attrs, require_autograd_internals
from flatview.backends.torch_versions import tested_torch
from flatview.comm.replicated import Compression
from flatview.errors import StateError, WrapError

_PRIVATES = (
    "module",
    "process_group",
    "bucket_bytes_cap",
    "parameters_to_ignore",
    "require_backward_grad_sync",
    "require_forward_param_sync",
    "will_sync_module_buffers",
    "static_graph",
    "mixed_precision",
    "_comm_hooks",
    "_get_ddp_logging_data",
    "_use_python_reducer",
    "_delay_all_reduce_params",
    "_join_config",
    "register_comm_hook",
    "_register_builtin_comm_hook",
)
"""What the adapter reads or sets of a DDP model, checked at wrap time: the refusals
below would pass silently on a torch that renamed what they read."""


JOIN_REFUSED = (
    "DDP's join() (torch.distributed.algorithms.Join, uneven inputs) is not supported "
    "on a model wrapped by flatview: flatview reduces the gradients itself, so DDP's join "
    "hook would shadow DDP's own all-reduces on the ranks that ran out of inputs, not "
    "flatview's, and every rank would wait on the others. Give every rank the same "
    "number of batches (DistributedSampler(drop_last=True), or stop all ranks at the "
    "smallest count)"
)
"""Why the adapter refuses DDP's join: at wrap time if a join is on, and at a forward
inside one (:func:`refuse_enabled_join`)."""


HOOK_METHODS = ("register_comm_hook", "_register_builtin_comm_hook")
"""DDP's methods that register a communication hook: a wrapped model refuses them
(:func:`~flatview.backends.messages.comm_hook_after_wrap`)."""


def refuse_enabled_join(ddp: Any) -> None:
    """Refuse a forward inside an enabled ``Join`` (see :data:`JOIN_REFUSED`), before
    it communicates. A disabled one (accelerate's ``join_uneven_inputs`` with even
    batches) changes nothing: allowed. The fallback of :func:`refusing_join_hook`, for a
    join built where that cannot tell (a rank without any batch still waits then)."""
    if ddp._join_config.enable:
        raise StateError(JOIN_REFUSED)


def refusing_join_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """DDP's ``join_hook``, refusing an enabled ``Join`` as it is built: ``Join.__init__``
    asks every joinable for its hook first, on every rank, before anything communicates,
    so every rank raises there, a rank that has no batch at all too (refused only at
    its first forward, such a rank waited forever in the join's exit). ``Join.__init__``
    stores ``enable`` after asking for the hooks, so it is read from its frame; where
    that frame is not ``Join.__init__`` (another torch, or a direct call) the forward
    refuses instead (:func:`refuse_enabled_join`)."""

    def join_hook(**kwargs: Any) -> Any:
        # Join.__init__ asks in a list comprehension: its own frame before Python 3.12.
        frame = sys._getframe(1)
        for _ in range(2):
            if frame.f_code.co_name == "__init__":
                arguments = frame.f_locals
                joining = type(arguments.get("self")).__name__ == "Join"
                if joining and arguments.get("enable") is True:
                    raise StateError(JOIN_REFUSED)
                break
            if frame.f_back is None:
                break
            frame = frame.f_back
        return original(**kwargs)

    return join_hook


_DTYPE_NAMES = {
    torch.float32: "float",
    torch.float64: "double",
    torch.float16: "c10::Half",
    torch.bfloat16: "c10::BFloat16",
}
"""The names DDP's logging data gives the parameters' dtypes it was built with."""


def cast_since_built(ddp: Any) -> str | None:
    """How the parameters' dtypes differ from those DDP was built with (``model.double()``
    after ``DDP(...)``), or ``None``. DDP's reducer keeps what it built for the old
    tensors: bare DDP then no longer averages their gradients (measured: float64 after
    a float32 build, the ranks 0.07 apart after 4 steps of SGD). flatview, which reduces
    itself, trains them right; only bare DDP after :meth:`flatview.FlatView.unwrap` would
    not. ``None`` too where a dtype has no known name."""
    built = ddp._get_ddp_logging_data().get("dtypes")
    names = {_DTYPE_NAMES.get(p.dtype) for p in ddp.module.parameters()}
    if not built or None in names:
        return None
    now = ", ".join(sorted(n for n in names if n is not None))
    if set(built.split(", ")) == set(now.split(", ")):
        return None
    return f"DDP was built for {built}, the parameters are {now} now"


def _ddp_class() -> type[nn.Module] | None:
    return optional_class("torch.nn.parallel", "DistributedDataParallel")


def is_ddp(model: object) -> bool:
    """Whether ``model`` is a ``DistributedDataParallel`` module."""
    ddp = _ddp_class()
    return ddp is not None and isinstance(model, ddp)


def _check_supported(ddp: Any) -> None:
    found = f"{tested_torch()}; found torch {torch.__version__}"
    require_autograd_internals(found)
    require_attrs(ddp, _PRIVATES, "the DistributedDataParallel model", found)
    if ddp.static_graph:
        raise WrapError(
            "DDP was built with static_graph=True, which promises the same used "
            "parameters every step; skip sets break that promise. Build DDP without "
            "static_graph (flatview reduces the gradients itself)"
        )
    if ddp.mixed_precision is not None:
        raise WrapError(
            "DDP's mixed_precision is not supported by flatview; use torch.autocast "
            "or cast the model instead"
        )
    if ddp._use_python_reducer:
        raise WrapError(
            "DDP uses its Python reducer (compiled autograd); flatview drives DDP's "
            "C++ reducer only"
        )
    if ddp._join_config.enable:
        raise WrapError(JOIN_REFUSED + " (the model is inside an enabled Join already)")
    if ddp._delay_all_reduce_params:
        raise WrapError(
            "DDP delays the all-reduce of some parameters to the end of the backward "
            "(device mesh / delay_all_reduce_named_params); flatview does not support that"
        )
    for name, module in ddp.module.named_modules():
        if getattr(module, "sparse", False) is True:
            raise WrapError(
                f"module {name!r} produces sparse gradients (sparse=True); flatview "
                "all-reduces dense gradients only"
            )


@dataclass(frozen=True)
class DDPModel:
    """A DDP model that passed every check (:func:`inspect`)."""

    root: Any
    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    compression: Compression | None
    """How its communication hook reduces (``None``: no hook)."""


def inspect(model: nn.Module) -> DDPModel:
    """Check ``model`` (a ``DistributedDataParallel`` module) for everything the adapter
    relies on, before anything is patched."""
    ddp: Any = model
    _check_supported(ddp)
    compression = compression_of(ddp)
    group: dist.ProcessGroup | None = ddp.process_group
    return DDPModel(ddp, group, dist.get_rank(group), dist.get_world_size(group), compression)
