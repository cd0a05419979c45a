"""Micro-benchmarks of what flatview's views cost, measured side by side in one process.

(a) Keeping views in place: the same fairscale FSDP model (one unit per block, many small
    parameters), plain and wrapped by flatview, forward+backward steps interleaved (ABBA)
    in one process at world size 1, so that only flatview's per-step bookkeeping differs:
    hiding the views before compute and showing them after, carrying view gradients into
    the flat gradient and back, and the skip-set machinery with an empty skip set. The
    time spent inside flatview's core calls is also measured directly, per step and per
    parameter.
(b) An optimizer step (AdamW) over the views vs over the flat parameters they alias, with
    torch's default implementation choice and with ``foreach=True``.

    python benchmarks/micro_views.py [--units 16 --layers 16 --width 32 --steps 200]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import flatview
from flatview.testing import fairscale_on_cpu


class Unit(nn.Module):
    """Many small parameters: ``layers`` Linear(width, width), a weight and a bias each."""

    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return x


class Net(nn.Module):
    def __init__(self, units: int, layers: int, width: int) -> None:
        super().__init__()
        self.units = nn.ModuleList(Unit(layers, width) for _ in range(units))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in self.units:
            x = unit(x)
        return self.head(x)


def build(args: argparse.Namespace) -> nn.Module:
    from fairscale.nn import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    net = Net(args.units, args.layers, args.width)
    for index, unit in enumerate(net.units):
        net.units[index] = FSDP(unit, flatten_parameters=True)
    return FSDP(net, flatten_parameters=True)


def flat_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The flat parameters of every FSDP unit (hidden from ``parameters()`` while flatview
    shows the views)."""
    from fairscale.nn import FullyShardedDataParallel as FSDP

    return [p for m in model.modules() if isinstance(m, FSDP) for p in m.params]


class CallTimer:
    """Accumulates the wall time spent inside chosen methods while installed.

    Core methods are wrapped on the FlatView's runtime (the adapter reaches the runtime by
    attribute lookup, so an instance attribute sees every call); ViewSet methods on the
    class (only the wrapped model in this process has view sets). Nested calls are
    counted in both: ``end_backward`` includes ``pull_grads`` and ``show``.
    """

    CORE = (
        "begin_compute",
        "check_unit_forward",
        "skipped_segments",
        "reduction_plan",
        "flat_used_so_far",
        "unit_skipped",
        "end_backward",
    )
    VIEWS = ("hide", "show", "rebind", "push_grads", "pull_grads")

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    @contextlib.contextmanager
    def installed(self, fv: flatview.FlatView) -> Iterator[None]:
        from flatview.views import ViewSet

        originals = {name: getattr(ViewSet, name) for name in self.VIEWS}
        runtime = fv.runtime
        for name in self.CORE:
            setattr(runtime, name, self._timed(f"core.{name}", getattr(runtime, name)))
        for name, method in originals.items():
            setattr(ViewSet, name, self._timed(f"views.{name}", method))
        try:
            yield
        finally:
            for name in self.CORE:
                delattr(runtime, name)
            for name, method in originals.items():
                setattr(ViewSet, name, method)

    def _timed(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - started
                self.calls[name] += 1

        return timed


def interleaved(
    fns: dict[str, Callable[[], None]], steps: int, warmup: int
) -> dict[str, list[float]]:
    """Per-call seconds of each function, called in ABBA order so that drift in the
    machine's load falls on all of them alike."""
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for step in range(warmup + steps):
        order = names if step % 2 == 0 else names[::-1]
        for name in order:
            started = time.perf_counter()
            fns[name]()
            if step >= warmup:
                times[name].append(time.perf_counter() - started)
    return times


def views_in_place(args: argparse.Namespace) -> None:
    plain = build(args)
    wrapped = build(args)
    fv = flatview.wrap(wrapped, check_skip_agreement=False)
    n_views = sum(1 for _ in fv.parameters())
    n_elements = sum(p.numel() for p in fv.parameters())
    x = torch.randn(args.batch, args.width)
    y = torch.randn(args.batch, 1)

    def plain_step() -> None:
        F.mse_loss(plain(x), y).backward()
        for p in plain.parameters():
            p.grad = None

    step_context = {"seconds": 0.0}

    def wrapped_step() -> None:
        started = time.perf_counter()
        with fv.step(skip=()):
            entered = time.perf_counter()
            F.mse_loss(wrapped(x), y).backward()
            left = time.perf_counter()
        step_context["seconds"] += (entered - started) + (time.perf_counter() - left)
        for p in fv.parameters():
            p.grad = None

    # Warm both up (lazy init, caches) before the timer goes in.
    for _ in range(args.warmup):
        plain_step()
        wrapped_step()
    # End to end first, with nothing patched; then again with the timers in, for the
    # breakdown (timers add a little to what they measure).
    times = interleaved({"plain": plain_step, "flatview": wrapped_step}, args.steps, 0)
    plain_ms = statistics.median(times["plain"]) * 1e3
    wrapped_ms = statistics.median(times["flatview"]) * 1e3
    ratios = [w / p for w, p in zip(times["flatview"], times["plain"], strict=True)]
    timer = CallTimer()
    step_context["seconds"] = 0.0
    with timer.installed(fv):
        for _ in range(args.steps):
            wrapped_step()
    per_step = {name: s / args.steps * 1e3 for name, s in timer.seconds.items()}
    per_step["step() enter + exit"] = step_context["seconds"] / args.steps * 1e3
    # Core entry points and step() hold everything else; views.* are nested inside them.
    inside = sum(ms for name, ms in per_step.items() if not name.startswith("views."))

    print(
        f"(a) keeping views in place: forward+backward, {args.steps} steps each, interleaved\n"
        f"    model: {args.units} FSDP units x {args.layers} Linear({args.width}, {args.width}) "
        f"+ head = {n_views} original parameters ({n_elements / 1e3:.0f} k elements), "
        f"batch {args.batch}\n"
        f"    bare fairscale         {plain_ms:8.3f} ms/step (median)\n"
        f"    fairscale + flatview   {wrapped_ms:8.3f} ms/step (median)\n"
        f"    flatview / bare        {wrapped_ms / plain_ms:8.3f} (ratio of medians), "
        f"{statistics.median(ratios):.3f} (median of per-step ratios)\n"
        f"    inside flatview per step: {inside:.3f} ms = {inside / n_views * 1e3:.2f} µs per "
        f"parameter = {inside / wrapped_ms:.1%} of the wrapped step (separate timed run)\n"
        "      (views.* run inside core.*: show/hide move the views in and out of their\n"
        "      modules, push/pull_grads keep view gradients and the flat gradient in step)"
    )
    for name, ms in sorted(per_step.items(), key=lambda item: -item[1]):
        calls = timer.calls.get(name)
        per_call = f"{calls / args.steps:5.1f} calls/step" if calls is not None else ""
        print(
            f"      {name:24s} {ms * 1e3:9.1f} µs/step  {ms * 1e3 / n_views:6.2f} µs/param  "
            f"{per_call}"
        )


def optimizer_step(args: argparse.Namespace) -> None:
    model = build(args)
    fv = flatview.wrap(model, check_skip_agreement=False)
    x = torch.randn(args.batch, args.width)
    with fv.step():
        F.mse_loss(model(x), torch.zeros(args.batch, 1)).backward()
    views = list(fv.parameters())
    flats = flat_parameters(model)
    if any(p.grad is None for p in views) or any(p.grad is None for p in flats):
        raise RuntimeError("expected gradients on every view and flat parameter")

    # The same model without FSDP: what an optimizer over the original parameters costs.
    torch.manual_seed(0)
    unwrapped = Net(args.units, args.layers, args.width)
    F.mse_loss(unwrapped(x), torch.zeros(args.batch, 1)).backward()
    originals = list(unwrapped.parameters())

    print(
        f"(b) AdamW step over the {len(views)} views, over the {len(flats)} flat parameters "
        f"they alias, and over the {len(originals)} parameters of the same model without "
        f"FSDP; {args.steps} steps each, interleaved (ms, median)"
    )
    # On CPU torch's default is the per-tensor loop (foreach only for accelerator tensors).
    for label, foreach in (("default", None), ("foreach=True", True)):
        optimizers = {
            "views": torch.optim.AdamW(views, lr=1e-4, foreach=foreach),
            "flat": torch.optim.AdamW(flats, lr=1e-4, foreach=foreach),
            "unwrapped": torch.optim.AdamW(originals, lr=1e-4, foreach=foreach),
        }
        times = interleaved(
            {name: opt.step for name, opt in optimizers.items()}, args.steps, args.warmup
        )
        v, f, u = (statistics.median(times[k]) * 1e3 for k in ("views", "flat", "unwrapped"))
        print(
            f"    AdamW {label:13s} views {v:7.3f}   flat {f:7.3f}   unwrapped {u:7.3f}   "
            f"views/flat {v / f:5.2f}   views/unwrapped {v / u:5.2f}"
        )


@contextlib.contextmanager
def single_process_group() -> Iterator[None]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--units", type=int, default=16, help="FSDP units (blocks)")
    parser.add_argument("--layers", type=int, default=16, help="Linear layers per unit")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
    torch.set_num_threads(args.threads)
    print(
        f"flatview micro-benchmarks: torch {torch.__version__}, 1 process, gloo world size 1, "
        f"fairscale FSDP on CPU, {args.threads} thread(s), load average "
        f"{os.getloadavg()[0]:.1f}\n"
    )
    with single_process_group(), fairscale_on_cpu():
        views_in_place(args)
        print()
        optimizer_step(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
