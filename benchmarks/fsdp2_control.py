"""What flatview's two control collectives cost on FSDP2, before and after overlapping them.

flatview adds two tiny collectives per FSDP2 step: the skip-set check (an all-gather of a
fingerprint, with the check on) and the flags that catch undeclared unused parameters
(an all-reduce at the end of the backward). This trains, side by side in the same 2
processes over gloo with their steps interleaved, the model of ``bench_skip.py`` (FSDP2
per block) as:

* ``plain``: bare FSDP2;
* ``old``: flatview with the earlier schedule, emulated: the flags started and waited
  for together at the end of the backward;
* ``new``: flatview as it is (the flags start at the last parameter group's
  post_backward, alongside its reduce-scatter, and are waited for at the end of the
  backward);
* ``new_off``, ``old_off``: the same with the check off (the flags only).

and prints each one's median step time, its ratio to bare FSDP2 and the host's time
per step inside the two control collectives (start and wait), which is the robust
number on a shared machine: step-time ratios move by several percent between runs
there, the wait barely does.

Run: python benchmarks/fsdp2_control.py [steps] [skip|none] [variants, comma-separated]
"""

from __future__ import annotations

import collections
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_skip as bench

WAIT: dict[str | None, float] = collections.defaultdict(float)
CURRENT: list[str | None] = [None]


def _timed(owner: Any, name: str) -> None:
    original = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            WAIT[CURRENT[0]] += time.perf_counter() - started

    setattr(owner, name, timed)


def _old_schedule(trainer: bench.Trainer) -> bench.Trainer:
    """The schedule before: flags started and awaited together."""
    adapter = trainer.flatview.adapter
    start = type(adapter)._start_flags
    adapter._start_flags = lambda: None

    def exchange() -> tuple[list[int], list[int]]:
        start(adapter)
        flags, adapter._flags = adapter._flags, None
        if flags is None:
            lacking = sorted(adapter.runtime.plain_used_so_far() - adapter._contributions.gave)
            return lacking, lacking
        return flags.lacked(), flags.unused()

    adapter._exchange_flags = exchange
    return trainer


def worker(rank: int, port: int, steps: int, skip: bool, variants: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import flatview.comm.agreement as agreement
    import flatview.comm.unused as unused

    for owner, name in (
        (agreement.Agreement, "__init__"),
        (agreement.Agreement, "settle"),
        (unused.UsageFlags, "exchanged"),
        (unused.UsageFlags, "lacked"),
        (unused.UsageFlags, "unused"),
    ):
        _timed(owner, name)
    cfg = bench.Config()
    builders: dict[str, Callable[[], bench.Trainer]] = {
        "plain": lambda: bench.build_torch_fsdp2(cfg),
        "old": lambda: _old_schedule(bench._flatview_fsdp2(True)(cfg)),
        "new": lambda: bench._flatview_fsdp2(True)(cfg),
        "new_off": lambda: bench._flatview_fsdp2(False)(cfg),
        "old_off": lambda: _old_schedule(bench._flatview_fsdp2(False)(cfg)),
    }
    trainers = {k: builders[k]() for k in variants}
    batches = bench.make_batches(cfg, steps, rank)
    masks = bench.skip_masks(cfg, steps) if skip else [[] for _ in range(steps)]
    times: dict[str, list[float]] = collections.defaultdict(list)
    keys = list(trainers)
    for i in range(steps):
        for key in keys if i % 2 == 0 else keys[::-1]:
            CURRENT[0] = key if i >= cfg.warmup else None
            started = time.perf_counter()
            trainers[key].step(*batches[i], masks[i])
            if i >= cfg.warmup:
                times[key].append(time.perf_counter() - started)
    if rank == 0:
        base = statistics.median(times[keys[0]])
        for key in keys:
            ts = times[key]
            print(
                f"{key:8s} median {1e3 * statistics.median(ts):7.2f} ms"
                f"  / {keys[0]} {statistics.median(ts) / base:.3f}"
                f"  control ms/step {1e3 * WAIT[key] / len(ts):.3f}",
                flush=True,
            )
    dist.destroy_process_group()


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 85
    skip = len(sys.argv) > 2 and sys.argv[2] == "skip"
    variants = (sys.argv[3] if len(sys.argv) > 3 else "plain,old,new,new_off").split(",")
    mp.start_processes(
        worker,
        args=(bench._free_port(), steps, skip, variants),
        nprocs=2,
        start_method="spawn",
    )


if __name__ == "__main__":
    main()
