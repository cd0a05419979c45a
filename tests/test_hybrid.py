"""Hybrid sharding: shard within a group, replicate across groups (4 ranks as 2 x 2).

The masked hybrid reduction (:mod:`flatview.comm.hybrid`) against hand-computed sums,
with its bytes measured per group at the collectives; the grid check on torch's own
groups; bare torch FSDP1 hybrid training against the single-process reference (which
shows the harness's hybrid models are right). Then flatview on torch FSDP1
``HYBRID_SHARD`` and ``_HYBRID_SHARD_ZERO2``: the reference equivalence with skip sets,
bytes per group (through ``fv.stats`` and at the collectives), the skip-set check across
replica groups, refused layouts, norms, and optimizer state (``rank0_only`` is global
rank 0; checkpoints move to and from non-hybrid layouts).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flatview.comm.hybrid import REPLICA_ALL_REDUCE, check_grid
from flatview.comm.options import Strategy
from flatview.comm.sharded import choose_strategy
from tests import hybrid_workers as hw
from tests import optim_workers as ow
from tests.scenarios import (
    GATED,
    HYBRID_CONFIGS,
    BackendConfig,
    Scenario,
    backend_param,
    batch,
    check_equivalent,
    compare,
    loss_of,
    make_net,
    scenarios,
)
from tests.test_norms import check_training
from tests.test_optim_state import assert_same_state, check_round_trip

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

TIMEOUT = 120.0
WORLD = 4
HYBRID_SHARD, ZERO2 = HYBRID_CONFIGS
FULL_SHARD = BackendConfig("torch", "FULL_SHARD")

# ------------------------------------------------------------------ the grid check

ROWS, COLUMNS = ([0, 1], [2, 3]), ([0, 2], [1, 3])


def _places(shards: tuple[list[int], ...], replicas: tuple[list[int], ...]) -> list[tuple]:
    world = sum(len(s) for s in shards)
    return [
        (next(s for s in shards if r in s), next(c for c in replicas if r in c))
        for r in range(world)
    ]


@pytest.mark.parametrize(
    ("shards", "replicas", "expected"),
    [
        (ROWS, COLUMNS, (2, 2)),
        (([0, 1, 2, 3],), ([0], [1], [2], [3]), (4, 1)),
        (([0], [1], [2], [3]), ([0, 1, 2, 3],), (1, 4)),
        # Shard groups need not be consecutive ranks.
        (([0, 2], [1, 3]), ([0, 1], [2, 3]), (2, 2)),
    ],
)
def test_check_grid_accepts_grids(
    shards: tuple[list[int], ...], replicas: tuple[list[int], ...], expected: tuple[int, int]
) -> None:
    assert check_grid(_places(shards, replicas)) == expected


def test_check_grid_names_what_breaks_it() -> None:
    # Replica peers 0 and 3 hold different shards (shard ranks 0 and 1).
    with pytest.raises(ValueError, match="replica peers 0 and 3 hold different shards"):
        check_grid(_places(ROWS, ([0, 3], [1, 2])))
    with pytest.raises(ValueError, match="disagree on their shard group"):
        check_grid([([0, 1], [0, 2]), ([1, 0], [1, 3]), ([2, 3], [0, 2]), ([2, 3], [1, 3])])
    # A replica group inside a shard group: its members hold different shards.
    with pytest.raises(ValueError, match="replica peers 0 and 1 hold different shards"):
        check_grid(_places(ROWS, ([0, 1], [2, 3])))
    with pytest.raises(ValueError, match="not in its own replica group"):
        check_grid([([0, 1], [1]), ([0, 1], [1])])
    with pytest.raises(ValueError, match="do not cover"):
        check_grid(_places(([0, 1], [2, 3]), ([0], [1], [2], [3])))


@pytest.mark.parametrize("kind", ["mesh", "tuple"])
def test_torch_groups_form_the_grid(dist_pool: PoolFactory, kind: str) -> None:
    assert dist_pool(WORLD).run(hw.grid_places, kind, timeout=TIMEOUT) == [(2, 2)] * WORLD


# ------------------------------------------------------------------ the reduction


def _expected(number: int, case: hw.Case, rank: int) -> list[np.ndarray]:
    """This rank's shards: every rank's gradient summed, divided, masked, cut."""
    shard_rank = rank % 2
    out = []
    for i, entry in enumerate(case.entries):
        layout = entry.plan(2).layout
        total = sum(hw.case_grad(number, i, r, layout.padded_numel) for r in range(WORLD))
        mask = torch.zeros(layout.padded_numel)
        for segment, used in zip(layout.segments, entry.used, strict=True):
            if used:
                mask[segment.offset : segment.end] = 1
        full = total / (case.predivide * case.postdivide) * mask
        size = layout.shard_numel
        out.append(full[shard_rank * size : (shard_rank + 1) * size].numpy())
    return out


def test_hybrid_reduce_matches_hand_computed_sums(dist_pool: PoolFactory) -> None:
    results = dist_pool(WORLD).run(hw.reduce_cases, "mesh", timeout=TIMEOUT)
    for number, case in enumerate(hw.CASES):
        plans = [e.plan(2) for e in case.entries]
        counts = [sum(p.counts[r] for p in plans) for r in range(2)]
        masked = not all(p.all_used for p in plans)
        chosen = choose_strategy(counts, Strategy(case.strategy), masked)
        if sum(counts) == 0:
            shard_bytes = {}
        elif chosen is Strategy.REDUCE_SCATTER:
            shard_bytes = {"reduce_scatter": 2 * max(counts) * 4}
        else:
            shard_bytes = {"all_to_all": sum(counts) * 4}
        for rank in range(WORLD):
            got = results[rank][number]
            label = f"{case.name} on rank {rank}"
            for shard, want in zip(got["shards"], _expected(number, case, rank), strict=True):
                np.testing.assert_allclose(shard, want, rtol=1e-5, atol=1e-6, err_msg=label)
            assert got["unchanged"], label
            shard_rank = rank % 2
            replica = counts[shard_rank] * 4
            assert got["ledger"] == {
                **shard_bytes,
                **({REPLICA_ALL_REDUCE: replica} if replica else {}),
            }, label
            # Measured at the collectives, per group: the shard group (a row) moved the
            # used elements (padded for a reduce-scatter), the replica group (a column)
            # only those of this rank's shard; nothing used, nothing moved.
            row = (0, 1) if rank < 2 else (2, 3)
            column = (shard_rank, shard_rank + 2)
            expected: dict[tuple[int, ...], dict[str, int]] = {}
            if shard_bytes:
                expected[row] = shard_bytes
            if replica:
                expected[column] = {"all_reduce": replica}
            assert got["groups"] == expected, label
    for rank in range(WORLD):
        assert "shards over 4 ranks, the shard group has 2" in results[rank][-1]["error"]


# ------------------------------------------------------------ bare torch hybrid


@pytest.mark.parametrize(
    ("config", "kind"),
    [backend_param(HYBRID_SHARD, "tuple"), backend_param(ZERO2, "mesh")],
)
def test_plain_torch_hybrid_matches_reference(
    dist_pool: PoolFactory, config: BackendConfig, kind: str
) -> None:
    """The harness's hybrid models train like one process (nothing skipped, no
    flatview): what every equivalence test below builds on."""
    scenario = config.scenario(GATED, world_size=WORLD, skips=((),) * 3, options={"hybrid": kind})
    got = dist_pool(WORLD).run(hw.plain_training, scenario, timeout=TIMEOUT)[0]
    net = make_net(scenario)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for micro in range(len(scenario.skips)):
        x, y = batch(scenario, micro)
        loss_of(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    compare(got, {k: v.detach().numpy() for k, v in net.named_parameters()})


# ------------------------------------------------------- flatview on torch hybrid

# What each equivalence run adds to GATED (five steps that skip whole units, parameters
# inside units and root parameters).
VARIANTS = {
    "plain": {},
    "orig-params": {"options": {"use_orig_params": True}},
    "evaluate": {"evaluate": True},
    "accumulate": {"accumulate": 2, "skips": GATED.skips[:4]},
}
EQUIVALENCE = [
    backend_param(HYBRID_SHARD, "mesh", "plain"),
    backend_param(HYBRID_SHARD, "tuple", "orig-params"),
    backend_param(ZERO2, "mesh", "evaluate"),
    backend_param(ZERO2, "tuple", "accumulate"),
]


@pytest.mark.parametrize(("config", "kind", "variant"), EQUIVALENCE)
def test_hybrid_trains_like_the_reference(
    dist_pool: PoolFactory, config: BackendConfig, kind: str, variant: str
) -> None:
    fields = dict(VARIANTS[variant])
    options = {**fields.pop("options", {}), "hybrid": kind}
    scenario = config.scenario(GATED, world_size=WORLD, options=options, **fields)
    check_equivalent(dist_pool, scenario, timeout=TIMEOUT)


@pytest.mark.slow
@given(data=st.data())
@settings(max_examples=max(2, settings().max_examples // 2))
def test_hybrid_draws_match_the_reference(dist_pool: PoolFactory, data: st.DataObject) -> None:
    scenario = data.draw(scenarios(world_sizes=(WORLD,), configs=HYBRID_CONFIGS, unwrap=True))
    kind = data.draw(st.sampled_from(("mesh", "tuple")), label="grid")
    scenario = replace(scenario, options={**scenario.options, "hybrid": kind})
    check_equivalent(dist_pool, scenario, timeout=TIMEOUT)


def _numel(scenario: Scenario, prefixes: tuple[str, ...]) -> int:
    net = make_net(scenario)
    return sum(p.numel() for n, p in net.named_parameters() if n.startswith(prefixes))


def test_hybrid_bytes_per_group(dist_pool: PoolFactory) -> None:
    """Each group moves only used gradients, counted at the collectives: every rank's
    shard group its used elements (an exact all-to-all), its replica group those of
    its shard; a wholly skipped unit (``body.1``) costs nothing on either; the skip-set
    check spans the world; torch's own reduce-scatter and all-reduce never run."""
    scenario = HYBRID_SHARD.scenario(GATED, world_size=WORLD, options={"hybrid": "mesh"})
    skips = [(), (1,), (1, "body.2.gate", "aux")]
    results = dist_pool(WORLD).run(hw.bytes_per_group, scenario, skips, timeout=TIMEOUT)
    total = sum(p.numel() for p in make_net(scenario).parameters())
    for number, skip in enumerate(skips):
        names = tuple(f"body.{s}." if isinstance(s, int) else f"{s}." for s in skip)
        used = (total - _numel(scenario, names)) * 4
        steps = [r["steps"][number] for r in results]
        replica_bytes = []
        for rank, step in enumerate(steps):
            groups = step["groups"]
            row = (0, 1) if rank < 2 else (2, 3)
            column = (rank % 2, rank % 2 + 2)
            gradient = {k: v for k, v in groups[row].items() if k != "all_gather"}
            assert gradient == {"all_to_all": used}, (skip, rank, groups)
            assert set(groups[column]) == {"all_reduce"}, (skip, rank, groups)
            assert set(groups[(0, 1, 2, 3)]) == {"all_gather"}, (skip, rank, groups)
            replica_bytes.append(groups[column]["all_reduce"])
            assert step["reduced_bytes"] == used + replica_bytes[-1], (skip, rank)
            assert step["replica_bytes"] == replica_bytes[-1], (skip, rank)
            assert step["used_bytes"] == used, (skip, rank)
            assert step["units_skipped"] == (1 if 1 in skip else 0), (skip, rank)
            assert all(n.startswith(names) for n in step["grads_none"]), (skip, rank)
        # Replica peers move the same; the two shard ranks' parts make up the used bytes.
        assert replica_bytes[0] == replica_bytes[2] and replica_bytes[1] == replica_bytes[3]
        assert replica_bytes[0] + replica_bytes[1] == used, (skip, replica_bytes)


def test_replica_groups_that_skip_differently_raise(dist_pool: PoolFactory) -> None:
    """Shard group {0, 1} skips body.0, {2, 3} skips body.1: each shard group agrees
    within itself, so only a check spanning the world sees it (a replica all-reduce
    would pair different units' gradients)."""
    scenario = HYBRID_SHARD.scenario(GATED, world_size=WORLD, options={"hybrid": "mesh"})
    err = dist_pool(WORLD).run_expecting_error(
        hw.replicas_disagree, scenario, match="SkipSetMismatchError", timeout=60.0
    )
    assert set(err.errors) == set(range(WORLD))


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("shard-of-one", "shard group of one rank"),
        ("not-a-grid", "hold different shards"),
        ("subset", "the grid must span the default process group"),
    ],
)
def test_hybrid_layouts_flatview_refuses(dist_pool: PoolFactory, case: str, match: str) -> None:
    messages = dist_pool(WORLD).run(hw.wrap_refused, case, timeout=60.0)
    # The subset case: ranks 2 and 3 hold no model (None); the others must not hang.
    inside = [m for m in messages if m is not None]
    assert len(inside) == (2 if case == "subset" else WORLD)
    for message in inside:
        assert match in message, message


# ------------------------------------------------ norms and optimizer state


def test_hybrid_norms_count_each_element_once(dist_pool: PoolFactory) -> None:
    """Replica peers hold the same shards: norms combine the shard group's pieces only
    (over the world each element would count twice, off by sqrt(2) for 2-norms)."""
    scenario = HYBRID_SHARD.scenario(
        GATED, world_size=WORLD, skips=GATED.skips[:3], options={"hybrid": "tuple"}
    )
    check_training(dist_pool, scenario)


def test_hybrid_rank0_only_is_global_rank0(dist_pool: PoolFactory) -> None:
    """The consolidated optimizer state equals the reference on every rank; with
    ``rank0_only`` only global rank 0 gets it, not shard rank 0 of the other replica
    (global rank 2); every rank issues the same collectives."""
    scenario = ZERO2.scenario(GATED, world_size=WORLD, options={"hybrid": "mesh"})
    results = dist_pool(WORLD).run(ow.both_ways, scenario, timeout=TIMEOUT)
    _, want = ow.reference(scenario)
    assert len({calls for _, _, calls in results}) == 1
    for rank, (everywhere, only, _) in enumerate(results):
        for index, state in enumerate(everywhere):
            assert_same_state(state, want[index], (rank, index))
        for index, state in enumerate(only):
            if rank == 0:
                assert_same_state(state, want[index], (rank, index))
            else:
                assert state["state"] == {}, rank
                assert state["param_groups"] == want[index]["param_groups"]


@pytest.mark.parametrize(
    ("saved_on", "resumed_on"),
    [
        pytest.param((HYBRID_SHARD, WORLD, {"hybrid": "tuple"}), (FULL_SHARD, 2, {}), id="to-full"),
        pytest.param(
            (FULL_SHARD, 2, {"use_orig_params": True}),
            (ZERO2, WORLD, {"hybrid": "mesh", "use_orig_params": True}),
            id="from-full",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_hybrid_optimizer_state_moves_across_layouts(
    dist_pool: PoolFactory,
    saved_on: tuple[BackendConfig, int, dict[str, Any]],
    resumed_on: tuple[BackendConfig, int, dict[str, Any]],
) -> None:
    """Two steps on one layout, checkpoint (parameters, consolidated optimizer state on
    rank 0), the other steps on the other: the reference's parameters and state."""
    saved, resumed = (
        config.scenario(GATED, world_size=ws, batch_per_rank=4 // ws, options=options)
        for config, ws, options in (saved_on, resumed_on)
    )
    check_round_trip(dist_pool, saved, resumed, steps=2)
