"""Stochastic depth under FSDP with flatview: an MLP-Mixer learns scikit-learn's digits.

Every step skips a random set of residual blocks (deeper blocks more often, as in Huang
et al., "Deep Networks with Stochastic Depth"). The skip set comes from a generator seeded
identically on every rank, so all ranks agree without talking. Each block is its own FSDP
unit; flatview tells FSDP which units a step skips, so they are neither gathered nor
reduced, and gives the original parameters back as views, so the optimizer can have
parameter groups by name (no weight decay on biases and norms, its own learning rate for
the head). On DeepSpeed, whose engine takes exactly one optimizer when it is built, the
engine is built with ``flatview.optim.Deferred`` and the real optimizers, built over the
views, are handed to it after wrapping; ``engine.step()`` then steps them.

Run it:

    python examples/stochastic_depth.py                 # spawns 2 CPU processes (gloo)
    python examples/stochastic_depth.py --backend torch # torch's FSDP instead of fairscale
    python examples/stochastic_depth.py --backend fsdp2 # torch FSDP2 (fully_shard)
    python examples/stochastic_depth.py --backend ddp   # DDP: skip sets, no sharding
    python examples/stochastic_depth.py --backend deepspeed  # DeepSpeed ZeRO 3 (--zero-stage)
    python examples/stochastic_depth.py --optimizer muon  # Muon on the blocks' matrices
    torchrun --nproc-per-node 8 examples/stochastic_depth.py   # GPUs, NCCL

It prints train and held-out accuracy and the gradient bytes flatview reduced against
what bare FSDP would have reduced, and writes a plot of loss and accuracy per step.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import (
    DistEnv,
    deepspeed_runtime,
    explain_and_exit,
    fairscale_runtime,
    launch,
    load_digits,
    quiet_known_warnings,
)
from torch import nn

import flatview
import flatview.optim

# ----------------------------------------------------------------------------- model


class MixerBlock(nn.Module):
    """One MLP-Mixer block: an MLP across tokens, then an MLP across channels."""

    def __init__(self, tokens: int, dim: int, expansion: int = 2) -> None:
        super().__init__()
        self.token_norm = nn.LayerNorm(dim)
        self.token_mlp = nn.Sequential(
            nn.Linear(tokens, expansion * tokens), nn.GELU(), nn.Linear(expansion * tokens, tokens)
        )
        self.channel_norm = nn.LayerNorm(dim)
        self.channel_mlp = nn.Sequential(
            nn.Linear(dim, expansion * dim), nn.GELU(), nn.Linear(expansion * dim, dim)
        )

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        # `scale` is 1/keep-probability in training: a block that survives stands in for
        # the times it is skipped, so evaluation can run every block unscaled.
        mixed = self.token_mlp(self.token_norm(x).transpose(1, 2)).transpose(1, 2)
        x = x + scale * mixed
        return x + scale * self.channel_mlp(self.channel_norm(x))


class Mixer(nn.Module):
    def __init__(
        self,
        depth: int = 8,
        dim: int = 64,
        patch: int = 2,
        image: int = 8,
        classes: int = 10,
        max_drop: float = 0.5,
    ) -> None:
        super().__init__()
        self.patch = patch
        tokens = (image // patch) ** 2
        self.embed = nn.Linear(patch * patch, dim)
        self.blocks = nn.ModuleList(MixerBlock(tokens, dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)
        # Linear decay rule: the first block is almost always kept, the last skipped
        # with probability max_drop.
        self.drop_probs = [max_drop * (i + 1) / depth for i in range(depth)]

    def forward(self, images: torch.Tensor, skip: Iterable[int] = ()) -> torch.Tensor:
        skipped = set(skip)
        p = self.patch
        patches = images.unfold(1, p, p).unfold(2, p, p).reshape(images.shape[0], -1, p * p)
        x = self.embed(patches)
        for index, block in enumerate(self.blocks):
            # A skipped block must not be called at all: calling an FSDP unit would
            # all-gather its parameters, which is exactly the cost skipping saves.
            if index in skipped:
                continue
            keep = 1.0 - self.drop_probs[index] if self.training else 1.0
            x = block(x, 1.0 / keep)
        return self.head(self.norm(x).mean(dim=1))


class SkipSampler:
    """Draws each step's skip set from its own generator: same seed, same sets on every
    rank, whatever else consumes random numbers on that rank."""

    def __init__(self, drop_probs: Sequence[float], seed: int) -> None:
        self.drop_probs = torch.tensor(drop_probs)
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self) -> list[int]:
        draws = torch.rand(len(self.drop_probs), generator=self.generator)
        return [int(i) for i in torch.nonzero(draws < self.drop_probs).flatten()]


def batches(n_samples: int, global_batch: int, env: DistEnv, seed: int) -> Iterator[torch.Tensor]:
    """Endless shuffled batches; every rank draws the same global batch and keeps its
    slice, so the ranks together see each sample once per epoch."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(n_samples, generator=generator)
        for start in range(0, n_samples - global_batch + 1, global_batch):
            yield order[start : start + global_batch][env.rank :: env.world_size]


# ------------------------------------------------------------------------------ FSDP

WRAPPERS = {
    "fairscale": "fairscale FSDP",
    "torch": "torch FSDP",
    "fsdp2": "torch FSDP2 (fully_shard)",
    "ddp": "DDP",
    "deepspeed": "DeepSpeed ZeRO",
}


UNITS = {"ddp": "", "deepspeed": " (ZeRO: no units; ZeRO 3 gathers each submodule as it runs)"}


def deepspeed_engine(
    net: Mixer, optimizer: torch.optim.Optimizer, env: DistEnv, args: argparse.Namespace
) -> nn.Module:
    """A DeepSpeed ZeRO engine over the existing process group: one optimizer (the
    Deferred stand-in), fp32, and no gradient clipping (DeepSpeed's default clips at 1.0;
    the other backends here do not clip)."""
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": args.batch_size // env.world_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": args.zero_stage},
        # Deferred is not among the optimizers DeepSpeed's ZeRO has tested.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=optimizer, config=config)
    return engine  # type: ignore[no-any-return]


def wrap_fsdp(net: Mixer, backend: str, env: DistEnv) -> nn.Module:
    """Each block its own FSDP unit inside one outer unit: the usual nesting, and the one
    bare fairscale cannot train with skipped blocks."""
    if backend == "ddp":
        # Replicated: nothing to gather; flatview reduces only the used blocks' gradients.
        from torch.nn.parallel import DistributedDataParallel

        devices = [env.device.index] if env.device.type == "cuda" else None
        return DistributedDataParallel(net, device_ids=devices)
    if backend == "fairscale":
        from fairscale.nn import FullyShardedDataParallel

        for index, block in enumerate(net.blocks):
            net.blocks[index] = FullyShardedDataParallel(block, flatten_parameters=True)
        return FullyShardedDataParallel(net, flatten_parameters=True)

    if backend == "fsdp2":
        # FSDP2 keeps the original parameters (DTensors): flatview adds no views there,
        # only skip sets, the agreement check, norms and optimizer state.
        from torch.distributed.fsdp import fully_shard

        for block in net.blocks:
            fully_shard(block)
        fully_shard(net)
        return net

    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(
        net,
        auto_wrap_policy=ModuleWrapPolicy({MixerBlock}),
        use_orig_params=False,
        device_id=env.device,
    )


def parameter_groups(
    named: Iterable[tuple[str, nn.Parameter]], lr: float, head_lr: float, weight_decay: float
) -> list[dict[str, object]]:
    """Groups by original name. By name, not by shape: a view that straddles this rank's
    shard boundary is a 1-D piece of its parameter, so ``ndim`` says nothing."""
    groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    for name, param in named:
        in_head = name.startswith("head.")
        decays = not (name.endswith(".bias") or "norm" in name)
        groups.setdefault((in_head, decays), []).append(param)
    return [
        {
            "params": params,
            "lr": head_lr if in_head else lr,
            "weight_decay": weight_decay if decays else 0.0,
        }
        for (in_head, decays), params in sorted(groups.items())
    ]


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, env: DistEnv) -> float:
    """Accuracy with every block, each rank scoring its slice of the set."""
    model.eval()
    mine = slice(env.rank, None, env.world_size)
    logits = model(x[mine].to(env.device))
    counts = torch.tensor(
        [(logits.argmax(1) == y[mine].to(env.device)).sum().item(), logits.shape[0]],
        dtype=torch.float64,
        device=env.device,
    )
    dist.all_reduce(counts)
    model.train()
    return float(counts[0] / counts[1])


# ------------------------------------------------------------------------------ run


@dataclass
class History:
    step_loss: list[float] = field(default_factory=list)
    step_accuracy: list[float] = field(default_factory=list)
    skipped_blocks: list[int] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_accuracy: list[float] = field(default_factory=list)
    reduced_bytes: int = 0
    dense_bytes: int = 0
    used_bytes: int = 0
    agreement_bytes: int = 0


def train(env: DistEnv, args: argparse.Namespace) -> None:
    if args.batch_size < env.world_size:
        explain_and_exit(
            env,
            f"--batch-size {args.batch_size} is global: give at least one sample per rank "
            f"({env.world_size})",
        )
    data = load_digits(args.seed)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    net = Mixer(depth=args.depth, max_drop=args.max_drop).to(env.device)
    sample_skip = SkipSampler(net.drop_probs, args.seed + 1)

    deferred: flatview.optim.Deferred | None = None
    if args.backend == "deepspeed":
        if args.batch_size % env.world_size:
            explain_and_exit(env, "--batch-size must split evenly over the ranks on DeepSpeed")
        # DeepSpeed partitions what the optimizer it is built with holds; the real
        # optimizers come later, over the views.
        deferred = flatview.optim.Deferred(net.parameters())
        model = deepspeed_engine(net, deferred, env, args)
    else:
        model = wrap_fsdp(net, args.backend, env)
    try:
        fv = flatview.wrap(model)
    except flatview.WrapError as exc:
        explain_and_exit(
            env,
            f"\nflatview.wrap does not accept this {WRAPPERS[args.backend]} model here:\n  {exc}\n"
            "This flatview build may not support that backend yet; "
            "run with --backend fairscale.",
        )

    # Views are ordinary parameters of the original submodules, under their original
    # names: parameter groups work exactly as they would without FSDP.
    named = list(fv.named_parameters())
    optimizers: list[torch.optim.Optimizer] = []
    if args.optimizer == "muon":
        # Muon orthogonalises whole matrices: the blocks' weights, chosen by original shape
        # (a view is a 1-D piece where it straddles a shard boundary), stepped whole by
        # one owner rank each (flatview.optim.Whole). AdamW keeps the rest.
        matrices = [
            p for n, p in named if n.startswith("blocks.") and len(fv.placement(p).shape) == 2
        ]
        chosen = {id(p) for p in matrices}
        named = [(n, p) for n, p in named if id(p) not in chosen]
        optimizers.append(
            flatview.optim.Whole(
                torch.optim.Muon, fv, matrices, lr=args.muon_lr, momentum=0.95, weight_decay=0.0
            )
        )
    groups = parameter_groups(named, args.lr, args.head_lr, args.weight_decay)
    optimizers.append(torch.optim.AdamW(groups))
    optimizer = optimizers[-1]
    if deferred is not None:
        # engine.step() steps them (after the gradient clipping the config asks for).
        deferred.set(*optimizers)
    warmup = max(1, args.steps // 20)
    schedules = [
        torch.optim.lr_scheduler.LambdaLR(
            opt,
            lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / args.steps)),
        )
        for opt in optimizers
    ]
    if env.is_main:
        print(
            f"{fv}\n{env.world_size} ranks ({env.launcher}, {env.device.type}), "
            f"{WRAPPERS[args.backend]}, {len(net.blocks)} blocks"
            f"{UNITS.get(args.backend, ' each its own unit')}, "
            f"drop probabilities {[round(p, 2) for p in net.drop_probs]}",
            flush=True,
        )
        if args.optimizer == "muon":
            print(f"  {optimizers[0]!r}: the blocks' matrices, lr {args.muon_lr}")
        for group in optimizer.param_groups:
            print(
                f"  param group: {len(group['params']):2d} views, peak lr "
                f"{group['initial_lr']:.0e}, weight decay {group['weight_decay']}"
            )

    history = History()
    eval_every = max(1, args.steps // 20)
    stream = batches(len(data.x_train), args.batch_size, env, args.seed + 2)
    progress = range(args.steps)
    if env.is_main:
        from tqdm import tqdm

        progress = tqdm(progress, desc="training", unit="step", dynamic_ncols=True)
    started = time.perf_counter()
    for step in progress:
        index = next(stream)
        x, y = data.x_train[index].to(env.device), data.y_train[index].to(env.device)
        skip = sample_skip()
        # Original module names; modules or views would do too.
        with fv.step(skip=[f"blocks.{i}" for i in skip]):
            logits = model(x, skip=skip)
            loss = F.cross_entropy(logits, y)
            if deferred is not None:
                model.backward(loss)  # type: ignore[operator]
            else:
                loss.backward()
        if deferred is not None:
            model.step()  # type: ignore[operator]  # the optimizers step, grads dropped
        else:
            for opt in optimizers:
                opt.step()
                opt.zero_grad(set_to_none=True)
        for schedule in schedules:
            schedule.step()

        stats = fv.stats
        assert stats is not None
        history.reduced_bytes += stats.reduced_bytes
        history.dense_bytes += stats.dense_bytes
        history.used_bytes += stats.used_bytes
        history.agreement_bytes += stats.agreement_bytes

        # One tiny all-reduce so the curve is the global batch's, not rank 0's slice.
        figures = torch.tensor(
            [loss.item() * len(y), (logits.argmax(1) == y).sum().item(), len(y)],
            dtype=torch.float64,
            device=env.device,
        )
        dist.all_reduce(figures)
        history.step_loss.append(float(figures[0] / figures[2]))
        history.step_accuracy.append(float(figures[1] / figures[2]))
        history.skipped_blocks.append(len(skip))
        if (step + 1) % eval_every == 0 or step + 1 == args.steps:
            history.eval_steps.append(step + 1)
            history.eval_accuracy.append(accuracy(model, data.x_test, data.y_test, env))
        if env.is_main:
            progress.set_postfix(  # type: ignore[attr-defined]
                loss=f"{history.step_loss[-1]:.3f}",
                held_out=f"{history.eval_accuracy[-1]:.3f}" if history.eval_accuracy else "-",
                skipped=len(skip),
            )
    elapsed = time.perf_counter() - started
    if env.is_main:
        progress.close()  # type: ignore[attr-defined]

    train_acc = accuracy(model, data.x_train, data.y_train, env)
    test_acc = history.eval_accuracy[-1]
    if env.is_main:
        report(args, env, history, train_acc, test_acc, elapsed)


def report(
    args: argparse.Namespace,
    env: DistEnv,
    history: History,
    train_acc: float,
    test_acc: float,
    elapsed: float,
) -> None:
    mib = 2.0**20
    saved = (
        f"{1 - history.reduced_bytes / history.dense_bytes:9.1%}"
        if history.dense_bytes
        else "      n/a  (one rank: the wrapper communicates nothing)"
    )
    mean_skipped = sum(history.skipped_blocks) / len(history.skipped_blocks)
    plain, everything = {
        "ddp": ("bare DDP", "every gradient"),
        "fsdp2": ("bare FSDP2", "every gradient, padded, if no block were skipped"),
        # Bare ZeRO (0.19.8) leaves unused parameters' gradients out of its reduction
        # too (it moves what flatview moves); it gives them zero gradients that the
        # optimizer then steps (weight decay, momentum), which flatview does not.
        "deepspeed": ("no block skipped", "every gradient, padded"),
    }.get(args.backend, ("bare FSDP", "every flat gradient, padded"))
    print(
        f"\n{args.steps} steps in {elapsed:.1f} s, {mean_skipped:.2f} of {args.depth} blocks "
        "skipped per step on average\n"
        f"train accuracy     {train_acc:7.2%}\n"
        f"held-out accuracy  {test_acc:7.2%}   (chance: 10%)\n"
        "gradient bytes reduced (rank 0, summed over steps; inputs of the reduce collectives)\n"
        f"  flatview           {history.reduced_bytes / mib:9.2f} MiB\n"
        f"  {plain:<18} {history.dense_bytes / mib:9.2f} MiB  ({everything})\n"
        f"  used gradients     {history.used_bytes / mib:9.2f} MiB  (exact lower bound)\n"
        f"  saved              {saved}\n"
        f"  skip-set checks    {history.agreement_bytes / mib:9.4f} MiB",
        flush=True,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    backend = f"deepspeed{args.zero_stage}" if args.backend == "deepspeed" else args.backend
    stem = f"stochastic_depth_{backend}" + ("_muon" if args.optimizer == "muon" else "")
    plot(history, out / f"{stem}.png", args)
    summary = {
        "backend": args.backend,
        "world_size": env.world_size,
        "launcher": env.launcher,
        "device": env.device.type,
        "steps": args.steps,
        "seconds": round(elapsed, 2),
        "train_accuracy": train_acc,
        "held_out_accuracy": test_acc,
        "history": asdict(history),
    }
    (out / f"{stem}.json").write_text(json.dumps(summary, indent=1))
    print(f"plot: {out / f'{stem}.png'}   numbers: {out / f'{stem}.json'}", flush=True)


def plot(history: History, path: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = range(1, len(history.step_loss) + 1)
    window = max(1, len(history.step_loss) // 25)

    def smooth(values: list[float]) -> list[float]:
        out, total = [], 0.0
        for i, value in enumerate(values):
            total += value - (values[i - window] if i >= window else 0.0)
            out.append(total / min(i + 1, window))
        return out

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(steps, history.step_loss, color="tab:blue", alpha=0.25, label="per step")
    ax_loss.plot(steps, smooth(history.step_loss), color="tab:blue", label=f"mean of {window}")
    ax_loss.set_yscale("log")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss (global batch)")
    ax_loss.legend()
    ax_acc.plot(steps, smooth(history.step_accuracy), color="tab:blue", label="training batch")
    ax_acc.plot(
        history.eval_steps,
        history.eval_accuracy,
        "o-",
        color="tab:orange",
        label="held-out set, all blocks",
    )
    ax_acc.axhline(0.1, color="grey", linestyle=":", label="chance")
    ax_acc.set_ylim(0, 1)
    ax_acc.set_xlabel("step")
    ax_acc.set_ylabel("accuracy")
    ax_acc.legend(loc="lower right")
    fig.suptitle(
        f"Stochastic-depth MLP-Mixer on digits, {WRAPPERS[args.backend]} + flatview "
        f"({args.depth} blocks, max drop {args.max_drop})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--backend", choices=tuple(WRAPPERS), default="fairscale")
    parser.add_argument(
        "--world-size", type=int, default=2, help="processes to spawn (ignored under torchrun)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results", help="directory for the plot and numbers")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--max-drop", type=float, default=0.5)
    parser.add_argument("--lr", type=float, default=4e-3)
    parser.add_argument("--head-lr", type=float, default=1e-2)
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument(
        "--optimizer",
        choices=("adamw", "muon"),
        default="adamw",
        help="muon: torch.optim.Muon on the blocks' matrices (flatview.optim.Whole), AdamW on "
        "the rest",
    )
    parser.add_argument("--muon-lr", type=float, default=0.02)
    parser.add_argument(
        "--zero-stage", type=int, choices=(1, 2, 3), default=3, help="with --backend deepspeed"
    )
    return parser.parse_args(argv)


def main(env: DistEnv, args: argparse.Namespace) -> None:
    quiet_known_warnings()
    if args.backend == "fairscale":
        with fairscale_runtime(env):
            train(env, args)
    elif args.backend == "deepspeed":
        with deepspeed_runtime(env):
            train(env, args)
    else:
        train(env, args)


if __name__ == "__main__":
    arguments = parse_args()
    sys.exit(launch(main, arguments, arguments.world_size))
