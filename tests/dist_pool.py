"""Reusable pools of ``torch.distributed`` (gloo) workers for tests.

Starting a process group costs seconds per process (each imports torch and the frameworks,
and rendezvouses), which would dominate a suite of many small distributed tests on a
2-core machine. A :class:`WorkerPool` pays that once: its workers stay alive with an
initialised gloo process group and run one task after another. They are forked from a
server that imported torch, flatview and the frameworks once (``_CTX`` below).

A task is a module-level callable (pickled by reference, so it must be importable from a
fresh interpreter: define it at the top level of a module under ``tests/``) plus pickled
arguments. Every rank runs the same task; a task learns its rank from
``torch.distributed.get_rank()``.

Failure handling is built so that a broken test never stalls the suite:

* an exception on any rank gives the other ranks only a short grace period (they may be
  blocked in a collective the failing rank never joined); ranks still busy after it are
  killed and the pool is respawned on next use;
* a task that outlives its timeout kills the pool and raises :class:`WorkerTimeout` naming
  the ranks that did not answer, with their Python stacks where the platform can dump them;
* after every task the ranks' collective sequence numbers are compared; if they differ
  (some rank issued a collective the others did not), later collectives would pair up with
  the wrong partners, so the pool is respawned before the next task.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import gc
import multiprocessing
import os
import pickle
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

__all__ = ["WorkerError", "WorkerPool", "WorkerTimeout"]

# Workers are forked from one server process that imported torch, flatview and the
# frameworks once: a spawned worker imports them itself, 3-5 s of CPU each, paid by every
# worker of every pool (and every respawn) on a 2-core machine. The server forks before any
# task runs, with one thread, and the test environment's torch is the CPU build (no CUDA
# state to inherit). A module that is not installed is skipped (the server ignores
# ImportError); DeepSpeed is left to its harness, which sets its accelerator on import.
_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(
    [
        "torch",
        "torch.distributed",
        "torch.distributed.fsdp",
        "torch.distributed.tensor",
        "torch.distributed.checkpoint",
        "torch._dynamo",
        "flatview",
        "tests.workers",
        "fairscale",
        "lightning",
        "transformers",
        "accelerate",
    ]
)

# Seconds the other ranks get to finish once one rank has failed. Long enough for ranks
# that fail at the same point to report (they all raise within milliseconds of each
# other), short enough that a rank stuck in a collective costs little.
DEFAULT_ERROR_GRACE = 3.0
# Starting 4 workers on 2 cores (each importing torch) takes a few seconds; the limit only
# guards against a rendezvous that never completes.
DEFAULT_STARTUP_TIMEOUT = 120.0
# Per-collective gloo timeout inside the workers. Hangs are normally cut short by the pool
# killing its workers; this only bounds how long an orphaned worker can linger.
_PG_TIMEOUT = datetime.timedelta(seconds=300)


class WorkerError(Exception):
    """A task raised on one or more ranks.

    Attributes:
        fn_name: qualified name of the task.
        errors: rank -> formatted traceback (plus ``repr`` of the exception) of each rank
            that raised.
        exc_types: rank -> qualified class name of the exception each failing rank raised.
        results: rank -> return value of each rank that finished normally.
        unfinished: ranks that had not finished when the grace period ran out (they were
            killed; the pool is respawned on next use).
        stacks: rank -> Python stack dump of each unfinished rank, where available.
    """

    def __init__(
        self,
        fn_name: str,
        world_size: int,
        errors: dict[int, str],
        exc_types: dict[int, str],
        results: dict[int, Any],
        unfinished: list[int],
        stacks: dict[int, str],
        grace: float,
    ) -> None:
        self.fn_name = fn_name
        self.world_size = world_size
        self.errors = errors
        self.exc_types = exc_types
        self.results = results
        self.unfinished = unfinished
        self.stacks = stacks
        lines = [f"{fn_name} failed on rank(s) {sorted(errors)} of world size {world_size}"]
        if unfinished:
            lines.append(
                f"rank(s) {unfinished} had not finished {grace:g}s after the first failure "
                "(probably waiting in a collective); they were killed and the pool will be "
                "respawned"
            )
        for rank in sorted(errors):
            lines.append(f"----- rank {rank} -----\n{errors[rank].rstrip()}")
        for rank in sorted(stacks):
            lines.append(f"----- rank {rank} (unfinished) stack -----\n{stacks[rank].rstrip()}")
        super().__init__("\n".join(lines))


class WorkerTimeout(AssertionError):
    """A task did not finish on every rank within its timeout; the pool was killed.

    Attributes:
        fn_name: qualified name of the task.
        timeout: the timeout in seconds.
        missing: ranks that did not answer.
        results: rank -> return value of the ranks that did finish.
        stacks: rank -> Python stack dump of each missing rank, where available.
    """

    def __init__(
        self,
        fn_name: str,
        timeout: float,
        missing: list[int],
        results: dict[int, Any],
        stacks: dict[int, str],
    ) -> None:
        self.fn_name = fn_name
        self.timeout = timeout
        self.missing = missing
        self.results = results
        self.stacks = stacks
        lines = [
            f"{fn_name} did not finish within {timeout:g}s on rank(s) {missing}; "
            "the worker pool was killed and will be respawned on next use"
        ]
        for rank in sorted(stacks):
            lines.append(f"----- rank {rank} stack -----\n{stacks[rank].rstrip()}")
        super().__init__("\n".join(lines))


@dataclass
class _Outcome:
    results: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    exc_types: dict[int, str] = field(default_factory=dict)
    seqs: dict[int, dict[str, int] | None] = field(default_factory=dict)
    # Ranks whose task destroyed the default process group.
    lost_group: set[int] = field(default_factory=set)


# Pools alive in this process, so an interpreter exit that skips the fixture finaliser
# still reaps the workers.
_LIVE_POOLS: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


@atexit.register
def _shutdown_live_pools() -> None:
    for pool in list(_LIVE_POOLS):
        pool.shutdown()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _qualname(fn: Callable[..., Any]) -> str:
    module = getattr(fn, "__module__", None) or "?"
    name = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{module}.{name}"


class WorkerPool:
    """``world_size`` worker processes, each rank of one gloo process group, reused across tasks.

    Workers start lazily on the first :meth:`run`, and again after a failure that left them
    in an unknown state. Use as a context manager or call :meth:`shutdown`.
    """

    def __init__(
        self,
        world_size: int,
        *,
        error_grace: float = DEFAULT_ERROR_GRACE,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.error_grace = error_grace
        self.startup_timeout = startup_timeout
        # Wall-clock seconds of every (re)start, for reporting suite start-up cost.
        self.startup_seconds: list[float] = []
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        self._dump_dir: str | None = None
        self._next_task = 0
        self._lock = threading.Lock()
        _LIVE_POOLS.add(self)

    # ----------------------------------------------------------------- lifecycle

    @property
    def started(self) -> bool:
        """Whether worker processes are currently running."""
        return bool(self._procs)

    @property
    def pids(self) -> list[int]:
        """Process ids of the current workers, by rank (empty when not started)."""
        return [p.pid for p in self._procs if p.pid is not None]

    def start(self) -> None:
        """Spawn the workers and wait until every rank has joined the process group."""
        if self._procs:
            return
        last_error = ""
        # The free port is only free when probed; another process may take it before rank 0
        # binds it, so a failed rendezvous is retried on a fresh port.
        for _attempt in range(3):
            t0 = time.perf_counter()
            last_error = self._try_start()
            if not last_error:
                self.startup_seconds.append(time.perf_counter() - t0)
                return
        raise RuntimeError(f"could not start a {self.world_size}-process gloo pool:\n{last_error}")

    def _try_start(self) -> str:
        port = _free_port()
        self._dump_dir = tempfile.mkdtemp(prefix="dist_pool_")
        for rank in range(self.world_size):
            parent_conn, child_conn = _CTX.Pipe(duplex=True)
            dump_path = os.path.join(self._dump_dir, f"rank{rank}.stack")
            proc = _CTX.Process(
                target=_worker_main,
                args=(rank, self.world_size, port, child_conn, dump_path),
                name=f"dist_pool-ws{self.world_size}-rank{rank}",
                # Not daemonic: daemonic processes may not have children, and a task may
                # legitimately start some (e.g. a DataLoader with workers).
                daemon=False,
            )
            proc.start()
            # Close our copy of the child's end so a dying worker shows up as EOF.
            child_conn.close()
            self._procs.append(proc)
            self._conns.append(parent_conn)

        deadline = time.monotonic() + self.startup_timeout
        waiting = dict(enumerate(self._conns))
        problems: list[str] = []
        while waiting and time.monotonic() < deadline:
            for rank in _ready_ranks(waiting, deadline - time.monotonic()):
                conn = waiting.pop(rank)
                try:
                    kind, detail = conn.recv()
                except (EOFError, OSError):
                    problems.append(f"rank {rank} exited during start-up")
                    continue
                if kind != "ready":
                    problems.append(f"rank {rank} failed to start:\n{detail}")
            if problems:
                break
        if waiting and not problems:
            problems.append(
                f"rank(s) {sorted(waiting)} did not join within {self.startup_timeout:g}s"
            )
        if problems:
            self.kill()
            return "\n".join(problems)
        return ""

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the workers to exit cleanly; kill any that do not within ``timeout`` seconds."""
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Kill the workers at once (they may be stuck in a collective); restart on next use."""
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(5.0)
        for conn in self._conns:
            conn.close()
        self._procs = []
        self._conns = []
        if self._dump_dir is not None:
            shutil.rmtree(self._dump_dir, ignore_errors=True)
            self._dump_dir = None

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # --------------------------------------------------------------------- tasks

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank and return the results, indexed by rank.

        ``fn`` must be a module-level function importable by the workers. ``timeout`` (seconds)
        is reserved and not passed to ``fn``.

        Raises:
            WorkerError: some rank raised; carries every failing rank's traceback.
            WorkerTimeout: some rank did not finish within ``timeout``; the pool was killed.
        """
        outcome = self._execute(fn, args, kwargs, timeout)
        if outcome.errors:
            raise self._worker_error(fn, outcome, [], {})
        return [outcome.results[rank] for rank in range(self.world_size)]

    def run_expecting_error(
        self,
        fn: Callable[..., Any],
        *args: Any,
        match: str,
        ranks: Iterable[int] | None = None,
        timeout: float = 120.0,
        **kwargs: Any,
    ) -> WorkerError:
        """Run ``fn`` on every rank and assert that each rank in ``ranks`` raised.

        ``match`` is a regular expression searched for (``re.search``) in each failing rank's
        formatted traceback, which ends with the exception's ``repr``. ``ranks`` defaults to
        all ranks; ranks outside it may fail or succeed. ``match``, ``ranks`` and ``timeout``
        are reserved and not passed to ``fn``.

        Returns:
            The :class:`WorkerError`, for further checks on ``errors`` / ``exc_types``.

        Raises:
            AssertionError: an expected rank returned normally, or its error did not match.
            WorkerTimeout: some rank did not finish within ``timeout``.
        """
        expected = list(range(self.world_size)) if ranks is None else sorted(set(ranks))
        try:
            self.run(fn, *args, timeout=timeout, **kwargs)
        except WorkerError as err:
            problems = []
            for rank in expected:
                if rank in err.errors:
                    if not re.search(match, err.errors[rank]):
                        problems.append(f"rank {rank} raised, but not matching {match!r}")
                elif rank in err.unfinished:
                    problems.append(f"rank {rank} did not finish")
                else:
                    problems.append(f"rank {rank} returned {err.results.get(rank)!r}")
            if problems:
                raise AssertionError(
                    f"expected {_qualname(fn)} to raise on rank(s) {expected}: "
                    + "; ".join(problems)
                    + f"\n{err}"
                ) from err
            return err
        raise AssertionError(
            f"expected {_qualname(fn)} to raise on rank(s) {expected}, but every rank returned"
        )

    def _worker_error(
        self,
        fn: Callable[..., Any],
        outcome: _Outcome,
        unfinished: list[int],
        stacks: dict[int, str],
    ) -> WorkerError:
        return WorkerError(
            _qualname(fn),
            self.world_size,
            outcome.errors,
            outcome.exc_types,
            outcome.results,
            unfinished,
            stacks,
            self.error_grace,
        )

    def _execute(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float
    ) -> _Outcome:
        try:
            payload = pickle.dumps((fn, args, kwargs))
        except Exception as exc:
            raise TypeError(
                f"cannot send {_qualname(fn)} and its arguments to the workers: {exc!r}. "
                "Tasks must be module-level functions in an importable module."
            ) from exc
        with self._lock:
            self.start()
            task_id = self._next_task
            self._next_task += 1
            try:
                return self._collect(fn, task_id, payload, timeout)
            except BaseException:
                # Interrupted (KeyboardInterrupt, pytest-timeout) or a protocol failure: the
                # workers are in an unknown state.
                self.kill()
                raise

    def _collect(
        self, fn: Callable[..., Any], task_id: int, payload: bytes, timeout: float
    ) -> _Outcome:
        for conn in self._conns:
            conn.send((task_id, payload))
        outcome = _Outcome()
        pending = dict(enumerate(self._conns))
        broken = False
        deadline = time.monotonic() + timeout
        grace_deadline: float | None = None
        while pending:
            limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                break
            for rank in _ready_ranks(pending, remaining):
                try:
                    data = pending[rank].recv_bytes()
                except (EOFError, OSError):
                    del pending[rank]
                    broken = True
                    proc = self._procs[rank]
                    proc.join(1.0)
                    outcome.errors[rank] = (
                        f"worker process for rank {rank} died (exit code {proc.exitcode})"
                    )
                    outcome.exc_types[rank] = "WorkerDied"
                    continue
                try:
                    reply_id, status, value, seqs, group_alive = pickle.loads(data)
                except Exception:
                    # E.g. a result of a class this process cannot import.
                    del pending[rank]
                    outcome.errors[rank] = "cannot unpickle the reply:\n" + traceback.format_exc()
                    outcome.exc_types[rank] = "UnpicklableReply"
                    outcome.seqs[rank] = None
                else:
                    if reply_id != task_id:
                        # Cannot happen while the pool is killed whenever a task is abandoned;
                        # kept so that a stray reply can never be taken for this task's.
                        continue
                    del pending[rank]
                    outcome.seqs[rank] = seqs
                    if not group_alive:
                        outcome.lost_group.add(rank)
                    if status == "ok":
                        outcome.results[rank] = value
                    else:
                        exc_type, text = value
                        outcome.errors[rank] = text
                        outcome.exc_types[rank] = exc_type
                if rank in outcome.errors and grace_deadline is None:
                    grace_deadline = time.monotonic() + self.error_grace

        if pending:
            missing = sorted(pending)
            stacks = self._dump_stacks(missing)
            self.kill()
            if outcome.errors:
                raise self._worker_error(fn, outcome, missing, stacks)
            raise WorkerTimeout(_qualname(fn), timeout, missing, outcome.results, stacks)
        if broken or outcome.lost_group or not _sequences_agree(outcome.seqs):
            # A dead worker, a destroyed process group, or ranks that disagree on how many
            # collectives they issued (the next collective would pair up with the wrong
            # partners): start afresh.
            self.kill()
        return outcome

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask stuck workers for their Python stacks (faulthandler on SIGUSR1)."""
        if self._dump_dir is None or not hasattr(signal, "SIGUSR1"):
            return {}
        for rank in ranks:
            proc = self._procs[rank]
            if proc.pid is not None and proc.is_alive():
                with contextlib.suppress(OSError):
                    os.kill(proc.pid, signal.SIGUSR1)
        # faulthandler writes from a signal handler at once; a short pause lets it land.
        time.sleep(0.3)
        stacks = {}
        for rank in ranks:
            path = os.path.join(self._dump_dir, f"rank{rank}.stack")
            with contextlib.suppress(OSError), open(path) as f:
                text = f.read()
                if text.strip():
                    stacks[rank] = text
        return stacks


def _ready_ranks(conns: dict[int, Connection], timeout: float) -> list[int]:
    """Ranks whose connection has a message (or EOF) within ``timeout`` seconds."""
    ready = {id(obj) for obj in wait(list(conns.values()), max(0.0, timeout))}
    return [rank for rank, conn in conns.items() if id(conn) in ready]


def _sequences_agree(seqs: dict[int, dict[str, int] | None]) -> bool:
    per_group: dict[str, set[int]] = {}
    for group_seqs in seqs.values():
        if group_seqs is None:
            continue
        for name, seq in group_seqs.items():
            per_group.setdefault(name, set()).add(seq)
    return all(len(values) == 1 for values in per_group.values())


# ------------------------------------------------------------------------ worker side


def _group_sequence_numbers() -> dict[str, int] | None:
    """Collective sequence number of every process group this rank belongs to.

    Uses private c10d state; returns None (no check) where this torch lacks it.
    """
    try:
        import torch.distributed.distributed_c10d as c10d

        groups: list[Any] = list(c10d._world.pg_map)
        return {
            str(c10d._world.pg_names[pg]): int(pg._get_sequence_number_for_group()) for pg in groups
        }
    except Exception:
        return None


def _watch_parent(parent_pid: int) -> None:
    # A worker stuck in a collective never reads its pipe, so it would not notice a killed
    # pytest; polling the parent pid bounds how long it can outlive the suite.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def _freeze_imports(known: int) -> int:
    """Move what is alive to the collector's permanent generation when tasks imported
    modules since last time (``known``: how many were loaded then); the number now.

    ``flatview.wrap`` looks for an enclosing wrapper unit with one referrer search of
    the collector's generations (``flatview.backends.nesting``), a pass over every
    object they track: some 400,000 once the frameworks are imported, 30 to 65 ms per
    wrap on this machine, on every rank of every task. Frozen objects are not searched
    and never collected: what is alive after a collection is frozen, only when the set
    of modules grew, so what gets frozen is what the imports made (and what tasks keep
    between them), not the models tasks make and drop."""
    loaded = len(sys.modules)
    if loaded != known:
        gc.collect()
        gc.freeze()
    return loaded


def _worker_main(rank: int, world_size: int, port: int, conn: Connection, dump_path: str) -> None:
    """Entry point of one worker: join the process group, then run tasks until told to stop."""
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    if hasattr(signal, "SIGUSR1"):
        dump_file = open(dump_path, "w")  # noqa: SIM115 - must stay open for the handler
        faulthandler.register(signal.SIGUSR1, file=dump_file, all_threads=True)

    import torch
    import torch.distributed as dist

    # One core per worker at most: with several workers on a 2-core machine, intra-op
    # threads would only contend.
    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=_PG_TIMEOUT,
        )
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))

    modules = _freeze_imports(0)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        if message is None:
            break
        task_id, payload = message
        try:
            fn, args, kwargs = pickle.loads(payload)
            reply = (task_id, "ok", fn(*args, **kwargs))
            data = pickle.dumps((*reply, _group_sequence_numbers(), dist.is_initialized()))
            modules = _freeze_imports(modules)
        except BaseException as exc:
            text = "".join(traceback.format_exception(exc)) + f"\n{exc!r}"
            error = (f"{type(exc).__module__}.{type(exc).__qualname__}", text)
            data = pickle.dumps(
                (task_id, "error", error, _group_sequence_numbers(), dist.is_initialized())
            )
        try:
            conn.send_bytes(data)
        except (EOFError, OSError):
            break

    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    # Skip interpreter teardown (finalising torch and whatever tasks imported takes
    # seconds, paid at the end of every session); there is nothing left to clean up.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
