"""Workers of tests/test_fp16_reduction.py: flatview skipping a block against bare FSDP
training the same model with that block's contribution multiplied by zero.

Under a low-precision gradient reduction the fp32 single-process reference is the wrong
yardstick: fp16 rounds every reduced gradient, and AdamW's first steps (an update of about
``lr * sign(g)``) turn the rounding of a near-zero element into a whole ``lr``. What a user
who adds flatview must get is the training bare FSDP gives them under the same policy.
Bare FSDP cannot skip, but a block whose residual is multiplied by zero runs and gets
exactly zero gradients, while every other gradient is the skipping model's, bit for bit
(``x + 0 * (f(x) - x)`` is ``x`` exactly, and its backward adds exact zeros)."""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Sequence

import numpy as np
import torch
import torch.distributed as dist

import flatview
from tests.scenarios import (
    Net,
    Scenario,
    backend_context,
    full_state,
    local_batch,
    loss_of,
    skip_names,
    wrap_fsdp,
)


class ZeroedNet(Net):
    """:class:`~tests.scenarios.Net` running skipped blocks with their residual times 0."""

    def forward(self, x: torch.Tensor, skip: Collection[str] = ()) -> torch.Tensor:
        assert self.aux is None and not hasattr(self, "head_copy"), "not zeroed here"
        x = self.stem(x)
        for index, block in enumerate(self.body):
            assert f"body.{index}.gate" not in skip, "only whole blocks are zeroed"
            out = block(x)
            x = x + 0.0 * (out - x) if f"body.{index}" in skip else out
        result: torch.Tensor = self.head(x)
        return result


def _net(scenario: Scenario, zeroed: bool) -> Net:
    torch.manual_seed(scenario.seed)
    return ZeroedNet(scenario) if zeroed else Net(scenario)


def skipping_and_zeroed_plain(
    scenario: Scenario,
) -> tuple[list[np.ndarray | None], ...]:
    """Train the scenario twice with one elementwise optimizer over all parameters:
    FSDP + flatview skipping as declared, and bare FSDP over its flat parameters with the
    skipped blocks zeroed. Skips may only occur in the first step: bare FSDP's zero
    gradients then leave the momentum buffers at zero, as flatview's ``None`` does.

    Every rank returns (flatview's, plain's) flat gradient shards of the first step, one
    per FSDP unit in a fixed order (None where a unit got none), then rank 0 adds the two
    final states (others add None twice)."""
    assert all(not s for s in scenario.skips[1:]), "skips only in the first step"
    grads: list[list[np.ndarray | None]] = []
    states = []
    for use_flatview in (True, False):
        with backend_context(scenario.backend):
            model = wrap_fsdp(scenario, _net(scenario, zeroed=not use_flatview))
            fv = flatview.wrap(model) if use_flatview else None
            params = list(fv.parameters() if fv is not None else model.parameters())
            # Momentum, elementwise: a difference in any gradient shows. No weight decay:
            # it would move plain's zeroed block, which flatview's None leaves alone.
            opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
            for micro in range(len(scenario.skips)):
                x, y = local_batch(scenario, micro)
                skip = skip_names(scenario, micro)
                step = fv.step(skip=list(skip)) if fv is not None else contextlib.nullcontext()
                with step:
                    loss_of(model(x, skip), y).backward()
                if micro == 0:
                    grads.append(_flat_grads(model))
                opt.step()
                opt.zero_grad()
            states.append(full_state(model, scenario))
    return (*grads, *states)


def _flat_grads(model: torch.nn.Module) -> list[np.ndarray | None]:
    """This rank's sharded gradient of every FSDP unit's flat parameter, units in module
    order (with flatview, ``model.parameters()`` holds the views too)."""
    if dist.get_world_size() and hasattr(model, "_handle"):
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

        flats = [m._handle.flat_param for m in TorchFSDP.fsdp_modules(model) if m._handle]
    else:
        from fairscale.nn.data_parallel import FullyShardedDataParallel as FairscaleFSDP

        flats = [p for m in model.modules() if isinstance(m, FairscaleFSDP) for p in m.params]
    return [None if p.grad is None else p.grad.detach().float().numpy().copy() for p in flats]


def reduce_calls(scenario: Scenario, bucket_all_used: bool | None) -> tuple[int, list[np.ndarray]]:
    """One step skipping nothing with ``ReduceOptions(bucket_all_used=...)``: the
    reduce-scatters counted at the collective, and this rank's flat gradient shards."""
    from flatview.testing.counting import CollectiveCounter

    with backend_context(scenario.backend):
        model = wrap_fsdp(scenario, _net(scenario, zeroed=False))
        options = flatview.ReduceOptions(bucket_all_used=bucket_all_used)
        fv = flatview.wrap(model, reduce_options=options)
        x, y = local_batch(scenario, 0)
        with CollectiveCounter() as counter, fv.step():
            loss_of(model(x), y).backward()
        grads = [g for g in _flat_grads(model) if g is not None]
        return counter.calls.get("reduce_scatter", 0), grads


def rank_local_accumulation(
    scenario: Scenario, skip: Sequence[str] = ()
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Two backward passes, both leaving out ``skip`` (gates: bare FSDP leaves their
    gradients at zero, flatview masks them); between them every rank but 0 drops its
    gradients, so only rank 0 accumulates (torch keeps its earlier shard to add to: a
    fact of that rank alone). FSDP + flatview, then bare FSDP: this rank's flat
    gradient shards of each."""
    out = []
    for use_flatview in (True, False):
        with backend_context(scenario.backend):
            model = wrap_fsdp(scenario, _net(scenario, zeroed=False))
            fv = flatview.wrap(model) if use_flatview else None
            params = list(fv.parameters() if fv is not None else model.parameters())
            for micro in range(2):
                if micro == 1 and dist.get_rank() != 0:
                    for p in params:
                        p.grad = None
                x, y = local_batch(scenario, micro)
                step = fv.step(skip=list(skip)) if fv is not None else contextlib.nullcontext()
                with step:
                    loss_of(model(x, skip), y).backward()
            out.append([g for g in _flat_grads(model) if g is not None])
    return out[0], out[1]
