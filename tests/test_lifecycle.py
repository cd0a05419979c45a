"""Detaching flatview with ``unwrap()``, on each backend configuration."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests import workers as w
from tests.scenarios import BACKENDS, BackendConfig

if TYPE_CHECKING:
    from tests.conftest import PoolFactory


@pytest.mark.parametrize("backend", BACKENDS)
def test_unwrap_gives_back_plain_fsdp(dist_pool: PoolFactory, backend: BackendConfig) -> None:
    results = dist_pool(backend.ranks(2)).run(
        w.unwrap_restores_plain_fsdp, backend.scenario(), timeout=60
    )
    for result in results:
        assert result == {"flats_back": True, "step_refused": True, "hooks_left": False}, result
