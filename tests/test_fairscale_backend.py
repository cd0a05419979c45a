"""Checks only fairscale's backend has: the masked all-gather of partly skipped flat
parameters, fairscale's own wrapper options, and where those options break.

Equivalence, views, skip sets and their errors run on fairscale through the
parametrized suites (test_equivalence.py, test_views.py, test_skip.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from tests import workers as w
from tests.scenarios import (
    FAIRSCALE,
    Scenario,
    check_equivalent,
    make_net,
)

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

pytest.importorskip("fairscale")

TIMEOUT = 60.0
# Blocks of different sizes so skipped spans fall unevenly across shards.
SC = FAIRSCALE.scenario(
    Scenario(width=4, inner=(6, 2, 5, 3), norms=(True, False, True, False), nested=False)
)


def test_partly_skipped_unit_gathers_only_used_segments(dist_pool: PoolFactory) -> None:
    """One unit for the whole model: with most of it skipped, the all-gather moves only
    the used segments (padded to the largest rank's part); with little skipped, masking
    would not pay and the unit is gathered whole."""
    pool = dist_pool(2)
    whole = pool.run(w.count_step, SC, (), "auto", timeout=TIMEOUT)[0]
    mostly = pool.run(w.count_step, SC, (0, 2, 3), "auto", timeout=TIMEOUT)[0]
    little = pool.run(w.count_step, SC, (1,), "auto", timeout=TIMEOUT)[0]
    named = list(make_net(SC).named_parameters())
    total = sum(p.numel() for _, p in named)
    padded = -(-total // 2) * 2
    assert whole["bytes"]["all_gather"] == padded * 4  # root: gathered once, kept for backward
    assert little["bytes"]["all_gather"] == padded * 4
    skipped = sum(p.numel() for n, p in named if n.startswith(("body.0.", "body.2.", "body.3.")))
    used = total - skipped
    assert used * 4 <= mostly["bytes"]["all_gather"] <= 0.6 * padded * 4
    assert mostly["bytes"]["all_gather"] < whole["bytes"]["all_gather"]


def test_small_units_are_gathered_whole_by_default(dist_pool: PoolFactory) -> None:
    """By default a masked gather must leave out MASK_GATHER_MIN_SAVED elements: this
    model's unit is far smaller, so with most of it skipped it is still gathered whole
    (packing would cost more than the bytes save); the suite's scenarios lower the floor
    to 0, and the test above masks."""
    import flatview
    from flatview.comm.options import MASK_GATHER_MIN_SAVED

    named = list(make_net(SC).named_parameters())
    total = sum(p.numel() for _, p in named)
    assert total < MASK_GATHER_MIN_SAVED
    padded = -(-total // 2) * 2
    pool = dist_pool(2)
    default = flatview.ReduceOptions()
    mostly = pool.run(w.count_step, SC, (0, 2, 3), "auto", reduce_options=default, timeout=TIMEOUT)
    assert mostly[0]["bytes"]["all_gather"] == padded * 4
    floor = flatview.ReduceOptions(mask_gather_min_saved=total // 4)
    masked = pool.run(w.count_step, SC, (0, 2, 3), "auto", reduce_options=floor, timeout=TIMEOUT)
    assert masked[0]["bytes"]["all_gather"] < padded * 4


def test_partly_skipped_units_gathered_whole_train_exactly(dist_pool: PoolFactory) -> None:
    """With the library's floor, the partly skipped unit is gathered whole while parts of
    it are skipped (the test above): training still matches the unwrapped model."""
    from flatview.comm.options import MASK_GATHER_MIN_SAVED

    scenario = FAIRSCALE.scenario(
        SC, skips=((0, 2, 3), (1,), (), (0, 2)), mask_gather_min_saved=MASK_GATHER_MIN_SAVED
    )
    check_equivalent(dist_pool, scenario, timeout=TIMEOUT)


@pytest.mark.parametrize(
    "options",
    [{"reshard_after_forward": False}, {"mixed_precision": True}],
    ids=["no-reshard", "mixed-precision"],
)
def test_state_dict_with_wrapper_options(dist_pool: PoolFactory, options: dict[str, Any]) -> None:
    scenario = FAIRSCALE.scenario(options=options)
    for result in dist_pool(2).run(w.state_dict_with_and_without, scenario, timeout=TIMEOUT):
        assert result["same"] and result["loaded"], result
        assert result["views_loaded"] and result["views_intact"], result


UNFLATTENED = FAIRSCALE.scenario(
    inner=(3, 4, 2),
    norms=(True, True, False),
    aux=True,
    set_to_none=False,
    options={"flatten_parameters": False},
)


def test_unflattened_skipping_whole_units(dist_pool: PoolFactory) -> None:
    """flatten_parameters=False: each parameter is its own flat parameter; skipping
    whole nested units works."""
    scenario = FAIRSCALE.scenario(UNFLATTENED, skips=((0, 2), (1,), (), (0, 1, 2)))
    check_equivalent(dist_pool, scenario, timeout=TIMEOUT)


def test_unflattened_skipping_root_parameters(dist_pool: PoolFactory) -> None:
    """A parameter of the root unit skipped while the unit runs: its post-backward hook
    never fires, and fairscale's final callback reshards only nested units; flatview
    reshards it (it used to stay unsharded and break the next backward)."""
    scenario = FAIRSCALE.scenario(UNFLATTENED, skips=((), ("aux",), ()))
    check_equivalent(dist_pool, scenario, timeout=TIMEOUT)
