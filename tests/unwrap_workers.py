"""Workers for tests/test_unwrap_orig_params.py: plain training after ``unwrap()`` when
torch ``use_orig_params=True`` left a ``SHARD_GRAD_OP`` unit unsharded."""

from __future__ import annotations

import numpy as np
import torch

from tests.scenarios import (
    Scenario,
    backend_context,
    distributed_model,
    full_state,
    local_batch,
    optimizer_steps,
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
