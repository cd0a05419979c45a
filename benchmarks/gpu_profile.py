"""Where flatview spends a step on one GPU: + DDP against DDP ``find_unused_parameters``,
+ torch FSDP1 against torch FSDP1 alone.

A companion of ``gpu_smoke.py`` for a lent GPU machine (NCCL, world size 1). For each
variant it measures, side by side in one process:

* the median step time with a device synchronisation after every step (latency), and
  the time of all steps with one synchronisation at the end (throughput: the host may
  run ahead of the GPU, as it does in training);
* every host-device synchronisation the step makes (``torch.cuda.set_sync_debug_mode``),
  with the flatview line that caused it;
* a ``torch.profiler`` table of the operators with most host time (``--tables``).

    python benchmarks/gpu_profile.py --out results/gpu_profile     # sizes: see --sizes

Without a GPU it runs over gloo on CPU (no synchronisation report), so it can be checked
anywhere.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).parent))
import bench_skip as bench
from gpu_smoke import _step, recording_syncs, start_one_process

import flatview

VARIANTS = (
    "ddp_find_unused",
    "flatview_ddp",
    "flatview_ddp_no_overlap",
    "flatview_ddp_no_check",
    "torch_fsdp1_plain",
    "flatview_torch_fsdp1",
)
"""DDP variants are compared with ``ddp_find_unused``; torch FSDP1 per block (``NO_SHARD``
at world size 1; skipped blocks are not called, so bare FSDP1 handles the skips too)
with flatview against without."""


class Run:
    """One variant's model, optimizer and data."""

    def __init__(self, variant: str, cfg: bench.Config, device: torch.device, n: int) -> None:
        ids = [device.index or 0] if device.type == "cuda" else None
        net = bench.make_net(cfg).to(device)
        self.model: nn.Module
        if "torch_fsdp1" in variant:
            from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy

            policy = ModuleWrapPolicy({bench.Block})
            self.model = TorchFSDP(net, auto_wrap_policy=policy, device_id=device)
        else:
            find_unused = variant == "ddp_find_unused"
            self.model = DDP(net, device_ids=ids, find_unused_parameters=find_unused)
        self.fv: Any = None
        self.check = variant != "flatview_ddp_no_check"
        if variant == "flatview_torch_fsdp1":
            self.fv = flatview.wrap(self.model)
        elif variant.startswith("flatview"):
            overlap = variant != "flatview_ddp_no_overlap"
            self.fv = flatview.wrap(self.model, overlap_reduction=overlap)
        self.opt = torch.optim.SGD((self.fv or self.model).parameters(), lr=cfg.lr, momentum=0.9)
        self.masks = bench.skip_masks(cfg, n)
        self.batches = [(x.to(device), y.to(device)) for x, y in bench.make_batches(cfg, n, 0)]
        self.cuda = device.type == "cuda"

    def step(self, i: int) -> None:
        (x, y), skip = self.batches[i % len(self.batches)], self.masks[i % len(self.masks)]
        _step(self.model, self.fv, self.opt, x, y, skip, self.check)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def measure(run: Run, steps: int) -> dict[str, float]:
    for i in range(5):
        run.step(i)
    run.sync()
    samples = []
    for i in range(steps):
        start = time.perf_counter()
        run.step(i)
        run.sync()
        samples.append(time.perf_counter() - start)
    start = time.perf_counter()
    for i in range(steps):
        run.step(i)
    run.sync()
    return {
        "latency_ms": sorted(samples)[len(samples) // 2] * 1e3,
        "throughput_ms": (time.perf_counter() - start) / steps * 1e3,
    }


def synchronisations(run: Run, steps: int) -> dict[str, int]:
    """Each distinct host-device synchronisation of ``steps`` steps, by where it happened."""
    with recording_syncs(torch.device("cuda" if run.cuda else "cpu")) as seen:
        for i in range(steps):
            run.step(i)
    return seen


def profile_table(run: Run, steps: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if run.cuda else [])
    with profile(activities=activities) as prof:
        for i in range(steps):
            run.step(i)
        run.sync()
    return str(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument(
        "--sizes",
        default="1024x64,4096x2048",
        help="comma-separated WIDTHxBATCH; the first is host-bound on a GPU",
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--tables", default="", help="sizes to write profiler tables for")
    parser.add_argument("--out", default="results/gpu_profile")
    args = parser.parse_args(argv)
    device = start_one_process()
    cuda = device.type == "cuda"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if cuda else "cpu"}
    try:
        for size in args.sizes.split(","):
            width, batch = (int(v) for v in size.split("x"))
            cfg = bench.Config(blocks=args.blocks, width=width, batch=batch, world_size=1)
            runs = {v: Run(v, cfg, device, 16) for v in VARIANTS}
            times = {v: measure(run, args.steps) for v, run in runs.items()}
            for v, t in times.items():
                base = times["torch_fsdp1_plain" if "torch_fsdp1" in v else "ddp_find_unused"]
                t["latency_vs_base"] = t["latency_ms"] / base["latency_ms"]
                t["throughput_vs_base"] = t["throughput_ms"] / base["throughput_ms"]
            syncs = {v: synchronisations(run, 4) for v, run in runs.items()}
            if size in args.tables.split(","):
                for v, run in runs.items():
                    (out / f"profile_{size}_{v}.txt").write_text(profile_table(run, 10))
            report[size] = {"times": times, "syncs_in_4_steps": syncs}
            print(json.dumps({size: report[size]}, indent=2), flush=True)
    finally:
        dist.destroy_process_group()
    (out / "gpu_profile.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
