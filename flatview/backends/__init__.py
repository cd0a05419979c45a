"""Backend adapters, one per FSDP implementation, and detection of which one applies."""

from __future__ import annotations

from torch import nn

from flatview.backends.base import Adapter
from flatview.errors import WrapError


def detect(model: object, compute_on_views: bool | None = None) -> Adapter:
    """The adapter for ``model``, or a :class:`WrapError` saying why there is none.

    ``compute_on_views``: for torch FSDP1 models whose units all replicate, whether the
    model computes on the views (:mod:`flatview.backends.torch_replicated`); ``None``:
    where eligible."""
    from flatview.backends import ddp, fairscale, fsdp2, torch_fsdp, torch_replicated

    if torch_fsdp.is_torch_fsdp(model):
        assert isinstance(model, nn.Module)
        adapter = torch_fsdp.TorchFSDPAdapter(model)
        if compute_on_views is False:
            return adapter
        reason = torch_replicated.ineligibility(adapter)
        if reason is None:
            return torch_replicated.TorchReplicatedAdapter(adapter)
        if compute_on_views:
            raise WrapError(
                f"compute_on_views=True needs every FSDP unit to replicate in full "
                f"precision (NO_SHARD, no mixed precision): {reason}"
            )
        return adapter
    if compute_on_views is not None:
        # Refused whatever the model is, before any adapter touches it.
        raise WrapError(
            f"compute_on_views={compute_on_views!r} applies to torch FSDP1 models only, "
            f"not to a {type(model).__name__} (leave it None)"
        )
    if fairscale.is_fairscale_fsdp(model):
        assert isinstance(model, nn.Module)
        return fairscale.FairscaleAdapter(model)
    if ddp.is_ddp(model):
        assert isinstance(model, nn.Module)
        return ddp.DDPAdapter(model)
    if torch_fsdp.is_fsdp2(model):
        assert isinstance(model, nn.Module)
        return fsdp2.FSDP2Adapter(model)
    raise WrapError(
        "flatview.wrap expects the outermost FullyShardedDataParallel model (fairscale's, or "
        "torch's FSDP1) or a DistributedDataParallel model, got"
        f" {type(model).__module__}.{type(model).__qualname__}"
    )
