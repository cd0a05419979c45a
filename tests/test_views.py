"""Views: what a user sees and can do after ``flatview.wrap``, on each backend
configuration that flattens parameters (fairscale; torch FULL_SHARD, SHARD_GRAD_OP,
NO_SHARD, and the hybrid strategies). DDP keeps the original parameters
(``test_ddp_backend``), FSDP2 shards them as they are, with no views
(``test_fsdp2_backend``): the suites here that are about views leave both out."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from tests import workers as w
from tests.scenarios import (
    BACKEND_CONFIGS,
    BACKENDS,
    FLAT_BACKENDS,
    FLAT_CONFIGS,
    HYBRID_SHARD_SIZE,
    BackendConfig,
    Scenario,
    backend_param,
    check_equivalent,
    make_net,
)

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

TIMEOUT = 60.0
TIED = Scenario(inner=(5, 3, 4), norms=(True, False, True), tie=True)


def _views_params() -> list[Any]:
    # Nested and unnested at world sizes 2 and 3 alternate over the backends; the other
    # combinations (and world sizes 1 and 4) run in the thorough profile.
    params = []
    # Hybrid layouts run on 4 ranks only (their scenario would run any other world size
    # there too, under the wrong name).
    for index, config in enumerate(FLAT_CONFIGS):
        for ws in config.world_sizes:
            for nested in (False, True):
                quick = ws == 2 + (index + nested) % 2
                params.append(backend_param(config, ws, nested, slow=not quick))
    return params


@pytest.mark.parametrize(("backend", "world_size", "nested"), _views_params())
def test_views_replace_original_parameters(
    dist_pool: PoolFactory, backend: BackendConfig, world_size: int, nested: bool
) -> None:
    scenario = backend.scenario(TIED, world_size=world_size, nested=nested)
    results = dist_pool(scenario.world_size).run(w.describe_views, scenario, timeout=TIMEOUT)
    reference = list(make_net(scenario).named_parameters())
    sharded = world_size > 1 and not backend.replicated
    for rank, seen in enumerate(results):
        assert seen["names"] == [n for n, _ in reference], rank
        assert seen["leaf_params"] and seen["submodule_is_views"] and seen["forwarded_same"]
        assert seen["model_params_are_views"], "model.parameters() must give views, never flats"
        assert seen["flats_hidden"] and seen["alias_a_shard"], rank
        assert seen["tied_same_object"] is True
        if not sharded:
            assert set(seen["kinds"].values()) == {"full"}, rank
        assert "misshapen" not in seen["kinds"].values(), seen["kinds"]
    total = sum(p.numel() for _, p in reference)
    if not sharded:
        assert all(seen["numel_here"] == total for seen in results)
        return
    # Under hybrid sharding each shard group (consecutive ranks) holds the model once,
    # and its replicas hold the same pieces.
    size = HYBRID_SHARD_SIZE if backend.hybrid else world_size
    groups = [results[first : first + size] for first in range(0, len(results), size)]
    for group in groups:
        assert [seen["kinds"] for seen in group] == [seen["kinds"] for seen in groups[0]]
        # Every element lives on exactly one rank of the group: each parameter is full on
        # one rank, or split into partial pieces.
        assert sum(seen["numel_here"] for seen in group) == total
        for name, _ in reference:
            kinds = [seen["kinds"][name] for seen in group]
            assert kinds.count("full") == 1 or ("partial" in kinds and "full" not in kinds), name
    assert any(seen["kinds"][n] != "full" for seen in results for n, _ in reference), (
        "no partial or empty view: the scenario does not exercise sharding"
    )


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("backend", FLAT_BACKENDS)
def test_views_alias_the_shard_across_operations(
    dist_pool: PoolFactory, backend: BackendConfig, nested: bool
) -> None:
    scenario = backend.scenario(nested=nested, classes=2, width=3)
    results = dist_pool(scenario.world_size).run(
        w.alias_after_operations, scenario, timeout=TIMEOUT
    )
    for rank, result in enumerate(results):
        assert all(result.values()), (rank, result)
    assert "writes_reach_full_state" in results[0]  # rank 0 compared full states


@pytest.mark.parametrize("backend", FLAT_BACKENDS)
def test_state_dict_is_unchanged_and_loads(dist_pool: PoolFactory, backend: BackendConfig) -> None:
    results = dist_pool(backend.ranks(2)).run(
        w.state_dict_with_and_without, backend.scenario(), timeout=TIMEOUT
    )
    names = sorted(n for n, _ in make_net(Scenario()).named_parameters())
    for result in results:
        assert result["keys"] == names
        assert result["same"] and result["loaded"], result
        assert result["views_loaded"] and result["views_intact"], result


# Low-precision compute (parameters gathered in 16 bits) with full-precision shards.
LOW_PRECISION_PARAMS = {
    "fairscale": {"mixed_precision": True},
    "torch": {"mixed_precision": ("bfloat16", "bfloat16")},
}


@pytest.mark.parametrize("backend", FLAT_BACKENDS)
def test_mixed_precision_views_alias_fp32_master(
    dist_pool: PoolFactory, backend: BackendConfig
) -> None:
    scenario = backend.scenario(options=LOW_PRECISION_PARAMS[backend.backend], skips=((1,),))
    for result in dist_pool(scenario.world_size).run(
        w.mixed_precision_run, scenario, timeout=TIMEOUT
    ):
        assert result["dtypes"] == {"torch.float32"} and result["grad_dtypes"] <= {"torch.float32"}
        assert result["changed"], "the step must train something"
        assert all(not n.startswith("body.1.") for n in result["changed"])


@pytest.mark.parametrize("backend", FLAT_BACKENDS)
def test_optimizer_holding_view_and_flat_is_refused(
    dist_pool: PoolFactory, backend: BackendConfig
) -> None:
    err = dist_pool(backend.ranks(2)).run_expecting_error(
        w.double_count, backend.scenario(TIED), match="holds the flat parameter", timeout=TIMEOUT
    )
    assert set(err.exc_types.values()) == {"flatview.errors.DoubleCountError"}


BAD_WRAPS = {
    "twice": (
        w.wrap_twice,
        {"fairscale": "already wrapped", "torch": "already wrapped", "ddp": "already wrapped"},
    ),
    "not-fsdp": (
        w.wrap_not_fsdp,
        {
            "fairscale": "expects the outermost",
            "torch": "expects the outermost",
            "ddp": "expects the outermost",
        },
    ),
    "inner-after-outer": (
        w.wrap_inner_after_outer,
        {"fairscale": "nested FSDP unit", "torch": "nested FSDP unit", "ddp": "got tests"},
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_WRAPS))
# FSDP2 left out: its wrap refusals (and what it takes for a unit) are
# tests/test_fsdp2_backend.py's.
@pytest.mark.parametrize(
    "backend", [backend_param(c) for c in BACKEND_CONFIGS if c.backend != "fsdp2"]
)
def test_bad_wrap_inputs(dist_pool: PoolFactory, backend: BackendConfig, case: str) -> None:
    fn, match = BAD_WRAPS[case]
    # One rank, except hybrid layouts (shard 2 x replicate 2: four).
    scenario = backend.scenario(world_size=1)
    err = dist_pool(scenario.world_size).run_expecting_error(
        fn, scenario, match=match[backend.backend], timeout=TIMEOUT
    )
    assert set(err.exc_types.values()) == {"flatview.errors.WrapError"}


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_without_backward_then_zero_grad(
    dist_pool: PoolFactory, backend: BackendConfig, set_to_none: bool
) -> None:
    """After each step a validation loss computed with autograd on (a forward whose graph
    is dropped), zero_grad, and a forward under no_grad inside a step: no stale gradient
    survives, and training matches the reference. Block 0 is skipped in one step and
    runs again in the next."""
    scenario = backend.scenario(
        skips=((), (0,), (), (1,), ()), set_to_none=set_to_none, evaluate=True
    )
    check_equivalent(dist_pool, scenario, timeout=TIMEOUT)
