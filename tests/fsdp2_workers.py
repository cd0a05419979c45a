"""Worker tasks of test_fsdp2_backend.py (FSDP2 ``fully_shard``, HSDP included)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

import flatview
from flatview.errors import FlatViewError
from tests.scenarios import (
    Scenario,
    distributed_model,
    distributed_training,
    full_state,
    local_batch,
    loss_of,
    make_net,
    no_sync,
    optimizer_steps,
    optimizers,
    reference_model,
    reference_training,
    skip_names,
    synced_backward,
    wrap_fsdp,
)


def against_plain(scenario: Scenario) -> dict[str, Any]:
    """Train the scenario with FSDP2 + flatview and with bare FSDP2 (the same skip set on
    every rank, which bare FSDP2 trains correctly) in the same processes: what each
    communicated per step and their final parameters."""
    model, fv, opts = distributed_model(scenario)
    stats, gathers = [], []
    for stepped in distributed_training(scenario, model, fv, opts):
        if not stepped:
            stats.append(fv.stats)
            gathers.append(fv.ledger.calls.get("all_gather", 0))
    return {
        "flatview": full_state(model, scenario),
        "plain": _bare_fsdp2(scenario),
        "stats": stats,
        "gathers": gathers,
    }


def synced_per_backward(scenario: Scenario) -> list[bool]:
    """``fv.stats.synced`` after each backward of the scenario's training (all but each
    step's last micro-batch in its window)."""
    model, fv, opts = distributed_model(scenario)
    synced = []
    for micros in optimizer_steps(scenario):
        for micro in micros:
            xs, ys = local_batch(scenario, micro)
            skip = skip_names(scenario, micro)
            window = contextlib.nullcontext() if micro == micros[-1] else no_sync(model)
            with window, fv.step(skip=list(skip)):
                loss_of(model(xs, skip), ys).backward()
            synced.append(fv.stats.synced)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return synced


def _bare_fsdp2(scenario: Scenario) -> dict[str, Any] | None:
    """The scenario's net sharded with FSDP2 alone, trained as the scenario says: its full
    parameters (rank 0)."""
    plain = wrap_fsdp(scenario, make_net(scenario))
    plain_opts = optimizers(plain)
    for micros in optimizer_steps(scenario):
        synced_backward(scenario, plain, None, micros)
        for opt in plain_opts:
            opt.step()
            opt.zero_grad()
    return full_state(plain, scenario)


def built_on_meta(scenario: Scenario) -> dict[str, Any]:
    """The net built under ``torch.device("meta")`` and sharded there, as large models are
    (torchtitan's order): ``flatview.wrap`` before ``to_empty`` (refused: what it raised),
    then materialized and given the scenario's initial values shard by shard, wrapped and
    trained; and bare FSDP2 built the usual way, trained alike in the same processes."""
    from torch.distributed.tensor import distribute_tensor

    initial = make_net(scenario).state_dict()
    with torch.device("meta"):
        net = make_net(scenario)
    model = wrap_fsdp(scenario, net)
    try:
        flatview.wrap(model)
        refused = None
    except FlatViewError as error:
        refused = f"{type(error).__name__}: {error}"
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            value = initial[name]
            if hasattr(tensor, "device_mesh"):
                value = distribute_tensor(value, tensor.device_mesh, tensor.placements)
            tensor.copy_(value)
    fv = flatview.wrap(model)
    opts = optimizers(model)
    for _ in distributed_training(scenario, model, fv, opts):
        pass
    return {
        "refused": refused,
        "flatview": full_state(model, scenario),
        "plain": _bare_fsdp2(scenario),
    }


def mismatch(per_block: bool, declare: bool, hsdp: bool = False) -> dict[str, Any]:
    """Ranks skip different blocks (rank r skips block r % 2; with ``hsdp``, on a 2 x 2
    mesh, replica r // 2 skips block r // 2: the shard groups agree within). With
    flatview (``declare``): the error each rank raised; without: how far bare FSDP2's
    gradients are from the correct ones (each rank's own forward, averaged)."""
    scenario = Scenario(
        backend="fsdp2",
        world_size=dist.get_world_size(),
        inner=(4, 4),
        norms=(False, False),
        nested=per_block,
        options={"hsdp": 2} if hsdp else {},
    )
    rank = dist.get_rank()
    skip = (f"body.{rank // 2 if hsdp else rank % 2}",)
    xs, ys = local_batch(scenario, 0)
    if declare:
        model, fv, _ = distributed_model(scenario)
        try:
            with fv.step(skip=list(skip)):
                loss_of(model(xs, skip), ys).backward()
        except FlatViewError as error:
            return {"error": type(error).__name__, "message": str(error)}
        return {"error": None}
    model = wrap_fsdp(scenario, make_net(scenario))
    loss_of(model(xs, skip), ys).backward()
    reference = make_net(scenario)
    loss_of(reference(xs, skip), ys).backward()
    worst = 0.0
    world = dist.get_world_size()
    for (_, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        want = q.grad if q.grad is not None else torch.zeros_like(q)
        dist.all_reduce(want)
        want /= world
        rows = -(-want.shape[0] // world)
        mine = want[rank * rows : (rank + 1) * rows]
        got = p.grad.to_local() if p.grad is not None else torch.zeros_like(mine)
        if mine.numel():
            worst = max(worst, float((got - mine).abs().max()))
    return {"error": None, "worst": worst}


def undeclared(everywhere: bool) -> dict[str, Any]:
    """Block 1's gate gets no gradient (its forward skips the gate) without being declared
    skipped: on rank 0 only, or on every rank."""
    scenario = Scenario(backend="fsdp2", world_size=dist.get_world_size(), gates=(True, True))
    model, fv, _ = distributed_model(scenario)
    xs, ys = local_batch(scenario, 0)
    unused = ("body.1.gate",) if everywhere or dist.get_rank() == 0 else ()
    out: dict[str, Any] = {}
    try:
        with fv.step():
            loss_of(model(xs, unused), ys).backward()
    except FlatViewError as error:
        out["error"] = type(error).__name__
        out["message"] = str(error)
    gate = dict(fv.named_parameters())["body.1.gate.weight"]
    out["gate_grad_none"] = gate.grad is None
    # The next step trains on normally.
    with fv.step(skip=["body.1.gate"]):
        loss_of(model(xs, ("body.1.gate",)), ys).backward()
    out["after"] = fv.stats is not None and fv.stats.params_skipped == 2
    return out


def skipped_used(one_rank: bool = False, hsdp: int = 0) -> dict[str, Any]:
    """A parameter declared skipped that the model uses (on every rank, or on rank 0
    alone, whose backward then differs from the others'), then a valid step."""
    scenario = Scenario(
        backend="fsdp2",
        world_size=dist.get_world_size(),
        gates=(True, True),
        options={"hsdp": hsdp} if hsdp else {},
    )
    model, fv, opts = distributed_model(scenario)
    xs, ys = local_batch(scenario, 0)
    out: dict[str, Any] = {"error": None}
    used = not one_rank or dist.get_rank() == 0
    try:
        with fv.step(skip=["body.0.gate"]):
            loss_of(model(xs, () if used else ("body.0.gate",)), ys).backward()
    except FlatViewError as error:
        out["error"] = type(error).__name__
        out["message"] = str(error)
    for opt in opts:
        opt.zero_grad(set_to_none=True)
    with fv.step(skip=["body.0.gate"]):
        loss_of(model(xs, ("body.0.gate",)), ys).backward()
    grads = dict(fv.named_parameters())
    out["after"] = grads["body.0.gate.weight"].grad is None and all(
        p.grad is not None for n, p in grads.items() if not n.startswith("body.0.gate")
    )
    return out


def skipped_unit_called() -> str | None:
    scenario = Scenario(backend="fsdp2", world_size=dist.get_world_size())
    model, fv, _ = distributed_model(scenario)
    xs, _ = local_batch(scenario, 0)
    try:
        with fv.step(skip=["body.1"]):
            model(xs)
    except FlatViewError as error:
        return type(error).__name__
    return None


def norms_and_state(scenario: Scenario) -> dict[str, Any]:
    """After training: param and grad norms and the consolidated optimizer state, against
    the single-process reference; the state loaded back consolidates to the same."""
    model, fv, opts = distributed_model(scenario)
    ref, ref_opts = reference_model(scenario)
    reference = reference_training(scenario, ref, ref_opts)
    worst: dict[str, float] = {"param": 0.0, "grad": 0.0, "state": 0.0}
    for stepped in distributed_training(scenario, model, fv, opts):
        if stepped:
            continue
        next(reference)  # the reference's backward of the same step
        want = dict(ref.named_parameters())
        for name, norm in fv.param_norms().items():
            worst["param"] = max(worst["param"], abs(float(norm) - float(want[name].norm())))
        for name, norm in fv.grad_norms().items():
            grad = want[name].grad
            assert (norm is None) == (grad is None), name
            if norm is not None and grad is not None:
                worst["grad"] = max(worst["grad"], abs(float(norm) - float(grad.norm())))
    for _ in reference:
        pass
    for opt, ref_opt in zip(opts, ref_opts, strict=True):
        state = fv.optim_state_dict(opt)
        names = {id(p): n for n, p in ref.named_parameters()}
        for p, entry in ref_opt.state.items():
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    got = state["state"][names[id(p)]][key]
                    worst["state"] = max(worst["state"], float((got - value).abs().max()))
        fv.load_optim_state_dict(opt, state)
        again = fv.optim_state_dict(opt)
        for name, entry in state["state"].items():
            for key, value in entry.items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(value, again["state"][name][key]), (name, key)
    return worst


def hybrid_stats() -> list[dict[str, int]]:
    """HSDP 2 x 2, per-block: per step, the ledger's calls and bytes by kind, with block 1
    skipped and with nothing skipped."""
    scenario = Scenario(
        backend="fsdp2", world_size=4, inner=(4, 4, 4), norms=(False,) * 3, options={"hsdp": 2}
    )
    model, fv, _ = distributed_model(scenario)
    out = []
    for skip in ((), ("body.1",), ("body.0", "body.2")):
        xs, ys = local_batch(scenario, 0)
        with fv.step(skip=list(skip)):
            loss_of(model(xs, skip), ys).backward()
        out.append(
            {
                **{f"calls.{k}": v for k, v in fv.ledger.calls.items()},
                **{f"bytes.{k}": v for k, v in fv.ledger.bytes.items()},
                "reduced_bytes": fv.stats.reduced_bytes if fv.stats else -1,
                "replica_bytes": fv.stats.replica_bytes if fv.stats else -1,
            }
        )
    return out


def refused(kind: str) -> str:
    """The WrapError message for an FSDP2 configuration flatview does not support."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    net = make_net(Scenario(backend="fsdp2"))
    options: dict[str, Any] = {}
    if kind == "offload":
        fully_shard(net, offload_policy=CPUOffloadPolicy(pin_memory=False))
        target: Any = net
    elif kind == "replicate":  # torch's replicate built on FSDP2: no shard dimension
        from torch.distributed._composable.replicate_with_fsdp import replicate
        from torch.distributed.device_mesh import init_device_mesh

        target = replicate(net, mesh=init_device_mesh("cpu", (1,)))
    elif kind == "unsharded-root":  # only the blocks sharded, not the root
        for block in net.body:
            fully_shard(block)
        target = net
    else:  # reduction options FSDP2's own collectives would ignore
        fully_shard(net)
        target = net
        if kind == "all-to-all":
            options["reduce_strategy"] = "all_to_all"
        else:
            options["reduce_options"] = flatview.ReduceOptions(keep_buffer_bytes=0)
    try:
        flatview.wrap(target, **options)
    except flatview.WrapError as error:
        return str(error)
    return ""


def _generate(self: Any, x: torch.Tensor) -> torch.Tensor:
    """A generation method (Hugging Face's ``generate`` calls the model itself, several
    times, without autograd)."""
    with torch.no_grad():
        first = self(x)
        return (first + self(0.5 * x)).argmax(-1)


def _train_loss(self: Any, x: torch.Tensor, y: torch.Tensor, skip: Any) -> torch.Tensor:
    """A training loss computed by a method, through the model's ``forward`` itself."""
    return loss_of(self.forward(x, skip), y)


def registered_forward_methods(scenario: Scenario, use_flatview: bool) -> dict[str, Any]:
    """FSDP2 told to run ``generate`` and ``train_loss`` as forwards
    (``register_fsdp_forward_method``), as RLHF loops do for generation: bare or wrapped
    by flatview, the scenario's steps trained through the model itself (even steps) or
    through ``train_loss`` (odd ones), each followed by a generation. Returns every
    generation and rank 0's final parameters."""
    import types

    from torch.distributed.fsdp import register_fsdp_forward_method

    net = make_net(scenario)
    net.generate = types.MethodType(_generate, net)  # type: ignore[assignment]
    net.train_loss = types.MethodType(_train_loss, net)  # type: ignore[assignment]
    model = wrap_fsdp(scenario, net)
    register_fsdp_forward_method(model, "generate")
    register_fsdp_forward_method(model, "train_loss")
    fv = flatview.wrap(model) if use_flatview else None
    params = list(fv.parameters()) if fv is not None else list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    generated = []
    for micro in range(len(scenario.skips)):
        x, y = local_batch(scenario, micro)
        skip = skip_names(scenario, micro)
        with fv.step(skip=skip) if fv is not None else contextlib.nullcontext():
            if micro % 2:
                model.train_loss(x, y, skip).backward()  # type: ignore[operator]
            else:
                loss_of(model(x, skip), y).backward()
        opt.step()
        opt.zero_grad()
        generated.append(model.generate(x).tolist())  # type: ignore[operator]
    return {"generated": generated, "params": full_state(model, scenario)}


def window_error_recovery(scenario: Scenario, kind: str) -> dict[str, Any]:
    """The first micro-batch of an HSDP ``set_requires_all_reduce(False)`` window goes
    wrong (``kind``), the user zeroes the gradients and runs a clean window: the error
    raised, and that window's gradients against a fresh model's for the same window (the
    parameters are unchanged: no optimizer step in between)."""
    model, fv, _ = distributed_model(scenario)
    batches = [local_batch(scenario, micro) for micro in (0, 1)]
    (x0, y0), (x1, y1) = batches
    rank = dist.get_rank()
    error = None
    try:
        if kind == "undeclared":
            # body.1.gate unused in both micro-batches, never declared skipped: found where
            # the window closes.
            with no_sync(model), fv.step():
                loss_of(model(x0, ("body.1.gate",)), y0).backward()
            with fv.step():
                loss_of(model(x1, ("body.1.gate",)), y1).backward()
        else:
            # Declared skipped, used (on every rank, or on rank 0 alone) inside the window,
            # after later units' reduce-scatters have begun their window's sums: found
            # where the window closes, on every rank.
            used = kind == "used_everywhere" or rank == 0
            with no_sync(model), fv.step(skip=["body.1.gate"]):
                loss_of(model(x0, () if used else ("body.1.gate",)), y0).backward()
            with fv.step(skip=["body.1.gate"]):
                loss_of(model(x1, ("body.1.gate",)), y1).backward()
    except FlatViewError as raised:
        error = type(raised).__name__
    model.zero_grad(set_to_none=True)
    fresh, fresh_fv, _ = distributed_model(scenario)
    grads = []
    for m, f in ((model, fv), (fresh, fresh_fv)):
        with no_sync(m), f.step(skip=["body.0", "body.2.gate", "body.3.gate"]):
            loss_of(m(x0, ("body.0", "body.2.gate", "body.3.gate")), y0).backward()
        with f.step(skip=["body.1", "body.3.gate"]):
            loss_of(m(x1, ("body.1", "body.3.gate")), y1).backward()
        grads.append({n: p.grad for n, p in f.named_parameters()})
    recovered, clean = grads
    worst = 0.0
    for name, grad in clean.items():
        assert (grad is None) == (recovered[name] is None), name
        if grad is not None:
            # FSDP2's views are DTensors: compare this rank's elements.
            here, there = grad.to_local(), recovered[name].to_local()
            if here.numel():
                worst = max(worst, (here - there).abs().max().item())
    held = {n for n, p in fresh_fv.named_parameters() if p.to_local().numel()}
    none = sorted(n for n, g in clean.items() if g is None and n in held)
    return {"error": error, "worst": worst, "none": none}


def one_rank_used_then_training(scenario: Scenario) -> dict[str, Any]:
    """Rank 0 alone uses ``body.0.gate``, declared skipped (in the first micro-batch of a
    window where the scenario accumulates); the error caught on every rank and the
    gradients zeroed, the scenario trains: its parameters, for the reference's."""
    model, fv, opts = distributed_model(scenario)
    (x0, y0), (x1, y1) = local_batch(scenario, 0), local_batch(scenario, 1)
    used = () if dist.get_rank() == 0 else ("body.0.gate",)
    error = None
    try:
        if scenario.accumulate > 1:
            with no_sync(model), fv.step(skip=["body.0.gate"]):
                loss_of(model(x0, used), y0).backward()
            with fv.step(skip=["body.0.gate"]):
                loss_of(model(x1, ("body.0.gate",)), y1).backward()
        else:
            with fv.step(skip=["body.0.gate"]):
                loss_of(model(x0, used), y0).backward()
    except FlatViewError as raised:
        error = type(raised).__name__
    for opt in opts:
        opt.zero_grad(set_to_none=True)
    for _ in distributed_training(scenario, model, fv, opts):
        pass
    return {"error": error, "params": full_state(model, scenario)}
