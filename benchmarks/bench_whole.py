"""Muon over flat shards: ``flatview.optim.Whole`` against the other ways of running it.

The model is llama-shaped (``--layers`` layers of attention with grouped key/value heads,
a SwiGLU MLP and a layer of ``--experts`` experts stored as 3-D tensors ``(experts, out,
in)``, RMSNorms, embedding and head), each layer its own fairscale FSDP unit, each layer
skipped with probability ``--skip-prob`` per step (stochastic depth, the same on every
rank), ``--world-size`` CPU processes over gloo. Its matrices (attention, MLP and expert
weights; experts one matrix each) are trained by Muon, the rest (embedding, head,
router, norms) by AdamW. Five ways are built side by side in the same processes, on
copies of one model, their steps interleaved:

* ``whole``: ``flatview.optim.Whole(torch.optim.Muon, fv, matrices)`` with
  ``overlap=True``: owners balanced by Newton-Schulz cost, each stepping
  ``Muon.step()`` itself, exchanges in buckets pipelined with the owners' steps;
* ``whole_sequential``: the same with ``overlap=False`` (one exchange in, every step, one
  exchange out), as shipped on a CPU;
* ``whole_stacked``: ``whole_sequential`` with ``stacked=True`` (same-shape matrices
  orthogonalised together: opt-in, within bfloat16's rounding of torch's);
* ``owner_per_matrix``: the first ``Whole``: owners balanced by element count, each matrix
  orthogonalised on its own, no overlap (owners assigned here by the old rule);
* ``gather``: the Moonlight way: every rank all-gathers every matrix's gradient, runs Muon
  on every whole matrix (each rank holding all the state) and keeps its own pieces.

Reported, rank 0 printing (medians over ``--steps`` timed steps):

* the optimizer step (``Muon.step()``): all of it runs after the backward, so it is also
  the optimizer time exposed after the backward; the backward is timed too, for scale;
* bytes per step counted at the collective calls (a ``TorchDispatchMode`` over every
  ``c10d`` op, in a separate, untimed pass), summed over ranks, against the bytes of the
  matrices that had a gradient (the used ones);
* max / mean owner cost (``m * n * min(m, n)`` per matrix, summed per owner);
* peak memory per rank: the optimizer's tensors held between steps (state, whole copies,
  counted by walking them) and the resident-set growth during its step (``VmHWM`` reset
  before it, glibc's mmap threshold fixed as in ``bench_skip.py``), the largest rank;
* the machine's load average before and after (the box is shared).

The ways orthogonalise the same gradients (torch's bfloat16 iteration; ``--float32`` for
float32), so the largest difference between their parameters is printed: 0 among the
ways that step ``Muon.step()``, one bfloat16 rounding through the iteration where a
stacked product rounds otherwise.

    python benchmarks/bench_whole.py --world-size 4   # a few minutes
    python benchmarks/bench_whole.py --quick          # under a minute
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_skip import (
    Config,
    _init,
    _libc,
    _proc_status_mib,
    _resident_mib,
    _runtime,
    run_in_fresh_processes,
)
from torch import nn

import flatview
import flatview.optim
from flatview import whole as whole_module
from flatview import whole_stacked
from flatview.testing.counting import CollectiveCounter

MIB = 2.0**20
WAYS = ("whole", "whole_sequential", "whole_stacked", "owner_per_matrix", "gather")


@dataclass(frozen=True)
class Shape:
    layers: int = 4
    dim: int = 192
    heads: int = 6
    kv_heads: int = 2
    ffn: int = 520
    experts: int = 4
    expert_ffn: int = 96
    vocab: int = 512
    seq: int = 32
    batch: int = 4
    skip_prob: float = 0.25
    warmup: int = 2
    steps: int = 8
    count_steps: int = 3
    seed: int = 0


# ------------------------------------------------------------------------- model


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = s.heads, s.kv_heads, s.dim // s.heads
        self.wq = nn.Linear(s.dim, s.dim, bias=False)
        self.wk = nn.Linear(s.dim, s.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(s.dim, s.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(s.dim, s.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))  # type: ignore[no-any-return]


class Experts(nn.Module):
    """A dense mixture (every token to every expert, weighted by a softmax router): every
    expert gets a gradient whenever its layer runs."""

    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.router = nn.Linear(s.dim, s.experts, bias=False)
        self.up = nn.Parameter(torch.randn(s.experts, s.expert_ffn, s.dim) / s.dim**0.5)
        self.down = nn.Parameter(torch.randn(s.experts, s.dim, s.expert_ffn) / s.expert_ffn**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(self.router(x), -1)
        hidden = F.silu(torch.einsum("btd,efd->btef", x, self.up))
        out = torch.einsum("btef,edf->bted", hidden, self.down)
        return torch.einsum("bted,bte->btd", out, weights)


class Layer(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(s.dim), Attention(s)
        self.mlp_norm = RMSNorm(s.dim)
        self.w1 = nn.Linear(s.dim, s.ffn, bias=False)
        self.w3 = nn.Linear(s.dim, s.ffn, bias=False)
        self.w2 = nn.Linear(s.ffn, s.dim, bias=False)
        self.moe_norm, self.moe = RMSNorm(s.dim), Experts(s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        h = self.mlp_norm(x)
        x = x + self.w2(F.silu(self.w1(h)) * self.w3(h))
        return x + self.moe(self.moe_norm(x))


class Llama(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.embed = nn.Embedding(s.vocab, s.dim)
        self.layers = nn.ModuleList([Layer(s) for _ in range(s.layers)])
        self.norm = RMSNorm(s.dim)
        self.head = nn.Linear(s.dim, s.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, skip: list[int]) -> torch.Tensor:
        x = self.embed(tokens)
        for index, layer in enumerate(self.layers):
            if index not in skip:
                x = layer(x)
        return self.head(self.norm(x))  # type: ignore[no-any-return]


def is_muon(name: str, shape: torch.Size) -> bool:
    """Muon's matrices: attention, MLP and expert weights (not embedding, head, router)."""
    return len(shape) in (2, 3) and name.startswith("layers.") and "router" not in name


# ---------------------------------------------------------------------- the ways


def float32_newton_schulz(
    grad: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """torch's iteration in float32 (for one matrix or a stack), in every way (``--float32``)."""
    a, b, c = coefficients
    x = grad.float()
    tall = grad.size(-2) > grad.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = (
            torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
            if (x.dim() == 3)
            else torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        )
    return (x.mT if tall else x).to(grad.dtype)


@contextlib.contextmanager
def float32_everywhere() -> Iterator[None]:
    from torch.optim import _muon

    originals = (_muon._zeropower_via_newtonschulz, whole_stacked.newton_schulz)
    _muon._zeropower_via_newtonschulz = float32_newton_schulz
    whole_stacked.newton_schulz = float32_newton_schulz
    try:
        yield
    finally:
        _muon._zeropower_via_newtonschulz, whole_stacked.newton_schulz = originals


def by_elements(matrices: Any, world: int) -> list[int]:
    """The first Whole's owners: split matrices largest first onto the rank with the
    fewest elements (costs returned as Newton-Schulz cost, for the report)."""
    elements = [0] * world
    cost = [0] * world
    spread = []
    for m in matrices:
        held = [r for r, (s, e) in enumerate(m.slices) if e > s]
        if not m.member.placement.sharded:
            m.owner = -1
        elif len(held) <= 1:
            m.owner = held[0] if held else 0
            elements[m.owner] += m.numel
            cost[m.owner] += m.cost
        else:
            spread.append(m)
    for m in sorted(spread, key=lambda m: (-m.numel, m.member.name, m.number)):
        m.owner = min(range(world), key=lambda r: (elements[r], r))
        elements[m.owner] += m.numel
        cost[m.owner] += m.cost
    return cost


class Gathered:
    """The Moonlight way: all-gather every matrix's gradient, step ``torch.optim.Muon`` on
    every whole matrix (experts one each) on every rank, keep this rank's pieces."""

    def __init__(self, fv: flatview.FlatView, params: list[nn.Parameter]) -> None:
        self.fv = fv
        self.params = params
        self.matrices: list[list[nn.Parameter]] = []
        for view in params:
            shape = fv.shape_of(view)
            count, rows, cols = (shape[0], *shape[1:]) if len(shape) == 3 else (1, *shape)
            self.matrices.append([nn.Parameter(torch.zeros(rows, cols)) for _ in range(count)])
        self.muon = torch.optim.Muon([m for ms in self.matrices for m in ms], lr=0.02)
        with torch.no_grad():
            for view, matrices in zip(params, self.matrices, strict=True):
                whole = self._all_pieces(view, view.detach())
                assert whole is not None
                for m, part in zip(matrices, whole.view(len(matrices), -1), strict=True):
                    m.copy_(part.view(m.shape))

    def _all_pieces(self, view: nn.Parameter, tensor: torch.Tensor | None) -> torch.Tensor | None:
        flag = torch.tensor([float(tensor is not None)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return None
        placement = self.fv.placement(view)
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

    @torch.no_grad()
    def step(self) -> None:
        for view, matrices in zip(self.params, self.matrices, strict=True):
            grad = self._all_pieces(view, view.grad)
            for number, m in enumerate(matrices):
                m.grad = (
                    None if grad is None else grad.view(len(matrices), -1)[number].view(m.shape)
                )
        self.muon.step()
        for view, matrices in zip(self.params, self.matrices, strict=True):
            start, end = self.fv.placement(view).param_interval
            if end > start:
                whole = torch.cat([m.reshape(-1) for m in matrices])
                view.detach().reshape(-1).copy_(whole[start:end])

    def zero_grad(self) -> None:
        for view in self.params:
            view.grad = None

    def held_bytes(self) -> int:
        tensors = [t for s in self.muon.state.values() for t in s.values()]
        tensors += [m for ms in self.matrices for m in ms]
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

    def costs(self) -> list[int]:
        total = sum(m.shape[0] * m.shape[1] * min(m.shape) for ms in self.matrices for m in ms)
        return [total] * dist.get_world_size()


def whole_held_bytes(opt: flatview.optim.Whole) -> int:
    tensors = [t for s in opt.inner.state.values() for t in s.values()]
    tensors += [m.whole for m in opt._matrices if m.whole is not None]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def build(s: Shape, how: str) -> dict[str, Any]:
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

    torch.manual_seed(s.seed)
    net = Llama(s)
    for i in range(len(net.layers)):
        net.layers[i] = FSDP(net.layers[i], flatten_parameters=True)
    model = FSDP(net, flatten_parameters=True)
    fv = flatview.wrap(model)
    named = list(fv.named_parameters())
    matrices = [p for n, p in named if is_muon(n, fv.shape_of(p))]
    chosen = {id(p) for p in matrices}
    rest = [p for _, p in named if id(p) not in chosen]
    muon: Any
    if how == "gather":
        muon = Gathered(fv, matrices)
        costs, held = muon.costs(), muon.held_bytes
    else:
        muon = _whole(how, fv, matrices)
        costs, held = muon.owner_costs, functools.partial(whole_held_bytes, muon)
    return {
        "model": model,
        "fv": fv,
        "muon": muon,
        "adamw": torch.optim.AdamW(rest, lr=1e-3),
        "costs": costs,
        "held": held,
        "matrices": matrices,
    }


def _whole(how: str, fv: flatview.FlatView, matrices: list[nn.Parameter]) -> Any:
    """The ``Whole`` of way ``how`` (``whole_buckets_N``: pipelined in ``N`` buckets)."""
    from flatview import whole_exchange

    options: dict[str, Any] = {"lr": 0.02, "overlap": how == "whole" or "buckets" in how}
    if how == "whole_stacked":
        options["stacked"] = True
    buckets = whole_exchange.BUCKETS
    if how.startswith("whole_buckets_"):
        buckets = int(how.rsplit("_", 1)[1])
    assign = whole_module.assign_owners
    if how == "owner_per_matrix":
        options["stacked"] = False
        assign = by_elements  # type: ignore[assignment]
    saved = whole_exchange.BUCKETS, whole_module.assign_owners
    whole_exchange.BUCKETS, whole_module.assign_owners = buckets, assign
    try:
        return flatview.optim.Whole(torch.optim.Muon, fv, matrices, **options)
    finally:
        whole_exchange.BUCKETS, whole_module.assign_owners = saved


# ------------------------------------------------------------------------ worker


def _time_parts(opt: flatview.optim.Whole) -> dict[str, list[float]]:
    """Per step, the time ``opt`` spends in its exchanges and in its inner steps (wraps
    them on this instance; for the sequential one, where they do not overlap)."""
    parts: dict[str, list[float]] = {"exchange": [], "inner": []}
    pending = {"exchange": 0.0, "inner": 0.0}

    def timed(fn: Any, key: str) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                pending[key] += time.perf_counter() - started

        return run

    step = opt.step

    def whole_step() -> None:
        pending.update(exchange=0.0, inner=0.0)
        step()
        parts["exchange"].append(pending["exchange"])
        parts["inner"].append(pending["inner"])

    opt._exchange = timed(opt._exchange, "exchange")  # type: ignore[method-assign]
    opt._step_inner = timed(opt._step_inner, "inner")  # type: ignore[method-assign]
    opt.step = whole_step  # type: ignore[method-assign]
    return parts


def _peak_during(fn: Any) -> float:
    """Resident-set growth (MiB) while ``fn()`` runs (``VmHWM`` reset before it)."""
    before = _resident_mib()
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    fn()
    return _proc_status_mib("VmHWM") - before


def worker(
    rank: int, cfg: Config, s: Shape, float32: bool, ways: tuple[str, ...], port: int, out: str
) -> None:
    _init(rank, cfg, port, out)
    torch.set_num_threads(1)
    result: dict[str, Any] = {}
    iteration = float32_everywhere() if float32 else contextlib.nullcontext()
    with _runtime(fairscale=True), iteration:
        runs = {how: build(s, how) for how in ways}
        total = s.warmup + s.steps + s.count_steps + 1
        g = torch.Generator().manual_seed(s.seed)
        masks = [
            [i for i in range(s.layers) if torch.rand((), generator=g) < s.skip_prob]
            for _ in range(total)
        ]
        data = torch.Generator().manual_seed(s.seed + 1 + rank)
        batches = [
            torch.randint(0, s.vocab, (s.batch, s.seq + 1), generator=data) for _ in range(total)
        ]
        times: dict[str, list[float]] = {how: [] for how in runs}
        parts = _time_parts(runs["whole_sequential"]["muon"])
        backward: list[float] = []
        counted: dict[str, list[int]] = {how: [] for how in runs}
        peaks: dict[str, float] = {}
        used: list[int] = []
        counting_from = s.warmup + s.steps
        for step in range(total):
            tokens = batches[step]
            skip = masks[step]
            for how, run in runs.items():
                fv, model, muon = run["fv"], run["model"], run["muon"]
                started = time.perf_counter()
                with fv.step(skip=[f"layers.{i}" for i in skip]):
                    logits = model(tokens[:, :-1], skip)
                    F.cross_entropy(
                        logits.reshape(-1, s.vocab), tokens[:, 1:].reshape(-1)
                    ).backward()
                if how == "whole" and step >= s.warmup and step < counting_from:
                    backward.append(time.perf_counter() - started)
                if how == "whole" and step >= counting_from:
                    flags = torch.tensor([float(p.grad is not None) for p in run["matrices"]])
                    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
                    used.append(
                        int(
                            sum(
                                fv.placement(p).numel * 4
                                for p, f in zip(run["matrices"], flags.tolist(), strict=True)
                                if f
                            )
                        )
                    )
                dist.barrier()
                if step == total - 1:
                    # The memory pass: glibc's mmap threshold fixed (so freed tensors
                    # leave the resident set), VmHWM reset before the step.
                    _libc().mallopt(-3, 64 * 1024)
                    peaks[how] = _peak_during(muon.step)
                elif step >= counting_from:
                    with CollectiveCounter() as counter:
                        muon.step()
                    moved = torch.tensor([float(counter.total_bytes)])
                    dist.all_reduce(moved)
                    counted[how].append(int(moved.item()))
                else:
                    started = time.perf_counter()
                    muon.step()
                    if step >= s.warmup:
                        times[how].append(time.perf_counter() - started)
                run["adamw"].step()
                muon.zero_grad()
                run["adamw"].zero_grad()
        views = {
            how: [p.detach().clone() for p in run["fv"].parameters()] for how, run in runs.items()
        }
        # Per way, its largest difference from ``whole``'s parameters (0 where both step
        # Muon.step(); a stacked product may round otherwise).
        drift = {
            how: max(
                (
                    float((a - b).abs().max())
                    for a, b in zip(views["whole"], views[how], strict=True)
                    if a.numel()
                ),
                default=0.0,
            )
            for how in ways[1:]
        }
        memory = torch.tensor(
            [[float(runs[h]["held"]()) / MIB, peaks[h]] for h in ways], dtype=torch.float64
        )
        dist.all_reduce(memory, op=dist.ReduceOp.MAX)
        # Every rank's timings: the slowest rank's median is what the step costs; per
        # step, the slowest rank's time of each way (the ways ran back to back, so the
        # per-step ratios cancel the drift of a shared machine's load).
        per_step = torch.tensor([times[h] for h in ways], dtype=torch.float64)
        dist.all_reduce(per_step, op=dist.ReduceOp.MAX)
        medians = per_step.median(dim=1).values
        ratios = {
            f"{a}/{b}": float((per_step[ways.index(a)] / per_step[ways.index(b)]).median())
            for a in ways
            for b in ("whole_sequential", "gather")
            if a != b and b in ways
        }
        split = torch.tensor(
            [statistics.median(parts[k]) if parts[k] else 0.0 for k in ("exchange", "inner")],
            dtype=torch.float64,
        )
        dist.all_reduce(split, op=dist.ReduceOp.MAX)
        result = {
            "status": "ok",
            "ways": list(ways),
            "step_ms": {h: 1e3 * float(v) for h, v in zip(ways, medians, strict=True)},
            "backward_ms": 1e3 * statistics.median(backward),
            "per_step_ratio": ratios,
            "sequential_split_ms": {
                "exchanges": 1e3 * float(split[0]),
                "steps": 1e3 * float(split[1]),
            },
            "bytes_per_step": {h: statistics.mean(counted[h]) for h in ways},
            "used_bytes_per_step": statistics.mean(used),
            "costs": {h: runs[h]["costs"] for h in ways},
            "held_mib": {h: float(memory[i, 0]) for i, h in enumerate(ways)},
            "step_peak_mib": {h: float(memory[i, 1]) for i, h in enumerate(ways)},
            "max_parameter_difference": drift,
            "matrices": len(runs["whole"]["muon"]._matrices),
        }
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _balance(costs: list[int]) -> float:
    return max(costs) / (sum(costs) / len(costs)) if sum(costs) else 1.0


def report(result: dict[str, Any], s: Shape, world: int, load: tuple[str, str]) -> str:
    step, moved, used = result["step_ms"], result["bytes_per_step"], result["used_bytes_per_step"]
    lines = [
        f"Muon on a llama-shaped model: {s.layers} layers (dim {s.dim}, {s.heads} heads, "
        f"{s.kv_heads} kv heads, ffn {s.ffn}, {s.experts} experts of {s.expert_ffn}), "
        f"{result['matrices']} matrices, fairscale per layer, {world} ranks, skip p={s.skip_prob}; "
        f"load average {load[0]} before, {load[1]} after",
        "",
        "| way | optimizer step = exposed after backward (median) | / whole_sequential | "
        "/ gather | bytes per step (all ranks) | / used matrices | max/mean owner cost | "
        "held per rank | step peak per rank |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ways = result["ways"]
    gather = step.get("gather")
    for how in ways:
        versus = f"{step[how] / gather:.2f}" if gather else "-"
        lines.append(
            f"| {how} | {step[how]:.1f} ms | {step[how] / step['whole_sequential']:.2f} | "
            f"{versus} | {moved[how] / MIB:.2f} MiB | "
            f"{moved[how] / used:.2f}x | {_balance(result['costs'][how]):.3f} | "
            f"{result['held_mib'][how]:.1f} MiB | {result['step_peak_mib'][how]:.1f} MiB |"
        )
    ratio, split = result["per_step_ratio"], result["sequential_split_ms"]
    lines += [
        "",
        "median of per-step ratios: "
        + ", ".join(f"{k} {v:.2f}" for k, v in ratio.items())
        + "; whole_sequential's step: "
        f"{split['exchanges']:.1f} ms in exchanges, {split['steps']:.1f} ms in the owners' steps "
        "(medians, slowest rank)",
        f"backward (median, whole's model): {result['backward_ms']:.1f} ms; used matrices "
        f"{used / MIB:.2f} MiB per step; largest parameter difference from whole: "
        + ", ".join(f"{h} {d:.1e}" for h, d in result["max_parameter_difference"].items()),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--layers", type=int, default=Shape.layers)
    parser.add_argument("--dim", type=int, default=Shape.dim)
    parser.add_argument("--steps", type=int, default=Shape.steps)
    parser.add_argument("--float32", action="store_true", help="float32 Newton-Schulz")
    parser.add_argument(
        "--ways",
        default=",".join(WAYS),
        help="comma-separated ways (also whole_buckets_N: pipelined in N buckets); the first "
        "two are always whole and whole_sequential",
    )
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    s = replace(Shape(), layers=args.layers, dim=args.dim, steps=args.steps)
    if args.quick:
        s = replace(s, layers=2, dim=96, heads=4, ffn=260, expert_ffn=48, steps=3, warmup=1)
    cfg = replace(Config(), world_size=args.world_size, timeout=1800.0)
    load_before = Path("/proc/loadavg").read_text().split()[0]
    ways = (
        "whole",
        "whole_sequential",
        *(w for w in args.ways.split(",") if w and w not in ("whole", "whole_sequential")),
    )
    result = run_in_fresh_processes(worker, (cfg, s, args.float32, ways), cfg)
    load_after = Path("/proc/loadavg").read_text().split()[0]
    if result.get("status") != "ok":
        print(f"failed: {result}")
        return 1
    print(report(result, s, args.world_size, (load_before, load_after)))
    if args.json:
        args.json.write_text(json.dumps({"shape": s.__dict__, "world": args.world_size, **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
