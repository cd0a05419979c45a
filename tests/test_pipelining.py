"""Several forwards of the root before their backwards (fairscale's
``test_fwd_fwd_bwd_bwd``): not supported by flatview yet; refused on every rank with a
StateError naming the pattern, never a silent wrong number. Workers in
:mod:`tests.pipelining_workers`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests import pipelining_workers as pw
from tests.scenarios import FAIRSCALE, GATED, BackendConfig

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

TIMEOUT = 90.0


@pytest.mark.parametrize("name", ["fairscale", "torch_shard_grad_op"])
def test_fwd_fwd_bwd_bwd_refused_everywhere(dist_pool: PoolFactory, name: str) -> None:
    """fairscale's own test pattern (three forwards, two backwards under no_sync(), the
    last synchronising): every rank raises the same StateError."""
    if name == "fairscale":
        pytest.importorskip("fairscale")
    config = FAIRSCALE if name == "fairscale" else BackendConfig("torch", "SHARD_GRAD_OP")
    scenario = config.scenario(GATED, nested=False)
    for found in dist_pool(2).run(pw.fwd_fwd_bwd_bwd, scenario, True, timeout=TIMEOUT):
        assert "error" in found, found
        assert found["error"].startswith("StateError"), found
        assert "several forwards of the root before their backwards" in found["error"], found
