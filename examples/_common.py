"""Launching and data helpers shared by the examples (not part of the flatview API).

One script runs both ways:

* ``python examples/<script>.py``: no launcher in sight, so the script spawns
  ``--world-size`` CPU processes itself and connects them over gloo on localhost.
* ``torchrun ... examples/<script>.py``: the launcher set ``RANK``/``WORLD_SIZE``/
  ``LOCAL_RANK``, so this process is one rank; it joins the launcher's group (NCCL and
  ``cuda:LOCAL_RANK`` when CUDA is there, gloo and CPU otherwise).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# A worker exits with this code when the run cannot go on for a reason it has already
# explained (e.g. a backend this flatview does not support); the parent then exits with
# it too instead of printing the spawn machinery's traceback.
EXIT_EXPLAINED = 3


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    launcher: str
    """``"torchrun"`` (environment from a launcher) or ``"spawn"`` (we started it)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def on_cpu(self) -> bool:
        return self.device.type == "cpu"


Entry = Callable[[DistEnv, Any], None]


def launched_externally() -> bool:
    """Whether a launcher (torchrun, SLURM wrappers, ...) made this process one rank."""
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def launch(entry: Entry, args: Any, world_size: int) -> int:
    """Run ``entry(env, args)`` on every rank; return the exit code for the script.

    ``entry`` must be a module-level function (spawned processes import it by name).
    """
    if launched_externally():
        with _process_group_from_env() as env:
            entry(env, args)
        return 0
    port = _free_port()
    try:
        mp.start_processes(
            _spawned,
            args=(entry, args, world_size, port),
            nprocs=world_size,
            start_method="spawn",
        )
    except mp.ProcessExitedException as exc:
        if exc.exit_code == EXIT_EXPLAINED:
            return EXIT_EXPLAINED
        raise
    return 0


def _spawned(rank: int, entry: Entry, args: Any, world_size: int, port: int) -> None:
    # Two processes on a small machine: one intra-op thread each, or they fight for cores.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    env = DistEnv(rank, world_size, rank, torch.device("cpu"), "spawn")
    try:
        entry(env, args)
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _process_group_from_env() -> Iterator[DistEnv]:
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        # FSDP picks its compute device from the current CUDA device.
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend)
    env = DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, device, "torchrun")
    try:
        yield env
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def explain_and_exit(env: DistEnv, message: str) -> None:
    """Print ``message`` once (rank 0) and end this rank with :data:`EXIT_EXPLAINED`
    (the process group is torn down on the way out, by whoever set it up)."""
    if env.is_main:
        print(message, file=sys.stderr, flush=True)
    sys.exit(EXIT_EXPLAINED)


def quiet_known_warnings() -> None:
    """Silence deprecation chatter a newcomer can do nothing about: fairscale 0.4.13 uses
    ``TypedStorage``, and torch renamed the tensor forms of some collectives."""
    warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated")


@contextlib.contextmanager
def fairscale_runtime(env: DistEnv) -> Iterator[None]:
    """fairscale's FSDP assumes CUDA; on a CPU rank, run it under flatview's CPU stand-ins."""
    if not env.on_cpu:
        yield
        return
    from flatview.testing import fairscale_on_cpu

    with fairscale_on_cpu():
        yield


@contextlib.contextmanager
def deepspeed_runtime(env: DistEnv) -> Iterator[None]:
    """DeepSpeed on a CPU rank: its CPU accelerator, plain gloo collectives, no op built
    (flatview's test aid); on GPUs as it is."""
    if not env.on_cpu:
        yield
        return
    from flatview.testing import deepspeed_on_cpu

    with deepspeed_on_cpu():
        yield


@dataclass(frozen=True)
class Digits:
    """scikit-learn's 8x8 handwritten digits (shipped with the package: no download)."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def load_digits(seed: int, test_fraction: float = 0.2) -> Digits:
    """A fixed train / held-out split (the same on every rank for the same seed),
    standardised with the training set's statistics."""
    from sklearn.datasets import load_digits as sk_load_digits

    data = sk_load_digits()
    images = torch.tensor(data.images, dtype=torch.float32)
    labels = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(images) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    mean, std = images[train].mean(), images[train].std()
    images = (images - mean) / std
    return Digits(images[train], labels[train], images[test], labels[test])
