"""Muon over flat shards: ``flatview.optim.Whole`` against gathering every gradient.

The model and skip sequence are ``bench_skip.py``'s (a residual MLP of ``--blocks``
blocks of ``--width`` x ``--width``, 256 by default, each skipped with probability
``--skip-prob``), each block its own fairscale FSDP unit, ``--world-size`` CPU processes
over gloo. Its matrices (the blocks' weights and the head's) are trained by
``torch.optim.Muon``, the biases by AdamW, in two ways built side by side in the same
processes, their steps interleaved:

* ``whole``: ``flatview.optim.Whole(torch.optim.Muon, fv, matrices)``: each matrix has
  one owner rank, which receives the pieces of its gradient (one all-to-all for all
  matrices), steps Muon and sends the pieces of the update back (a second all-to-all).
* ``gather``: the naive way: every rank all-gathers every matrix's whole gradient (one
  all-gather of every unit's sharded gradient), runs Muon on every whole matrix (each
  rank holding all the state) and keeps its own pieces.

Reported per step (rank 0): median optimizer-step time of each and their ratio, bytes
counted at the collective calls (a ``TorchDispatchMode`` over every ``c10d`` op, in a
separate, untimed pass) summed over ranks, and the bytes of the matrices that had a
gradient (the used ones): ``whole`` moves at most 2x those, ``gather`` about world-size
times them. Both must end at the same parameters (checked).

    python benchmarks/bench_whole.py            # about a minute and a half
    python benchmarks/bench_whole.py --quick    # a few seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_skip import (
    Config,
    _fairscale_model,
    _init,
    _runtime,
    make_batches,
    run_in_fresh_processes,
    skip_masks,
)
from torch import nn

import flatview
import flatview.optim
from flatview.testing.counting import CollectiveCounter


class _Gathered:
    """The naive whole-matrix optimizer: all-gather every flat gradient, step Muon on
    every whole matrix on every rank, keep this rank's pieces."""

    def __init__(self, fv: flatview.FlatView, matrices: list[nn.Parameter]) -> None:
        self.fv = fv
        self.matrices = matrices
        self.wholes = [
            nn.Parameter(torch.zeros(fv.placement(p).shape, dtype=p.dtype)) for p in matrices
        ]
        self.muon = torch.optim.Muon(self.wholes, lr=0.02, momentum=0.95)
        self._gather_values()

    def _gather_values(self) -> None:
        with torch.no_grad():
            for whole, view in zip(self.wholes, self.matrices, strict=True):
                pieces = _all_pieces(self.fv, view, view.detach())
                whole.copy_(pieces.view_as(whole))

    @torch.no_grad()
    def step(self) -> None:
        for whole, view in zip(self.wholes, self.matrices, strict=True):
            grad = _all_pieces(self.fv, view, view.grad)
            whole.grad = None if grad is None else grad.view_as(whole)
        self.muon.step()
        for whole, view in zip(self.wholes, self.matrices, strict=True):
            placement = self.fv.placement(view)
            start, end = placement.param_interval
            if end > start:
                view.detach().reshape(-1).copy_(whole.reshape(-1)[start:end])

    def zero_grad(self) -> None:
        for view in self.matrices:
            view.grad = None


def _all_pieces(
    fv: flatview.FlatView, view: nn.Parameter, tensor: torch.Tensor | None
) -> torch.Tensor | None:
    """The whole parameter from every rank's piece of ``tensor``: one all-gather of the
    padded pieces (what gathering every gradient moves)."""
    flag = torch.tensor([float(tensor is not None)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not flag.item():
        return None
    placement = fv.placement(view)
    world = dist.get_world_size()
    pieces = [placement.piece(r) for r in range(world)]
    longest = max(p.numel for p in pieces)
    mine = torch.zeros(longest)
    if tensor is not None and pieces[dist.get_rank()].numel:
        mine[: pieces[dist.get_rank()].numel] = tensor.detach().reshape(-1)
    everyone = torch.empty(world * longest)
    dist.all_gather_into_tensor(everyone, mine)
    whole = torch.empty(placement.numel)
    for r, piece in enumerate(pieces):
        start, end = piece.param_interval
        whole[start:end] = everyone[r * longest : r * longest + piece.numel]
    return whole


def _build(cfg: Config, how: str) -> tuple[Any, flatview.FlatView, Any, torch.optim.Optimizer]:
    model = _fairscale_model(cfg, per_block=True, flatten=True)
    fv = flatview.wrap(model)
    named = list(fv.named_parameters())
    matrices = [p for _, p in named if len(fv.placement(p).shape) == 2]
    rest = [p for _, p in named if len(fv.placement(p).shape) != 2]
    if how == "whole":
        muon: Any = flatview.optim.Whole(torch.optim.Muon, fv, matrices, lr=0.02, momentum=0.95)
    else:
        muon = _Gathered(fv, matrices)
    return model, fv, muon, torch.optim.AdamW(rest, lr=1e-3)


def worker(rank: int, cfg: Config, port: int, out: str) -> None:
    _init(rank, cfg, port, out)
    with _runtime(fairscale=True):
        runs = {how: _build(cfg, how) for how in ("whole", "gather")}
        total = cfg.warmup + cfg.steps + cfg.count_steps
        masks = skip_masks(cfg, total)
        batches = make_batches(cfg, total, rank)
        times: dict[str, list[float]] = {how: [] for how in runs}
        counted: dict[str, list[int]] = {how: [] for how in runs}
        used: list[int] = []
        for step in range(total):
            x, y = batches[step]
            skip = masks[step]
            counting = step >= cfg.warmup + cfg.steps
            for how, (model, fv, muon, adamw) in runs.items():
                with fv.step(skip=[f"blocks.{i}" for i in skip]):
                    F.cross_entropy(model(x, skip), y).backward()
                if how == "whole" and counting:
                    matrices = [p for _, p in fv.named_parameters() if p.grad is not None]
                    used.append(
                        sum(
                            fv.placement(p).numel * 4
                            for p in matrices
                            if len(fv.placement(p).shape) == 2
                        )
                    )
                dist.barrier()
                if counting:
                    with CollectiveCounter() as counter:
                        muon.step()
                    moved = torch.tensor([float(counter.total_bytes)])
                    dist.all_reduce(moved)
                    counted[how].append(int(moved.item()))
                else:
                    started = time.perf_counter()
                    muon.step()
                    if step >= cfg.warmup:
                        times[how].append(time.perf_counter() - started)
                adamw.step()
                muon.zero_grad()
                adamw.zero_grad()
        # Both trained the same parameters.
        views = [[p.detach().clone() for p in run[1].parameters()] for run in runs.values()]
        drift = max(
            (float((a - b).abs().max()) for a, b in zip(*views, strict=True) if a.numel()),
            default=0.0,
        )
    if rank == 0:
        result = {
            "status": "ok",
            "median_ms": {how: 1e3 * statistics.median(t) for how, t in times.items()},
            "bytes_per_step": {how: statistics.mean(c) for how, c in counted.items()},
            "used_bytes_per_step": statistics.mean(used),
            "max_parameter_difference": drift,
        }
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=12)
    # 256, not bench_skip's 512: Muon orthogonalises in bfloat16, whose matrix products
    # are slow on CPUs without bfloat16 units (about 1 s per step of 256x256 matrices here).
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    cfg = replace(
        Config(),
        world_size=args.world_size,
        blocks=args.blocks,
        width=args.width,
        steps=args.steps,
        timeout=600.0,
    )
    if args.quick:
        cfg = replace(cfg, blocks=4, width=128, steps=5, warmup=2, count_steps=3)
    result = run_in_fresh_processes(worker, (cfg,), cfg)
    if result.get("status") != "ok":
        print(f"failed: {result}")
        return 1
    times, moved = result["median_ms"], result["bytes_per_step"]
    used = result["used_bytes_per_step"]
    mib = 2.0**20
    print(
        f"Muon on {cfg.blocks + 1} matrices ({cfg.blocks} of {cfg.width}x{cfg.width}), "
        f"fairscale per block, {cfg.world_size} ranks, skip p={cfg.skip_prob}\n"
        f"| way | optimizer step (median) | bytes per step (all ranks) | / used matrices |\n"
        f"|---|---|---|---|\n"
        f"| flatview.optim.Whole | {times['whole']:.1f} ms | {moved['whole'] / mib:.2f} MiB "
        f"| {moved['whole'] / used:.2f}x |\n"
        f"| all-gather every gradient | {times['gather']:.1f} ms | "
        f"{moved['gather'] / mib:.2f} MiB | {moved['gather'] / used:.2f}x |\n"
        f"time ratio whole/gather {times['whole'] / times['gather']:.2f}, bytes ratio "
        f"{moved['whole'] / moved['gather']:.2f}; used matrices {used / mib:.2f} MiB per step; "
        f"largest parameter difference between the two {result['max_parameter_difference']:.1e}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
