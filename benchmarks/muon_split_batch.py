"""How much torch's own ``Muon`` moves when a batch mean is taken as the mean of per-rank
means: one process, no wrapper, no flatview.

Data parallel training (DDP, FSDP, and flatview over them) gives each rank a slice of the
batch and averages the ranks' gradients: the mean of per-rank means, equal to the batch
mean in exact arithmetic, not in float32. ``torch.optim.Muon`` casts the momentum-updated
gradient to bfloat16 before its Newton-Schulz iteration; a last-bit difference in float32
can move a bfloat16 rounding, and the iteration carries it into the whole matrix. This
script measures it on a small llama-shaped model (3 layers, 21 weight matrices stepped by
Muon): the same initial model, one step from the whole batch's mean gradient and one from
the mean of ``--ranks`` slices' mean gradients, with torch's Muon as it ships and with its
Newton-Schulz iteration in float32, over several seeds.

    python benchmarks/muon_split_batch.py [--ranks 2] [--seeds 5]

It prints, per seed, how many matrices moved by more than 1e-5, the largest difference of
an element (also relative to the learning rate), and the largest norm of a matrix's
difference relative to the norm of its update.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import _muon

VOCAB, DIM, HEADS, HIDDEN, LAYERS, SEQ, BATCH = 96, 64, 4, 176, 3, 37, 12
LR = 0.02


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Layer(nn.Module):
    """Attention (q, k, v, o) and a SwiGLU MLP (gate, up, down): seven matrices."""

    def __init__(self) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(DIM)
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.mlp_norm = RMSNorm(DIM)
        self.gate = nn.Linear(DIM, HIDDEN, bias=False)
        self.up = nn.Linear(DIM, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q, k, v = (m(h).view(b, t, HEADS, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, DIM))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TinyLlama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm = RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))

    def matrices(self) -> list[tuple[str, nn.Parameter]]:
        """The hidden weight matrices (what Muon is meant for: not embedding, not head)."""
        named = self.named_parameters()
        return [(n, p) for n, p in named if p.ndim == 2 and n.startswith("layers")]


def loss_of(model: TinyLlama, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


@contextlib.contextmanager
def newton_schulz_in_float32() -> Iterator[None]:
    """torch's Newton-Schulz iteration, computed in float32 instead of bfloat16."""

    def float32(
        grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
    ) -> torch.Tensor:
        a, b, c = ns_coefficients
        x = grad.float()
        tall = grad.size(0) > grad.size(1)
        x = x.T if tall else x
        x = x / x.norm().clamp(min=eps)
        for _ in range(ns_steps):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        return x.T if tall else x

    original = _muon._zeropower_via_newtonschulz
    _muon._zeropower_via_newtonschulz = float32
    try:
        yield
    finally:
        _muon._zeropower_via_newtonschulz = original


def one_step(seed: int, ranks: int) -> dict[str, tuple[float, float]]:
    """Per matrix, after one Muon step from the whole batch's mean gradient and one from
    the mean of ``ranks`` slices' mean gradients: the largest |difference| of an element,
    and the norm of the difference relative to the norm of the update."""
    torch.manual_seed(seed)
    model = TinyLlama()
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    after = []
    for split in (1, ranks):
        model.load_state_dict(state)
        model.zero_grad(set_to_none=True)
        grads: dict[str, torch.Tensor] = {}
        for piece in tokens.chunk(split):
            model.zero_grad(set_to_none=True)
            loss_of(model, piece).backward()
            for n, p in model.matrices():
                assert p.grad is not None
                grads[n] = grads[n] + p.grad if n in grads else p.grad.clone()
        matrices = model.matrices()
        for n, p in matrices:
            # The sum of the ranks' gradients, divided by the world size (as DDP does).
            p.grad = grads[n] / split
        torch.optim.Muon([p for _, p in matrices], lr=LR, momentum=0.95).step()
        after.append({n: p.detach().clone() for n, p in matrices})
    before = {n: state[n] for n in after[0]}
    return {
        n: (
            float((after[0][n] - after[1][n]).abs().max()),
            float((after[0][n] - after[1][n]).norm() / (after[0][n] - before[n]).norm()),
        )
        for n in after[0]
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    for label, context in (
        ("bfloat16 (torch's Muon)", contextlib.nullcontext),
        ("float32 Newton-Schulz", newton_schulz_in_float32),
    ):
        print(f"{label}, batch split over {args.ranks} ranks, one step, lr {LR}:")
        for seed in range(args.seeds):
            with context():
                diffs = one_step(seed, args.ranks)
            moved = [n for n, (d, _) in diffs.items() if d > 1e-5]
            worst = max(d for d, _ in diffs.values())
            relative = max(r for _, r in diffs.values())
            print(
                f"  seed {seed}: {len(moved)} of {len(diffs)} matrices moved by more than "
                f"1e-5; largest element difference {worst:.2e} ({worst / LR:.3f} x lr); "
                f"largest |difference| / |update| of a matrix {relative:.1e}"
            )


if __name__ == "__main__":
    main()
