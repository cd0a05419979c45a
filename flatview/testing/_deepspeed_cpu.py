"""Run DeepSpeed's ZeRO engine (0.19.x) on CPU over a gloo group, for tests.

DeepSpeed picks its accelerator once, at import (``DS_ACCELERATOR``, or CUDA when it
finds one), and its communication backend builds a C++ shared-memory all-reduce op
(``ShareMemCommBuilder``) the first time it is set up on CPU. On a busy 2-core machine
that build did not finish in 240 s, and a build killed half way leaves a lock under
``~/.cache/torch_extensions/*/deepspeed_shm_comm`` on which every later run waits
forever. :func:`deepspeed_on_cpu` sets DeepSpeed up on the CPU accelerator with
gloo collectives and no op ever built, for as long as the context is open, and puts
everything back on exit.

This is a test aid; flatview itself never needs it.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch.distributed as dist

__all__ = ["deepspeed_on_cpu"]

_TESTED_VERSION = "0.19.8"
_COMM_TORCH = "deepspeed.comm.torch"
_COMM = "deepspeed.comm.comm"
_GROUPS = "deepspeed.utils.groups"
_ACCELERATOR = "deepspeed.accelerator.real_accelerator"
_BUILDER = "deepspeed.ops.op_builder.builder"
# Set by torch's inductor when DeepSpeed's import first asks for its cache directory.
_INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"

_lock = threading.Lock()
_active = 0
_undo: list[Any] = []


def _no_shm_op() -> None:
    """Stands in for ``deepspeed.comm.torch.build_shm_op``: no op, gloo's own collectives."""
    return None


def _refuse_build(self: Any, verbose: bool = True) -> None:
    """Stands in for ``OpBuilder.jit_load``: nothing is compiled (and no build lock is
    ever taken) while the context is open."""
    raise RuntimeError(
        f"flatview.testing.deepspeed_on_cpu: DeepSpeed asked to build its {self.name!r} op. "
        "Nothing is compiled inside this context (a killed build leaves a lock under "
        "~/.cache/torch_extensions that hangs later runs): give DeepSpeed a torch "
        "optimizer instead of one of its own, and leave its CPU ops off"
    )


def _import_deepspeed() -> ModuleType:
    try:
        deepspeed = importlib.import_module("deepspeed")
        for name in (_COMM_TORCH, _COMM, _GROUPS, _ACCELERATOR, _BUILDER):
            importlib.import_module(name)
    except ImportError as exc:
        raise ImportError(
            "flatview.testing.deepspeed_on_cpu needs DeepSpeed (tested with "
            f"{_TESTED_VERSION}); install it without building ops: "
            f"`DS_BUILD_OPS=0 pip install deepspeed=={_TESTED_VERSION}` or "
            "`pip install flatview[deepspeed]`"
        ) from exc
    needed = {
        f"{_COMM_TORCH}.build_shm_op": hasattr(sys.modules[_COMM_TORCH], "build_shm_op"),
        f"{_COMM}.cdb": hasattr(sys.modules[_COMM], "cdb"),
        f"{_ACCELERATOR}.set_accelerator": hasattr(sys.modules[_ACCELERATOR], "set_accelerator"),
        f"{_BUILDER}.OpBuilder.jit_load": hasattr(
            getattr(sys.modules[_BUILDER], "OpBuilder", None), "jit_load"
        ),
    }
    missing = [name for name, ok in needed.items() if not ok]
    if missing:
        raise ImportError(
            f"DeepSpeed {getattr(deepspeed, '__version__', 'unknown')} lacks "
            f"{', '.join(missing)}; flatview.testing.deepspeed_on_cpu supports "
            f"DeepSpeed {_TESTED_VERSION}"
        )
    return deepspeed


def _module_state(module: ModuleType) -> dict[str, Any]:
    """The module's globals that are data (its backend, process groups, flags),
    containers copied, so that they can be put back as they were."""
    state = {}
    for name, value in vars(module).items():
        if name.startswith("__") or callable(value) or isinstance(value, ModuleType):
            continue
        state[name] = (value, dict(value) if isinstance(value, dict) else None)
    return state


def _groups_in(value: Any) -> list[dist.ProcessGroup]:
    if isinstance(value, dist.ProcessGroup):
        return [value]
    if isinstance(value, dict):
        return [g for v in value.values() for g in _groups_in(v)]
    if isinstance(value, (list, tuple)):
        return [g for v in value for g in _groups_in(v)]
    return []


def _restore_module(module: ModuleType, before: dict[str, Any]) -> None:
    """Put ``module``'s globals back; process groups DeepSpeed made meanwhile
    (its clone of the world group) are destroyed."""
    kept = {id(g) for value, _ in before.values() for g in _groups_in(value)}
    made: dict[int, dist.ProcessGroup] = {}
    for name, (value, _) in _module_state(module).items():
        for group in _groups_in(value):
            if id(group) not in kept:
                made[id(group)] = group
        if name not in before:
            delattr(module, name)
    for name, (value, contents) in before.items():
        if contents is not None:
            value.clear()
            value.update(contents)
        setattr(module, name, value)
    for group in made.values():
        with contextlib.suppress(Exception):
            dist.destroy_process_group(group)


def _set_env(name: str, value: str, undo: list[Any]) -> None:
    undo.append(("env", name, os.environ.get(name)))
    os.environ[name] = value


def _enter() -> list[Any]:
    """Apply every change and return how to take each back (in reverse)."""
    undo: list[Any] = []
    try:
        inductor_cache = os.environ.get(_INDUCTOR_CACHE)
        undo.append(("env", _INDUCTOR_CACHE, inductor_cache))
        _set_env("DS_ACCELERATOR", "cpu", undo)
        if "LOCAL_RANK" not in os.environ and dist.is_available() and dist.is_initialized():
            # DeepSpeed's engine asserts the variable a launcher would set; one rank per
            # process on one machine, as the worker pools run.
            _set_env("LOCAL_RANK", str(dist.get_rank()), undo)
        _import_deepspeed()
        # DeepSpeed is untyped: its modules are reached through ``Any``.
        accelerator: Any = sys.modules[_ACCELERATOR]
        current = accelerator.ds_accelerator
        if current is None or current._name != "cpu":
            cpu = importlib.import_module("deepspeed.accelerator.cpu_accelerator")
            undo.append(("attr", accelerator, "ds_accelerator", current))
            accelerator.set_accelerator(cpu.CPU_Accelerator())
        comm_torch: Any = sys.modules[_COMM_TORCH]
        undo.append(("attr", comm_torch, "build_shm_op", comm_torch.build_shm_op))
        comm_torch.build_shm_op = _no_shm_op
        builder: Any = getattr(sys.modules[_BUILDER], "OpBuilder")  # noqa: B009
        undo.append(("class_attr", builder, "jit_load", vars(builder).get("jit_load")))
        builder.jit_load = _refuse_build
        for name in (_COMM, _GROUPS):
            undo.append(("module", sys.modules[name], _module_state(sys.modules[name])))
    except BaseException:
        _exit(undo)
        raise
    return undo


def _exit(undo: list[Any]) -> None:
    for record in reversed(undo):
        kind = record[0]
        if kind == "env":
            _, name, value = record
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        elif kind in ("attr", "class_attr"):
            _, owner, name, value = record
            if value is None and kind == "class_attr":
                with contextlib.suppress(AttributeError):
                    delattr(owner, name)
            else:
                setattr(owner, name, value)
        else:
            _, module, state = record
            _restore_module(module, state)


@contextlib.contextmanager
def deepspeed_on_cpu() -> Iterator[ModuleType]:
    """Let DeepSpeed (0.19.8) build and train ZeRO engines on CPU over the initialised
    gloo process group; yields the ``deepspeed`` module.

    Enter it after ``torch.distributed.init_process_group("gloo", ...)``, build the
    engine inside (``deepspeed.initialize(model=..., optimizer=..., config=...)``, which
    then wraps the existing group) and use the engine only inside: on exit DeepSpeed's
    communication backend and its clone of the world group are gone.

    While open:

    * ``DS_ACCELERATOR=cpu`` (DeepSpeed reads it when first imported, which happens
      here) and, if DeepSpeed was imported with another accelerator, its CPU
      accelerator set in its place;
    * ``LOCAL_RANK`` set to this process's rank when no launcher set it (the engine
      asserts it);
    * ``deepspeed.comm.torch.build_shm_op`` returns ``None``: DeepSpeed's backend uses
      gloo's own collectives instead of compiling its shared-memory all-reduce;
    * ``OpBuilder.jit_load`` raises instead of compiling any op, so no build (and no
      build lock under ``~/.cache/torch_extensions``) can start.

    On exit (of the outermost context, also on an exception) all of that is put back,
    and DeepSpeed's communication globals (``deepspeed.comm.comm``) and process groups
    (``deepspeed.utils.groups``) are as they were on entry: the world-group clone
    DeepSpeed made is destroyed, so a reused worker holds nothing of DeepSpeed's but the
    imported modules. ``TORCHINDUCTOR_CACHE_DIR``, which torch sets when DeepSpeed's
    import first asks for it, is put back too.

    Contexts may be nested (and entered from several threads); changes are applied once
    and undone when the last one closes.

    Raises:
        ImportError: DeepSpeed is not installed, or lacks what this relies on.
    """
    global _active, _undo
    with _lock:
        if _active == 0:
            _undo = _enter()
        _active += 1
    try:
        yield sys.modules["deepspeed"]
    finally:
        with _lock:
            _active -= 1
            if _active == 0:
                undo, _undo = _undo, []
                _exit(undo)
