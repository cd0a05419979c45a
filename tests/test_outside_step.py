"""Iterations outside any ``FlatView.step()`` take part in the skip-set check (issue 15,
item 12): one rank inside a checked step while another runs outside any step raised
nothing and hung (gloo aborted) on every backend; now every rank raises, naming the
rank outside, and training goes on exactly as the reference's. With the check off an
outside-step iteration exchanges nothing."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import pytest

from tests import outside_workers as w
from tests.scenarios import (
    BACKENDS,
    DDP,
    FSDP2,
    BackendConfig,
    Scenario,
    backend_param,
    compare,
    run_reference,
)

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

TIMEOUT = 60.0

# After the mismatch: one micro-batch skipping a whole unit, one skipping nothing.
SC = Scenario(skips=((1,), ()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_rank_outside_a_checked_step_raises_everywhere(
    dist_pool: PoolFactory, backend: BackendConfig
) -> None:
    """Rank 0 in a checked step skipping body.1, the other ranks outside any step: all
    raise, naming those outside (this hung); rank 0 in a step skipping nothing while they run
    outside is accepted (the same iteration); training afterwards is the reference's."""
    check_inside_and_outside(dist_pool, backend.scenario(SC))


@pytest.mark.parametrize("backend", [backend_param(FSDP2)])
def test_one_rank_outside_a_checked_step_raises_everywhere_fsdp2_as_one_unit(
    dist_pool: PoolFactory, backend: BackendConfig
) -> None:
    """The same with FSDP2 sharding only the root: body.1 is skipped inside the unit."""
    check_inside_and_outside(dist_pool, backend.scenario(SC, nested=False))


def check_inside_and_outside(dist_pool: PoolFactory, scenario: Scenario) -> None:
    results = dist_pool(scenario.world_size).run(w.inside_and_outside, scenario, timeout=TIMEOUT)
    # Every rank but 0 runs outside (hybrid layouts run on 4 ranks: 1, 2 and 3).
    outside = list(range(1, scenario.world_size))
    for got in results:
        assert re.search(
            rf"SkipSetMismatchError: rank\(s\) {re.escape(str(outside))} ran this iteration's "
            r"forward outside any FlatView\.step\(\).*rank 0 skips \['body\.1\..*"
            + "".join(
                rf"rank {r} runs outside any FlatView\.step\(\) \(skips nothing\).*"
                for r in outside
            ),
            got["mismatch"],
        ), got["mismatch"]
        assert got["alike"] == "accepted", got["alike"]
        assert got["phase"] == "IDLE"
    compare(results[0]["params"], run_reference(scenario).params)


TORCH_FULL = BackendConfig("torch", "FULL_SHARD")


@pytest.mark.parametrize("backend", [backend_param(DDP), backend_param(TORCH_FULL)])
def test_outside_step_exchanges_only_with_the_check_on(
    dist_pool: PoolFactory, backend: BackendConfig
) -> None:
    """With wrap(check_skip_agreement=False) training outside any step issues no
    agreement all-gather; with it on, one per iteration (8 bytes). Evaluation forwards
    under no_grad outside a step, and a step with check=False, exchange nothing; on DDP
    the recomputation of a checkpointed whole model inside the backward does not either."""
    pool = dist_pool(backend.ranks(2))
    off, on = (
        pool.run(w.outside_exchanges, backend.scenario(SC, check=check), timeout=TIMEOUT)
        for check in (False, True)
    )
    for got_off, got_on in zip(off, on, strict=True):
        assert got_off["agreement_bytes"] == 0 and got_on["agreement_bytes"] == 8
        assert got_on["train"] - got_off["train"] == 3, (got_on, got_off)
        assert got_on["evaluate"] == got_off["evaluate"], (got_on, got_off)
        assert got_on["unchecked_step"] == got_off["unchecked_step"], (got_on, got_off)
        if backend.backend == "ddp":
            assert got_on["checkpointed"] - got_off["checkpointed"] == 3, (got_on, got_off)
            assert got_off["train"] == got_off["evaluate"] == got_off["unchecked_step"] == 0
