"""flatview: original-parameter views and skip sets for sharded data parallel training.

>>> fv = flatview.wrap(fsdp_model)                  # doctest: +SKIP
>>> opt = torch.optim.AdamW(fsdp_model.module.head.parameters())  # doctest: +SKIP
>>> with fv.step(skip=skipped_blocks):              # doctest: +SKIP
...     loss_fn(fsdp_model(x), y).backward()
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from flatview.backends import detect
from flatview.comm.options import ReduceOptions, Strategy
from flatview.errors import (
    DoubleCountError,
    FlatViewError,
    FrozenMismatchError,
    NormError,
    OptimStateError,
    ParameterError,
    ParamGroupError,
    SkippedParameterUsedError,
    SkipSetError,
    SkipSetMismatchError,
    StateError,
    UndeclaredUnusedError,
    WrapError,
)
from flatview.handle import FlatView
from flatview.integrations.frameworks import find_wrapper
from flatview.phase import Phase
from flatview.stats import StepStats

__all__ = [
    "DoubleCountError",
    "FlatView",
    "FlatViewError",
    "FrozenMismatchError",
    "NormError",
    "OptimStateError",
    "ParamGroupError",
    "ParameterError",
    "Phase",
    "ReduceOptions",
    "SkipSetError",
    "SkipSetMismatchError",
    "SkippedParameterUsedError",
    "StateError",
    "StepStats",
    "Strategy",
    "UndeclaredUnusedError",
    "WrapError",
    "wrap",
]

__version__ = "0.1.0"


def wrap(
    model: nn.Module,
    *,
    check_skip_agreement: bool = True,
    reduce_strategy: Strategy | str = Strategy.AUTO,
    overlap_reduction: bool | None = None,
    compute_on_views: bool | None = None,
    reduce_options: ReduceOptions | None = None,
) -> FlatView:
    """Give an FSDP model's original parameters back as views, and enable skip sets.

    Call it once, right after wrapping the model in FSDP (before or after the first
    forward, but between iterations), on the outermost FSDP module. A model built on the
    meta device is wrapped once its parameters are materialized (after ``to_empty`` and
    their initialisation). A
    ``DistributedDataParallel`` model gets skip sets only: DDP keeps the original
    parameters, which ``FlatView.parameters()`` then returns.

    Args:
        model: the outermost ``FullyShardedDataParallel`` module (fairscale's, or torch's
            FSDP1 with flat parameters or ``use_orig_params=True``), a torch
            ``DistributedDataParallel`` module, a module sharded with FSDP2's
            ``fully_shard``, or a DeepSpeed ``DeepSpeedEngine`` (ZeRO stages 1-3, right
            after ``deepspeed.initialize``: its optimizer is pointed at the views); or a
            framework's object that holds one (:func:`flatview.integrations.find_wrapper`):
            what Fabric's ``setup`` returns, a Lightning ``Trainer``, its strategy, or a
            LightningModule attached to one (accelerate's ``prepare`` returns the wrapper
            itself).
        check_skip_agreement: in every :meth:`FlatView.step`, check with one tiny
            all-gather that all ranks passed the same skip set (turn off once you trust
            your sampler; the check can also be chosen per step). Iterations outside any
            step take part too, as steps skipping nothing (one such all-gather per root
            forward with autograd on that starts an iteration), so that a rank inside a
            checked step while another runs outside any step raises on every rank
            instead of hanging; off, they exchange nothing.
        reduce_strategy: how partly skipped gradients are reduced: ``"auto"`` (even
            reduce-scatter unless skipped spans fall so unevenly across shards that its
            padding costs more than 5%, then an exact all-to-all), ``"reduce_scatter"``
            or ``"all_to_all"``.
        overlap_reduction: DDP models only: start each gradient bucket's all-reduce as
            soon as the backward has produced it, as DDP does (``True``), or reduce
            everything at the end of the backward in as few collectives as DDP's bucket
            size allows (``False``). ``None`` (default): overlap unless the model is on
            CPU, where the collectives compete with the backward for the same cores.
            Applies to torch FSDP1 models computed on views too (below); other FSDP
            models reduce in the wrapper's own gradient hooks: anything but ``None`` is
            refused there.
        compute_on_views: torch FSDP1 models whose every unit is ``NO_SHARD`` (DDP-style;
            torch also picks it at world size 1) without mixed precision: bypass torch's
            per-unit runtime, compute on the views (torch's own parameters with
            ``use_orig_params=True``), and all-reduce the used gradients as for DDP
            (faster; the flat parameters then get no gradient, so optimizers must be
            built from views). ``None``
            (default): wherever eligible; ``True``: refuse a model that is not;
            ``False``: keep torch's runtime.
        reduce_options: every tuning option of the gradient reduction
            (:class:`ReduceOptions`: the two above, and when a gradient is reduced whole
            instead of packed, and how large a bucket buffer is kept between steps).
            ``reduce_strategy`` and ``overlap_reduction``, when given, fill in its
            ``strategy`` and ``overlap``; a contradiction between them is refused.

    Returns:
        The :class:`FlatView` handle. From now on every submodule's ``parameters()``
        returns views (``nn.Parameter`` leaves aliasing this rank's shard), so
        optimizers and parameter groups can be built per submodule. The model keeps its
        handle (in its instance dictionary): keeping what ``wrap`` returns is optional,
        and a model dropped without :meth:`FlatView.unwrap` is freed with its views and
        everything flatview put on it, as the bare wrapper's model is.

    Raises:
        WrapError: ``model`` is not an outermost FSDP model, a DDP model or a DeepSpeed
            engine of a supported configuration (the message names what is not
            supported), is already wrapped or still has parameters on the meta device;
            or it is a framework's object whose model the framework did not distribute.
    """
    model = find_wrapper(model)
    options = _options(reduce_options, Strategy(reduce_strategy), overlap_reduction)
    adapter = detect(model, compute_on_views, options)
    return FlatView(model, adapter, check_skip_agreement=check_skip_agreement)


def _options(
    given: ReduceOptions | None, strategy: Strategy, overlap: bool | None
) -> ReduceOptions:
    """``given`` with the keywords of :func:`wrap` that name one of its fields filled in."""
    options = given if given is not None else ReduceOptions()
    if strategy is not Strategy.AUTO:
        if options.strategy not in (Strategy.AUTO, strategy):
            raise WrapError(
                f"reduce_strategy={strategy.value!r} contradicts reduce_options.strategy="
                f"{options.strategy.value!r}; give one of them"
            )
        options = replace(options, strategy=strategy)
    if overlap is not None:
        if options.overlap not in (None, overlap):
            raise WrapError(
                f"overlap_reduction={overlap!r} contradicts reduce_options.overlap="
                f"{options.overlap!r}; give one of them"
            )
        options = replace(options, overlap=overlap)
    return options
