"""``torch.optim.Muon``'s step with same-shape matrices orthogonalised together.

``torch.optim.Muon`` runs one Newton-Schulz iteration per matrix (its own refuses
anything but 2-D), so an owner holding many matrices of one shape (the experts of a
layer, the heads of a projection, the same projection of every layer) pays the
per-call overhead once per matrix, and on an accelerator launches small kernels.
:func:`stacked_muon_step` steps chosen parameters of an unmodified ``torch.optim.Muon``
(its ``param_groups``, its ``state``, its ``momentum_buffer`` s) with the same
arithmetic as torch's ``_single_tensor_muon``, in the same order per matrix:

1. ``buf.lerp_(grad, 1 - momentum)``; the update is ``grad.lerp(buf, momentum)`` with
   Nesterov, ``buf`` without;
2. the updates of one shape, dtype and device are stacked and orthogonalised by
   :func:`newton_schulz`, torch's iteration (bfloat16, the quintic coefficients,
   transposed when tall, normalised by the Frobenius norm clamped at ``eps``) with
   ``torch.baddbmm`` in place of ``torch.addmm``;
3. ``param.mul_(1 - lr * weight_decay)``, then ``param.add_(update, alpha=-lr')`` with
   torch's learning-rate adjustment for the matrix's shape.

Every step but the matrix products runs per matrix as torch's does. The products are
not torch's: ``torch.addmm`` on a CPU scales and adds its bfloat16 product in one
rounding, ``torch.baddbmm`` does not, so now and then an element of an iteration's result
is one bfloat16 rounding away from torch's, and the iteration carries that on (up to
about ``lr / 30`` per element and step; found by ``tests/test_whole_stacked.py``, which
bounds it). Hence opt-in (``Whole(stacked=True)``): :class:`flatview.optim.Whole` steps
``Muon.step()`` itself by default.
"""

from __future__ import annotations

import math
from collections.abc import Collection

import torch


def newton_schulz(
    updates: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """torch's Newton-Schulz iteration for Muon over a stack ``(k, rows, cols)`` of
    matrices, each on its own (see the module docstring)."""
    if steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if len(coefficients) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")
    a, b, c = coefficients
    x = updates.bfloat16()
    if x is updates:
        x = x.clone()  # divided in place below: never the caller's tensor
    tall = updates.size(-2) > updates.size(-1)
    if tall:
        x = x.mT
    # Each matrix divided in place by its own 0-dim norm: the operations torch's Muon
    # runs, on the same strides. (A batched division by a (k, 1, 1) norm gave the same
    # bits in 4,000 random checks here, but nothing promises it; the products below are
    # where batching does round otherwise.)
    for matrix in x:
        matrix.div_(matrix.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.mT
        gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, gram_update, x, beta=a)
    return x.mT if tall else x


def adjusted_lr(
    lr: float | torch.Tensor, adjust_lr_fn: str | None, shape: torch.Size
) -> float | torch.Tensor:
    """torch Muon's learning rate for a matrix of ``shape`` (its documented rule: Keller
    Jordan's ``sqrt(max(1, rows / cols))`` by default, Moonshot's ``0.2 * sqrt(max(rows,
    cols))`` for ``"match_rms_adamw"``)."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        ratio = 1.0
    return lr * ratio


def _scalar(value: float | torch.Tensor) -> float | torch.Tensor:
    if isinstance(value, torch.Tensor) and value.dim() != 0 and value.numel() == 1:
        return value.reshape(())
    return value


@torch.no_grad()
def stacked_muon_step(optimizer: torch.optim.Optimizer, chosen: Collection[int]) -> None:
    """Step those parameters of ``optimizer`` (a ``torch.optim.Muon``) whose ``id`` is in
    ``chosen`` and that have a gradient, as ``optimizer.step()`` would step them."""
    for group in optimizer.param_groups:
        lr = _scalar(group["lr"])
        weight_decay = group["weight_decay"]
        momentum = group["momentum"]
        stacks: dict[tuple[object, ...], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for param in group["params"]:
            grad = param.grad
            if grad is None or id(param) not in chosen:
                continue
            if torch.is_complex(param):
                raise RuntimeError("Muon does not support complex parameters")
            if grad.is_sparse:
                raise RuntimeError("Muon does not support sparse gradients")
            if grad.ndim != 2:
                raise ValueError("Param gradient must be a 2D matrix")
            state = optimizer.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(
                    grad, memory_format=torch.preserve_format
                )
            buf = state["momentum_buffer"]
            buf.lerp_(grad, 1 - momentum)
            update = grad.lerp(buf, momentum) if group["nesterov"] else buf
            key = (tuple(update.shape), update.dtype, update.device)
            stacks.setdefault(key, []).append((param, update))
        for items in stacks.values():
            ortho = newton_schulz(
                torch.stack([update for _, update in items]),
                group["ns_coefficients"],
                group["ns_steps"],
                group["eps"],
            )
            for (param, _), update in zip(items, ortho, strict=True):
                rate = adjusted_lr(lr, group["adjust_lr_fn"], param.shape)
                param.mul_(1 - lr * weight_decay)
                param.add_(update, alpha=-rate)  # type: ignore[arg-type]
