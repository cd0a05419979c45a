"""Workers for :mod:`tests.test_whole`: torch's Muon on whole matrices over views, against
the unmodified ``torch.optim.Muon`` on the unwrapped model in one process."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import flatview
from flatview.optim import Whole
from flatview.testing.counting import CollectiveCounter
from tests.scenarios import (
    Scenario,
    backend_context,
    distributed_model,
    full_state,
    make_net,
    optimizer_steps,
    reference_backward,
    synced_backward,
)


@dataclass(frozen=True)
class MuonRun:
    """A scenario trained with Muon on its matrices and AdamW on the rest."""

    scenario: Scenario
    nesterov: bool = True
    weight_decay: float = 0.1
    lr: float = 0.02
    momentum: float = 0.95
    float32: bool = False
    """Orthogonalise in float32 instead of Muon's bfloat16, in both runs (see
    :func:`float32_newton_schulz`)."""
    halve_after: int | None = None
    """After this many optimizer steps, halve every matrix through ``.data`` (a write
    outside the optimizer, which its owners must notice)."""
    steps: tuple[int, int] | None = None
    """Which optimizer steps of the scenario to run (``[start, stop)``; all by default)."""

    def chosen(self) -> list[range]:
        every = optimizer_steps(self.scenario)
        return every if self.steps is None else every[self.steps[0] : self.steps[1]]

    @property
    def muon_kwargs(self) -> dict[str, Any]:
        return {
            "lr": self.lr,
            "momentum": self.momentum,
            "nesterov": self.nesterov,
            "weight_decay": self.weight_decay,
        }


def float32_newton_schulz(
    grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> torch.Tensor:
    """torch's Newton-Schulz iteration for Muon, in float32. Muon's own casts the update to
    bfloat16: gradients averaged over ranks differ from one process's in their last
    float32 bits, which now and then moves one bfloat16 rounding and, through the
    iteration, every element of the matrix by ~1e-4. Randomised comparisons use this to
    see Whole's own arithmetic, which must match to 1e-5; fixed ones keep Muon's."""
    a, b, c = ns_coefficients
    x = grad.float()
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).to(grad.dtype)


@contextlib.contextmanager
def newton_schulz(run: MuonRun) -> Iterator[None]:
    """Muon's own iteration, or the float32 one for the duration."""
    if not run.float32:
        yield
        return
    from torch.optim import _muon

    original = _muon._zeropower_via_newtonschulz
    _muon._zeropower_via_newtonschulz = float32_newton_schulz
    try:
        yield
    finally:
        _muon._zeropower_via_newtonschulz = original


def _split(named: Iterator[tuple[str, nn.Parameter]], ndim: Any) -> tuple[list[Any], list[Any]]:
    matrices, rest = [], []
    for name, param in named:
        (matrices if ndim(name, param) == 2 else rest).append(param)
    return matrices, rest


def reference(run: MuonRun, start: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """The unwrapped model in one process with ``torch.optim.Muon`` and AdamW."""
    with newton_schulz(run):
        return _reference(run, start)


def _reference(run: MuonRun, start: dict[str, np.ndarray] | None) -> dict[str, Any]:
    sc = run.scenario
    net = make_net(sc)
    if start is not None:
        net.load_state_dict({k: torch.from_numpy(v) for k, v in start.items()}, strict=False)
    for name, param in net.named_parameters():
        if sc.frozen and name.startswith(sc.frozen):
            param.requires_grad_(False)
    matrices, rest = _split(net.named_parameters(), lambda n, p: p.ndim)
    muon = torch.optim.Muon(matrices, **run.muon_kwargs)
    adamw = torch.optim.AdamW(rest, lr=0.01)
    for number, micros in enumerate(run.chosen()):
        if number == run.halve_after:
            for p in matrices:
                p.data.mul_(0.5)
        reference_backward(sc, net, micros)
        muon.step()
        adamw.step()
        muon.zero_grad(set_to_none=sc.set_to_none)
        adamw.zero_grad(set_to_none=sc.set_to_none)
    names = {id(p): n for n, p in net.named_parameters()}
    return {
        "params": {k: v.detach().numpy().copy() for k, v in net.named_parameters()},
        "momentum": {
            names[id(p)]: s["momentum_buffer"].numpy().copy() for p, s in muon.state.items()
        },
    }


def distributed(
    run: MuonRun,
    start: dict[str, np.ndarray] | None = None,
    load: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The same with FSDP + flatview: ``Whole(torch.optim.Muon, ...)`` on the matrices.
    ``start``/``load``: parameters and the Muon state to resume from."""
    sc = run.scenario
    with backend_context(sc.backend), newton_schulz(run):
        net = make_net(sc)
        if start is not None:
            net.load_state_dict({k: torch.from_numpy(v) for k, v in start.items()}, strict=False)
        model, fv, _ = distributed_model(sc, net)
        matrices, rest = _split(fv.named_parameters(), lambda n, p: fv.shape_of(p).ndim)
        muon = Whole(torch.optim.Muon, fv, matrices, **run.muon_kwargs)
        adamw = torch.optim.AdamW(rest, lr=0.01)
        if load is not None:
            fv.load_optim_state_dict(muon, load["muon"])
            fv.load_optim_state_dict(adamw, load["adamw"])
        moved, used = [], []
        for number, micros in enumerate(run.chosen()):
            if number == run.halve_after:
                for p in matrices:
                    p.data.mul_(0.5)
            synced_backward(sc, model, fv, micros)
            # What the step may move at most: gradients in and updates out of every
            # matrix with a gradient, except the owner's own piece.
            used.append(
                sum(
                    fv.placement(p).numel * p.element_size()
                    for p in matrices
                    if _has_grad_anywhere(p)
                )
            )
            with CollectiveCounter() as counter:
                muon.step()
            moved.append(dict(counter.bytes))
            adamw.step()
            muon.zero_grad(set_to_none=sc.set_to_none)
            adamw.zero_grad(set_to_none=sc.set_to_none)
        state = fv.optim_state_dict(muon)
        saved = {"muon": state, "adamw": fv.optim_state_dict(adamw)}
        params = full_state(model, sc)
        return {
            "params": params,
            "state": state,
            "saved": saved,
            "moved": moved,
            "used": used,
            "repr": repr(muon),
            "owned": sum(fv.placement(m).numel for m in matrices if _owned(fv, muon, m)),
        }


def _has_grad_anywhere(param: torch.Tensor) -> bool:
    flag = torch.tensor([float(param.grad is not None)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _owned(fv: flatview.FlatView, opt: Whole, param: torch.Tensor) -> bool:
    # Owners are ranks of the group flatview exchanges in (a shard group under hybrid
    # sharding), not of the world.
    rank = dist.get_rank(fv.adapter.group)
    return any(m.tensor is param and m.owner == rank for m in opt._members)


def refusals(scenario: Scenario) -> list[str]:
    """Every refusal of :class:`Whole`, on every rank alike (no collective runs first)."""
    messages = []
    with backend_context(scenario.backend):
        _, fv, _ = distributed_model(scenario)
        other = torch.nn.Parameter(torch.zeros(2, 2))
        attempts: list[tuple[type[torch.optim.Optimizer], list[Any]]] = [
            # A bias is 1-D: Muon refuses it, flatview names it.
            (torch.optim.Muon, [p for _, p in fv.named_parameters()]),
            (torch.optim.Muon, [other]),
            (torch.optim.LBFGS, [p for _, p in fv.named_parameters()]),
        ]
        for cls, params in attempts:
            try:
                Whole(cls, fv, params)
            except flatview.OptimStateError as err:
                messages.append(str(err))
        # Still usable afterwards: the refusals ran no collective.
        matrices = [p for _, p in fv.named_parameters() if len(fv.placement(p).shape) == 2]
        Whole(torch.optim.Muon, fv, matrices).step()
    return messages
