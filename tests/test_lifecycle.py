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


HOOKED = (
    BackendConfig("ddp"),
    BackendConfig("torch", "FULL_SHARD"),
    BackendConfig("torch", "NO_SHARD"),
)


@pytest.mark.parametrize("backend", [backend_param(c, ci=True) for c in HOOKED])
def test_comm_hook_registered_after_wrap_is_refused(
    dist_pool: PoolFactory, backend: BackendConfig
) -> None:
    """A communication hook registered after the wrap (fp16 compression): flatview reduces
    the gradients itself, so on DDP and torch ``NO_SHARD`` computed on views the hook was
    bypassed in silence (DDP trained 6e-5 away from bare DDP with the hook); on sharded
    torch FSDP1 torch's assertion failed. Refused on every rank, as at the wrap; after
    ``unwrap()`` bare training takes the hook."""
    scenario = backend.scenario(world_size=2)
    for out in dist_pool(2).run(w.comm_hook_after_wrap, scenario, timeout=60):
        assert out["error"].startswith("StateError: "), out
        assert "register_comm_hook" in out["error"] and "unwrap" in out["error"], out
        assert out["bare"] == "trained"
