"""Backend adapters, one per FSDP implementation, and detection of which one applies."""

from __future__ import annotations

from torch import nn

from flatview.backends.base import Adapter
from flatview.errors import WrapError


def detect(model: object) -> Adapter:
    """The adapter for ``model``, or a :class:`WrapError` saying why there is none."""
    from flatview.backends import fairscale

    if fairscale.is_fairscale_fsdp(model):
        assert isinstance(model, nn.Module)
        return fairscale.FairscaleAdapter(model)
    raise WrapError(
        "flatview.wrap expects the outermost fairscale FullyShardedDataParallel model, got "
        f"{type(model).__module__}.{type(model).__qualname__}"
    )
