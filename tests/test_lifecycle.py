"""Detaching flatview with ``unwrap()``, on each backend configuration."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests import workers as w
from tests.scenarios import BACKENDS, FSDP2, BackendConfig, Scenario, backend_param

if TYPE_CHECKING:
    from tests.conftest import PoolFactory


def check_unwrap(dist_pool: PoolFactory, scenario: Scenario) -> None:
    results = dist_pool(scenario.world_size).run(w.unwrap_restores_plain_fsdp, scenario, timeout=60)
    for result in results:
        assert result == {"flats_back": True, "step_refused": True, "hooks_left": False}, result


@pytest.mark.parametrize("backend", BACKENDS)
def test_unwrap_gives_back_plain_fsdp(dist_pool: PoolFactory, backend: BackendConfig) -> None:
    check_unwrap(dist_pool, backend.scenario(world_size=backend.ranks(2)))


@pytest.mark.parametrize("backend", [backend_param(FSDP2)])
def test_unwrap_gives_back_plain_fsdp2_as_one_unit(
    dist_pool: PoolFactory, backend: BackendConfig
) -> None:
    """FSDP2 with only the root sharded (BACKENDS shards each block too)."""
    check_unwrap(dist_pool, backend.scenario(world_size=2, nested=False))
