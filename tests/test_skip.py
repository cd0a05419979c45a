"""Skip sets: no gradient and no communication for the parameters a step does not use,
and clear errors when a skip set and the model disagree. Every test runs on each
backend configuration (fairscale; torch FULL_SHARD, SHARD_GRAD_OP, NO_SHARD)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import pytest

from tests import workers as w
from tests.scenarios import (
    BACKEND_CONFIGS,
    BACKENDS,
    BackendConfig,
    Scenario,
    assert_equivalent,
    backend_param,
    check_equivalent,
    make_net,
    run_distributed,
    run_reference,
)

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

TIMEOUT = 60.0

# Blocks of different sizes so skipped spans fall unevenly across shards.
SC = Scenario(world_size=2, width=4, inner=(6, 2, 5, 3), norms=(True, False, True, False))


def _numel(prefix: str) -> int:
    return sum(p.numel() for n, p in make_net(SC).named_parameters() if n.startswith(prefix))


def _padded(numel: int, world_size: int) -> int:
    return -(-numel // world_size) * world_size


# ------------------------------------------------------------------ collectives


def _count_params() -> list[Any]:
    params = []
    for config in BACKEND_CONFIGS:
        if config.replicated:
            # NO_SHARD all-reduces; the reduce-scatter strategies do not apply.
            strategies: tuple[str, ...] = ("auto",)
        elif config.strategy == "SHARD_GRAD_OP":
            # The same reduction path as FULL_SHARD.
            strategies = ("auto",)
        else:
            strategies = ("all_to_all", "reduce_scatter", "auto")
        params += [
            backend_param(config, strategy, nested)
            for strategy in strategies
            for nested in (False, True)
        ]
    return params


def _skip_collective_counts(backend: BackendConfig) -> None:
    """The counts below are those of one shard group over the world, with flatview's
    choice of reduction: not what hybrid layouts or FSDP2 move."""
    if backend.hybrid:
        pytest.skip(
            "hybrid layouts count bytes per group: tests/test_hybrid.py::"
            "test_hybrid_bytes_per_group, tests/test_fsdp2_backend.py (HSDP)"
        )
    if backend.sharded_originals:
        pytest.skip(
            "FSDP2 reduces with its own reduce-scatter per unit (reduce_strategy does not "
            "apply) plus a flags all-reduce: counted in tests/test_fsdp2_backend.py"
        )


@pytest.mark.parametrize(("backend", "strategy", "nested"), _count_params())
def test_reduced_bytes_track_used_parameters(
    dist_pool: PoolFactory, backend: BackendConfig, strategy: str, nested: bool
) -> None:
    _skip_collective_counts(backend)
    scenario = backend.scenario(SC, nested=nested)
    results = dist_pool(scenario.world_size).run(
        w.count_step, scenario, (0, 2), strategy, timeout=TIMEOUT
    )
    total = sum(p.numel() for p in make_net(scenario).parameters())
    used = total - _numel("body.0.") - _numel("body.2.")
    skipped_names = sorted(
        n for n, _ in make_net(scenario).named_parameters() if n.startswith(("body.0.", "body.2."))
    )
    for r in results:
        # Measured at the collectives, and flatview's own account of them agrees.
        reduce_kinds = ("reduce_scatter", "all_to_all", "all_reduce")
        measured = sum(r["bytes"].get(kind, 0) for kind in reduce_kinds)
        assert measured == r["reduced_bytes"], r
        assert r["used_bytes"] == used * 4
        assert 1 <= r["reduce_calls"] == sum(r["calls"].get(k, 0) for k in reduce_kinds), r
        if backend.on_views:
            # One all-reduce of the packed used gradients and, per used parameter, a
            # flag saying whether this rank's backward reached it (DDP, torch NO_SHARD
            # computed on views).
            assert set(r["bytes"]) & set(reduce_kinds) == {"all_reduce"}, r
            flags = len(list(make_net(scenario).parameters())) - len(skipped_names)
            assert measured == (used + flags) * 4, r
        elif backend.replicated:
            # One all-reduce of the packed used gradients.
            assert set(r["bytes"]) & set(reduce_kinds) == {"all_reduce"}, r
            assert measured == used * 4
        elif strategy == "all_to_all":
            assert measured == used * 4
        else:
            # Reduce-scatter pads every rank's part to the largest one.
            assert used * 4 <= measured <= (used + 2 * 16) * 4, r
        if strategy == "auto" and not backend.replicated:
            assert measured <= 1.05 * used * 4 or r["calls"].get("all_to_all"), r
        assert measured < r["dense_bytes"]
        # Empty views of parameters held elsewhere get no gradient either.
        assert r["grads_none"] == sorted(set(skipped_names) | set(r["empty_elsewhere"]))
        # DDP has one unit, the whole model.
        assert r["units_skipped"] == (2 if nested and backend.backend != "ddp" else 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_rank_stats_follow_the_wrapper(dist_pool: PoolFactory, backend: BackendConfig) -> None:
    """On one rank fairscale communicates no gradient, and flatview neither: nothing
    reduced, nothing to compare with. The others still reduce (an all-reduce with
    itself), and the stats say what that moved."""
    _skip_collective_counts(backend)
    scenario = backend.scenario(SC, world_size=1)
    (r,) = dist_pool(scenario.world_size).run(
        w.count_step, scenario, (0, 2), "auto", timeout=TIMEOUT
    )
    reduce_kinds = ("reduce_scatter", "all_to_all", "all_reduce")
    measured = sum(r["bytes"].get(kind, 0) for kind in reduce_kinds)
    assert measured == r["reduced_bytes"], r
    if backend.backend == "fairscale":
        assert (measured, r["dense_bytes"], r["used_bytes"]) == (0, 0, 0), r
    else:
        assert 0 < r["used_bytes"] <= measured < r["dense_bytes"], r


# Per backend, how often an FSDP unit is all-gathered in one training step.
GATHERS_PER_UNIT = {
    "fairscale": 2,  # for forward, and again for backward (resharded after forward)
    "torch-full-shard": 2,
    "torch-shard-grad-op": 1,  # kept unsharded from forward to backward
    "torch-no-shard": 0,  # every rank holds every parameter
    "torch-no-shard-runtime": 0,
    "ddp": 0,
    # FSDP2 reshards after forward by default; hybrid layouts gather within shard groups.
    "fsdp2": 2,
    "fsdp2-hsdp": 2,
    "torch-hybrid-shard": 2,
    "torch-hybrid-shard-zero2": 1,
}


@pytest.mark.parametrize("backend", BACKENDS)
def test_skipped_units_are_not_gathered(dist_pool: PoolFactory, backend: BackendConfig) -> None:
    _skip_collective_counts(backend)
    scenario = backend.scenario(SC, nested=True)
    full = dist_pool(scenario.world_size).run(w.count_step, scenario, (), "auto", timeout=TIMEOUT)[
        0
    ]
    skipped = dist_pool(scenario.world_size).run(
        w.count_step, scenario, (0, 2), "auto", timeout=TIMEOUT
    )[0]
    per_unit = GATHERS_PER_UNIT[str(backend)]
    gathered = full["bytes"].get("all_gather", 0) - skipped["bytes"].get("all_gather", 0)
    padded = sum(_padded(_numel(f"body.{i}."), 2) for i in (0, 2))
    assert gathered == per_unit * padded * 4
    calls = full["calls"].get("all_gather", 0) - skipped["calls"].get("all_gather", 0)
    assert calls == per_unit * 2
    if per_unit:
        assert skipped["bytes"]["all_gather"] > 0, "the used units must still be gathered"


# -------------------------------------------------------------------- training


@pytest.mark.parametrize("backend", BACKENDS)
def test_accumulation_with_different_skip_sets(
    dist_pool: PoolFactory, backend: BackendConfig
) -> None:
    """Micro-batches under no_sync() with different skip sets: a parameter used in any
    of them gets the accumulated gradient, one skipped in all keeps None (in the first
    step block 1, and block 3's gate while the rest of block 3 trains); a unit used only
    before the synchronising micro-batch (block 0, then block 2) still gets reduced."""
    scenario = backend.scenario(
        SC,
        gates=(False, True, False, True),
        skips=(
            (0, 1, "body.3.gate"),
            (1, 3),
            (0, 1, "body.3.gate"),
            (2, "body.3.gate"),
            ("body.1.gate",),
            (2,),
        ),
        accumulate=3,
    )
    results = dist_pool(scenario.world_size).run(run_distributed, scenario, timeout=TIMEOUT)
    reference = run_reference(scenario)
    # What the scenario is for: whole units and single parameters without a gradient.
    assert {"body.1.up.weight", "body.3.gate.weight"} <= set(reference.none_grads[0])
    assert "body.3.up.weight" not in reference.none_grads[0]
    assert_equivalent(results, reference, scenario)


@pytest.mark.parametrize("backend", BACKENDS)
def test_accumulation_after_a_mostly_skipped_micro_batch(
    dist_pool: PoolFactory, backend: BackendConfig
) -> None:
    """One unit for the whole model; the first micro-batch of each step skips every
    block (fairscale then gathers only the used segments), the second uses them all."""
    scenario = backend.scenario(SC, nested=False, skips=((0, 1, 2, 3), ()) * 2, accumulate=2)
    check_equivalent(dist_pool, scenario, timeout=TIMEOUT)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_outside_step_is_plain_fsdp(
    dist_pool: PoolFactory, backend: BackendConfig
) -> None:
    scenario = backend.scenario(SC, skips=((), ()), declare=False)
    check_equivalent(dist_pool, scenario, timeout=TIMEOUT)


# ---------------------------------------------------------------------- errors


@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_with_different_skip_sets_fail_everywhere(
    dist_pool: PoolFactory, backend: BackendConfig
) -> None:
    scenario = backend.scenario(SC)
    err = dist_pool(scenario.world_size).run_expecting_error(
        w.mismatched_skips,
        scenario,
        match="SkipSetMismatchError.*rank 0 skips.*body.0.*rank 1 skips.*body.1",
        timeout=TIMEOUT,
    )
    assert set(err.errors) == set(range(scenario.world_size))


SKIPPED_BUT_USED = {
    # declared, nested: what the error must name
    "unit": ("body.0", True, r"unit 'body\.0' is declared skipped"),
    "block-in-root": ("body.0", False, r"parameter 'body\.0\..*' is declared skipped"),
    "inside-unit": ("body.1.gate", True, r"parameter 'body\.1\.gate\.(weight|bias)' is declared"),
    "root-param": ("head.bias", True, r"parameter 'head\.bias' is declared skipped"),
}


@pytest.mark.parametrize("case", sorted(SKIPPED_BUT_USED))
@pytest.mark.parametrize("backend", BACKENDS)
def test_skipped_parameter_that_gets_a_gradient(
    dist_pool: PoolFactory, backend: BackendConfig, case: str
) -> None:
    declared, nested, match = SKIPPED_BUT_USED[case]
    if backend.backend == "ddp" and case == "unit":
        # DDP has no units: the parameters that got a gradient are named.
        match = r"parameter 'body\.0\..*' is declared skipped"
    if backend.sharded_originals and case != "unit":
        # FSDP2 raises at the end of the backward, on every rank, naming them together.
        match = match.replace("parameter ", r"parameter\(s\) .*").replace(" is ", ".* are ")
    scenario = backend.scenario(SC, nested=nested, gates=(False, True, False, False))
    err = dist_pool(scenario.world_size).run_expecting_error(
        w.skipped_but_used, scenario, declared, match=match, timeout=TIMEOUT
    )
    assert set(err.exc_types.values()) == {"flatview.errors.SkippedParameterUsedError"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_unit_unused_but_not_declared(dist_pool: PoolFactory, backend: BackendConfig) -> None:
    # Reduced DDP-style (DDP, torch NO_SHARD on views), the flags name the parameters.
    # FSDP2 (its flags are per parameter) names the parameters too.
    name = r"'body\.0\.\w+" if backend.on_views or backend.sharded_originals else r"'body\.0'"
    scenario = backend.scenario(SC, nested=True)
    err = dist_pool(scenario.world_size).run_expecting_error(
        w.undeclared_unused,
        scenario,
        match=rf"UndeclaredUnusedError.*{name}",
        timeout=TIMEOUT,
    )
    assert set(err.exc_types.values()) == {"flatview.errors.UndeclaredUnusedError"}


UNKNOWN_ITEMS = {
    "name": "'body.9.up.weight'.*did you mean",
    "module": "module that is not part of the wrapped model: Linear",
    "tensor": "tensor that is neither a view",
    "number": "must be modules, parameters or names, got int",
}


@pytest.mark.parametrize("backend", BACKENDS)
def test_unknown_skip_items(dist_pool: PoolFactory, backend: BackendConfig) -> None:
    scenario = backend.scenario(SC)
    for messages in dist_pool(scenario.world_size).run(w.bad_skip_items, scenario, timeout=TIMEOUT):
        assert messages.keys() == UNKNOWN_ITEMS.keys()
        for item, match in UNKNOWN_ITEMS.items():
            assert re.search(f"SkipSetError: .*{match}", messages[item]), messages[item]


@pytest.mark.parametrize("backend", BACKENDS)
def test_skip_items_resolve_to_original_names(
    dist_pool: PoolFactory, backend: BackendConfig
) -> None:
    scenario = backend.scenario(SC, tie=True)
    got = dist_pool(scenario.world_size).run(w.resolve_items, scenario, timeout=TIMEOUT)[0]
    body0 = [n for n, _ in make_net(SC).named_parameters() if n.startswith("body.0.")]
    assert got["unit"] == body0
    assert got["inner_module"] == ["body.0.up.weight", "body.0.up.bias"]
    assert got["view"] == ["head.bias"]
    assert got["names"] == [*body0, "head.weight"]
    # A tied parameter answers to each of its names, under its first.
    assert got["tied_name"] == ["head.weight"]
    assert got["tied_module"] == ["head.weight", "head_copy.bias"]
