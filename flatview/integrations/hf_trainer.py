"""flatview where Hugging Face ``transformers`` users train: the ``Trainer``, in one call.

::

    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    attach(trainer, skip=lambda model, inputs: blocks_to_skip(inputs))
    trainer.train()

:func:`attach` changes three things on this one ``Trainer`` (instance attributes, never
its class; :meth:`Attached.remove` puts them back):

* **The wrap.** The ``Trainer`` prepares the model with its accelerator inside
  ``train()``; the call that prepares the user's model goes through
  :func:`flatview.integrations.accelerate.prepare_by` instead: accelerate prepares it,
  ``flatview.wrap`` wraps what it made, and the optimizer the ``Trainer`` built is
  prepared with it, as accelerate would (the order for each backend below; under
  DeepSpeed accelerate builds the engine over the ``Trainer``'s optimizer, and the
  engine is wrapped).
  ``accelerator.clip_grad_norm_`` (the ``Trainer``'s ``max_grad_norm``) stays exact.
* **The step.** Each call of ``training_step`` (one micro-batch: its forward and its
  backward) runs inside ``fv.step(skip=skip(model, inputs))``: ``model`` is the model
  given to the ``Trainer``, names are relative to it, ``inputs`` the micro-batch. Under
  gradient accumulation each micro-batch declares its own skip set; the ``Trainer``'s
  ``no_sync`` before the last one is honoured as ``fv.step`` honours it.
* **Layer drop.** With ``layerdrop=seed``, the layer drop of a ``transformers`` model
  (BART, Whisper, wav2vec2, ...) is drawn by :class:`~flatview.integrations.layerdrop.
  LayerDrop` and added to each micro-batch's skip set. Its generator is seeded for every
  micro-batch from ``seed``, the optimizer step and the micro-batch's place in it, so a
  run resumed from a checkpoint (``train(resume_from_checkpoint=...)``) drops what the
  uninterrupted run dropped, with nothing more saved.

Evaluation (``evaluate``, ``predict``, evaluation during training) runs as without
flatview: outside any step, in ``eval()`` mode, where nothing is skipped or dropped. An
``evaluate()`` before ``train()`` under DDP leaves accelerate's mark "prepared" on the
model, after which the bare ``Trainer`` trains it without DDP, each rank alone; the mark
is cleared before the training's prepare, so the model is wrapped.

Which backends: the ``Trainer``'s DDP, FSDP2 (``fsdp_config`` version 2, transformers'
default) and FSDP1, launched in several processes (``torchrun``, ``accelerate launch``).
Under FSDP2 the ``Trainer`` builds its optimizer before the wrap (accelerate swaps in the
sharded parameters), under FSDP1 after it, from the wrapped model: with
``use_orig_params=False`` its parameters are flatview's views by then (weight decay
still decided by their names), with ``True`` torch's own. The ``Trainer``'s checkpoints
are its own (accelerate's FSDP functions); with ``use_orig_params=False`` the two of
FSDP's optimizer-state functions they call, ``FSDP.optim_state_dict`` and
``optim_state_dict_to_load``, are served by :mod:`flatview.checkpoint` for optimizers
over views.

DeepSpeed ZeRO 1, 2 and 3 (``TrainingArguments(deepspeed=config)``): the ``Trainer``
builds its one optimizer before the engine (its AdamW with decay by name, or DeepSpeed's
from the config's ``"optimizer"``), accelerate builds the engine over it, and
``flatview.wrap`` points that optimizer's groups at the views, so a skipped parameter
gets no weight decay and no momentum step (bare DeepSpeed steps it with a zero
gradient). The engine steps at each accumulation boundary inside the last micro-batch's
``training_step``, clipping as the config says; the ``Trainer``'s schedule, its
checkpoints (``engine.save_checkpoint``) and its resume (``load_checkpoint``) are its
own. An ``evaluate()`` before ``train()`` is what the bare ``Trainer`` cannot do under
DeepSpeed either (ZeRO 1/2 refuse it; under ZeRO 3 the training then trains the
evaluation's engine, without an optimizer): it is named at the first training step.

Refused with :class:`~flatview.errors.WrapError` when :func:`attach` is called, before any
collective: FSDP on XLA, a model ``transformers`` sharded at load time, tensor, context or
sequence parallelism, ``auto_find_batch_size`` (which prepares the model anew after running
out of memory), one process without a distributed wrapper, accelerate's FSDP plugin where it
runs as DDP (on CPU), and a second :func:`attach` on the same ``Trainer``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

import flatview
from flatview.errors import StateError, WrapError
from flatview.handle import FlatView
from flatview.integrations.accelerate import check_distributed, prepare_by
from flatview.integrations.batch_steps import Scope, scope_of
from flatview.integrations.layerdrop import LayerDrop
from flatview.integrations.patching import InstancePatches
from flatview.skip import SkipItem

SkipFn = Callable[[nn.Module, dict[str, Any]], "SkipItem | Iterable[SkipItem] | None"]
"""``(model, inputs) -> skip set`` of one micro-batch: ``model`` is the model given to
the ``Trainer`` (names are relative to it), ``inputs`` what its ``training_step`` got."""

_PREPARED_MARK = "_is_accelerate_prepared"
"""accelerate's mark on what its ``prepare`` / ``prepare_model`` has seen."""
_NOT_PREPARED = (
    "the Trainer trains a model its train() did not prepare, so flatview did not wrap it: "
    "an evaluate() or predict() before train() under DeepSpeed ZeRO 3 leaves the "
    "evaluation's engine in place, without an optimizer (the bare Trainer then fails "
    "with \"'NoneType' object has no attribute 'backward'\"). Call train() first, or "
    "evaluate with another Trainer"
)
_ATTACHED = "_flatview_attached"
"""Where an attached ``Trainer`` keeps its :class:`Attached` (a second one is refused)."""


class Attached:
    """flatview attached to one ``Trainer`` (:func:`attach` returns it)."""

    def __init__(self, trainer: Any, skip: SkipFn | None, layerdrop: int | None) -> None:
        self.trainer = trainer
        self.model: nn.Module = trainer.model
        """The model given to the ``Trainer``: skip sets name things relative to it."""
        self._skip = skip
        self._layerdrop_seed = layerdrop
        self._fv: FlatView | None = None
        self._scope = Scope()
        self._layerdrop: LayerDrop | None = None
        self._patches = InstancePatches()

    @property
    def fv(self) -> FlatView:
        """The handle of the wrapped model, once ``train()`` has prepared it."""
        if self._fv is None:
            raise StateError(
                "the Trainer has not prepared its model yet: flatview wraps it when "
                "train() prepares it (fv exists from the first training step on)"
            )
        return self._fv

    @property
    def layerdrop(self) -> LayerDrop | None:
        """The model's :class:`LayerDrop` (with ``layerdrop=seed``), once wrapped."""
        return self._layerdrop

    def remove(self) -> None:
        """Put the ``Trainer``'s own methods back and the layer drop's plain
        probabilities; the model stays wrapped (``fv.unwrap()`` undoes that)."""
        self._patches.remove()
        if self._layerdrop is not None:
            self._layerdrop.remove()
            self._layerdrop = None
        vars(self.trainer).pop(_ATTACHED, None)

    def _install(self, wrap_options: dict[str, Any]) -> None:
        accelerator = self.trainer.accelerator
        accelerates = accelerator.prepare

        def prepare(*objs: Any, **kwargs: Any) -> Any:
            if self._fv is not None or not any(obj is self.model for obj in objs):
                return accelerates(*objs, **kwargs)
            return self._prepare(accelerates, objs, kwargs, wrap_options)

        training_step = self.trainer.training_step

        def step_one_batch(model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            if self._fv is None:
                raise StateError(_NOT_PREPARED)
            if self._layerdrop_seed is not None:
                # training_step's first act, done before the draw: after an evaluation
                # the model is still in eval() mode, where nothing would be drawn.
                model.train()
            with self._step(inputs):
                return training_step(model, inputs, *args, **kwargs)

        self._patches.set(accelerator, "prepare", prepare)
        self._patches.set(self.trainer, "training_step", step_one_batch)

    def _prepare(
        self,
        accelerates: Callable[..., Any],
        objs: tuple[Any, ...],
        kwargs: dict[str, Any],
        wrap_options: dict[str, Any],
    ) -> Any:
        """The ``Trainer``'s ``accelerator.prepare(model, optimizer, ...)``: the model
        prepared and wrapped, the optimizers prepared, returned in the order given."""
        # The Trainer's evaluate() before train() prepares the model for evaluation only
        # (no DDP), and accelerate marks it prepared: its prepare for training would then
        # hand it back unwrapped, and each rank would train alone (the bare Trainer does,
        # transformers 5.24 with accelerate 1.16). Unmarked, it is wrapped for training.
        vars(self.model).pop(_PREPARED_MARK, None)
        if check_distributed(self.trainer.accelerator) == "DEEPSPEED":
            # The Trainer built its one optimizer (and scheduler) over the model's
            # parameters before: accelerate builds the engine over them as always, and
            # flatview.wrap points that optimizer's groups at the views (the Trainer's
            # weight decay by name stays as it grouped them). The model prepared alone is
            # the engine of an evaluation before train() (ZeRO 3 only): not wrapped, the
            # training's prepare builds another.
            prepared = accelerates(*objs, **kwargs)
            if len(objs) > 1:
                self._wrapped(flatview.wrap(prepared[objs.index(self.model)], **wrap_options))
            return prepared
        others = [obj for obj in objs if obj is not self.model]
        unknown = [
            type(obj).__name__ for obj in others if not isinstance(obj, torch.optim.Optimizer)
        ]
        if unknown or kwargs:
            raise WrapError(
                f"the Trainer prepared its model together with {unknown or sorted(kwargs)}: "
                "flatview.integrations.hf_trainer knows a model prepared alone or with its "
                "optimizers only"
            )

        def factory(model: nn.Module) -> list[Any]:
            return others

        prepared = prepare_by(
            accelerates, self.trainer.accelerator, self.model, factory, **wrap_options
        )
        self._wrapped(prepared.fv)
        optimizers = iter(prepared.optimizers)
        out = [prepared.model if obj is self.model else next(optimizers) for obj in objs]
        return out[0] if len(out) == 1 else tuple(out)

    def _wrapped(self, fv: FlatView) -> None:
        self._fv = fv
        self._scope = scope_of(fv, self.model)
        if self._layerdrop_seed is not None:
            self._layerdrop = LayerDrop(fv, seed=self._layerdrop_seed)

    def _step(self, inputs: Any) -> Any:
        fv = self.fv
        skip = self._scope.skip(self._skip(self.model, inputs)) if self._skip else None
        if self._layerdrop is None:
            return fv.step(skip=skip)
        return self._layerdrop.step_at(int(self.trainer.state.global_step), skip=skip)


def attach(
    trainer: Any,
    *,
    skip: SkipFn | None = None,
    layerdrop: int | None = None,
    **wrap_options: Any,
) -> Attached:
    """Train ``trainer``'s model with flatview: wrapped when ``train()`` prepares it, each
    micro-batch inside ``fv.step(skip=skip(model, inputs))``.

    Args:
        trainer: a ``transformers.Trainer`` (or a subclass: ``Seq2SeqTrainer``, TRL's),
            not trained yet, running DDP, FSDP2, FSDP1 or DeepSpeed ZeRO in several
            processes.
        skip: ``(model, inputs) -> skip set`` for each micro-batch (names relative to the
            model given to the ``Trainer``, its modules or parameters); the same on
            every rank. ``None``: nothing skipped but what ``layerdrop`` drops.
        layerdrop: a seed, the same on every rank: the model's own layer drop is drawn
            from it and skipped (:class:`~flatview.integrations.layerdrop.LayerDrop`).
            ``None``: a model whose layer drop is on is refused by flatview at its first
            dropped layer, naming it.
        **wrap_options: keyword arguments of :func:`flatview.wrap`.

    Returns:
        :class:`Attached`: ``.fv`` once ``train()`` has prepared the model.

    Raises:
        flatview.WrapError: the ``Trainer`` runs FSDP on XLA, a model sharded at load time,
            tensor, context or sequence parallelism, ``auto_find_batch_size``, one
            process, or is attached already (see the module docstring).
    """
    if getattr(trainer, _ATTACHED, None) is not None:
        raise WrapError("flatview is attached to this Trainer already (remove() it first)")
    _refuse_unserved(trainer)
    attached = Attached(trainer, skip, layerdrop)
    attached._install(dict(wrap_options))
    setattr(trainer, _ATTACHED, attached)
    return attached


def _refuse_unserved(trainer: Any) -> None:
    if getattr(trainer, "is_fsdp_xla_enabled", False):
        not_yet = "FSDP on XLA"
    elif getattr(trainer, "is_distributed_loading_by_transformers", False):
        not_yet = "a model transformers sharded when it was loaded (tp_plan / device_mesh)"
    elif _model_parallel(trainer):
        not_yet = "tensor, context or sequence parallelism (parallelism_config, autotp_size)"
    elif getattr(trainer.args, "auto_find_batch_size", False):
        # After an out-of-memory error the Trainer prepares the model anew, in a wrapper
        # flatview has not wrapped.
        not_yet = "auto_find_batch_size (give per_device_train_batch_size instead)"
    else:
        check_distributed(trainer.accelerator)
        return
    raise WrapError(
        "flatview.integrations.hf_trainer serves the Trainer's data parallelism (DDP, "
        f"FSDP2, FSDP1, DeepSpeed ZeRO 1-3), not {not_yet} yet"
    )


def _model_parallel(trainer: Any) -> bool:
    """Whether the model is split across ranks other than by data parallelism: accelerate's
    ``parallelism_config`` (tensor, context, sequence) or DeepSpeed's automatic tensor
    parallelism."""
    parallelism = getattr(trainer.accelerator, "parallelism_config", None)
    if parallelism is not None and parallelism.non_data_parallel_size > 1:
        return True
    deepspeed = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    config = getattr(getattr(deepspeed, "hf_ds_config", None), "config", {})
    return int(config.get("tensor_parallel", {}).get("autotp_size", 1)) > 1
