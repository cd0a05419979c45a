"""Worker tasks of test_fsdp2_held.py: FSDP2's small reduce-scatters held and run as one
(``ReduceOptions.bucket_all_used``, :mod:`flatview.comm.held`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

import flatview
from tests.scenarios import (
    Scenario,
    distributed_model,
    distributed_training,
    full_state,
    local_batch,
    loss_of,
    make_net,
    optimizers,
    wrap_fsdp,
)

UNITS = 3  # the blocks of the scenarios below, each its own unit, and the root


def held_against_unheld(scenario: Scenario, bucket: bool | None) -> dict[str, Any]:
    """Train ``scenario`` with ``bucket_all_used=bucket`` and with ``False`` (each unit
    reduce-scattered on its own, as bare FSDP2 does) in the same processes: their final
    parameters, and per optimizer step what each reduced (counted at the collectives)."""
    out: dict[str, Any] = {}
    for key, value in (("held", bucket), ("unheld", False)):
        run = replace(scenario, options={**scenario.options, "bucket_all_used": value})
        model, fv, opts = distributed_model(run)
        steps = []
        for stepped in distributed_training(run, model, fv, opts):
            if not stepped:
                stats = fv.stats
                assert stats is not None
                steps.append((stats.reduce_calls, stats.reduced_bytes, stats.used_bytes))
        out[key] = {"state": full_state(model, run), "steps": steps}
    return out


class CountedReduceScatter(DefaultReduceScatter):
    """A user's own reduce-scatter (here FSDP2's default, subclassed to count its calls):
    flatview must never bypass it."""

    calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        CountedReduceScatter.calls += 1
        return super().__call__(*args, **kwargs)


def _configure(model: Any, kind: str) -> None:
    """Set up what keeps FSDP2 reading a reduce-scatter's output right after the call."""
    units = [m for m in model.modules() if hasattr(m, "set_custom_reduce_scatter")]
    if kind == "custom":
        for unit in units:
            unit.set_custom_reduce_scatter(CountedReduceScatter())
    elif kind == "force-sum":
        for unit in units:
            unit.set_force_sum_reduction_for_comms(True)
    elif kind == "all-reduce-hook":
        # A hook that changes nothing, as a custom HSDP's would on one replica.
        for unit in units:
            unit.set_all_reduce_hook(lambda output: output.mul_(1.0))
    elif kind == "post-accumulate-hook":
        for param in model.parameters():
            param.register_post_accumulate_grad_hook(lambda p: None)


def one_step(kind: str, options: dict[str, Any]) -> dict[str, Any]:
    """One step skipping nothing, with FSDP2 configured as ``kind`` says, with flatview
    (``bucket_all_used`` left at its default) and plain: parameters of both, the
    reduce-scatters flatview counted and those a custom comm saw."""
    scenario = Scenario(
        backend="fsdp2",
        world_size=dist.get_world_size(),
        inner=(4,) * UNITS,
        norms=(False,) * UNITS,
        options=options,
    )
    xs, ys = local_batch(scenario, 0)
    states = {}
    counted = {}
    for key in ("flatview", "plain"):
        model = wrap_fsdp(scenario, make_net(scenario))
        _configure(model, kind)
        CountedReduceScatter.calls = 0
        fv = flatview.wrap(model) if key == "flatview" else None
        opts = optimizers(model)
        if fv is not None:
            with fv.step(skip=[]):
                loss_of(model(xs), ys).backward()
            counted["ledger"] = fv.ledger.calls.get("reduce_scatter", 0)
        else:
            loss_of(model(xs), ys).backward()
        counted[key] = CountedReduceScatter.calls
        for opt in opts:
            opt.step()
        states[key] = full_state(model, scenario)
    return {**states, "calls": counted}


class _UserHookError(RuntimeError):
    pass


def aborted(bucket: bool | None) -> dict[str, Any]:
    """A backward that raises as it reaches the first block (a user's hook), after later
    blocks' reduce-scatters were held; then a step that trains. The gradients right
    after the error, and the parameters at the end."""
    scenario = Scenario(
        backend="fsdp2",
        world_size=dist.get_world_size(),
        inner=(4,) * UNITS,
        norms=(False,) * UNITS,
        gates=(True,) + (False,) * (UNITS - 1),
        options={"bucket_all_used": bucket},
    )
    model, fv, opts = distributed_model(scenario)
    xs, ys = local_batch(scenario, 0)
    error = None

    def refuse(grad: torch.Tensor) -> None:
        raise _UserHookError("the user's hook refuses this gradient")

    def guard(module: Any, args: Any, out: torch.Tensor) -> None:
        out.register_hook(refuse)

    hook = model.body[0].register_forward_hook(guard)
    try:
        with fv.step(skip=[]):
            loss_of(model(xs), ys).backward()
    except _UserHookError as caught:
        error = type(caught).__name__
    hook.remove()
    grads = {
        name: None if p.grad is None else p.grad.to_local().clone()
        for name, p in fv.named_parameters()
    }
    for opt in opts:
        opt.zero_grad()
    with fv.step(skip=[]):
        loss_of(model(xs), ys).backward()
    for opt in opts:
        opt.step()
    return {"error": error, "grads": grads, "state": full_state(model, scenario)}


def refused(kind: str) -> str:
    """The WrapError message for a held-reduce-scatter option flatview cannot serve."""
    world = dist.get_world_size()
    options: dict[str, Any] = {"hsdp": 2} if kind == "hsdp" else {}
    scenario = Scenario(backend="fsdp2", world_size=world, options=options)
    model = wrap_fsdp(scenario, make_net(scenario))
    reduce = (
        flatview.ReduceOptions(bucket_all_used=True)
        if kind == "hsdp"
        else flatview.ReduceOptions(in_place_min_numel=16)
    )
    try:
        flatview.wrap(model, reduce_options=reduce)
    except flatview.WrapError as error:
        return str(error)
    return ""


def held_by_hand(cap: int) -> dict[str, Any]:
    """Reduce-scatters of several sizes held (an op change and ``cap`` running them
    early) against each run at once; gradients added to, ``-0.0`` among them. Per
    output: whether it is bit for bit the same (NaN and the sign of zero included), and
    the collectives the ledger counted."""
    from flatview.comm._compat import reduce_scatter_single
    from flatview.comm.held import Accumulate, HeldReduceScatters
    from flatview.comm.ledger import Ledger

    world, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(7 + rank)
    sizes = (3, 1, 8, 2)
    ops = (dist.ReduceOp.AVG, dist.ReduceOp.AVG, dist.ReduceOp.SUM, dist.ReduceOp.AVG)
    inputs = []
    for size in sizes:
        source = torch.randn(world * size, generator=gen)
        chunks = source.view(world, size)
        chunks[:, -1] = -0.0  # every rank's: the reduction of -0.0s is -0.0
        if size == 8:
            chunks[:, 0] = float("nan")
        inputs.append(source)
    ledger = Ledger()
    held = HeldReduceScatters(ledger, cap)
    outputs, targets, wanted = [], [], []
    for size, source, op in zip(sizes, inputs, ops, strict=True):
        expected = torch.empty(size)
        reduce_scatter_single(expected, source, op=op)
        target = torch.full((size - 1,), -0.0) if size > 1 else None
        if target is not None:
            wanted.append(target + expected[1:])
            targets.append(target)
        output = torch.empty(size)
        accumulate = [Accumulate(target, 1)] if target is not None else []
        # As FSDP2 does right after its call: add the output to the existing gradient.
        held.hold(output, source.clone(), dist.group.WORLD, op, accumulate)
        if target is not None:
            target += output[1:]
        outputs.append((output, expected))
    held.run()
    same = [bool(torch.equal(o.view(torch.int32), e.view(torch.int32))) for o, e in outputs] + [
        bool(torch.equal(t.view(torch.int32), x.view(torch.int32)))
        for t, x in zip(targets, wanted, strict=True)
    ]
    return {"same": same, "calls": ledger.calls.get("reduce_scatter", 0), "left": len(held)}
