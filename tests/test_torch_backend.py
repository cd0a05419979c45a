"""Checks only torch's FSDP1 backend has: its state-dict types, its prefetching,
``use_orig_params``, uninstalling its hooks and the configurations flatview refuses.

Equivalence, views, skip sets and their errors run on torch through the parametrized
suites (test_equivalence.py, test_views.py, test_skip.py).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import pytest
import torch

from flatview.backends import torch_fsdp
from tests import torch_workers as tw
from tests.scenarios import (
    GATED,
    BackendConfig,
    Scenario,
    assert_equivalent,
    check_equivalent,
    make_net,
    only_on_tested_torch,
    run_distributed,
    run_reference,
)

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

pytest.importorskip("torch.distributed.fsdp")
pytestmark = only_on_tested_torch("torch")

TIMEOUT = 120.0
FULL_SHARD = BackendConfig("torch", "FULL_SHARD")
NO_SHARD = BackendConfig("torch", "NO_SHARD")


@pytest.mark.parametrize("backend", [FULL_SHARD, NO_SHARD], ids=str)
def test_use_orig_params_accumulation(dist_pool: PoolFactory, backend: BackendConfig) -> None:
    """torch keeps its own per-parameter views; flatview adds skip sets, and gives
    skipped parameters None where torch would hand out zeros, also across no_sync()
    micro-batches (block 3 is skipped in every micro-batch of the first step)."""
    scenario = backend.scenario(
        GATED,
        skips=(
            (0, 3, "body.1.gate"),
            (1, 3, "aux"),
            (1, 3, "body.2.gate", "aux"),
            (2, "body.0.gate", "aux"),
            ("body.3.gate",),
            (0, 2, "aux"),
        ),
        accumulate=3,
        options={"use_orig_params": True},
    )
    results = dist_pool(2).run(run_distributed, scenario, timeout=TIMEOUT)
    reference = run_reference(scenario)
    assert "body.3.up.weight" in reference.none_grads[0]
    assert_equivalent(results, reference, scenario)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_use_orig_params_alignment_gaps_with_every_nested_unit_skipped(
    dist_pool: PoolFactory, strategy: str
) -> None:
    """Found by the optimizer-state hypothesis test: with ``use_orig_params=True`` torch
    leaves alignment gaps between parameters, so one rank's shard of the root's fully
    used gradient has unused elements in the middle. With every nested unit skipped the
    root's gradient is the only one in the bucket, and sending it unpacked shifted that
    rank's elements after the gap (``head_copy.bias`` got another parameter's gradient)."""
    scenario = BackendConfig("torch", strategy).scenario(
        in_dim=1,
        width=4,
        inner=(1, 1),
        norms=(False, False),
        aux=True,
        classes=2,
        tie=True,
        skips=(("body.0", "body.1"), ()),
        set_to_none=False,
        batch_per_rank=1,
        seed=0,
        options={"use_orig_params": True},
    )
    check_equivalent(dist_pool, scenario, timeout=TIMEOUT)


@pytest.mark.parametrize(
    ("strategy", "world_size"), [("NO_SHARD", 2), ("SHARD_GRAD_OP", 3), ("FULL_SHARD", 3)]
)
@pytest.mark.parametrize("evaluate", [False, True])
def test_use_orig_params_accumulation_with_zeroed_grads(
    dist_pool: PoolFactory, strategy: str, world_size: int, evaluate: bool
) -> None:
    """The smallest case hypothesis found: one unit, zero_grad(set_to_none=False), block 0
    skipped in both micro-batches of the first step and trained in the second step.
    flatview hands the skipped block ``None`` gradients, which torch then marks; torch
    clears its marks only in a synchronising backward and zeroes what a marked parameter
    accumulated under ``no_sync()``, unless flatview clears them (``evaluate``: a forward
    without backward between steps)."""
    scenario = BackendConfig("torch", strategy).scenario(
        world_size=world_size,
        evaluate=evaluate,
        in_dim=1,
        width=5,
        inner=(1, 1, 1),
        norms=(False, True, False),
        aux=True,
        classes=2,
        nested=False,
        skips=((0, 1), (0,), (), ()),
        accumulate=2,
        set_to_none=False,
        batch_per_rank=1,
        options={"use_orig_params": True},
    )
    check_equivalent(dist_pool, scenario, timeout=TIMEOUT)


# ------------------------------------------------------------------- state dicts


@pytest.mark.parametrize("kind", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"])
def test_state_dict_types_unchanged(dist_pool: PoolFactory, kind: str) -> None:
    scenario = FULL_SHARD.scenario(GATED)
    results = dist_pool(2).run(tw.state_dict_task, scenario, kind, timeout=TIMEOUT)
    full_shapes = {n: tuple(p.shape) for n, p in make_net(scenario).named_parameters()}
    for rank, r in enumerate(results):
        assert r["plain"].keys() == r["wrapped"].keys() == r["reloaded"].keys(), rank
        assert r["plain"], rank
        for key, plain in r["plain"].items():
            wrapped, reloaded = r["wrapped"][key], r["reloaded"][key]
            plain_parts = plain if isinstance(plain, list) else [plain]
            wrapped_parts = wrapped if isinstance(wrapped, list) else [wrapped]
            reloaded_parts = reloaded if isinstance(reloaded, list) else [reloaded]
            for a, b, c in zip(plain_parts, wrapped_parts, reloaded_parts, strict=True):
                assert torch.equal(a, b), (rank, key)
                torch.testing.assert_close(c, b + 0.5, msg=f"rank {rank}: {key}")
        assert r["same_views"] and r["views_loaded"] and r["after_summon"], rank
        # Inside summon_full_params the submodules hold the full parameters.
        summoned = {torch_fsdp.clean_name(n): s for n, s in r["summoned"].items()}
        assert summoned == full_shapes, rank


def test_uninstall_leaves_nothing(dist_pool: PoolFactory) -> None:
    for left in dist_pool(2).run(tw.uninstall_task, FULL_SHARD.scenario(GATED), timeout=TIMEOUT):
        assert left == []


# ---------------------------------------------------------------------- prefetch


def test_forward_prefetch_skips_skipped_units(dist_pool: PoolFactory) -> None:
    """torch prefetches in the first iteration's order; without flatview it all-gathers
    units that a later step skips. With flatview it prefetches the next used unit."""
    scenario = FULL_SHARD.scenario(
        GATED, options={"forward_prefetch": True, "backward_prefetch": "BACKWARD_PRE"}
    )
    pool = dist_pool(2)
    plain_wasted, _ = pool.run(tw.prefetch_task, scenario, False, timeout=TIMEOUT)[0]
    wasted, prefetched = pool.run(tw.prefetch_task, scenario, True, timeout=TIMEOUT)[0]
    # Step 0 skips block 1, so the first iteration's order is block 0, 2, 3; step 2
    # skips blocks 0 and 3, which torch alone would still prefetch.
    assert plain_wasted[2] == ["body.0", "body.3"]  # what flatview has to prevent
    assert wasted == [[]] * len(scenario.skips)
    # The root prefetches block 2 instead of block 0.
    assert "body.2" in prefetched[2]


def test_prefetch_with_evaluation_passes(dist_pool: PoolFactory) -> None:
    """Forward prefetching steered around skipped units, and between steps a forward that
    no backward follows plus one under no_grad: training still matches the reference."""
    scenario = FULL_SHARD.scenario(
        GATED,
        world_size=3,
        evaluate=True,
        options={"forward_prefetch": True, "backward_prefetch": "BACKWARD_POST"},
    )
    check_equivalent(dist_pool, scenario, timeout=TIMEOUT)


@pytest.mark.parametrize("backward_prefetch", ["BACKWARD_PRE", "BACKWARD_POST"])
def test_backward_prefetch_never_gathers_skipped_units(
    dist_pool: PoolFactory, backward_prefetch: str
) -> None:
    """Backward prefetching follows this iteration's forward order, which holds no skipped
    unit, except after a forward that no backward followed: torch then keeps that
    forward's order and prefetches a unit the next step skips (block 1 in step 0)."""
    scenario = FULL_SHARD.scenario(GATED, options={"backward_prefetch": backward_prefetch})
    pool = dist_pool(2)
    for abandon_first in (False, True):
        plain, _ = pool.run(tw.prefetch_task, scenario, False, abandon_first, timeout=TIMEOUT)[0]
        assert plain[0] == (["body.1"] if abandon_first else [])
        wasted, _ = pool.run(tw.prefetch_task, scenario, True, abandon_first, timeout=TIMEOUT)[0]
        assert wasted == [[]] * len(scenario.skips)


# ------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("nested", "nested FSDP unit"),
        ("version", "torch 1[.]0[.]x; found torch .*FLATVIEW_ALLOW_UNTESTED_TORCH=1"),
        ("comm_hook", "already has a communication hook"),
        ("overlap_reduction", "overlap_reduction=False applies to DistributedDataParallel"),
        ("mask_gather_min_saved", r"mask_gather_min_saved=0\) applies to fairscale models only"),
        ("hybrid_shard_of_one", "hybrid sharding with a shard group of one rank"),
        (
            "views_sharded",
            r"compute_on_views=True needs every FSDP unit to replicate .*: FSDP unit '<root>' "
            r"shards \(FULL_SHARD\)",
        ),
        ("views_mixed_precision", "compute_on_views=True .*: FSDP unit '.*' uses mixed precision"),
        ("views_ddp", "compute_on_views=False applies to torch FSDP1 models only"),
    ],
)
def test_wrap_refuses(dist_pool: PoolFactory, case: str, match: str) -> None:
    scenario = FULL_SHARD.scenario(Scenario())
    for message in dist_pool(2).run(tw.wrap_error_task, scenario, case, timeout=TIMEOUT):
        assert re.search(match, message), message


# ------------------------------------------------------------------ computed on views


def test_no_shard_computes_on_views(dist_pool: PoolFactory) -> None:
    """Every unit NO_SHARD in full precision: the model computes on the views (torch's own
    with use_orig_params=True) and flatview reduces (torch's runtime stays idle);
    otherwise torch's runtime."""
    for r in dist_pool(2).run(tw.on_views_task, NO_SHARD.scenario(GATED), timeout=TIMEOUT):
        assert r["default"] == r["use_orig_params"] == "TorchReplicatedAdapter", r
        assert r["runtime"] == r["mixed_precision"] == "TorchFSDPAdapter", r
        assert r["units_idle"] and r["flat_grads_none"] and r["flats_hidden"], r
        assert r["grads_on_used_views"], r
        assert re.search(
            r"OptimStateError: optimizer SGD holds the flat parameter of FSDP unit '<root>', "
            r"which gets no gradient.*compute_on_views=False",
            r["flat_optimizer"],
        ), r


@pytest.mark.parametrize("world_size", [1, 3])
def test_computed_on_views_overlapped_with_accumulation(
    dist_pool: PoolFactory, world_size: int
) -> None:
    """Buckets started during the backward (as DDP's), gradient accumulation under
    no_sync(), evaluation passes between steps: the single-process reference's result.
    One rank: torch picks NO_SHARD for the FULL_SHARD model, which then computes on views."""
    config = FULL_SHARD if world_size == 1 else NO_SHARD
    scenario = config.scenario(
        GATED,
        world_size=world_size,
        skips=(*GATED.skips, ()),
        accumulate=2,
        evaluate=True,
        set_to_none=False,
        options={"overlap": True},
    )
    check_equivalent(dist_pool, scenario, timeout=TIMEOUT)


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig-params"])
def test_state_dict_between_backward_and_step_keeps_gradients(
    dist_pool: PoolFactory, use_orig_params: bool
) -> None:
    """Computed on views, a checkpoint taken before the optimizer step leaves every
    gradient as the backward made it (torch may copy them into the flat gradient with
    use_orig_params=True), skipped parameters' None included."""
    options = {"use_orig_params": True} if use_orig_params else {}
    scenario = NO_SHARD.scenario(GATED, skips=GATED.skips[:3], options=options)
    for changed in dist_pool(2).run(tw.state_dict_mid_step_task, scenario, timeout=TIMEOUT):
        assert changed == [[]] * 3, changed


def test_computed_on_views_edges(dist_pool: PoolFactory) -> None:
    for r in dist_pool(2).run(tw.on_views_edges_task, NO_SHARD.scenario(GATED), timeout=TIMEOUT):
        assert re.search(
            r"OptimStateError: optimizer SGD holds the flat parameter of FSDP unit '.*', "
            r"which gets no gradient",
            r.get("orig_flat_optimizer", "accepted"),
        ), r
        assert r["dtypes"] == r["grad_dtypes"] == ["torch.float64"], r
        assert r["alias_flats"] and r["step_reaches_flats"], r
