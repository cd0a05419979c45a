"""DeepSpeed's own checkpoints on an engine flatview wraps: ``engine.save_checkpoint`` and
``engine.load_checkpoint`` (what DeepSpeed scripts, Lightning's DeepSpeed strategy and
accelerate call) resume exactly, also a run bare DeepSpeed started; DeepSpeed's
``zero_to_fp32`` and bare DeepSpeed read the weights of flatview's files; what is
refused raises on every rank."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import pytest

from tests import deepspeed_ckpt_workers as w
from tests.deepspeed_workers import run_reference
from tests.scenarios import GATED, compare

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

pytest.importorskip("deepspeed")

TIMEOUT = 300
slow = pytest.mark.slow
SC = replace(GATED, skips=(*GATED.skips, (3, "aux")), world_size=2)
# Nothing skipped in the steps bare DeepSpeed trains (it would give skipped parameters
# zero gradients and step them), skip sets afterwards.
BARE_FIRST = replace(SC, skips=((), (), *SC.skips[2:]))


def _stages(ci: tuple[int, ...]) -> list[object]:
    return [pytest.param(s, id=f"zero{s}", marks=() if s in ci else slow) for s in (1, 2, 3)]


def _same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("stage", _stages(ci=(3,)))
def test_engine_checkpoints_resume_exactly(dist_pool: PoolFactory, stage: int) -> None:
    """Per-submodule optimizers and skip sets: saved with engine.save_checkpoint after
    three steps, loaded into a fresh wrapped engine with engine.load_checkpoint, trained
    on: bit for bit the run that went on without stopping, and the unwrapped model's
    training; the client state and DeepSpeed's step count come back. A wrapped engine
    with load_module_only, zero_to_fp32 and a bare engine (weights only) read the saved
    weights."""
    results = dist_pool(2).run(w.engine_checkpoints, SC, stage, 3, timeout=TIMEOUT)
    reference = run_reference(SC).params
    for got in results:
        assert got["client"] == {"epoch": 7}
        assert got["global_steps"] == 3
        _same(got["loaded"], got["at_save"])
        _same(got["resumed"], got["continued"])
        compare(got["resumed"], reference)
        _same(got["module_only"], got["at_save"])
        assert got["fresh_state"]
        _same(got["exported"], got["at_save"])
        _same(got["bare_loaded"], got["at_save"])


@pytest.mark.parametrize("stage", _stages(ci=(1,)))
def test_engine_checkpoints_resume_exactly_with_accumulation(
    dist_pool: PoolFactory, stage: int
) -> None:
    """gradient_accumulation_steps=2, saved at the second boundary: the run that went on,
    and the unwrapped model accumulating two micro-batches per step."""
    scenario = replace(SC, accumulate=2)
    results = dist_pool(2).run(w.engine_checkpoints, scenario, stage, 4, timeout=TIMEOUT)
    reference = run_reference(scenario).params
    for got in results:
        assert got["global_steps"] == 2
        _same(got["loaded"], got["at_save"])
        _same(got["resumed"], got["continued"])
        compare(got["resumed"], reference)


@pytest.mark.parametrize("stage", _stages(ci=(2,)))
def test_a_run_bare_deepspeed_started_resumes_under_flatview(
    dist_pool: PoolFactory, stage: int
) -> None:
    """Two steps of bare DeepSpeed (the engine's AdamW in two groups), saved with its own
    engine.save_checkpoint; loaded into a wrapped engine (each view's state cut out of
    its partition's), trained on with skip sets: the unwrapped model's training."""
    results = dist_pool(2).run(w.bare_then_flatview, BARE_FIRST, stage, 2, timeout=TIMEOUT)
    reference = run_reference(BARE_FIRST, "groups").params
    for got in results:
        compare(got["params"], reference)


@pytest.mark.parametrize("stage", _stages(ci=(2,)))
def test_refused_checkpoint_calls_raise_on_every_rank(dist_pool: PoolFactory, stage: int) -> None:
    """Saving inside an iteration, loading into an optimizer built otherwise than the
    one that saved, a bare DeepSpeed file into flatview.optim.Deferred, a file damaged
    on one rank only: an error on every rank (the others name the refusing rank),
    before anything loads; training goes on."""
    for got in dist_pool(2).run(w.refused_checkpoints, SC, stage, timeout=TIMEOUT):
        assert got["inside an iteration"].startswith("StateError: "), got
        assert "between iterations" in got["inside an iteration"], got
        assert got["another optimizer"].startswith("OptimStateError: "), got
        assert "holds other parameters" in got["another optimizer"], got
        assert got["bare into Deferred"].startswith("OptimStateError: "), got
        assert "flatview.optim.Deferred" in got["bare into Deferred"], got
        assert got["one rank's file"].startswith("OptimStateError: "), got
        assert "single_partition_of_fp32_groups" in got["one rank's file"] or (
            "fp32_flat_groups" in got["one rank's file"]
        ), got


@pytest.mark.parametrize("stage", _stages(ci=(3,)))
def test_writes_into_views_between_steps_reach_the_forward(
    dist_pool: PoolFactory, stage: int
) -> None:
    """Views written in place after a step: the next forward computes on those values
    (under ZeRO 3 too, which keeps small parameters gathered between steps),
    engine.save_16bit_model saves them, and bare DeepSpeed's forward after fv.unwrap()
    computes on them."""
    for got in dist_pool(2).run(w.writes_between_steps, SC, stage, timeout=TIMEOUT):
        assert got == {"forward": 0.0, "save_16bit_model": 0.0, "after unwrap": 0.0}


@pytest.mark.parametrize("stage", _stages(ci=(2,)))
def test_whole_muon_resumes_through_engine_checkpoints(dist_pool: PoolFactory, stage: int) -> None:
    """flatview.optim.Whole (torch's Muon over whole matrices) and AdamW in the engine's
    Deferred: resumed from engine.save_checkpoint, bit for bit the run that went on."""
    for got in dist_pool(2).run(w.whole_engine_checkpoints, SC, stage, 3, timeout=TIMEOUT):
        _same(got["resumed"], got["continued"])


@pytest.mark.parametrize("stage", _stages(ci=(2,)))
def test_bf16_resumes_through_engine_checkpoints(dist_pool: PoolFactory, stage: int) -> None:
    """DeepSpeed's bf16 (fp32 masters) with skip sets and clipping: resumed from
    engine.save_checkpoint, bit for bit the run that went on."""
    for got in dist_pool(2).run(w.bf16_engine_checkpoints, SC, stage, 3, timeout=TIMEOUT):
        _same(got["resumed"], got["continued"])
