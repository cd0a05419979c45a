"""Worker functions for the per-parameter norm tests (run in the pool), and the
single-process references they are compared with.

Norms travel back as ``{name: float or None}``; every worker returns plain data or
raises, so the test process asserts on it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import flatview
from flatview.local_tensors import local_tensor
from flatview.optim import LARC, trust_ratios
from flatview.testing.counting import CollectiveCounter
from tests.scenarios import (
    HYBRID_SHARD_SIZE,
    Scenario,
    _original_tree,
    backend_context,
    distributed_model,
    distributed_training,
    full_state,
    local_batch,
    loss_of,
    make_net,
    no_sync,
    optimizer_steps,
    reference_backward,
    reference_model,
    reference_training,
    synced_backward,
    wrap_fsdp,
)

Norms = dict[str, float | None]
"""One call's result: ``{name: norm or None}``."""
Record = dict[str, Norms]
"""What one optimizer step saw: ``{"param 2.0": ..., "grad inf": ...}``."""


def as_floats(norms: dict[str, torch.Tensor] | dict[str, torch.Tensor | None]) -> Norms:
    return {name: None if n is None else float(n) for name, n in norms.items()}


def reference_norm(tensor: torch.Tensor | None, norm_type: float) -> float | None:
    if tensor is None:
        return None
    return float(torch.linalg.vector_norm(tensor.detach(), norm_type))


@contextlib.contextmanager
def wrapped(scenario: Scenario) -> Iterator[tuple[nn.Module, flatview.FlatView]]:
    with backend_context(scenario.backend):
        model = wrap_fsdp(scenario, make_net(scenario))
        yield model, flatview.wrap(model, **scenario.flatview_options)


# ------------------------------------------------------------------ equivalence


def norms_while_training(
    scenario: Scenario, norm_types: Sequence[float]
) -> tuple[list[Record], list[dict[str, int]], list[Record]]:
    """Train the scenario with per-submodule optimizers over views; after every synced
    backward record the parameter and gradient norms of every norm type, the
    collectives each call issued, and the same norms computed the slow way from every
    rank's pieces of this run (:func:`_assembled`)."""
    with backend_context(scenario.backend):
        model, fv, opts = distributed_model(scenario)
        records, calls, slow = [], [], []
        for stepped in distributed_training(scenario, model, fv, opts):
            if stepped:
                continue
            record: Record = {}
            for norm_type in norm_types:
                with CollectiveCounter() as counter:
                    record[f"param {norm_type}"] = as_floats(fv.param_norms(norm_type=norm_type))
                calls.append(dict(counter.calls))
                with CollectiveCounter() as counter:
                    record[f"grad {norm_type}"] = as_floats(fv.grad_norms(norm_type=norm_type))
                calls.append(dict(counter.calls))
            records.append(record)
            named = dict(fv.named_parameters())
            slow.append(
                {
                    f"{kind} {norm_type}": _assembled(
                        fv,
                        scenario,
                        {n: p if kind == "param" else p.grad for n, p in named.items()},
                        norm_type,
                    )
                    for norm_type in norm_types
                    for kind in ("param", "grad")
                }
            )
        return records, calls, slow


def reference_norms_while_training(scenario: Scenario, norm_types: Sequence[float]) -> list[Record]:
    """:func:`norms_while_training` in one process, without any wrapper."""
    net, opts = reference_model(scenario)
    records = []
    for _ in reference_training(scenario, net, opts):
        record: Record = {}
        for norm_type in norm_types:
            named = list(net.named_parameters())
            record[f"param {norm_type}"] = {n: reference_norm(p, norm_type) for n, p in named}
            record[f"grad {norm_type}"] = {n: reference_norm(p.grad, norm_type) for n, p in named}
        records.append(record)
    return records


def subsets_and_tensors(scenario: Scenario) -> dict[str, Any]:
    """After one backward: norms of a parameter group (views and names, in any order),
    of optimizer state (``tensor_norms``), trust ratios, and the collectives of each."""
    with wrapped(scenario) as (model, fv):
        tree = _original_tree(model)
        opt = torch.optim.Adam(fv.parameters(), lr=0.01)
        synced_backward(scenario, model, fv, range(1))
        opt.step()
        opt.zero_grad()
        synced_backward(scenario, model, fv, range(1, 2))
        group = [*reversed(list(tree.head.parameters())), "stem.weight", "head.bias"]
        state = {p: opt.state[p]["exp_avg"] if p in opt.state else None for p in fv.parameters()}
        out: dict[str, Any] = {"calls": []}
        calls: list[dict[str, int]] = out["calls"]
        with CollectiveCounter() as counter:
            out["group"] = as_floats(fv.grad_norms(group, norm_type=1.0))
        calls.append(dict(counter.calls))
        with CollectiveCounter() as counter:
            out["exp_avg"] = as_floats(fv.tensor_norms(state))
        calls.append(dict(counter.calls))
        with CollectiveCounter() as counter:
            out["trust"] = as_floats(trust_ratios(fv, weight_decay=0.1, trust_coefficient=0.5))
        calls.append(dict(counter.calls))
        names = dict(fv.named_parameters())
        # exp_avg assembled from every rank's piece, for the reference.
        out["exp_avg_full"] = _assembled(fv, scenario, {n: state[p] for n, p in names.items()})
        out["params"] = full_state(model, scenario)
        return out


def _assembled(
    fv: flatview.FlatView,
    scenario: Scenario,
    pieces: dict[str, torch.Tensor | None],
    norm_type: float = 2.0,
) -> dict[str, float | None]:
    """Norms of ``pieces`` computed the slow way: every rank's piece gathered (one copy
    where every rank holds the whole, one shard group's under hybrid sharding),
    concatenated, and measured in float64. Padding in a piece is zeros, which no norm
    sees."""
    gathered: list[dict[str, np.ndarray | None]] = [{} for _ in range(dist.get_world_size())]
    # FSDP2's pieces are DTensors: this rank's shard is their local tensor.
    mine = {
        n: None if t is None else local_tensor(t).detach().reshape(-1).numpy()
        for n, t in pieces.items()
    }
    dist.all_gather_object(gathered, mine)
    if scenario.config.hybrid or "hsdp" in scenario.options:
        # Replicas hold the same pieces: one shard group's (ranks 0, 1, ...) make the whole.
        gathered = gathered[:HYBRID_SHARD_SIZE]
    out: dict[str, float | None] = {}
    for name in pieces:
        parts = [g[name] for g in gathered if g[name] is not None]
        if scenario.config.replicated:
            parts = parts[:1]
        whole = np.concatenate(parts).astype(np.float64) if parts else None
        out[name] = None if whole is None else float(np.linalg.norm(whole, ord=norm_type))
    return out


def reference_state_norms(scenario: Scenario) -> dict[str, Any]:
    """:func:`subsets_and_tensors`' trust ratios in one process."""
    net = make_net(scenario)
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    reference_backward(scenario, net, range(1))
    opt.step()
    opt.zero_grad()
    reference_backward(scenario, net, range(1, 2))
    trust = {}
    for name, p in net.named_parameters():
        if p.grad is None:
            trust[name] = None
            continue
        w, g = reference_norm(p, 2.0), reference_norm(p.grad, 2.0)
        assert w is not None and g is not None
        trust[name] = 1.0 if w == 0 or g == 0 else 0.5 * w / (g + 0.1 * w + 1e-8)
    return {
        "group": {
            n: reference_norm(p.grad, 1.0)
            for n, p in net.named_parameters()
            if n in ("head.weight", "head.bias", "stem.weight")
        },
        "exp_avg": {
            n: float(opt.state[p]["exp_avg"].norm()) if p in opt.state else None
            for n, p in net.named_parameters()
        },
        "trust": trust,
    }


# ------------------------------------------------------------------------- LARC


def larc_groups(params: Iterable[tuple[str, nn.Parameter]]) -> list[dict[str, Any]]:
    """Two parameter groups by name: weights decayed, biases and norms not."""
    named = list(params)
    decay = [p for n, p in named if n.endswith("weight") and ".norm." not in n]
    other = [p for n, p in named if not (n.endswith("weight") and ".norm." not in n)]
    return [
        {"params": decay, "weight_decay": 1e-3},
        {"params": other, "weight_decay": 0.0, "lr": 0.05},
    ]


def larc_training(scenario: Scenario) -> tuple[dict[str, np.ndarray] | None, list[dict[str, int]]]:
    """SGD with momentum under flatview's LARC, with the scenario's skips; the final
    full parameters (rank 0) and the collectives of every LARC step."""
    with wrapped(scenario) as (model, fv):
        opt = LARC(
            fv,
            torch.optim.SGD(larc_groups(fv.named_parameters()), lr=0.1, momentum=0.9),
            trust_coefficient=0.02,
        )
        calls = []
        for micros in optimizer_steps(scenario):
            synced_backward(scenario, model, fv, micros)
            with CollectiveCounter() as counter:
                opt.step()
            calls.append(dict(counter.calls))
            opt.zero_grad()
        return full_state(model, scenario), calls


def apex_larc_step(
    optimizer: torch.optim.Optimizer, trust_coefficient: float, clip: bool, eps: float
) -> None:
    """apex.parallel.LARC.step, as apex writes it (whole tensors, one process)."""
    with torch.no_grad():
        weight_decays = []
        for group in optimizer.param_groups:
            weight_decay = group.get("weight_decay", 0)
            weight_decays.append(weight_decay)
            group["weight_decay"] = 0
            for p in group["params"]:
                if p.grad is None:
                    continue
                param_norm = torch.norm(p.data)
                grad_norm = torch.norm(p.grad.data)
                if param_norm != 0 and grad_norm != 0:
                    adaptive_lr = (
                        trust_coefficient
                        * param_norm
                        / (grad_norm + param_norm * weight_decay + eps)
                    )
                    if clip:
                        adaptive_lr = min(adaptive_lr / group["lr"], 1)
                    p.grad.data += weight_decay * p.data
                    p.grad.data *= adaptive_lr
    optimizer.step()
    for i, group in enumerate(optimizer.param_groups):
        group["weight_decay"] = weight_decays[i]


def reference_larc_training(scenario: Scenario, larc: bool = True) -> dict[str, np.ndarray]:
    """:func:`larc_training` in one process, with apex's LARC (or, ``larc=False``, with
    plain SGD): the final parameters."""
    net = make_net(scenario)
    opt = torch.optim.SGD(larc_groups(net.named_parameters()), lr=0.1, momentum=0.9)
    for micros in optimizer_steps(scenario):
        reference_backward(scenario, net, micros)
        if larc:
            apex_larc_step(opt, 0.02, True, 1e-8)
        else:
            opt.step()
        opt.zero_grad()
    return {k: v.detach().numpy().copy() for k, v in net.named_parameters()}


# ------------------------------------------------------------------------- LAMB

NormsOf = Callable[[dict[nn.Parameter, Any]], dict[nn.Parameter, Any]]


@torch.no_grad()
def lamb_step(
    params: Sequence[nn.Parameter],
    state: dict[nn.Parameter, dict[str, Any]],
    param_norms: Callable[[Sequence[nn.Parameter]], dict[nn.Parameter, Any]],
    tensor_norms: NormsOf,
    lr: float = 0.02,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-6,
    weight_decay: float = 0.01,
) -> None:
    """LAMB (the recipe in docs/recipes.md): Adam's update with weight decay, scaled
    per parameter by ``||w|| / ||update||``; the norms come from the callables."""
    updates: dict[nn.Parameter, torch.Tensor | None] = {}
    for p in params:
        if p.grad is None:
            updates[p] = None  # every rank still names p: the call is collective
            continue
        s = state.setdefault(p, {"step": 0, "m": torch.zeros_like(p), "v": torch.zeros_like(p)})
        s["step"] += 1
        s["m"].lerp_(p.grad, 1 - betas[0])
        s["v"].mul_(betas[1]).addcmul_(p.grad, p.grad, value=1 - betas[1])
        m_hat = s["m"] / (1 - betas[0] ** s["step"])
        v_hat = s["v"] / (1 - betas[1] ** s["step"])
        updates[p] = m_hat / (v_hat.sqrt() + eps) + weight_decay * p
    w_norms = param_norms(params)
    u_norms = tensor_norms(updates)
    for p, update in updates.items():
        if update is None:
            continue
        w, u = w_norms[p], u_norms[p]
        ratio = torch.where((w > 0) & (u > 0), w / u, torch.ones_like(w))
        p.sub_(lr * ratio * update)


def lamb_training(scenario: Scenario) -> tuple[dict[str, np.ndarray] | None, list[dict[str, int]]]:
    """LAMB over all views, with the scenario's skips: the final full parameters (rank
    0) and the collectives of every step's norms."""
    with wrapped(scenario) as (model, fv):
        params = list(fv.parameters())
        names = {p: n for n, p in fv.named_parameters()}

        def param_norms(ps: Sequence[nn.Parameter]) -> dict[nn.Parameter, Any]:
            found = fv.param_norms(ps)
            return {p: found[names[p]] for p in ps}

        def tensor_norms(tensors: dict[nn.Parameter, Any]) -> dict[nn.Parameter, Any]:
            found = fv.tensor_norms(tensors)
            return {p: found[names[p]] for p in tensors}

        state: dict[nn.Parameter, dict[str, Any]] = {}
        calls = []
        for micros in optimizer_steps(scenario):
            synced_backward(scenario, model, fv, micros)
            with CollectiveCounter() as counter:
                lamb_step(params, state, param_norms, tensor_norms)
            calls.append(dict(counter.calls))
            for p in params:
                p.grad = None
        return full_state(model, scenario), calls


def reference_lamb_training(scenario: Scenario) -> dict[str, np.ndarray]:
    net = make_net(scenario)
    params = list(net.parameters())

    def norms(tensors: Any) -> dict[nn.Parameter, Any]:
        items = tensors.items() if isinstance(tensors, dict) else ((p, p) for p in tensors)
        return {p: None if t is None else torch.linalg.vector_norm(t) for p, t in items}

    state: dict[nn.Parameter, dict[str, Any]] = {}
    for micros in optimizer_steps(scenario):
        reference_backward(scenario, net, micros)
        lamb_step(params, state, norms, norms)
        for p in params:
            p.grad = None
    return {k: v.detach().numpy().copy() for k, v in net.named_parameters()}


# ----------------------------------------------------------------------- errors


def bad_arguments(scenario: Scenario) -> dict[str, str]:
    """The error each kind of bad argument raises, and any collective issued first
    (none may be)."""
    with wrapped(scenario) as (model, fv):
        tree = _original_tree(model)
        synced_backward(scenario, model, fv, range(1))
        from tests.workers import flats_and_shards

        flats = flats_and_shards(model, scenario.backend)
        # A gradient every rank holds (an empty view has none): the call must be the
        # same everywhere.
        held = [n for n, p in fv.named_parameters() if p.grad is not None]
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, held)
        common = [n for n in held if all(n in other for other in everyone)]
        grad_of = "stem.bias" if "stem.bias" in common else common[0]
        grad = dict(fv.named_parameters())[grad_of].grad
        cases: dict[str, Any] = {
            "name": lambda: fv.param_norms(["head.weight", "body.9.up.weight"]),
            "typo": lambda: fv.param_norms("head.wieght"),
            "foreign": lambda: fv.param_norms([tree.head.weight, torch.zeros(3)]),
            # DDP flattens nothing: there is no flat parameter to pass.
            "flat": lambda: fv.param_norms([flats[0][0]]) if flats else fv.param_norms([3]),
            "grad": lambda: fv.param_norms([grad]),
            "number": lambda: fv.param_norms([3]),
            "mapping": lambda: fv.param_norms({"head.weight": 1}),
            "module": lambda: fv.param_norms(tree.head),
            "zero": lambda: fv.grad_norms(norm_type=0),
            "negative": lambda: fv.param_norms(norm_type=-2),
            "nan": lambda: fv.param_norms(norm_type=math.nan),
            "text": lambda: fv.param_norms(norm_type="fro"),
            "tensors": lambda: fv.tensor_norms([tree.head.weight]),
        }
        messages = {}
        for kind, call in cases.items():
            with CollectiveCounter() as counter:
                try:
                    call()
                except flatview.FlatViewError as err:
                    messages[kind] = f"{type(err).__name__}: {err}"
                else:
                    messages[kind] = "accepted"
            if counter.calls:
                messages[kind] += f" after collectives {dict(counter.calls)}"
        return messages


def wrong_phase(scenario: Scenario, where: str) -> None:
    """A norm call while the model computes, inside no_sync(), or after unwrap()."""
    with wrapped(scenario) as (model, fv):
        x, y = local_batch(scenario, 0)
        if where == "forward":
            model(x)  # autograd on and no backward: the model is still computing
            fv.param_norms()
        elif where == "no_sync":
            with no_sync(model):  # FSDP2: set_requires_gradient_sync(False)
                loss_of(model(x), y).backward()
            fv.grad_norms()
        elif where == "unwrapped":
            fv.unwrap()
            fv.param_norms()
        else:
            raise ValueError(where)


def disagreeing_ranks(scenario: Scenario, how: str) -> None:
    """Ranks pass different arguments: each must raise, none may hang."""
    with wrapped(scenario) as (model, fv):
        synced_backward(scenario, model, fv, range(1))
        rank = dist.get_rank()
        if how == "params":
            # What a rank would get by keeping only the parameters with elements here.
            # (FSDP2: the local tensor; the DTensor has the whole parameter's size.)
            here = [p for p in fv.parameters() if local_tensor(p).numel() > 0 or rank == 0]
            fv.grad_norms(here)
        elif how == "subset":
            names = [n for n, _ in fv.named_parameters()]
            fv.param_norms(names[: 1 + rank])
        elif how == "norm_type":
            fv.param_norms(norm_type=2.0 + rank)
        elif how == "inf":
            fv.param_norms(norm_type=math.inf if rank else 2.0)
        elif how == "kind":
            if rank:
                fv.param_norms()
            else:
                fv.grad_norms()
        elif how == "tensor_size":
            fv.tensor_norms({p: torch.zeros(p.numel() + rank) for p in fv.parameters()})
        else:
            raise ValueError(how)
