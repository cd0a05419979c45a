"""Whether stepping neighbours as one tensor gives, on this device, the bits that stepping
each gives: :func:`grouping_exact`.

:class:`~flatview.coalesced.Coalesced` rests on SGD, Adam and AdamW being elementwise in
the bits, not only in the arithmetic. That holds for the foreach kernels on this project's
CPUs and for the fused ones away from a tensor's tail (tested), but a kernel may round an
element by where it sits in its tensor (a vectorised body and a scalar tail that contract
multiply-adds differently, on another instruction set or another device). So before any
run forms, the optimizer class steps a few canary tensors of awkward sizes both ways with
the group's hyperparameters, on the parameters' device and dtype; where any bit differs,
the views there are stepped one by one, as the plain optimizer steps them, and a warning
says so. A canary shows a difference, not the absence of one, but one that random values
at every position of a vector register and its tail miss is not a rounding rule.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import Tensor

from flatview.coalesced_plan import FUSED_UNIT_BYTES, RunPlan

CANARY_STEPS = 3
"""Steps the canaries take: the first (state made) and later ones (state read) differ."""

_checked: dict[tuple[Any, ...], bool] = {}
"""Per optimizer class, hyperparameters, device and dtype: what the canary showed (a
process steps the same kinds of groups every step)."""


def grouping_exact(
    optimizer_class: type,
    defaults: dict[str, Any],
    group: dict[str, Any],
    device: torch.device,
    dtype: torch.dtype,
) -> bool:
    """Whether ``optimizer_class`` (built with ``defaults``) with ``group``'s
    hyperparameters steps a run of neighbours on ``device`` in ``dtype`` bit for bit as
    it steps each of them."""
    hyper = {k: v for k, v in group.items() if k != "params"}
    key = (optimizer_class, device, dtype, _frozen(hyper))
    found = _checked.get(key)
    if found is None:
        found = _checked[key] = _canary(optimizer_class, defaults, hyper, device, dtype)
        if not found:
            warnings.warn(
                f"flatview.optim.Coalesced: {optimizer_class.__name__} on {device} in "
                f"{dtype} rounds an element by its place in its tensor (seen on canary "
                "tensors): its views there are stepped one by one, as the plain optimizer "
                "steps them (same numbers, the plain optimizer's speed)",
                RuntimeWarning,
                stacklevel=3,
            )
    return found


def _canary(
    optimizer_class: type,
    defaults: dict[str, Any],
    hyper: dict[str, Any],
    device: torch.device,
    dtype: torch.dtype,
) -> bool:
    if hyper.get("fused"):
        # Under fused, every view but a run's last fills whole work units (the plan's
        # rule); the last one may end anywhere.
        unit = max(1, FUSED_UNIT_BYTES // torch.empty((), dtype=dtype).element_size())
        sizes = [unit, 2 * unit, 3 * unit, unit + 3]
    else:
        sizes = [1, 3, 7, 13, 17, 33, 70, 5]
    total = sum(sizes)
    generator = torch.Generator().manual_seed(0)

    def values() -> Tensor:
        return torch.randn(total, generator=generator).to(device=device, dtype=dtype)

    start = values()
    grads = [values() for _ in range(CANARY_STEPS)]
    # The run starts off any alignment, as a view inside a shard may.
    run = torch.empty(total + 3, device=device, dtype=dtype)[3:].copy_(start)
    alone = [piece.clone() for piece in start.split(sizes)]
    step = unhooked_step(optimizer_class)
    with torch.no_grad():
        for tensors in ([run], alone):
            optimizer = optimizer_class(tensors, **defaults)
            # A group's keys beyond the class's own (a scheduler's initial_lr) ride along.
            optimizer.param_groups[0].update(hyper)
            for grad in grads:
                pieces = [grad] if len(tensors) == 1 else list(grad.split(sizes))
                for tensor, piece in zip(tensors, pieces, strict=True):
                    tensor.grad = piece.clone()
                step(optimizer)
            if len(tensors) == 1:
                grouped = optimizer.state[run]
            else:
                each = [optimizer.state[t] for t in alone]
    if not torch.equal(run, torch.cat(alone)):
        return False
    return all(
        torch.equal(value, torch.cat([s[key].reshape(-1) for s in each]))
        for key, value in grouped.items()
        if isinstance(value, Tensor) and value.numel() == total
    )


def unhooked_step(optimizer_class: type) -> Any:
    """``optimizer_class.step`` as Coalesced runs it on its inner optimizer and on the
    canaries: without the wrapper torch puts around it, which runs the global optimizer
    hooks (flatview's checks of optimizers over views, which ran on Coalesced itself)."""
    step: Any = optimizer_class.step  # type: ignore[attr-defined]
    return getattr(step, "__wrapped__", step)


def _frozen(hyper: dict[str, Any]) -> tuple[Any, ...]:
    """The hyperparameters as a key (a tensor learning rate by its value)."""
    out = []
    for name, value in sorted(hyper.items()):
        if isinstance(value, Tensor):
            value = ("tensor", value.item())
        elif isinstance(value, list):
            value = tuple(value)
        elif isinstance(value, float) and math.isnan(value):
            value = "nan"
        out.append((name, value))
    return tuple(out)


def unlink_inexact(
    plans: list[RunPlan],
    groups: list[dict[str, Any]],
    optimizer_class: type,
    defaults: dict[str, Any],
) -> None:
    """Cut every link between views whose device and dtype failed the canary for their
    group (:func:`grouping_exact`): they are stepped one by one."""
    for plan, group in zip(plans, groups, strict=True):
        kinds = {(p.device, p.dtype) for p in plan.order}
        inexact = {
            kind for kind in kinds if not grouping_exact(optimizer_class, defaults, group, *kind)
        }
        if not inexact:
            continue
        for i, p in enumerate(plan.order[:-1]):
            if (p.device, p.dtype) in inexact:
                plan.link[i] = plan.fused_link[i] = False
        plan.joins.clear()
