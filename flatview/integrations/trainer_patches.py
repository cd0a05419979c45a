"""What the Lightning Trainer's strategy and precision plugin do differently while
flatview drives the model (installed by ``FlatViewCallback`` for one ``fit``).

Lightning offers no hook for these, so they are instance attributes on the Trainer's
own strategy and precision plugin (:class:`~flatview.integrations.patching.InstancePatches`),
removed when the fit ends:

* **Manual optimization** (``automatic_optimization = False``). Lightning calls
  ``training_step`` *through* the wrapper's forward (it patches the LightningModule's
  ``forward`` to be ``training_step`` and calls the DDP or FSDP module), so the user's
  ``manual_backward`` runs while the wrapper's forward is still running: flatview, which
  learns that a backward is coming from the forward's outputs, would see no backward,
  and the gradients would stay unreduced. Here ``training_step`` is called directly,
  and the LightningModule's ``forward`` goes through the wrapper instead: ``self(x)``
  inside ``training_step`` is the wrapper's forward, its outputs feed the loss, and the
  backward comes after it, as in a plain loop. The LightningModule must compute its
  loss through ``self(...)``; a backward whose forward did not reach the wrapper is
  refused after it runs (:class:`~flatview.integrations.batch_steps.BatchSteps`).
  On DDP, Lightning's ``pre_backward`` would also prepare DDP's own reducer for that
  backward (flatview keeps it idle and reduces itself): it does nothing here.
* **Gradient clipping by norm** (``Trainer(gradient_clip_val=...)``, or
  ``self.clip_gradients`` in manual optimization). The precision plugin clips with
  ``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters, which over views
  of a sharded wrapper is the norm of this rank's pieces (and Lightning's FSDP plugin
  refuses it). Where that is so (:func:`~flatview.integrations.clipping.clips_locally`),
  and wherever Lightning's FSDP plugin would refuse, the norm is taken over the whole
  gradients instead, with one all-reduce; over whole parameters (DDP) Lightning's own
  clipping runs, exact already.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from flatview.handle import FlatView
from flatview.integrations.clipping import clip_whole, clips_locally
from flatview.integrations.patching import InstancePatches


class TrainerPatches:
    """The changes above, on ``trainer``'s strategy and precision plugin, for ``fv``."""

    def __init__(self, trainer: Any, fv: FlatView) -> None:
        self.fv = fv
        self._patches = InstancePatches()
        strategy = trainer.strategy
        module = strategy.lightning_module
        if not module.automatic_optimization and strategy.model is not module:
            self._patches.set(strategy, "training_step", _direct_training_step(strategy))
            if _is_ddp(strategy.model):
                self._patches.set(strategy, "pre_backward", _leave_reducer_idle)
        precision = strategy.precision_plugin
        self._patches.set(precision, "clip_grad_by_norm", self._clipper(precision))

    def _clipper(self, precision: Any) -> Any:
        lightnings = precision.clip_grad_by_norm
        fv = self.fv

        # Lightning's FSDP precision plugin refuses to clip by norm (it cannot reach the
        # FSDP root); over flatview's parameters the whole norm is exact at any world size.
        refuses = any(cls.__name__ == "FSDPPrecision" for cls in type(precision).__mro__)

        def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
            params = list(precision.main_params(optimizer))
            if refuses or clips_locally(fv, params):
                clip_whole(fv, params, clip_val)
            else:
                lightnings(optimizer, clip_val)

        return clip_grad_by_norm

    def remove(self) -> None:
        """Undo every change (idempotent)."""
        self._patches.remove()


def _direct_training_step(strategy: Any) -> Any:
    def training_step(*args: Any, **kwargs: Any) -> Any:
        module = strategy.lightning_module
        with (
            strategy.precision_plugin.train_step_context(),
            forward_through(strategy.model, module),
        ):
            return module.training_step(*args, **kwargs)

    return training_step


@contextlib.contextmanager
def forward_through(wrapper: nn.Module, module: nn.Module) -> Iterator[None]:
    """Within the block, ``module(...)`` calls ``wrapper(...)``, whose own call of
    ``module`` reaches ``module``'s real ``forward``."""
    patches = InstancePatches()

    def forward(*args: Any, **kwargs: Any) -> Any:
        patches.remove()  # the wrapper calls module(...): the real forward this time
        try:
            return wrapper(*args, **kwargs)
        finally:
            patches.set(module, "forward", forward)

    patches.set(module, "forward", forward)
    try:
        yield
    finally:
        patches.remove()


def _leave_reducer_idle(closure_loss: Any) -> None:
    """DDP's ``pre_backward`` under manual optimization, with flatview reducing: nothing
    (Lightning's would prepare DDP's reducer for a backward flatview reduces itself)."""


def _is_ddp(model: object) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, DistributedDataParallel)
