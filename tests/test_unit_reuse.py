"""A unit applied several times in one forward (weight sharing across depth, as in
ALBERT or universal transformers) trains under flatview as the unwrapped model, with
the shared block's gate skipped or the whole block skipped in some steps, and under
activation checkpointing too."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests.scenarios import BACKENDS, GATED, BackendConfig, check_equivalent

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

TIMEOUT = 120.0


@pytest.mark.parametrize("recompute", ["", "inside-plain"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_unit_applied_three_times_per_forward(
    dist_pool: PoolFactory, backend: BackendConfig, recompute: str
) -> None:
    scenario = backend.scenario(GATED, first_block_calls=3, recompute=recompute)
    check_equivalent(dist_pool, scenario, timeout=TIMEOUT)
