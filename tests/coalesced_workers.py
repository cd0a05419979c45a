"""Worker and reference of ``tests/test_coalesced.py``'s distributed test:
``flatview.optim.Coalesced(torch.optim.AdamW, ...)`` over a wrapper's views, trained
with the skip sequence of :data:`tests.scenarios.GATED` and a DCP checkpoint halfway
(``flatview.checkpoint``), against ``torch.optim.AdamW`` over the unwrapped model in one
process; on fairscale with the gradients zeroed in place before each forward, the other
placement users write."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

import flatview
import flatview.checkpoint as fcp
import flatview.optim
from tests.optim_workers import State, as_numpy
from tests.scenarios import (
    GATED,
    Scenario,
    backend_context,
    full_state,
    make_net,
    optimizer_steps,
    reference_backward,
    synced_backward,
    wrap_fsdp,
)

SCENARIOS = {
    "torch": replace(GATED, backend="torch", strategy="FULL_SHARD", world_size=2),
    "fairscale": replace(GATED, backend="fairscale", world_size=2),
    # Parameters of their own (DTensors on FSDP2): nothing joins, views step one by one.
    "fsdp2": replace(GATED, backend="fsdp2", world_size=2),
    "ddp": replace(GATED, backend="ddp", world_size=2),
}
OPTIONS = {"lr": 0.05, "betas": (0.9, 0.99), "weight_decay": 0.1, "foreach": True}
ZEROED_BEFORE = {"fairscale"}
"""Backends trained with ``zero_grad(set_to_none=False)`` before each forward (gradients
zeroed in place, kept by parameters skipped since) instead of ``set_to_none=True`` after
each step."""


def _build(
    scenario: Scenario,
) -> tuple[torch.nn.Module, flatview.FlatView, flatview.optim.Coalesced]:
    model = wrap_fsdp(scenario, make_net(scenario))
    fv = flatview.wrap(model)
    return model, fv, flatview.optim.Coalesced(torch.optim.AdamW, fv.parameters(), **OPTIONS)


def _train(
    scenario: Scenario,
    model: torch.nn.Module,
    fv: flatview.FlatView,
    opt: flatview.optim.Coalesced,
    steps: list[range],
    stepped: list[int],
    views: list[int],
) -> None:
    before = scenario.backend in ZEROED_BEFORE
    for micros in steps:
        if before:
            opt.zero_grad(set_to_none=False)
        synced_backward(scenario, model, fv, micros)
        views.append(sum(p.grad is not None for p in fv.parameters()))
        opt.step()
        stepped.append(opt.stepped_tensors)
        if not before:
            opt.zero_grad(set_to_none=True)


def train(
    backend: str, path: str
) -> tuple[dict[str, np.ndarray] | None, State, list[int], list[int]]:
    """Train the first steps, save a DCP checkpoint through ``flatview.checkpoint`` to
    ``path``, resume a fresh model and optimizer from it and train the other steps.
    Returns rank 0's full parameters, the consolidated optimizer state, and per step
    how many tensors the inner optimizer stepped and how many views had a gradient."""
    scenario = SCENARIOS[backend]
    steps = optimizer_steps(scenario)
    split = len(steps) // 2
    stepped: list[int] = []
    views: list[int] = []
    with backend_context(scenario.backend):
        model, fv, opt = _build(scenario)
        _train(scenario, model, fv, opt, steps[:split], stepped, views)
        model_sd, optim_sd = fcp.get_state_dict(fv, model, [opt])
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        fv.unwrap()
        model, fv, opt = _build(scenario)
        model_sd, optim_sd = fcp.get_state_dict(fv, model, [opt])
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        fcp.set_state_dict(fv, model, [opt], model_state_dict=model_sd, optim_state_dict=optim_sd)
        _train(scenario, model, fv, opt, steps[split:], stepped, views)
        state = as_numpy(fv.optim_state_dict(opt))
        return full_state(model, scenario), state, stepped, views


def reference(backend: str) -> tuple[dict[str, np.ndarray], State]:
    """The same training in one process, unwrapped, with ``torch.optim.AdamW``."""
    scenario = SCENARIOS[backend]
    net = make_net(scenario)
    named = list(net.named_parameters())
    opt = torch.optim.AdamW(net.parameters(), **OPTIONS)
    before = backend in ZEROED_BEFORE
    steps = optimizer_steps(scenario)
    for index, micros in enumerate(steps):
        if index == len(steps) // 2:
            # Where the run under test resumes from its checkpoint: without gradients.
            opt.zero_grad(set_to_none=True)
        if before:
            opt.zero_grad(set_to_none=False)
        reference_backward(scenario, net, micros)
        opt.step()
        if not before:
            opt.zero_grad(set_to_none=True)
    names = {id(p): n for n, p in named}
    order = [names[id(p)] for group in opt.param_groups for p in group["params"]]
    saved = opt.state_dict()
    state = as_numpy(
        {
            "state": {order[k]: v for k, v in saved["state"].items()},
            "param_groups": [
                {**g, "params": [order[k] for k in g["params"]]} for g in saved["param_groups"]
            ],
        }
    )
    return {k: v.detach().numpy().copy() for k, v in named}, state
