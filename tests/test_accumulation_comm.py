"""Gradient accumulation under the wrapper's ``no_sync()`` (fairscale's
``TestGradAccCommunication``): a micro-step has exactly the wrapper's collectives, with
flatview's skip-set check of the whole window settled in the synchronising step; a
disagreement in any micro-step still raises on every rank, before any reduction.
Workers in :mod:`tests.grad_acc_workers`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests import grad_acc_workers as gw
from tests.scenarios import DDP, FAIRSCALE, GATED, BackendConfig

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

TIMEOUT = 90.0
SLOW = pytest.mark.slow
CONFIGS = {
    "fairscale": FAIRSCALE,
    "torch": BackendConfig("torch", "FULL_SHARD"),
    "torch_no_shard": BackendConfig("torch", "NO_SHARD"),
    "ddp": DDP,
}


@pytest.mark.parametrize(
    "name", [n if n != "torch_no_shard" else pytest.param(n, marks=SLOW) for n in sorted(CONFIGS)]
)
def test_no_sync_micro_steps_add_no_collective(dist_pool: PoolFactory, name: str) -> None:
    """Each micro-step under no_sync() issues the same collectives as the plain wrapper's
    (counted at the calls; without skip sets, the peers' test), and, with skip sets, as
    flatview's with the check off: the check of the window is the synchronising step's
    (one more all-gather there than unchecked)."""
    if name == "fairscale":
        pytest.importorskip("fairscale")
    scenario = CONFIGS[name].scenario(GATED)
    skips = [(0,), (2, 3), (1,)]
    for found in dist_pool(2).run(gw.counted_window, scenario, skips, timeout=TIMEOUT):
        plain = found["plain"]
        if name == "ddp":
            # Plain DDP's reducer rebuilds its buckets once, in the first forward after
            # the first synchronising backward, and broadcasts their order: flatview keeps
            # DDP's reducer idle and learns its own order (replicated.py). The scenario
            # has no buffers; their broadcast is test_ddp_backend's.
            plain = [{k: v for k, v in step.items() if k != "broadcast"} for step in plain]
        assert found["flatview"][:-1] == plain[:-1], found
        assert found["skipping"][:-1] == found["unchecked"][:-1], found
        last, unchecked = found["skipping"][-1], found["unchecked"][-1]
        assert last.get("all_gather", 0) == unchecked.get("all_gather", 0) + 1, found


@pytest.mark.parametrize(
    ("name", "where"),
    [
        ("fairscale", 0),
        ("torch", 0),
        pytest.param("ddp", 0, marks=SLOW),
        pytest.param("fairscale", 2, marks=SLOW),
        pytest.param("torch", 2, marks=SLOW),
        ("ddp", 2),
    ],
)
def test_disagreement_in_window_raises_everywhere(
    dist_pool: PoolFactory, name: str, where: int
) -> None:
    """A rank skipping differently in a micro-step under no_sync() (``where`` 0) or in the
    synchronising one (2): SkipSetMismatchError on every rank, naming the micro-step."""
    if name == "fairscale":
        pytest.importorskip("fairscale")
    scenario = CONFIGS[name].scenario(GATED, nested=False)
    for found in dist_pool(2).run(gw.disagreeing_window, scenario, where, timeout=TIMEOUT):
        assert found["message"].startswith("SkipSetMismatchError"), found
        if where == 0:
            assert "iteration 1 of the 3" in found["message"], found


@pytest.mark.parametrize("name", ["fairscale", "torch"])
def test_explicit_check_catches_units_called_differently_in_the_micro_step(
    dist_pool: PoolFactory, name: str
) -> None:
    """Nested units, rank 1 skipping a whole unit in a micro-step under no_sync(): with
    the default check the wrapper's own gathers pair up wrongly first (gloo aborts a
    rank; docs/limitations.md), with ``step(check=True)`` every rank raises in that
    micro-step, before them."""
    if name == "fairscale":
        pytest.importorskip("fairscale")
    scenario = CONFIGS[name].scenario(GATED, nested=True)
    for found in dist_pool(2).run(gw.disagreeing_window, scenario, 0, True, timeout=TIMEOUT):
        assert found["message"].startswith("SkipSetMismatchError"), found
        assert "iteration 1 of the 3" not in found["message"], found
