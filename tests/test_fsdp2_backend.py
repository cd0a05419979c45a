"""torch FSDP2 (``fully_shard``) and FSDP2 HSDP: skip sets, the agreement check, errors,
stats at the collectives, norms and optimizer state, against a single-process reference
and against bare FSDP2 in the same processes."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import TYPE_CHECKING

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import fsdp2_workers as w
from tests.scenarios import (
    GATED,
    BackendConfig,
    Scenario,
    check_equivalent,
    compare,
    only_on_tested_torch,
    run_reference,
    scenarios,
)

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

pytestmark = only_on_tested_torch("FSDP2")

TIMEOUT = 120.0
FSDP2 = BackendConfig("fsdp2")
# Whole units, parameters inside units and root parameters skipped, varying per step.
SKIPS = GATED.skips


@pytest.mark.parametrize(
    ("world_size", "nested"),
    [
        (2, True),
        (2, False),
        (3, True),
        pytest.param(1, True, marks=pytest.mark.slow),
        pytest.param(4, True, marks=pytest.mark.slow),
        pytest.param(4, False, marks=pytest.mark.slow),
    ],
)
def test_equivalent(dist_pool: PoolFactory, world_size: int, nested: bool) -> None:
    """Per-block units and one unit train like the unwrapped model, skip sets varying
    per step (whole blocks, gates inside blocks, root parameters)."""
    scenario = FSDP2.scenario(GATED, world_size=world_size, nested=nested, tie=True)
    check_equivalent(dist_pool, scenario, timeout=TIMEOUT)


def test_accumulation_with_different_skips(dist_pool: PoolFactory) -> None:
    """``set_requires_gradient_sync(False)`` micro-batches skipping different blocks: what
    each accumulated is reduced at the synchronising one (block 3 skipped throughout the
    first step keeps ``None``)."""
    scenario = FSDP2.scenario(
        GATED,
        skips=((0, 3, "body.1.gate"), (1, 3, "aux"), (2, "body.0.gate"), (0, 2, "aux")),
        accumulate=2,
        evaluate=True,
    )
    check_equivalent(dist_pool, scenario, timeout=TIMEOUT)


# Two micro-batches per step: units run in one micro-batch only (block 1's in the first:
# FSDP2 keeps its reduce-scatter's sum past a closing backward that skips it), root and
# gate parameters skipped in one of the two (the reduce-scatter's layout changes inside
# the window), block 3 and a gate skipped in both (no gradient).
WINDOW_SKIPS = (
    (0,),
    (1, "aux"),
    ("body.0.gate",),
    ("body.1.gate", "body.2.gate", 3),
    ("body.0.gate", 3),
    ("body.0.gate", 3, "aux"),
    (),
    (0, 2, "body.1.gate"),
)


@pytest.mark.parametrize(
    ("zero_grad_at", "set_to_none"),
    [
        ("after_step", True),
        pytest.param("between", False, marks=pytest.mark.slow),
        pytest.param("before_forward", True, marks=pytest.mark.slow),
    ],
)
def test_hsdp_accumulation_reduce_scattering_each_micro_batch(
    dist_pool: PoolFactory, zero_grad_at: str, set_to_none: bool
) -> None:
    """HSDP accumulating with ``set_requires_all_reduce(False)`` (torchtitan's window:
    every micro-batch reduce-scattered, the sum all-reduced by the last), micro-batches
    skipping different units, gates and root parameters: equal to the reference, with no
    gradient exactly where it has none. Bare FSDP2 raises at a reduce-scatter whose
    layout changed inside the window, and keeps the sum of a unit the last micro-batch
    skips for the next step's gradient (3.7e-3 off after 2 steps, in silence)."""
    scenario = FSDP2.scenario(
        GATED,
        world_size=4,
        options={"hsdp": 2, "window": "all_reduce"},
        skips=WINDOW_SKIPS,
        accumulate=2,
        zero_grad_at=zero_grad_at,
        set_to_none=set_to_none,
    )
    check_equivalent(dist_pool, scenario, timeout=TIMEOUT)


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="fsdp2"),
        pytest.param({"hsdp": 2}, id="hsdp", marks=pytest.mark.slow),
        pytest.param({"hsdp": 2, "window": "all_reduce"}, id="hsdp-all-reduce-window"),
    ],
)
def test_mixed_precision_accumulation_with_skips(dist_pool: PoolFactory, options: dict) -> None:
    """Accumulation in FSDP2's reduce dtype (float64 here, over float32 parameters, so
    that the reference tells a wrong sum from rounding), micro-batches skipping different
    units and gates, units skipped from the first step on: equal to the reference, no
    gradient exactly where it has none. Bare FSDP2 (torch 2.13) raises there, in bf16
    with a float32 reduction too: ``AttributeError`` for a unit never run yet, and
    ``expects uniform gradient dtype`` for a parameter first used by the closing
    micro-batch (pytorch#196996)."""
    scenario = FSDP2.scenario(
        GATED,
        world_size=4 if "hsdp" in options else 2,
        options={**options, "mixed_precision": ("float32", "float64")},
        skips=WINDOW_SKIPS,
        accumulate=2,
    )
    check_equivalent(dist_pool, scenario, timeout=TIMEOUT)


def test_hsdp_window_backwards_are_not_synced(dist_pool: PoolFactory) -> None:
    """Inside a ``set_requires_all_reduce(False)`` window a backward only accumulates:
    ``fv.stats.synced`` is False there, True at the micro-batch that closes it."""
    options = {"hsdp": 2, "window": "all_reduce"}
    scenario = FSDP2.scenario(GATED, world_size=4, options=options, skips=WINDOW_SKIPS[:4])
    scenario = replace(scenario, accumulate=2)
    for synced in dist_pool(4).run(w.synced_per_backward, scenario, timeout=TIMEOUT):
        assert synced == [False, True, False, True], synced


def test_hsdp_window_same_as_plain_fsdp2(dist_pool: PoolFactory) -> None:
    """Where bare FSDP2 trains that window right (each step's micro-batches skip the
    same), flatview ends at its parameters bit for bit, though it reduce-scatters zeros
    for the skipped parameters of the units that run."""
    skips = ((0,), (0,), (1, "aux"), (1, "aux"), ("body.2.gate",), ("body.2.gate",))
    options = {"hsdp": 2, "window": "all_reduce"}
    scenario = FSDP2.scenario(GATED, world_size=4, options=options, skips=skips, accumulate=2)
    results = dist_pool(4).run(w.against_plain, scenario, timeout=TIMEOUT)
    compare(results[0]["flatview"], results[0]["plain"], tolerance=0.0)


@pytest.mark.parametrize(
    ("kind", "error"),
    [
        ("used_everywhere", "SkippedParameterUsedError"),
        ("used_on_one_rank", "SkippedParameterUsedError"),
        ("undeclared", "UndeclaredUnusedError"),
    ],
)
def test_hsdp_window_error_then_recovery(dist_pool: PoolFactory, kind: str, error: str) -> None:
    """An error inside a ``set_requires_all_reduce(False)`` window (a skipped parameter
    used on every rank or on one, in the first micro-batch, after later units' sums were
    begun; or an undeclared unused one, found as the window closes) raises on every rank;
    after ``zero_grad`` the next window's gradients are a fresh model's, bit for bit:
    nothing FSDP2 held for the broken window leaks into it."""
    options = {"hsdp": 2, "window": "all_reduce"}
    scenario = FSDP2.scenario(GATED, world_size=4, options=options)
    results = dist_pool(4).run(w.window_error_recovery, scenario, kind, timeout=TIMEOUT)
    for r in results:
        assert r["error"] == error
        assert r["worst"] == 0.0
        # Only the gate skipped throughout the window has no gradient (views that hold
        # none of a rank's elements aside).
        assert all(n.startswith("body.3.gate.") for n in r["none"]), r
    assert any(r["none"] for r in results)


@pytest.mark.parametrize(
    ("world_size", "options", "accumulate"),
    [
        (2, {}, 1),
        (4, {"hsdp": 2, "window": "all_reduce"}, 2),
    ],
    ids=["fsdp2", "hsdp-window"],
)
def test_training_after_a_skipped_parameter_used_on_one_rank(
    dist_pool: PoolFactory, world_size: int, options: dict, accumulate: int
) -> None:
    """After a skipped parameter used on one rank only (raised on every rank, caught,
    the gradients zeroed), the scenario trains as the single-process reference."""
    scenario = FSDP2.scenario(
        GATED, world_size=world_size, options=options, skips=WINDOW_SKIPS, accumulate=accumulate
    )
    results = dist_pool(world_size).run(w.one_rank_used_then_training, scenario, timeout=TIMEOUT)
    assert [r["error"] for r in results] == ["SkippedParameterUsedError"] * world_size
    compare(results[0]["params"], run_reference(scenario).params)


@pytest.mark.parametrize(
    ("world_size", "options"),
    [
        (2, {"mixed_precision": ("bfloat16", "float32")}),
        (2, {"reshard_after_forward": False, "prefetch": True}),
        (4, {"reshard_after_forward": 2}),
        (4, {"hsdp": 2, "prefetch": True}),
    ],
    ids=["bf16-params", "no-reshard-prefetch", "reshard-to-2", "hsdp-2x2"],
)
def test_same_as_plain_fsdp2(dist_pool: PoolFactory, world_size: int, options: dict) -> None:
    """With the same skip set on every rank bare FSDP2 trains correctly: flatview on top
    ends at exactly its parameters; skipped blocks are never gathered (explicit prefetch
    steered away from them) and cost no reduction."""
    scenario = FSDP2.scenario(GATED, world_size=world_size, options=options)
    results = dist_pool(world_size).run(w.against_plain, scenario, timeout=TIMEOUT)
    compare(results[0]["flatview"], results[0]["plain"], tolerance=0.0)
    ran = [len(GATED.inner) - sum(isinstance(s, int) for s in skip) for skip in SKIPS]
    for stats, gathers, units in zip(results[0]["stats"], results[0]["gathers"], ran, strict=True):
        # One reduce-scatter per unit that ran (root included), with HSDP one all-reduce
        # more each; on 2 shards held and run as one (test_fsdp2_held.py). The skipped
        # blocks' bytes are not reduced.
        per_unit = 2 if "hsdp" in options else 1
        held = world_size == 2 and "hsdp" not in options
        assert stats.reduce_calls == (1 if held else per_unit * (units + 1))
        assert stats.skipped_bytes > 0 or units == len(GATED.inner)
        # Forward: root and each block that ran; backward: each block again unless kept
        # (the root too when told to reshard: by default it keeps its parameters).
        reshard = options.get("reshard_after_forward")
        expected = {False: units + 1, None: 2 * units + 1}.get(reshard, 2 * (units + 1))
        assert gathers == expected


def test_forward_methods_registered_with_fsdp2(dist_pool: PoolFactory) -> None:
    """``register_fsdp_forward_method``: a ``generate`` that calls the model itself,
    between steps (as RLHF loops on FSDP2 do), and training steps through a registered
    loss method (only the nested units' forwards reach flatview's hooks), skipping
    blocks: the generations are bare FSDP2's, the training bit for bit."""
    scenario = FSDP2.scenario(GATED, skips=SKIPS)
    pool = dist_pool(2)
    bare = pool.run(w.registered_forward_methods, scenario, False, timeout=TIMEOUT)
    wrapped = pool.run(w.registered_forward_methods, scenario, True, timeout=TIMEOUT)
    for got, want in zip(wrapped, bare, strict=True):
        assert got["generated"] == want["generated"]
    compare(wrapped[0]["params"], bare[0]["params"], tolerance=0.0)


def test_built_on_meta_refused_until_materialized(dist_pool: PoolFactory) -> None:
    """A net built on the meta device and sharded there: ``flatview.wrap`` before
    ``to_empty`` is refused naming the parameters (torch's lazy initialisation raised
    its own RuntimeError inside the wrap before); materialized, initialized and then
    wrapped, it trains exactly as bare FSDP2 built the usual way."""
    scenario = FSDP2.scenario(GATED, skips=SKIPS[:2])
    result = dist_pool(2).run(w.built_on_meta, scenario, timeout=TIMEOUT)[0]
    assert result["refused"] is not None
    assert re.search(
        r"WrapError: .*still on the meta device \('stem\.weight', .* more\); materialize",
        result["refused"],
    ), result["refused"]
    compare(result["flatview"], result["plain"], tolerance=0.0)


def test_equivalent_hybrid(dist_pool: PoolFactory) -> None:
    """HSDP on a 2 x 2 mesh (shard 2, replicate 2) against the single-process reference."""
    scenario = FSDP2.scenario(GATED, world_size=4, options={"hsdp": 2})
    check_equivalent(dist_pool, scenario, timeout=TIMEOUT)


def test_hybrid_stats(dist_pool: PoolFactory) -> None:
    """HSDP: a skipped block costs nothing in the shard group (reduce-scatter) nor across
    replicas (all-reduce); both are counted."""
    full, one, two = dist_pool(4).run(w.hybrid_stats, timeout=TIMEOUT)[0]
    rs, ar = "reduce_scatter", "replica_all_reduce"
    assert full[f"calls.{rs}"] == full[f"calls.{ar}"] == 4
    assert one[f"calls.{rs}"] == one[f"calls.{ar}"] == 3
    assert two[f"calls.{rs}"] == two[f"calls.{ar}"] == 2
    assert full["calls.all_gather"] == 7 and one["calls.all_gather"] == 5
    for stats in (full, one, two):
        # The all-reduce moves the reduce-scatter's output: half its input on 2 shards.
        assert stats[f"bytes.{ar}"] * 2 == stats[f"bytes.{rs}"]
        assert stats["reduced_bytes"] == stats[f"bytes.{rs}"] + stats[f"bytes.{ar}"]
        assert stats["replica_bytes"] == stats[f"bytes.{ar}"]


@pytest.mark.parametrize("per_block", [True, False], ids=["per-block", "one-unit"])
def test_mismatch_raises_everywhere(dist_pool: PoolFactory, per_block: bool) -> None:
    """Ranks that skip different blocks raise SkipSetMismatchError on every rank, before
    any all-gather could pair up wrongly."""
    results = dist_pool(2).run(w.mismatch, per_block, True, timeout=TIMEOUT)
    assert [r["error"] for r in results] == ["SkipSetMismatchError"] * 2


def test_hybrid_mismatch_across_replicas(dist_pool: PoolFactory) -> None:
    """HSDP: replicas that skip different blocks (each shard group agreeing within) raise
    on every rank: the check spans the whole mesh, not only the shard group."""
    results = dist_pool(4).run(w.mismatch, True, True, True, timeout=TIMEOUT)
    assert [r["error"] for r in results] == ["SkipSetMismatchError"] * 4


def test_plain_fsdp2_mismatch_is_silent(dist_pool: PoolFactory) -> None:
    """The hazard the check exists for: bare FSDP2 with ranks skipping different
    blocks raises nothing and computes wrong gradients."""
    results = dist_pool(2).run(w.mismatch, True, False, timeout=TIMEOUT)
    assert all(r["error"] is None for r in results)
    assert max(r["worst"] for r in results) > 1e-3


@pytest.mark.parametrize("everywhere", [False, True], ids=["one-rank", "every-rank"])
def test_undeclared_unused(dist_pool: PoolFactory, everywhere: bool) -> None:
    """A parameter not declared skipped that gets no gradient raises
    UndeclaredUnusedError on every rank (on one rank only: the others' reduce-scatters
    still pair, with zeros from it); training goes on afterwards."""
    results = dist_pool(2).run(w.undeclared, everywhere, timeout=TIMEOUT)
    for r in results:
        assert r["error"] == "UndeclaredUnusedError"
        assert "body.1.gate.weight" in r["message"]
        assert r["gate_grad_none"] is everywhere
        assert r["after"]


def test_skipped_unit_called(dist_pool: PoolFactory) -> None:
    results = dist_pool(2).run(w.skipped_unit_called, timeout=TIMEOUT)
    assert results == ["SkippedParameterUsedError"] * 2


@pytest.mark.parametrize(
    ("world_size", "hsdp", "one_rank"),
    [(2, 0, False), (2, 0, True), (4, 2, True)],
    ids=["every-rank", "one-rank", "hsdp-one-rank"],
)
def test_skipped_parameter_used(
    dist_pool: PoolFactory, world_size: int, hsdp: int, one_rank: bool
) -> None:
    """A parameter declared skipped that the model uses raises on every rank at the end
    of the backward, naming it, also where one rank alone uses it (that rank raising
    inside the backward left the others in its reduce-scatters: a hang); the next step
    trains."""
    results = dist_pool(world_size).run(w.skipped_used, one_rank, hsdp, timeout=TIMEOUT)
    for rank, r in enumerate(results):
        assert r["error"] == "SkippedParameterUsedError", r
        assert "'body.0.gate.weight'" in r["message"], r
        here = rank == 0 or not one_rank
        assert ("on this rank" if here else "on another rank") in r["message"], r
        assert r["after"], r


@pytest.mark.parametrize("options", [{}, {"hsdp": 2}], ids=["fsdp", "hsdp"])
def test_norms_and_optimizer_state(dist_pool: PoolFactory, options: dict) -> None:
    """Norms of whole parameters and gradients from the DTensor pieces, and the
    consolidated optimizer state, equal the reference's; loading it back round-trips."""
    scenario = FSDP2.scenario(GATED, world_size=4 if options else 3, options=options)
    results = dist_pool(scenario.world_size).run(w.norms_and_state, scenario, timeout=TIMEOUT)
    for worst in results:
        assert max(worst.values()) < 1e-5, worst


REFUSED = {
    "offload": "CPUOffloadPolicy",
    "unsharded-root": "fully_shard(model)",
    # An AttributeError from inside the wrap before.
    "replicate": "['<root>'] replicate without sharding",
    # Accepted and silently ignored before: FSDP2 reduces in its own collectives.
    "all-to-all": "would be ignored: strategy='all_to_all'",
    "reduce-options": "would be ignored: keep_buffer_bytes=0",
}


@pytest.mark.parametrize("kind", list(REFUSED))
def test_refused(dist_pool: PoolFactory, kind: str) -> None:
    messages = dist_pool(1).run(w.refused, kind, timeout=TIMEOUT)
    assert REFUSED[kind] in messages[0], messages[0]


@settings(max_examples=4)
@given(data=st.data())
def test_equivalent_random(dist_pool: PoolFactory, data: st.DataObject) -> None:
    """Random models, skip sets, accumulation and FSDP2 options (a few draws in CI, many
    in the thorough profile)."""
    scenario = data.draw(scenarios(world_sizes=(2, 3, 1), configs=(FSDP2,)))
    option = data.draw(st.sampled_from(({}, {"reshard_after_forward": False}, {"prefetch": True})))
    scenario = replace(scenario, options={**scenario.options, **option})
    check_equivalent(dist_pool, scenario, timeout=TIMEOUT)


@pytest.mark.slow
@settings(max_examples=20)
@given(data=st.data())
def test_equivalent_random_hybrid(dist_pool: PoolFactory, data: st.DataObject) -> None:
    scenario = data.draw(scenarios(world_sizes=(4,), configs=(FSDP2,)))
    # Held reduce-scatters are refused with HSDP (test_fsdp2_held.py).
    options = {k: v for k, v in scenario.options.items() if k != "bucket_all_used"}
    scenario = replace(scenario, options={**options, "hsdp": 2})
    check_equivalent(dist_pool, scenario, timeout=TIMEOUT)


def test_scenario_default_is_not_fsdp2() -> None:
    assert Scenario().backend != "fsdp2"
