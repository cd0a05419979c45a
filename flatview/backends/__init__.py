"""Backend adapters, one per wrapper flatview drives, and the registry that picks the
one a model needs (:mod:`flatview.backends.registry`; the contract between adapters and
the runtime: :mod:`flatview.backends.base`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flatview.backends.base import Adapter
    from flatview.comm.options import ReduceOptions


def detect(
    model: object, compute_on_views: bool | None = None, options: ReduceOptions | None = None
) -> Adapter:
    """:func:`flatview.backends.registry.detect` (imported when first asked: every
    adapter module comes with it)."""
    from flatview.backends.registry import detect as registry_detect

    return registry_detect(model, compute_on_views, options)
