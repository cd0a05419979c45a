"""Worker and reference of ``tests/test_coalesced.py``'s distributed test:
``flatview.optim.Coalesced(torch.optim.AdamW, ...)`` over torch FSDP1's views, trained
with the skip sequence of :data:`tests.scenarios.GATED`, against ``torch.optim.AdamW``
over the unwrapped model in one process."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

import flatview
import flatview.optim
from tests.optim_workers import State, as_numpy
from tests.scenarios import (
    GATED,
    backend_context,
    full_state,
    make_net,
    optimizer_steps,
    reference_backward,
    synced_backward,
    wrap_fsdp,
)

SCENARIO = replace(GATED, backend="torch", strategy="FULL_SHARD", world_size=2)
OPTIONS = {"lr": 0.05, "betas": (0.9, 0.99), "weight_decay": 0.1, "foreach": True}


def train() -> tuple[dict[str, np.ndarray] | None, State, list[int], list[int]]:
    """Rank 0's full parameters, the consolidated state, and per step how many tensors
    the inner optimizer stepped and how many views had a gradient."""
    scenario = SCENARIO
    with backend_context(scenario.backend):
        model = wrap_fsdp(scenario, make_net(scenario))
        fv = flatview.wrap(model)
        opt = flatview.optim.Coalesced(torch.optim.AdamW, fv.parameters(), **OPTIONS)
        stepped, views = [], []
        for micros in optimizer_steps(scenario):
            synced_backward(scenario, model, fv, micros)
            views.append(sum(p.grad is not None for p in fv.parameters()))
            opt.step()
            stepped.append(opt.stepped_tensors)
            opt.zero_grad(set_to_none=True)
        state = as_numpy(fv.optim_state_dict(opt))
        return full_state(model, scenario), state, stepped, views


def reference() -> tuple[dict[str, np.ndarray], State]:
    """The same training in one process, unwrapped, with ``torch.optim.AdamW``."""
    scenario = SCENARIO
    net = make_net(scenario)
    named = list(net.named_parameters())
    opt = torch.optim.AdamW(net.parameters(), **OPTIONS)
    for micros in optimizer_steps(scenario):
        reference_backward(scenario, net, micros)
        opt.step()
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
