"""Views: what a user sees and can do after ``flatview.wrap`` (issue: views over FSDP)."""

from __future__ import annotations

from typing import Any

import pytest

from tests import fairscale_workers as w
from tests.scenarios import Scenario, compare, make_net, run_reference

NESTED = Scenario(world_size=2, inner=(5, 3, 4), norms=(True, False, True), tie=True)


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("nested", [False, True])
def test_views_replace_original_parameters(dist_pool: Any, world_size: int, nested: bool) -> None:
    scenario = Scenario(
        world_size=world_size, inner=(5, 3, 4), norms=(True, False, True), nested=nested, tie=True
    )
    results = dist_pool(world_size).run(w.describe_views, scenario)
    reference = list(make_net(scenario).named_parameters())
    for rank, seen in enumerate(results):
        assert seen["names"] == [n for n, _ in reference], rank
        assert seen["leaf_params"] and seen["submodule_is_views"] and seen["forwarded_same"]
        assert seen["model_params_are_views"], "model.parameters() must give views, never flats"
        assert seen["tied_same_object"] is True
        for name, param in reference:
            shape = seen["shapes"][name]
            # full (original shape), partial (1-D) or empty
            assert shape == tuple(param.shape) or len(shape) == 1, (name, shape)
    # Every element lives on exactly one rank.
    total = sum(p.numel() for _, p in reference)
    assert sum(seen["numel_here"] for seen in results) == total
    if world_size > 1:
        assert any(seen["shapes"][n] != tuple(p.shape) for seen in results for n, p in reference), (
            "no partial or empty view: the scenario does not exercise sharding"
        )


@pytest.mark.parametrize("nested", [False, True])
def test_views_alias_the_shard_across_operations(dist_pool: Any, nested: bool) -> None:
    scenario = Scenario(world_size=2, nested=nested, classes=2, width=3)
    for rank, result in enumerate(dist_pool(2).run(w.alias_after_operations, scenario)):
        assert all(result.values()), (rank, result)


@pytest.mark.parametrize(
    "options",
    [{}, {"reshard_after_forward": False}, {"mixed_precision": True}],
    ids=["default", "no-reshard", "mixed-precision"],
)
def test_state_dict_is_unchanged_and_loads(dist_pool: Any, options: dict[str, Any]) -> None:
    scenario = Scenario(world_size=2, options=options)
    for result in dist_pool(2).run(w.state_dict_with_and_without, scenario):
        assert result["same"] and result["loaded"] and result["views_intact"], result


def test_mixed_precision_views_alias_fp32_master(dist_pool: Any) -> None:
    scenario = Scenario(world_size=2, options={"mixed_precision": True}, skips=((1,),))
    for result in dist_pool(2).run(w.mixed_precision_run, scenario):
        assert result["dtypes"] == {"torch.float32"} and result["grad_dtypes"] <= {"torch.float32"}
        assert all(not n.startswith("body.1.") for n in result["changed"])


def test_optimizer_holding_view_and_flat_is_refused(dist_pool: Any) -> None:
    err = dist_pool(2).run_expecting_error(w.double_count, NESTED, match="holds the flat parameter")
    assert set(err.errors) == {0, 1}


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (w.wrap_twice, "already wrapped"),
        (w.wrap_not_fsdp, "expects the outermost"),
        (w.wrap_inner_after_outer, "already wrapped"),
    ],
)
def test_bad_wrap_inputs(dist_pool: Any, fn: Any, match: str) -> None:
    dist_pool(1).run_expecting_error(fn, Scenario(world_size=1), match=match)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_forward_without_backward_then_zero_grad(dist_pool: Any, set_to_none: bool) -> None:
    scenario = Scenario(world_size=2, skips=((), (1,), ()), set_to_none=set_to_none)
    compare(dist_pool(2).run(w.abandoned_forward_then_zero, scenario)[0], run_reference(scenario))
