"""Shared pytest configuration: hypothesis profiles, the ``slow`` marker, worker pools.

Hypothesis profiles (select with the environment variable ``HYPOTHESIS_PROFILE``):

* ``ci`` (default): few examples, derandomized so that every CI run tries the same
  inputs and a failure reproduces.
* ``thorough``: many random examples; also runs the tests marked ``slow``.

Tests marked ``slow`` are skipped unless ``HYPOTHESIS_PROFILE=thorough`` or ``--runslow``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from tests import scenarios
from tests.dist_pool import WorkerPool

settings.register_profile(
    "ci",
    max_examples=8,
    # Distributed examples take a variable, load-dependent time on a shared 2-core box.
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "thorough",
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
HYPOTHESIS_PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(HYPOTHESIS_PROFILE)

# Each pool keeps world_size processes (a few hundred MB each) alive for the session.
MAX_POOL_WORLD_SIZE = 4


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add ``--runslow``."""
    parser.addoption(
        "--runslow",
        action="store_true",
        default=False,
        help="run tests marked slow (also enabled by HYPOTHESIS_PROFILE=thorough)",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``slow`` marker (harmless if the ini file registers it too)."""
    config.addinivalue_line(
        "markers", "slow: long test; runs with --runslow or the thorough profile"
    )
    # Draws over backend configurations include the thorough-only ones.
    scenarios.THOROUGH = bool(config.getoption("--runslow")) or HYPOTHESIS_PROFILE == "thorough"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``slow`` tests unless asked for."""
    if config.getoption("--runslow") or HYPOTHESIS_PROFILE == "thorough":
        return
    skip = pytest.mark.skip(reason="slow: needs --runslow or HYPOTHESIS_PROFILE=thorough")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


class PoolFactory:
    """``get(world_size)`` returns the session's pool for that world size, starting it lazily."""

    def __init__(self, max_world_size: int = MAX_POOL_WORLD_SIZE) -> None:
        self.max_world_size = max_world_size
        self.pools: dict[int, WorkerPool] = {}

    def __call__(self, world_size: int) -> WorkerPool:
        if not 1 <= world_size <= self.max_world_size:
            raise ValueError(f"world_size must be in 1..{self.max_world_size}, got {world_size}")
        pool = self.pools.get(world_size)
        if pool is None:
            pool = self.pools[world_size] = WorkerPool(world_size)
        # Processes start on the pool's first task, so an unused world size costs nothing.
        return pool

    def shutdown(self) -> None:
        """Stop every pool's workers."""
        for pool in self.pools.values():
            pool.shutdown()


_FACTORIES: list[PoolFactory] = []


@pytest.fixture(scope="session")
def dist_pool() -> Iterator[PoolFactory]:
    """Session-wide factory of reusable gloo worker pools: ``dist_pool(2).run(fn, ...)``."""
    factory = PoolFactory()
    _FACTORIES.append(factory)
    yield factory
    factory.shutdown()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Report what starting worker pools cost: restarts after failures are the suite's
    hidden time (each imports torch in every rank again)."""
    starts = [
        (size, seconds)
        for factory in _FACTORIES
        for size, pool in sorted(factory.pools.items())
        for seconds in pool.startup_seconds
    ]
    if starts:
        by_size = ", ".join(
            f"{size} ranks: {sum(1 for s, _ in starts if s == size)}"
            for size in sorted({s for s, _ in starts})
        )
        total = sum(seconds for _, seconds in starts)
        terminalreporter.write_line(
            f"shared worker pool starts: {len(starts)} ({by_size}), {total:.1f} s in all"
        )
