"""Hugging Face ``transformers``' ``Trainer`` with :func:`flatview.integrations.hf_trainer.
attach` (workers in :mod:`tests.hf_trainer_workers`): DDP, FSDP2, FSDP1 and DeepSpeed ZeRO
1-3 on 2 ranks train exactly as the same run written out in one process, with skip sets,
gradient accumulation, clipping, the linear schedule and weight decay by name; a BART's
layer drop is drawn alike on every rank, and a run resumed from the ``Trainer``'s
checkpoint drops and trains as the uninterrupted one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from tests import hf_trainer_workers as w
from tests.integration_workers import call
from tests.scenarios import skip_names

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

TIMEOUT = 240.0
WORKERS = "tests.hf_trainer_workers"


def _under(names: list[str], micro: int) -> set[str]:
    """The parameters micro-batch ``micro`` skips."""
    skip = skip_names(w.EVEN, micro)
    return {n for n in names if any(n.startswith(s + ".") for s in skip)}


WRAPPERS = {
    "ddp": "DistributedDataParallel",
    "fsdp2": "FSDPTrainerNet",
    "fsdp1": "FullyShardedDataParallel",
    "fsdp1-orig": "FullyShardedDataParallel",
    "zero2": "DeepSpeedEngine",
    "zero3": "DeepSpeedEngine",
}


@pytest.mark.parametrize(
    ("backend", "accumulate", "clip"),
    [
        ("ddp", 2, 0.05),
        ("fsdp2", 2, 0.05),
        ("fsdp1", 2, 0.05),
        ("fsdp1-orig", 1, 0.05),
    ],
)
def test_trainer_trains_like_the_reference(
    dist_pool: PoolFactory, backend: str, accumulate: int, clip: float
) -> None:
    # The Trainer's own FSDP path (accelerate's wrapping, optimizer built after it under
    # FSDP1: over views with use_orig_params=False) on CPU: see hf_trainer_workers.
    results = dist_pool(2).run(
        call, WORKERS, "trains_like_the_reference", backend, accumulate, clip, timeout=TIMEOUT
    )
    assert results[0]["worst"] <= 1e-5, results[0]["worst"]
    every = [name for name, _ in w.TrainerNet(w.EVEN).named_parameters()]
    # At each optimizer step exactly the parameters every micro-batch of it skipped
    # are without a gradient.
    held = set()
    for result in results:
        assert result["wrapper"] == WRAPPERS[backend]
        seen = result["seen"]
        assert len(seen) == len(w.EVEN.skips) // accumulate
        for step, views in enumerate(seen):
            micros = range(step * accumulate, (step + 1) * accumulate)
            want = set.intersection(*(_under(every, m) for m in micros))
            assert views["none"] == sorted(want & set(views["views"])), (step, views)
            held |= set(views["views"])
    assert held == set(every)
    assert any(views["none"] for result in results for views in result["seen"])


@pytest.mark.parametrize(
    ("backend", "accumulate"),
    [("zero1-own", 2), ("zero2", 1), ("zero3", 2), ("fsdp1", 1), ("fsdp2", 1), ("fsdp1-orig", 1)],
)
def test_trainer_trains_and_resumes_like_the_reference(
    dist_pool: PoolFactory, backend: str, accumulate: int
) -> None:
    # DeepSpeed: the Trainer's optimizer (decay by name) or DeepSpeed's own from its
    # config ("-own"), with the Trainer's schedule; bare DeepSpeed steps the skipped
    # parameters with zero gradients (0.017-0.025 from the reference on these runs).
    # Without accumulation the checkpoint comes before some parameters were ever stepped.
    # FSDP1 with flat views: the Trainer's own checkpoints (accelerate's FSDP functions,
    # FSDP.optim_state_dict served over views).
    results = dist_pool(2).run(
        call, WORKERS, "resumes_like_the_reference", backend, accumulate, 0.05, timeout=TIMEOUT
    )
    assert results[0]["worst"] <= 1e-5, results[0]["worst"]
    if backend.startswith("zero"):  # save_model (FSDP: sharded checkpoints only)
        assert results[0]["saved_worst"] == 0.0, results[0]["saved_worst"]
    for result in results:  # resumed from the checkpoint after the first step
        assert result["resumed_worst"] <= 1e-6, result["resumed_worst"]


def test_trainer_on_zero3_names_an_evaluation_before_training(dist_pool: PoolFactory) -> None:
    for message in dist_pool(2).run(call, WORKERS, "zero3_evaluated_first", timeout=TIMEOUT):
        assert "did not prepare" in message and "evaluate() or predict() before" in message


@pytest.mark.parametrize(
    ("backend", "accumulate", "recompute"),
    [("ddp", 2, True), ("fsdp2", 1, False), ("zero3", 2, True)],
)
def test_trainer_layerdrop_trains_and_resumes_like_the_reference(
    dist_pool: PoolFactory, backend: str, accumulate: int, recompute: bool
) -> None:
    micros = 4 * accumulate
    results = dist_pool(2).run(
        call,
        WORKERS,
        "layerdrop_like_the_reference",
        backend,
        micros,
        accumulate,
        recompute,
        timeout=TIMEOUT,
    )
    first, second = results
    assert first["evaluations"] == micros // accumulate  # one after every step
    assert first["checkpointed"] == recompute
    assert first["drops"] == second["drops"]  # every rank dropped the same layers
    assert any(first["drops"]) and first["drops"][0] != first["drops"][1]
    # The resumed run starts at the middle checkpoint and drops what the first did.
    assert first["resumed_drops"] == first["drops"][micros // 2 :]
    assert first["worst"] <= 1e-5, first["worst"]
    for result in results:
        assert result["resumed_worst"] <= 1e-6, result["resumed_worst"]


def test_whisper_layerdrop_through_seq2seq_trainer(dist_pool: PoolFactory) -> None:
    # The layer drop of Whisper (BART's form, in another model) through Seq2SeqTrainer:
    # both stacks found, the same layers dropped on every rank, the same training.
    first, second = dist_pool(2).run(call, WORKERS, "whisper_seq2seq", timeout=TIMEOUT)
    assert first["stacks"] == {"model.encoder": 0.5, "model.decoder": 0.5}
    assert first["drops"] == second["drops"] and len(first["drops"]) == 4
    assert any(first["drops"])
    assert first["digest"] == second["digest"]


EVERYDAY = {
    "bf16": True,
    "optim": "adafactor",
    "lr_scheduler_type": "cosine",
    "warmup_steps": 1,
    "neftune_noise_alpha": 5.0,
    "gradient_checkpointing": True,
    "include_num_input_tokens_seen": True,
}
"""``TrainingArguments`` users set every day, together in one run."""


@pytest.mark.parametrize(
    ("backend", "lora", "options", "tolerance"),
    [
        ("ddp", True, {}, 0.0),
        ("ddp", False, EVERYDAY, 0.0),
        ("zero2", True, {"bf16": True}, 0.0),
        # A full model made partitioned (zero.Init), as from_pretrained does under ZeRO 3.
        ("zero3", False, {"zero_init": True}, 1e-6),
        ("fsdp2", False, {}, 1e-6),
        # Over FSDP1's flat parameters the bare Trainer decays every bias and norm
        # (7.8e-4 apart here with its default decay); flatview's views decay by name.
        ("fsdp1", False, {"weight_decay": 0.0}, 1e-6),
    ],
)
def test_attach_trains_as_the_bare_trainer(
    dist_pool: PoolFactory, backend: str, lora: bool, options: dict[str, Any], tolerance: float
) -> None:
    # Nothing skipped: what a user who adds attach() to a working Trainer script gets. With
    # LoRA (PEFT freezes the base before the Trainer wraps the model: under DDP flatview's
    # wrap raised "cannot register a hook on a tensor that doesn't require gradient").
    # flatview's reductions sum as DDP's and DeepSpeed's do on 2 ranks (bf16 included):
    # the same numbers; FSDP's last bits may differ (flatview's clipping norm is summed in
    # another order).
    if lora:
        pytest.importorskip("peft")
    results = dist_pool(2).run(
        call, WORKERS, "like_bare", backend, lora, timeout=TIMEOUT, **options
    )
    bf16 = options.get("bf16") and backend != "ddp"  # DDP: bf16 autocast over fp32
    for result in results:
        assert result["count"] > 0 and result["worst"] <= tolerance, result
        assert result["dtypes"] == (["torch.bfloat16"] if bf16 else ["torch.float32"]), result
        wrapper = "FSDPOPTForCausalLM" if backend == "fsdp2" else WRAPPERS[backend]
        assert result["wrapped"] == wrapper, result
        # The gradient norm the Trainer logs at each step (DeepSpeed: the engine's).
        bare, flat = result["norms"]
        assert len(bare) == 2 and flat == pytest.approx(bare, rel=1e-6, abs=0.0), result
        if backend.startswith("zero"):  # save_model while wrapped: every weight, exact
            assert result["saved"] == (result["count"], 0.0), result


def test_attach_refuses_what_it_does_not_serve(dist_pool: PoolFactory) -> None:
    for refused in dist_pool(2).run(call, WORKERS, "refusals", timeout=TIMEOUT):
        assert "not tensor, context or sequence" in refused["tensor-parallel"], refused
        assert "not tensor, context or sequence" in refused["autotp"], refused
        assert "not auto_find_batch_size (give" in refused["auto_find_batch_size"], refused
        assert "attached to this Trainer already" in refused["twice"], refused
