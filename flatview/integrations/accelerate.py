"""flatview with Hugging Face accelerate: one call where the order matters.

accelerate wraps the model in ``prepare`` (DDP, FSDP1 or FSDP2 per its plugin), and
flatview can only give views of what is wrapped, so the order that works is: prepare the
model, ``flatview.wrap`` it, build the optimizers from the model's submodules (views
now), prepare the optimizers. :func:`prepare` is that order::

    model, fv, (opt_body, opt_head) = flatview.integrations.accelerate.prepare(
        accelerator, model,
        lambda m: [AdamW(m.body.parameters()), SGD(m.head.parameters())],
    )
    for x, y in loader:
        with accelerator.accumulate(model), fv.step(skip=skipped_blocks()):
            accelerator.backward(loss_fn(model(x), y))
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt_body.step(); opt_head.step(); opt_body.zero_grad(); opt_head.zero_grad()

Under FSDP2 (``FullyShardedDataParallelPlugin(fsdp_version=2)``) accelerate prepares an
optimizer only together with its model (it swaps the optimizer's parameters for the
sharded ones); FSDP2 keeps the original parameters, so there the optimizers are built
first and prepared with the model, then the model is wrapped. The caller sees no
difference.

Under the DeepSpeed plugin accelerate builds the engine in ``prepare(model, optimizer)``,
and the engine takes its one optimizer then, before there are views: it is built with a
:class:`flatview.optim.Deferred`, wrapped, and handed the optimizers the factory builds
from views (:func:`_prepare_deepspeed`). The engine steps them in
``accelerator.backward`` at its accumulation boundary, clipping as the DeepSpeed config
says; the user's ``opt.step()`` / ``opt.zero_grad()`` do nothing there, as for any
optimizer accelerate prepares for DeepSpeed.

``accelerator.clip_grad_norm_`` is exact afterwards: where accelerate would take the
norm of this rank's pieces of views (any parameter list but ``model.parameters()`` under
FSDP1, and every list under FSDP1 with views of flat parameters), the norm of the whole
gradients is taken instead (:mod:`flatview.integrations.clipping`); everything else is
accelerate's own (under DeepSpeed it only reports the engine's norm).

Refused (:class:`~flatview.errors.WrapError`, before anything is prepared): an
``Accelerator`` given an FSDP plugin that runs as something else (on CPU accelerate
silently trains with DDP instead), and one that is not distributed at all.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch import nn

import flatview
from flatview.deferred import Deferred
from flatview.errors import WrapError
from flatview.handle import FlatView
from flatview.integrations.clipping import clip_whole, clips_locally
from flatview.integrations.patching import InstancePatches

OptimizerFactory = Callable[..., "torch.optim.Optimizer | Iterable[torch.optim.Optimizer]"]
"""Builds the optimizers from the user's model (``model.body.parameters()``: views), called
as ``factory(model)``, or as ``factory(model, fv)`` where it takes two arguments (to build
:class:`flatview.optim.Whole` over the views)."""


class Prepared(NamedTuple):
    """What :func:`prepare` returns."""

    model: nn.Module
    """What ``accelerator.prepare`` made of the model: train through it."""
    fv: FlatView
    """The handle: ``fv.step(skip=...)``, views, norms, optimizer state."""
    optimizers: list[Any]
    """accelerate's prepared optimizers, in the order the factory built them."""


def prepare(
    accelerator: Any, model: nn.Module, optimizers: OptimizerFactory, **wrap_options: Any
) -> Prepared:
    """Prepare ``model``, wrap it with flatview, build the optimizers from views with
    ``optimizers(model)`` and prepare them; route ``accelerator.clip_grad_norm_``.

    Args:
        accelerator: an ``accelerate.Accelerator`` (DDP, FSDP1, FSDP2 or DeepSpeed).
        model: the user's model, not prepared yet.
        optimizers: ``model -> optimizer or optimizers``, built from ``model``'s
            submodules (their ``parameters()`` are views when it is called); or
            ``(model, fv) -> ...`` to build :class:`flatview.optim.Whole` over them
            (not under the FSDP2 plugin, which builds the optimizers before the wrap).
        **wrap_options: keyword arguments of :func:`flatview.wrap`.

    Raises:
        flatview.WrapError: the accelerator runs in one process, or was given an FSDP
            plugin but runs as something else (accelerate on CPU turns FSDP into DDP);
            or :func:`flatview.wrap` refuses the prepared model.
    """
    return prepare_by(accelerator.prepare, accelerator, model, optimizers, **wrap_options)


def prepare_by(
    prepare_fn: Callable[..., Any],
    accelerator: Any,
    model: nn.Module,
    optimizers: OptimizerFactory,
    **wrap_options: Any,
) -> Prepared:
    """:func:`prepare`, with accelerate's own preparation done by ``prepare_fn``: the
    accelerator's ``prepare`` as it was before something shadowed it (the Trainer
    integration, :mod:`flatview.integrations.hf_trainer`, routes the Trainer's call to
    ``accelerator.prepare`` here)."""
    if check_distributed(accelerator) == "DEEPSPEED":
        return _prepare_deepspeed(prepare_fn, accelerator, model, optimizers, wrap_options)
    if getattr(accelerator, "is_fsdp2", False):
        if _takes_fv(optimizers):
            raise WrapError(
                "under accelerate's FSDP2 plugin the optimizers are built before the model "
                "is wrapped (accelerate prepares an optimizer only together with its model), "
                "so a factory of (model, fv) cannot be served: give a factory of the model "
                "alone; for flatview.optim.Whole, prepare the model with accelerate, "
                "flatview.wrap it and build Whole over it yourself"
            )
        built = _built(optimizers, model, None)
        result = prepare_fn(model, *built)
        # accelerate hands back one object bare, several as a tuple.
        prepared_model, *prepared = result if built else (result,)
        fv = flatview.wrap(prepared_model, **wrap_options)
    else:
        prepared_model = prepare_fn(model)
        fv = flatview.wrap(prepared_model, **wrap_options)
        built = _built(optimizers, model, fv)
        result = prepare_fn(*built) if built else ()
        prepared = list(result) if isinstance(result, tuple) else [result]
    _route_clipping(accelerator, fv)
    return Prepared(prepared_model, fv, prepared)


def _prepare_deepspeed(
    prepare_fn: Callable[..., Any],
    accelerator: Any,
    model: nn.Module,
    optimizers: OptimizerFactory,
    wrap_options: Any,
) -> Prepared:
    """The DeepSpeed plugin's order (see the module docstring). What is returned for
    each optimizer is accelerate's own DeepSpeed optimizer wrapper around it (``step``
    and ``zero_grad`` do nothing: ``accelerator.backward`` steps the engine)."""
    # Looked up here: only the DeepSpeed plugin needs it (accelerate is untyped).
    wrapper: Any = importlib.import_module("accelerate.utils").DeepSpeedOptimizerWrapper
    # The stand-in is not an optimizer DeepSpeed knows; the ones it steps are the user's.
    accelerator.state.deepspeed_plugin.deepspeed_config["zero_allow_untested_optimizer"] = True
    deferred = Deferred(model.parameters())
    engine, _ = prepare_fn(model, deferred)
    fv = flatview.wrap(engine, **wrap_options)
    built = _built(optimizers, model, fv)
    deferred.set(*built)
    return Prepared(engine, fv, [wrapper(opt) for opt in built])


def check_distributed(accelerator: Any) -> str:
    """The accelerator's distributed type (``"MULTI_CPU"``, ``"FSDP"``, ...), refused
    with :class:`~flatview.errors.WrapError` where flatview cannot serve it."""
    kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))
    plugin_given = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if plugin_given and kind != "FSDP":
        raise WrapError(
            f"the Accelerator was given an FSDP plugin but runs as {kind}: accelerate trains "
            "with DDP instead of FSDP here (on CPU it always does). flatview refuses to "
            "stand in silently: drop the FSDP plugin to train with DDP, or run on GPUs"
        )
    if kind == "NO":
        raise WrapError(
            "the Accelerator runs in one process without a distributed wrapper: flatview "
            "needs DDP, FSDP or DeepSpeed (launch with torchrun or accelerate launch)"
        )
    return kind


def _takes_fv(optimizers: OptimizerFactory) -> bool:
    """Whether the factory takes ``(model, fv)``: two positional parameters."""
    try:
        parameters = inspect.signature(optimizers).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in positional for p in parameters) >= 2


def _built(
    optimizers: OptimizerFactory, model: nn.Module, fv: FlatView | None
) -> list[torch.optim.Optimizer]:
    made = optimizers(model, fv) if fv is not None and _takes_fv(optimizers) else optimizers(model)
    if isinstance(made, torch.optim.Optimizer):
        return [made]
    return list(made)


def _route_clipping(accelerator: Any, fv: FlatView) -> None:
    accelerates = accelerator.clip_grad_norm_

    def clip_grad_norm_(
        parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2
    ) -> torch.Tensor:
        params = list(parameters)
        if clips_locally(fv, params):
            accelerator.unscale_gradients()
            return clip_whole(fv, params, max_norm, norm_type)
        return accelerates(params, max_norm, norm_type)

    # For the accelerator's lifetime: it may clip any time it trains this model.
    InstancePatches().set(accelerator, "clip_grad_norm_", clip_grad_norm_)
