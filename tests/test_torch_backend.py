"""flatview over torch's own FSDP1 (``FullyShardedDataParallel``), on CPU over gloo.

The central check is equivalence: training with views, per-submodule optimizers and a
sequence of skip sets (skips in the first step included) must end at the parameters of
a single-process run of the same model in which the skipped parts simply do not run.
The tasks live in :mod:`tests.torch_workers`; this file only picks world sizes and
options and compares.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from flatview.backends import torch_fsdp
from tests import torch_workers as tw
from tests.scenarios import Scenario, compare, run_reference, scenarios

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

pytest.importorskip("torch.distributed.fsdp")
pytestmark = pytest.mark.skipif(
    torch_fsdp.torch_version() not in torch_fsdp.TESTED_TORCH,
    reason=f"flatview's torch backend is tested with torch {torch_fsdp.TESTED_TORCH}",
)

BACKEND = "torch"
SINGLE_STEPS = tuple((plan,) for plan in tw.PLANS)
TIMEOUT = 120.0


def assert_matches_reference(
    results: list[dict[str, Any]],
    schedule: tuple[tuple[tw.Plan, ...], ...],
    world_size: int,
    *,
    wrapper_views: bool = False,
) -> None:
    """Every rank ended at the reference parameters, and gradients were None exactly for
    what the reference left without one."""
    reference, reference_none = tw.reference_run(schedule, world_size)
    names = [name for name, _ in tw.build_model().named_parameters()]
    for rank, out in enumerate(results):
        assert out["names"] == names, f"rank {rank}"
        assert out["module_params_are_views"], f"rank {rank}"
        assert out["full"].keys() == reference.keys(), f"rank {rank}"
        for key, expected in reference.items():
            torch.testing.assert_close(
                out["full"][key], expected, atol=2e-5, rtol=1e-4, msg=f"rank {rank}: {key}"
            )
        for step, (none, expected_none) in enumerate(zip(out["none"], reference_none, strict=True)):
            if wrapper_views:
                # torch's own views of parameters outside this rank's shard have no
                # gradient whatever the step did.
                assert set(expected_none) <= set(none), f"rank {rank}, step {step}"
                assert set(none) - set(expected_none) <= set(out["empty"]), f"rank {rank}"
            else:
                assert none == expected_none, f"rank {rank}, step {step}"


# ------------------------------------------------------------------ equivalence

QUICK_EQUIVALENCE = [
    pytest.param(1, "FULL_SHARD", True, id="ws1"),  # torch uses NO_SHARD at world size 1
    pytest.param(2, "FULL_SHARD", True, id="ws2-full"),
    pytest.param(2, "SHARD_GRAD_OP", True, id="ws2-grad-op"),
    pytest.param(2, "NO_SHARD", True, id="ws2-no-shard"),
    pytest.param(3, "FULL_SHARD", False, id="ws3-full-manual"),
    pytest.param(3, "SHARD_GRAD_OP", False, id="ws3-grad-op-manual"),
    pytest.param(3, "NO_SHARD", True, id="ws3-no-shard"),
]
SLOW_EQUIVALENCE = [
    pytest.param(ws, strategy, auto, id=f"ws{ws}-{strategy}-{'auto' if auto else 'manual'}")
    for ws in (2, 3, 4)
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
    for auto in (True, False)
]


@pytest.mark.parametrize(("world_size", "strategy", "auto_wrap"), QUICK_EQUIVALENCE)
def test_matches_reference(
    dist_pool: PoolFactory, world_size: int, strategy: str, auto_wrap: bool
) -> None:
    options = tw.Options(strategy=strategy, auto_wrap=auto_wrap)
    results = dist_pool(world_size).run(
        tw.train_task, BACKEND, options, SINGLE_STEPS, timeout=TIMEOUT
    )
    assert_matches_reference(results, SINGLE_STEPS, world_size)


@pytest.mark.slow
@pytest.mark.parametrize(("world_size", "strategy", "auto_wrap"), SLOW_EQUIVALENCE)
def test_matches_reference_everywhere(
    dist_pool: PoolFactory, world_size: int, strategy: str, auto_wrap: bool
) -> None:
    for schedule in (SINGLE_STEPS, tw.ACCUMULATION):
        options = tw.Options(strategy=strategy, auto_wrap=auto_wrap)
        results = dist_pool(world_size).run(
            tw.train_task, BACKEND, options, schedule, timeout=TIMEOUT
        )
        assert_matches_reference(results, schedule, world_size)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_accumulation_under_no_sync(dist_pool: PoolFactory, strategy: str) -> None:
    """Micro-batches with different skip sets: a parameter used in any of them gets the
    accumulated gradient, one skipped in all keeps None (block 3 in the first step);
    a unit used only before the synchronising micro-batch still gets reduced."""
    results = dist_pool(2).run(
        tw.train_task, BACKEND, tw.Options(strategy=strategy), tw.ACCUMULATION, timeout=TIMEOUT
    )
    assert_matches_reference(results, tw.ACCUMULATION, 2)


@pytest.mark.parametrize("schedule", ["single", "accumulation"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_use_orig_params_gets_skip_sets_without_views(
    dist_pool: PoolFactory, strategy: str, schedule: str
) -> None:
    """torch keeps its own per-parameter views; flatview adds skip sets, and gives
    skipped parameters None where torch would hand out zeros."""
    steps = SINGLE_STEPS if schedule == "single" else tw.ACCUMULATION
    options = tw.Options(strategy=strategy, use_orig_params=True)
    results = dist_pool(2).run(tw.train_task, BACKEND, options, steps, timeout=TIMEOUT)
    assert_matches_reference(results, steps, 2, wrapper_views=True)


def test_prefetch_and_evaluation_keep_results(dist_pool: PoolFactory) -> None:
    """Forward prefetching (steered around skipped units), and between steps a forward
    without autograd under a skip set plus a forward that no backward follows."""
    options = tw.Options(auto_wrap=False, forward_prefetch=True, backward_prefetch="BACKWARD_POST")
    results = dist_pool(3).run(tw.train_task, BACKEND, options, SINGLE_STEPS, True, timeout=TIMEOUT)
    assert_matches_reference(results, SINGLE_STEPS, 3)


def test_low_precision_reduction(dist_pool: PoolFactory) -> None:
    """Gradients reduced in fp16 (torch casts before the communication hook and back
    after it) still agree with the fp32 reference to fp16 accuracy."""
    from torch.distributed.fsdp import MixedPrecision

    options = tw.Options(extra={"mixed_precision": MixedPrecision(reduce_dtype=torch.float16)})
    results = dist_pool(2).run(tw.train_task, BACKEND, options, SINGLE_STEPS, timeout=TIMEOUT)
    reference, _ = tw.reference_run(SINGLE_STEPS, 2)
    for out in results:
        for key, expected in reference.items():
            torch.testing.assert_close(out["full"][key], expected, atol=3e-3, rtol=3e-3)


PLAIN_CONFIGS = {
    "full-shard": tw.Options(),
    "no-shard": tw.Options(strategy="NO_SHARD"),
    "use-orig-params": tw.Options(use_orig_params=True),
    "bf16-params": tw.Options(
        extra={"mixed_precision": ("bfloat16", "bfloat16")},
    ),
}


@pytest.mark.parametrize("config", sorted(PLAIN_CONFIGS))
def test_nothing_skipped_equals_plain_fsdp(dist_pool: PoolFactory, config: str) -> None:
    """With nothing skipped, flatview's reduction is torch's own: the same parameters as
    plain FSDP with optimizers over the flat parameters, bit for bit (bf16 compute
    included, where any other reduction order would show)."""
    options = PLAIN_CONFIGS[config]
    pool = dist_pool(2)
    plain = pool.run(tw.plain_task, BACKEND, options, 4, timeout=TIMEOUT)[0]
    ours = pool.run(tw.train_task, BACKEND, options, ((tw.FULL_PLAN,),) * 4, timeout=TIMEOUT)
    for key, value in plain.items():
        assert torch.equal(ours[0]["full"][key], value), key


def test_skipped_units_are_not_reduced(dist_pool: PoolFactory) -> None:
    results = dist_pool(2).run(tw.train_task, BACKEND, tw.Options(), SINGLE_STEPS, timeout=TIMEOUT)
    for out in results:
        for plan, stats in zip(tw.PLANS, out["stats"], strict=True):
            # One reduction per unit with anything used: the root and the blocks run.
            assert stats.reduce_calls == 1 + tw.DEPTH - len(plan.skip_blocks)
            assert stats.units_skipped == len(plan.skip_blocks)
            if tw.skip_names(plan):
                assert stats.reduced_bytes < stats.dense_bytes
            else:
                assert stats.reduced_bytes == stats.dense_bytes


STRATEGIES = st.sampled_from(["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])


def well_conditioned(scenario: Scenario) -> bool:
    """False for a LayerNorm over one feature: its weight's gradient is rounding noise
    (~1e-7) whose value depends on how the batch is split, and AdamW scales noise up to
    full-size steps, so no two runs agree (fairscale fails these alike)."""
    return scenario.width > 1 or not any(scenario.norms)


@given(scenarios(world_sizes=(1, 2, 3), backend="torch"), STRATEGIES)
def test_shared_scenarios(dist_pool: PoolFactory, scenario: Scenario, strategy: str) -> None:
    """The equivalence suite's scenarios (shapes straddling shards, ties, zeroing to
    zeros instead of None) on this backend."""
    assume(well_conditioned(scenario))
    results = dist_pool(scenario.world_size).run(
        tw.scenario_task, scenario, strategy, timeout=TIMEOUT
    )
    compare(results[0], run_reference(scenario))


@pytest.mark.slow
@given(scenarios(world_sizes=(4,), backend="torch"), STRATEGIES)
def test_shared_scenarios_four_ranks(
    dist_pool: PoolFactory, scenario: Scenario, strategy: str
) -> None:
    assume(well_conditioned(scenario))
    results = dist_pool(4).run(tw.scenario_task, scenario, strategy, timeout=TIMEOUT)
    compare(results[0], run_reference(scenario))


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_freezing_by_name(dist_pool: PoolFactory, strategy: str) -> None:
    """requires_grad_(False) on views: those parameters get neither gradient nor
    communication, partial pieces included."""
    scenario = Scenario(
        world_size=3,
        inner=(5, 3),
        norms=(True, False),
        skips=((), (1,), ()),
        frozen=("body.0.up", "head.bias", "stem.weight"),
        backend="torch",
    )
    results = dist_pool(3).run(tw.scenario_task, scenario, strategy, timeout=TIMEOUT)
    compare(results[0], run_reference(scenario))


# ------------------------------------------------------------------------ views


def test_views(dist_pool: PoolFactory) -> None:
    facts = dist_pool(3).run(tw.views_task, BACKEND, tw.Options(), timeout=TIMEOUT)
    names = [name for name, _ in tw.build_model().named_parameters()]
    kinds_seen = set()
    for rank, f in enumerate(facts):
        assert f["names"] == names, rank
        # Hidden flat parameters: the model's parameters are exactly the views.
        assert not f["flat_in_parameters"], rank
        assert f["root_param_ids"] == f["view_ids"], rank
        assert f["grad_alias"], rank
        assert f["shifted"], rank
        clipped, by_views = f["clip_norm"]
        assert clipped == pytest.approx(by_views, rel=1e-5), rank
        kinds_seen.update(f["kinds"].values())
    assert kinds_seen == {"full", "partial", "empty"}
    # Each original parameter is FULL on exactly one rank or split into PARTIAL pieces.
    for name in names:
        kinds = [f["kinds"][name] for f in facts]
        assert kinds.count("full") == 1 or ("partial" in kinds and "full" not in kinds), name


@pytest.mark.parametrize("kind", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"])
def test_state_dict_unchanged(dist_pool: PoolFactory, kind: str) -> None:
    results = dist_pool(2).run(tw.state_dict_task, BACKEND, tw.Options(), kind, timeout=TIMEOUT)
    full_shapes = {n: tuple(p.shape) for n, p in tw.build_model().named_parameters()}
    for rank, r in enumerate(results):
        assert r["plain"].keys() == r["wrapped"].keys() == r["reloaded"].keys(), rank
        for key, plain in r["plain"].items():
            wrapped, reloaded = r["wrapped"][key], r["reloaded"][key]
            plain_parts = plain if isinstance(plain, list) else [plain]
            wrapped_parts = wrapped if isinstance(wrapped, list) else [wrapped]
            reloaded_parts = reloaded if isinstance(reloaded, list) else [reloaded]
            for a, b, c in zip(plain_parts, wrapped_parts, reloaded_parts, strict=True):
                assert torch.equal(a, b), (rank, key)
                torch.testing.assert_close(c, b + 0.5, msg=f"rank {rank}: {key}")
        assert r["same_views"] and r["after_summon"], rank
        # Inside summon_full_params the submodules hold the full parameters.
        summoned = {torch_fsdp.clean_name(n): s for n, s in r["summoned"].items()}
        assert summoned == full_shapes, rank


def test_uninstall_leaves_nothing(dist_pool: PoolFactory) -> None:
    for left in dist_pool(2).run(tw.uninstall_task, BACKEND, tw.Options(), timeout=TIMEOUT):
        assert left == []


# ---------------------------------------------------------------------- prefetch


def test_forward_prefetch_skips_skipped_units(dist_pool: PoolFactory) -> None:
    """torch prefetches in the first iteration's order; without flatview it all-gathers
    units that a later step skips. With flatview it prefetches the next used unit."""
    options = tw.Options(forward_prefetch=True, backward_prefetch="BACKWARD_PRE")
    pool = dist_pool(2)
    plain_wasted, _ = pool.run(tw.prefetch_task, BACKEND, options, False, timeout=TIMEOUT)[0]
    wasted, prefetched = pool.run(tw.prefetch_task, BACKEND, options, True, timeout=TIMEOUT)[0]
    assert plain_wasted[2] == ["body.0", "body.3"]  # what flatview has to prevent
    assert wasted == [[]] * len(tw.PLANS)
    # Step 2 skips blocks 0 and 3: the root prefetches block 2 instead of block 0.
    assert "body.2" in prefetched[2]


@pytest.mark.parametrize("backward_prefetch", ["BACKWARD_PRE", "BACKWARD_POST"])
def test_backward_prefetch_never_gathers_skipped_units(
    dist_pool: PoolFactory, backward_prefetch: str
) -> None:
    """Backward prefetching follows this iteration's forward order, which holds no skipped
    unit, except after a forward that no backward followed: torch then keeps that
    forward's order and prefetches a unit the next step skips (block 1 in step 0)."""
    options = tw.Options(backward_prefetch=backward_prefetch)
    pool = dist_pool(2)
    for abandon_first in (False, True):
        plain, _ = pool.run(tw.prefetch_task, BACKEND, options, False, abandon_first)[0]
        assert plain[0] == (["body.1"] if abandon_first else [])
        wasted, _ = pool.run(tw.prefetch_task, BACKEND, options, True, abandon_first)[0]
        assert wasted == [[]] * len(tw.PLANS)


# ------------------------------------------------------------------------ errors


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_undeclared_unused_unit(dist_pool: PoolFactory, strategy: str) -> None:
    err = dist_pool(2).run_expecting_error(
        tw.undeclared_task,
        BACKEND,
        tw.Options(strategy=strategy),
        match=r"UndeclaredUnusedError.*'body\.1'",
        timeout=TIMEOUT,
    )
    assert set(err.exc_types.values()) == {"flatview.errors.UndeclaredUnusedError"}


def test_calling_a_skipped_unit(dist_pool: PoolFactory) -> None:
    dist_pool(2).run_expecting_error(
        tw.call_skipped_unit_task,
        BACKEND,
        tw.Options(),
        match=r"SkippedParameterUsedError.*'body\.1' is declared skipped",
        timeout=TIMEOUT,
    )


@pytest.mark.parametrize(
    ("strategy", "name"),
    [("FULL_SHARD", "body.0.gate"), ("FULL_SHARD", "aux.weight"), ("NO_SHARD", "body.2.fc1")],
)
def test_using_a_skipped_parameter(dist_pool: PoolFactory, strategy: str, name: str) -> None:
    dist_pool(2).run_expecting_error(
        tw.use_skipped_param_task,
        BACKEND,
        tw.Options(strategy=strategy),
        name,
        match=rf"SkippedParameterUsedError.*{name.replace('.', '[.]')}.*used it",
        timeout=TIMEOUT,
    )


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("fsdp2", "FSDP2.*no flat parameters"),
        ("nested", "nested FSDP unit"),
        ("version", "torch 1[.]0[.]x; found torch"),
        ("comm_hook", "already has a communication hook"),
        ("plain", "expects the outermost FullyShardedDataParallel"),
        ("HYBRID_SHARD", "hybrid sharding"),
    ],
)
def test_wrap_refuses(dist_pool: PoolFactory, case: str, match: str) -> None:
    for message in dist_pool(2).run(tw.wrap_error_task, BACKEND, tw.Options(), case):
        assert re.search(match, message), message
