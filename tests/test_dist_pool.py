"""Tests of the reusable gloo worker pool (tests/dist_pool.py)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.distributed as dist

from tests.dist_pool import WorkerError, WorkerPool, WorkerTimeout, _sequences_agree

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

# ----------------------------------------------------------------- worker tasks
# Module level so that they pickle by reference into the workers.


def task_rank_info(a: int, *, b: int) -> tuple[int, int, int, int]:
    """Rank, world size and the arguments, to check routing."""
    return dist.get_rank(), dist.get_world_size(), a, b


def task_all_reduce_rank() -> torch.Tensor:
    """Sum of ranks over the group: proves the process group works."""
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t


def task_pid() -> int:
    """The worker's process id, to tell whether the pool was respawned."""
    return os.getpid()


def task_fail_on_rank(bad_rank: int) -> str:
    """Raise on one rank, return on the others."""
    if dist.get_rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    return "fine"


def task_fail_on_rank_while_others_wait(bad_rank: int) -> None:
    """One rank raises, the others block in a collective it never joins."""
    if dist.get_rank() == bad_rank:
        raise RuntimeError("failing before the all_reduce")
    dist.all_reduce(torch.ones(1))


def task_fail_everywhere(message: str) -> None:
    """Every rank raises the same error."""
    raise ValueError(f"{message} (rank {dist.get_rank()})")


def task_hang_on_rank_zero() -> None:
    """Rank 0 waits in an all_reduce that no other rank joins."""
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))


def task_die_on_rank(bad_rank: int) -> None:
    """A rank's process exits abruptly (as a segfault would)."""
    if dist.get_rank() == bad_rank:
        os._exit(3)


def task_unpicklable_result() -> Any:
    """A result that cannot be sent back."""
    return lambda: None


# ------------------------------------------------------------------------ tests


def _pids(dist_pool: PoolFactory, world_size: int = 2) -> list[int]:
    return list(dist_pool(world_size).run(task_pid))


def test_results_come_back_per_rank(dist_pool: PoolFactory) -> None:
    pool = dist_pool(2)
    assert pool.run(task_rank_info, 7, b=9) == [(0, 2, 7, 9), (1, 2, 7, 9)]
    totals = pool.run(task_all_reduce_rank)
    assert [t.item() for t in totals] == [1.0, 1.0]


def test_factory_caches_one_pool_per_world_size(dist_pool: PoolFactory) -> None:
    assert dist_pool(2) is dist_pool(2)
    with pytest.raises(ValueError):
        dist_pool(5)


def test_error_on_one_rank_is_reported_and_pool_survives(dist_pool: PoolFactory) -> None:
    before = _pids(dist_pool)
    with pytest.raises(WorkerError) as info:
        dist_pool(2).run(task_fail_on_rank, 1)
    err = info.value
    assert sorted(err.errors) == [1]
    assert err.results == {0: "fine"}
    assert err.exc_types[1] == "builtins.ValueError"
    # The message carries the worker's traceback: file, function and exception.
    message = str(err)
    assert "task_fail_on_rank" in message
    assert "test_dist_pool.py" in message
    assert "deliberate failure on rank 1" in message
    # Every rank answered and no collective was left half-done: the same workers go on.
    assert _pids(dist_pool) == before


@pytest.fixture(scope="module")
def own_pool() -> Iterator[WorkerPool]:
    """A pool of its own for the tests that kill their workers: the suite's shared pool
    keeps its workers, and with them the frameworks they imported (restarted, each rank
    imports Lightning, DeepSpeed and transformers again, seconds each on 2 cores)."""
    with WorkerPool(2) as pool:
        yield pool


@pytest.mark.slow  # restarts the pool; the hang test below covers the restart in CI
def test_error_while_peer_is_stuck_restarts_pool(
    own_pool: WorkerPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = own_pool
    monkeypatch.setattr(pool, "error_grace", 1.0)
    before = pool.run(task_pid)
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        pool.run(task_fail_on_rank_while_others_wait, 1, timeout=60)
    # Bounded by the grace period, not by the 60 s timeout.
    assert time.monotonic() - start < pool.error_grace + 10
    err = info.value
    assert sorted(err.errors) == [1]
    assert err.unfinished == [0]
    assert "failing before the all_reduce" in str(err)
    assert not pool.started
    after = pool.run(task_pid)
    assert set(after).isdisjoint(before)
    assert [t.item() for t in pool.run(task_all_reduce_rank)] == [1.0, 1.0]


def test_hang_raises_timeout_and_pool_recovers(own_pool: WorkerPool) -> None:
    pool = own_pool
    pool.run(task_pid)  # start outside the timed region
    start = time.monotonic()
    with pytest.raises(WorkerTimeout) as info:
        pool.run(task_hang_on_rank_zero, timeout=2.0)
    assert time.monotonic() - start < 2.0 + 8
    err = info.value
    assert err.missing == [0]
    assert err.results == {1: None}
    assert "task_hang_on_rank_zero" in str(err)
    assert "rank(s) [0]" in str(err)
    if 0 in err.stacks:  # faulthandler dump, where the platform has SIGUSR1
        assert "all_reduce" in err.stacks[0]
    assert isinstance(err, AssertionError)
    assert [t.item() for t in pool.run(task_all_reduce_rank)] == [1.0, 1.0]


def test_run_expecting_error(dist_pool: PoolFactory) -> None:
    pool = dist_pool(2)
    err = pool.run_expecting_error(task_fail_everywhere, "bad input", match=r"bad input \(rank")
    assert sorted(err.errors) == [0, 1]
    assert "rank 1" in err.errors[1]
    # A rank that does not raise, or raises something else, fails the expectation.
    with pytest.raises(AssertionError, match=r"rank 0 returned 'fine'"):
        pool.run_expecting_error(task_fail_on_rank, 1, match="deliberate")
    pool.run_expecting_error(task_fail_on_rank, 1, match="deliberate", ranks=[1])
    with pytest.raises(AssertionError, match="not matching"):
        pool.run_expecting_error(task_fail_everywhere, "bad input", match="something else")
    with pytest.raises(AssertionError, match="every rank returned"):
        pool.run_expecting_error(task_pid, match="")


def test_dead_worker_is_reported_and_replaced(own_pool: WorkerPool) -> None:
    pool = own_pool
    with pytest.raises(WorkerError, match=r"rank 1 died \(exit code 3\)") as info:
        pool.run(task_die_on_rank, 1)
    assert info.value.exc_types[1] == "WorkerDied"
    assert not pool.started
    assert [t.item() for t in pool.run(task_all_reduce_rank)] == [1.0, 1.0]


def test_unsendable_task_and_result(dist_pool: PoolFactory) -> None:
    pool = dist_pool(2)
    with pytest.raises(TypeError, match="module-level"):
        pool.run(lambda: None)
    err = pool.run_expecting_error(task_unpicklable_result, match="pickle")
    assert sorted(err.errors) == [0, 1]
    assert pool.run(task_rank_info, 1, b=2)[1] == (1, 2, 1, 2)


def test_sequence_check() -> None:
    assert _sequences_agree({0: {"0": 5}, 1: {"0": 5}})
    assert _sequences_agree({0: None, 1: {"0": 5}})
    # Subgroups a rank is not in are simply absent from its map.
    assert _sequences_agree({0: {"0": 5, "1": 2}, 1: {"0": 5}})
    assert not _sequences_agree({0: {"0": 5}, 1: {"0": 6}})
