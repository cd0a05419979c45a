"""Worker functions of ``test_misuse`` (run on every rank of a worker pool): errors one
rank finds alone, ranks that freeze differently, and training after flatview's errors."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import flatview
from flatview.errors import FlatViewError
from tests.scenarios import (
    Scenario,
    _original_tree,
    backend_context,
    distributed_model,
    distributed_training,
    flatview_error,
    full_state,
    local_batch,
    loss_of,
    make_net,
    wrap_fsdp,
)


def _last() -> int:
    return dist.get_world_size() - 1


def _train_step(model: nn.Module, fv: flatview.FlatView, scenario: Scenario, skip: Any) -> None:
    x, y = local_batch(scenario, 0)
    with fv.step(skip=skip):
        loss_of(model(x, ("body.1",)), y).backward()


def local_errors(scenario: Scenario) -> dict[str, Any]:
    """Each kind of error one rank finds alone inside ``step()`` (a name that does not
    resolve on rank 0, a bad item on the last rank, a skip set of the wrong type on rank
    0), then a norm call with a bad norm type on rank 0 and an unknown name on the last
    rank: each must raise on every rank; then a valid step and norm call must work."""
    rank = dist.get_rank()
    with backend_context(scenario.backend):
        model, fv, _ = distributed_model(scenario)
        good = ["body.1"]
        cases: dict[str, Any] = {
            "name": ["bdy.1"] if rank == 0 else good,
            "item": [*good, 3] if rank == _last() else good,
            "type": 3 if rank == 0 else good,
        }
        out: dict[str, Any] = {}
        for kind, skip in cases.items():
            out[kind] = flatview_error(lambda skip=skip: _train_step(model, fv, scenario, skip))
        out["norm_type"] = flatview_error(lambda: fv.param_norms(norm_type=-1 if rank == 0 else 2))
        names = ["head.weight", "head.wieght" if rank == _last() else "head.bias"]
        out["norm_name"] = flatview_error(lambda: fv.grad_norms(names))
        _train_step(model, fv, scenario, good)
        grads = {n: p.grad for n, p in fv.named_parameters()}
        out["skipped_none"] = all(g is None for n, g in grads.items() if n.startswith("body.1"))
        out["norms"] = sorted(k for k, v in fv.grad_norms().items() if v is not None)
        return out


def frozen_differently(scenario: Scenario) -> dict[str, Any]:
    """Rank 0 freezes a parameter that the others train: the step's check raises on every
    rank, naming it, before any gradient moves; once frozen alike, a step works."""
    with backend_context(scenario.backend):
        model, fv, _ = distributed_model(scenario)
        view = dict(fv.named_parameters())["body.0.up.weight"]
        if dist.get_rank() == 0:
            view.requires_grad_(False)
        out = {"mismatch": flatview_error(lambda: _train_step(model, fv, scenario, ["body.1"]))}
        view.requires_grad_(False)
        out["alike"] = flatview_error(lambda: _train_step(model, fv, scenario, ["body.1"]))
        out["frozen_grad"] = view.grad is None
        return out


@contextlib.contextmanager
def _caught(out: list[str]) -> Iterator[None]:
    try:
        yield
    except FlatViewError as err:
        out.append(f"{type(err).__name__}: {err}")
    else:
        out.append("accepted")


def recovery(scenario: Scenario, kinds: list[str]) -> dict[str, Any]:
    """Provoke each of flatview's errors inside ``step()`` (on every rank alike), zero the
    gradients, then train the scenario: the result must be the reference's (what the
    reference never ran cannot have left anything behind)."""
    errors: list[str] = []
    with backend_context(scenario.backend):
        model, fv, opts = distributed_model(scenario)
        for kind in kinds:
            x, y = local_batch(scenario, 0)
            with _caught(errors):
                if kind == "undeclared":
                    # body.1 does not run, and the step does not say so.
                    with fv.step():
                        loss_of(model(x, ("body.1",)), y).backward()
                elif kind == "skipped_used":
                    # body.1 is declared skipped but runs.
                    with fv.step(skip=["body.1"]):
                        loss_of(model(x), y).backward()
                elif kind == "outside":
                    # The forward runs outside the step that declares body.1 skipped.
                    loss = loss_of(model(x), y)
                    with fv.step(skip=["body.1"]):
                        loss.backward()
                elif kind == "outside_skipping":
                    loss = loss_of(model(x, ("body.1",)), y)
                    with fv.step(skip=["body.1"]):
                        loss.backward()
                else:
                    raise ValueError(kind)
            for opt in opts:
                opt.zero_grad(set_to_none=True)
        for _ in distributed_training(scenario, model, fv, opts):
            pass
        return {"errors": errors, "params": full_state(model, scenario), "phase": fv.phase.name}


def interrupted_forward(scenario: Scenario, inside_step: bool) -> dict[str, Any]:
    """DDP: a KeyboardInterrupt in the forward leaves DDP's sync flag as the user set it,
    and the next step still averages the gradients over the ranks."""
    with backend_context(scenario.backend):
        model, fv, _ = distributed_model(scenario)
        tree = _original_tree(model)

        def interrupt(module: nn.Module, args: Any) -> None:
            raise KeyboardInterrupt

        handle = tree.body[0].register_forward_pre_hook(interrupt)
        x, y = local_batch(scenario, 0)
        interrupted = False
        try:
            with fv.step() if inside_step else contextlib.nullcontext():
                model(x)
        except KeyboardInterrupt:
            interrupted = True
        handle.remove()
        flag = bool(getattr(model, "require_backward_grad_sync", True))
        # Each rank its own batch: unaveraged gradients would differ between ranks.
        with fv.step():
            loss_of(model(x), y).backward()
        averaged = []
        for _, p in fv.named_parameters():
            if p.grad is not None:
                total = p.grad.clone()
                dist.all_reduce(total)
                averaged.append(torch.allclose(total, p.grad * dist.get_world_size()))
        return {"interrupted": interrupted, "flag": flag, "averaged": all(averaged)}


def wrap_mid_iteration(scenario: Scenario) -> dict[str, Any]:
    """``flatview.wrap`` between a forward and its backward: refused on the FSDP
    backends (and accepted after the backward and an evaluation forward); on DDP
    (undetectable there) that backward is DDP's own, gradients averaged by DDP as
    without flatview."""
    with backend_context(scenario.backend):
        model = wrap_fsdp(scenario, make_net(scenario))
        x, y = local_batch(scenario, 0)
        loss = loss_of(model(x), y)
        out: dict[str, Any] = {"error": flatview_error(lambda: flatview.wrap(model))}
        loss.backward()
        if out["error"] == "accepted":
            grads = [p.grad for p in model.parameters()]
            same = []
            for g in grads:
                assert g is not None
                total = g.clone()
                dist.all_reduce(total)
                same.append(torch.allclose(total, g * dist.get_world_size()))
            out["averaged"] = all(same)
        else:
            # Refused before it touched anything: wrapping between iterations works, also
            # after an evaluation forward under no_grad (FSDP2 leaves the root unsharded
            # then; with the loss dropped, no graph is alive that could be a pending one).
            del loss
            with torch.no_grad():
                model(x)
            fv = flatview.wrap(model)
            with fv.step(skip=["body.1"]):
                loss_of(model(x, ("body.1",)), y).backward()
            # (Empty views of parameters held elsewhere get no gradient either.)
            out["after"] = sorted(
                n
                for n, p in fv.named_parameters()
                if p.grad is None and not (p.numel() == 0 and fv.numel(p) > 0)
            )
        return out


def first_step_of(scenario: Scenario, kind: str) -> dict[str, Any]:
    """An optimizer of ``kind`` over the views: torch's ``ZeroRedundancyOptimizer``
    (``"zero"``, AdamW on each owner rank) or ``Adafactor`` (``"adafactor"``:
    whole-tensor statistics, factored moments and the parameter's RMS). What its first
    step raises (empty if it trained), and whether any parameter changed on this rank."""
    with backend_context(scenario.backend):
        model = wrap_fsdp(scenario, make_net(scenario))
        fv = flatview.wrap(model)
        opt: torch.optim.Optimizer
        if kind == "zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(list(fv.parameters()), torch.optim.AdamW, lr=0.05)
        else:
            opt = torch.optim.Adafactor(fv.parameters(), lr=0.01)
        return _step_after_training(model, fv, scenario, opt, list(fv.parameters()))


def _step_after_training(
    model: nn.Module,
    fv: flatview.FlatView,
    scenario: Scenario,
    opt: torch.optim.Optimizer,
    watched: list[torch.Tensor],
) -> dict[str, Any]:
    """One training step, then ``opt.step()``: what it raised (empty if nothing), and
    whether any of the ``watched`` parameters changed on this rank."""
    before = [p.detach().clone() for p in watched]
    x, y = local_batch(scenario, 0)
    with fv.step():
        loss_of(model(x), y).backward()
    try:
        opt.step()
        error = ""
    except FlatViewError as err:
        error = f"{type(err).__name__}: {err}"
    changed = any(not torch.equal(a, b) for a, b in zip(before, watched, strict=True))
    return {"error": error, "changed": changed}


def hooks_on_views(scenario: Scenario, kind: str, when: str) -> dict[str, Any]:
    """A ``kind`` hook (``"grad"``: ``register_hook``, halving; ``"post"``:
    ``register_post_accumulate_grad_hook``, counting; ``"step"``: that hook stepping an
    optimizer of the parameter and zeroing its gradient) on every parameter of
    ``fv.parameters()``, registered ``when``: ``"before"`` the first step,
    ``"after"`` it (before the optimizer's first step), or ``"late"`` (after both). What
    is raised (empty if nothing), and how often a hook ran."""
    with backend_context(scenario.backend):
        model = wrap_fsdp(scenario, make_net(scenario))
        fv = flatview.wrap(model)
        calls = [0]

        def grad_hook(grad: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            return grad * 0.5

        steppers: dict[int, torch.optim.Optimizer] = {}

        def post_hook(param: torch.Tensor) -> None:
            calls[0] += 1
            if kind == "step":  # an optimizer stepped in the backward, as torchtune's
                stepper = steppers.setdefault(id(param), torch.optim.SGD([param], lr=0.1))
                stepper.step()
                stepper.zero_grad()

        def register() -> None:
            for p in fv.parameters():
                if kind == "grad":
                    p.register_hook(grad_hook)
                else:
                    p.register_post_accumulate_grad_hook(post_hook)

        opt = torch.optim.SGD(fv.parameters(), lr=0.1)
        error = ""
        try:
            if when == "before":
                register()
            for micro in range(3):
                x, y = local_batch(scenario, micro)
                with fv.step():
                    loss_of(model(x), y).backward()
                if micro == {"after": 0, "late": 1}.get(when):
                    register()
                opt.step()
                opt.zero_grad()
        except FlatViewError as err:
            error = f"{type(err).__name__}: {err}"
        return {"error": error, "calls": calls[0]}


def optimizer_built_while_lent(scenario: Scenario, how: str) -> dict[str, Any]:
    """The first seed's broken remedy: an SGD built inside the wrapper's summoning, over
    the head's parameters there, then a training step. ``how``: ``"summon"``
    (``summon_full_params``: fairscale's method, torch FSDP1's static one), on fairscale
    also ``"unflatten"`` (``unflatten_params()``, each rank's FSDP on a process group of
    its own, as at world size 1, where it works), on FSDP2 ``"unshard"`` (built between
    ``model.unshard()`` and ``reshard()``). A first ``opt.step()`` runs inside a
    summoning (no gradients yet: nothing to step). What the step after the training
    raised (empty if none), and whether the head changed."""
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    with backend_context(scenario.backend):
        if how == "unflatten":
            from fairscale.nn.data_parallel import FullyShardedDataParallel as FairscaleFSDP

            own = groups[dist.get_rank()]
            model = FairscaleFSDP(make_net(scenario), flatten_parameters=True, process_group=own)
        else:
            model = wrap_fsdp(scenario, make_net(scenario))
        fv = flatview.wrap(model)
        head = _original_tree(model).head
        if how == "unshard":
            model.unshard()
            opt = torch.optim.SGD(head.parameters(), lr=0.5)
            model.reshard()
            return _step_after_training(model, fv, scenario, opt, list(head.parameters()))
        if how == "unflatten":
            lent = model.unflatten_params()
        elif scenario.backend == "fairscale":
            lent = model.summon_full_params()
        else:
            lent = type(model).summon_full_params(model)
        with lent:
            opt = torch.optim.SGD(head.parameters(), lr=0.5)
            opt.step()
        return _step_after_training(model, fv, scenario, opt, list(head.parameters()))
