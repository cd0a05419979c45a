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
  forward's backward, as it would have decided for DDP.
* DDP broadcasts buffers (``broadcast_buffers``) before a forward only if the forward
  before was a synchronising one (``require_forward_param_sync``, set in
  ``_post_forward``); the forward hook sets it as DDP would have.
* The end of a backward: hooks on the forward's outputs fire when the backward reaches
  them and queue a callback that autograd runs when the whole backward is done. The
  callback all-reduces the gradients of the parameters used since the last
  synchronising backward (divided by the world size first, as DDP averages), in
  buckets of DDP's ``bucket_cap_mb``; a large gradient (``MaskedReducer.reduces_in_place``)
  is all-reduced in place, without packing.

A parameter not in the skip set is used: if this rank's backward gave it no gradient,
it contributes zeros (some other rank's backward did reach it: DDP's
``find_unused_parameters`` gives the same). If no rank's backward reached it, the
model left it out without declaring it: it keeps ``None`` and every rank raises
:class:`~flatview.errors.UndeclaredUnusedError`, learnt from one flag per parameter that
travels in the same all-reduce, so it costs no extra collective.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from flatview.backends._common import AdapterBase, optional_class
from flatview.backends.base import PlainSpec, UnitSpec
from flatview.core import Phase
from flatview.errors import StateError, UndeclaredUnusedError, WrapError
from flatview.layout import FlatLayout, MaskPlan

if TYPE_CHECKING:
    from flatview.core import FlatView

_WRAPPER = "module"
"""The attribute DDP keeps the user's module under (dropped from original names)."""


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


class DDPAdapter(AdapterBase):
    """Maps the flatview core onto one DDP model: one unit, every parameter plain."""

    backend = "ddp"
    # DDP's forward communicates only buffers, the same whatever the skip set.
    overlaps_agreement = True

    def __init__(self, model: nn.Module) -> None:
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
        ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ())
        # Per parameter (first name, in module order): reduced by flatview unless DDP
        # was told to ignore it (then, as with DDP, nobody reduces it).
        self._params: list[tuple[str, nn.Parameter]] = []
        seen: set[int] = set()
        for name, param in ddp.module.named_parameters(remove_duplicate=False):
            if id(param) not in seen:
                seen.add(id(param))
                self._params.append((name, param))
        self._reduced = {id(p) for name, p in self._params if name not in ignored}
        self._plans: dict[int, MaskPlan] = {}
        self._synced = True
        """Whether the backward of the last forward reduces (``no_sync()`` was not on)."""
        self._callback_queued = False
        self._window: set[int] = set()
        """Core indices of parameters used since the last synchronising backward."""

    @staticmethod
    def _check_supported(ddp: Any) -> None:
        if getattr(ddp, "static_graph", False):
            raise WrapError(
                "DDP was built with static_graph=True, which promises the same used "
                "parameters every step; skip sets break that promise. Build DDP without "
                "static_graph (flatview reduces the gradients itself)"
            )
        if getattr(ddp, "_comm_hooks", None):
            raise WrapError(
                "DDP has a communication hook (register_comm_hook); flatview all-reduces "
                "the gradients itself and would bypass it"
            )
        if getattr(ddp, "mixed_precision", None) is not None:
            raise WrapError(
                "DDP's mixed_precision is not supported by flatview; use torch.autocast "
                "or cast the model instead"
            )
        if getattr(ddp, "_use_python_reducer", False):
            raise WrapError(
                "DDP uses its Python reducer (compiled autograd); flatview drives DDP's "
                "C++ reducer only"
            )
        if getattr(ddp, "_delay_all_reduce_params", None):
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

    @staticmethod
    def clean_name(name: str) -> str:
        return clean_name(name)

    def describe(self) -> list[UnitSpec]:
        plain = tuple(
            PlainSpec(name, param, tuple(param.shape), reduced=id(param) in self._reduced)
            for name, param in self._params
        )
        return [UnitSpec("", self.root, (), plain, True)]

    # ---------------------------------------------------------------- install

    def install(self, core: FlatView) -> None:
        self._core = core
        self._hook(self.root.register_forward_pre_hook(self._pre_forward))
        # always_call: a forward that raises must still give DDP its flag back.
        self._hook(self.root.register_forward_hook(self._after_forward, always_call=True))

    def uninstall(self) -> None:
        super().uninstall()
        self._window.clear()

    # -------------------------------------------------------------- lifecycle

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        core = self.core
        ddp: Any = self.root
        core.begin_compute(outermost=True)
        core.guard_skipped_plain()
        self._synced = bool(ddp.require_backward_grad_sync)
        # DDP's reducer stays idle: flatview reduces after the backward.
        ddp.require_backward_grad_sync = False

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        ddp: Any = self.root
        ddp.require_backward_grad_sync = self._synced
        if output is None or not torch.is_grad_enabled():
            self.core.end_forward_only()
            return
        # What DDP's _post_forward does after a synchronising forward: buffers are
        # broadcast again before the next one.
        ddp.require_forward_param_sync = self._synced
        for leaf in tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                # Not kept for uninstall: these die with the output.
                leaf.register_hook(self._backward_starts)

    def _backward_starts(self, grad: torch.Tensor) -> None:
        if self._core is None or self._callback_queued:
            return
        self._callback_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        self._callback_queued = False
        core = self.core
        if core.phase is not Phase.COMPUTING:
            raise StateError(
                "a second backward through a forward whose backward already ran "
                "(retain_graph=True): flatview reduces once per forward; run a new forward"
            )
        self._window.update(i for i in core.plain_used() if id(core.tensor(i)) in self._reduced)
        if self._synced:
            window, self._window = sorted(self._window), set()
            core.settle_agreement()
            self._reduce(window)
        core.end_backward(self._synced)

    # -------------------------------------------------------------- reduction

    @torch.no_grad()
    def _reduce(self, indices: list[int]) -> None:
        """All-reduce (average) the gradients of the parameters ``indices``.

        One flag per parameter travels in the same bucket: whether this rank's backward
        gave it a gradient. A parameter that no rank's did was left out of the model
        without being declared skipped: it keeps ``None`` and every rank raises
        :class:`UndeclaredUnusedError` after the collective (DDP would have hung or
        raised at the next forward)."""
        core = self.core
        reducer = core.reducer
        world = float(self.world_size)
        params = [core.tensor(index) for index in indices]
        if not params:
            return  # everything skipped or frozen, on every rank alike
        had = [param.grad is not None for param in params]
        whole: list[torch.Tensor] = []
        for param in params:
            grad = param.grad
            if grad is None:
                # Used, but this rank's backward did not reach it: zeros (see above).
                grad = param.grad = torch.zeros_like(param)
            if grad.is_contiguous():
                flat = grad.view(-1)
                plan = self._plan(flat.numel())
                if reducer.reduces_in_place(flat, plan):
                    # Large: no copy into the bucket, the all-reduce starts at once.
                    reducer.all_reduce_in_place(flat, plan, world)
                    continue
            whole.append(grad)
        # In the parameters' dtype, so that they share the gradients' all-reduce.
        dtype = params[0].dtype if params[0].dtype.is_floating_point else torch.float32
        flags = torch.tensor(had, dtype=dtype, device=params[0].device)
        reducer.all_reduce_whole([*whole, flags], world)
        reducer.settle()
        unused = [k for k, v in enumerate(flags.tolist()) if v == 0]
        if unused:
            for k in unused:
                params[k].grad = None
            names = [core.name(indices[k]) for k in unused]
            raise UndeclaredUnusedError(
                f"parameter(s) {', '.join(repr(n) for n in names)} got no gradient on any "
                "rank in this backward pass, but are not declared skipped. Pass what a step "
                "does not use to FlatView.step(skip=...)."
            )

    def _plan(self, numel: int) -> MaskPlan:
        plan = self._plans.get(numel)
        if plan is None:
            plan = self._plans[numel] = MaskPlan.build(FlatLayout.packed([(numel,)], 1), (True,))
        return plan
