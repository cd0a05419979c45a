"""Plain training after ``unwrap()`` on torch FSDP1 ``SHARD_GRAD_OP`` with
``use_orig_params=True``, where a forward without backward leaves a unit unsharded and
``model.parameters()`` holds torch's non-leaf views of it until the next reshard."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import pytest

from tests.scenarios import (
    Scenario,
    check_equivalent,
    compare,
    run_reference,
    torch_backend_tested,
)
from tests.unwrap_workers import keep_optimizers_after_unwrap

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

# body.0 is skipped in step 0, so the no_grad pass does not run (and reshard) it.
SCENARIO = Scenario(
    world_size=2,
    in_dim=1,
    width=1,
    inner=(1, 1),
    norms=(False, False),
    gates=(False, False),
    aux=False,
    classes=2,
    nested=True,
    tie=False,
    skips=(("body.0",), (), ()),
    accumulate=1,
    set_to_none=False,
    zero_grad_at="after_step",
    unwrap_after=0,
    batch_per_rank=1,
    seed=0,
    backend="torch",
    strategy="SHARD_GRAD_OP",
    check=True,
    declare=True,
    evaluate=True,
    frozen=(),
    options={"use_orig_params": True},
)


@pytest.mark.skipif(not torch_backend_tested(), reason="flatview refuses this torch")
def test_unwrap_with_unit_left_unsharded(dist_pool: PoolFactory) -> None:
    # A thorough hypothesis draw: the harness's plain optimizer over model.parameters()
    # met torch's non-leaf views ("can't optimize a non-leaf Tensor").
    check_equivalent(dist_pool, SCENARIO, timeout=120)
    # Optimizers over torch's own parameters train on after unwrap, as with bare FSDP;
    # unwrap() marked those of the unsharded unit stale (StateError at their step).
    results = dist_pool(2).run(keep_optimizers_after_unwrap, SCENARIO, timeout=120)
    compare(results[0], run_reference(replace(SCENARIO, unwrap_after=None)).params)
