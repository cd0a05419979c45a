"""Blocks compiled with ``torch.compile`` (in place, as torchtitan compiles each block)
train under flatview as the unwrapped model does, skip sets of every kind included."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests.scenarios import (
    BACKEND_CONFIGS,
    BackendConfig,
    backend_param,
    check_equivalent,
)

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

TIMEOUT = 240.0


# Compiling costs seconds per model: CI runs torch FSDP1 FULL_SHARD, the thorough profile
# every configuration.
@pytest.mark.parametrize(
    "backend",
    [
        backend_param(c, slow=(c.backend, c.strategy, c.runtime) != ("torch", "FULL_SHARD", False))
        for c in BACKEND_CONFIGS
    ],
)
def test_compiled_blocks_train_as_the_reference(
    dist_pool: PoolFactory, backend: BackendConfig
) -> None:
    scenario = backend.scenario(
        width=5,
        inner=(6, 4),
        norms=(True, False),
        gates=(True, False),
        aux=True,
        skips=((), (1, "aux"), ("body.0.gate",)),
        compiled=True,
    )
    check_equivalent(dist_pool, scenario, timeout=TIMEOUT)
