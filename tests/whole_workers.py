"""Workers for :mod:`tests.test_whole`: torch's Muon on whole matrices over views, against
the unmodified ``torch.optim.Muon`` on the unwrapped model in one process.

The model is the scenario's net, optionally with a 3-D expert tensor ``(experts, width,
width)`` in every block (:class:`ExpertNet`) and with matrices cut per head
(:func:`heads_for`). The reference steps ``torch.optim.Muon`` over one standalone 2-D
parameter per matrix (an expert, a head), copied from and back into the model at every
step: exactly what Muon over each ``param[i]`` (or each row block) would do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator, Sequence
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
    Block,
    Net,
    Scenario,
    backend_context,
    distributed_model,
    freeze,
    full_state,
    optimizer_steps,
    reference_backward,
    synced_backward,
)

# ------------------------------------------------------------------------- model


class ExpertBlock(Block):
    """A block with a dense mixture of ``experts`` matrices stored as one 3-D tensor."""

    def __init__(self, width: int, inner: int, norm: bool, gate: bool, experts: int) -> None:
        super().__init__(width, inner, norm, gate)
        self.experts = nn.Parameter(torch.randn(experts, width, width) / max(width, 1) ** 0.5)
        mix = 1.0 / torch.arange(1, experts + 1, dtype=torch.float32)
        self.register_buffer("mix", mix, persistent=False)

    def forward(self, x: torch.Tensor, gated: bool = True, experts: bool = True) -> torch.Tensor:
        out = super().forward(x, gated)
        if experts:
            each = torch.tanh(torch.einsum("bi,eoi->beo", out, self.experts))
            out = out + torch.einsum("beo,e->bo", each, self.mix)
        return out


class ExpertNet(Net):
    """The scenario's net with :class:`ExpertBlock` s; ``body.i.experts`` may be skipped."""

    def __init__(self, scenario: Scenario, experts: int) -> None:
        super().__init__(scenario)
        s = scenario
        gates = s.gates or (False,) * len(s.inner)
        self.body = nn.Sequential(
            *[
                ExpertBlock(s.width, inner, norm, gate, experts)
                for inner, norm, gate in zip(s.inner, s.norms, gates, strict=True)
            ]
        )

    def forward(self, x: torch.Tensor, skip: Collection[str] = ()) -> torch.Tensor:
        x = self.stem(x)
        for index, block in enumerate(self.body):
            if f"body.{index}" not in skip:
                x = block(x, f"body.{index}.gate" not in skip, f"body.{index}.experts" not in skip)
        if self.aux is not None and "aux" not in skip:
            x = x + torch.tanh(self.aux(x))
        out: torch.Tensor = self.head(x)
        if hasattr(self, "head_copy"):
            out = out + 0.5 * self.head_copy(x)
        return out


ADAMW_EPS = 1e-4
"""AdamW's eps on the parameters Muon does not step, in both runs. At torch's 1e-8 a
gradient that is rounding noise turns into a step of ``lr * g / (|g| + eps)`` that the
batch split decides: a thorough draw (torch ``_HYBRID_SHARD_ZERO2``, 4 ranks) gave a
block's gain a gradient of about 3e-8 and a step 0.76 of the learning rate, 3.8e-4 apart
between the runs (as ``tests.scenarios.optimizers`` found for its AdamW)."""


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
    experts: int = 0
    """A 3-D expert tensor of this many ``(width, width)`` matrices in every block."""
    heads: int = 1
    """Cut every matrix whose rows it divides into this many row blocks (``heads=``)."""
    overlap: bool = True
    stacked: bool | None = None
    closure: bool = False
    """Each step's forward and backward run in a closure given to ``Whole.step`` (as
    Lightning's automatic optimization steps), whose loss it must return."""

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


def make_whole_net(run: MuonRun) -> Net:
    torch.manual_seed(run.scenario.seed)
    if run.experts:
        return ExpertNet(run.scenario, run.experts)
    return Net(run.scenario)


def heads_for(shape: Sequence[int], heads: int) -> int:
    """How many row blocks a matrix of ``shape`` is cut into."""
    if len(shape) in (2, 3) and heads > 1 and shape[-2] % heads == 0:
        return heads
    return 1


def is_matrix(shape: Sequence[int]) -> bool:
    return len(shape) in (2, 3)


# ------------------------------------------------------------- float32 iteration


def float32_newton_schulz(
    grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> torch.Tensor:
    """torch's Newton-Schulz iteration for Muon, in float32, for one matrix or a stack.
    Muon's own casts the update to bfloat16: gradients averaged over ranks differ from one
    process's in their last float32 bits, which now and then moves one bfloat16 rounding
    and, through the iteration, every element of the matrix by ~1e-4. Randomised
    comparisons use this to see Whole's own arithmetic, which must match to 1e-5; fixed
    ones keep Muon's."""
    a, b, c = ns_coefficients
    x = grad.float()
    tall = grad.size(-2) > grad.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.mT if tall else x).to(grad.dtype)


@contextlib.contextmanager
def newton_schulz(float32: bool) -> Iterator[None]:
    """Muon's own iteration, or (``float32``) the float32 one for the duration (torch's
    and the stacked one of :mod:`flatview.whole_stacked`)."""
    if not float32:
        yield
        return
    from torch.optim import _muon

    from flatview import whole_stacked

    originals = (_muon._zeropower_via_newtonschulz, whole_stacked.newton_schulz)
    _muon._zeropower_via_newtonschulz = float32_newton_schulz
    whole_stacked.newton_schulz = float32_newton_schulz
    try:
        yield
    finally:
        _muon._zeropower_via_newtonschulz, whole_stacked.newton_schulz = originals


# --------------------------------------------------------------------- reference


class Standalone:
    """One 2-D parameter per matrix of ``params`` (experts, heads), for torch's Muon."""

    def __init__(self, params: Sequence[nn.Parameter], heads: int) -> None:
        self.params = list(params)
        self.parts: list[list[tuple[tuple[int, int], nn.Parameter]]] = []
        for p in self.params:
            count = p.shape[0] if p.ndim == 3 else 1
            cut = heads_for(p.shape, heads)
            rows, cols = p.shape[-2] // cut, p.shape[-1]
            block = rows * cols
            parts = []
            for k in range(count * cut):
                span = (k * block, (k + 1) * block)
                parts.append((span, nn.Parameter(torch.zeros(rows, cols))))
            self.parts.append(parts)
        self.matrices = [m for parts in self.parts for _, m in parts]

    def pull(self) -> None:
        """Values and gradients from the model."""
        for p, parts in zip(self.params, self.parts, strict=True):
            for (lo, hi), m in parts:
                m.data.copy_(p.detach().reshape(-1)[lo:hi].view(m.shape))
                m.grad = None if p.grad is None else p.grad.reshape(-1)[lo:hi].view(m.shape).clone()

    def push(self) -> None:
        """Stepped values into the model."""
        for p, parts in zip(self.params, self.parts, strict=True):
            for (lo, hi), m in parts:
                p.data.reshape(-1)[lo:hi].copy_(m.detach().reshape(-1))

    def momentum(self, muon: torch.optim.Optimizer) -> dict[int, np.ndarray]:
        """Per parameter (by ``id``) with state, its matrices' momentum end to end."""
        out = {}
        for p, parts in zip(self.params, self.parts, strict=True):
            if parts[0][1] in muon.state:
                buffers = [muon.state[m]["momentum_buffer"].reshape(-1) for _, m in parts]
                out[id(p)] = torch.cat(buffers).reshape(p.shape).numpy().copy()
        return out


def reference(run: MuonRun, start: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """The unwrapped model in one process with ``torch.optim.Muon`` and AdamW."""
    with newton_schulz(run.float32):
        return _reference(run, start)


def _reference(run: MuonRun, start: dict[str, np.ndarray] | None) -> dict[str, Any]:
    sc = run.scenario
    net = make_whole_net(run)
    if start is not None:
        net.load_state_dict({k: torch.from_numpy(v) for k, v in start.items()}, strict=False)
    freeze(net.named_parameters(), sc)
    named = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    matrices = [p for _, p in named if is_matrix(p.shape)]
    rest = [p for _, p in named if not is_matrix(p.shape)]
    standalone = Standalone(matrices, run.heads)
    muon = torch.optim.Muon(standalone.matrices, **run.muon_kwargs)
    adamw = torch.optim.AdamW(rest, lr=0.01, eps=ADAMW_EPS)
    for number, micros in enumerate(run.chosen()):
        if number == run.halve_after:
            for p in matrices:
                p.data.mul_(0.5)
        reference_backward(sc, net, micros)
        standalone.pull()
        muon.step()
        standalone.push()
        adamw.step()
        for p in [*matrices, *rest, *standalone.matrices]:
            if sc.set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
    names = {id(p): n for n, p in named}
    return {
        "params": {k: v.detach().numpy().copy() for k, v in net.named_parameters()},
        "momentum": {names[i]: m for i, m in standalone.momentum(muon).items()},
    }


# ------------------------------------------------------------------ distributed


def whole_optimizer(
    run: MuonRun, fv: flatview.FlatView
) -> tuple[Whole, torch.optim.Optimizer, list[Any]]:
    named = [(n, p) for n, p in fv.named_parameters() if p.requires_grad]
    matrices = [(n, p) for n, p in named if is_matrix(fv.shape_of(p))]
    rest = [p for n, p in named if not is_matrix(fv.shape_of(p))]
    heads = {
        n: heads_for(fv.shape_of(p), run.heads)
        for n, p in matrices
        if heads_for(fv.shape_of(p), run.heads) > 1
    }
    muon = Whole(
        torch.optim.Muon,
        fv,
        [p for _, p in matrices],
        heads=heads,
        overlap=run.overlap,
        stacked=run.stacked,
        **run.muon_kwargs,
    )
    return muon, torch.optim.AdamW(rest, lr=0.01, eps=ADAMW_EPS), [p for _, p in matrices]


def distributed(
    run: MuonRun,
    start: dict[str, np.ndarray] | None = None,
    load: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The same with FSDP + flatview: ``Whole(torch.optim.Muon, ...)`` on the matrices.
    ``start``/``load``: parameters and the Muon state to resume from."""
    sc = run.scenario
    with backend_context(sc.backend), newton_schulz(run.float32):
        net = make_whole_net(run)
        names = [n for n, _ in net.named_parameters()]
        if start is not None:
            net.load_state_dict({k: torch.from_numpy(v) for k, v in start.items()}, strict=False)
        model, fv, _ = distributed_model(sc, net)
        muon, adamw, matrices = whole_optimizer(run, fv)
        if load is not None:
            fv.load_optim_state_dict(muon, load["muon"])
            fv.load_optim_state_dict(adamw, load["adamw"])
        moved, used = [], []
        for number, micros in enumerate(run.chosen()):
            if number == run.halve_after:
                for p in matrices:
                    p.data.mul_(0.5)
            if run.closure:
                # The backward's own collectives would be counted with the step's.
                loss = muon.step(lambda m=micros: [synced_backward(sc, model, fv, m), 0.5][1])
                assert loss == 0.5, loss
                moved.append({})
            else:
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
            if not run.closure:
                with CollectiveCounter() as counter:
                    muon.step()
                moved.append(dict(counter.bytes))
            adamw.step()
            muon.zero_grad(set_to_none=sc.set_to_none)
            adamw.zero_grad(set_to_none=sc.set_to_none)
        state = fv.optim_state_dict(muon)
        saved = {"muon": state, "adamw": fv.optim_state_dict(adamw)}
        params = full_state(model, sc, names)
        return {
            "params": params,
            "state": state,
            "saved": saved,
            "moved": moved,
            "used": used,
            "repr": repr(muon),
            "costs": muon.owner_costs,
        }


def _has_grad_anywhere(param: torch.Tensor) -> bool:
    flag = torch.tensor([float(param.grad is not None)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def refusals(scenario: Scenario) -> list[str]:
    """Every refusal of :class:`Whole`, on every rank alike (no collective runs first)."""
    messages = []
    with backend_context(scenario.backend):
        _, fv, _ = distributed_model(scenario)
        other = torch.nn.Parameter(torch.zeros(2, 2))
        matrices = [p for _, p in fv.named_parameters() if len(fv.placement(p).shape) == 2]
        attempts: list[tuple[type[torch.optim.Optimizer], list[Any], dict[str, Any]]] = [
            # A bias is 1-D: Muon refuses it, flatview names it.
            (torch.optim.Muon, [p for _, p in fv.named_parameters()], {}),
            (torch.optim.Muon, [other], {}),
            (torch.optim.LBFGS, [p for _, p in fv.named_parameters()], {}),
            # stem.weight has 4 rows (the default scenario's width).
            (torch.optim.Muon, matrices, {"heads": {"stem.weight": 3}}),
            (torch.optim.Muon, matrices, {"heads": {"nothing.weight": 2}}),
            (torch.optim.SGD, matrices, {"stacked": True, "lr": 0.1}),
        ]
        for cls, params, options in attempts:
            try:
                Whole(cls, fv, params, **options)
            except flatview.OptimStateError as err:
                messages.append(str(err))
        # Still usable afterwards: the refusals ran no collective.
        Whole(torch.optim.Muon, fv, matrices).step()
    return messages


# ------------------------------------------------------------------- checkpoints


def _train(
    run: MuonRun, model: Any, fv: flatview.FlatView, opts: Sequence[Any], steps: Sequence[range]
) -> None:
    sc = run.scenario
    for micros in steps:
        synced_backward(sc, model, fv, micros)
        for opt in opts:
            opt.step()
        for opt in opts:
            opt.zero_grad(set_to_none=sc.set_to_none)


def _options(full: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full)


def checkpoint_and_train_on(
    run: MuonRun, paths: dict[bool, str], split: int, optimizer: str = "muon"
) -> dict[str, Any]:
    """Train ``split`` steps, save model and optimizers with flatview.checkpoint + DCP
    (sharded to ``paths[False]``, full to ``paths[True]``), train on to the end: the
    consolidated state at the save and the final parameters (rank 0). ``optimizer``:
    ``"muon"``, or ``"adamw"`` (``Whole(torch.optim.AdamW)`` on the matrices)."""
    import torch.distributed.checkpoint as dcp

    import flatview.checkpoint as fcp

    sc = run.scenario
    with backend_context(sc.backend), newton_schulz(run.float32):
        net = make_whole_net(run)
        names = [n for n, _ in net.named_parameters()]
        model, fv, _ = distributed_model(sc, net)
        opts = _checkpointed_optimizers(run, fv, optimizer)
        steps = run.chosen()
        _train(run, model, fv, opts, steps[:split])
        saved = fv.optim_state_dict(opts[0])
        for full, path in paths.items():
            model_sd, optim_sd = fcp.get_state_dict(fv, model, opts, options=_options(full))
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        # Reading the state for a checkpoint changed nothing: training goes on as if not.
        _train(run, model, fv, opts, steps[split:])
        return {"saved": saved, "params": full_state(model, sc, names)}


def resume_from_checkpoint(
    run: MuonRun, path: str, full: bool, split: int, optimizer: str = "muon"
) -> dict[str, Any]:
    """A fresh model, flatview and optimizers (at this run's world size and backend)
    loaded from ``path``, then trained from step ``split`` on: the consolidated state
    right after the load, the final parameters (rank 0)."""
    import torch.distributed.checkpoint as dcp

    import flatview.checkpoint as fcp

    sc = run.scenario
    with backend_context(sc.backend), newton_schulz(run.float32):
        net = make_whole_net(run)
        names = [n for n, _ in net.named_parameters()]
        model, fv, _ = distributed_model(sc, net)
        opts = _checkpointed_optimizers(run, fv, optimizer)
        model_sd, optim_sd = fcp.get_state_dict(fv, model, opts, options=_options(full))
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        fcp.set_state_dict(
            fv,
            model,
            opts,
            model_state_dict=model_sd,
            optim_state_dict=optim_sd,
            options=_options(full),
        )
        loaded = fv.optim_state_dict(opts[0])
        _train(run, model, fv, opts, run.chosen()[split:])
        return {"loaded": loaded, "params": full_state(model, sc, names)}


def _checkpointed_optimizers(run: MuonRun, fv: flatview.FlatView, optimizer: str) -> list[Any]:
    """Whole over Muon (or AdamW) on the matrices, Whole over AdamW on the rest: both make
    their state eagerly. (A plain AdamW over views makes it lazily: a parameter without a
    gradient before the save has no state then, but has some in a fresh optimizer that
    flatview.checkpoint primes with a step, and DCP's load misses it.)"""
    muon, _, matrices = whole_optimizer(run, fv)
    chosen = {id(p) for p in matrices}
    rest = [p for p in fv.parameters() if p.requires_grad and id(p) not in chosen]
    adamw = Whole(torch.optim.AdamW, fv, rest, lr=0.01, eps=ADAMW_EPS)
    if optimizer == "muon":
        return [muon, adamw]
    return [Whole(torch.optim.AdamW, fv, matrices, lr=0.01, overlap=run.overlap), adamw]


def sharded_refused_for_lazy_state(run: MuonRun) -> str:
    """``Whole(torch.optim.SGD)`` (state made lazily) in the sharded checkpoint form: the
    error, on every rank alike (raised before any collective)."""
    import flatview.checkpoint as fcp

    sc = run.scenario
    with backend_context(sc.backend):
        model, fv, _ = distributed_model(sc, make_whole_net(run))
        matrices = [p for _, p in fv.named_parameters() if is_matrix(fv.shape_of(p))]
        sgd = Whole(torch.optim.SGD, fv, matrices, lr=0.1, momentum=0.9)
        try:
            fcp.get_state_dict(fv, model, [sgd], options=_options(False))
        except flatview.OptimStateError as err:
            message = str(err)
        else:
            message = ""
        # Nothing was left half done: the full form works.
        fcp.get_state_dict(fv, model, [sgd], options=_options(True))
        return message
