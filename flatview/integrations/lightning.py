"""flatview where Lightning users train: the Trainer (one callback) and Fabric.

**Trainer.** One line::

    trainer = Trainer(strategy="ddp", callbacks=[FlatViewCallback(skip=Lit.skipped)])

:class:`FlatViewCallback` wraps the model the strategy built (``flatview.wrap`` at
``on_fit_start``), enters one ``fv.step(skip=...)`` per batch (each micro-batch under
gradient accumulation) and leaves it after the batch, or on an exception; skip sets name
things relative to the LightningModule. It works with automatic and manual
optimization, and makes Lightning's own gradient clipping by norm exact over views
(:mod:`flatview.integrations.trainer_patches` says what changes, and why).

Which strategies: DDP (``"ddp"``, :class:`~lightning.pytorch.strategies.DDPStrategy`
with ``find_unused_parameters=False``: skip sets replace it), FSDP2
(``ModelParallelStrategy``, sharding in ``configure_model``), both with
``configure_optimizers`` over ``self.<sub>.parameters()`` as usual (neither replaces
parameters), and torch FSDP1 through :class:`FlatViewFSDPStrategy`, which wraps between
FSDP's wrapping and ``configure_optimizers`` so that ``self.<sub>.parameters()`` are
views there (with ``use_orig_params=False``; Lightning's default ``True`` keeps torch's
own). Lightning's ``FSDPStrategy`` needs a GPU.

**Fabric.** ``fv = flatview.wrap(fabric_module)`` takes what ``fabric.setup`` returns
(DDP, ``FSDPStrategy``, ``ModelParallelStrategy``). Optimizers built after that from
``model.<sub>.parameters()`` go through ``fabric.setup_optimizers`` as usual, except
under ``FSDPStrategy(use_orig_params=False)``, whose check for flat parameters refuses
views: :func:`setup_optimizers` is the same call without that check.

This module imports Lightning (``lightning.pytorch``, or ``pytorch_lightning`` when only
that is installed): install ``flatview[integrations]``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeAlias

import torch
from torch import nn

import flatview
from flatview.errors import WrapError
from flatview.handle import FlatView
from flatview.integrations.batch_steps import BatchSteps, scope_of
from flatview.integrations.frameworks import find_wrapper
from flatview.integrations.layerdrop import LayerDrop
from flatview.integrations.patching import InstancePatches
from flatview.integrations.trainer_patches import TrainerPatches
from flatview.phase import Phase
from flatview.skip import SkipSet
from flatview.wrapped_models import wrapping


def _lightning() -> ModuleType:
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError(
        "flatview.integrations.lightning needs Lightning: pip install 'flatview[integrations]' "
        "(or lightning)"
    )


_pl = _lightning()
_Callback: Any = _pl.Callback
_FSDPStrategy: Any = _pl.strategies.FSDPStrategy
_Strategy: Any = _pl.strategies.Strategy

SkipFn: TypeAlias = Callable[[Any, Any, int], SkipSet]
"""``skip(pl_module, batch, batch_idx)``: the skip set of one batch (an unbound method of
the LightningModule fits), the same on every rank."""


class FlatViewCallback(_Callback):
    """flatview for the Lightning Trainer: wrap at ``on_fit_start``, one
    ``fv.step(skip=...)`` per batch.

    Args:
        skip: the skip set of every batch, or a function ``skip(pl_module, batch,
            batch_idx)`` giving it (``pl_module.global_step`` is the optimizer step);
            names are relative to the LightningModule (``"blocks.3"``). It must be the
            same on every rank (checked, see ``flatview.wrap``) and match what the
            forward leaves out: call the same function from ``training_step``.
        enter_steps: ``False`` enters no step: ``training_step`` enters its own
            (``with flatview_of(self.trainer).step(skip=...)``, manual optimization).
        layerdrop: a seed, the same on every rank: the layer drop of the Hugging Face
            ``transformers`` model inside is drawn from it, per batch, and added to the
            batch's skip set (:class:`~flatview.integrations.layerdrop.LayerDrop`, made
            at ``on_fit_start``: :attr:`layerdrop`). Each batch's draws are seeded from
            the seed, ``trainer.global_step`` and the batch's place in that step, so a
            fit resumed from a checkpoint drops what the uninterrupted one did.
        **wrap_options: keyword arguments of :func:`flatview.wrap` (not with
            :class:`FlatViewFSDPStrategy`, which wraps itself: give them to it).

    After ``on_fit_start``, :attr:`fv` is the :class:`~flatview.FlatView`.

    Raises (from the hooks, on every rank alike):
        flatview.WrapError: the strategy built nothing flatview can wrap (one device,
            ``find_unused_parameters=True`` is fine but pointless, a DDP communication
            hook, ...), named.
        flatview.StateError: a backward whose forward did not go through the wrapped
            model (``training_step`` calling submodules instead of ``self(...)``).
    """

    def __init__(
        self,
        skip: SkipSet | SkipFn = None,
        *,
        enter_steps: bool = True,
        layerdrop: int | None = None,
        **wrap_options: Any,
    ) -> None:
        super().__init__()
        if layerdrop is not None and not enter_steps:
            raise WrapError(
                "FlatViewCallback: layerdrop= draws in the steps the callback enters; with "
                "enter_steps=False enter LayerDrop.step() in training_step yourself"
            )
        self.skip = skip
        self.enter_steps = enter_steps
        self.layerdrop_seed = layerdrop
        self.layerdrop: LayerDrop | None = None
        self.wrap_options = wrap_options
        self.fv: FlatView | None = None
        self._steps: BatchSteps | None = None
        self._patches: TrainerPatches | None = None

    # ------------------------------------------------------------------ fitting

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Wrap the strategy's model (or take the strategy's own :class:`FlatView`)."""
        fv = self.fv = self._adopt_or_wrap(trainer)
        self._steps = BatchSteps(fv, scope_of(fv, pl_module))
        self._patches = TrainerPatches(trainer, fv)
        if self.layerdrop_seed is not None and self.layerdrop is None:
            self.layerdrop = LayerDrop(fv, seed=self.layerdrop_seed)

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        """Enter the batch's step."""
        steps = self._require_steps()
        steps.begin_batch()
        if not self.enter_steps:
            return
        skip = self._skip_of(pl_module, batch, batch_idx)
        layerdrop = self.layerdrop
        if layerdrop is None:
            steps.enter(skip)
            return
        at = int(trainer.global_step)
        steps.enter(skip, lambda mapped: layerdrop.step_at(at, skip=mapped))

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        """Check that flatview reduced the backward that just ran."""
        self._require_steps().after_backward()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Leave the batch's step (after the optimizer step, if the batch had one)."""
        self._require_steps().leave()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Leave the step as its body raising ``exception`` does, and undo the patches."""
        if self._steps is not None:
            self._steps.leave(exception)
        self._finish(trainer)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        """Undo the patches; unwrap if the strategy dropped its wrapper (DDP does)."""
        self._finish(trainer)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """As :meth:`on_fit_end` (idempotent)."""
        self._finish(trainer)

    # ------------------------------------------------------------------ helpers

    def _skip_of(self, pl_module: Any, batch: Any, batch_idx: int) -> SkipSet:
        skip = self.skip
        if callable(skip) and not isinstance(skip, (nn.Module, torch.Tensor)):
            return skip(pl_module, batch, batch_idx)
        return skip

    def _require_steps(self) -> BatchSteps:
        if self._steps is None:
            raise WrapError(
                "FlatViewCallback: the model was not wrapped (on_fit_start did not run)"
            )
        return self._steps

    def _finish(self, trainer: Any) -> None:
        if self._steps is not None:
            self._steps.remove()
            self._steps = None
        if self.layerdrop is not None:
            self.layerdrop.remove()
            self.layerdrop = None
        if self._patches is not None:
            self._patches.remove()
            self._patches = None
        fv = self.fv
        # Lightning unwraps DDP at teardown: nothing computes through it. A model that
        # is still the strategy's (FSDP2 inside the LightningModule) stays wrapped, so
        # that trainer.save_checkpoint after the fit goes through flatview too.
        if fv is not None and not self._still_wrapping(trainer) and fv.phase is Phase.IDLE:
            fv.unwrap()

    def wrap_now(self, trainer: Any) -> FlatView | None:
        """Wrap the strategy's model now, before ``on_fit_start`` (which then takes this
        FlatView), if the strategy has built it; ``None`` otherwise."""
        if getattr(trainer.strategy, "model", None) is None:
            return None
        self.fv = self._adopt_or_wrap(trainer)
        return self.fv

    def _adopt_or_wrap(self, trainer: Any) -> FlatView:
        """The strategy's own FlatView, one that wraps its model already, or a new one."""
        fv = getattr(trainer.strategy, "flatview", None)
        if fv is not None and self.wrap_options:
            raise WrapError(
                f"{type(trainer.strategy).__name__} wraps the model itself: give "
                f"{sorted(self.wrap_options)} to it, not to FlatViewCallback"
            )
        if fv is None:
            # Wrapped already: by this callback in an earlier fit (a model the strategy
            # kept, see _finish), or by the user's own flatview.wrap(self) in
            # configure_optimizers (to build flatview.optim.Whole over the views).
            fv = _wrapper_of(trainer.strategy)
            if fv is not None and fv is not self.fv and self.wrap_options:
                raise WrapError(
                    f"the model is wrapped already ({fv!r}): give {sorted(self.wrap_options)} "
                    "to that flatview.wrap, not to FlatViewCallback"
                )
        if fv is None:
            fv = flatview.wrap(trainer.strategy, **self.wrap_options)
        return fv

    def _still_wrapping(self, trainer: Any) -> bool:
        """Whether this callback's model is still the strategy's model or inside it."""
        fv = self.fv
        model = getattr(trainer.strategy, "model", None)
        if fv is None or fv.phase is Phase.DETACHED or not isinstance(model, nn.Module):
            return False
        return any(m is fv.model for m in model.modules())


def _wrapper_of(strategy: Any) -> FlatView | None:
    """The FlatView that wraps the strategy's model already, if any."""
    model = find_wrapper(strategy)
    owner = wrapping(model) if isinstance(model, nn.Module) else None
    return owner if isinstance(owner, FlatView) else None


def flatview_of(trainer: Any) -> FlatView:
    """The :class:`~flatview.FlatView` of a Trainer's fit: the one its
    :class:`FlatViewCallback` or :class:`FlatViewFSDPStrategy` made. Called before the
    callback's ``on_fit_start`` (in ``configure_optimizers``, to build
    :class:`flatview.optim.Whole` over the views) it has the callback wrap the
    strategy's model then."""
    fv = getattr(trainer.strategy, "flatview", None)
    for callback in trainer.callbacks:
        if fv is None and isinstance(callback, FlatViewCallback):
            fv = callback.fv if callback.fv is not None else callback.wrap_now(trainer)
    if fv is None:
        raise WrapError(
            "this Trainer has no FlatView: add FlatViewCallback to its callbacks (the model "
            "is wrapped at on_fit_start)"
        )
    return fv


class FlatViewFSDPStrategy(_FSDPStrategy):
    """Lightning's ``FSDPStrategy`` (torch FSDP1) with flatview wrapped between FSDP's
    wrapping and ``configure_optimizers``, so that ``self.<sub>.parameters()`` there are
    views (and optimizers over them are accepted: Lightning's check for flat parameters
    is left out). Use it with :class:`FlatViewCallback` for skip sets; its
    :attr:`flatview` is the handle.

    Args:
        flatview_options: keyword arguments of :func:`flatview.wrap`; every other
            argument is ``FSDPStrategy``'s.

    Needs a GPU: on CPU Lightning gives torch FSDP no device, which torch refuses; the
    strategy says so before wrapping (use ``ModelParallelStrategy`` or DDP there).
    Lightning's checkpoints hold the optimizers over views in either form (its
    ``state_dict_type``): torch FSDP1's ``optim_state_dict`` pair, which Lightning saves
    and loads them with, is served by :mod:`flatview.checkpoint` for them.
    """

    def __init__(
        self, *args: Any, flatview_options: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.flatview: FlatView | None = None
        self.flatview_options = dict(flatview_options or {})

    def _setup_model(self, model: nn.Module) -> nn.Module:
        if self.root_device.type == "cpu":
            raise WrapError(
                "FlatViewFSDPStrategy (Lightning's FSDPStrategy, torch FSDP1) needs a GPU: "
                "Lightning builds FSDP without a device on CPU, which torch refuses. On CPU "
                "use ModelParallelStrategy (FSDP2) or strategy='ddp'"
            )
        wrapped: nn.Module = super()._setup_model(model)
        return wrapped

    def setup_optimizers(self, trainer: Any) -> None:
        """Wrap the FSDP model, then let ``configure_optimizers`` build optimizers over
        its views."""
        if self.flatview is None or self.flatview.model is not self.model:
            self.flatview = flatview.wrap(self.model, **self.flatview_options)
        # What FSDPStrategy does first (a second fit discards the old optimizers); then
        # the base strategy's optimizers, without FSDPStrategy's check that they hold
        # flat parameters: they hold views of them.
        self._reset_optimizers_and_schedulers()
        _Strategy.setup_optimizers(self, trainer)


def setup_optimizers(fabric: Any, fv: FlatView, *optimizers: torch.optim.Optimizer) -> Any:
    """``fabric.setup_optimizers(*optimizers)`` for optimizers over ``fv``'s views.

    Fabric's ``FSDPStrategy(use_orig_params=False)`` refuses optimizers that do not hold
    FSDP's flat parameters, as optimizers over views do not; this checks instead that
    each holds only ``fv``'s parameters, and leaves Fabric's check out. Under any other
    strategy it is ``fabric.setup_optimizers`` after the same check.

    Raises:
        flatview.OptimStateError: an optimizer holds a tensor that is not one of
            ``fv``'s parameters (a flat parameter, say), named.
    """
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                fv.placement(param)  # raises, naming it, for anything else
    patches = InstancePatches()
    strategy = fabric.strategy
    if any(cls.__name__ == "FSDPStrategy" for cls in type(strategy).__mro__):
        # Fabric's FSDPStrategy.setup_optimizer only checks for flat parameters.
        patches.set(strategy, "setup_optimizer", _as_given)
    try:
        return fabric.setup_optimizers(*optimizers)
    finally:
        patches.remove()


def _as_given(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return optimizer
