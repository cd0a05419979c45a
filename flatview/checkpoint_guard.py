"""torch's own checkpoint functions, refused for optimizers over flatview's views.

``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizers)`` would take
each view's optimizer state for that of a whole flat parameter (or parameter):
:func:`guard_torch_checkpoint`, installed by the handle on FSDP models, makes it raise
before any collective, naming :mod:`flatview.checkpoint`, which offers the same functions.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from flatview.errors import FlatViewError

if TYPE_CHECKING:
    from flatview.backends.base import Runtime


class Guarded(Protocol):
    """Where :func:`guard_torch_checkpoint` installs itself (the handle's site)."""

    backend: str
    root: Any

    @property
    def core(self) -> Runtime: ...

    def patch(self, owner: object, name: str, replacement: Callable[..., Any]) -> None: ...


def guard_torch_checkpoint(adapter: Guarded) -> None:
    """Make torch's ``torch.distributed.checkpoint.state_dict`` functions refuse, with a
    :class:`flatview.FlatViewError` naming this module, optimizers over the views of the
    adapter's model; model-only calls, and optimizers over parameters the wrapper does
    not flatten, go on as before.

    torch reads ``root._fqn_modifiers()`` (when present) while it checks its arguments,
    before any collective: an instance attribute there (removed with the adapter's other
    patches) looks at the calling torch function's optimizers. The decision is local and
    the same on every rank whose optimizers are counterparts, so every rank raises.
    """
    root = adapter.root
    previous = getattr(root, "_fqn_modifiers", None)
    core = adapter.core
    backend = adapter.backend

    def _fqn_modifiers() -> dict[str, str]:
        _refuse_view_optimizers(core, backend)
        found = previous() if callable(previous) else {}
        return dict(found)

    adapter.patch(root, "_fqn_modifiers", _fqn_modifiers)


def _torch_entry_points() -> dict[Any, str]:
    module = sys.modules.get("torch.distributed.checkpoint.state_dict")
    if module is None:
        return {}
    entries = {}
    for name in (
        "get_state_dict",
        "get_optimizer_state_dict",
        "set_state_dict",
        "set_optimizer_state_dict",
    ):
        fn = getattr(module, name, None)
        fn = getattr(fn, "__wrapped__", fn)
        code = getattr(fn, "__code__", None)
        if code is not None:
            entries[code] = name
    return entries


def _refuse_view_optimizers(core: Runtime, backend: str) -> None:
    entries = _torch_entry_points()
    frame = sys._getframe(1)
    while frame is not None and frame.f_code not in entries:
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return
    name = entries[frame.f_code]
    optimizers = frame.f_locals.get("optimizers") or ()
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = (optimizers,)
    for optimizer in optimizers:
        if not isinstance(optimizer, torch.optim.Optimizer):
            continue
        held = _views_held(core, optimizer)
        if held:
            shown = ", ".join(repr(n) for n in held[:3]) + (", ..." if len(held) > 3 else "")
            raise FlatViewError(
                f"torch.distributed.checkpoint.state_dict.{name} cannot handle optimizer "
                f"{type(optimizer).__name__}, which holds flatview's views ({shown}) of a "
                f"{backend} model: torch would take each view's state for the "
                "state of a whole flat parameter (or of a whole parameter). Use "
                f"flatview.checkpoint.{name}(fv, model, ...) instead: the same arguments "
                "and options after fv, a state dict keyed by original names that "
                "torch.distributed.checkpoint.save / load handle and reshard"
            )


def _views_held(core: Runtime, optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of the parameters of ``optimizer`` that torch's functions would misread:
    flatview's own views, and parameters the wrapper shards one by one."""
    names = []
    for group in optimizer.param_groups:
        for tensor in group["params"]:
            index = core.index_of(tensor)
            if index is None:
                continue
            table = core.table
            # A plain parameter with a padded-shard placement is one the wrapper shards
            # by itself (fairscale's flatten_parameters=False).
            if table.own_view(index) or table.placement_of(index).padded_shard:
                names.append(table.name(index))
    return names
