"""Workers for mixture-of-experts models whose experts are FSDP units on process groups of
their own (torch FSDP1 and fairscale), as the peers' own MoE tests wrap them.

The model (:class:`MoE`): shared layers (``inp``, ``router``, ``out``) on the root's
group, and ``experts`` (one unit holding all of a group's experts, or one unit per
expert) on an *expert group*: one group per rank (torch's and fairscale's tests) or one
per ``group_size`` consecutive ranks. Experts differ between expert groups (seeded by
the group) and are the same on the ranks of one group. Each step picks, from a seed the
ranks of an expert group share, which of the group's experts take tokens; the others are
skipped (``experts.<e>.*``), so ranks of different groups skip different experts.

The single-process reference (:func:`reference`, run inside each worker without any
collective) holds every group's experts: the shared parameters' gradient is the mean of
every rank's, an expert's the mean over the ranks of its group (what FSDP's reduction in
each unit's own group gives), with the same optimizer per parameter, the gradients
zeroed as the case says (:attr:`MoECase.set_to_none`) and the same values written
between steps (:func:`writes`).
"""

from __future__ import annotations

import contextlib
import itertools
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import flatview
import flatview.optim
from flatview.optim_state import local_part
from tests.scenarios import backend_context, flatview_error, no_sync
from tests.whole_workers import newton_schulz

D_IN, WIDTH, D_OUT, BATCH = 5, 6, 3, 4
ADAM_EPS = 1e-6
"""Adam's ``eps`` in the trainings compared with the reference. Where an element's
gradient nearly cancels (sums to about ``eps``), Adam's update ``g / (|g| + eps)`` turns
the last-bit difference between one process's sum and the ranks' reduction into a
difference of a sizeable fraction of the learning rate: with torch's default 1e-8, one
drawn case (bare FSDP alike) ended 1.6e-4 apart. 1e-6 keeps that below the tolerance."""

_GROUPS: dict[tuple[int, ...], list[dist.ProcessGroup]] = {}
"""Expert groups made in this worker, by the partition of ranks (reused across tasks:
``new_group`` is collective over all ranks, and made once per partition)."""

_MESHES: dict[int, Any] = {}
"""FSDP2 device meshes made in this worker, by the id of their process group (made from
the group, without a collective; reused across tasks as the groups are)."""


@dataclass(frozen=True)
class MoECase:
    """One MoE run: backend, expert group size, experts per group, whether each expert
    is a unit of its own, steps and the optimizer."""

    backend: str  # "torch", "fairscale" or "fsdp2"
    world_size: int
    group_size: int = 1
    experts: int = 3
    unit_per_expert: bool = False
    steps: int = 3
    optimizer: str = "adam"
    """``"adam"``, ``"sgd"`` (plain SGD: a zero gradient = no gradient), ``"coalesced"``
    (Adam through ``flatview.optim.Coalesced`` over flatview's views, plain Adam
    elsewhere) or ``"muon"`` (:class:`MuonAndAdam`: ``torch.optim.Muon`` on every weight
    matrix, experts' included, through ``flatview.optim.Whole``; Adam on the biases)."""
    overlap: bool = False
    """``Whole(overlap=...)``: the pipelined exchanges (``"muon"``)."""
    reload_at: int | None = None
    """After this step the optimizer is built anew and loaded from ``fv.optim_state_dict``
    of the old one on each rank (``Whole``: from its ``state_dict()``): each expert's
    state consolidated in its own group."""
    skip: bool = True
    seed: int = 0
    micro: int = 1
    """Micro-batches per optimizer step (all but the last under ``no_sync()``)."""
    orig_params: bool = False
    """torch FSDP1's ``use_orig_params``."""
    shared_unit: bool = True
    """The shared layer ``inp`` is a unit of its own on the root's group (as the peers')."""
    unwrap_after: int | None = None
    """flatview's run calls ``fv.unwrap()`` after this step and trains on bare (plain SGD:
    an optimizer built anew over the wrapper's parameters trains alike)."""
    zero_grad_at: str = "after_step"
    """Where the optimizer zeroes gradients, one of :data:`tests.scenarios.ZERO_GRAD_PLACES`:
    right after each optimizer step, before each step's first forward, or between that
    forward and its backward."""
    set_to_none: bool = True
    """``zero_grad(set_to_none=...)``: ``False`` leaves a skipped expert that had a
    gradient a zero one, which Adam steps (its moments decay), unlike ``None``."""
    writes: bool = False
    """After each optimizer step, values written into parameters between steps
    (:func:`writes`): ``.data = t`` on an expert's module attribute, ``.data.copy_(t)`` on
    a view, ``p.mul_`` under ``no_grad`` (FSDP2: the in-place one only)."""

    clip: float | None = None
    """Before each optimizer step, ``fv.clip_grad_norm_(clip, clip_p)``: the norm over the
    shared parameters and every group's experts, as the reference (holding them all)
    clips."""
    clip_p: float = 2.0

    @property
    def user_patterns(self) -> bool:
        """Zeroing elsewhere than after the step, zeroing in place, writes, or clipping:
        compared with the reference only (the plain wrapper has no views to write
        through, and clips otherwise)."""
        return (
            self.zero_grad_at != "after_step"
            or not self.set_to_none
            or self.writes
            or self.clip is not None
            or self.optimizer == "muon"
            or self.reload_at is not None
        )

    @property
    def groups(self) -> int:
        return self.world_size // self.group_size

    def group_of(self, rank: int) -> int:
        return rank // self.group_size


def expert_group(case: MoECase) -> dist.ProcessGroup:
    """This rank's expert group (every rank makes every group, as ``new_group`` needs)."""
    key = tuple(case.group_of(r) for r in range(case.world_size))
    made = _GROUPS.get(key)
    if made is None:
        made = _GROUPS[key] = [
            dist.new_group(list(range(g * case.group_size, (g + 1) * case.group_size)))
            for g in range(case.groups)
        ]
    return made[case.group_of(dist.get_rank())]


def mesh_of(group: Any) -> Any:
    """The one-dimensional CPU device mesh over ``group`` (made once per worker)."""
    from torch.distributed.device_mesh import DeviceMesh

    made = _MESHES.get(id(group))
    if made is None:
        made = _MESHES[id(group)] = DeviceMesh.from_group(group, "cpu")
    return made


class Experts(nn.Module):
    """A group's experts; tokens routed by ``assignment`` (expert per row)."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(count))

    def forward(self, h: torch.Tensor, gates: torch.Tensor, assignment: list[int]) -> torch.Tensor:
        rows = []
        for i, e in enumerate(assignment):
            rows.append(gates[i, e] * torch.tanh(self.experts[e](h[i : i + 1])))
        return torch.cat(rows)


class OneExpert(nn.Module):
    """One expert as a module of its own (wrapped alone as a unit)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.layer(h))


class MoE(nn.Module):
    """Shared input, router and output layers around one group's experts."""

    def __init__(self, case: MoECase, group: int) -> None:
        super().__init__()
        torch.manual_seed(case.seed)
        self.inp = nn.Linear(D_IN, WIDTH)
        self.router = nn.Linear(WIDTH, case.experts)
        self.out = nn.Linear(WIDTH, D_OUT)
        torch.manual_seed(case.seed + 1000 + group)
        self.per_expert = case.unit_per_expert
        if case.unit_per_expert:
            self.experts = nn.ModuleList(OneExpert() for _ in range(case.experts))
        else:
            self.experts = Experts(case.experts)

    def forward(self, x: torch.Tensor, assignment: list[int] | None) -> torch.Tensor:
        """``assignment``: the expert of each row, ``None``: no expert takes any token
        (the router still runs)."""
        h = torch.tanh(self.inp(x))
        gates = torch.softmax(self.router(h), dim=-1)
        if assignment is None:
            mixed = 0 * gates.sum()
        elif self.per_expert:
            mixed = torch.cat(
                [gates[i, e] * self.experts[e](h[i : i + 1]) for i, e in enumerate(assignment)]
            )
        else:
            mixed = self.experts(h, gates, assignment)
        return self.out(h + mixed)


def batch(case: MoECase, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(case.seed * 7919 + step * 131 + rank)
    return torch.randn(BATCH, D_IN, generator=g), torch.randn(BATCH, D_OUT, generator=g)


def routing(case: MoECase, group: int, step: int) -> tuple[list[int], list[int]]:
    """(the experts that take tokens, the expert per row) of ``group`` at ``step``: the
    same on its ranks; with ``skip`` off every expert takes some token."""
    rng = random.Random(case.seed * 104729 + step * 31 + group)
    if case.skip:
        active = sorted(rng.sample(range(case.experts), rng.randint(1, case.experts)))
    else:
        active = list(range(case.experts))
    rows = [active[(i + rng.randint(0, 10)) % len(active)] for i in range(BATCH)]
    return sorted(set(rows)), rows


def skipped(case: MoECase, group: int, step: int) -> list[str]:
    used, _ = routing(case, group, step)
    return [_expert_name(case, e) for e in range(case.experts) if e not in used]


class MuonAndAdam:
    """Muon on the weight matrices (``flatview.optim.Whole`` over views, or torch's own
    in the reference), Adam on the biases: one optimizer to the training loop."""

    def __init__(
        self,
        named: Sequence[tuple[str, nn.Parameter]],
        fv: flatview.FlatView | None,
        overlap: bool,
    ) -> None:
        self.named, self.fv, self.overlap = list(named), fv, overlap
        weights = [p for n, p in self.named if n.endswith("weight")]
        kwargs = {"lr": 0.05, "momentum": 0.9}
        self.muon: Any = (
            torch.optim.Muon(weights, **kwargs)
            if fv is None
            else flatview.optim.Whole(torch.optim.Muon, fv, weights, overlap=overlap, **kwargs)
        )
        biases = [p for n, p in self.named if n.endswith("bias")]
        self.adam = torch.optim.Adam(biases, lr=0.01, eps=ADAM_EPS)

    def step(self) -> None:
        self.muon.step()
        self.adam.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adam.zero_grad(set_to_none=set_to_none)

    def reloaded(self) -> MuonAndAdam:
        """The same optimizers built anew and loaded from this one's consolidated state
        dicts."""
        assert self.fv is not None
        fresh = MuonAndAdam(self.named, self.fv, self.overlap)
        fresh.muon.load_state_dict(self.muon.state_dict())
        self.fv.load_optim_state_dict(fresh.adam, self.fv.optim_state_dict(self.adam))
        return fresh


def _reloaded(case: MoECase, opt: Any, fv: flatview.FlatView | None) -> Any:
    """``opt`` built anew, loaded from its consolidated state (see ``reload_at``)."""
    assert fv is not None, "reloading consolidates through flatview"
    if isinstance(opt, MuonAndAdam):
        return opt.reloaded()
    fresh = _optimizer(case, fv.named_parameters(), fv)
    fv.load_optim_state_dict(fresh, fv.optim_state_dict(opt))
    return fresh


def _optimizer(
    case: MoECase,
    named: Iterator[tuple[str, nn.Parameter]],
    fv: flatview.FlatView | None = None,
) -> Any:
    if case.optimizer == "muon":
        return MuonAndAdam(list(named), fv, case.overlap)
    params = [p for _, p in named]
    if case.optimizer == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    if case.optimizer == "coalesced" and fv is not None:
        return flatview.optim.Coalesced(torch.optim.Adam, params, lr=0.01, eps=ADAM_EPS)
    return torch.optim.Adam(params, lr=0.01, eps=ADAM_EPS)


def wrap(case: MoECase, model: MoE) -> nn.Module:
    """FSDP-wrap as the peers do: experts on their own group, ``inp`` a unit on the root's
    (FSDP2: experts on a mesh of their own group, the others on the world's mesh)."""
    group = expert_group(case)
    if case.backend == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        def unit(module: nn.Module, pg: Any) -> nn.Module:
            fully_shard(module, mesh=mesh_of(pg if pg is not None else dist.group.WORLD))
            return module

    elif case.backend == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        def unit(module: nn.Module, pg: Any) -> nn.Module:
            return FSDP(
                module,
                process_group=pg,
                device_id=torch.device("cpu"),
                use_orig_params=case.orig_params,
            )

    else:
        from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

        def unit(module: nn.Module, pg: Any) -> nn.Module:
            kwargs = {"process_group_reduce_scatter": pg} if pg is not None else {}
            return FSDP(module, process_group=pg, flatten_parameters=True, **kwargs)

    if case.unit_per_expert:
        for i in range(len(model.experts)):
            model.experts[i] = unit(model.experts[i], group)
    else:
        model.experts = unit(model.experts, group)  # type: ignore[assignment]
    if case.shared_unit:
        model.inp = unit(model.inp, None)  # type: ignore[assignment]
    return unit(model, None)


def _original(root: nn.Module) -> MoE:
    module = root
    while not isinstance(module, MoE):
        module = module.module  # type: ignore[assignment]
    return module


def train(
    case: MoECase,
    use_flatview: bool,
    provoke: Callable[[nn.Module, flatview.FlatView], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Train the wrapped model; the parameters this rank holds, whole, by name.
    ``provoke`` runs once flatview has wrapped the model, before its optimizer is made."""
    rank = dist.get_rank()
    group = case.group_of(rank)
    root = wrap(case, MoE(case, group))
    fv = flatview.wrap(root) if use_flatview else None
    assert fv is not None or not case.writes, "writes go through flatview's views"
    if provoke is not None:
        assert fv is not None
        provoke(root, fv)
    opt = _optimizer(case, (fv.named_parameters() if fv else root.named_parameters()), fv)
    for step in range(case.steps):
        if case.zero_grad_at == "before_forward":
            opt.zero_grad(set_to_none=case.set_to_none)
        for m in range(case.micro):
            at = step * case.micro + m
            x, y = batch(case, rank, at)
            _, rows = routing(case, group, at)
            scope = fv.step(skip=skipped(case, group, at)) if fv else contextlib.nullcontext()
            sync = no_sync(root) if m < case.micro - 1 else contextlib.nullcontext()
            with sync, scope:
                loss = torch.nn.functional.mse_loss(root(x, rows), y)
                if m == 0 and case.zero_grad_at == "between":
                    opt.zero_grad(set_to_none=case.set_to_none)
                loss.backward()
        if case.clip is not None:
            assert fv is not None, "clipping is flatview's (the plain wrapper's is local)"
            fv.clip_grad_norm_(case.clip, case.clip_p)
        opt.step()
        if case.zero_grad_at == "after_step":
            opt.zero_grad(set_to_none=case.set_to_none)
        if step == case.reload_at:
            opt = _reloaded(case, opt, fv)
        if fv is not None and case.writes:
            write_through(case, root, fv, step)
        if fv is not None and step == case.unwrap_after:
            fv.unwrap()
            fv = None
            opt = _optimizer(case, root.named_parameters())
    return whole_parameters(case, root, fv)


@dataclass(frozen=True)
class Write:
    """One write into a parameter between steps: ``kind`` ``"assign"`` (``.data = t`` on
    the module attribute), ``"copy"`` (``.data.copy_(t)`` on the view) or ``"scale"``
    (``p.mul_(0.5)`` under ``no_grad``); ``t`` drawn from ``seed``."""

    kind: str
    name: str
    seed: int = 0


def writes(case: MoECase, group: int, step: int) -> list[Write]:
    """The writes after optimizer step ``step`` on the ranks of expert group ``group``:
    into two of the group's experts (in turn, so that one skipped in the next step or
    the whole unit of one is written too) and, in place, into two shared parameters
    (the same values on every rank; never assigned, which would untie the reference's
    shared parameters)."""
    layer = ".layer" if case.unit_per_expert else ""
    first = _expert_name(case, step % case.experts) + layer
    second = _expert_name(case, (step + 1) % case.experts) + layer
    seed = case.seed * 7907 + step * 101
    found = [
        Write("scale", "router.weight"),
        Write("copy", "out.bias", seed),
        Write("assign", f"{first}.weight", seed + 1 + 10 * group),
        Write("copy", f"{second}.bias", seed + 2 + 10 * group),
        Write("scale", f"{second}.weight"),
    ]
    if case.backend == "fsdp2":
        # FSDP2's parameters are the model's own sharded DTensors (no views): a user
        # writes them in place.
        return [w for w in found if w.kind == "scale"]
    return found


def _value(shape: Sequence[int], seed: int) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed))


def write_through(case: MoECase, root: nn.Module, fv: flatview.FlatView, step: int) -> None:
    """:func:`writes` through flatview's views on this rank: ``.data = t`` with the whole
    value (flatview keeps this rank's piece), ``.data.copy_`` with this rank's piece
    (a sharded expert's view holds a part of it)."""
    views = dict(fv.named_parameters())
    model = _original(root)
    for w in writes(case, case.group_of(dist.get_rank()), step):
        view = views[w.name]
        if w.kind == "scale":
            with torch.no_grad():
                view.mul_(0.5)
            continue
        whole = _value(fv.shape_of(view), w.seed)
        start, end = fv.placement(view).param_interval
        # This rank's piece (a partial view is 1-D, an empty one empty).
        piece = whole.flatten()[start:end].view_as(view).clone()
        if w.kind == "copy":
            view.data.copy_(piece)
        else:
            # The whole value, as on the unwrapped model: flatview keeps this rank's
            # piece. torch's own views (use_orig_params=True) take only their own shape,
            # as without flatview (torch's writeback raises on another).
            path, attr = w.name.rsplit(".", 1)
            module: Any = model
            for part in path.split("."):
                module = getattr(module, part)
            assert getattr(module, attr) is view, w.name
            getattr(module, attr).data = piece if case.orig_params else whole


def _write_whole(params: dict[str, nn.Parameter], write: Write) -> None:
    """``write`` on the reference's (whole) parameter."""
    param = params[write.name]
    if write.kind == "scale":
        with torch.no_grad():
            param.mul_(0.5)
    elif write.kind == "copy":
        param.data.copy_(_value(param.shape, write.seed))
    else:
        param.data = _value(param.shape, write.seed)


def whole_parameters(
    case: MoECase, root: nn.Module, fv: flatview.FlatView | None
) -> dict[str, torch.Tensor]:
    """Every parameter of this rank's model, whole (``summon_full_params``; FSDP2: each
    ``DTensor``'s ``full_tensor``, gathered over its own mesh)."""
    if case.backend == "fsdp2":
        return {n: p.full_tensor().detach().clone() for n, p in root.named_parameters()}
    if case.backend == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        summon = FSDP.summon_full_params(root)
    else:
        summon = root.summon_full_params()
    with summon:
        return {n: p.detach().clone() for n, p in _clean_named(_original(root).named_parameters())}


def _clean_named(named: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, p in named:
        parts = [
            s
            for s in name.split(".")
            if s not in ("_fsdp_wrapped_module", "_fpw_module", "_flat_param", "module")
        ]
        yield ".".join(parts), p


def reference(case: MoECase) -> list[dict[str, torch.Tensor]]:
    """Per rank, the parameters the single-process reference ends with (see the module
    docstring); no collective."""
    models = [MoE(case, g) for g in range(case.groups)]
    shared = {n: p for n, p in models[0].named_parameters() if not n.startswith("experts")}
    for m in models[1:]:
        for n, p in m.named_parameters():
            if not n.startswith("experts"):
                p.data = shared[n].data  # one set of shared parameters
    named: list[tuple[str, nn.Parameter]] = list(shared.items())
    for m in models:
        named += [(n, p) for n, p in m.named_parameters() if n.startswith("experts")]
    params = [p for _, p in named]
    opt = _optimizer(case, iter(named))
    for step in range(case.steps):
        # Wherever the distributed run zeroes (after the last step, before the forward
        # or between it and its backward), no gradient of this step has arrived yet.
        opt.zero_grad(set_to_none=case.set_to_none)
        grads: dict[int, torch.Tensor] = {}
        for rank, m in itertools.product(range(case.world_size), range(case.micro)):
            g = case.group_of(rank)
            model = models[g]
            at = step * case.micro + m
            x, y = batch(case, rank, at)
            used, rows = routing(case, g, at)
            named = [
                (n, p)
                for n, p in model.named_parameters()
                if not n.startswith("experts") or _used(case, n, used)
            ]
            loss = torch.nn.functional.mse_loss(model(x, rows), y)
            found = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
            for (n, p), grad in zip(named, found, strict=True):
                if grad is None:
                    grad = torch.zeros_like(p)
                scale = case.world_size if not n.startswith("experts") else case.group_size
                key = id(shared[n]) if not n.startswith("experts") else id(p)
                grads[key] = grads.get(key, 0) + grad / scale
        for p in params:
            grad = grads.get(id(p))
            if grad is not None:
                p.grad = grad if p.grad is None else p.grad + grad
        if case.clip is not None:
            torch.nn.utils.clip_grad_norm_(params, case.clip, case.clip_p)
        opt.step()
        if case.writes:
            for g, model in enumerate(models):
                named = dict(model.named_parameters())
                for w in writes(case, g, step):
                    # The shared parameters once (the models share their storage).
                    if g == 0 or w.name.startswith("experts"):
                        _write_whole(named, w)
    return [
        {n: p.detach().clone() for n, p in models[case.group_of(r)].named_parameters()}
        for r in range(case.world_size)
    ]


def _used(case: MoECase, name: str, used: Sequence[int]) -> bool:
    index = int(name.split(".")[1 if case.unit_per_expert else 2])
    return not case.skip or index in used


def run_case(case: MoECase) -> dict[str, float]:
    """Worker: flatview's training vs the reference and vs the plain wrapper's (same
    processes); the largest relative differences."""
    with backend_context(case.backend), newton_schulz(float32=case.optimizer == "muon"):
        return _compare(case)


def _compare(case: MoECase) -> dict[str, float]:
    mine = train(case, True)
    expected = reference(case)[dist.get_rank()]
    assert sorted(mine) == sorted(expected), (sorted(mine), sorted(expected))
    found = {"reference": worst(mine, expected)}
    # Plain fairscale fails in its own backward when an expert unit's forward is not
    # called (a skipped expert of its own), and the plain wrappers under no_sync() with
    # experts skipped: no plain run to compare with there.
    plain_fails = case.skip and (
        (case.backend == "fairscale" and case.unit_per_expert) or case.micro > 1
    )
    # Plain FSDP2 leaves a parameter without a gradient out of its reduce-scatter and its
    # gradient None, as flatview does a skipped one: the same training for any optimizer.
    comparable = case.backend == "fsdp2" or (
        (case.optimizer == "sgd" or not case.skip) and not plain_fails
    )
    if comparable and not case.user_patterns:
        # A skipped expert gets no gradient under flatview, zeros under the plain
        # wrapper: the same training for plain SGD only.
        plain = train(case, False)
        found["plain"] = worst(mine, plain)
        found["plain_vs_reference"] = worst(plain, expected)
    return found


def worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-6)) for n in a)


def _wrapped(case: MoECase) -> tuple[nn.Module, flatview.FlatView]:
    root = wrap(case, MoE(case, case.group_of(dist.get_rank())))
    return root, flatview.wrap(root)


def _step(
    case: MoECase, root: nn.Module, fv: flatview.FlatView, step: int, skip: Sequence[str]
) -> None:
    rank = dist.get_rank()
    x, y = batch(case, rank, step)
    _, rows = routing(case, case.group_of(rank), step)
    with fv.step(skip=skip):
        torch.nn.functional.mse_loss(root(x, rows), y).backward()


def mismatch_task(case: MoECase, shared: bool) -> str:
    """Rank 1 skips an expert (``shared``: a shared layer) that its group's other ranks
    use; every rank must raise."""
    with backend_context(case.backend):
        root, fv = _wrapped(case)
        rank = dist.get_rank()
        skip = skipped(case, case.group_of(rank), 0)
        if rank == 1:
            extra = "router" if shared else _first_used(case, 0)
            skip = [*skip, extra]
        try:
            _step(case, root, fv, 0, skip)
        except flatview.FlatViewError as err:
            return f"{type(err).__name__}: {err}"
        return "no error"


def _first_used(case: MoECase, step: int) -> str:
    used, _ = routing(case, case.group_of(dist.get_rank()), step)
    return _expert_name(case, used[0])


def traffic_task(case: MoECase) -> tuple[int, int, int]:
    """(bytes a step moves with every expert of the group skipped, with none skipped,
    the experts' numel on this rank's group): counted at the collective calls."""
    from flatview.testing.counting import CollectiveCounter

    with backend_context(case.backend):
        root, fv = _wrapped(case)
        names = [_expert_name(case, e) for e in range(case.experts)]
        moved = []
        rank = dist.get_rank()
        x, y = batch(case, rank, 0)
        rows = [e % case.experts for e in range(BATCH)]
        for skip in (names, []):
            with CollectiveCounter() as counter, fv.step(skip=skip):
                out = root(x, rows if not skip else None)
                torch.nn.functional.mse_loss(out, y).backward()
            moved.append(counter.total_bytes)
        return moved[0], moved[1], case.experts * (WIDTH * WIDTH + WIDTH)


def whole_traffic_task(case: MoECase) -> tuple[int, int]:
    """(collective calls, bytes) of one ``Whole(Muon)`` step over the experts' weights
    alone, every expert used: counted at the collective calls."""
    from flatview.testing.counting import CollectiveCounter

    with backend_context(case.backend):
        root, fv = _wrapped(case)
        weights = [
            p for n, p in fv.named_parameters() if n.startswith("experts") and n.endswith("weight")
        ]
        muon = flatview.optim.Whole(torch.optim.Muon, fv, weights, lr=0.05)
        x, y = batch(case, dist.get_rank(), 0)
        with fv.step():
            rows = [e % case.experts for e in range(BATCH)]
            torch.nn.functional.mse_loss(root(x, rows), y).backward()
        with CollectiveCounter() as counter:
            muon.step()
        return sum(counter.calls.values()), counter.total_bytes


def checkpoint_task(
    case: MoECase, directory: str, full: bool, half: int, via_torch: str = ""
) -> dict[str, Any]:
    """Steps ``[0, half)``, ``flatview.checkpoint.get_state_dict`` (``full``: the full
    form; ``via_torch``: torch's own functions, routed to it: ``"pair"``
    ``get_state_dict`` / ``set_state_dict``, ``"halves"`` the model's and the
    optimizer's apart, as Lightning's ``ModelParallelStrategy`` and accelerate call them)
    saved with ``torch.distributed.checkpoint``; then a fresh model (other initial
    values) and optimizer loaded from it, trained on to ``case.steps``. ``reference``:
    the largest relative difference from the uninterrupted reference; ``keys``: the
    saved model keys of experts."""
    import dataclasses

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as torch_sd
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    import flatview.checkpoint as fcp

    options = StateDictOptions(full_state_dict=full)

    def optimizers(opt: Any) -> Any:
        # Muon's case: the optimizers the checkpoint functions take.
        return (opt.muon, opt.adam) if isinstance(opt, MuonAndAdam) else opt

    def get(fv: flatview.FlatView, root: nn.Module, opt: Any) -> tuple[Any, Any]:
        opt = optimizers(opt)
        if via_torch == "halves":
            return (
                torch_sd.get_model_state_dict(root, options=options),
                torch_sd.get_optimizer_state_dict(root, opt, options=options),
            )
        if via_torch:
            return torch_sd.get_state_dict(root, opt, options=options)
        return fcp.get_state_dict(fv, root, opt, options=options)

    def load(fv: flatview.FlatView, root: nn.Module, opt: Any, model: Any, optim: Any) -> None:
        opt = optimizers(opt)
        if via_torch == "halves":
            torch_sd.set_model_state_dict(root, model, options=options)
            torch_sd.set_optimizer_state_dict(root, opt, optim, options=options)
        elif via_torch:
            torch_sd.set_state_dict(
                root, opt, model_state_dict=model, optim_state_dict=optim, options=options
            )
        else:
            fcp.set_state_dict(
                fv, root, opt, model_state_dict=model, optim_state_dict=optim, options=options
            )

    rank = dist.get_rank()
    group = case.group_of(rank)
    muon = case.optimizer == "muon"
    with backend_context(case.backend), newton_schulz(float32=muon):
        root, fv = _wrapped(case)
        opt = _optimizer(case, fv.named_parameters(), fv)
        _train_steps(case, root, fv, opt, range(half))
        model_sd, optim_sd = get(fv, root, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
        keys = sorted(k for k in model_sd if "experts" in k)
        del root, fv, opt, model_sd, optim_sd
        other = dataclasses.replace(case, seed=case.seed + 17)
        root = wrap(case, MoE(other, group))
        fv = flatview.wrap(root)
        opt = _optimizer(case, fv.named_parameters(), fv)
        model_sd, optim_sd = get(fv, root, opt)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
        load(fv, root, opt, model_sd, optim_sd)
        _train_steps(case, root, fv, opt, range(half, case.steps))
        mine = whole_parameters(case, root, fv)
        # Inside the context: Muon's reference orthogonalises in float32 too.
        expected = reference(case)[rank]
    return {"reference": worst(mine, expected), "keys": keys}


def resharded_task(case: MoECase, directory: str, save: bool) -> dict[str, Any]:
    """``save``: two steps, the sharded form saved with ``torch.distributed.checkpoint``;
    else a fresh model and optimizer loaded from it. Either way the full form after (CPU
    tensors, experts under their group's prefix), to compare across world sizes."""
    import dataclasses

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    import flatview.checkpoint as fcp

    with backend_context(case.backend):
        seeded = case if save else dataclasses.replace(case, seed=case.seed + 17)
        root = wrap(case, MoE(seeded, case.group_of(dist.get_rank())))
        fv = flatview.wrap(root)
        opt = _optimizer(case, fv.named_parameters(), fv)
        if save:
            _train_steps(case, root, fv, opt, range(2))
        model_sd, optim_sd = fcp.get_state_dict(fv, root, opt)
        if save:
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
        else:
            dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
            fcp.set_state_dict(fv, root, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        full = StateDictOptions(full_state_dict=True)
        model_sd, optim_sd = fcp.get_state_dict(fv, root, opt, options=full)
        model = {k: _local(v).detach().cpu().clone() for k, v in model_sd.items()}
        state = {
            f"{name}/{key}": value.detach().cpu().clone()
            for name, entry in optim_sd["state"].items()
            for key, value in entry.items()
            if isinstance(value, torch.Tensor)
        }
        return {"model": model, "state": state}


def _train_steps(
    case: MoECase, root: nn.Module, fv: flatview.FlatView, opt: Any, steps: range
) -> None:
    """The steps of :func:`train` with the default patterns (zeroing after the step)."""
    rank = dist.get_rank()
    group = case.group_of(rank)
    for step in steps:
        for m in range(case.micro):
            at = step * case.micro + m
            x, y = batch(case, rank, at)
            _, rows = routing(case, group, at)
            sync = no_sync(root) if m < case.micro - 1 else contextlib.nullcontext()
            with sync, fv.step(skip=skipped(case, group, at)):
                torch.nn.functional.mse_loss(root(x, rows), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _expert_name(case: MoECase, e: int) -> str:
    return f"experts.{e}" if case.unit_per_expert else f"experts.experts.{e}"


def state_task(case: MoECase) -> dict[str, Any]:
    """After two steps: what ``fv.optim_state_dict``, ``flatview.checkpoint`` and
    ``flatview.optim.Whole`` do with expert units (each outcome: a result or the error)."""
    import flatview.checkpoint as fcp

    with backend_context(case.backend):
        root, fv = _wrapped(case)
        opt = torch.optim.Adam(fv.parameters(), lr=0.01)
        group = case.group_of(dist.get_rank())
        found: dict[str, Any] = {}
        for step in range(2):
            _step(case, root, fv, step, skipped(case, group, step))
            if step == 1:
                found["grad_norms"] = _expert_grad_norms(case, fv)
                try:
                    fv.clip_grad_norm_(1.0)
                    found["clip"] = "clipped"
                except flatview.FlatViewError as err:
                    found["clip"] = f"{type(err).__name__}: {err}"
            opt.step()
            opt.zero_grad()
        try:
            consolidated = fv.optim_state_dict(opt)
            # Each expert's whole state, assembled in its own group: this rank's piece of
            # it is this rank's own state.
            found["optim"] = {
                n: bool(
                    torch.equal(
                        local_part(fv.placement(p), consolidated["state"][n]["exp_avg"]).view(-1),
                        _local(opt.state[p]["exp_avg"]).reshape(-1),
                    )
                )
                for n, p in fv.named_parameters()
                if p in opt.state and n.startswith("experts")
            }
            fv.load_optim_state_dict(opt, consolidated)
        except flatview.FlatViewError as err:
            found["optim"] = f"{type(err).__name__}: {err}"
        try:
            fcp.get_state_dict(fv, root, opt)
            found["checkpoint"] = "saved"
        except flatview.FlatViewError as err:
            found["checkpoint"] = f"{type(err).__name__}: {err}"
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_state_dict,
            set_model_state_dict,
        )

        rank0 = StateDictOptions(full_state_dict=True, cpu_offload=True)
        found["checkpoint_rank0"] = flatview_error(
            lambda: fcp.get_state_dict(fv, root, opt, options=rank0)
        )
        # torch's own functions on the wrapped model are routed to flatview.checkpoint.
        found["backend"] = case.backend
        found["torch_rank0"] = flatview_error(lambda: get_state_dict(root, opt, options=rank0))
        model_sd, optim_sd = get_state_dict(root, opt)
        found["torch_keys"] = sorted(k for k in [*model_sd, *optim_sd["state"]] if "experts" in k)
        # On a module holding the wrapped model (as a LightningModule does): routed, the
        # keys under its path. With other state besides: torch's own state of it on
        # FSDP2 (the experts' keys renamed), refused on the wrappers that flatten.
        holder = nn.Module()
        holder.net = root
        model_sd, optim_sd = get_state_dict(holder, opt)
        found["held_keys"] = sorted(k for k in [*model_sd, *optim_sd["state"]] if "experts" in k)
        holder.extra = nn.Linear(1, 1)
        found["held_with_extra"] = flatview_error(lambda: get_state_dict(holder, opt))
        if found["held_with_extra"] == "accepted":
            model_sd, _ = get_state_dict(holder, opt)
            found["held_extra_keys"] = sorted(k for k in model_sd if "experts" in k or "extra" in k)
            # Loads back through the same routing (each group's experts, the extra too).
            set_model_state_dict(holder, model_sd)
        try:
            whole = flatview.optim.Whole(torch.optim.SGD, fv, fv.parameters(), lr=0.1)
            found["whole"] = "built"
        except (flatview.FlatViewError, TypeError) as err:
            found["whole"] = f"{type(err).__name__}: {err}"
            return found
        found.update(_saved_on_another_group(case, fv, whole, opt))
        return found


def _saved_on_another_group(
    case: MoECase, fv: flatview.FlatView, whole: Any, opt: torch.optim.Optimizer
) -> dict[str, Any]:
    """The two habits that would load one expert group's experts into another's:
    ``rank0_only=True`` (refused), and a dict from a rank of the next group loaded here
    (refused; it names its group). What each of ``fv.optim_state_dict`` and
    ``Whole.state_dict`` raises."""
    found: dict[str, Any] = {}
    mine = {"whole": whole.state_dict(), "optim": fv.optim_state_dict(opt)}
    found["tag"] = mine["whole"].get("expert_group")
    found["optim_tag"] = mine["optim"].get("expert_group")
    found["whole_rank0_only"] = flatview_error(lambda: whole.state_dict(rank0_only=True))
    found["optim_rank0_only"] = flatview_error(lambda: fv.optim_state_dict(opt, rank0_only=True))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    theirs = everyone[(dist.get_rank() + case.group_size) % case.world_size]
    assert theirs is not None
    found["whole_foreign"] = flatview_error(lambda: whole.load_state_dict(theirs["whole"]))
    found["optim_foreign"] = flatview_error(lambda: fv.load_optim_state_dict(opt, theirs["optim"]))
    # One's own loads.
    whole.load_state_dict(mine["whole"])
    return found


def _expert_grad_norms(case: MoECase, fv: flatview.FlatView) -> dict[str, tuple[float, float]]:
    """Per expert parameter with a gradient: (``fv.grad_norms``, the norm of the pieces
    of this rank's expert group, summed here within the group)."""
    norms = fv.grad_norms()
    found = {}
    for name, view in fv.named_parameters():
        if not name.startswith("experts"):
            continue
        # None where skipped, and on a rank that holds none of the expert's elements (an
        # empty view gets no gradient): the group's ranks all join, and a parameter
        # counts if any of them has a gradient.
        grad = None if view.grad is None else _local(view.grad)
        pair = torch.zeros(2, dtype=torch.float64)
        if grad is not None:
            pair[0], pair[1] = grad.double().pow(2).sum(), 1.0
        dist.all_reduce(pair, group=expert_group(case))
        if pair[1]:
            found[name] = (float(norms[name]), float(pair[0].sqrt()))
    return found


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``tensor`` (a ``DTensor``'s local tensor under FSDP2)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def hsdp_refusal_task(case: MoECase) -> str:
    """FSDP2 with the shared layers on an HSDP mesh (every rank a replica) and the experts
    on meshes of their own: what ``flatview.wrap`` raises on this rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    hsdp = _MESHES.get(-1)
    if hsdp is None:
        hsdp = _MESHES[-1] = init_device_mesh(
            "cpu", (case.world_size, 1), mesh_dim_names=("replicate", "shard")
        )
    model = MoE(case, case.group_of(dist.get_rank()))
    fully_shard(model.experts, mesh=mesh_of(expert_group(case)))
    root = fully_shard(model, mesh=hsdp)
    try:
        flatview.wrap(root)
    except flatview.FlatViewError as err:
        return f"{type(err).__name__}: {err}"
    return "wrapped"


def one_rank_errors_task(case: MoECase) -> dict[str, Any]:
    """Errors one rank alone makes in a step, each before any training: rank 1 names an
    expert the model does not have, the last rank puts an item of the wrong type in its
    skip set, and (expert groups of several ranks) rank 1 skips an expert its group's
    other ranks use. Each must raise on every rank (``messages``); the training that
    follows must then be the reference's (``reference``: the largest relative
    difference)."""
    messages: dict[str, str] = {}

    def provoke(root: nn.Module, fv: flatview.FlatView) -> None:
        rank, last = dist.get_rank(), dist.get_world_size() - 1
        skip = skipped(case, case.group_of(rank), 0)
        bad: dict[str, list[Any]] = {
            "unknown": [*skip, _expert_name(case, case.experts)] if rank == 1 else skip,
            "item": [*skip, 3] if rank == last else skip,
        }
        if case.group_size > 1:
            bad["mismatch"] = [*skip, _first_used(case, 0)] if rank == 1 else skip
        for kind, items in bad.items():
            messages[kind] = flatview_error(lambda items=items: _step(case, root, fv, 0, items))

    with backend_context(case.backend):
        mine = train(case, True, provoke)
    expected = reference(case)[dist.get_rank()]
    return {"messages": messages, "reference": worst(mine, expected)}
