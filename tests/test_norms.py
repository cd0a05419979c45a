"""Per-parameter norms over views equal the norms of the whole parameters.

``FlatView.param_norms`` / ``grad_norms`` / ``tensor_norms`` are compared with
``torch.linalg.vector_norm`` of the unwrapped model's parameters and gradients, trained
alike in one process: on every backend configuration, world sizes 1 to 4, shapes that
put shard boundaries inside parameters, skip sets (skipped parameters have no gradient:
``None``), frozen parameters, gradient accumulation. Each call is one all-reduce. LARC
over views trains exactly as apex's LARC on the unwrapped model. Bad arguments raise
before any collective; ranks that disagree all raise instead of hanging.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch
from hypothesis import event
from hypothesis import strategies as st

from flatview.errors import NormError
from flatview.layout import FlatLayout, Placement
from flatview.norms import check_norm_type, local_elements
from tests import norm_workers as w
from tests.scenarios import (
    BACKEND_CONFIGS,
    BACKENDS,
    FAIRSCALE,
    FSDP2,
    FSDP2_HSDP,
    GATED,
    HYBRID_CONFIGS,
    WRAPPER_OPTIONS,
    BackendConfig,
    Scenario,
    Test,
    backend_param,
    compare,
    draws_per_backend,
    scenarios,
    wrapper_options,
)

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

TIMEOUT = 120.0
NORM_TYPES = (2.0, math.inf, 1.5)


def exchange(scenario: Scenario, calls: int = 1) -> dict[str, int]:
    """The collectives of ``calls`` norm calls: each one all-reduce and nothing else;
    under hybrid sharding two: the values within the shard group, the refusal flags over
    every rank (replicas included: a refusal on one shard group must stop the others)."""
    hybrid = scenario.config.hybrid or "hsdp" in scenario.options
    return {"all_reduce": (2 if hybrid else 1) * calls}


def assert_norms_equal(got: w.Norms, want: w.Norms, label: str, rtol: float = 1e-3) -> None:
    assert list(got) == list(want), label
    for name, value in want.items():
        if value is None:
            assert got[name] is None, f"{label}: {name}"
        else:
            assert got[name] is not None, f"{label}: {name} has no norm"
            np.testing.assert_allclose(got[name], value, rtol=rtol, atol=1e-5, err_msg=name)


def check_training(dist_pool: PoolFactory, scenario: Scenario) -> None:
    """flatview's norms during training: against the single-process reference where
    nothing (then not much) has amplified the rounding of a different reduction order,
    and at every step against the same norms computed the slow way from this run's
    pieces.

    With one sample per rank, AdamW turns that rounding into differences each step
    multiplies: drawn scenarios (3 ranks, width 2) were off by 2e-7, 2e-5 and 8e-3
    relative after 0, 1 and 2 steps on fairscale, torch FULL_SHARD and NO_SHARD alike
    (6e-2 on DDP, whose buckets place elements elsewhere): a training run that is
    right drifts from the reference as any two runs with different reduction orders do.
    The run's own pieces have no such drift; a wrong average, a dropped or misplaced
    piece are off by far more."""
    results = dist_pool(scenario.world_size).run(
        w.norms_while_training, scenario, NORM_TYPES, timeout=TIMEOUT
    )
    reference = w.reference_norms_while_training(scenario, NORM_TYPES)
    expected = exchange(scenario)
    for rank, (records, calls, _) in enumerate(results):
        assert records == results[0][0], rank
        assert all(c == expected for c in calls), (rank, calls)
    records, _, slow = results[0]
    assert len(records) == len(reference) == len(slow)
    for step, (got, want, own) in enumerate(zip(records, reference, slow, strict=True)):
        assert got.keys() == want.keys() == own.keys()
        for key in want:
            label = f"step {step}, {key}"
            assert_norms_equal(got[key], own[key], f"{label}, this run", rtol=1e-4)
            if step < 2:
                assert_norms_equal(got[key], want[key], f"{label}, reference")
            else:  # which parameters have a norm (skipped ones' gradients have none)
                assert [n for n, v in got[key].items() if v is None] == [
                    n for n, v in want[key].items() if v is None
                ], label


# --------------------------------------------------------------- equivalence


@draws_per_backend(share=4)
def test_norms_match_single_process_reference(
    dist_pool: PoolFactory, backend: BackendConfig, data: st.DataObject
) -> None:
    scenario = data.draw(scenarios(configs=(backend,)), label="scenario")
    # Norms are taken before each optimizer step; evaluation passes do not matter here.
    scenario = replace(scenario, evaluate=False)
    event(f"{scenario.world_size} rank(s)")
    check_training(dist_pool, scenario)


# The wrapper options where parameters live elsewhere than in flatview's views:
# fairscale's unflattened parameters (sharded one by one, padded), torch's own
# views (use_orig_params=True: None gradients on ranks holding no element).
ELSEWHERE = ("unflattened", "use-orig-params")


def _option_params() -> list[Any]:
    # Quick: fairscale on 4 ranks, torch FULL_SHARD on 3.
    return [
        backend_param(
            config,
            option,
            (4, 3, 2, 3, 2)[index] if index < 5 else config.world_sizes[-1],
            slow=config.backend == "torch" and config.strategy != "FULL_SHARD",
        )
        for index, config, _, option in wrapper_options(ELSEWHERE)
    ]


@pytest.mark.parametrize(("backend", "option", "world_size"), _option_params())
def test_wrapper_options(
    dist_pool: PoolFactory, backend: BackendConfig, option: str, world_size: int
) -> None:
    scenario = backend.scenario(
        GATED,
        world_size=world_size,
        skips=GATED.skips[:3],
        set_to_none=False,
        options=WRAPPER_OPTIONS[backend.backend][option],
    )
    check_training(dist_pool, scenario)


# Quick: fairscale, and torch NO_SHARD (replicated: nothing to combine across ranks).
QUICK_PAIR = [
    backend_param(c, slow=c.backend == "torch" and not c.replicated) for c in BACKEND_CONFIGS
]


@pytest.mark.parametrize(
    ("backend", "world_size"),
    # Quick: fairscale on 3 ranks, and one rank (torch then replicates: NO_SHARD).
    [
        backend_param(c, 1 if c.replicated else 3, slow=c.backend == "torch" and not c.replicated)
        for c in BACKEND_CONFIGS
    ],
)
def test_groups_optimizer_state_and_trust_ratios(
    dist_pool: PoolFactory, backend: BackendConfig, world_size: int
) -> None:
    """Norms of a parameter group given as views and names in any order (model order
    back), of Adam's ``exp_avg`` (``tensor_norms``), and LARC trust ratios."""
    skips = ((), (1, "body.0.gate", "aux"))
    scenario = backend.scenario(GATED, world_size=world_size, skips=skips)
    results = dist_pool(scenario.world_size).run(w.subsets_and_tensors, scenario, timeout=TIMEOUT)
    want = w.reference_state_norms(scenario)
    for rank, got in enumerate(results):
        assert all(c == exchange(scenario) for c in got["calls"]), (rank, got["calls"])
        assert list(got["group"]) == ["stem.weight", "head.weight", "head.bias"]
        assert_norms_equal(got["group"], want["group"], "group")
        # exp_avg: the pieces assembled by hand, and what a whole-model Adam holds.
        assert_norms_equal(got["exp_avg"], got["exp_avg_full"], "exp_avg (gathered)")
        assert_norms_equal(got["exp_avg"], want["exp_avg"], "exp_avg")
        assert_norms_equal(got["trust"], want["trust"], "trust ratios")
    assert any(v is None for v in want["trust"].values())  # the skip set shows


# ------------------------------------------------------------------------- LARC


@pytest.mark.parametrize(
    ("backend", "world_size"),
    [
        backend_param(c, ws, slow=(c, ws) not in ((FAIRSCALE, 3), (BACKEND_CONFIGS[1], 2)))
        for c in BACKEND_CONFIGS
        for ws in (2, 3)
    ],
)
def test_larc_trains_like_apex_larc_in_one_process(
    dist_pool: PoolFactory, backend: BackendConfig, world_size: int
) -> None:
    scenario = backend.scenario(GATED, world_size=world_size)
    params, calls = dist_pool(scenario.world_size).run(w.larc_training, scenario, timeout=TIMEOUT)[
        0
    ]
    # One all-reduce per step for every norm of every group; the optimizer adds none.
    assert calls == [exchange(scenario)] * len(GATED.skips)
    compare(params, w.reference_larc_training(scenario))


def test_larc_is_not_plain_sgd() -> None:
    """The reference LARC changes training, so the comparison above can fail."""
    scenario = FAIRSCALE.scenario(GATED)
    larc = w.reference_larc_training(scenario)
    sgd = w.reference_larc_training(scenario, larc=False)
    assert not all(np.allclose(larc[n], sgd[n]) for n in sgd)


@pytest.mark.parametrize(
    ("backend", "world_size"),
    [backend_param(c, 3, slow=c.backend == "torch" and not c.replicated) for c in BACKEND_CONFIGS],
)
def test_lamb_recipe_trains_like_lamb_in_one_process(
    dist_pool: PoolFactory, backend: BackendConfig, world_size: int
) -> None:
    """The LAMB recipe: trust ratios ``||w|| / ||update||`` with ``tensor_norms``."""
    scenario = backend.scenario(GATED, world_size=world_size)
    params, calls = dist_pool(scenario.world_size).run(w.lamb_training, scenario, timeout=TIMEOUT)[
        0
    ]
    # Two norm calls a step: the parameters', the updates'.
    assert calls == [exchange(scenario, calls=2)] * len(GATED.skips)
    compare(params, w.reference_lamb_training(scenario))


# ----------------------------------------------------------------------- errors


def each_misuse(argname: str, patterns: dict[str, str]) -> Callable[[Test], Test]:
    """Parametrize a test over the misuses in ``patterns`` (passed as ``argname``) and
    over fairscale and torch FULL_SHARD (and, thorough only, FSDP2, FSDP2 HSDP and torch
    HYBRID_SHARD, where a refusal in one shard group must stop the other too), with time
    for every rank to raise."""

    def mark(test: Test) -> Test:
        configs = [backend_param(FAIRSCALE), BACKENDS[1]]
        configs += [backend_param(c) for c in (FSDP2, FSDP2_HSDP, HYBRID_CONFIGS[0])]
        test = pytest.mark.parametrize("backend", configs)(test)
        test = pytest.mark.parametrize(argname, list(patterns))(test)
        return pytest.mark.timeout(150)(test)

    return mark


BAD_ARGUMENTS = {
    "name": r"NormError: params names 'body\.9\.up\.weight', which is not",
    "typo": r"NormError: params names 'head\.wieght'.*did you mean 'head\.weight'",
    "foreign": r"NormError: .*not an original parameter.*Tensor of shape \(3,\)",
    "flat": r"NormError: params holds a flat parameter",
    "grad": r"NormError: params holds the gradient of '[\w.]+'",
    "number": r"NormError: params must hold parameters \(views\) or names, got int",
    "mapping": r"NormError: params must be parameters or names, not a mapping",
    "module": r"NormError: params must be .* not a module \(Linear\); pass module\.param",
    "zero": r"NormError: norm_type must be a positive number or inf, got 0",
    "negative": r"NormError: norm_type must be .*got -2",
    "nan": r"NormError: norm_type must be .*got nan",
    "text": r"NormError: norm_type must be .*got 'fro'",
    "tensors": r"NormError: tensors must map parameters",
}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", QUICK_PAIR)
def test_bad_arguments_raise_before_any_collective(
    dist_pool: PoolFactory, backend: BackendConfig
) -> None:
    scenario = backend.scenario(GATED)
    results = dist_pool(scenario.world_size).run(w.bad_arguments, scenario, timeout=TIMEOUT)
    assert all(r == results[0] for r in results)
    for kind, pattern in BAD_ARGUMENTS.items():
        if kind == "flat" and not backend.flattens:
            continue  # DDP and FSDP2 flatten nothing: there is no flat parameter to pass
        assert results[0][kind] != "accepted", kind
        assert re.search(pattern, results[0][kind]), (kind, results[0][kind])
        # Only the call's own exchange, which tells a rank whose arguments were fine
        # (none here) that another refused its own. Every rank joins all of it, refusing
        # or not, in the same order (under hybrid sharding: the flags over the world,
        # then the values within the shard group), so none waits on another.
        message = results[0][kind]
        assert "after collectives" not in message or message.endswith(
            f"after collectives {exchange(scenario)}"
        ), (kind, message)


WRONG_PHASE = {
    "forward": r"StateError: FlatView\.param_norms\(\) needs phase IDLE, the model is COMPUTING",
    "no_sync": r"StateError: FlatView\.grad_norms\(\) inside an accumulation window \(no_sync\(\)",
    "unwrapped": r"StateError: .*the model is DETACHED: flatview was unwrapped",
}


@each_misuse("where", WRONG_PHASE)
def test_wrong_phase(dist_pool: PoolFactory, backend: BackendConfig, where: str) -> None:
    dist_pool(backend.ranks(2)).run_expecting_error(
        w.wrong_phase, backend.scenario(GATED), where, match=WRONG_PHASE[where], timeout=TIMEOUT
    )


DISAGREEING = {
    "params": r"NormError: ranks asked for the norms of different parameters: .*'body\.",
    "subset": r"NormError: ranks asked for .* different parameters: 'stem\.bias', 'body\.0",
    "norm_type": r"NormError: ranks asked for different norms in the same call",
    "inf": r"NormError: ranks asked for different norms in the same call",
    "kind": r"NormError: ranks asked for different norms .*(param|grad) norms",
    "tensor_size": r"NormError: on some rank the tensor given for 'stem\.weight'",
}


@each_misuse("how", DISAGREEING)
def test_disagreeing_ranks_all_raise(
    dist_pool: PoolFactory, backend: BackendConfig, how: str
) -> None:
    """Every rank raises the same error after the one collective; none hangs."""
    scenario = backend.scenario(GATED, world_size=3)
    err = dist_pool(backend.ranks(3)).run_expecting_error(
        w.disagreeing_ranks, scenario, how, match=DISAGREEING[how], timeout=TIMEOUT
    )
    assert not err.unfinished


# ------------------------------------------------------------------ pure parts


def test_local_elements() -> None:
    # Rank 2 of 3 holds elements [8, 10) of a 10-element parameter that fairscale
    # shards unflattened: its shard has 4 elements, the last 2 padding.
    layout = FlatLayout.packed([(2, 5)], 3)
    home = Placement("p", (2, 5), layout, 0, 2, padded_shard=True)
    assert (home.local_numel, home.local_interval, home.param_interval) == (4, (0, 2), (8, 10))
    assert local_elements(home, torch.arange(4.0)).tolist() == [0.0, 1.0]
    # A sharded parameter shown whole (torch's views, for a while): this rank's part.
    assert local_elements(home, torch.arange(10.0).view(2, 5)).tolist() == [8.0, 9.0]
    assert local_elements(home, torch.zeros(5)) is None
    replicated = Placement("q", (2, 3))
    assert local_elements(replicated, torch.ones(2, 3)).tolist() == [1.0] * 6
    assert local_elements(replicated, torch.zeros(10)) is None


def test_norm_types() -> None:
    assert check_norm_type(2) == 2.0
    assert check_norm_type("inf") == math.inf
    assert check_norm_type(torch.tensor(1.5)) == 1.5
    for bad in (0, -1, math.nan, "fro", None, -math.inf):
        with pytest.raises(NormError, match="norm_type must be"):
            check_norm_type(bad)
