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
* The reduction (buckets, overlap, the check for parameters no rank used) is the
  component it shares with torch FSDP1 ``NO_SHARD`` computed on views:
  :class:`~flatview.backends.replicated.ReplicatedBackward`.

What the adapter reads of DDP, its private attributes included, is checked at wrap time
(:mod:`~flatview.backends.ddp_checks`): a torch that renamed one is refused with the
attribute named.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from flatview.autograd import in_backward
from flatview.backends.base import Adapter, PlainSpec, UnitSpec
from flatview.backends.ddp_checks import (
    HOOK_METHODS,
    DDPModel,
    cast_since_built,
    refuse_enabled_join,
    refusing_join_hook,
)
from flatview.backends.ddp_comm_hooks import SERVED
from flatview.backends.messages import comm_hook_after_wrap
from flatview.backends.names import without_segments
from flatview.backends.patches import Patches
from flatview.backends.replicated import ReplicatedBackward
from flatview.comm.options import ReduceOptions

if TYPE_CHECKING:
    from flatview.backends.base import Runtime

_WRAPPER = "module"
"""The attribute DDP keeps the user's module under (dropped from original names)."""


def clean_name(name: str) -> str:
    """An original name from a name in the DDP-wrapped tree (``module.`` dropped)."""
    if name == _WRAPPER:
        return ""
    return without_segments(name.removeprefix(_WRAPPER + "."))


class DDPAdapter(Adapter):
    """Maps the flatview runtime onto one DDP model: one unit, every parameter plain."""

    backend = "ddp"
    clean_name = staticmethod(clean_name)
    # DDP's forward communicates nothing the skip set decides, and ReplicatedBackward
    # finds the end of a backward inside the root's forward.
    overlaps_agreement = True
    trains_inside_forward = True
    takes_overlap = True

    def __init__(self, model: DDPModel, options: ReduceOptions) -> None:
        ddp: Any = model.root
        self.root = ddp
        self._outer_sync: bool | None = None
        """DDP's ``require_backward_grad_sync`` as the user left it, while flatview clears
        it inside the root's forward (``None`` outside)."""
        self.group = model.group
        self.rank = model.rank
        self.world_size = model.world_size
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
        reduced: set[int] = set()
        for name, param in ddp.module.named_parameters(remove_duplicate=False):
            if id(param) in self._aliases:
                self._aliases[id(param)].append(clean_name(name))
            else:
                self._aliases[id(param)] = []
                params.append((clean_name(name), param))
                if name not in ignored:  # DDP's own name for it
                    reduced.add(id(param))
        self._backward = ReplicatedBackward(
            params, reduced, int(ddp.bucket_bytes_cap), options, self, ddp, model.compression
        )
        self._patches = Patches()

    def describe(self) -> list[UnitSpec]:
        plain = tuple(
            PlainSpec(
                name,
                param,
                tuple(param.shape),
                reduced=id(param) in self._backward.reduced,
                aliases=tuple(self._aliases[id(param)]),
                ignored=id(param) not in self._backward.reduced,
            )
            for name, param in self._backward.params
        )
        return [UnitSpec("", self.root, (), plain, True)]

    # ---------------------------------------------------------------- install

    def install(self, runtime: Runtime) -> None:
        self.runtime = runtime
        patches = self._patches
        patches.hook(self.root.register_forward_pre_hook(self._pre_forward))
        # always_call: a forward that raises an Exception ends its iteration here.
        patches.hook(self.root.register_forward_hook(self._after_forward, always_call=True))
        patches.patch(self.root, "forward", self._quiet_forward(self.root.forward))
        for name in HOOK_METHODS:
            patches.refusing(self.root, name, lambda: comm_hook_after_wrap("DDP", SERVED))
        patches.patch(self.root, "join_hook", refusing_join_hook(self.root.join_hook))
        self._backward.install(runtime, patches)

    def synchronizing(self) -> bool:
        # Inside the root's forward flatview keeps DDP's reducer idle (the flag is
        # cleared there): the user's setting is the one it saved.
        ddp: Any = self.root
        if self._outer_sync is not None:
            return self._outer_sync
        return bool(ddp.require_backward_grad_sync)

    def uninstall(self) -> None:
        self._patches.remove()
        self._backward.uninstall()
        cast = cast_since_built(self.root)
        if cast is not None:
            warnings.warn(
                f"flatview unwrapped a DDP model whose parameters were cast after DDP was "
                f"built ({cast}): bare DDP's reducer keeps what it built for the old "
                "tensors and no longer averages their gradients (the ranks drift apart); "
                "flatview reduced them correctly while wrapped. Build a new DDP around the "
                "module (DistributedDataParallel(ddp.module)) before training on without "
                "flatview, or keep it wrapped",
                stacklevel=3,
            )

    # -------------------------------------------------------------- lifecycle

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        ddp: Any = self.root
        refuse_enabled_join(ddp)
        if not in_backward():
            # Not a recomputation (checkpointing around the whole model): a new iteration.
            self._backward.begin_forward(bool(ddp.require_backward_grad_sync))
            if ddp.will_sync_module_buffers():
                # DDP broadcasts buffers in this forward: a rank that failed in step()
                # must have been heard before that collective.
                self.runtime.settle_agreement()

    def _quiet_forward(self, original: Any) -> Any:
        ddp: Any = self.root

        def forward(*args: Any, **kwargs: Any) -> Any:
            # DDP's reducer stays idle, in recomputations too: flatview reduces after the
            # backward. The user's value comes back however the forward ends.
            saved = ddp.require_backward_grad_sync
            outer, self._outer_sync = self._outer_sync, bool(saved)
            ddp.require_backward_grad_sync = False
            try:
                with self._backward.root_forward():
                    return original(*args, **kwargs)
            finally:
                ddp.require_backward_grad_sync = saved
                self._outer_sync = outer

        return forward

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        ddp: Any = self.root
        if in_backward():
            return  # a recomputation: its outputs feed the backward in flight
        if self._backward.end_forward(output):
            # What DDP's _post_forward does after a synchronising forward: buffers are
            # broadcast again before the next one.
            ddp.require_forward_param_sync = self._backward.reduces
