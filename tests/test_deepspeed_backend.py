"""flatview on DeepSpeed's ZeRO engine (stages 1, 2 and 3): training exactly like the
unwrapped model with per-submodule optimizers and skip sets, the bytes reduced, errors.

DeepSpeed's first import in a worker takes 10-60 s on a busy 2-core machine, so the CI
profile runs one world size (2) and one case per stage of each kind; the other world
sizes and drawn scenarios are ``slow``.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import TYPE_CHECKING

import pytest

from tests import deepspeed_workers as w
from tests.scenarios import GATED, assert_equivalent, compare

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

pytest.importorskip("deepspeed")

TIMEOUT = 300
STAGES = (1, 2, 3)
# Six steps: every block skipped in some and used in others, gates and aux too.
SC = replace(GATED, skips=(*GATED.skips, (3, "aux")))
slow = pytest.mark.slow


def _cases(worlds: tuple[int, ...], quick_world: int = 2) -> list[object]:
    return [
        pytest.param(
            stage, world, id=f"zero{stage}-ws{world}", marks=() if world == quick_world else slow
        )
        for stage in STAGES
        for world in worlds
    ]


@pytest.mark.parametrize(("stage", "world"), _cases((1, 2, 3)))
def test_several_optimizers_and_skip_sets_train_like_the_reference(
    dist_pool: PoolFactory, stage: int, world: int
) -> None:
    """Per-submodule optimizers (AdamW and SGD with and without momentum) handed to
    flatview.optim.Deferred, DeepSpeed's default clipping (1.0, active in these steps),
    six steps of stochastic depth: the unwrapped model's training, skipped parameters
    without gradients (no weight decay, no momentum)."""
    scenario = replace(SC, world_size=world)
    results = dist_pool(world).run(w.run_flatview, scenario, stage, "several", 1.0, timeout=TIMEOUT)
    reference = w.run_reference(scenario, "several", 1.0)
    assert max(reference.norms) > 1.0  # clipping acts
    assert_equivalent(results, reference, scenario)


@pytest.mark.parametrize(("stage", "world"), _cases((1, 2, 3)))
def test_the_engines_own_optimizer_steps_views(
    dist_pool: PoolFactory, stage: int, world: int
) -> None:
    """The script DeepSpeed users have (one AdamW given to deepspeed.initialize,
    engine.backward, engine.step) plus fv.step(skip=...): AdamW leaves skipped
    parameters alone, as on the unwrapped model; no clipping configured."""
    scenario = replace(SC, world_size=world)
    results = dist_pool(world).run(w.run_flatview, scenario, stage, "one", 0.0, timeout=TIMEOUT)
    assert_equivalent(results, w.run_reference(scenario, "one", 0.0), scenario)


EXPECTED = {
    "used": r"SkippedParameterUsedError: parameter 'body\.1\.[a-z]+\.(weight|bias)' is declared",
    "mismatch": r"SkipSetMismatchError",
}


@pytest.mark.parametrize("stage", STAGES)
def test_errors_raise_on_every_rank_and_training_goes_on_exactly(
    dist_pool: PoolFactory, stage: int
) -> None:
    """A declared-skipped parameter used, and ranks that skip differently: raised on
    every rank (no hang), and after engine.zero_grad() the training is the reference's."""
    kinds = ("used", "mismatch")
    results = dist_pool(2).run(w.recovery, SC, stage, kinds, timeout=TIMEOUT)
    for got in results:
        assert len(got["errors"]) == len(kinds), got["errors"]
        for kind, message in zip(kinds, got["errors"], strict=True):
            assert re.search(EXPECTED[kind], message), (kind, message)
        assert got["phase"] == "IDLE"
    compare(results[0]["params"], w.run_reference(SC).params)


def _used_bytes(flats: list[tuple[object, tuple[bool, ...]]]) -> int:
    """4 bytes per element of every used segment (fp32), from the layouts alone."""
    return 4 * sum(
        segment.numel
        for layout, used in flats
        for segment, flag in zip(layout.segments, used, strict=True)  # type: ignore[attr-defined]
        if flag
    )


@pytest.mark.parametrize("stage", STAGES)
def test_skipping_reduces_only_the_used_gradients(dist_pool: PoolFactory, stage: int) -> None:
    """Bytes counted at the collective calls of each backward: with the exact exchange
    (reduce_strategy="all_to_all") exactly the used gradients; by default one collective
    per backward moving what plain DeepSpeed moves (ZeRO 1/2: the used gradients when
    something is skipped, the padded flat buffer when nothing is; ZeRO 3: each used
    parameter padded to a multiple of the world size, as DeepSpeed's reduce-scatter)."""
    pool = dist_pool(2)
    exact = pool.run(w.gradient_bytes, SC, stage, "all_to_all", False, timeout=TIMEOUT)
    default = pool.run(w.gradient_bytes, SC, stage, "auto", False, timeout=TIMEOUT)
    plain = pool.run(w.gradient_bytes, SC, stage, "auto", True, timeout=TIMEOUT)
    for rank in range(2):
        rows = zip(exact[rank]["rows"], default[rank]["rows"], plain[rank]["rows"], strict=True)
        for micro, (e, d, p) in enumerate(rows):
            used = _used_bytes(e["flats"])
            assert e["counted"] == e["ledger"] == e["used"] == used, (micro, e)
            assert d["counted"] == d["ledger"], (micro, d)
            assert sum(d["calls"].values()) == 1, (micro, d)
            if SC.skips[micro] or stage == 3:
                assert d["counted"] == p["counted"], (micro, d, p)
            if SC.skips[micro] and stage != 3:
                assert d["counted"] == used, (micro, d)
            assert used <= d["counted"] <= d["dense"], (micro, d)
