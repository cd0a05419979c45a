"""Worker functions of ``tests/test_caches.py`` (run in the gloo worker pools), and the
single-process references they are compared with."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tests.scenarios import (
    Scenario,
    backend_context,
    distributed_model,
    full_state,
    local_batch,
    loss_of,
    reference_backward,
    reference_model,
    synced_backward,
)


def _set_frozen(named: Any, prefixes: tuple[str, ...]) -> None:
    for name, param in named:
        param.requires_grad_(not (prefixes and name.startswith(prefixes)))


def _none(named: Any) -> list[str]:
    return sorted(name for name, p in named if p.grad is None)


def freezing_reference(
    scenario: Scenario, frozen: Sequence[tuple[str, ...]]
) -> tuple[list[list[str]], dict[str, np.ndarray]]:
    """:func:`freezing_between_steps` in one process on the plain net."""
    net, opts = reference_model(scenario)
    none = []
    for micro, prefixes in enumerate(frozen):
        _set_frozen(net.named_parameters(), prefixes)
        reference_backward(scenario, net, range(micro, micro + 1))
        none.append(_none(net.named_parameters()))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return none, {k: v.detach().numpy().copy() for k, v in net.named_parameters()}


def freezing_between_steps(
    scenario: Scenario, frozen: Sequence[tuple[str, ...]]
) -> tuple[list[list[str]], list[str], dict[str, np.ndarray] | None]:
    """One optimizer step per micro-batch, the parameters named by ``frozen[step]``
    frozen (``requires_grad_(False)``) for that step and the others trainable: per step
    the parameters without a gradient, the empty views, the final parameters."""
    with backend_context(scenario.backend):
        model, fv, opts = distributed_model(scenario)
        none = []
        for micro, prefixes in enumerate(frozen):
            _set_frozen(fv.named_parameters(), prefixes)
            synced_backward(scenario, model, fv, range(micro, micro + 1))
            none.append(_none(fv.named_parameters()))
            for opt in opts:
                opt.step()
                opt.zero_grad()
        empty = sorted(n for n, p in fv.named_parameters() if p.numel() == 0 and fv.numel(p) > 0)
        return none, empty, full_state(model, scenario)


def bucket_layouts(keep_bytes: int) -> tuple[list[bool], bool]:
    """Tensor buckets through one replicated reduction: the same shapes twice around a
    bucket that makes the slot's buffer grow (and, with ``keep_bytes`` 0, buffers
    dropped after every reduction), each result checked against a plain all-reduce; and
    whether every layout kept is over a buffer the reduction still keeps (a layout over
    a dropped one would keep its memory alive)."""
    from flatview.comm.ledger import Ledger
    from flatview.comm.options import ReduceOptions
    from flatview.comm.replicated import ReplicatedReduction

    world = dist.get_world_size()
    options = ReduceOptions(keep_buffer_bytes=keep_bytes)
    reduction = ReplicatedReduction(None, dist.get_rank(), world, Ledger(), options, 2**20)
    generator = torch.Generator().manual_seed(dist.get_rank())
    checks = []
    for shapes in ([(3, 2), (4,)], [(5, 5), (7,), (2,)], [(3, 2), (4,)], [(3, 2), (4,)]):
        tensors = [torch.randn(s, generator=generator) for s in shapes]
        expected = [t.clone() for t in tensors]
        for t in expected:
            dist.all_reduce(t)
            t /= world
        reduction.start_all_reduce_tensors(tensors, float(world))
        reduction.wait_in_flight()
        checks.append(all(torch.allclose(t, e) for t, e in zip(tensors, expected, strict=True)))
    kept = {id(b) for b in reduction._buffers.values()}
    current = all(id(whole._base) in kept for whole, _ in reduction._layouts.values())
    return checks, current and (keep_bytes > 0 or not reduction._layouts)


def guard_culprits(scenario: Scenario, runs: Sequence[tuple[int, int]]) -> list[str]:
    """Per ``(skipped, left_out)``: a step declaring ``body.<skipped>`` skipped whose
    model leaves out ``body.<left_out>`` (the same: a correct step; another: the model
    uses a skipped parameter). What each step raised, or ``"accepted"``."""
    from flatview.errors import FlatViewError

    out: list[str] = []
    with backend_context(scenario.backend):
        model, fv, opts = distributed_model(scenario)
        for micro, (skipped, left_out) in enumerate(runs):
            x, y = local_batch(scenario, micro)
            try:
                with fv.step(skip=[f"body.{skipped}"]):
                    loss_of(model(x, (f"body.{left_out}",)), y).backward()
            except FlatViewError as err:
                out.append(f"{type(err).__name__}: {err}")
            else:
                out.append("accepted")
            for opt in opts:
                opt.zero_grad()
    return out
