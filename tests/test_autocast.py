"""A forward under ``torch.autocast`` (bfloat16) trains under flatview exactly as on the
bare wrapper: the autocast casts happen on the wrapper's compute tensors, which flatview
leaves alone."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pytest

from tests.scenarios import BACKENDS, GATED, BackendConfig
from tests.workers import plain_and_flatview

if TYPE_CHECKING:
    from tests.conftest import PoolFactory


@pytest.mark.parametrize("backend", BACKENDS)
def test_autocast_trains_as_the_bare_wrapper(
    dist_pool: PoolFactory, backend: BackendConfig
) -> None:
    scenario = backend.scenario(GATED, skips=((),) * 3, autocast=True)
    plain, ours = dist_pool(scenario.world_size).run(plain_and_flatview, scenario, timeout=120)[0]
    assert plain.keys() == ours.keys() and plain
    for name, value in plain.items():
        assert np.array_equal(ours[name], value), name
