"""Several forwards of the root before their backwards (fairscale's
``test_fwd_fwd_bwd_bwd``, the pipelining pattern: the backwards but the last under
``no_sync()``). Workers in :mod:`tests.pipelining_workers`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests import pipelining_workers as pw
from tests.scenarios import DDP, FAIRSCALE, FSDP2, GATED, BackendConfig, only_on_tested_torch

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

TIMEOUT = 90.0


@pytest.mark.parametrize("nested", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_fwd_fwd_bwd_bwd_on_fairscale(dist_pool: PoolFactory, nested: bool) -> None:
    """fairscale trains it; with flatview, two windows of it give the plain wrapper's
    parameters exactly (same processes)."""
    pytest.importorskip("fairscale")
    scenario = FAIRSCALE.scenario(GATED, nested=nested)
    for found in dist_pool(2).run(pw.compare, scenario, timeout=TIMEOUT):
        assert found.get("worst") == 0.0, found


@only_on_tested_torch("FSDP2")
@pytest.mark.parametrize("nested", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_fwd_fwd_bwd_bwd_on_fsdp2(dist_pool: PoolFactory, nested: bool) -> None:
    """FSDP2 trains it too (the first backwards with ``set_requires_gradient_sync(False)``):
    with flatview, two windows give plain FSDP2's parameters exactly."""
    scenario = FSDP2.scenario(GATED, nested=nested)
    for found in dist_pool(2).run(pw.compare, scenario, timeout=TIMEOUT):
        assert found.get("worst") == 0.0, found


@pytest.mark.parametrize("name", ["torch_shard_grad_op", "ddp"])
def test_fwd_fwd_bwd_bwd_refused_everywhere(dist_pool: PoolFactory, name: str) -> None:
    """Where flatview does not support it, every rank raises a StateError naming the
    pattern: torch FSDP1 SHARD_GRAD_OP with the first backwards under no_sync() (plain
    torch fails later, in its own final callback's assertion; FULL_SHARD fails in
    torch's own backward, with or without flatview), found at the first backward that
    has no post-backward hook (before: a misleading UndeclaredUnusedError), and DDP."""
    config = BackendConfig("torch", "SHARD_GRAD_OP") if name != "ddp" else DDP
    scenario = config.scenario(GATED, nested=False)
    for found in dist_pool(2).run(pw.fwd_fwd_bwd_bwd, scenario, True, timeout=TIMEOUT):
        assert "error" in found, found
        assert found["error"].startswith("StateError"), found
        assert "several forwards, then their backwards" in found["error"], found
