"""What users of real training scripts call on a wrapped model, against the unwrapped
model trained alike in one process (workers in :mod:`tests.user_workers`).

* Forwards inside ``summon_full_params`` (evaluation, ``model.module.generate``): the
  user's module and the FSDP root, on torch FSDP1 (every strategy, ``use_orig_params``
  both ways) and fairscale, nested units included, between a backward and its optimizer
  step; equal to the unwrapped model's outputs, training exact afterwards. (Bare FSDP
  fails at the summoning's exit there, or with ``use_orig_params=True`` trains on from
  stale shards; a forward that reaches no unit worked already.)
* Whole-parameter facts (``shape_of``, ``numel``, ``repr``); timm's ``p.ndim <= 1``
  grouping on views is warned at the first step and refused by ``check_param_groups``;
  ``flatview.optim.param_groups`` trains as timm's rule on the unwrapped model.
* ``clip_grad_norm_``: torch's total norm of the unwrapped model, one all-reduce.
* Parametrizations registered on views after wrapping: refused at the next forward.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import pytest
import torch

from flatview.optimizer_checks import hyperparameters as _hyperparameters
from tests import user_workers as w
from tests.scenarios import (
    DDP,
    FAIRSCALE,
    FSDP2,
    GATED,
    TORCH_NO_SHARD_RUNTIME,
    BackendConfig,
    Scenario,
    compare,
    torch_backend_tested,
)

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

TIMEOUT = 120.0
FULL_SHARD = BackendConfig("torch", "FULL_SHARD")
SHARDED = (
    FAIRSCALE,
    FULL_SHARD,
    BackendConfig("torch", "SHARD_GRAD_OP"),
    BackendConfig("torch", "NO_SHARD"),
    TORCH_NO_SHARD_RUNTIME,
)
BASE = Scenario(width=5, inner=(6, 4), norms=(True, False), skips=((), (1,), (0,)))
ORIG = {"use_orig_params": True}
GATED_FIELDS = {
    field: getattr(GATED, field) for field in ("width", "inner", "norms", "gates", "aux", "skips")
}
"""The fields of the skip-set scenario that make a case of it (gates, aux, skips)."""


def case(config: BackendConfig, *, slow: bool = False, **fields: Any) -> Any:
    """A ``pytest.param`` of ``BASE`` on ``config``, skipped where it cannot run
    (``slow``: thorough profile only)."""
    scenario = config.scenario(BASE, **fields)
    orig = "-orig" if scenario.options.get("use_orig_params") else ""
    skip = pytest.mark.skipif(
        config.backend == "torch" and not torch_backend_tested(),
        reason="flatview's torch backend refuses this torch version",
    )
    marks = [skip, pytest.mark.slow] if slow else [skip]
    return pytest.param(scenario, marks=marks, id=f"{config}{orig}")


def configs(*chosen: BackendConfig, orig: bool = True) -> list[Any]:
    """A case per configuration, plus torch FULL_SHARD with use_orig_params."""
    return [case(c) for c in chosen] + ([case(FULL_SHARD, options=ORIG)] if orig else [])


@pytest.mark.parametrize("scenario", configs(*SHARDED))
def test_forward_inside_summon_full_params(dist_pool: PoolFactory, scenario: Scenario) -> None:
    results = dist_pool(2).run(w.summon_forward_task, scenario, timeout=TIMEOUT)
    for rank, got in enumerate(results):
        # The backward of a forward inside the summoning is refused, every step.
        assert len(got["errors"]) == 3, rank
        assert all("summon_full_params" in e for e in got["errors"]), rank
        assert "recurse=True" in got["not_summoned"], rank
    compare(results[0]["params"], results[0]["reference"])


@pytest.mark.parametrize(
    "scenario",
    [
        *(case(c, **GATED_FIELDS) for c in (FAIRSCALE, FULL_SHARD, FSDP2, DDP)),
        *(case(c, slow=True, **GATED_FIELDS) for c in SHARDED[2:]),
    ],
)
def test_two_forwards_then_one_backward(dist_pool: PoolFactory, scenario: Scenario) -> None:
    """The contrastive pattern: two forwards of the root (two views of each sample),
    then one backward through both losses, inside one ``fv.step``, skip sets varying
    per step: trains as the unwrapped model."""
    results = dist_pool(2).run(w.contrastive_task, scenario, timeout=TIMEOUT)
    compare(results[0]["params"], results[0]["reference"])


@pytest.mark.parametrize("scenario", configs(FAIRSCALE, FULL_SHARD))
def test_shape_based_param_groups(dist_pool: PoolFactory, scenario: Scenario) -> None:
    results = dist_pool(2).run(w.groups_task, scenario, timeout=TIMEOUT)
    pieces = [name for got in results for name in got["pieces"]]
    assert pieces, "the scenario must cut some matrix between ranks"
    for rank, got in enumerate(results):
        assert got["shapes"] and got["shapes_by_name"], rank
        assert got["numel"][0] == got["numel"][1] and got["trainable"] == got["numel"][1]
        assert got["numel_one"][0] == got["numel_one"][1]
        assert f"numel={got['numel'][1]}" in got["repr"]
        assert "not an original parameter" in got["unknown"]
        # Exact check: every rank refuses timm's rule, naming the matrices it decides
        # differently for (empty views count as 1-D too); with use_orig_params every
        # piece is 1-D, and every matrix lands with the biases on every rank.
        check = got["timm_check"]
        if scenario.options.get("use_orig_params"):
            assert "groups every matrix like the biases" in check, rank
            assert any(name in check for name in pieces), rank
        else:
            assert "different hyperparameters on different ranks" in check, rank
            assert ".weight (rank 0: weight_decay=" in check, rank
        # The first-step warning: once per optimizer, where this rank holds a piece.
        warned = got["timm_warnings"]
        assert len(warned) == (1 if got["pieces"] else 0), (rank, warned)
        if warned:
            assert repr(got["pieces"][0]) in warned[0]
        assert got["fixed_warnings"] == [] and got["by_name_warnings"] == [], rank
        no_decay, decay = got["groups"]
        assert "head.weight" in decay and "head.bias" in no_decay
        assert "body.0.norm.weight" in no_decay
    compare(results[0]["params"], results[0]["reference"])


@pytest.mark.parametrize("scenario", [*configs(*SHARDED), case(DDP)])
def test_clip_grad_norm_is_global(dist_pool: PoolFactory, scenario: Scenario) -> None:
    results = dist_pool(2).run(w.clip_task, scenario, timeout=TIMEOUT)
    for rank, got in enumerate(results):
        assert got["all_reduces"] == [{"all_reduce": 1}] * 3, rank
        assert len(got["bad"]) == 2, rank
        for total, want in zip(got["totals"], got["reference_totals"], strict=True):
            assert math.isclose(total, want, rel_tol=1e-4), (rank, total, want)
    compare(results[0]["params"], results[0]["reference"])


@pytest.mark.parametrize(
    "scenario",
    configs(FAIRSCALE, FULL_SHARD, BackendConfig("torch", "NO_SHARD"), TORCH_NO_SHARD_RUNTIME),
)
def test_parametrization_after_wrap_is_refused(dist_pool: PoolFactory, scenario: Scenario) -> None:
    results = dist_pool(2).run(w.parametrization_task, scenario, timeout=TIMEOUT)
    for rank, got in enumerate(results):
        assert "parametrization" in got["error"] and "'stem'" in got["error"], rank
        assert "before FSDP" in got["error"], rank
    compare(results[0]["params"], results[0]["reference"])


def test_timm_rule_by_original_shape_needs_no_distribution() -> None:
    """The helper's rule is timm's, applied to original shapes (here the plain model)."""
    net = w.make_net(replace(BASE, world_size=1))
    timm = w.timm_param_groups(net.named_parameters(), 0.1)
    names = {id(p): n for n, p in net.named_parameters()}
    assert [sorted(names[id(p)] for p in g["params"]) for g in timm][1] == sorted(
        n for n, p in net.named_parameters() if p.ndim > 1
    )
    assert _hyperparameters({"params": [], "lr": torch.tensor(0.1)}) != _hyperparameters(
        {"params": [], "lr": torch.tensor(0.2)}
    )
