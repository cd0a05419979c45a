"""Worker functions of ``test_ddp_backend`` (run on every rank of a worker pool)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import flatview
from flatview.errors import FlatViewError
from flatview.testing.counting import CollectiveCounter
from tests.scenarios import Scenario, as_names, batch, local_batch, loss_of, make_net


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
        model.register_comm_hook(None, _own_hook)
    if case == "comm_hook_group":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(dist.new_group([0]), default_hooks.fp16_compress_hook)
    if case == "mixed_precision":
        model.mixed_precision = object()  # what DDP(mixed_precision=...) sets
    if case == "join":
        from torch.distributed.algorithms import Join

        Join([model])  # built (its hooks enabled), not entered
    try:
        flatview.wrap(model)
    except FlatViewError as err:
        return f"{type(err).__name__}: {err}"
    return "accepted"


def uneven_inputs(scenario: Scenario) -> dict[str, Any]:
    """DDP's ``join()`` around a loop over uneven inputs (rank r has 2 + r batches), and
    a ``Join`` where rank 0 has no batch: what flatview raises as it is built, on every
    rank; what the first forward raises inside a join only the forward can tell (its
    config enabled by hand); a disabled ``Join`` (what
    accelerate's ``join_uneven_inputs`` builds for even batches) around an even loop,
    which trains; after ``unwrap()`` the uneven loop on bare DDP, which finishes."""
    from torch.distributed.algorithms import Join

    model = DDP(make_net(scenario))
    fv = flatview.wrap(model)
    opt = torch.optim.SGD(fv.parameters(), lr=0.1)
    out: dict[str, Any] = {}

    def train(batches: int) -> None:
        for micro in range(batches):
            x, y = local_batch(scenario, micro)
            with fv.step():
                loss_of(model(x), y).backward()
            opt.step()
            opt.zero_grad()

    try:
        with model.join():
            train(2 + dist.get_rank())
            out["ran"] = True
    except FlatViewError as err:
        out["error"] = f"{type(err).__name__}: {err}"
    # Rank 0 has no batch at all: it would go straight to the join's exit and wait there.
    try:
        with Join([model]):
            train(2 * dist.get_rank())
            out["ran"] = True
    except FlatViewError as err:
        out["no_batch"] = f"{type(err).__name__}: {err}"
    # Where the join cannot be told as it is built, its first forward refuses it.
    with Join([model], enable=False):
        model._join_config = model._join_config._replace(enable=True)
        try:
            train(1)
        except FlatViewError as err:
            out["at_forward"] = f"{type(err).__name__}: {err}"
        model._join_config = model._join_config._replace(enable=False)
    with Join([model], enable=False):
        train(2)
    out["disabled"] = "trained"
    fv.unwrap()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.join():
        for micro in range(2 + dist.get_rank()):
            x, y = local_batch(scenario, micro)
            loss_of(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    out["bare"] = "finished"
    return out


def assigned_anew(scenario: Scenario) -> str:
    """After one step, the parameters replaced on their modules
    (``load_state_dict(assign=True)``) and a new optimizer over them: what the next
    step raises."""
    model = DDP(make_net(scenario))
    fv = flatview.wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for micro in range(2):
        x, y = local_batch(scenario, micro)
        try:
            with fv.step():
                loss_of(model(x), y).backward()
        except FlatViewError as err:
            return f"{type(err).__name__}: {err}"
        opt.step()
        opt.zero_grad()
        if micro == 0:
            state = {k: v.clone() for k, v in model.module.state_dict().items()}
            model.module.load_state_dict(state, assign=True)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
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


def overlapped_and_end_of_backward(scenario: Scenario) -> dict[str, Any]:
    """The scenario trained with buckets started during the backward and with everything
    reduced at its end: the same parameters (up to the order in which the collective
    sums three ranks, which depends on where an element sits in its bucket); and how
    many buckets the overlapped run had started when each backward ended."""
    finals = []
    started_early: list[int] = []
    for overlap in (True, False):
        model = DDP(make_net(scenario), **scenario.options)
        fv = flatview.wrap(model, overlap_reduction=overlap)
        adapter: Any = fv.adapter._backward  # the replicated reduction component
        end = adapter._end_backward

        def spy(end: Any = end, overlap: bool = overlap, adapter: Any = adapter) -> None:
            if overlap and adapter._round is not None:
                started_early.append(adapter._round.started)
            end()

        adapter._end_backward = spy
        opt = torch.optim.SGD(fv.parameters(), lr=0.1, momentum=0.9)
        for micro, skip in enumerate(scenario.skips):
            x, y = local_batch(scenario, micro)
            with fv.step(skip=list(as_names(skip))):
                loss_of(model(x, as_names(skip)), y).backward()
            opt.step()
            opt.zero_grad()
        finals.append({n: p.detach().clone() for n, p in fv.named_parameters()})
        fv.unwrap()
    return {
        "equal": all(
            torch.allclose(finals[0][n], finals[1][n], rtol=1e-6, atol=1e-7) for n in finals[0]
        ),
        "started_early": started_early,
    }


class _Reversed(nn.Module):
    """Layers applied in the reverse of the order they are registered in: reverse
    registration order, flatview's first guess at the order of the backward, is then
    exactly wrong."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return x.sum()


def learned_bucket_order(scenario: Scenario) -> dict[str, Any]:
    """Every parameter its own bucket, overlapped: per backward, how many gradients were
    ready when each bucket but the last (which waits for the end) started, and whether
    the gradients are the local ones averaged by hand."""
    torch.manual_seed(0)
    reference = _Reversed()
    torch.manual_seed(0)
    model = DDP(_Reversed(), bucket_cap_mb=1e-5)
    fv = flatview.wrap(model, overlap_reduction=True)
    adapter: Any = fv.adapter._backward  # the replicated reduction component
    ready_at_start: list[list[int]] = []
    start = adapter._start_bucket

    def spy(round_: Any, extra: Any = ()) -> None:
        if round_.started == 0:
            ready_at_start.append([])
        if round_.started < len(round_.buckets) - 1:
            ready_at_start[-1].append(len(round_.ready))
        start(round_, extra)

    adapter._start_bucket = spy
    averaged = True
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        x = torch.randn(2, 3, generator=generator)
        with fv.step():
            model(x).backward()
        reference.zero_grad()
        reference(x).backward()
        for got, want in zip(fv.parameters(), reference.parameters(), strict=True):
            assert want.grad is not None and got.grad is not None
            mean = want.grad.clone()
            dist.all_reduce(mean)
            averaged = averaged and torch.allclose(got.grad, mean / dist.get_world_size())
        for param in fv.parameters():
            param.grad = None
    fv.unwrap()
    return {"ready_at_start": ready_at_start, "averaged": averaged}


class _Twice(nn.Module):
    """``a`` runs twice: inside a reentrant checkpoint and after it, so its gradient is
    accumulated in two graph tasks of one backward, the second after ``a``'s bucket
    started (registered after ``b``, ``a`` comes first in reverse registration order)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(3, 4)
        self.b = nn.Linear(4, 2)
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.a, self.stem(x), use_reentrant=True)
        return self.b(self.a(h))


def gradient_grows_after_its_bucket_started(scenario: Scenario) -> dict[str, Any]:
    """Every parameter its own bucket: the refired gradient makes flatview reduce again,
    and the gradients equal the local ones averaged by hand."""
    torch.manual_seed(0)
    reference = _Twice()
    torch.manual_seed(0)
    model = DDP(_Twice(), bucket_cap_mb=1e-5)
    fv = flatview.wrap(model, overlap_reduction=True)  # off by default on CPU
    adapter: Any = fv.adapter._backward  # the replicated reduction component
    refired: list[bool] = []
    end = adapter._end_backward

    def spy() -> None:
        refired.append(adapter._round is not None and adapter._round.grew_after_start)
        end()

    adapter._end_backward = spy
    torch.manual_seed(1 + dist.get_rank())
    x = torch.randn(5, 3)
    with fv.step():
        model(x).square().sum().backward()
    reference(x).square().sum().backward()
    equal = True
    for got, want in zip(fv.parameters(), reference.parameters(), strict=True):
        averaged = want.grad.clone()
        dist.all_reduce(averaged)
        averaged /= dist.get_world_size()
        equal = equal and got.grad is not None and torch.allclose(got.grad, averaged)
    return {"refired": refired, "equal": equal}


def undeclared_in_an_earlier_micro_batch(scenario: Scenario) -> None:
    """Block 0 is left out of the first micro-batch (under no_sync()) without being
    declared, and declared skipped in the second: no backward ever reached it, so the
    synchronising backward must raise, although its bucket starts before the end
    (every parameter its own bucket)."""
    model = DDP(make_net(scenario), bucket_cap_mb=1e-5)
    fv = flatview.wrap(model, overlap_reduction=True)  # off by default on CPU
    for micro, declared in enumerate(([], ["body.0"])):
        x, y = local_batch(scenario, micro)
        sync = model.no_sync() if micro == 0 else torch.enable_grad()
        with sync, fv.step(skip=declared):
            loss_of(model(x, ("body.0",)), y).backward()


def checkpointed_whole_model(scenario: Scenario) -> dict[str, bool]:
    """The DDP model called under activation checkpointing: its forward runs again
    inside the backward, which must neither start a new iteration nor reduce twice.
    Gradients equal the local ones averaged by hand, on every rank, overlapped or not."""
    from torch.utils.checkpoint import checkpoint

    out = {}
    for overlap in (False, True):
        reference = make_net(scenario)
        model = DDP(make_net(scenario), bucket_cap_mb=1e-5)
        fv = flatview.wrap(model, overlap_reduction=overlap)
        x, y = local_batch(scenario, 0)
        skip = as_names([1])
        with fv.step(skip=list(skip)):
            loss_of(checkpoint(model, x, skip, use_reentrant=False), y).backward()
        loss_of(reference(x, skip), y).backward()
        equal = True
        for got, want in zip(fv.parameters(), reference.parameters(), strict=True):
            if want.grad is None:
                equal = equal and got.grad is None
                continue
            averaged = want.grad.clone()
            dist.all_reduce(averaged)
            averaged /= dist.get_world_size()
            equal = equal and got.grad is not None and torch.allclose(got.grad, averaged)
        out[f"overlap={overlap}"] = equal and fv.phase.name == "IDLE"
        fv.unwrap()
    return out


class TwoHeads(nn.Module):
    """Two outputs, of which a loss may use one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used = nn.Linear(3, 2)
        self.unused = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"used": self.used(x), "unused": self.unused(x)}


def skipped_behind_an_unused_output(skip: list[str]) -> dict[str, Any]:
    """DDP with ``find_unused_parameters=True`` passes every output through one autograd
    node, whose backward reaches the parameters of an output the loss did not use with
    no gradient (None): a step that skips them trains; one that does not is refused."""
    model = DDP(TwoHeads(), find_unused_parameters=True)
    fv = flatview.wrap(model)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(dist.get_rank()))
    try:
        with fv.step(skip=skip):
            model(x)["used"].sum().backward()
    except FlatViewError as error:
        return {"error": type(error).__name__}
    finally:
        fv.unwrap()
    return {"none": sorted(n for n, p in fv.named_parameters() if p.grad is None)}


def frozen_before_the_wrap(scenario: Scenario, overlap: bool) -> dict[str, Any]:
    """A block frozen before DDP is built (LoRA's base, a frozen backbone): flatview wraps
    it, leaves its parameters without a gradient, and once it is unfrozen (from the third
    step on) reduces them; trained alongside the unwrapped model on the whole batches."""
    net, plain = make_net(scenario), make_net(scenario)
    for module in (net, plain):
        module.body[0].requires_grad_(False)
    # Overlapped: buckets of about 100 elements start as their gradients are ready.
    model = DDP(net, bucket_cap_mb=0.0004) if overlap else DDP(net)
    fv = flatview.wrap(model, overlap_reduction=overlap)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (net, plain)]
    none = []
    for micro in range(4):
        if micro == 2:
            for module in (net, plain):
                module.body[0].requires_grad_(True)
        x, y = local_batch(scenario, micro)
        with fv.step():
            loss_of(model(x), y).backward()
        whole_x, whole_y = batch(scenario, micro)
        loss_of(plain(whole_x), whole_y).backward()
        none.append(sorted(n for n, p in fv.named_parameters() if p.grad is None))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    # Hooked once unfrozen, as every trained parameter is: its gradient starts its
    # bucket during the backward (with overlap), and shows a backward's start.
    hooked = bool(getattr(net.body[0].up.weight, "_post_accumulate_grad_hooks", None))
    fv.unwrap()
    worst = max(
        float((a - b).abs().max())
        for a, b in zip(net.parameters(), plain.parameters(), strict=True)
    )
    return {"none": none, "worst": worst, "hooked": hooked}


# DDP checks a hook's annotations, and this module's are strings (postponed): none.
def _own_hook(state, bucket):  # type: ignore[no-untyped-def]
    """A hook of the user's own (torch's allreduce hook, under another name)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.allreduce_hook(state, bucket)


def _bf16_hook(state, bucket):  # type: ignore[no-untyped-def]
    """torch's ``bf16_compress_hook`` without its check for NCCL (gloo sums bfloat16):
    cast, divide by the group's size, sum, cast back into the bucket."""
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size())
    future = dist.all_reduce(compressed, async_op=True).get_future()

    def decompress(fut: Any) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer

    return future.then(decompress)


def _register(model: DDP, hook: str, bare: bool) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if hook.startswith("builtin_"):
        kinds = {"builtin_allreduce": "ALLREDUCE", "builtin_fp16": "FP16_COMPRESS"}
        model._register_builtin_comm_hook(getattr(dist.BuiltinCommHookType, kinds[hook]))
    elif hook == "bf16_compress_hook":
        # torch's refuses to be registered without NCCL: bare DDP runs the same
        # arithmetic as a hook of its own; flatview reads the record register_comm_hook
        # would have left (DDP's reducer, which it keeps idle, is not told).
        if bare:
            model.register_comm_hook(None, _bf16_hook)
        else:
            model._comm_hooks.append((default_hooks.bf16_compress_hook, None))
    elif hook:
        model.register_comm_hook(None, getattr(default_hooks, hook))


def with_comm_hook(scenario: Scenario, hook: str, use_flatview: bool) -> dict[str, Any]:
    """The scenario on DDP with ``hook`` registered (``""``: none; ``builtin_fp16`` /
    ``builtin_allreduce``: torch's C++ hooks; else a hook of torch's ``default_hooks``
    by name), bare (``find_unused_parameters=True``) or wrapped by flatview after the
    hook was registered, skipping the scenario's blocks, under SGD without momentum (a
    zero gradient, which bare DDP gives skipped parameters, then moves nothing, as
    ``None`` does). Returns rank 0's final parameters and, wrapped, the bytes each
    step's gradient all-reduces moved."""
    net = make_net(scenario)
    model = DDP(net, find_unused_parameters=not use_flatview)
    _register(model, hook, bare=not use_flatview)
    fv = flatview.wrap(model) if use_flatview else None
    params = list(fv.parameters()) if fv is not None else list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    reduced = []
    for micro in range(len(scenario.skips)):
        x, y = local_batch(scenario, micro)
        skip = as_names(scenario.skips[micro])
        if fv is not None:
            with fv.step(skip=skip):
                loss_of(model(x, skip), y).backward()
            reduced.append(fv.stats.reduced_bytes)
        else:
            loss_of(model(x, skip), y).backward()
        opt.step()
        opt.zero_grad()
    state = {n: p.detach().numpy().copy() for n, p in net.named_parameters()}
    return {"params": state if dist.get_rank() == 0 else None, "reduced": reduced}
