"""FSDP2's small reduce-scatters held and run as one collective at the end of the backward
(``ReduceOptions.bucket_all_used``; by default on CPU over 2 shards): the same training bit
for bit as each unit's own reduce-scatter, fewer collectives, the same bytes; never in
place of a call whose output FSDP2 (or the user) reads right away."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import fsdp2_held_workers as w
from tests.scenarios import (
    GATED,
    BackendConfig,
    check_equivalent,
    compare,
    only_on_tested_torch,
    scenarios,
)

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

pytestmark = only_on_tested_torch("FSDP2")

TIMEOUT = 120.0
FSDP2 = BackendConfig("fsdp2")
THOROUGH = "thorough" if os.environ.get("HYPOTHESIS_PROFILE") == "thorough" else None


def _check_held(result: dict, tolerance: float) -> None:
    held, unheld = result["held"], result["unheld"]
    compare(held["state"], unheld["state"], tolerance=tolerance)
    assert len(held["steps"]) == len(unheld["steps"]) > 0
    for (calls, reduced, used), (calls_one_each, reduced_one_each, used_one_each) in zip(
        held["steps"], unheld["steps"], strict=True
    ):
        # The same bytes, counted at the one collective that moved them.
        assert (reduced, used) == (reduced_one_each, used_one_each)
        assert calls == (1 if calls_one_each else 0)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"accumulate": 2, "set_to_none": False},
        {"accumulate": 2, "zero_grad_at": "between", "evaluate": True},
        {"nested": False},
    ],
    ids=["skipping", "accumulate-onto-zeros", "zero-grad-between", "one-unit"],
)
def test_same_bits_as_one_reduce_scatter_each(dist_pool: PoolFactory, fields: dict) -> None:
    """On 2 shards (the default): held and run as one, every step's reduce-scatters give
    the parameters bit for bit, with one collective per synchronising backward in place
    of one per unit that ran. Gradients added to existing ones (zero_grad with
    ``set_to_none=False``) and micro-batches accumulated with different skip sets
    included."""
    skips = ((0, 3, "body.1.gate"), (1, 3, "aux"), (2, "body.0.gate"), (0, 2, "aux"))
    scenario = FSDP2.scenario(GATED, world_size=2, **({"skips": skips} | fields))
    result = dist_pool(2).run(w.held_against_unheld, scenario, None, timeout=TIMEOUT)[0]
    _check_held(result, tolerance=0.0)


def test_forced_on_four_shards(dist_pool: PoolFactory) -> None:
    """``bucket_all_used=True`` on 4 shards: gloo may add the ranks' values in another order
    (the position in the buffer decides), so within rounding of one reduce-scatter each,
    and like the single-process reference."""
    scenario = FSDP2.scenario(GATED, world_size=4)
    result = dist_pool(4).run(w.held_against_unheld, scenario, True, timeout=TIMEOUT)[0]
    _check_held(result, tolerance=1e-6)
    forced = FSDP2.scenario(GATED, world_size=4, options={"bucket_all_used": True})
    check_equivalent(dist_pool, forced, timeout=TIMEOUT)


def test_default_holds_nothing_on_three_shards(dist_pool: PoolFactory) -> None:
    scenario = FSDP2.scenario(GATED, world_size=3)
    result = dist_pool(3).run(w.held_against_unheld, scenario, None, timeout=TIMEOUT)[0]
    compare(result["held"]["state"], result["unheld"]["state"], tolerance=0.0)
    assert result["held"]["steps"] == result["unheld"]["steps"]


NOT_HELD = {
    "custom": {},
    "force-sum": {},
    "all-reduce-hook": {},
    "post-accumulate-hook": {},
    "fp16-reduce": {"mixed_precision": (None, "float16")},
    "bf16-reduce": {"mixed_precision": ("bfloat16", "bfloat16")},
}


@pytest.mark.parametrize("kind", list(NOT_HELD))
def test_not_held_where_the_output_is_read_at_once(dist_pool: PoolFactory, kind: str) -> None:
    """A user's own reduce-scatter, a sum divided afterwards, an all-reduce hook, a
    post-accumulate-grad hook and a cast of the output all need the output right after
    the call: each unit's reduce-scatter runs on its own there, as bare FSDP2's."""
    result = dist_pool(2).run(w.one_step, kind, NOT_HELD[kind], timeout=TIMEOUT)[0]
    compare(result["flatview"], result["plain"], tolerance=0.0)
    units = w.UNITS + 1
    assert result["calls"]["ledger"] == units
    if kind == "custom":
        assert result["calls"]["flatview"] == result["calls"]["plain"] == units


def test_held_where_nothing_reads_the_output_at_once(dist_pool: PoolFactory) -> None:
    """The control of the test above: bf16 parameters reduced in float32 (the sharded
    gradient's dtype) are held."""
    options = {"mixed_precision": ("bfloat16", "float32")}
    result = dist_pool(2).run(w.one_step, "default", options, timeout=TIMEOUT)[0]
    compare(result["flatview"], result["plain"], tolerance=0.0)
    assert result["calls"]["ledger"] == 1


@pytest.mark.parametrize("bucket", [None, False], ids=["held", "unheld"])
def test_aborted_backward(dist_pool: PoolFactory, bucket: bool | None) -> None:
    """A backward that raises (a user's hook) after later units' reduce-scatters were
    held: those never run, and no gradient holds a reduced value; the next step trains
    as without holding."""
    held = dist_pool(2).run(w.aborted, bucket, timeout=TIMEOUT)[0]
    assert held["error"] == "_UserHookError"
    if bucket is None:
        unheld = dist_pool(2).run(w.aborted, False, timeout=TIMEOUT)[0]
        compare(held["state"], unheld["state"], tolerance=0.0)
        # Units reduced before the error (held) have no reduced gradient: the held
        # outputs' placeholders, zeros, until the next forward drops them.
        assert all(g is None or not g.any() for g in held["grads"].values()), held["grads"]
    else:
        # Control: without holding, the units reduced before the error keep gradients.
        assert any(grad is not None for grad in held["grads"].values())


REFUSED = {
    "hsdp": (4, "cannot bucket FSDP2's reduce-scatters with HSDP"),
    "one-rank": (1, "in_place_min_numel=...) only sets which FSDP2 reduce-scatters"),
}


@pytest.mark.parametrize("kind", list(REFUSED))
def test_refused(dist_pool: PoolFactory, kind: str) -> None:
    world, message = REFUSED[kind]
    assert message in dist_pool(world).run(w.refused, kind, timeout=TIMEOUT)[0]


@settings(max_examples=3 if THOROUGH is None else 30)
@given(data=st.data())
def test_same_bits_random(dist_pool: PoolFactory, data: st.DataObject) -> None:
    """Random models, skip sets, accumulation and FSDP2 options on 2 shards: held or not,
    the same parameters bit for bit."""
    scenario = data.draw(scenarios(world_sizes=(2,), configs=(FSDP2,)))
    # A reduce dtype of FSDP2's own casts each output as it comes: never held.
    dropped = ("bucket_all_used", "mixed_precision")
    options = {k: v for k, v in scenario.options.items() if k not in dropped}
    scenario = replace(scenario, options=options)
    result = dist_pool(2).run(w.held_against_unheld, scenario, None, timeout=TIMEOUT)[0]
    _check_held(result, tolerance=0.0)


@pytest.mark.parametrize(("cap", "calls"), [(2**20, 3), (5, 4)], ids=["one-run", "cap"])
def test_held_by_hand(dist_pool: PoolFactory, cap: int, calls: int) -> None:
    """:class:`~flatview.comm.held.HeldReduceScatters` on its own: outputs and the
    gradients added to are bit for bit those of one reduce-scatter each (``-0.0`` kept:
    the placeholder a gradient is added to early must leave it as it was); another op
    runs what is held first, reaching the cap runs it at once."""
    for result in dist_pool(2).run(w.held_by_hand, cap, timeout=TIMEOUT):
        assert all(result["same"]), result["same"]
        assert (result["calls"], result["left"]) == (calls, 0)
