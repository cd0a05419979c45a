"""The backend registry: one :class:`Backend` entry per wrapper flatview drives, in the
order :func:`detect` tries them. ``flatview.wrap`` finds the model's entry here, and its
error for a model no entry takes names every entry.

Adding a backend is one adapter module (``docs/internals.md``, "Adding a backend") and
one entry in :data:`BACKENDS`; ``tests/test_architecture.py`` fails on an adapter class
whose ``backend`` no entry names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from flatview.backends import (
    ddp_checks,
    deepspeed_checks,
    fairscale_checks,
    fsdp2_checks,
    torch_fsdp_checks,
)
from flatview.backends.base import Adapter
from flatview.backends.ddp import DDPAdapter
from flatview.backends.deepspeed import DeepSpeedAdapter
from flatview.backends.fairscale import FairscaleAdapter
from flatview.backends.fsdp2 import FSDP2Adapter
from flatview.backends.torch_fsdp import TorchFSDPAdapter
from flatview.backends.torch_replicated import TorchReplicatedAdapter, ineligibility
from flatview.backends.torch_versions import is_fsdp2, is_torch_fsdp, tested_torch
from flatview.comm.options import MASK_GATHER_MIN_SAVED, ReduceOptions
from flatview.errors import WrapError, listing


@dataclass(frozen=True)
class Backend:
    """One wrapper flatview drives."""

    name: str
    """What its adapters' ``backend`` says (``FlatView.adapter.backend``)."""
    takes: str
    """The model ``flatview.wrap`` takes for it, as the error for other models names it."""
    tested: Callable[[], str]
    """The versions its internals were checked against (``"torch 2.13.x"``)."""
    detects: Callable[[object], bool]
    """Whether a model is this wrapper's (asked in registry order: the first one wins)."""
    build: Callable[[nn.Module, ReduceOptions, bool | None], Adapter]
    """The adapter for a detected model, given the reduction options and
    ``compute_on_views``; it checks the model (refusing with a :class:`WrapError`) before
    it attaches anything."""
    computes_on_views: bool = False
    """Whether ``wrap(compute_on_views=)`` applies (others refuse anything but ``None``)."""


def _torch(model: nn.Module, options: ReduceOptions, compute_on_views: bool | None) -> Adapter:
    """torch FSDP1: computed on views where every unit replicates in full precision
    (``compute_on_views=None``), or as ``compute_on_views`` demands."""
    found = torch_fsdp_checks.inspect(model)
    if compute_on_views is not False:
        reason = ineligibility(found)
        if reason is None:
            return TorchReplicatedAdapter(found, options)
        if compute_on_views:
            raise WrapError(
                f"compute_on_views=True needs every FSDP unit to replicate in full "
                f"precision (NO_SHARD, no mixed precision): {reason}"
            )
    return TorchFSDPAdapter(found, options)


def _fairscale(model: nn.Module, options: ReduceOptions, _: bool | None) -> Adapter:
    return FairscaleAdapter(fairscale_checks.inspect(model), options)


def _ddp(model: nn.Module, options: ReduceOptions, _: bool | None) -> Adapter:
    return DDPAdapter(ddp_checks.inspect(model), options)


def _fsdp2(model: nn.Module, options: ReduceOptions, _: bool | None) -> Adapter:
    return FSDP2Adapter(fsdp2_checks.inspect(model, options), options)


def _deepspeed(model: nn.Module, options: ReduceOptions, _: bool | None) -> Adapter:
    return DeepSpeedAdapter(deepspeed_checks.inspect(model), options)


BACKENDS: tuple[Backend, ...] = (
    Backend(
        "torch",
        "torch's FSDP1 FullyShardedDataParallel (flat parameters or use_orig_params=True)",
        tested_torch,
        is_torch_fsdp,
        _torch,
        computes_on_views=True,
    ),
    Backend(
        "fairscale",
        "fairscale's FullyShardedDataParallel",
        lambda: fairscale_checks.TESTED,
        fairscale_checks.is_fairscale_fsdp,
        _fairscale,
    ),
    Backend("ddp", "torch's DistributedDataParallel", tested_torch, ddp_checks.is_ddp, _ddp),
    Backend(
        "fsdp2",
        "a model sharded with torch's FSDP2 fully_shard, the root included",
        tested_torch,
        is_fsdp2,
        _fsdp2,
    ),
    Backend(
        "deepspeed",
        "a DeepSpeed DeepSpeedEngine (ZeRO stage 1, 2 or 3, fp32)",
        lambda: deepspeed_checks.TESTED,
        deepspeed_checks.is_engine,
        _deepspeed,
    ),
)


def detect(
    model: object, compute_on_views: bool | None = None, options: ReduceOptions | None = None
) -> Adapter:
    """The adapter for ``model``: that of the first entry of :data:`BACKENDS` that
    detects it, or a :class:`WrapError` saying why there is none.

    ``compute_on_views``: for torch FSDP1 models whose units all replicate, whether the
    model computes on the views (:mod:`flatview.backends.torch_replicated`); ``None``:
    where eligible. ``options``: how the adapter's reduction reduces (default
    :class:`~flatview.comm.options.ReduceOptions()`); ``overlap`` applies to the adapters
    of replicating wrappers only (``Adapter.takes_overlap``), anything but ``None`` is
    refused for the others."""
    options = options if options is not None else ReduceOptions()
    entry = next((backend for backend in BACKENDS if backend.detects(model)), None)
    if compute_on_views is not None and (entry is None or not entry.computes_on_views):
        # Refused whatever the model is, before any adapter touches it.
        raise WrapError(
            f"compute_on_views={compute_on_views!r} applies to torch FSDP1 models only, "
            f"not to a {type(model).__name__} (leave it None)"
        )
    if entry is None:
        takes = "; ".join(f"{b.takes} ({b.tested()})" for b in BACKENDS)
        raise WrapError(
            f"flatview.wrap expects the outermost module of a model wrapped by one of: "
            f"{takes}; got {type(model).__module__}.{type(model).__qualname__}"
        )
    assert isinstance(model, nn.Module)
    refuse_meta_parameters(model)
    adapter = entry.build(model, options, compute_on_views)
    overlap = options.overlap
    if overlap is not None and not adapter.takes_overlap:
        raise WrapError(
            f"overlap_reduction={overlap!r} applies to DistributedDataParallel "
            "models and torch FSDP1 models computed on views only; this "
            f"{type(model).__name__} reduces gradients in its own hooks (leave it None)"
        )
    min_saved = options.mask_gather_min_saved
    if min_saved != MASK_GATHER_MIN_SAVED and not adapter.masks_gathers:
        raise WrapError(
            f"ReduceOptions(mask_gather_min_saved={min_saved!r}) applies to fairscale "
            f"models only, whose all-gathers flatview masks; this {type(model).__name__}'s "
            "gathers are the wrapper's own (leave it at its default)"
        )
    return adapter


def refuse_meta_parameters(model: nn.Module) -> None:
    """Refuse a model whose parameters are still on the meta device (built under
    ``torch.device("meta")`` and sharded before ``to_empty``), before any adapter touches
    it: views of storage that does not exist yet would alias nothing, and
    ``module.to_empty`` afterwards replaces the parameters flatview recorded. Every rank
    holds the same meta parameters, so every rank raises, before anything collective."""
    on_meta = [name for name, param in model.named_parameters() if param.is_meta]
    if on_meta:
        raise WrapError(
            f"flatview.wrap was given a model whose parameters are still on the meta "
            f"device ({listing(on_meta, limit=3)}); materialize them first "
            "(module.to_empty(device=...) and their initialisation), then wrap"
        )
