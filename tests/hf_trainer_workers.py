"""Worker tasks of ``test_hf_trainer``: Hugging Face ``transformers``' ``Trainer`` under
DDP, FSDP and DeepSpeed on the pool's 2 ranks with
:func:`flatview.integrations.hf_trainer.attach`, against the same training written out by
hand in one process (AdamW with weight decay by name, the linear schedule, loss scaled by
the accumulation, clipping by the total norm).

The data reach each rank as the suite's scenarios lay them out: a sequential sampler over
rows ordered micro-batch by micro-batch, rank by rank, so that accelerate's sharding of
batches (rank ``r`` takes batches ``r, r + W, ...``) hands rank ``r`` its chunk of each.
Each row carries its micro-batch's index, from which the model and the skip function
decide the same skip set. ``transformers`` is imported inside the tasks.

FSDP: the ``Trainer`` runs accelerate's FSDP plugin only on accelerators (on CPU
accelerate silently trains with DDP instead). :func:`trainer_session` lets accelerate's
state take the FSDP plugin on CPU, as it would on GPUs; everything after that is the
``Trainer``'s and accelerate's own code (FSDP wrapping, delayed optimizer creation, no_sync,
checkpoints). DeepSpeed runs on CPU through :func:`flatview.testing.deepspeed_on_cpu`."""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import flatview
from tests import layerdrop_workers as lw
from tests.integration_workers import EVEN, framework_env
from tests.scenarios import Net, Scenario, batch, loss_of, skip_names

LR = 0.05
DECAY = 0.01
FSDP = {
    "ddp": None,
    "fsdp2": {"version": 2},
    "fsdp1": {"version": 1, "use_orig_params": False},
    "fsdp1-orig": {"version": 1, "use_orig_params": True},
}
"""Each backend's ``fsdp_config`` (``None``: DDP)."""


@contextlib.contextmanager
def trainer_session(deepspeed: bool = False) -> Iterator[str]:
    """:func:`tests.integration_workers.framework_env`, with accelerate's state taking an
    FSDP plugin on CPU (see the module docstring) and reset on the way out, so that the
    next task in the same worker starts from a fresh one; with ``deepspeed``, DeepSpeed
    set up on CPU (:func:`flatview.testing.deepspeed_on_cpu`)."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    from flatview.testing import deepspeed_on_cpu

    init = AcceleratorState.__init__

    def fsdp_on_cpu(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            # accelerate's device is "cpu:0", which FSDP1 refuses. Written into the
            # process's shared state too: a later AcceleratorState() reads it back from
            # there (else the Trainer's accelerator turns to DDP half way through).
            taken = {"distributed_type": DistributedType.FSDP, "device": torch.device("cpu")}
            self.__dict__.update(taken)
            PartialState._shared_state.update(taken)
            self.fsdp_plugin = plugin
            if self.mixed_precision != "no":  # as accelerate does for its FSDP plugin
                plugin.set_mixed_precision(self.mixed_precision)

    AcceleratorState.__init__ = fsdp_on_cpu  # type: ignore[method-assign]
    try:
        with framework_env() as out, deepspeed_on_cpu() if deepspeed else contextlib.nullcontext():
            if deepspeed:
                # As accelerate does on accelerators (on CPU it leaves DeepSpeed's
                # communication to the engine, so that what reads DeepSpeed's config
                # before it, zero.Init and the "auto" batch sizes, counts one process).
                import deepspeed as ds

                ds.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
            yield out
    finally:
        AcceleratorState.__init__ = init  # type: ignore[method-assign]
        fresh_state()


def fresh_state() -> None:
    """A new ``Trainer`` in the same session starts from a fresh accelerate state."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def fsdp_options(backend: str, *layers: str) -> dict[str, Any]:
    """``TrainingArguments`` of ``backend``: nothing for DDP; for FSDP a unit per module
    of the classes named ``layers``, and checkpoints saved sharded (accelerate's full
    state dicts offload to CPU, which on CPU frees tensors still in use: the bare
    ``Trainer`` fails alike)."""
    config = FSDP[backend]
    if config is None:
        return {}
    config = {
        **config,
        "sync_module_states": False,
        "transformer_layer_cls_to_wrap": list(layers),
        "state_dict_type": "SHARDED_STATE_DICT",
    }
    return {"fsdp": True, "fsdp_config": config}


def deepspeed_options(stage: int, own_optimizer: bool = False) -> dict[str, Any]:
    """``TrainingArguments`` of DeepSpeed ZeRO ``stage``, the batch sizes and clipping
    ``"auto"`` (the ``Trainer`` fills them). ``own_optimizer``: DeepSpeed builds the
    optimizer from its config (torch's AdamW, every parameter decayed), the ``Trainer``
    its schedule over it."""
    # ZeRO 3 gathers whole weights for save_model only when told to.
    zero = {"stage": stage, "stage3_gather_16bit_weights_on_model_save": stage == 3}
    config: dict[str, Any] = {
        "zero_optimization": zero,
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
    }
    if own_optimizer:
        params = {"lr": LR, "weight_decay": DECAY, "torch_adam": True, "adam_w_mode": True}
        config["optimizer"] = {"type": "AdamW", "params": params}
    return {"deepspeed": config}


class TrainerNet(Net):
    """The scenarios' model as a ``Trainer`` takes one: inputs by keyword, the loss out;
    the micro-batch's index says what it skips."""

    def __init__(self, scenario: Scenario) -> None:
        torch.manual_seed(scenario.seed)
        super().__init__(scenario)
        self.scenario = scenario

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, labels: torch.Tensor, micro: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        skip: Collection[str] = skip_names(self.scenario, int(micro[0]))
        return {"loss": loss_of(super().forward(x, skip), labels)}


def skipped(model: nn.Module, inputs: dict[str, Any]) -> tuple[str, ...]:
    """The skip function given to :func:`attach`: the same names the model passes over."""
    return skip_names(EVEN, int(inputs["micro"][0]))


def rows(scenario: Scenario) -> list[dict[str, Any]]:
    """Every micro-batch's rows, rank by rank (see the module docstring)."""
    out = []
    for micro in range(len(scenario.skips)):
        x, y = batch(scenario, micro)
        out += [{"x": x[i], "labels": y[i], "micro": torch.tensor(micro)} for i in range(len(y))]
    return out


def evaluated_rows() -> list[dict[str, Any]]:
    """The rows of :data:`EVEN`'s micro-batches that skip nothing: what is evaluated
    (outside any step nothing is skipped, and under ZeRO 3 ranks running other blocks
    would gather other parameters)."""
    return [row for row in rows(EVEN) if not skip_names(EVEN, int(row["micro"]))]


def arguments(out: str, per_rank: int, accumulate: int, clip: float, **more: Any) -> Any:
    """The tests' ``TrainingArguments``; ``more`` adds to them or overrides them."""
    from transformers import TrainingArguments

    given = dict(
        output_dir=out,
        per_device_train_batch_size=per_rank,
        gradient_accumulation_steps=accumulate,
        learning_rate=LR,
        weight_decay=DECAY,
        max_grad_norm=clip,
        num_train_epochs=1,
        train_sampling_strategy="sequential",
        remove_unused_columns=False,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        dataloader_num_workers=0,
    )
    return TrainingArguments(**{**given, **more})


def linear(opt: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The ``Trainer``'s default schedule without warmup: from the learning rate to 0."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda done: (steps - done) / steps)


def trainer_adamw(model: nn.Module, eps: float = 1e-8, by_name: bool = True) -> torch.optim.AdamW:
    """The ``Trainer``'s AdamW: no weight decay on biases and LayerNorm weights (unless
    not ``by_name``: every parameter decayed, as DeepSpeed's own AdamW does)."""
    if not by_name:
        return torch.optim.AdamW(model.parameters(), lr=LR, eps=eps, weight_decay=DECAY)
    norms = {n for n, m in model.named_modules() if isinstance(m, nn.LayerNorm)}
    named = list(model.named_parameters())
    plain = {n for n, _ in named if n.endswith("bias") or n.rpartition(".")[0] in norms}
    groups = [
        {"params": [p for n, p in named if n not in plain], "weight_decay": DECAY},
        {"params": [p for n, p in named if n in plain], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=LR, eps=eps)


def finish(trainer: Any, attached: Any) -> dict[str, np.ndarray]:
    """The trained parameters, whole (:func:`trainable`), once flatview is taken off the
    ``Trainer`` and the model."""
    detach(attached)
    return trainable(trainer, lora=False)


def detach(attached: Any) -> None:
    """flatview taken off the ``Trainer`` (``remove``) and off the model (``unwrap``)."""
    fv = attached.fv
    attached.remove()
    fv.unwrap()


def recording(trainer_class: type) -> type:
    """``trainer_class`` recording, in ``drops``, the layers each micro-batch dropped (its
    ``attached`` set to what :func:`attach` returned)."""

    class Recording(trainer_class):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.attached: Any = None
            self.drops: list[list[str]] = []

        def training_step(self, *args: Any, **kwargs: Any) -> Any:
            self.drops.append(list(self.attached.layerdrop.dropped))
            return super().training_step(*args, **kwargs)

    return Recording


def reference(
    scenario: Scenario, accumulate: int, clip: float, by_name: bool = True
) -> dict[str, np.ndarray]:
    """The run in one process on whole batches, written out (``by_name``: see
    :func:`trainer_adamw`)."""
    net = TrainerNet(scenario)
    opt = trainer_adamw(net, by_name=by_name)
    micros = len(scenario.skips)
    schedule = linear(opt, micros // accumulate)
    for micro in range(micros):
        x, y = batch(scenario, micro)
        loss = net(x, y, torch.tensor([micro]))["loss"] / accumulate
        loss.backward()
        if micro % accumulate == accumulate - 1:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
            opt.step()
            schedule.step()
            opt.zero_grad()
    return {n: p.detach().numpy().copy() for n, p in net.named_parameters()}


def worst(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> float:
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    return max(float(np.abs(got[n] - want[n]).max()) for n in want)


def trains_like_the_reference(backend: str, accumulate: int, clip: float) -> dict[str, Any]:
    """Train :data:`EVEN` through an attached ``Trainer``; on rank 0 the largest difference
    from :func:`reference`, and on every rank, before each optimizer step, the non-empty
    views and those of them without a gradient."""
    from transformers import Trainer, TrainerCallback

    from flatview.integrations.hf_trainer import attach

    seen: list[dict[str, list[str]]] = []

    class Record(TrainerCallback):  # type: ignore[misc]
        def on_pre_optimizer_step(self, *args: Any, **kwargs: Any) -> None:
            views = [(n, p) for n, p in attached.fv.named_parameters() if p.numel()]
            seen.append(
                {
                    "views": sorted(n for n, _ in views),
                    "none": sorted(n for n, p in views if p.grad is None),
                }
            )

    with trainer_session() as out:
        net = TrainerNet(EVEN)
        more = fsdp_options(backend, "Block")
        args = arguments(out, EVEN.batch_per_rank, accumulate, clip, save_strategy="no", **more)
        # Evaluated first on the micro-batch that skips nothing (outside any step): under
        # FSDP2 that prepares (and wraps) the model, under DDP it marks it prepared. Not
        # under FSDP1, where the bare Trainer then fails to build its optimizer.
        # Under DDP the optimizer and schedule are given, as users may (the Trainer's
        # own, built alike); the Trainer refuses that under FSDP.
        given: Any = (None, None)
        if backend == "ddp":
            opt = trainer_adamw(net)
            given = (opt, linear(opt, len(EVEN.skips) // accumulate))
        trainer = Trainer(
            model=net,
            args=args,
            train_dataset=rows(EVEN),
            eval_dataset=evaluated_rows(),
            callbacks=[Record()],
            optimizers=given,
        )
        attached = attach(trainer, skip=skipped)
        if not backend.startswith("fsdp1"):
            trainer.evaluate()
        trainer.train()
        wrapper = type(attached.fv.model).__name__
        got = finish(trainer, attached)
    diff = worst(got, reference(EVEN, accumulate, clip)) if dist.get_rank() == 0 else None
    return {"worst": diff, "seen": seen, "wrapper": wrapper}


def backend_options(backend: str) -> dict[str, Any]:
    """``TrainingArguments`` of ``backend``: ``"zero<stage>"`` (DeepSpeed, see
    :func:`deepspeed_options`; ``"zero<stage>-own"`` with DeepSpeed's own optimizer) or
    one of :data:`FSDP` (a unit per ``Block``)."""
    if backend.startswith("zero"):
        stage, _, own = backend.removeprefix("zero").partition("-")
        return deepspeed_options(int(stage), own == "own")
    return fsdp_options(backend, "Block")


def resumes_like_the_reference(backend: str, accumulate: int, clip: float) -> dict[str, Any]:
    """Train :data:`EVEN` through an attached ``Trainer`` on ``backend`` (see
    :func:`backend_options`), saving a checkpoint after its first step, and its model at
    the end (``save_model``, while wrapped; not under FSDP, which saves sharded state
    dicts only); then a fresh ``Trainer`` resumed from the checkpoint. On rank 0 the
    largest differences from :func:`reference` and of the saved model, and on every rank
    the resumed run's from the uninterrupted one."""
    from safetensors.torch import load_file
    from transformers import Trainer

    from flatview.integrations.hf_trainer import attach

    def trained(resume: str | None) -> dict[str, np.ndarray]:
        more = backend_options(backend)
        saving = {"save_strategy": "no"} if resume else {"save_strategy": "steps", "save_steps": 1}
        args = arguments(out, EVEN.batch_per_rank, accumulate, clip, **saving, **more)
        trainer = Trainer(model=TrainerNet(EVEN), args=args, train_dataset=rows(EVEN))
        attached = attach(trainer, skip=skipped)
        trainer.train(resume_from_checkpoint=resume)
        if resume is None and not fsdp:  # what from_pretrained would load
            trainer.save_model(f"{out}/final")
        got = finish(trainer, attached)
        fresh_state()
        return got

    fsdp = backend.startswith("fsdp")
    with trainer_session(deepspeed=backend.startswith("zero")) as out:
        got = trained(None)
        saved = {} if fsdp else load_file(f"{out}/final/model.safetensors")
        resumed = trained(f"{out}/checkpoint-1")
    result: dict[str, Any] = {"resumed_worst": worst(resumed, got), "worst": None}
    if dist.get_rank() == 0:
        by_name = not backend.endswith("-own")
        result["worst"] = worst(got, reference(EVEN, accumulate, clip, by_name=by_name))
        result["saved_worst"] = (
            worst({n: t.numpy() for n, t in saved.items()}, got) if saved else None
        )
    return result


def zero3_evaluated_first() -> str:
    """Under ZeRO 3 an ``evaluate()`` before ``train()``: what the first training step
    raises (the bare ``Trainer`` fails there too, less clearly)."""
    from transformers import Trainer

    from flatview.integrations.hf_trainer import attach

    with trainer_session(deepspeed=True) as out:
        more = deepspeed_options(3)
        args = arguments(out, EVEN.batch_per_rank, 1, 0.0, save_strategy="no", **more)
        trainer = Trainer(
            model=TrainerNet(EVEN),
            args=args,
            train_dataset=rows(EVEN),
            eval_dataset=evaluated_rows(),
        )
        attach(trainer, skip=skipped)
        trainer.evaluate()
        try:
            trainer.train()
        except flatview.StateError as error:
            return str(error)
        finally:
            fresh_state()
    return "trained"


# ----------------------------------------------------------------------- layer drop


class Rows(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """The tiny BART's batches of :mod:`tests.layerdrop_workers`, row by row, laid out as
    :func:`rows` lays out the scenarios'."""

    def __init__(self, micros: int) -> None:
        world = dist.get_world_size()
        self.items = []
        for micro in range(micros):
            ids, labels = lw.batch(micro, rows=2 * world)
            self.items += [{"input_ids": ids[i], "labels": labels[i]} for i in range(len(ids))]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.items[index]


def bart_trainer(
    out: str, backend: str, micros: int, accumulate: int, **more: Any
) -> tuple[Any, Any, list[Any]]:
    """A ``Trainer`` of the tiny BART (its layer drop on, its embeddings untied: see
    :func:`tests.layerdrop_workers.tiny_bart`), attached with ``layerdrop=7``,
    evaluating after every optimizer step (in ``eval()`` mode: nothing dropped, nothing
    trained); the layers each micro-batch dropped are recorded."""
    from transformers import Trainer

    from flatview.integrations.hf_trainer import attach

    if backend.startswith("zero"):
        more.update(deepspeed_options(int(backend[-1])))
    else:
        more.update(fsdp_options(backend, "BartEncoderLayer", "BartDecoderLayer"))
    args = arguments(out, 2, accumulate, 1.0, adam_epsilon=1e-4, eval_steps=1, **more)
    model = lw.tiny_bart(tie=False)
    # Untied, the BART of transformers 5 never reads model.shared. It is declared
    # skipped, but under FSDP2 frozen: torch's sharded checkpoints cannot load an
    # optimizer that never stepped a parameter it holds (the bare Trainer fails alike).
    dead = None if backend == "fsdp2" else "model.shared"
    if dead is None:
        model.get_submodule("model.shared").requires_grad_(False)
    trainer = recording(Trainer)(
        model=model, args=args, train_dataset=Rows(micros), eval_dataset=Rows(1)
    )
    trainer.attached = attach(trainer, layerdrop=7, skip=lambda model, inputs: dead)
    return trainer, trainer.attached, trainer.drops


def bart_reference(drops: list[list[str]], accumulate: int) -> dict[str, np.ndarray]:
    """The unwrapped BART in one process, the layers each micro-batch dropped passed
    over (:func:`tests.layerdrop_workers.reference`), with the ``Trainer``'s schedule,
    decay and clipping, and its loss scaling for a model whose forward takes ``**kwargs``
    (it expects such a model to divide by ``num_items_in_batch``, which BART's loss does
    not): not divided by the accumulation, multiplied by the number of ranks
    (``average_tokens_across_devices``)."""
    model = lw.tiny_bart(0.0, 0.0, tie=False)
    model.train()
    opt = trainer_adamw(model, eps=1e-4)
    schedule = linear(opt, len(drops) // accumulate)
    world = dist.get_world_size()
    for micro, dropped in enumerate(drops):
        kept = {name: model.get_submodule(name) for name in dropped}
        for name in dropped:
            model.set_submodule(name, lw.PassOver())
        ids, labels = lw.batch(micro, rows=2 * world)
        (model(input_ids=ids, labels=labels).loss * world).backward()
        for name, layer in kept.items():
            model.set_submodule(name, layer)
        if micro % accumulate == accumulate - 1:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            schedule.step()
            opt.zero_grad()
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def layerdrop_like_the_reference(
    backend: str, micros: int, accumulate: int, recompute: bool
) -> dict[str, Any]:
    """The tiny BART trained through the ``Trainer`` with its layer drop (``recompute``:
    with the ``Trainer``'s gradient checkpointing); then the same run interrupted at its
    middle checkpoint and resumed by a fresh ``Trainer``."""
    middle = micros // accumulate // 2
    with trainer_session(deepspeed=backend.startswith("zero")) as out:
        trainer, attached, drops = bart_trainer(
            out,
            backend,
            micros,
            accumulate,
            eval_strategy="steps",
            save_strategy="steps",
            save_steps=middle,
            gradient_checkpointing=recompute,
        )
        # Before the training prepared the model (FSDP: prepares it). Not under DeepSpeed,
        # where the bare Trainer cannot (ZeRO 1/2: "ZeRO inference only makes sense
        # with ZeRO Stage 3"; ZeRO 3: its training then has no engine to step).
        if not backend.startswith("zero"):
            trainer.evaluate()
        trainer.train()
        checkpointed = trainer.model.is_gradient_checkpointing
        evaluations = sum("eval_loss" in entry for entry in trainer.state.log_history)
        got = finish(trainer, attached)
        fresh_state()
        again, attached, resumed_drops = bart_trainer(
            out, backend, micros, accumulate, save_strategy="no", gradient_checkpointing=recompute
        )
        again.train(resume_from_checkpoint=f"{out}/checkpoint-{middle}")
        resumed = finish(again, attached)
    result: dict[str, Any] = {"drops": drops, "resumed_drops": resumed_drops}
    result["evaluations"] = evaluations
    result["checkpointed"] = checkpointed
    result["resumed_worst"] = worst(resumed, got)
    result["worst"] = (
        worst(got, bart_reference(drops, accumulate)) if dist.get_rank() == 0 else None
    )
    return result


# --------------------------------------------------------------------------- refusals


def refusals() -> dict[str, str]:
    """What :func:`attach` refuses, before any collective."""
    from accelerate import ParallelismConfig
    from transformers import Trainer

    from flatview.integrations.hf_trainer import attach

    cases = {
        "tensor-parallel": ("ddp", "no"),
        "autotp": ("zero2", "no"),
        "auto_find_batch_size": ("ddp", "no"),
        "twice": ("ddp", "no"),
    }
    out: dict[str, str] = {}
    for case, (backend, saving) in cases.items():
        with trainer_session(deepspeed=backend.startswith("zero")) as tmp:
            more = backend_options(backend)
            if case == "autotp":  # DeepSpeed's automatic tensor parallelism
                more["deepspeed"]["tensor_parallel"] = {"autotp_size": 2}
            if case == "auto_find_batch_size":
                more["auto_find_batch_size"] = True
            args = arguments(tmp, 2, 1, 1.0, save_strategy=saving, **more)
            trainer = Trainer(model=TrainerNet(EVEN), args=args)
            if case == "tensor-parallel":  # what the Trainer's parallelism_config makes
                trainer.accelerator.state.parallelism_config = ParallelismConfig(tp_size=2)
            elif case == "twice":
                attach(trainer)
            try:
                attach(trainer)
            except flatview.WrapError as error:
                out[case] = str(error)
            else:
                out[case] = "accepted"
    return out


# ------------------------------------------------------------------------------ PEFT


def like_bare(
    backend: str = "ddp", lora: bool = True, zero_init: bool = False, **options: Any
) -> dict[str, Any]:
    """A tiny OPT trained by the bare ``Trainer`` and by an attached one, nothing skipped,
    on ``backend`` (``"ddp"``, ``"zero<stage>"`` or one of :data:`FSDP`), with ``options``
    added to its ``TrainingArguments`` (``bf16=True`` also turns DeepSpeed's bf16 on);
    with ``lora`` a LoRA model of it (PEFT: the base frozen before the ``Trainer`` wraps
    it); with ``zero_init`` made as ``from_pretrained`` makes it under ZeRO 3
    (``_from_config``: partitioned by ``deepspeed.zero.Init`` as each module is made).
    The largest difference of the trained parameters, how many there are, the dtypes the
    model computed in, what flatview wrapped, and the gradient norms the ``Trainer``
    logged at each step, bare and attached."""
    from transformers import Trainer

    from flatview.integrations.hf_trainer import attach

    deepspeed = backend.startswith("zero")
    if deepspeed:
        options.update(deepspeed_options(int(backend[-1])))
        if options.get("bf16"):
            options["deepspeed"]["bf16"] = {"enabled": True}
    else:
        options.update(fsdp_options(backend, "OPTDecoderLayer"))
    trained, norms, wrapped, saved = [], [], "", (0, 0.0)
    for attached in (False, True):
        with trainer_session(deepspeed=deepspeed) as out:
            # The arguments first: under ZeRO 3 they tell transformers to make models
            # partitioned.
            args = arguments(
                out, 2, 2, 1.0, save_strategy="no", adam_epsilon=1e-4, logging_steps=1, **options
            )
            model = lw.tiny_opt(0.0)
            if zero_init:
                torch.manual_seed(0)
                model = type(model)._from_config(model.config)
                assert all(hasattr(p, "ds_id") for p in model.parameters())
            if lora:
                from peft import LoraConfig, get_peft_model

                model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
            trainer = Trainer(model=model, args=args, train_dataset=Rows(4))
            handle = attach(trainer) if attached else None
            trainer.train()
            if handle is not None:
                if deepspeed:  # saved while wrapped: what from_pretrained would load
                    trainer.save_model(f"{out}/final")
                wrapped = type(handle.fv.model).__name__
                detach(handle)
            dtypes = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad})
            trained.append(trainable(trainer, lora))
            if handle is not None and deepspeed:
                saved = saved_against(f"{out}/final", trained[-1], lora)
            norms.append([e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e])
    bare, flat = trained
    return {
        "count": len(bare),
        "worst": worst(flat, bare),
        "dtypes": dtypes,
        "wrapped": wrapped,
        "norms": norms,
        "saved": saved,
    }


def saved_against(directory: str, trained: dict[str, np.ndarray], lora: bool) -> tuple[int, float]:
    """How many of the ``trained`` parameters ``save_model`` wrote to ``directory``
    (PEFT's adapter file with ``lora``), and their largest difference from the trained
    values in the saved dtype (DeepSpeed's bf16 weights are its fp32 masters rounded)."""
    from safetensors.torch import load_file

    saved = load_file(f"{directory}/{'adapter_model' if lora else 'model'}.safetensors")
    diffs = []
    for name, value in trained.items():
        key = name.replace(".default", "")  # PEFT's adapter name is not in its file
        if key in saved:
            want = torch.from_numpy(value).to(saved[key].dtype).float()
            diffs.append(float((saved[key].float() - want).abs().max()))
    return len(diffs), max(diffs, default=0.0)


def trainable(trainer: Any, lora: bool) -> dict[str, np.ndarray]:
    """The trained parameters of ``trainer``'s model (not wrapped by flatview any more),
    whole by name: under DeepSpeed its fp32 masters; with ``lora`` the adapters only."""
    from tests.integration_workers import params_of

    if trainer.is_deepspeed_enabled:
        from deepspeed.utils import safe_get_full_fp32_param

        named = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
        got = {n: safe_get_full_fp32_param(p).detach().numpy().copy() for n, p in named}
    else:
        got = params_of(trainer.model)
    return {n: v for n, v in got.items() if "lora_" in n or not lora}


# --------------------------------------------------------------------------- Whisper


def whisper_seq2seq() -> dict[str, Any]:
    """A tiny Whisper (layer drop in its encoder and decoder) through ``Seq2SeqTrainer``
    with ``attach(trainer, layerdrop=0)``: the stacks found, the layers dropped per
    micro-batch, and a digest of the trained parameters (equal on every rank)."""
    from transformers import (
        Seq2SeqTrainer,
        Seq2SeqTrainingArguments,
        WhisperConfig,
        WhisperForConditionalGeneration,
    )

    from flatview.integrations.hf_trainer import attach

    config = WhisperConfig(
        vocab_size=40,
        num_mel_bins=8,
        d_model=16,
        encoder_layers=3,
        decoder_layers=3,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=16,
        decoder_ffn_dim=16,
        max_source_positions=8,
        max_target_positions=16,
        encoder_layerdrop=0.5,
        decoder_layerdrop=0.5,
        dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(config)
    g = torch.Generator().manual_seed(0)
    data = [
        {
            "input_features": torch.randn(8, 16, generator=g),
            "labels": torch.randint(3, 40, (5,), generator=g),
        }
        for _ in range(16)
    ]
    with trainer_session() as out:
        args = Seq2SeqTrainingArguments(
            output_dir=out,
            per_device_train_batch_size=2,
            max_steps=4,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            use_cpu=True,
            remove_unused_columns=False,
        )
        trainer = recording(Seq2SeqTrainer)(model=model, args=args, train_dataset=data)
        attached = trainer.attached = attach(trainer, layerdrop=0)
        trainer.train()
        assert attached.layerdrop is not None
        stacks = attached.layerdrop.stacks
        digest = float(sum(p.detach().double().sum() for p in model.parameters()))
        detach(attached)
    return {"stacks": stacks, "drops": trainer.drops, "digest": digest}
