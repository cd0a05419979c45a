"""Distributed training with FSDP + flatview equals single-process training.

Hypothesis varies model shapes (so parameters straddle shard boundaries and padding is
exercised), world sizes 1 to 4, nesting, tied parameters, how gradients are zeroed, and
the skip set of every step (the first included). Optimizers are built per submodule from
views. The reference runs the same model, data and optimizers in one process, without
executing skipped blocks.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given

from tests.scenarios import Scenario, compare, run_distributed, run_reference, scenarios


def check(dist_pool: Any, scenario: Scenario, tolerance: float = 1e-5) -> None:
    results = dist_pool(scenario.world_size).run(run_distributed, scenario, timeout=120)
    compare(results[0], run_reference(scenario), tolerance)


@given(scenarios())
def test_matches_single_process_reference(dist_pool: Any, scenario: Scenario) -> None:
    check(dist_pool, scenario)


def test_skip_everything_in_the_first_step(dist_pool: Any) -> None:
    scenario = Scenario(
        world_size=2, inner=(3, 4, 2), norms=(True, True, False), skips=((0, 1, 2), (1,), ())
    )
    check(dist_pool, scenario)


WRAPPER_OPTIONS = {
    "no-reshard": {"reshard_after_forward": False},
    "unflattened": {"flatten_parameters": False},
    "unbucketed": {"bucket_cap_mb": 0},
    "no-agreement-check": {},
}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("option", sorted(WRAPPER_OPTIONS))
def test_wrapper_options(dist_pool: Any, world_size: int, option: str) -> None:
    scenario = Scenario(
        world_size=world_size,
        inner=(3, 4, 2),
        norms=(True, True, False),
        skips=((0, 2), (1,), (), (0, 1, 2)),
        set_to_none=False,
        options=WRAPPER_OPTIONS[option],
        check=option != "no-agreement-check",
    )
    check(dist_pool, scenario)


def test_mixed_precision(dist_pool: Any) -> None:
    """fp16 compute: parameters stay fp32 and agree to fp16 accuracy."""
    scenario = Scenario(
        world_size=2,
        inner=(3, 4),
        norms=(True, False),
        skips=((1,), (0,), ()),
        options={"mixed_precision": True},
    )
    check(dist_pool, scenario, tolerance=3e-3)


def test_freezing_by_name(dist_pool: Any) -> None:
    """requires_grad_(False) on views freezes exactly those parameters, partial ones too."""
    scenario = Scenario(
        world_size=3,
        inner=(5, 3),
        norms=(True, False),
        skips=((), (1,), ()),
        frozen=("body.0.up", "head.bias", "stem.weight"),
    )
    check(dist_pool, scenario)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_one_unit_mostly_skipped(dist_pool: Any, world_size: int) -> None:
    """One unit, most blocks skipped: gathers and reductions are both masked."""
    scenario = Scenario(
        world_size=world_size,
        nested=False,
        width=5,
        inner=(7, 2, 6, 3, 5),
        norms=(True, False, True, False, True),
        skips=((0, 2, 3, 4), (1, 2, 3), (0, 1, 2, 4), ()),
    )
    check(dist_pool, scenario)
