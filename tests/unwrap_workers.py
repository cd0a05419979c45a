"""Workers for tests/test_unwrap_orig_params.py (plain training after ``unwrap()`` when
torch ``use_orig_params=True`` left a ``SHARD_GRAD_OP`` unit unsharded) and
tests/test_lifecycle.py (``unwrap()`` refused inside an accumulation window)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from flatview.errors import StateError
from tests.scenarios import (
    Scenario,
    backend_context,
    distributed_model,
    full_state,
    local_batch,
    loss_of,
    no_sync,
    optimizer_steps,
    plain_optimizer,
    plain_parameters,
    skip_names,
    synced_backward,
    zero_grads,
)


def keep_optimizers_after_unwrap(scenario: Scenario) -> dict[str, np.ndarray] | None:
    """The scenario's training with the optimizers over ``fv.parameters()`` kept across
    ``unwrap()`` after step 0 (torch's own parameters with ``use_orig_params``, which a
    bare FSDP optimizer holds too). Step 0 ends with a forward with autograd on and no
    backward, then one without autograd inside a step, as the equivalence harness's
    evaluation passes. Rank 0 returns the final parameters."""
    with backend_context(scenario.backend):
        model, fv, opts = distributed_model(scenario)
        for number, micros in enumerate(optimizer_steps(scenario)):
            synced_backward(scenario, model, fv if number == 0 else None, micros)
            for opt in opts:
                opt.step()
            zero_grads(scenario, opts)
            if number == 0:
                model(local_batch(scenario, 10_000)[0])
                skip = skip_names(scenario, micros[-1])
                with torch.no_grad(), fv.step(skip=list(skip)):
                    model(local_batch(scenario, 20_000)[0], skip)
                fv.unwrap()
        return full_state(model, scenario)


def unwrap_refused_inside_a_window(scenario: Scenario) -> dict[str, Any]:
    """Step 0 on views, ``unwrap()`` tried between its first micro-batch (under the
    wrapper's window: ``no_sync()``, FSDP2's ``set_requires_gradient_sync(False)`` or
    HSDP's ``set_requires_all_reduce(False)``) and its synchronising one; then unwrapped
    after the step, and the rest trained bare by one optimizer over
    ``model.parameters()``, as :attr:`Scenario.unwrap_after` ``= 0`` says. Every rank
    returns the refusal, rank 0 the final parameters too."""
    assert scenario.unwrap_after == 0 and scenario.accumulate == 2, scenario
    refused = "nothing raised"
    with backend_context(scenario.backend):
        model, fv, opts = distributed_model(scenario)
        first, *others = optimizer_steps(scenario)
        x, y = local_batch(scenario, first[0])
        skip = skip_names(scenario, first[0])
        with no_sync(model), fv.step(skip=list(skip)):
            loss_of(model(x, skip), y).backward()
        try:
            fv.unwrap()
        except StateError as error:
            refused = f"StateError: {error}"
        synced_backward(scenario, model, fv, first[1:])
        for opt in opts:
            opt.step()
        zero_grads(scenario, opts)
        fv.unwrap()
        opts = [plain_optimizer(plain_parameters(scenario, model))]
        for micros in others:
            synced_backward(scenario, model, None, micros)
            for opt in opts:
                opt.step()
            zero_grads(scenario, opts)
        return {"refused": refused, "params": full_state(model, scenario)}
