"""``flatview.optim.Whole``: torch's Muon on whole matrices over flat shards equals the
unmodified ``torch.optim.Muon`` on the unwrapped model in one process, moves each
gradient and update element at most once, and consolidates its state by name."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
from hypothesis import strategies as st

from tests import whole_workers as ww
from tests.scenarios import (
    BACKEND_CONFIGS,
    BACKENDS,
    DDP,
    FAIRSCALE,
    FSDP2,
    FSDP2_HSDP,
    GATED,
    HYBRID_SHARD_SIZE,
    BackendConfig,
    Scenario,
    backend_param,
    compare,
    draws_per_backend,
    scenarios,
)

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

TIMEOUT = 120.0
TOLERANCE = 1e-5
BFLOAT16_TOLERANCE = 1e-3
"""For one step of Muon as torch ships it (Newton-Schulz in bfloat16): the last float32
bits of a gradient averaged over ranks now and then move one bfloat16 rounding, and
through the iteration every element of that matrix by up to ~lr / 30 (lr 0.02). Over
several steps such moves add up (6e-4 after 6 steps on 2 ranks, 5e-3 on 4, seen on a
machine whose float32 kernels round otherwise than the one the fixed scenarios were first
run on): every comparison over several steps runs the float32 iteration in both runs. A
wrong whole matrix (a stale copy, a piece, another rank's) is off by ~lr."""


def _hybrid(scenario: Scenario) -> bool:
    return scenario.config.hybrid or "hsdp" in scenario.options


def _check(
    results: list[dict], reference: dict, scenario: Scenario, tolerance: float = TOLERANCE
) -> None:
    world_size = scenario.world_size
    compare(results[0]["params"], reference["params"], tolerance)
    state = results[0]["state"]["state"]
    for name, buffer in reference["momentum"].items():
        np.testing.assert_allclose(
            state[name]["momentum_buffer"].numpy(), buffer, rtol=1e-4, atol=tolerance, err_msg=name
        )
    # Under hybrid sharding each shard group (consecutive ranks) exchanges on its own:
    # the bound holds per group.
    size = HYBRID_SHARD_SIZE if _hybrid(scenario) else world_size
    for step, used in enumerate(results[0]["used"]):
        for first in range(0, world_size, size):
            group = results[first : first + size]
            moved = sum(r["moved"][step].get("all_to_all", 0) for r in group)
            assert moved <= 2 * used, (step, first, moved, used)
        if world_size == 1:
            assert not any(r["moved"][step] for r in results), results[0]["moved"]


@draws_per_backend(share=3)
def test_muon_matches_single_process_reference(
    dist_pool: PoolFactory, backend: BackendConfig, data: st.DataObject
) -> None:
    scenario = data.draw(scenarios(configs=(backend,)), label="scenario")
    # Orthogonalised in float32 in both runs: see whole_workers.float32_newton_schulz.
    # test_muon_as_torch_ships_it runs Muon's own.
    run = ww.MuonRun(
        scenario,
        nesterov=data.draw(st.booleans(), label="nesterov"),
        weight_decay=data.draw(st.sampled_from((0.0, 0.1)), label="weight_decay"),
        float32=True,
        experts=data.draw(st.sampled_from((0, 2, 3)), label="experts"),
        heads=data.draw(st.sampled_from((1, 2, 3)), label="heads"),
        overlap=data.draw(st.booleans(), label="overlap"),
        stacked=data.draw(st.sampled_from((None, True)), label="stacked"),
    )
    results = dist_pool(scenario.world_size).run(ww.distributed, run, timeout=TIMEOUT)
    _check(results, ww.reference(run), scenario)


@pytest.mark.parametrize(
    "backend",
    [backend_param(c, slow=c not in (FAIRSCALE, FSDP2), ci=c == FSDP2) for c in BACKEND_CONFIGS],
)
def test_step_takes_a_closure(dist_pool: PoolFactory, backend: BackendConfig) -> None:
    """``step(closure)``, as Lightning's automatic optimization calls it: the closure's
    forward and backward first, then the step, its loss returned; as the reference."""
    scenario = backend.scenario(GATED, world_size=2)
    run = ww.MuonRun(scenario, float32=True, closure=True)
    results = dist_pool(backend.ranks(2)).run(ww.distributed, run, timeout=TIMEOUT)
    _check(results, ww.reference(run), scenario)


@pytest.mark.parametrize("backend", BACKENDS)
def test_skips_cost_nothing_and_replicas_communicate_nothing(
    dist_pool: PoolFactory, backend: BackendConfig
) -> None:
    scenario = backend.scenario(GATED, world_size=2)
    run = ww.MuonRun(scenario, float32=True, experts=2)
    results = dist_pool(backend.ranks(2)).run(ww.distributed, run, timeout=TIMEOUT)
    _check(results, ww.reference(run), scenario)
    if backend.replicated:
        # Every view full on every rank: the plain optimizer, nothing exchanged.
        for r in results:
            assert not any(m for m in r["moved"]), r["moved"]
    else:
        # Something moved, and every owner got a share of the work (the same costs on
        # every rank: under hybrid sharding each shard group assigns alike).
        assert any(m.get("all_to_all") for r in results for m in r["moved"])
        costs = [r["costs"] for r in results]
        assert min(costs[0]) > 0, costs
        assert all(c == costs[0] for c in costs), costs


@pytest.mark.parametrize("backend", [FAIRSCALE, backend_param(FSDP2), BackendConfig("ddp")])
@pytest.mark.parametrize("stacked", [None, True])
def test_muon_as_torch_ships_it(
    dist_pool: PoolFactory, backend: BackendConfig, stacked: bool | None
) -> None:
    """One step of Muon with its own bfloat16 iteration, unpatched (torch's per matrix
    on the owners, or stacked per shape; torch's per matrix in the reference), with
    expert tensors cut per expert and per head: within :data:`BFLOAT16_TOLERANCE` of
    the reference."""
    scenario = backend.scenario(GATED, world_size=2)
    run = ww.MuonRun(scenario, steps=(0, 1), experts=3, heads=5, stacked=stacked)
    results = dist_pool(2).run(ww.distributed, run, timeout=TIMEOUT)
    _check(results, ww.reference(run), scenario, BFLOAT16_TOLERANCE)


@pytest.mark.parametrize("backend", [FAIRSCALE, backend_param(FSDP2)])
@pytest.mark.parametrize("stacked", [None, False])
def test_default_step_is_torchs_muon_bit_for_bit(
    dist_pool: PoolFactory, backend: BackendConfig, stacked: bool | None
) -> None:
    """By default the owners step ``Muon.step()`` itself: on one rank (the gradients
    are the unwrapped model's, bit for bit) Muon as torch ships it, bfloat16 iteration
    included, gives exactly the reference's parameters. ``stacked=True`` does not here:
    one element of its batched iteration rounds otherwise (6.7e-4 away at the end)."""
    scenario = backend.scenario(GATED, world_size=1)
    run = ww.MuonRun(scenario, experts=2, nesterov=False, stacked=stacked)
    results = dist_pool(1).run(ww.distributed, run, timeout=TIMEOUT)
    _check(results, ww.reference(run), scenario, 0.0)


@pytest.mark.parametrize("world_size", [2, 3])
def test_torch_own_views_are_stepped_in_their_original_shape(
    dist_pool: PoolFactory, world_size: int
) -> None:
    """With ``use_orig_params=True`` torch's views are 1-D even where a rank holds all of
    a matrix: Muon must see the matrix (found by hypothesis: it refused a 1-D view on the
    ranks holding one, while the others went on)."""
    scenario = BackendConfig("torch").scenario(
        GATED, world_size=world_size, options={"use_orig_params": True}
    )
    run = ww.MuonRun(scenario, float32=True)
    results = dist_pool(scenario.world_size).run(ww.distributed, run, timeout=TIMEOUT)
    _check(results, ww.reference(run), run.scenario)


def test_a_rank_holding_nothing_of_a_matrix_costs_nothing(dist_pool: PoolFactory) -> None:
    """Tiny matrices on 3 ranks: some rank holds no element of a split matrix; it must
    not take that for a change (which would resend every value each step)."""
    scenario = FAIRSCALE.scenario(
        Scenario(world_size=3, in_dim=1, width=3, inner=(1, 2), norms=(False, False), classes=2),
        skips=((), ()),
    )
    run = ww.MuonRun(scenario)
    results = dist_pool(3).run(ww.distributed, run, timeout=TIMEOUT)
    _check(results, ww.reference(run), scenario)


@pytest.mark.parametrize("backend", [backend_param(FSDP2)])
def test_fsdp2_matrices_wholly_on_one_rank(dist_pool: PoolFactory, backend: BackendConfig) -> None:
    """One-row matrices on 2 ranks: FSDP2 puts each wholly on rank 0, whose inner Muon
    steps it alone; stepped as the DTensor it communicated on that rank only (a hang),
    as did slicing the DTensor on the rank with nothing to send."""
    scenario = backend.scenario(
        Scenario(world_size=2, in_dim=1, width=1, inner=(1,), norms=(False,), classes=2),
        skips=((), ()),
    )
    run = ww.MuonRun(scenario, float32=True)
    results = dist_pool(2).run(ww.distributed, run, timeout=TIMEOUT)
    _check(results, ww.reference(run), scenario)


@pytest.mark.parametrize("world_size", [2, 3])
def test_writes_outside_the_optimizer_reach_the_owners(
    dist_pool: PoolFactory, world_size: int
) -> None:
    """Halving the matrices through ``.data`` between steps (as a model
    ``load_state_dict`` would overwrite them): owners refresh their whole copies."""
    scenario = FAIRSCALE.scenario(GATED, world_size=world_size)
    run = ww.MuonRun(scenario, halve_after=2, float32=True)
    results = dist_pool(world_size).run(ww.distributed, run, timeout=TIMEOUT)
    _check(results, ww.reference(run), run.scenario)


def test_state_resumes_at_another_world_size(dist_pool: PoolFactory) -> None:
    """Train 2 steps on 2 ranks, consolidate, resume on 3 ranks: the same as 4 steps in
    one process."""
    # The same global batch of 6 on 2 and on 3 ranks.
    base = replace(FAIRSCALE.scenario(GATED, world_size=2), skips=GATED.skips[:4], batch_per_rank=3)
    first = ww.MuonRun(base, steps=(0, 2), float32=True)
    saved = dist_pool(2).run(ww.distributed, first, timeout=TIMEOUT)[0]
    second = ww.MuonRun(replace(base, world_size=3, batch_per_rank=2), steps=(2, 4), float32=True)
    resumed = dist_pool(3).run(
        ww.distributed, second, saved["params"], saved["saved"], timeout=TIMEOUT
    )
    whole = ww.reference(ww.MuonRun(base, steps=(0, 4), float32=True))
    compare(resumed[0]["params"], whole["params"], TOLERANCE)


@pytest.mark.parametrize("world_size", [2, 3])
def test_refusals_name_the_culprit_on_every_rank(dist_pool: PoolFactory, world_size: int) -> None:
    scenario = FAIRSCALE.scenario(Scenario(), world_size=world_size)
    results = dist_pool(scenario.world_size).run(ww.refusals, scenario, timeout=TIMEOUT)
    for messages in results:
        assert len(messages) == 6, messages
        assert "Muon refuses parameter 'stem.bias'" in messages[0]
        assert "not an original parameter" in messages[1]
        assert "LBFGS needs a closure" in messages[2]
        assert "heads=3 for parameter 'stem.weight'" in messages[3]
        assert "heads= names 'nothing.weight'" in messages[4]
        assert "stacked=True orthogonalises as torch.optim.Muon" in messages[5]


CHECKPOINT_SPLIT = 1
"""Saved after the first step of GATED, which skips ``body.1`` (and ``body.2.gate``,
``body.3.gate``, ``aux``): those matrices have had no gradient when the checkpoint is
written, so only eagerly made state describes them alike on every rank."""


def _same_state(got: dict, want: dict) -> None:
    assert got["param_groups"] == want["param_groups"]
    assert sorted(got["state"]) == sorted(want["state"])
    for name, entry in want["state"].items():
        assert sorted(got["state"][name]) == sorted(entry), name
        for key, value in entry.items():
            np.testing.assert_array_equal(
                np.asarray(got["state"][name][key]), np.asarray(value), err_msg=f"{name} {key}"
            )


@pytest.mark.parametrize(
    ("backend", "before", "after", "optimizer", "resume_on"),
    [
        backend_param(FAIRSCALE, 2, 3, "muon", None),
        backend_param(BackendConfig("torch"), 3, 2, "muon", None, slow=True),
        backend_param(FSDP2, 4, 1, "muon", None),
        backend_param(DDP, 2, 4, "muon", None, slow=True),
        backend_param(FAIRSCALE, 2, 4, "adamw", None, slow=True),
        # Hybrid sharding (a 2 x 2 grid) resumed on fairscale at 2 ranks, and back.
        backend_param(BackendConfig("torch", "HYBRID_SHARD"), 4, 2, "muon", FAIRSCALE),
        backend_param(FSDP2_HSDP, 4, 2, "muon", FAIRSCALE),
        backend_param(
            FAIRSCALE, 2, 4, "muon", BackendConfig("torch", "_HYBRID_SHARD_ZERO2"), slow=True
        ),
    ],
)
def test_checkpoint_resumes_at_another_world_size(
    dist_pool: PoolFactory,
    backend: BackendConfig,
    before: int,
    after: int,
    optimizer: str,
    resume_on: BackendConfig | None,
    tmp_path: Path,
) -> None:
    """flatview.checkpoint + DCP, sharded and full, of Whole (Muon over 3-D experts cut
    per expert, or AdamW) and AdamW: saved at one world size (and backend) after a step
    that left some matrices without a gradient, resumed at another, equal to an
    uninterrupted run (the single-process reference); the state loaded is the state
    saved."""

    # The same global batch of 12 at every world size.
    def at(config: BackendConfig, world: int) -> ww.MuonRun:
        scenario = replace(
            config.scenario(GATED, world_size=world),
            skips=GATED.skips[:4],
            batch_per_rank=12 // world,
        )
        return ww.MuonRun(scenario, float32=True, experts=2)

    paths = {False: str(tmp_path / "sharded"), True: str(tmp_path / "full")}
    first = dist_pool(before).run(
        ww.checkpoint_and_train_on,
        at(backend, before),
        paths,
        CHECKPOINT_SPLIT,
        optimizer,
        timeout=TIMEOUT,
    )[0]
    reference = ww.reference(at(backend, before))["params"]
    want = reference if optimizer == "muon" else first["params"]
    # Writing the checkpoint changed nothing (flatview.checkpoint once primed Whole with a
    # learning-rate-0 step, which decayed its momentum).
    compare(first["params"], want, TOLERANCE)
    for full, path in paths.items():
        resumed = dist_pool(after).run(
            ww.resume_from_checkpoint,
            at(resume_on or backend, after),
            path,
            full,
            CHECKPOINT_SPLIT,
            optimizer,
            timeout=TIMEOUT,
        )[0]
        _same_state(resumed["loaded"], first["saved"])
        compare(resumed["params"], want, TOLERANCE)


def test_sharded_checkpoint_refuses_lazy_state(dist_pool: PoolFactory) -> None:
    """Whole over an optimizer whose state flatview cannot make eagerly (SGD): a fresh one
    would have nothing for DCP to load into, so the sharded form is refused on every
    rank, naming the way out."""
    run = ww.MuonRun(FAIRSCALE.scenario(GATED, world_size=2))
    for message in dist_pool(2).run(ww.sharded_refused_for_lazy_state, run, timeout=TIMEOUT):
        assert "makes its state lazily" in message and "full_state_dict=True" in message
