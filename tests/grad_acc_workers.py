"""Workers for the collectives of gradient accumulation under the wrapper's ``no_sync()``:
flatview adds none to a micro-step (its skip-set check waits for the synchronising step),
and a disagreement inside the window still raises on every rank before any reduction."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

import flatview
from flatview.testing.counting import CollectiveCounter
from tests.scenarios import (
    Scenario,
    as_names,
    backend_context,
    local_batch,
    loss_of,
    make_net,
    wrap_fsdp,
)


def _micro(
    model: Any,
    fv: flatview.FlatView | None,
    scenario: Scenario,
    i: int,
    skip: Sequence[str],
    last: bool,
    check: bool | None = None,
) -> None:
    x, y = local_batch(scenario, i)
    sync = contextlib.nullcontext() if last else model.no_sync()
    step = fv.step(skip=list(skip), check=check) if fv is not None else contextlib.nullcontext()
    with sync, step:
        loss_of(model(x, tuple(skip)), y).backward()


def counted_window(scenario: Scenario, skips: Sequence[Sequence[int | str]]) -> dict[str, Any]:
    """Collective calls per micro-step of one window (the last synchronises), in the same
    processes, each after a warm-up window: the plain wrapper's (without skip sets, which
    the plain wrappers cannot all take under ``no_sync()``: its peers' test), flatview's
    without them, and flatview's with ``skips``, checked and unchecked."""
    runs = {"plain": None, "flatview": True, "skipping": True, "unchecked": False}
    found: dict[str, Any] = {}
    with backend_context(scenario.backend):
        for label, checked in runs.items():
            window = [()] * len(skips) if label in ("plain", "flatview") else skips
            found[label] = _count(scenario, [tuple(as_names(s)) for s in window], checked)
    return found


def _count(
    scenario: Scenario, names: Sequence[Sequence[str]], checked: bool | None
) -> list[dict[str, int]]:
    model = wrap_fsdp(scenario, make_net(scenario))
    fv = None
    if checked is not None:
        fv = flatview.wrap(model, **{**scenario.flatview_options, "check_skip_agreement": checked})
    per_step = []
    for window in range(2):
        for i, skip in enumerate(names):
            with CollectiveCounter() as counter:
                _micro(model, fv, scenario, i, skip, i == len(names) - 1)
            if window == 1:
                per_step.append(dict(counter.calls))
        model.zero_grad(set_to_none=True)
        if fv is not None:
            for p in fv.parameters():
                p.grad = None
    return per_step


def disagreeing_window(scenario: Scenario, where: int, check: bool | None = None) -> dict[str, str]:
    """Rank 1 skips one more block in micro-step ``where`` of a window of three: every
    rank raises (at the synchronising step's check, before any reduction, when ``where``
    is under ``no_sync()``; in that micro-step with ``check=True`` given to its step)."""
    with backend_context(scenario.backend):
        model = wrap_fsdp(scenario, make_net(scenario))
        fv = flatview.wrap(model, **scenario.flatview_options)
        try:
            for i in range(3):
                skip = ("body.1",) if dist.get_rank() == 1 and i == where else ()
                _micro(model, fv, scenario, i, skip, i == 2, check)
        except flatview.FlatViewError as err:
            message = f"{type(err).__name__}: {err}"
        else:
            message = "no error"
        return {"message": message}
