"""Loss scaling over views equals it in one process: torch's ``ShardedGradScaler`` (what
torch's FSDP suite, ``test_fsdp_sharded_grad_scaler.py``, trains with; DDP: the plain
``GradScaler``) unscales each per-submodule optimizer's views, finds an overflow that
only one rank's data causes and skips that step on every rank, with the same scale
after each step as a plain ``GradScaler`` over the unwrapped model.

Small optimizers (the head's) hold no elements on some ranks: there every view is empty
and has no gradient, and the scaler must still take part in the all-reduce of its
overflow flag (torch's does; fairscale's CUDA-only ``ShardedGradScaler`` all-reduces
once per device that holds a gradient: ``docs/recipes.md``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.scenarios import (
    BACKENDS,
    BackendConfig,
    Scenario,
    backend_context,
    batch,
    compare,
    distributed_model,
    full_state,
    local_batch,
    reference_model,
    skip_names,
)

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

TIMEOUT = 120.0
OVERFLOW = 2
"""The micro-batch whose first sample (rank 0's) weighs enough to overflow."""
SCENARIO = Scenario(
    world_size=4,
    width=5,
    inner=(6, 4, 5, 3),
    norms=(True, False, True, False),
    gates=(True, True, True, True),
    aux=True,
    # Every optimizer keeps a used parameter in every step (a plain GradScaler refuses
    # to step an optimizer without gradients; the reference uses one).
    skips=((1, "body.2.gate"), (), (0, "body.3.gate"), (2, "body.1.gate"), (3,)),
)


def _weights(scenario: Scenario, micro: int, rows: int, first: int) -> torch.Tensor:
    """Per-sample loss weights of rows ``first..first+rows`` of the global batch."""
    w = torch.ones(scenario.batch_per_rank * scenario.world_size)
    if micro == OVERFLOW:
        w[0] = 1e37
    return w[first : first + rows]


def _loss(out: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (torch.nn.functional.cross_entropy(out, y, reduction="none") * w).mean()


def _scaler(distributed: bool, backend: str) -> Any:
    kwargs = {"init_scale": 2.0**12, "growth_interval": 2}
    if distributed and backend != "ddp":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device="cpu", **kwargs)
    return torch.amp.GradScaler("cpu", **kwargs)


def _step(scaler: Any, opts: list[torch.optim.Optimizer]) -> float:
    """Step every optimizer through the scaler, update it, zero; the new scale."""
    for opt in opts:
        scaler.step(opt)
    scaler.update()
    for opt in opts:
        opt.zero_grad()
    return float(scaler.get_scale())


def _scaled_training(scenario: Scenario) -> dict[str, Any]:
    rank = dist.get_rank()
    with backend_context(scenario.backend):
        model, fv, opts = distributed_model(scenario)
        scaler = _scaler(True, scenario.backend)
        only_empty = [
            all(p.numel() == 0 for g in opt.param_groups for p in g["params"]) for opt in opts
        ]
        scales = []
        for micro in range(len(scenario.skips)):
            x, y = local_batch(scenario, micro)
            w = _weights(scenario, micro, len(y), rank * len(y))
            skip = skip_names(scenario, micro)
            with fv.step(skip=list(skip)):
                scaler.scale(_loss(model(x, skip), y, w)).backward()
            scales.append(_step(scaler, opts))
        return {
            "params": full_state(model, scenario),
            "scales": scales,
            "empty": only_empty,
        }


def _reference(scenario: Scenario) -> dict[str, Any]:
    net, opts = reference_model(scenario)
    scaler = _scaler(False, scenario.backend)
    scales = []
    for micro in range(len(scenario.skips)):
        x, y = batch(scenario, micro)
        w = _weights(scenario, micro, len(y), 0)
        scaler.scale(_loss(net(x, skip_names(scenario, micro)), y, w)).backward()
        scales.append(_step(scaler, opts))
    params = {k: v.detach().numpy().copy() for k, v in net.named_parameters()}
    return {"params": params, "scales": scales}


@pytest.mark.parametrize("backend", BACKENDS)
def test_scaled_steps_match_one_process(dist_pool: PoolFactory, backend: BackendConfig) -> None:
    scenario = backend.scenario(SCENARIO)
    results = dist_pool(scenario.world_size).run(_scaled_training, scenario, timeout=TIMEOUT)
    want = _reference(scenario)
    # The overflow was found and its step skipped (the scale halved there).
    assert want["scales"][OVERFLOW] == want["scales"][OVERFLOW - 1] / 2
    for r in results:
        assert r["scales"] == want["scales"]
    compare(results[0]["params"], want["params"])
    if backend.flattens and backend.strategy != "NO_SHARD":
        # Some rank held no element of some optimizer's parameters: the case above.
        assert any(any(r["empty"]) for r in results)
    assert np.isfinite(np.concatenate([v.ravel() for v in want["params"].values()])).all()
