"""Open silent wrong number (found under hybrid sharding, not specific to it): torch
FSDP1 with ``MixedPrecision(reduce_dtype=float16)`` on 4 ranks, block 1 skipped in the
first step, ends with ``body.0.norm.weight[0]`` 5% off the fp32 reference (0.995 against
0.945; the other elements agree to 1e-4). The same scenario passes on 2 and 3 ranks with
fp16 and on 4 ranks in fp32, and on 4 ranks in fp16 with nothing skipped. Strict xfail: a
fix makes it pass and then this marker must go (and the hybrid skip in
test_equivalence.test_mixed_precision with it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests.scenarios import BackendConfig, check_equivalent

if TYPE_CHECKING:
    from tests.conftest import PoolFactory


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="open: fp16 reduction on 4 ranks, one element off")
def test_fp16_four_ranks(dist_pool: PoolFactory) -> None:
    scenario = BackendConfig("torch", "FULL_SHARD").scenario(
        world_size=4,
        inner=(3, 4),
        norms=(True, False),
        skips=((1,), (), ()),
        options={"mixed_precision": (None, "float16")},
    )
    check_equivalent(dist_pool, scenario, tolerance=3e-3, timeout=120)
