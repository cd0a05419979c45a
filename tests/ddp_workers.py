"""Worker functions of ``test_ddp_backend`` (run on every rank of a worker pool)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import flatview
from flatview.comm.counting import CollectiveCounter
from flatview.errors import FlatViewError
from tests.scenarios import Scenario, as_names, local_batch, loss_of, make_net


def _same_on_every_rank(tensor: torch.Tensor) -> bool:
    total = tensor.detach().clone()
    dist.all_reduce(total)
    return torch.allclose(total, tensor * dist.get_world_size())


def originals_and_collectives(scenario: Scenario) -> dict[str, Any]:
    """fv's parameters are the module's own; a step issues the agreement all-gather and
    one all-reduce (DDP's reducer none); skipped parameters keep None; the others end
    equal on every rank (averaged)."""
    model = DDP(make_net(scenario))
    originals = list(model.module.named_parameters())
    fv = flatview.wrap(model)
    x, y = local_batch(scenario, 0)
    with CollectiveCounter() as counter, fv.step(skip=["body.1"]):
        loss_of(model(x, as_names([1])), y).backward()
    grads = {n: p.grad for n, p in fv.named_parameters()}
    return {
        "names": [n for n, _ in fv.named_parameters()] == [n for n, _ in originals],
        "same_objects": all(
            a is b for (_, a), (_, b) in zip(fv.named_parameters(), originals, strict=True)
        ),
        "calls": dict(counter.calls),
        "none": sorted(n for n, g in grads.items() if g is None),
        "averaged": all(_same_on_every_rank(g) for g in grads.values() if g is not None),
        "ddp_sync_flag": model.require_backward_grad_sync,
    }


class _Buffered(nn.Module):
    """A model whose buffer each rank changes differently in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.register_buffer("seen", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += dist.get_rank() + 1
        return self.fc(x)


def buffers_broadcast(scenario: Scenario) -> list[float]:
    """DDP broadcasts rank 0's buffers before every forward that follows a synchronising
    one, with flatview as without: the buffer after each of three steps (the second
    under no_sync(), so the third forward does not broadcast)."""
    torch.manual_seed(0)
    model = DDP(_Buffered())
    fv = flatview.wrap(model)
    seen = []
    for step in range(3):
        x = torch.randn(4, 3)
        sync = model.no_sync() if step == 1 else torch.enable_grad()
        with sync, fv.step():
            model(x).sum().backward()
        seen.append(float(model.module.seen))
    return seen


def refused(scenario: Scenario, case: str) -> str:
    """The WrapError a DDP configuration flatview cannot drive raises."""
    net: nn.Module = make_net(scenario)
    kwargs: dict[str, Any] = {}
    if case == "static_graph":
        kwargs["static_graph"] = True
    if case == "sparse":
        net.emb = nn.Embedding(4, 2, sparse=True)
    model = DDP(net, **kwargs)
    if case == "comm_hook":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.allreduce_hook)
    if case == "mixed_precision":
        model.mixed_precision = object()  # what DDP(mixed_precision=...) sets
    try:
        flatview.wrap(model)
    except FlatViewError as err:
        return f"{type(err).__name__}: {err}"
    return "accepted"


def second_backward(scenario: Scenario) -> None:
    """Two backwards through one forward (retain_graph): the second must raise."""
    model = DDP(make_net(scenario))
    fv = flatview.wrap(model)
    x, y = local_batch(scenario, 0)
    with fv.step():
        loss = loss_of(model(x), y)
        loss.backward(retain_graph=True)
        loss.backward()


def forward_that_raises(scenario: Scenario) -> dict[str, bool]:
    """A forward that raises leaves DDP's flag as the user set it: the next step still
    reduces (every rank ends with the same gradient)."""
    model = DDP(make_net(scenario))
    fv = flatview.wrap(model)
    try:
        with fv.step():
            model(torch.zeros(2, scenario.in_dim + 1))
    except RuntimeError:
        pass
    x, y = local_batch(scenario, 0)
    with fv.step():
        loss_of(model(x), y).backward()
    return {
        "flag": model.require_backward_grad_sync,
        "averaged": all(_same_on_every_rank(p.grad) for p in fv.parameters()),
    }


def in_place_matches_packed(scenario: Scenario) -> dict[str, bool]:
    """Gradients reduced in place (every one, whatever its size) equal packed ones."""
    grads = []
    for min_numel in (2**40, 0):
        model = DDP(make_net(scenario))
        fv = flatview.wrap(model)
        fv.reducer.in_place_min_numel = min_numel
        x, y = local_batch(scenario, 0)
        with CollectiveCounter() as counter, fv.step(skip=["body.0"], check=False):
            loss_of(model(x, as_names([0])), y).backward()
        grads.append(({n: p.grad for n, p in fv.named_parameters()}, counter.calls["all_reduce"]))
        fv.unwrap()
    (packed, packed_calls), (in_place, in_place_calls) = grads
    return {
        "equal": packed.keys() == in_place.keys()
        and all(
            (packed[n] is None and in_place[n] is None) or torch.equal(packed[n], in_place[n])
            for n in packed
        ),
        "more_collectives": in_place_calls > packed_calls == 1,
    }
