"""Adapter for ``torch.nn.parallel.DistributedDataParallel``: skip sets for DDP.

DDP replicates: every rank holds every parameter whole, where the user put it, so
there is nothing to view and ``fv.parameters()`` are the originals. What flatview adds
is the skip set, declared before the forward instead of searched for after it
(``find_unused_parameters=True`` walks the autograd graph every step, then all-reduces
zeros for everything it did not find). Skipped parameters get no gradient and cost no
communication; used ones are all-reduced by flatview, packed into buckets.

How DDP is driven (public behaviour, checked against torch 2.13):

* DDP decides at forward time whether the next backward reduces: its ``_pre_forward``
  and ``_post_forward`` prepare the C++ reducer only while
  ``require_backward_grad_sync`` is set (``no_sync()`` clears it). The adapter clears it
  around every forward (a forward pre-hook; the forward hook puts the value back), so
  DDP's reducer never expects a gradient and never communicates. The value the user
  left there (``no_sync()`` or not) decides whether flatview reduces after that
  forward's backward, as it would have decided for DDP. It is put back on every exit
  of the forward, ``BaseException`` (``KeyboardInterrupt``) included: the clearing
  happens inside an instance-level ``forward`` that restores it in a ``finally``
  (forward hooks do not run for a ``BaseException``).
* DDP broadcasts buffers (``broadcast_buffers``) before a forward only if the forward
  before was a synchronising one (``require_forward_param_sync``, set in
  ``_post_forward``); the forward hook sets it as DDP would have.
* The reduction (buckets, overlap, the check for parameters no rank used) is shared
  with torch FSDP1 ``NO_SHARD`` computed on views: :mod:`flatview.backends.replicated`.

What the adapter reads of DDP, its private attributes included, is checked at wrap time
(:data:`_PRIVATES`): a torch that renamed one is refused with the attribute named.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from flatview.backends._common import optional_class, require_attrs, require_autograd_internals
from flatview.backends.base import PlainSpec, UnitSpec
from flatview.backends.replicated import ReplicatedAdapter, in_backward
from flatview.comm.options import ReduceOptions
from flatview.errors import WrapError

if TYPE_CHECKING:
    from flatview.backends.base import Runtime

_WRAPPER = "module"
"""The attribute DDP keeps the user's module under (dropped from original names)."""

TESTED = "torch 2.13.x"
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
    "_use_python_reducer",
    "_delay_all_reduce_params",
)
"""What the adapter reads or sets of a DDP model, checked at wrap time: the refusals
below would pass silently on a torch that renamed what they read."""


def _ddp_class() -> type[nn.Module] | None:
    return optional_class("torch.nn.parallel", "DistributedDataParallel")


def is_ddp(model: object) -> bool:
    ddp = _ddp_class()
    return ddp is not None and isinstance(model, ddp)


def clean_name(name: str) -> str:
    """An original name from a name in the DDP-wrapped tree (``module.`` dropped)."""
    if name == _WRAPPER:
        return ""
    return name.removeprefix(_WRAPPER + ".")


class DDPAdapter(ReplicatedAdapter):
    """Maps the flatview core onto one DDP model: one unit, every parameter plain."""

    backend = "ddp"
    clean_name = staticmethod(clean_name)

    def __init__(self, model: nn.Module, options: ReduceOptions | None = None) -> None:
        super().__init__()
        ddp: Any = model
        self.root = ddp
        self._check_supported(ddp)
        self.group: dist.ProcessGroup | None = ddp.process_group
        self.rank: int = dist.get_rank(self.group)
        self.world_size: int = dist.get_world_size(self.group)
        first = next(ddp.module.parameters(), None)
        self.device = first.device if first is not None else torch.device("cpu")
        element = first.element_size() if first is not None else 4
        self.bucket_numel = max(1, int(ddp.bucket_bytes_cap) // element)
        ignored = set(ddp.parameters_to_ignore or ())
        # Per parameter (first name, in module order): reduced by flatview unless DDP
        # was told to ignore it (then, as with DDP, nobody reduces it).
        params: list[tuple[str, nn.Parameter]] = []
        # Per parameter, every further name it is registered under (tied parameters).
        self._aliases: dict[int, list[str]] = {}
        for name, param in ddp.module.named_parameters(remove_duplicate=False):
            if id(param) in self._aliases:
                self._aliases[id(param)].append(name)
            else:
                self._aliases[id(param)] = []
                params.append((name, param))
        reduced = {id(p) for name, p in params if name not in ignored}
        self._init_reduction(params, reduced, int(ddp.bucket_bytes_cap), options)

    @staticmethod
    def _check_supported(ddp: Any) -> None:
        found = f"{TESTED}; found torch {torch.__version__}"
        require_autograd_internals(found)
        require_attrs(ddp, _PRIVATES, "the DistributedDataParallel model", found)
        if ddp.static_graph:
            raise WrapError(
                "DDP was built with static_graph=True, which promises the same used "
                "parameters every step; skip sets break that promise. Build DDP without "
                "static_graph (flatview reduces the gradients itself)"
            )
        if ddp._comm_hooks:
            raise WrapError(
                "DDP has a communication hook (register_comm_hook); flatview all-reduces "
                "the gradients itself and would bypass it"
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

    def describe(self) -> list[UnitSpec]:
        plain = tuple(
            PlainSpec(
                name,
                param,
                tuple(param.shape),
                reduced=id(param) in self._reduced,
                aliases=tuple(self._aliases[id(param)]),
            )
            for name, param in self._params
        )
        return [UnitSpec("", self.root, (), plain, True)]

    # ---------------------------------------------------------------- install

    def install(self, core: Runtime) -> None:
        self._core = core
        self._hook(self.root.register_forward_pre_hook(self._pre_forward))
        # always_call: a forward that raises an Exception ends its iteration here.
        self._hook(self.root.register_forward_hook(self._after_forward, always_call=True))
        self.patch(self.root, "forward", self._quiet_forward(self.root.forward))
        self._install_reduction()

    # -------------------------------------------------------------- lifecycle

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        ddp: Any = self.root
        if not in_backward():
            # Not a recomputation (checkpointing around the whole model): a new iteration.
            self._begin_forward(bool(ddp.require_backward_grad_sync))
            if ddp.will_sync_module_buffers():
                # DDP broadcasts buffers in this forward: a rank that failed in step()
                # must have been heard before that collective.
                self.core.settle_agreement()

    def _quiet_forward(self, original: Any) -> Any:
        ddp: Any = self.root

        def forward(*args: Any, **kwargs: Any) -> Any:
            # DDP's reducer stays idle, in recomputations too: flatview reduces after the
            # backward. The user's value comes back however the forward ends.
            saved = ddp.require_backward_grad_sync
            ddp.require_backward_grad_sync = False
            try:
                with self._root_forward_open():
                    return original(*args, **kwargs)
            finally:
                ddp.require_backward_grad_sync = saved

        return forward

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        ddp: Any = self.root
        if in_backward():
            return  # a recomputation: its outputs feed the backward in flight
        if self._end_forward(output):
            # What DDP's _post_forward does after a synchronising forward: buffers are
            # broadcast again before the next one.
            ddp.require_forward_param_sync = self._synced
