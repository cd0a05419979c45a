"""Worker functions of ``tests/test_grad_truth.py`` (run in the gloo worker pools), and
the single-process references they are compared with."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import flatview
from tests.scenarios import (
    Net,
    Scenario,
    _original_tree,
    backend_context,
    batch,
    flatview_error,
    full_state,
    local_batch,
    loss_of,
    make_net,
    optimizers,
    plain_optimizer,
    skip_names,
    wrap_fsdp,
)
from tests.workers import flats_and_shards


def _value(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _state(model: nn.Module, scenario: Scenario) -> dict[str, np.ndarray] | None:
    return full_state(model, scenario)


def _train(
    scenario: Scenario,
    model: nn.Module,
    fv: flatview.FlatView | None,
    opts: list[torch.optim.Optimizer],
    micro: int,
    *,
    zero: bool = True,
) -> None:
    """One optimizer step on micro-batch ``micro`` (distributed: this rank's chunk),
    then zero_grad as the scenario says."""
    skip = skip_names(scenario, micro)
    if fv is None:
        x, y = batch(scenario, micro)
        step: Any = contextlib.nullcontext()
    else:
        x, y = local_batch(scenario, micro)
        step = fv.step(skip=list(skip))
    with step:
        loss_of(model(x, skip), y).backward()
    for opt in opts:
        opt.step()
        if zero:
            opt.zero_grad(set_to_none=scenario.set_to_none)


# --------------------------------------------------------------- write-back


def _replaceable(scenario: Scenario) -> bool:
    """Whether views may be replaced by new parameters: not where flatview reduces the
    views' own gradients (DDP-style, torch NO_SHARD computed on views)."""
    return not scenario.config.on_views


def _write_through(
    scenario: Scenario,
    params: dict[str, nn.Parameter],
    head: nn.Module,
    opts: list[torch.optim.Optimizer],
) -> None:
    """The writes a user makes through the original parameters between steps."""
    stem = params["stem.weight"]
    stem.data = _value(tuple(make_net(scenario).stem.weight.shape), 1)
    shape = tuple(make_net(scenario).head.weight.shape)
    if _replaceable(scenario):
        head.weight = nn.Parameter(_value(shape, 2))
        opts[1] = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
    else:
        head.weight.data = _value(shape, 2)
    grad = params["body.1.down.weight"].grad
    assert grad is not None
    grad.data = torch.full_like(grad, 0.25)


def write_back_reference(scenario: Scenario) -> dict[str, Any]:
    """:func:`write_back` in one process on the plain net."""
    net = make_net(scenario)
    opts = optimizers(net)
    _train(scenario, net, None, opts, 0, zero=False)
    _write_through(scenario, dict(net.named_parameters()), net.head, opts)
    written = {k: v.detach().numpy().copy() for k, v in net.named_parameters()}
    _train(scenario, net, None, opts, 1)
    net.aux.weight.data = _value(tuple(net.aux.weight.shape), 3)
    _train(scenario, net, None, opts, 2)
    final = {k: v.detach().numpy().copy() for k, v in net.named_parameters()}
    return {"written": written, "final": final}


def write_back(scenario: Scenario) -> dict[str, Any] | None:
    """Values written through views (``view.data = t``, ``module.weight =
    nn.Parameter(t)``, ``view.grad.data = t``) reach the shards: ``state_dict`` sees
    them, the next forward computes with them, the next backward accumulates onto them;
    a value of the wrong shape is refused at the next forward, naming the parameter."""
    out: dict[str, Any] = {}
    with backend_context(scenario.backend):
        model = wrap_fsdp(scenario, make_net(scenario))
        fv = flatview.wrap(model, **scenario.flatview_options)
        tree: Net = _original_tree(model)
        opts = optimizers(tree)
        _train(scenario, model, fv, opts, 0, zero=False)
        _write_through(scenario, dict(fv.named_parameters()), tree.head, opts)
        out["head_is_view"] = tree.head.weight is dict(fv.named_parameters())["head.weight"]
        out["head_in_parameters"] = any(p is tree.head.weight for p in fv.parameters())
        out["written"] = _state(model, scenario)
        _train(scenario, model, fv, opts, 1)
        # Shown again after a step: the new parameter, not the view it replaced (a
        # cached place to show views at must follow the replacement).
        shown = tree.head.weight
        out["head_shown_after_step"] = shown is dict(fv.named_parameters())["head.weight"]
        aux = dict(fv.named_parameters())["aux.weight"]
        aux.data = _value(tuple(make_net(scenario).aux.weight.shape), 3)
        _train(scenario, model, fv, opts, 2)
        out["final"] = _state(model, scenario)
        stem = dict(fv.named_parameters())["stem.weight"]
        stem.data = torch.zeros(7, 3)
        x, _ = local_batch(scenario, 0)
        out["bad_shape"] = flatview_error(lambda: model(x))
        out["phase"] = fv.phase.name
        if not _replaceable(scenario):
            stem.data = torch.zeros(tuple(make_net(scenario).stem.weight.shape))
            tree.head.weight = nn.Parameter(torch.zeros_like(tree.head.weight))
            out["replaced"] = flatview_error(lambda: model(x))
    return out if dist.get_rank() == 0 else None


# ------------------------------------------------------------------- unwrap


def _stale_step(opt: torch.optim.Optimizer, scenario: Scenario, model: nn.Module) -> str:
    if not scenario.config.flattens:
        # DDP's and FSDP2's parameters are the model's own, not views: nothing goes stale
        # (and a step here would change the model, unlike the reference). Say whether
        # the optimizer's are still the model's.
        registered = {id(p) for p in model.parameters()}
        mine = [p for group in opt.param_groups for p in group["params"]]
        return "own parameters" if all(id(p) in registered for p in mine) else "stale"
    try:
        opt.step()
    except flatview.StateError as err:
        return f"StateError: {err}"
    return "accepted"


def unwrap_reference(scenario: Scenario) -> dict[str, np.ndarray]:
    """:func:`unwrap_and_rewrap` in one process on the plain net."""
    net = make_net(scenario)
    opts = optimizers(net)
    for micro in (0, 1):
        _train(scenario, net, None, opts, micro)
    plain = [plain_optimizer(net.parameters())]
    _train(scenario, net, None, plain, 2)
    opts = optimizers(net)
    for micro in (3, 4):
        _train(scenario, net, None, opts, micro)
    return {k: v.detach().numpy().copy() for k, v in net.named_parameters()}


def unwrap_and_rewrap(scenario: Scenario) -> dict[str, Any] | None:
    """Two steps with flatview (skipping), unwrap, one step of bare FSDP with a fresh
    optimizer over ``model.parameters()``, wrap again with fresh optimizers over the new
    views, two more steps. The old optimizers raise at their step after unwrap."""
    out: dict[str, Any] = {}
    with backend_context(scenario.backend):
        model = wrap_fsdp(scenario, make_net(scenario))
        fv = flatview.wrap(model, **scenario.flatview_options)
        opts = optimizers(_original_tree(model))
        for micro in (0, 1):
            _train(scenario, model, fv, opts, micro)
        fv.unwrap()
        out["stale"] = _stale_step(opts[0], scenario, model)
        plain = [plain_optimizer(model.parameters())]
        x, y = local_batch(scenario, 2)
        loss_of(model(x), y).backward()
        plain[0].step()
        plain[0].zero_grad(set_to_none=scenario.set_to_none)
        fv = flatview.wrap(model, **scenario.flatview_options)
        out["stale_after_rewrap"] = _stale_step(opts[1], scenario, model)
        opts = optimizers(_original_tree(model))
        for micro in (3, 4):
            _train(scenario, model, fv, opts, micro)
        out["final"] = _state(model, scenario)
    return out if dist.get_rank() == 0 else None


# ------------------------------------------------------------- optimizers


def refused_optimizers(scenario: Scenario) -> dict[str, Any]:
    """An optimizer over the flat parameters built before wrapping is refused at its
    first step, before it changes anything; an optimizer whose group swaps a view for
    the flat parameter holding it (same length) is refused at its next step."""
    out: dict[str, Any] = {}
    with backend_context(scenario.backend):
        model = wrap_fsdp(scenario, make_net(scenario))
        early = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.1)
        fv = flatview.wrap(model, **scenario.flatview_options)
        views = dict(fv.named_parameters())
        opt = torch.optim.SGD(list(views.values()), lr=0.1)
        _train(scenario, model, fv, [opt], 1)
        before = {k: v.detach().clone() for k, v in views.items()}
        with torch.no_grad():
            # Gradients (zeros for skipped parameters) for the flat optimizer to use.
            for flat, _ in flats_and_shards(model, scenario.backend):
                if flat.grad is None:
                    flat.grad = torch.zeros_like(flat)
        out["flat"] = flatview_error(early.step)
        out["flat_unchanged"] = all(torch.equal(before[k], v) for k, v in views.items())
        # A view swapped for the flat parameter it lives in: the group's length is kept.
        root_flat = flats_and_shards(model, scenario.backend)[0][0]
        params = opt.param_groups[0]["params"]
        names = list(views)
        params[names.index("head.bias")] = root_flat
        out["swapped"] = flatview_error(opt.step)
    return out
