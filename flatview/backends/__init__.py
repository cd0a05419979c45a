"""Backend adapters, one per FSDP implementation, and detection of which one applies."""

from __future__ import annotations

from torch import nn

from flatview.backends.base import Adapter
from flatview.comm.options import ReduceOptions
from flatview.errors import WrapError


def detect(
    model: object, compute_on_views: bool | None = None, options: ReduceOptions | None = None
) -> Adapter:
    """The adapter for ``model``, or a :class:`WrapError` saying why there is none.

    ``compute_on_views``: for torch FSDP1 models whose units all replicate, whether the
    model computes on the views (:mod:`flatview.backends.torch_replicated`); ``None``:
    where eligible. ``options``: how the adapter's reduction reduces (default
    :class:`~flatview.comm.options.ReduceOptions()`); ``overlap`` applies to the adapters
    of replicating wrappers only, anything but ``None`` is refused for the others."""
    from flatview.backends.replicated import ReplicatedAdapter

    options = options if options is not None else ReduceOptions()
    adapter = _choose(model, compute_on_views, options)
    overlap = options.overlap
    if overlap is not None and not isinstance(adapter, ReplicatedAdapter):
        raise WrapError(
            f"overlap_reduction={overlap!r} applies to DistributedDataParallel "
            "models and torch FSDP1 models computed on views only; this "
            f"{type(model).__name__} reduces gradients in its own hooks (leave it None)"
        )
    return adapter


def _choose(model: object, compute_on_views: bool | None, options: ReduceOptions) -> Adapter:
    from flatview.backends import ddp, deepspeed, fairscale, fsdp2, torch_fsdp, torch_replicated

    if torch_fsdp.is_torch_fsdp(model):
        assert isinstance(model, nn.Module)
        adapter = torch_fsdp.TorchFSDPAdapter(model, options)
        if compute_on_views is False:
            return adapter
        reason = torch_replicated.ineligibility(adapter)
        if reason is None:
            return torch_replicated.TorchReplicatedAdapter(adapter, options)
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
        return fairscale.FairscaleAdapter(model, options)
    if ddp.is_ddp(model):
        assert isinstance(model, nn.Module)
        return ddp.DDPAdapter(model, options)
    if torch_fsdp.is_fsdp2(model):
        assert isinstance(model, nn.Module)
        return fsdp2.FSDP2Adapter(model, options)
    if deepspeed.is_engine(model):
        assert isinstance(model, nn.Module)
        return deepspeed.DeepSpeedAdapter(model, options)
    raise WrapError(
        "flatview.wrap expects the outermost FullyShardedDataParallel model (fairscale's, or "
        "torch's FSDP1), a DistributedDataParallel model or a DeepSpeed engine, got"
        f" {type(model).__module__}.{type(model).__qualname__}"
    )
