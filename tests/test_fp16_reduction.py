"""Skipping under a low-precision gradient reduction gives bare FSDP's training.

The fp32 single-process reference is the wrong yardstick here (see
:mod:`tests.precision_workers`): on 4 ranks with ``reduce_dtype=float16`` torch FSDP1 on
its own ends ``body.0.norm.weight[0]`` 5% away from it (0.0495 with AdamW at lr 0.05),
exactly as far as FSDP + flatview does. What must hold is that flatview skipping a block
is bare FSDP with that block zeroed: the first step's sharded gradients of every unit
(the skipped unit: None against plain's zeros) and the final parameters, bit for bit.

Bit for bit except where the wrapper's own layout cannot be kept: fairscale buckets the
reduce-scatters of several units (its ``bucket_cap_mb``), bare fairscale's bucket holds
the zeroed block and flatview's does not, so the other gradients sit elsewhere in the
collective's buffer, and on 3 or more ranks gloo sums them in another order. There they
agree to fp16 rounding (2 ranks: a sum of two is the same either way)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from tests.precision_workers import (
    rank_local_accumulation,
    reduce_calls,
    skipping_and_zeroed_plain,
)
from tests.scenarios import BackendConfig, backend_param

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

TIMEOUT = 120
FULL = BackendConfig("torch", "FULL_SHARD")
FP16 = {"mixed_precision": (None, "float16")}

# (configuration, wrapper options, world size, exact); the hybrid layouts are 2 x 2.
CASES = [
    # In CI: the case that was taken for a flatview defect (4 ranks, fp16), and fairscale's.
    backend_param(FULL, FP16, 4, ci=True),
    backend_param(BackendConfig("fairscale", "FULL_SHARD"), {"mixed_precision": True}, 4),
    backend_param(FULL, FP16, 2, slow=True),
    backend_param(FULL, {}, 4, slow=True),
    backend_param(BackendConfig("torch", "SHARD_GRAD_OP"), FP16, 4, slow=True),
    backend_param(BackendConfig("torch", "HYBRID_SHARD"), FP16, 4),
    backend_param(BackendConfig("torch", "_HYBRID_SHARD_ZERO2"), FP16, 4),
    backend_param(
        BackendConfig("fairscale", "FULL_SHARD"), {"mixed_precision": True}, 2, slow=True
    ),
]


@pytest.mark.parametrize(("backend", "options", "world_size"), CASES)
def test_skipping_is_plain_with_the_block_zeroed(
    dist_pool: PoolFactory, backend: BackendConfig, options: dict[str, Any], world_size: int
) -> None:
    exact = backend.backend == "torch" or world_size == 2

    def same(got: np.ndarray, want: np.ndarray) -> bool:
        if exact:
            return bool(np.array_equal(got, want))
        # fp16 keeps 11 bits: a different summation order moves a sum by an ulp or two.
        return bool(np.allclose(got, want, rtol=4e-3, atol=1e-5))

    scenario = backend.scenario(
        world_size=world_size,
        inner=(3, 4),
        norms=(True, False),
        skips=((1,), (), ()),
        options=options,
    )
    results = dist_pool(world_size).run(skipping_and_zeroed_plain, scenario, timeout=TIMEOUT)
    for rank, (ours, plain, *_) in enumerate(results):
        assert len(ours) == len(plain) == 3, rank  # root, body.0, body.1
        for unit, (got, want) in enumerate(zip(ours, plain, strict=True)):
            if unit == 2:
                # The skipped block: no gradient with flatview, zeros from bare FSDP.
                assert got is None, rank
                assert want is not None and not want.any(), rank
                continue
            assert got is not None and want is not None, (rank, unit)
            assert same(got, want), (rank, unit, np.abs(got - want).max())
    ours_state, plain_state = results[0][2], results[0][3]
    assert ours_state.keys() == plain_state.keys() and ours_state
    for name, value in plain_state.items():
        assert same(ours_state[name], value), (name, np.abs(ours_state[name] - value).max())


def test_gradients_used_whole_go_alone_unless_bucketing_is_asked_for(
    dist_pool: PoolFactory,
) -> None:
    """torch FSDP1 reduce-scatters each unit on its own, and so does flatview by default
    (its layout, its rounding); ``bucket_all_used=True`` shares one collective. On 2 ranks
    both give the same sums (two values add up the same either way)."""
    scenario = FULL.scenario(world_size=2, inner=(3, 4, 2), norms=(True, False, True))
    alone = dist_pool(2).run(reduce_calls, scenario, None, timeout=TIMEOUT)
    shared = dist_pool(2).run(reduce_calls, scenario, True, timeout=TIMEOUT)
    for (calls, grads), (shared_calls, shared_grads) in zip(alone, shared, strict=True):
        assert calls == 4  # the root and three blocks
        assert shared_calls == 1
        assert len(grads) == len(shared_grads) == 4
        for got, want in zip(shared_grads, grads, strict=True):
            assert np.array_equal(got, want)


@pytest.mark.parametrize(
    ("backend", "world_size"),
    [
        backend_param(FULL, 3, ci=True),
        # Hybrid: the replica all-reduces must pair up too, with a partly skipped unit
        # (a bucket, reduced at the end) between units reduced whole, in flight on the
        # ranks that do not accumulate and done at once on the one that does. Shard
        # groups of 2 sum the same in any order, so the masked bucket is exact here.
        backend_param(BackendConfig("torch", "HYBRID_SHARD"), 4),
    ],
)
def test_a_rank_that_accumulates_alone_reduces_like_the_others(
    dist_pool: PoolFactory, backend: BackendConfig, world_size: int
) -> None:
    """Whether torch still holds an earlier shard to accumulate into is a fact of one
    rank: flatview may finish such a gradient's reduce-scatter at once there and later
    elsewhere, but must issue the same collective on every rank. With torch's alignment
    padding (use_orig_params, 3 ranks) a packed collective there once differed in size
    from the whole one elsewhere, and gloo aborted the processes."""
    scenario = backend.scenario(
        world_size=world_size,
        inner=(3, 4, 2),
        norms=(True, False, True),
        gates=(True, True, True),
        options={"use_orig_params": True},
    )
    skip = ("body.1.gate",) if backend.hybrid else ()
    results = dist_pool(world_size).run(rank_local_accumulation, scenario, skip, timeout=TIMEOUT)
    for rank, (ours, plain) in enumerate(results):
        assert len(ours) == len(plain) > 0, rank
        for got, want in zip(ours, plain, strict=True):
            assert np.array_equal(got, want), rank
