"""Does masking the all-gather of a partly skipped flat parameter pay?

A forward pass reads only the used segments of a flat parameter, so in principle only
those need gathering. Masking costs a pack (gather of the used elements) before, and an
unpack (scatter into the unsharded buffer) after, the collective. This measures, side by
side in one run on 2 processes over gloo, a plain all-gather of the whole flat
parameter against a masked one, for several used fractions.

Run: python benchmarks/micro_allgather.py
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

NUMEL = 12 * (512 * 512 + 512)  # one unit holding 12 residual blocks of 512x512
REPEATS = 15


def _time(fn: object) -> float:
    times = []
    for _ in range(REPEATS):
        dist.barrier()
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _masked_gather(
    local: torch.Tensor,
    full: torch.Tensor,
    packed: torch.Tensor,
    gathered: torch.Tensor,
    mine: list[tuple[int, int]],
    per_rank: list[list[tuple[int, int]]],
    count: int,
    width: int,
) -> None:
    torch.cat([local[a:b] for a, b in mine], out=packed[:count])
    dist.all_gather_into_tensor(gathered, packed)
    for r, runs in enumerate(per_rank):
        offset = r * width
        for a, b in runs:
            full[a:b] = gathered[offset : offset + b - a]
            offset += b - a


def worker(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    shard = -(-NUMEL // world)
    local = torch.randn(shard)
    full = torch.empty(shard * world)
    plain = _time(lambda: dist.all_gather_into_tensor(full, local))
    rows = []
    blocks = 12
    size = NUMEL // blocks
    for fraction in (1.0, 0.75, 0.5, 0.25):
        # Used blocks spread evenly over the model, so over the shards too (the best
        # case for masking: little padding to the largest rank); runs are packed and
        # unpacked by slicing, as flatview's reducer does.
        used_blocks = sorted({round(i / fraction) for i in range(round(blocks * fraction))})
        runs = [(b * size, (b + 1) * size) for b in used_blocks if b < blocks]
        per_rank = []
        for r in range(world):
            lo, hi = r * shard, (r + 1) * shard
            per_rank.append([(max(a, lo), min(b, hi)) for a, b in runs if min(b, hi) > max(a, lo)])
        counts = [sum(b - a for a, b in rr) for rr in per_rank]
        width = max(counts)
        packed = torch.zeros(width)
        gathered = torch.empty(width * world)
        mine = [(a - rank * shard, b - rank * shard) for a, b in per_rank[rank]]

        masked = functools.partial(
            _masked_gather, local, full, packed, gathered, mine, per_rank, counts[rank], width
        )
        rows.append((fraction, width * world / NUMEL, _time(masked)))
    if rank == 0:
        print(f"plain all-gather of {NUMEL * 4 / 2**20:.1f} MiB: {plain * 1e3:.2f} ms")
        print("| used fraction | masked bytes / plain | masked / plain time |")
        print("|---|---|---|")
        for fraction, moved, t in rows:
            print(f"| {fraction:.2f} | {moved:.2f} | {t / plain:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    mp.spawn(worker, args=(world, 29000 + os.getpid() % 1000), nprocs=world)
