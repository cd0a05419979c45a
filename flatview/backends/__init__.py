"""Backend adapters, one per FSDP implementation, and detection of which one applies."""

from __future__ import annotations

from torch import nn

from flatview.backends.base import Adapter
from flatview.errors import WrapError


def detect(model: object) -> Adapter:
    """The adapter for ``model``, or a :class:`WrapError` saying why there is none."""
    from flatview.backends import ddp, fairscale, torch_fsdp

    if fairscale.is_fairscale_fsdp(model):
        assert isinstance(model, nn.Module)
        return fairscale.FairscaleAdapter(model)
    if torch_fsdp.is_torch_fsdp(model):
        assert isinstance(model, nn.Module)
        return torch_fsdp.TorchFSDPAdapter(model)
    if ddp.is_ddp(model):
        assert isinstance(model, nn.Module)
        return ddp.DDPAdapter(model)
    if torch_fsdp.is_fsdp2(model):
        raise WrapError(torch_fsdp.FSDP2_MESSAGE)
    raise WrapError(
        "flatview.wrap expects the outermost FullyShardedDataParallel model (fairscale's, or "
        "torch's FSDP1) or a DistributedDataParallel model, got"
        f" {type(model).__module__}.{type(model).__qualname__}"
    )
