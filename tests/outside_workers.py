"""Worker functions of ``test_outside_step`` (run on every rank of a worker pool): one
rank inside a checked step while another runs outside any step, and what iterations
outside a step exchange."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from flatview.errors import FlatViewError
from flatview.testing.counting import CollectiveCounter
from tests.scenarios import (
    Scenario,
    backend_context,
    distributed_model,
    distributed_training,
    full_state,
    local_batch,
    loss_of,
)


def _attempt(call: Any) -> str:
    """``"ClassName: message"`` of the flatview error ``call`` raises, else ``"accepted"``."""
    try:
        call()
    except FlatViewError as err:
        return f"{type(err).__name__}: {err}"
    return "accepted"


def inside_and_outside(scenario: Scenario) -> dict[str, Any]:
    """Rank 0 runs an iteration inside a checked step skipping ``body.1``, the others the
    same iteration outside any step (``body.1`` runs): every rank raises. Then rank 0
    inside a step skipping nothing, the others outside: the same iteration, accepted.
    Gradients zeroed, the scenario trains (to be compared with the reference)."""
    rank = dist.get_rank()
    with backend_context(scenario.backend):
        model, fv, opts = distributed_model(scenario)
        x, y = local_batch(scenario, 0)

        def mismatched() -> None:
            if rank == 0:
                with fv.step(skip=["body.1"]):
                    loss_of(model(x, ("body.1",)), y).backward()
            else:
                loss_of(model(x), y).backward()

        def alike() -> None:
            with fv.step() if rank == 0 else contextlib.nullcontext():
                loss_of(model(x), y).backward()

        out = {"mismatch": _attempt(mismatched), "alike": _attempt(alike)}
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        for _ in distributed_training(scenario, model, fv, opts):
            pass
        out["params"] = full_state(model, scenario)
        out["phase"] = fv.phase.name
        return out


def _all_gathers(call: Any) -> int:
    with CollectiveCounter() as counter:
        call()
    return counter.calls.get("all_gather", 0)


def outside_exchanges(scenario: Scenario) -> dict[str, Any]:
    """All-gathers issued by each kind of iteration (the scenario says whether the check
    is on): training iterations outside any step, evaluation forwards under ``no_grad``
    outside a step, a step with ``check=False``, on DDP iterations whose whole model is
    recomputed in the backward (activation checkpointing); and ``fv.stats.agreement_bytes``
    of the last outside-step backward."""
    with backend_context(scenario.backend):
        model, fv, opts = distributed_model(scenario)
        x, y = local_batch(scenario, 0)

        def train() -> None:
            for _ in range(3):
                loss_of(model(x), y).backward()
                for opt in opts:
                    opt.step()
                    opt.zero_grad()

        def evaluate() -> None:
            with torch.no_grad():
                for _ in range(3):
                    model(x)

        def unchecked_step() -> None:
            with fv.step(check=False):
                loss_of(model(x), y).backward()

        def checkpointed() -> None:
            # The whole model recomputed inside the backward: not a new iteration.
            for _ in range(3):
                logits = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
                loss_of(logits, y).backward()

        out: dict[str, Any] = {"train": _all_gathers(train)}
        stats = fv.stats
        out["agreement_bytes"] = None if stats is None else stats.agreement_bytes
        if scenario.backend == "ddp":
            out["checkpointed"] = _all_gathers(checkpointed)
        out["evaluate"] = _all_gathers(evaluate)
        out["unchecked_step"] = _all_gathers(unchecked_step)
        return out
