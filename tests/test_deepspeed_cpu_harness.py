"""flatview.testing.deepspeed_on_cpu: DeepSpeed's ZeRO engine on CPU over gloo inside
the suite's worker pools, without building any op and leaving nothing behind."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests import deepspeed_workers as w

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

pytest.importorskip("deepspeed")

# DeepSpeed's first import in a worker takes 10-30 s on a busy 2-core machine.
TIMEOUT = 240


def test_harness_trains_every_stage_and_leaves_nothing(dist_pool: PoolFactory) -> None:
    results = dist_pool(2).run(w.harness_leaves_nothing, (1, 2, 3), timeout=TIMEOUT)
    for result in results:
        assert all(result["unchanged"].values()), result["unchanged"]
        assert result["env_same"]
        assert result["locks_same"]
        for inside in result["inside"]:
            # No shared-memory op: DeepSpeed's backend runs gloo's own collectives.
            assert inside == {
                "shm_op": True,
                "backend_shm": None,
                "accelerator": "cpu",
                "env": "cpu",
            }


def test_harness_refuses_to_build_ops(dist_pool: PoolFactory) -> None:
    for result in dist_pool(2).run(w.harness_refuses_builds, timeout=TIMEOUT):
        assert "deepspeed_on_cpu" in result["message"]
        assert "'deepspeed_shm_comm'" in result["message"]
        assert result["locks_same"]
