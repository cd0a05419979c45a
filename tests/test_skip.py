"""Skip sets: no gradient and no communication for the parameters a step does not use."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from torch import nn

from tests import fairscale_workers as w
from tests.scenarios import Scenario, batch, compare, make_net, run_reference

# Blocks of different sizes so skipped spans fall unevenly across shards.
SC = Scenario(world_size=2, width=4, inner=(6, 2, 5, 3), norms=(True, False, True, False))


def _numel(prefix: str) -> int:
    return sum(p.numel() for n, p in make_net(SC).named_parameters() if n.startswith(prefix))


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("strategy", ["all_to_all", "reduce_scatter", "auto"])
def test_reduced_bytes_track_used_parameters(dist_pool: Any, nested: bool, strategy: str) -> None:
    scenario = Scenario(**{**SC.__dict__, "nested": nested})
    skip = (0, 2)
    results = dist_pool(2).run(w.count_step, scenario, skip, strategy)
    total = sum(p.numel() for p in make_net(scenario).parameters())
    used = total - _numel("body.0.") - _numel("body.2.")
    for r in results:
        # Measured at the collectives: reduction inputs are the used gradient bytes,
        # exactly for all_to_all, up to reduce-scatter padding otherwise.
        measured = r["bytes"].get("reduce_scatter", 0) + r["bytes"].get("all_to_all", 0)
        assert measured == r["reduced_bytes"], r
        assert r["used_bytes"] == used * 4
        if strategy == "all_to_all":
            assert measured == used * 4
        else:
            assert used * 4 <= measured <= (used + 2 * 16) * 4
        if strategy == "auto":
            assert measured <= 1.05 * used * 4 or r["calls"].get("all_to_all")
        assert r["grads_none"] == sorted(
            n
            for n, _ in make_net(scenario).named_parameters()
            if n.startswith(("body.0.", "body.2."))
        )
        assert r["units_skipped"] == (2 if nested else 0)


def test_skipped_units_are_not_gathered(dist_pool: Any) -> None:
    scenario = Scenario(**{**SC.__dict__, "nested": True})
    full = dist_pool(2).run(w.count_step, scenario, (), "auto")[0]
    skipped = dist_pool(2).run(w.count_step, scenario, (0, 2), "auto")[0]
    gathered = full["bytes"]["all_gather"] - skipped["bytes"]["all_gather"]
    # Each skipped unit would have been gathered for forward and again for backward.
    padded = sum(-(-_numel(f"body.{i}.") // 2) * 2 for i in (0, 2))
    assert gathered == 2 * padded * 4
    assert full["calls"]["all_gather"] - skipped["calls"]["all_gather"] == 4


def test_accumulation_with_different_skip_sets(dist_pool: Any) -> None:
    micro = ((0, 1), (1, 3), (0, 1))  # block 1 skipped everywhere, 0 and 3 once each
    got = dist_pool(2).run(w.accumulate, SC, micro)[0]["grads"]
    net = make_net(SC)
    for step, skip in enumerate(micro):
        x, y = batch(SC, step)
        nn.functional.cross_entropy(net(x, skip), y).backward()
    for name, param in net.named_parameters():
        if param.grad is None:
            assert got[name] is None, name
        else:
            np.testing.assert_allclose(
                got[name], param.grad.reshape(-1).numpy(), rtol=1e-4, atol=1e-6, err_msg=name
            )
    assert got["body.1.up.weight"] is None and got["body.0.up.weight"] is not None


def test_backward_outside_step_is_plain_fsdp(dist_pool: Any) -> None:
    scenario = Scenario(**{**SC.__dict__, "skips": ((), ())})
    compare(dist_pool(2).run(w.backward_outside_step, scenario)[0], run_reference(scenario))


def test_ranks_with_different_skip_sets_fail_everywhere(dist_pool: Any) -> None:
    err = dist_pool(2).run_expecting_error(
        w.mismatched_skips,
        SC,
        match="SkipSetMismatchError.*rank 0 skips.*body.0.*rank 1 skips.*body.1",
        timeout=60,
    )
    assert set(err.errors) == {0, 1}


@pytest.mark.parametrize("nested", [False, True])
def test_skipped_parameter_that_gets_a_gradient(dist_pool: Any, nested: bool) -> None:
    scenario = Scenario(**{**SC.__dict__, "nested": nested})
    match = "unit 'body.0' is declared skipped" if nested else "'body.0.*' is declared skipped"
    dist_pool(2).run_expecting_error(w.skipped_but_used, scenario, match=match, timeout=60)


def test_unit_unused_but_not_declared(dist_pool: Any) -> None:
    scenario = Scenario(**{**SC.__dict__, "nested": True})
    dist_pool(2).run_expecting_error(
        w.undeclared_unused, scenario, match="UndeclaredUnusedError.*'body.0'", timeout=60
    )


@pytest.mark.parametrize(
    ("item", "match"),
    [
        ("name", "'body.9.up.weight'.*did you mean"),
        ("module", "module that is not part of the wrapped model: Linear"),
        ("tensor", "tensor that is neither a view"),
        ("number", "must be modules, parameters or names, got int"),
    ],
)
def test_unknown_skip_items(dist_pool: Any, item: str, match: str) -> None:
    dist_pool(2).run_expecting_error(w.bad_skip_item, SC, item, match=match, timeout=60)


def test_skip_items_resolve_to_original_names(dist_pool: Any) -> None:
    got = dist_pool(2).run(w.resolve_items, SC)[0]
    body0 = [n for n, _ in make_net(SC).named_parameters() if n.startswith("body.0.")]
    assert got["unit"] == body0
    assert got["inner_module"] == ["body.0.up.weight", "body.0.up.bias"]
    assert got["view"] == ["head.bias"]
    assert got["names"] == [*body0, "head.weight"]


def test_partly_skipped_unit_gathers_only_used_segments(dist_pool: Any) -> None:
    """One unit for the whole model: with most of it skipped, the all-gather moves only
    the used segments (padded to the largest rank's part); with little skipped, masking
    would not pay and the unit is gathered whole."""
    scenario = Scenario(**{**SC.__dict__, "nested": False})
    whole = dist_pool(2).run(w.count_step, scenario, (), "auto")[0]
    mostly = dist_pool(2).run(w.count_step, scenario, (0, 2, 3), "auto")[0]
    little = dist_pool(2).run(w.count_step, scenario, (1,), "auto")[0]
    total = sum(p.numel() for p in make_net(scenario).parameters())
    padded = -(-total // 2) * 2
    assert whole["bytes"]["all_gather"] == padded * 4  # root: gathered once, kept for backward
    assert little["bytes"]["all_gather"] == padded * 4
    used = total - sum(_numel(f"body.{i}.") for i in (0, 2, 3))
    assert used * 4 <= mostly["bytes"]["all_gather"] <= 0.6 * padded * 4
    assert mostly["bytes"]["all_gather"] < whole["bytes"]["all_gather"]
