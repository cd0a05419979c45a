"""What :class:`flatview.integrations.layerdrop.LayerDrop` adds to a step, side by side.

Two identical tiny BARTs (``--layers`` encoder and as many decoder layers, width 16, so
that the host's work is most of a step), each DDP wrapped by flatview, in one process at
world size 1; their forward + backward steps interleaved (ABBA). The layer drop
probability is 1e-9: ``transformers`` draws and compares for every layer, nothing is ever
dropped, so both models compute the same. Two phases in the same run:

1. control: both models step inside a plain ``fv.step()``;
2. treatment: model A steps inside ``LayerDrop.step()`` (its draws, its hooks, its
   comparisons), model B as before.

Two identical instances do not cost exactly the same (memory placement), so the overhead
is the paired difference of phase 2 minus that of phase 1. Also ``draw()`` alone.

    OMP_NUM_THREADS=1 python benchmarks/micro_layerdrop.py [--layers 24 --steps 200]

Needs ``transformers`` (the ``libs`` extra).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import flatview
from flatview.integrations.layerdrop import LayerDrop


def _bart(layers: int) -> nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=40,
        d_model=16,
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=20,
        decoder_ffn_dim=20,
        max_position_embeddings=32,
        dropout=0.0,
        encoder_layerdrop=1e-9,
        decoder_layerdrop=1e-9,
    )
    torch.manual_seed(0)
    return nn.parallel.DistributedDataParallel(BartForConditionalGeneration(config))


def _paired(a: Callable[[], None], b: Callable[[], None], steps: int, warmup: int) -> float:
    """Median over steps of A's time minus B's, in seconds (ABBA order)."""
    diffs = []
    for i in range(warmup + steps):
        times = {}
        for name, step in (("a", a), ("b", b)) if i % 2 else (("b", b), ("a", a)):
            start = time.perf_counter()
            step()
            times[name] = time.perf_counter() - start
        if i >= warmup:
            diffs.append(times["a"] - times["b"])
    return statistics.median(diffs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)

    model_a, model_b = _bart(args.layers), _bart(args.layers)
    fv_a, fv_b = flatview.wrap(model_a), flatview.wrap(model_b)
    ids = torch.randint(3, 40, (4, 6), generator=torch.Generator().manual_seed(0))

    def plain(model: nn.Module, fv: flatview.FlatView) -> Callable[[], None]:
        def step() -> None:
            with fv.step():
                model(input_ids=ids, labels=ids).loss.backward()

        return step

    control = _paired(plain(model_a, fv_a), plain(model_b, fv_b), args.steps, args.warmup)
    layerdrop = LayerDrop(fv_a, seed=0)

    def dropping() -> None:
        with layerdrop.step():
            model_a(input_ids=ids, labels=ids).loss.backward()

    treated = _paired(dropping, plain(model_b, fv_b), args.steps, args.warmup)
    start = time.perf_counter()
    for _ in range(1000):
        layerdrop.draw()
    draw = (time.perf_counter() - start) / 1000
    layers = 2 * args.layers
    start = time.perf_counter()
    for _ in range(20):
        plain(model_b, fv_b)()
    step_time = (time.perf_counter() - start) / 20
    overhead = treated - control
    print(f"tiny BART, {layers} layers with layer drop, DDP + flatview, world size 1")
    print(f"  step (plain fv.step)            {step_time * 1e3:8.2f} ms")
    print(f"  paired A - B, control           {control * 1e6:8.0f} us")
    print(f"  paired A - B, A with LayerDrop  {treated * 1e6:8.0f} us")
    print(
        f"  LayerDrop's overhead            {overhead * 1e6:8.0f} us per step, "
        f"{overhead * 1e6 / layers:.1f} us per layer, {overhead / step_time:.1%} of the step"
    )
    print(f"  draw() alone                    {draw * 1e6:8.1f} us")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
