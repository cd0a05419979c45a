"""Workers for several forwards of the root before their backwards (fairscale's
``test_fwd_fwd_bwd_bwd``, the pipelining pattern): the first backwards under
``no_sync()``, the last one synchronising."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

import flatview
from tests.scenarios import Scenario, backend_context, local_batch, loss_of, make_net, wrap_fsdp


def fwd_fwd_bwd_bwd(scenario: Scenario, use_flatview: bool) -> dict[str, Any]:
    """Three forwards, then their backwards (two under ``no_sync()``), then an SGD step:
    the parameters, whole, or the error."""
    with backend_context(scenario.backend):
        model = wrap_fsdp(scenario, make_net(scenario))
        fv = flatview.wrap(model, **scenario.flatview_options) if use_flatview else None
        params = list(fv.parameters()) if fv is not None else list(model.parameters())
        opt = torch.optim.SGD(params, lr=0.1)
        try:
            for _ in range(2):
                losses = []
                for i in range(3):
                    x, y = local_batch(scenario, i)
                    losses.append(loss_of(model(x), y))
                with _no_sync(scenario, model):
                    losses[0].backward()
                    losses[1].backward()
                losses[2].backward()
                opt.step()
                opt.zero_grad()
        except flatview.FlatViewError as err:
            return {"error": f"{type(err).__name__}: {err}"}
        return {"params": _whole(scenario, model)}


@contextlib.contextmanager
def _no_sync(scenario: Scenario, model: Any) -> Iterator[None]:
    """The wrapper's way to keep backwards from synchronising (FSDP2 has no ``no_sync()``)."""
    if scenario.backend != "fsdp2":
        with model.no_sync():
            yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _whole(scenario: Scenario, model: Any) -> dict[str, torch.Tensor]:
    if scenario.backend == "fsdp2":
        return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    if scenario.backend == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        summon = FSDP.summon_full_params(model)
    else:
        summon = model.summon_full_params()
    with summon:
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def compare(scenario: Scenario) -> dict[str, Any]:
    """flatview's run against the plain wrapper's, in the same processes: the largest
    relative difference of a parameter, or flatview's error."""
    mine = fwd_fwd_bwd_bwd(scenario, True)
    if "error" in mine:
        return mine
    plain = fwd_fwd_bwd_bwd(scenario, False)
    worst = max(
        float((mine["params"][n] - p).abs().max() / p.abs().max().clamp_min(1e-6))
        for n, p in plain["params"].items()
    )
    return {"worst": worst}
