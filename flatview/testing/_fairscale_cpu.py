"""Run fairscale's ``FullyShardedDataParallel`` (0.4.13) on CPU over gloo, for tests.

fairscale's FSDP assumes CUDA: it creates CUDA streams at lazy initialisation only when
``torch.cuda.is_available()``, then calls stream APIs unconditionally, defaults its compute
device to ``cuda``, moves the gradient norm to CUDA in ``clip_grad_norm_`` and pins memory
for CPU offload. On a machine without a GPU it fails at the first forward
(``KeyError: 'all_gather'``). :func:`fairscale_on_cpu` supplies CPU stand-ins for exactly
those pieces, for as long as the context is open, and puts every original back on exit.

This is a test aid for CPU-only machines; flatview itself never needs it where CUDA exists.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

__all__ = ["fairscale_on_cpu"]

_FSDP_MODULE = "fairscale.nn.data_parallel.fully_sharded_data_parallel"
_BUCKETER_MODULE = "fairscale.internal.reduce_scatter_bucketer"
_TESTED_VERSION = "0.4.13"


class _CpuEvent:
    """Stand-in for ``torch.cuda.Event``: CPU work is complete when it is issued."""

    def record(self, stream: object = None) -> None:
        """No-op."""

    def wait(self, stream: object = None) -> None:
        """No-op."""

    def synchronize(self) -> None:
        """No-op."""

    def query(self) -> bool:
        """Always done."""
        return True


class _CpuStream:
    """The single stand-in for every CUDA stream.

    CPU kernels run in program order, so there is nothing to wait for. It is a singleton
    because FSDP asserts ``torch.cuda.current_stream() == self._streams["post_backward"]``
    inside code it runs under ``torch.cuda.stream(self._streams["post_backward"])``; with one
    shared object both sides are the same stream. It is a class, not a factory function, so
    ``isinstance(s, torch.cuda.Stream)`` keeps working while the patch is in place.
    """

    _instance: _CpuStream | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> _CpuStream:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: object) -> None:
        """No-op."""

    def wait_event(self, event: object) -> None:
        """No-op."""

    def record_event(self, event: _CpuEvent | None = None) -> _CpuEvent:
        """Return a completed event."""
        return _CpuEvent() if event is None else event

    def synchronize(self) -> None:
        """No-op."""

    def query(self) -> bool:
        """Always idle."""
        return True

    def __repr__(self) -> str:
        return "<flatview.testing CPU stand-in for torch.cuda.Stream>"


_CPU_STREAM = _CpuStream()


class _ThreadDepth(threading.local):
    """How deeply the current thread is inside the wrapped FSDP methods.

    Thread-local so that FSDP initialising in one thread never makes ``is_available()``
    answer True to another.
    """

    lazy_init = 0
    clip_grad_norm = 0
    init_param_attributes = 0
    gather_optim_state = 0


_depth = _ThreadDepth()


@dataclass
class _Saved:
    """What one patched attribute looked like before we touched it."""

    owner: Any
    name: str
    # Whether the attribute lived in the owner's own __dict__. torch.Tensor inherits e.g.
    # ``record_stream`` from torch._C.TensorBase: restoring means deleting our override,
    # not copying the inherited method onto torch.Tensor.
    present: bool
    value: Any


# Patches are applied when the outermost context opens and undone when it closes; nested
# contexts only count. A lock makes enter/exit from several threads safe.
_lock = threading.Lock()
_active = 0
_saved: list[_Saved] = []


def _import_fairscale() -> tuple[ModuleType, ModuleType]:
    try:
        fsdp_mod = importlib.import_module(_FSDP_MODULE)
        bucketer_mod = importlib.import_module(_BUCKETER_MODULE)
    except ImportError as exc:
        raise ImportError(
            "flatview.testing.fairscale_on_cpu needs fairscale (tested with "
            f"{_TESTED_VERSION}); install it with `pip install fairscale=={_TESTED_VERSION}` "
            "or `pip install flatview[fairscale]`"
        ) from exc
    fsdp_cls = getattr(fsdp_mod, "FullyShardedDataParallel", None)
    needed = {
        f"{_FSDP_MODULE}.enable_nccl_base_collectives": hasattr(
            fsdp_mod, "enable_nccl_base_collectives"
        ),
        f"{_FSDP_MODULE}._get_default_cuda_device": hasattr(fsdp_mod, "_get_default_cuda_device"),
        f"{_BUCKETER_MODULE}.enable_nccl_base_collectives": hasattr(
            bucketer_mod, "enable_nccl_base_collectives"
        ),
        "FullyShardedDataParallel._lazy_init": hasattr(fsdp_cls, "_lazy_init"),
        "FullyShardedDataParallel._init_param_attributes": hasattr(
            fsdp_cls, "_init_param_attributes"
        ),
        "FullyShardedDataParallel.clip_grad_norm_": hasattr(fsdp_cls, "clip_grad_norm_"),
        "FullyShardedDataParallel._gather_optim_state": hasattr(fsdp_cls, "_gather_optim_state"),
    }
    missing = [name for name, ok in needed.items() if not ok]
    if missing:
        version = getattr(importlib.import_module("fairscale"), "__version__", "unknown")
        raise ImportError(
            f"fairscale {version} lacks {', '.join(missing)}; "
            f"flatview.testing.fairscale_on_cpu supports fairscale {_TESTED_VERSION}"
        )
    return fsdp_mod, bucketer_mod


def _patch_targets() -> list[tuple[Any, str]]:
    """Every ``(owner, attribute)`` that :func:`fairscale_on_cpu` replaces while open."""
    fsdp_mod, bucketer_mod = _import_fairscale()
    return [(owner, name) for owner, name, _ in _replacements(fsdp_mod, bucketer_mod)]


def _replacements(fsdp_mod: ModuleType, bucketer_mod: ModuleType) -> list[tuple[Any, str, Any]]:
    fsdp_cls = fsdp_mod.FullyShardedDataParallel
    real_is_available: Callable[[], bool] = torch.cuda.is_available
    real_tensor_cuda = torch.Tensor.cuda
    real_pin_memory = torch.Tensor.pin_memory
    real_record_stream = torch.Tensor.record_stream
    real_lazy_init = fsdp_cls._lazy_init
    real_init_param_attributes = fsdp_cls._init_param_attributes
    real_clip_grad_norm = fsdp_cls.clip_grad_norm_
    real_tensor_cpu = torch.Tensor.cpu
    real_gather_optim_state = fsdp_cls._gather_optim_state

    def is_available() -> bool:
        # FSDP only creates its streams (and only syncs with them before an all-gather) if
        # CUDA is available during _lazy_init. Anywhere else the real answer stands, so
        # code that would pick a CUDA device when "available" keeps choosing CPU.
        return _depth.lazy_init > 0 or real_is_available()

    def current_stream(device: object = None) -> _CpuStream:
        return _CPU_STREAM

    def stream(s: object) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def synchronize(device: object = None) -> None:
        pass

    def record_stream(self: torch.Tensor, s: Any) -> None:
        # FSDP marks CPU buffers as used by its (stand-in) streams; the CPU caching
        # allocator has no streams, so there is nothing to record.
        if isinstance(s, _CpuStream):
            return
        real_record_stream(self, s)

    def tensor_cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        # clip_grad_norm_ moves the local norm to CUDA before all-reducing it; on CPU the
        # norm is all-reduced where it is. Only inside clip_grad_norm_.
        if _depth.clip_grad_norm > 0 and not real_is_available():
            return self
        return real_tensor_cuda(self, *args, **kwargs)

    def pin_memory(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        # CPU offload (move_params_to_cpu / move_grads_to_cpu) pins host buffers in
        # _lazy_init (through _init_param_attributes, which flatview also calls for units a
        # step skipped) for fast host-to-device copies. Without an accelerator torch
        # refuses to pin, and there is no device copy to speed up.
        pinning = _depth.lazy_init > 0 or _depth.init_param_attributes > 0
        if pinning and not real_is_available():
            return self
        return real_pin_memory(self, *args, **kwargs)

    def lazy_init(self: Any) -> None:
        _depth.lazy_init += 1
        try:
            real_lazy_init(self)
        finally:
            _depth.lazy_init -= 1

    def init_param_attributes(self: Any, p: torch.nn.Parameter) -> None:
        _depth.init_param_attributes += 1
        try:
            real_init_param_attributes(self, p)
        finally:
            _depth.init_param_attributes -= 1

    def clip_grad_norm_(self: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        _depth.clip_grad_norm += 1
        try:
            result: torch.Tensor = real_clip_grad_norm(self, *args, **kwargs)
            return result
        finally:
            _depth.clip_grad_norm -= 1

    def tensor_cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        # _gather_optim_state all-gathers every state tensor of a flat parameter into one
        # reused buffer and keeps `x.cpu()` of it: a copy from CUDA, but the buffer itself
        # on CPU, which the next tensor (exp_avg_sq after exp_avg) overwrites. As on CUDA:
        # a copy. Only inside _gather_optim_state.
        moved: torch.Tensor = real_tensor_cpu(self, *args, **kwargs)
        if _depth.gather_optim_state > 0 and moved is self:
            return self.clone()
        return moved

    def gather_optim_state(self: Any, *args: Any, **kwargs: Any) -> Any:
        _depth.gather_optim_state += 1
        try:
            return real_gather_optim_state(self, *args, **kwargs)
        finally:
            _depth.gather_optim_state -= 1

    def default_device(module: torch.nn.Module) -> torch.device:
        # Where FSDP would fall back to "cuda" when compute_device is not given.
        return torch.device("cpu")

    # Keep the wrappers recognisable in tracebacks and for functools.wraps-style introspection.
    lazy_init.__wrapped__ = real_lazy_init  # type: ignore[attr-defined]
    init_param_attributes.__wrapped__ = real_init_param_attributes  # type: ignore[attr-defined]
    clip_grad_norm_.__wrapped__ = real_clip_grad_norm  # type: ignore[attr-defined]
    gather_optim_state.__wrapped__ = real_gather_optim_state  # type: ignore[attr-defined]

    # Measured with torch 2.13 (CPU build): dropping any one of these breaks FSDP on CPU,
    # except torch.cuda.stream (torch's own StreamContext is already inert without CUDA)
    # and the FSDP module's flag (gloo accepts the 1-D all_gather_into_tensor). Both stay
    # replaced so the harness does not depend on those details of a torch version.
    return [
        (torch.cuda, "is_available", is_available),
        (torch.cuda, "Stream", _CpuStream),
        (torch.cuda, "current_stream", current_stream),
        (torch.cuda, "stream", stream),
        (torch.cuda, "synchronize", synchronize),
        (torch.Tensor, "record_stream", record_stream),
        (torch.Tensor, "cuda", tensor_cuda),
        (torch.Tensor, "pin_memory", pin_memory),
        (torch.Tensor, "cpu", tensor_cpu),
        (fsdp_cls, "_lazy_init", lazy_init),
        (fsdp_cls, "_init_param_attributes", init_param_attributes),
        (fsdp_cls, "clip_grad_norm_", clip_grad_norm_),
        (fsdp_cls, "_gather_optim_state", gather_optim_state),
        (fsdp_mod, "_get_default_cuda_device", default_device),
        # gloo rejects the 2-D bucket fairscale hands to _reduce_scatter_base ("Check
        # failed: outputShape[0] * worldSize == inputShape[0]"); with the flags off
        # fairscale uses the list forms, which gloo supports. fairscale reads the flags at
        # call time, so flipping the module globals works even after import.
        (fsdp_mod, "enable_nccl_base_collectives", False),
        (bucketer_mod, "enable_nccl_base_collectives", False),
    ]


def _restore(saved: list[_Saved]) -> None:
    # Reverse order, so an attribute patched twice would end at its first saved value.
    for record in reversed(saved):
        if record.present:
            setattr(record.owner, record.name, record.value)
        elif record.name in vars(record.owner):
            delattr(record.owner, record.name)


def _apply(fsdp_mod: ModuleType, bucketer_mod: ModuleType) -> list[_Saved]:
    saved: list[_Saved] = []
    try:
        for owner, name, replacement in _replacements(fsdp_mod, bucketer_mod):
            own = vars(owner)
            saved.append(_Saved(owner, name, name in own, own.get(name)))
            setattr(owner, name, replacement)
    except BaseException:
        _restore(saved)
        raise
    return saved


@contextlib.contextmanager
def fairscale_on_cpu() -> Iterator[None]:
    """Let fairscale 0.4.13 ``FullyShardedDataParallel`` train on CPU over a gloo group.

    A test aid for machines without a GPU. Inside the context, build the FSDP model (so
    that it picks the CPU as its compute device) and run forward, backward, optimizer
    steps, ``clip_grad_norm_``, ``summon_full_params``, ``state_dict`` /
    ``load_state_dict``, ``gather_full_optim_state_dict``, ``local_state_dict`` /
    ``load_local_state_dict``, ``no_sync``,
    nested FSDP units, ``reshard_after_forward`` True or False, ``mixed_precision=True``
    and CPU offload (``cpu_offload`` / ``move_params_to_cpu`` / ``move_grads_to_cpu``).
    Build the model inside the context (outside it FSDP picks ``cuda`` as its compute
    device unless ``compute_device`` is given) and use it only inside: after its first
    forward it holds the stand-in stream.

    While open, it replaces:

    * ``torch.cuda.Stream`` and ``torch.cuda.current_stream`` by one shared no-op stream
      (``wait_stream``, ``wait_event``, ``record_event``, ``synchronize``);
      ``torch.cuda.stream`` by a null context; ``torch.cuda.synchronize`` by a no-op;
      ``torch.Tensor.record_stream`` by a no-op for that stream.
    * ``torch.cuda.is_available`` by a function that answers True only while
      ``FullyShardedDataParallel._lazy_init`` runs (wrapped to track that), so FSDP sets up
      its streams; everywhere else it gives the real answer.
    * ``torch.Tensor.cuda`` by the identity while ``clip_grad_norm_`` runs (wrapped), and
      ``torch.Tensor.pin_memory`` by the identity while ``_lazy_init`` or
      ``_init_param_attributes`` (wrapped to track that) runs (CPU offload); elsewhere both
      behave as before.
    * ``torch.Tensor.cpu`` by one that copies a CPU tensor while ``_gather_optim_state``
      (wrapped) runs: ``gather_full_optim_state_dict`` keeps ``.cpu()`` of a buffer it
      reuses for the next state tensor, a copy from CUDA but the buffer itself on CPU
      (``exp_avg`` came back as ``exp_avg_sq``).
    * fairscale's ``_get_default_cuda_device`` by one returning ``cpu``, so FSDP computes
      on CPU without an explicit ``compute_device``.
    * ``enable_nccl_base_collectives`` in fairscale's FSDP and reduce-scatter bucketer
      modules by False, so reduce-scatter and all-gather use the list forms gloo accepts
      (no ``ENABLE_NCCL_BASE_COLLECTIVES`` environment variable needed).

    Every replaced attribute is put back when the outermost context exits, also on an
    exception. Contexts may be nested (and entered from several threads); patches are
    applied once and undone when the last one closes.

    Limits: ``mixed_precision=True`` computes in float16 on CPU, which torch supports but
    runs slowly and rounds differently from a GPU: compare to references loosely.
    Everything runs synchronously, so bugs that only appear with real stream overlap
    (a missing ``wait_stream`` or ``record_stream``) cannot show up here.

    Raises:
        ImportError: fairscale is not installed, or lacks what this relies on.
    """
    global _active, _saved
    fsdp_mod, bucketer_mod = _import_fairscale()
    with _lock:
        if _active == 0:
            _saved = _apply(fsdp_mod, bucketer_mod)
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0:
                saved, _saved = _saved, []
                _restore(saved)
