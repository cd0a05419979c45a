"""``deepspeed.zero.GatheredParameters`` over flatview's views: refused.

ZeRO 3 code reads or changes whole parameters inside ``GatheredParameters(params,
modifier_rank=...)``: DeepSpeed gathers them there, and broadcasts what the modifier
rank changed when the context ends. On a wrapped engine ``module.parameters()`` are
flatview's views: DeepSpeed does not know them, so the context silently gathers nothing.
Inside it a view is still this rank's piece, and a change made there stays on the rank
that made it. So while a DeepSpeed engine is wrapped, ``GatheredParameters.__init__``
refuses a view (enabled or not is the caller's: ``enabled=False`` passes), naming it,
on every rank alike (every rank passes the same parameters, before any collective).

The class is patched once for all wrapped engines (:func:`watch`) and restored when the
last of them is unwrapped (:func:`unwatch`).
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

from flatview.errors import StateError

__all__ = ["unwatch", "watch"]

_MODULE = "deepspeed.runtime.zero.partition_parameters"


class ViewNames(Protocol):
    def view_name(self, tensor: torch.Tensor) -> str | None:
        """The original name of ``tensor`` if it is one of this model's views."""


_watched: weakref.WeakSet[Any] = weakref.WeakSet()
_original: Callable[..., None] | None = None
"""``GatheredParameters.__init__`` as DeepSpeed defines it, while patched."""


def watch(owner: ViewNames) -> None:
    """Refuse ``owner``'s views in ``GatheredParameters`` until :func:`unwatch`."""
    global _original
    cls = _gathered_class()
    if cls is None:
        return
    if _original is None:
        _original = cls.__init__
        cls.__init__ = _refusing_views(cls.__init__)
    _watched.add(owner)


def unwatch(owner: ViewNames) -> None:
    global _original
    _watched.discard(owner)
    cls = _gathered_class()
    if not _watched and _original is not None and cls is not None:
        cls.__init__, _original = _original, None


def _gathered_class() -> Any:
    return getattr(sys.modules.get(_MODULE), "GatheredParameters", None)


def _refusing_views(init: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(init)
    def checked(
        self: Any,
        params: Any,
        modifier_rank: Any = None,
        fwd_module: Any = None,
        enabled: bool = True,
    ) -> None:
        if isinstance(params, torch.Tensor):
            listed = [params]
        else:
            listed = list(params)
            params = listed
        if enabled:
            for tensor in listed:
                for owner in list(_watched):
                    name = owner.view_name(tensor)
                    if name is not None:
                        raise StateError(
                            f"deepspeed.zero.GatheredParameters over flatview's view of "
                            f"{name}: DeepSpeed does not know views, so it would gather "
                            f"nothing. Inside it {name} would stay this rank's piece, and "
                            "a change made there would not reach the other ranks. Read "
                            "whole parameters with flatview.checkpoint.get_state_dict "
                            "(StateDictOptions(full_state_dict=True)) or FlatView.param_norms, "
                            "write them with flatview.checkpoint.set_state_dict, or "
                            "fv.unwrap() first"
                        )
        init(self, params, modifier_rank=modifier_rank, fwd_module=fwd_module, enabled=enabled)

    return checked
