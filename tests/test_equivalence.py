"""Distributed training with FSDP + flatview equals single-process training, on every
backend: fairscale FSDP, torch FSDP1 with FULL_SHARD, SHARD_GRAD_OP and NO_SHARD, and DDP.

Hypothesis varies the backend, model shapes (so parameters straddle shard boundaries
and padding is exercised), world sizes 1 to 4, nesting, tied parameters, frozen
parameters, how and where gradients are zeroed, gradient accumulation, evaluation passes
between steps, the skip set of every micro-batch (the first included) and unwrapping
midway (then training on as bare FSDP). Optimizers are built per submodule from views.
The reference runs the same model, data and optimizers in one process, without
executing skipped parts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from hypothesis import event
from hypothesis import strategies as st

from tests.scenarios import (
    BACKEND_CONFIGS,
    BACKENDS,
    FSDP2,
    FSDP2_HSDP,
    GATED,
    HYBRID_CONFIGS,
    HYBRID_STRATEGIES,
    TORCH_NO_SHARD,
    WRAPPER_OPTIONS,
    BackendConfig,
    Scenario,
    backend_param,
    check_equivalent,
    draws_per_backend,
    scenarios,
    spread,
    wrapper_options,
)
from tests.workers import plain_and_flatview

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

TIMEOUT = 120.0


@draws_per_backend(share=2, quick=(FSDP2, FSDP2_HSDP, HYBRID_CONFIGS[0], TORCH_NO_SHARD))
def test_matches_single_process_reference(
    dist_pool: PoolFactory, backend: BackendConfig, data: st.DataObject
) -> None:
    scenario = data.draw(scenarios(configs=(backend,), unwrap=True), label="scenario")
    # Shown by --hypothesis-show-statistics: how the draws spread over world sizes.
    event(f"{scenario.world_size} rank(s)")
    check_equivalent(dist_pool, scenario, timeout=TIMEOUT)


# Draws the thorough profile found: a unit used in one step and skipped in the next, with
# gradients zeroed to zero tensors (set_to_none=False), on a rank that holds none of its
# elements: its views must keep their (empty) gradients, as the unwrapped model keeps its
# zeroed ones, not fall back to None.
FOUND = [
    Scenario(
        world_size=3,
        in_dim=1,
        width=1,
        inner=(1,),
        norms=(False,),
        classes=2,
        skips=((), ("body.0",)),
        set_to_none=False,
        batch_per_rank=1,
        frozen=("body.0.up",),
    ),
    Scenario(
        world_size=2,
        in_dim=1,
        width=2,
        inner=(1, 1, 1, 1),
        norms=(False,) * 4,
        gates=(True, False, False, False),
        classes=2,
        skips=(("body.0.gate",), ("body.0",)),
        set_to_none=False,
        batch_per_rank=1,
        backend="torch",
    ),
]


@pytest.mark.parametrize("scenario", FOUND, ids=["fairscale-3", "torch-full-shard-2"])
def test_found_by_the_thorough_profile(dist_pool: PoolFactory, scenario: Scenario) -> None:
    check_equivalent(dist_pool, scenario, timeout=TIMEOUT)


# Quick: fairscale, SHARD_GRAD_OP and NO_SHARD on torch's runtime on 2 ranks, FULL_SHARD and
# NO_SHARD on views on 3, DDP on 4.
@pytest.mark.parametrize(("backend", "world_size"), spread((1, 2, 3, 4), quick=(2, 3, 2, 3, 2, 4)))
def test_skips_of_every_kind(
    dist_pool: PoolFactory, backend: BackendConfig, world_size: int
) -> None:
    check_equivalent(dist_pool, backend.scenario(GATED, world_size=world_size), timeout=TIMEOUT)


@pytest.mark.parametrize("backend", BACKENDS)
def test_skip_everything_in_the_first_step(dist_pool: PoolFactory, backend: BackendConfig) -> None:
    scenario = backend.scenario(
        world_size=2, inner=(3, 4, 2), norms=(True, True, False), skips=((0, 1, 2), (1,), ())
    )
    check_equivalent(dist_pool, scenario, timeout=TIMEOUT)


@pytest.mark.parametrize("backend", BACKENDS)
def test_evaluation_under_inference_mode(dist_pool: PoolFactory, backend: BackendConfig) -> None:
    """Evaluation passes between optimizer steps, one with autograd on outside any step
    and one under ``torch.inference_mode()`` inside a step with its skip set (Lightning's
    validation loop on DDP, hand-written evaluation loops): training is the
    single-process reference's, whatever the evaluation's tensors were made under."""
    scenario = backend.scenario(
        world_size=2,
        skips=((), (1,), (0,), ()),
        accumulate=2,
        zero_grad_at="before_forward",
        evaluate=True,
        inference=True,
    )
    check_equivalent(dist_pool, scenario, timeout=TIMEOUT)


def _option_params() -> list[Any]:
    # fairscale: each option at world sizes 2 and 3; torch: each option and strategy
    # once, world sizes alternating.
    return [
        backend_param(config, option, ws)
        for _, config, number, option in wrapper_options()
        for ws in ((2, 3) if config.backend == "fairscale" else ((2, 3)[number % 2],))
    ]


@pytest.mark.parametrize(("backend", "option", "world_size"), _option_params())
def test_wrapper_options(
    dist_pool: PoolFactory, backend: BackendConfig, option: str, world_size: int
) -> None:
    scenario = backend.scenario(
        world_size=world_size,
        inner=(3, 4, 2),
        norms=(True, True, False),
        gates=(False, True, False),
        aux=True,
        skips=((0, 2), (1, "aux"), ("body.1.gate",), (0, 1, 2)),
        set_to_none=False,
        options=WRAPPER_OPTIONS[backend.backend][option],
    )
    check_equivalent(dist_pool, scenario, timeout=TIMEOUT)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_agreement_check(dist_pool: PoolFactory, backend: BackendConfig) -> None:
    """Ranks trust each other's skip sets: nothing changes but the missing check."""
    scenario = backend.scenario(
        world_size=3,
        inner=(3, 4, 2),
        norms=(True, True, False),
        skips=((0, 2), (1,), ()),
        check=False,
    )
    check_equivalent(dist_pool, scenario, timeout=TIMEOUT)


# Low-precision compute (fairscale: fp16 parameters and reduction) or reduction (torch:
# fp16 gradients; torch casts before the communication hook and back after it). flatview
# refuses DDP's own mixed_precision (test_ddp_backend).
# (keep_low_precision_grads: test_nothing_skipped_equals_plain_fsdp; torch's AdamW, one
# of these scenarios' optimizers, cannot step a float32 parameter with a float16 gradient.)
MIXED_PRECISION: dict[str, dict[str, dict[str, Any]]] = {
    "fairscale": {"fp16": {"mixed_precision": True}},
    "torch": {"fp16-reduce": {"mixed_precision": (None, "float16")}},
}


@pytest.mark.parametrize(
    ("backend", "label"),
    [
        backend_param(config, label, slow=k > 0 and config.strategy != "FULL_SHARD")
        for config in BACKEND_CONFIGS
        for k, label in enumerate(MIXED_PRECISION.get(config.backend, {}))
    ],
)
def test_mixed_precision(dist_pool: PoolFactory, backend: BackendConfig, label: str) -> None:
    """Training agrees with the fp32 reference to fp16 accuracy."""
    if backend.strategy in HYBRID_STRATEGIES:
        # Hybrid layouts need 4 ranks, and there the fp32 reference is no yardstick: on
        # 2 x 2 with reduce_dtype float16, bare torch FSDP1 on its own ends
        # body.0.norm.weight[0] 5% off it (fp16 rounding of a near-zero gradient, which
        # AdamW's first steps turn into a whole lr), as flatview does. Compared against
        # bare torch under the same policy instead: tests/test_fp16_reduction.py.
        pytest.skip("fp16 reduction on 4 ranks: compared against bare torch FSDP1 instead")
    scenario = backend.scenario(
        world_size=2,
        inner=(3, 4),
        norms=(True, False),
        skips=((1,), (0,), ()),
        options=MIXED_PRECISION[backend.backend][label],
    )
    check_equivalent(dist_pool, scenario, tolerance=3e-3, timeout=TIMEOUT)


@pytest.mark.parametrize("backend", BACKENDS)
def test_freezing_by_name(dist_pool: PoolFactory, backend: BackendConfig) -> None:
    """requires_grad_(False) on views freezes exactly those parameters, partial ones too:
    they get neither gradient nor communication."""
    scenario = backend.scenario(
        world_size=3,
        inner=(5, 3),
        norms=(True, False),
        skips=((), (1,), ()),
        frozen=("body.0.up", "head.bias", "stem.weight"),
    )
    check_equivalent(dist_pool, scenario, timeout=TIMEOUT)


@pytest.mark.parametrize(("backend", "world_size"), spread((2, 3, 4), quick=(3, 2, 4, 3, 3, 2)))
def test_one_unit_mostly_skipped(
    dist_pool: PoolFactory, backend: BackendConfig, world_size: int
) -> None:
    """One unit, most blocks skipped: gathers (fairscale) and reductions are masked."""
    scenario = backend.scenario(
        world_size=world_size,
        nested=False,
        width=5,
        inner=(7, 2, 6, 3, 5),
        norms=(True, False, True, False, True),
        skips=((0, 2, 3, 4), (1, 2, 3), (0, 1, 2, 4), ()),
    )
    check_equivalent(dist_pool, scenario, timeout=TIMEOUT)


# Per backend, configurations whose reduction flatview must reproduce bit for bit.
PLAIN_OPTIONS: dict[str, dict[str, dict[str, Any]]] = {
    "fairscale": {"default": {}, "fp16": {"mixed_precision": True}},
    "torch": {
        "default": {},
        "use-orig-params": {"use_orig_params": True},
        "bf16": {"mixed_precision": ("bfloat16", "bfloat16")},
        # Gradients kept in bfloat16 for full-precision parameters (views included).
        "bf16-low-grads": {"mixed_precision": ("bfloat16", "bfloat16", True)},
        "orig-low-grads": {"use_orig_params": True, "mixed_precision": ("float16", None, True)},
    },
    "fsdp2": {"default": {}},
    "ddp": {"default": {}},
}


def _plain_params() -> list[Any]:
    params = []
    for backend in BACKEND_CONFIGS:
        for option in PLAIN_OPTIONS[backend.backend]:
            # Options beyond the default once per backend, not per torch strategy.
            slow = option != "default" and backend.strategy != "FULL_SHARD"
            params.append(backend_param(backend, option, slow=slow))
    return params


@pytest.mark.parametrize(("backend", "option"), _plain_params())
def test_nothing_skipped_equals_plain_fsdp(
    dist_pool: PoolFactory, backend: BackendConfig, option: str
) -> None:
    """With nothing skipped, flatview's reduction is the wrapper's own: the same
    parameters as bare FSDP with an optimizer over the flat parameters, bit for bit
    (low-precision compute included, where any other reduction order would show)."""
    scenario = backend.scenario(
        GATED,
        skips=((),) * 3,
        options=PLAIN_OPTIONS[backend.backend][option],
    )
    plain, ours = dist_pool(scenario.world_size).run(plain_and_flatview, scenario, timeout=TIMEOUT)[
        0
    ]
    assert plain.keys() == ours.keys() and plain
    for name, value in plain.items():
        assert np.array_equal(ours[name], value), name


def _exact_on_four(backend: BackendConfig) -> bool:
    """Whether flatview reduces, with nothing skipped, in the wrapper's own layout: torch
    FSDP1's sharded strategies (each unit alone) and FSDP2 (its own reduce-scatters)."""
    return backend.backend == "fsdp2" or (
        backend.backend == "torch" and backend.strategy != "NO_SHARD"
    )


def _four_rank_params() -> list[Any]:
    return [
        backend_param(b, option, slow=not (b.strategy == "FULL_SHARD" and option == "default"))
        for b in BACKEND_CONFIGS
        for option in PLAIN_OPTIONS[b.backend]
    ]


@pytest.mark.parametrize(("backend", "option"), _four_rank_params())
def test_nothing_skipped_equals_plain_fsdp_on_four_ranks(
    dist_pool: PoolFactory, backend: BackendConfig, option: str
) -> None:
    """On 4 ranks the order a collective adds the ranks' values in can depend on where an
    element sits in its buffer (gloo does), so only the wrapper's own layout gives its
    rounding: bit for bit where flatview keeps it (:func:`_exact_on_four`); where it
    buckets differently from the wrapper (DDP's buckets, torch ``NO_SHARD``'s per-unit
    all-reduces, fairscale's bucketer: docs/limitations.md) to a last-bit rounding."""
    options = PLAIN_OPTIONS[backend.backend][option]
    scenario = backend.scenario(GATED, skips=((),) * 3, options=options, world_size=4)
    plain, ours = dist_pool(4).run(plain_and_flatview, scenario, timeout=TIMEOUT)[0]
    assert plain.keys() == ours.keys() and plain
    low = option in ("fp16", "bf16", "bf16-low-grads", "orig-low-grads")
    for name, value in plain.items():
        if _exact_on_four(backend):
            assert np.array_equal(ours[name], value), name
        else:
            # Measured after 3 steps: fp32 3e-8, fp16 compute and reduction 2.6e-4.
            rtol, atol = (4e-3, 1e-3) if low else (1e-5, 1e-6)
            assert np.allclose(ours[name], value, rtol=rtol, atol=atol), name
