"""LayerDrop of ``transformers`` models (workers in :mod:`tests.layerdrop_workers`): a
tiny BART whose encoder and decoder drop layers, a unit per layer, 2 ranks, trained
through :class:`flatview.integrations.layerdrop.LayerDrop`, equals the unwrapped model in
one process with the same layers passed over by hand. Without it flatview refuses the
model's own per-rank draws clearly."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import pytest
import torch

from tests import layerdrop_workers as w
from tests.scenarios import only_on_tested_torch

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

pytest.importorskip("transformers")

TIMEOUT = 240.0
BACKENDS = [
    pytest.param("torch", marks=only_on_tested_torch("torch")),
    "fairscale",
    pytest.param("fsdp2", marks=only_on_tested_torch("fsdp2")),
    "ddp",
]
ENCODER_OWN = [
    "model.encoder.embed_positions.weight",
    "model.encoder.layernorm_embedding.bias",
    "model.encoder.layernorm_embedding.weight",
]


def _under(name: str, modules: list[str]) -> bool:
    return any(name.startswith(module + ".") for module in modules)


def _unread(dropped: list[str]) -> bool:
    """Whether a step dropped every decoder layer: nothing reads the encoder's output."""
    return all(f"model.decoder.layers.{i}" in dropped for i in range(w.LAYERS))


@pytest.mark.parametrize(
    ("encoder_p", "decoder_p", "seed"),
    [(w.DROP, w.DROP, 0), pytest.param(0.0, w.DROP, 3, id="encoder-never-drops")],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_layerdrop_trains_like_the_reference(
    dist_pool: PoolFactory, backend: str, encoder_p: float, decoder_p: float, seed: int
) -> None:
    """The same layers dropped on both ranks, their parameters' gradients ``None``, the
    parameters the unwrapped model's; a step that drops every decoder layer drops the
    encoder's layers too and leaves its own parameters (not the tied embedding) without
    a gradient: nothing reads them."""
    results = dist_pool(2).run(w.train_task, backend, encoder_p, decoder_p, seed, timeout=TIMEOUT)
    assert results[0]["drops"] == results[1]["drops"]
    drops = results[0]["drops"]
    assert any(_unread(dropped) for dropped in drops), drops
    assert any(dropped and not _unread(dropped) for dropped in drops), drops
    for got in results:
        assert got["stacks"] == {"model.encoder": encoder_p, "model.decoder": decoder_p}
        assert got["names_match"]
        assert got["max_diff"] < 1e-5, got["max_diff"]
        for dropped, none in zip(drops, got["none_grads"], strict=True):
            unread = _unread(dropped)
            if unread:
                assert all(f"model.encoder.layers.{i}" in dropped for i in range(w.LAYERS))
            want = [n for n in got["names"] if _under(n, dropped) or (unread and n in ENCODER_OWN)]
            assert none == sorted(want), (dropped, none)
        # transformers' own draws go on: the global generator moves as without flatview
        # (6 draws per forward, the encoder's only where its probability is not 0).
        draws = 6 if encoder_p else 3
        for step, (value, dropped) in enumerate(zip(got["rng"], drops, strict=True)):
            torch.manual_seed(100 + step)
            for _ in range(3 if not encoder_p and _unread(dropped) else 0):
                torch.rand([])
            want_value = [float(torch.rand([])) for _ in range(draws + 1)][-1]
            assert value == want_value, step
        assert got["without"].startswith("UndeclaredUnusedError"), got["without"]
        # transformers' own draws, seeded alike on both ranks: the first dropped layer.
        first = "model.encoder.layers.1" if encoder_p else "model.decoder.layers.1"
        assert f"'{first}" in got["without"], got["without"]  # the unit or its parameters


@pytest.mark.parametrize("backend", [BACKENDS[0], "ddp"])
def test_layerdrop_read_from_the_config_and_run_anyway_under_fsdp(
    dist_pool: PoolFactory, backend: str
) -> None:
    """wav2vec2: its stack reads ``self.config.layerdrop``, and under torch FSDP runs a
    dropped layer anyway (``synced_gpus``: bare, its layer drop is off there). Through
    ``LayerDrop`` the dropped layers are dropped, on torch FSDP1 as on DDP, and training
    equals the unwrapped model's with them passed over. The config keeps its value (in
    JSON, and pickled as a plain float)."""
    results = dist_pool(2).run(w.model_task, "wav2vec2", backend, timeout=TIMEOUT)
    assert results[0]["drops"] == results[1]["drops"]
    assert any(results[0]["drops"]), results[0]["drops"]
    for got in results:
        assert got["value"] == ("Decided", 0.5)
        assert got["json"]
        assert got["pickled"] == "float"
        assert got["names_match"]
        assert got["max_diff"] < 1e-5, got["max_diff"]


def test_layerdrop_edges(dist_pool: PoolFactory) -> None:
    """On DDP: a model without layer drop is refused; a training forward outside
    ``LayerDrop.step()`` raises on every rank; evaluation runs every layer; the stack's
    value pickles and copies as a plain float; a resumed generator draws
    what the uninterrupted one would; layers recomputed in the backward (gradient
    checkpointing) train exactly; ``remove`` puts the plain floats back. A second
    ``LayerDrop`` on the same model is refused; ranks given different seeds raise
    ``SkipSetMismatchError`` on every rank (not a hang); after ``unwrap`` a step raises."""
    for got in dist_pool(2).run(w.edges_task, timeout=TIMEOUT):
        assert got["no_stack"].startswith("WrapError: LayerDrop: DistributedDataParallel"), got
        assert "has no module that drops layers" in got["no_stack"]
        assert got["outside"].startswith("StateError: 'model.encoder' drew a layer-drop"), got
        assert "outside LayerDrop.step()" in got["outside"]
        assert got["eval_loss"] == pytest.approx(got["eval_want"], abs=1e-6)
        assert got["value"] == ("Decided", 0.5)
        assert got["pickled"] == got["copied"] == got["removed"] == "float"
        assert got["next"] == got["drops"][2:4], (got["next"], got["drops"])
        assert got["max_diff"] < 1e-5, got["max_diff"]
        assert got["second"].startswith(
            "WrapError: LayerDrop: ['model.encoder', 'model.decoder'] already draw"
        ), got["second"]
        assert got["seeds"].startswith("SkipSetMismatchError"), got["seeds"]
        assert "model.encoder.layers" in got["seeds"], got["seeds"]
        assert got["unwrapped"].startswith("StateError"), got["unwrapped"]


@pytest.mark.parametrize("backend", [BACKENDS[0], "ddp"])
def test_layerdrop_of_a_decoder_only_model(dist_pool: PoolFactory, backend: str) -> None:
    """OPT: one stack, every layer of it dropped in some step (nothing but the
    embeddings and the head then trains), equal to the reference."""
    results = dist_pool(2).run(w.model_task, "opt", backend, timeout=TIMEOUT)
    assert results[0]["drops"] == results[1]["drops"]
    drops = results[0]["drops"]
    assert any(len(dropped) == w.LAYERS for dropped in drops), drops
    for got in results:
        assert got["stacks"] == {"model.decoder": w.DROP}
        assert got["value"] == ("float", w.DROP)  # the stack keeps its own copy
        assert got["names_match"]
        assert got["max_diff"] < 1e-5, got["max_diff"]


@pytest.mark.parametrize("backend", [BACKENDS[0], "fairscale", "ddp"])
def test_layerdrop_with_gradient_accumulation(dist_pool: PoolFactory, backend: str) -> None:
    """Two micro-batches per optimizer step, the first under ``no_sync()``, each dropping
    its own layers: a layer dropped in one and kept in the other gets the gradient of the
    one, as the unwrapped model accumulates it."""
    results = dist_pool(2).run(w.accumulation_task, backend, timeout=TIMEOUT)
    drops = results[0]["drops"]
    assert results[1]["drops"] == drops
    assert any(set(drops[i]) != set(drops[i + 1]) for i in range(0, len(drops), 2)), drops
    for got in results:
        assert got["names_match"]
        assert got["max_diff"] < 1e-5, got["max_diff"]


@pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None, reason="lightning is not installed"
)
@pytest.mark.parametrize(("strategy", "accumulate"), [("ddp", 2), ("fsdp2", 1), ("deepspeed3", 2)])
def test_lightning_callback_layerdrop_trains_and_resumes(
    dist_pool: PoolFactory, strategy: str, accumulate: int
) -> None:
    # FlatViewCallback(layerdrop=seed) on the Lightning Trainer: a BART inside a
    # LightningModule (FSDP2: ModelParallelStrategy sharding self.model; DeepSpeed ZeRO 3
    # with Lightning's accumulation and checkpoints), two epochs;
    # then the same fit checkpointed after the first and resumed by a new Trainer.
    from tests.integration_workers import call

    results = dist_pool(2).run(
        call,
        "tests.lightning_layerdrop_workers",
        "layerdrop",
        strategy,
        accumulate,
        timeout=TIMEOUT,
    )
    first, second = results
    assert first["drops"] == second["drops"]
    assert len(first["drops"]) == 8
    # A batch that drops every decoder layer (its encoder's own parameters skipped by
    # name: a path in the wrapped model, which under FSDP2 is not the LightningModule).
    assert any(_unread(dropped) for dropped in first["drops"])
    assert first["drops"] == first["resumed_drops"]
    assert first["names_match"]
    assert first["worst"] <= 1e-5, first["worst"]
    assert first["resumed_worst"] <= 1e-6, first["resumed_worst"]


@pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None, reason="lightning is not installed"
)
def test_lightning_callback_layerdrop_needs_its_steps(dist_pool: PoolFactory) -> None:
    from tests.integration_workers import call

    workers = "tests.lightning_layerdrop_workers"
    for message in dist_pool(2).run(call, workers, "refused_without_steps", timeout=TIMEOUT):
        assert "enter_steps=False" in message, message
