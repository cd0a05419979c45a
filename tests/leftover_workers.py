"""Workers for tests/test_leftovers.py: programs of training micro-batches, evaluations,
optimizer steps and writes through the parameters, played on the wrapped model (and, by
the test, on the unwrapped net in one process).

A program is a string, one letter per action:

* ``T``: a micro-batch whose backward synchronises, inside ``fv.step(skip=...)``;
* ``a``: one under the wrapper's ``no_sync()`` (accumulated);
* ``E``: an evaluation forward under ``torch.no_grad()``, outside any step;
* ``G``: a forward with autograd on, outside any step, whose loss is never backwarded
  (a validation loss computed without ``no_grad``);
* ``S``: every optimizer steps, then zeroes its gradients;
* ``W``: every parameter multiplied by 0.9 in place, under ``no_grad`` (what copying a
  moving average in through the parameters does to them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from tests.scenarios import (
    Scenario,
    backend_context,
    batch,
    distributed_model,
    flatview_error,
    full_state,
    local_batch,
    loss_of,
    no_sync,
    plain_optimizer,
    reference_model,
    skip_names,
)

EVAL_BATCH = 10_000
"""Micro-batch numbers of the evaluation forwards start here (data no step trains on)."""


def play(
    scenario: Scenario,
    program: str,
    model: nn.Module,
    fv: Any,
    opts: Sequence[torch.optim.Optimizer],
    params: Callable[[], Iterable[torch.Tensor]],
    data: Callable[[Scenario, int], tuple[torch.Tensor, torch.Tensor]],
    windows: bool = True,
) -> None:
    """``program`` on ``model`` (``fv`` None: bare; ``windows`` False: no ``no_sync()``,
    the unwrapped net)."""
    micro = 0
    for number, action in enumerate(program):
        if action in "Ta":
            xs, ys = data(scenario, micro)
            skip = skip_names(scenario, micro)
            window = no_sync(model) if action == "a" and windows else contextlib.nullcontext()
            step = fv.step(skip=list(skip)) if fv is not None else contextlib.nullcontext()
            with window, step:
                loss_of(model(xs, skip), ys).backward()
            micro += 1
        elif action in "EG":
            xs, _ = data(scenario, EVAL_BATCH + number)
            with torch.no_grad() if action == "E" else contextlib.nullcontext():
                model(xs)
        elif action == "S":
            for opt in opts:
                opt.step()
            for opt in opts:
                opt.zero_grad()
        elif action == "W":
            with torch.no_grad():
                for p in params():
                    p.mul_(0.9)
        else:
            raise AssertionError(f"unknown action {action!r} in {program!r}")


def play_wrapped(
    scenario: Scenario, program: str, plain: bool = False
) -> dict[str, np.ndarray] | None:
    """``program`` on this rank (FSDP + flatview), then the full parameters (rank 0).
    ``plain``: one SGD over every view instead of the per-submodule optimizers (which
    include AdamW, which cannot step a float32 parameter with a float16 gradient)."""
    with backend_context(scenario.backend):
        model, fv, opts = distributed_model(scenario)
        if plain:
            opts = [plain_optimizer(fv.parameters())]
        play(scenario, program, model, fv, opts, fv.parameters, local_batch)
        return full_state(model, scenario)


def play_reference(scenario: Scenario, program: str) -> dict[str, np.ndarray]:
    """``program`` on the unwrapped net in this process, on whole batches."""
    net, opts = reference_model(scenario)
    play(scenario, program, net, None, opts, net.parameters, batch, windows=False)
    return {name: p.detach().numpy().copy() for name, p in net.named_parameters()}


def raised_by(scenario: Scenario, program: str) -> str:
    """What ``program`` raises on this rank (FSDP + flatview, SGD over the views):
    ``"ClassName: message"``, or ``"accepted"``."""
    with backend_context(scenario.backend):
        model, fv, _ = distributed_model(scenario)
        opts = [plain_optimizer(fv.parameters())]
        return flatview_error(
            lambda: play(scenario, program, model, fv, opts, fv.parameters, local_batch)
        )
