"""Worker tasks of tests/test_refusals.py: every collective entry point of the public API
called with a misuse on rank 1 only (the other ranks' arguments are fine), and plain
training after a refused ``flatview.wrap``.

Each case records, per rank, the error the call raised (or ``"no error"``). A call that
refuses on rank 1 alone leaves the other ranks either waiting in the call's first
collective (the pool's timeout fails the test) or going on to their next one, where they
would wait for rank 1 forever: every rank must raise. Between cases the ranks meet in a
barrier, so that each case starts together whatever the previous one did.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

import flatview
import flatview.checkpoint as fcp
from tests.scenarios import (
    Scenario,
    _original_tree,
    backend_context,
    distributed_training,
    full_state,
    make_net,
    optimizer_steps,
    optimizers,
    plain_optimizer,
    synced_backward,
    wrap_fsdp,
)

NO_ERROR = "no error"


def _attempt(call: Callable[[], Any]) -> str:
    try:
        call()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    finally:
        dist.barrier()
    return NO_ERROR


def entry_point_refusals(
    scenario: Scenario, fv: Any, model: Any, good: Any, chosen: Any, lonely: bool
) -> tuple[dict[str, str], dict[str, Any]]:
    """Every collective entry point, misused on the ``lonely`` rank only (``chosen``: its
    optimizer, ``good`` the others'): per call, the error this rank saw (every backend's
    one-rank refusal cases; ``model`` is what the backend's checkpoint functions take),
    and the optimizer state dict given to the set calls (broken on the lonely rank)."""
    out: dict[str, str] = {}
    out["optim_state_dict"] = _attempt(lambda: fv.optim_state_dict(chosen))
    out["rank0_only"] = _attempt(lambda: fv.optim_state_dict(good, rank0_only=lonely))
    for full in (False, True):
        options = StateDictOptions(full_state_dict=full)
        out[f"checkpoint_optimizer_{full}"] = _attempt(
            lambda options=options: fcp.get_state_dict(fv, model, [chosen], options=options)
        )
    out["checkpoint_model"] = _attempt(
        lambda: fcp.get_state_dict(fv, make_net(scenario) if lonely else model, [good])
    )
    out["checkpoint_options"] = _attempt(
        lambda: fcp.get_state_dict(
            fv, model, [good], options=StateDictOptions(full_state_dict=lonely)
        )
    )
    model_sd, optim_sd = fcp.get_state_dict(fv, model, [good])
    if lonely:
        groups = [dict(g, params=list(g["params"])) for g in optim_sd["param_groups"]]
        groups[0]["params"][0] = "body.0.nonexistent"
        optim_sd = {"state": optim_sd["state"], "param_groups": groups}
    out["set_state_dict"] = _attempt(
        lambda: fcp.set_state_dict(
            fv, model, [good], model_state_dict=model_sd, optim_state_dict=optim_sd
        )
    )
    out["set_optimizer_state_dict"] = _attempt(
        lambda: fcp.set_optimizer_state_dict(fv, model, [good], optim_sd)
    )
    out["clip_grad_norm_"] = _attempt(lambda: fv.clip_grad_norm_(-1.0 if lonely else 1.0))
    return out, optim_sd


def one_rank_refuses(scenario: Scenario) -> dict[str, str]:
    """Per case, the error this rank saw."""
    rank = dist.get_rank()
    lonely = rank == 1
    out: dict[str, str] = {}
    with backend_context(scenario.backend):
        model = wrap_fsdp(scenario, make_net(scenario))
        # Built before wrapping: over the flat parameters where the wrapper flattens
        # (the audit's divergent optimizer), over the originals otherwise.
        early = torch.optim.AdamW(model.parameters(), lr=0.01)
        fv = flatview.wrap(model, check_skip_agreement=scenario.check)
        opts = optimizers(_original_tree(model))
        for _ in distributed_training(scenario, model, fv, opts, optimizer_steps(scenario)[:1]):
            pass
        good = opts[0]
        if scenario.config.flattens:
            odd = early
        else:
            stranger = nn.Parameter(torch.zeros(2, 3))
            odd = torch.optim.SGD([*good.param_groups[0]["params"], stranger], lr=0.1)
        chosen = odd if lonely else good

        refused, optim_sd = entry_point_refusals(scenario, fv, model, good, chosen, lonely)
        out.update(refused)
        if scenario.config.flattens:
            # torch's own functions, routed to flatview.checkpoint on this model.
            from torch.distributed.checkpoint import state_dict as dsd

            flat_form = StateDictOptions(flatten_optimizer_state_dict=lonely)
            out["torch_options"] = _attempt(
                lambda: dsd.get_state_dict(model, [good], options=flat_form)
            )
            # Rank 1's optimizer over flat parameters would take torch's own path there.
            out["torch_optimizer"] = _attempt(lambda: dsd.get_optimizer_state_dict(model, [chosen]))
            out["torch_set"] = _attempt(
                lambda: dsd.set_optimizer_state_dict(model, [good], optim_sd)
            )
        # Nothing was left half done: the calls work again on every rank.
        fv.optim_state_dict(good)
        fcp.get_state_dict(fv, model, [good])
    return out


# ---------------------------------------------------------------- refused wraps


def _wrap_target(scenario: Scenario, model: nn.Module) -> nn.Module:
    """What a refused ``flatview.wrap`` is given: a nested unit (block 1's), or on DDP
    (nothing nests) the model itself, built with ``static_graph=True``, which flatview
    refuses."""
    if scenario.backend == "ddp":
        return model
    net = model if scenario.backend == "fsdp2" else model.module
    return net.body[1]  # type: ignore[index,union-attr]


def _plain_run(scenario: Scenario, attempt_before: int | None) -> dict[str, Any]:
    """Plain FSDP (or DDP) training over every optimizer step of ``scenario``; before
    step ``attempt_before`` (0: before the first forward) a ``flatview.wrap`` that is
    refused. Rank 0's final parameters and what the wrap raised."""
    model = wrap_fsdp(scenario, make_net(scenario))
    opt = plain_optimizer(model.parameters())
    refused = "not attempted"
    for number, micros in enumerate(optimizer_steps(scenario)):
        if number == attempt_before:
            try:
                flatview.wrap(_wrap_target(scenario, model))
            except flatview.WrapError as err:
                refused = f"{type(err).__name__}: {err}"
            else:
                refused = "accepted"
        synced_backward(scenario, model, None, micros)
        opt.step()
        opt.zero_grad()
    return {"refused": refused, "params": full_state(model, scenario)}


def refused_wrap_then_plain(scenario: Scenario) -> dict[Any, dict[str, Any]]:
    """Three plain runs of ``scenario``: without any wrap, with a refused wrap before
    the first forward, and with one after the first optimizer step."""
    with backend_context(scenario.backend):
        return {when: _plain_run(scenario, when) for when in (None, 0, 1)}
