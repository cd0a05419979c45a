"""Worker tasks of ``test_integrations`` for the layer drop of a Hugging Face model trained
by the Lightning Trainer with ``FlatViewCallback(layerdrop=seed)``: the tiny BART of
:mod:`tests.layerdrop_workers` inside a LightningModule, under DDP, FSDP2
(``ModelParallelStrategy``, a unit per layer) and DeepSpeed (``"deepspeed<stage>"``,
:class:`tests.lightning_workers.CPUDeepSpeed`), against the unwrapped model in one process
with the layers each batch dropped passed over by hand. Called through
:func:`tests.integration_workers.call`, so only the workers import Lightning."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from flatview.integrations.lightning import FlatViewCallback
from tests import layerdrop_workers as lw
from tests.integration_workers import framework_env, params_of, without_prefix
from tests.lightning_workers import quiet_trainer, strategy_of

PER_EPOCH = 4
"""Batches per epoch; a fit of two epochs is checkpointed between them."""


class BartLit(pl.LightningModule):
    """The tiny BART (layer drop on in both stacks) as ``self.model``; each batch trains
    on this rank's chunk of batch ``epoch * PER_EPOCH + batch_idx`` and records the
    layers the callback's layer drop dropped for it."""

    def __init__(self, sharded: bool, callback: FlatViewCallback) -> None:
        super().__init__()
        self.model = lw.tiny_bart()
        self.sharded = sharded
        self.callback = callback
        self.drops: list[list[str]] = []

    def configure_model(self) -> None:
        if not self.sharded:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        layers = lw.bart_layers()
        for module in list(self.model.modules()):
            if isinstance(module, tuple(layers)):
                fully_shard(module, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        assert self.callback.layerdrop is not None
        # Paths in the wrapped model: DDP wraps this module, FSDP2 shards self.model.
        inside = "" if self.sharded else "model."
        self.drops.append([n.removeprefix(inside) for n in self.callback.layerdrop.dropped])
        micro = self.current_epoch * PER_EPOCH + batch_idx
        return lw.bart_loss(self.model, micro, chunk=True)

    def configure_optimizers(self) -> Any:
        return lw.adamw(self.parameters())


def _fit(strategy: str, accumulate: int, tmp: str, epochs: int, resume: str | None) -> Any:
    callback = FlatViewCallback(layerdrop=3)
    module = BartLit(strategy == "fsdp2", callback)
    trainer = quiet_trainer(strategy_of(strategy), tmp, [callback], epochs, accumulate)
    loader = DataLoader(list(range(PER_EPOCH)), batch_size=None)
    trainer.fit(module, loader, ckpt_path=resume)
    return trainer, module


def _trained(trainer: Any, module: BartLit) -> dict[str, np.ndarray]:
    """The BART's parameters, whole, by their names in it (under DeepSpeed the module's
    are views of this rank's partitions: read through flatview)."""
    model = trainer.strategy.model
    if not isinstance(trainer.strategy, pl.strategies.DeepSpeedStrategy):
        return without_prefix(params_of(model), "model.")
    from tests.deepspeed_workers import full_params

    assert module.callback.fv is not None
    return without_prefix(full_params(module.callback.fv, model), "model.")


def layerdrop(strategy: str, accumulate: int) -> dict[str, Any]:
    """Two epochs in one fit, then the same fit checkpointed after the first epoch and
    resumed by a new Trainer, module and callback: the layers each batch dropped (every
    rank), and on rank 0 the largest differences from the reference and between the
    two fits."""
    from flatview.testing import deepspeed_on_cpu

    deepspeed = strategy.startswith("deepspeed")
    with framework_env() as tmp, deepspeed_on_cpu() if deepspeed else contextlib.nullcontext():
        whole, module = _fit(strategy, accumulate, tmp, epochs=2, resume=None)
        drops = module.drops
        got = _trained(whole, module)
        first, module = _fit(strategy, accumulate, tmp, epochs=1, resume=None)
        path = os.path.join(tmp, "resume.ckpt")
        first.save_checkpoint(path)
        again, resumed = _fit(strategy, accumulate, tmp, epochs=2, resume=path)
        resumed_drops = module.drops + resumed.drops
        resumed_got = _trained(again, resumed)
    out: dict[str, Any] = {"drops": drops, "resumed_drops": resumed_drops}
    if dist.get_rank() == 0:
        # Lightning divides the loss by the accumulation; under DeepSpeed the engine's
        # backward divides it once more (scale_wrt_gas): the bare fit's gradients.
        scale = accumulate * (accumulate if deepspeed else 1)

        def loss(model: Any, step: int, chunk: bool = False) -> torch.Tensor:
            return lw.bart_loss(model, step) / scale

        want = lw.reference(drops, lw.tiny_bart(0.0, 0.0), loss, micros=accumulate)
        out["worst"] = max(float(np.abs(got[n] - want[n]).max()) for n in want)
        out["resumed_worst"] = max(float(np.abs(resumed_got[n] - got[n]).max()) for n in got)
        out["names_match"] = sorted(got) == sorted(want)
    return out


def refused_without_steps() -> str:
    """``FlatViewCallback(layerdrop=..., enter_steps=False)``: the draws happen in the
    steps the callback enters, so it is refused when made."""
    from flatview.errors import WrapError

    try:
        FlatViewCallback(layerdrop=0, enter_steps=False)
    except WrapError as error:
        return str(error)
    return "accepted"
