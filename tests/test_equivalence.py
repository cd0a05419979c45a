"""Distributed training with FSDP + flatview equals single-process training.

Hypothesis varies model shapes (so parameters straddle shard boundaries and padding is
exercised), world sizes 1 to 4, nesting, tied parameters, how gradients are zeroed, and
the skip set of every step (the first included). Optimizers are built per submodule from
views. The reference runs the same model, data and optimizers in one process, without
executing skipped blocks.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given

from tests.scenarios import Scenario, compare, run_distributed, run_reference, scenarios


def check(dist_pool: Any, scenario: Scenario) -> None:
    results = dist_pool(scenario.world_size).run(run_distributed, scenario, timeout=120)
    compare(results[0], run_reference(scenario))


@given(scenarios())
def test_matches_single_process_reference(dist_pool: Any, scenario: Scenario) -> None:
    check(dist_pool, scenario)


def test_skip_everything_in_the_first_step(dist_pool: Any) -> None:
    scenario = Scenario(
        world_size=2, inner=(3, 4, 2), norms=(True, True, False), skips=((0, 1, 2), (1,), ())
    )
    check(dist_pool, scenario)
