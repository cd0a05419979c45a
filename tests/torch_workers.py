"""Worker tasks for the torch FSDP1 backend tests, and the non-distributed reference.

The tasks run on every rank of a ``tests.dist_pool`` pool, so they live at module
level (the pool pickles them by reference). Everything backend-specific (how the model
is wrapped, how full parameters are gathered) sits behind :class:`Backend`, so the same
tasks can later drive other FSDP implementations.

The model: a stem, a body of residual blocks (each its own FSDP unit), an ``aux`` layer
and a head. Each block has an optional ``gate`` layer, so a step can skip whole units
(``body.1``), single parameters inside a unit (``body.2.gate``) or parameters of the
root unit (``aux``). A :class:`Plan` says what one step runs; :func:`skip_names` turns
it into the skip set; the reference run (:func:`reference_run`) simply does not execute
what the plan leaves out.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import flatview
from flatview.errors import FlatViewError
from flatview.layout import PieceKind

SEED = 1234
DIN, WIDTH, DOUT, DEPTH = 5, 7, 3, 4
LOCAL_BATCH = 3

# ------------------------------------------------------------------------- model


class Block(nn.Module):
    """A residual branch; ``gate`` takes part only when the step asks for it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)
        self.gate = nn.Linear(width, width)

    def forward(self, h: torch.Tensor, gated: bool = False) -> torch.Tensor:
        out = self.fc2(torch.tanh(self.fc1(h)))
        if gated:
            out = out * torch.sigmoid(self.gate(h))
        return out


class Net(nn.Module):
    """Stem, body of blocks, optional aux layer, head."""

    def __init__(self, depth: int = DEPTH) -> None:
        super().__init__()
        self.stem = nn.Linear(DIN, WIDTH)
        self.body = nn.ModuleList(Block(WIDTH) for _ in range(depth))
        self.aux = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, DOUT)

    def forward(
        self,
        x: torch.Tensor,
        skip_blocks: Sequence[int] = (),
        gated: Sequence[int] = (),
        aux: bool = False,
    ) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        for index, block in enumerate(self.body):
            if index not in skip_blocks:
                h = h + block(h, gated=index in gated)
        if aux:
            h = h + torch.tanh(self.aux(h))
        out: torch.Tensor = self.head(h)
        return out


def build_model(depth: int = DEPTH) -> Net:
    """The same initial model on every process."""
    torch.manual_seed(SEED)
    return Net(depth)


@dataclass(frozen=True)
class Plan:
    """What one forward runs: blocks left out, blocks whose gate runs, the aux layer."""

    skip_blocks: tuple[int, ...] = ()
    gated: tuple[int, ...] = ()
    aux: bool = False

    def kwargs(self) -> dict[str, Any]:
        return {"skip_blocks": self.skip_blocks, "gated": self.gated, "aux": self.aux}


def skip_names(plan: Plan, depth: int = DEPTH) -> list[str]:
    """The skip set of a plan: skipped blocks, idle gates, the idle aux layer."""
    names = [f"body.{i}" for i in plan.skip_blocks]
    names += [f"body.{i}.gate" for i in range(depth) if i not in plan.skip_blocks + plan.gated]
    if not plan.aux:
        names.append("aux")
    return names


# Skips in the first step included; every block is skipped in some step and used in
# some other; gates and aux come and go.
PLANS: tuple[Plan, ...] = (
    Plan(skip_blocks=(1,), gated=(0,), aux=False),
    Plan(skip_blocks=(), gated=(0, 1, 2, 3), aux=True),
    Plan(skip_blocks=(0, 3), gated=(2,), aux=False),
    Plan(skip_blocks=(2,), gated=(), aux=True),
    Plan(skip_blocks=(1, 2), gated=(3,), aux=False),
)

# Gradient accumulation: per optimizer step, the plans of its micro-batches. Block 3 is
# skipped in every micro-batch of the first step (its grads must stay None); block 1 is
# used only in the first micro-batch and skipped in the synchronising one.
ACCUMULATION: tuple[tuple[Plan, ...], ...] = (
    (Plan((0, 3), (1,), True), Plan((1, 3), (), False), Plan((1, 3), (2,), False)),
    (Plan((2,), (0,), False), Plan((), (3,), True), Plan((0, 2), (), False)),
)


def batch(seed: int, world_size: int, rank: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one micro-batch, or rank ``rank``'s part of it."""
    gen = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(world_size * LOCAL_BATCH, DIN, generator=gen)
    y = torch.randn(world_size * LOCAL_BATCH, DOUT, generator=gen)
    if rank is None:
        return x, y
    rows = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    return x[rows], y[rows]


def make_optimizers(net: Net) -> list[torch.optim.Optimizer]:
    """Per-submodule optimizers: AdamW with weight decay on the body, SGD with momentum on
    the rest (both leave parameters without a gradient alone)."""
    body = torch.optim.AdamW(net.body.parameters(), lr=0.03, weight_decay=0.1)
    rest = [*net.stem.parameters(), *net.aux.parameters(), *net.head.parameters()]
    return [body, torch.optim.SGD(rest, lr=0.05, momentum=0.9)]


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # Mean over the local batch: FSDP averages over ranks, so the gradient is that of the
    # mean over the global batch.
    return nn.functional.mse_loss(out, y)


def _none_grads(named: Iterator[tuple[str, nn.Parameter]]) -> list[str]:
    return sorted(name for name, p in named if p.grad is None)


def reference_run(
    schedule: Sequence[Sequence[Plan]], world_size: int, depth: int = DEPTH
) -> tuple[dict[str, torch.Tensor], list[list[str]]]:
    """One process, no FSDP: what a distributed run over ``world_size`` ranks must match.

    ``schedule`` holds, per optimizer step, the plans of its micro-batches. Returns the
    final parameters and, per step, the names whose gradient was None before the step.
    """
    net = build_model(depth)
    optimizers = make_optimizers(net)
    none_per_step = []
    seed = 0
    for micro in schedule:
        for plan in micro:
            x, y = batch(seed, world_size, None)
            seed += 1
            loss_of(net(x, **plan.kwargs()), y).backward()
        none_per_step.append(_none_grads(net.named_parameters()))
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, none_per_step


# ---------------------------------------------------------------------- backends


@dataclass(frozen=True)
class Options:
    """How a test wraps the model (names rather than enums: they cross process lines)."""

    strategy: str = "FULL_SHARD"
    auto_wrap: bool = True
    use_orig_params: bool = False
    forward_prefetch: bool = False
    backward_prefetch: str | None = "BACKWARD_PRE"
    depth: int = DEPTH
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Backend:
    """What a task needs to know about one FSDP implementation."""

    wrap: Callable[[Net, Options], nn.Module]
    """Wrap a fresh model: the root is an FSDP unit, every body block its own unit."""
    inner: Callable[[nn.Module], Net]
    """The user's model inside the root wrapper."""
    full_state_dict: Callable[[nn.Module], dict[str, torch.Tensor]]
    """Full (unsharded) parameters on every rank, under the unwrapped model's names."""
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext


def _torch_wrap(net: Net, options: Options) -> nn.Module:
    from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    extra = dict(options.extra)
    if isinstance(extra.get("mixed_precision"), tuple):
        # (param dtype, reduce dtype) by name, so that parametrize ids stay readable.
        param, reduce = (getattr(torch, name) for name in extra["mixed_precision"])
        extra["mixed_precision"] = MixedPrecision(param_dtype=param, reduce_dtype=reduce)
    kwargs: dict[str, Any] = {
        "sharding_strategy": ShardingStrategy[options.strategy],
        "device_id": torch.device("cpu"),
        "use_orig_params": options.use_orig_params,
        "forward_prefetch": options.forward_prefetch,
        "backward_prefetch": (
            None
            if options.backward_prefetch is None
            else BackwardPrefetch[options.backward_prefetch]
        ),
        **extra,
    }
    if options.auto_wrap:
        return FSDP(net, auto_wrap_policy=ModuleWrapPolicy({Block}), **kwargs)
    for index, block in enumerate(net.body):
        net.body[index] = FSDP(block, **kwargs)
    return FSDP(net, **kwargs)


def _torch_full_state_dict(root: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    config = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
    with FSDP.state_dict_type(root, StateDictType.FULL_STATE_DICT, config):
        state = root.state_dict()
    return {k: v.detach().clone() for k, v in state.items()}


BACKENDS: dict[str, Backend] = {
    "torch": Backend(
        wrap=_torch_wrap,
        inner=lambda root: root.module,  # type: ignore[arg-type,return-value]
        full_state_dict=_torch_full_state_dict,
    ),
}


def _setup(backend: str, options: Options) -> tuple[Backend, nn.Module, Net]:
    b = BACKENDS[backend]
    root = b.wrap(build_model(options.depth), options)
    return b, root, b.inner(root)


# ------------------------------------------------------------------ equivalence


def train_task(
    backend: str,
    options: Options,
    schedule: Sequence[Sequence[Plan]],
    evaluate: bool = False,
) -> dict[str, Any]:
    """Train with flatview (views, per-submodule optimizers, skip sets, ``no_sync`` for
    all but the last micro-batch of a step) and report what the test compares with
    :func:`reference_run`.

    ``evaluate``: after every optimizer step also run a forward without autograd under a
    skip set, and a forward with autograd that no backward follows; neither may change
    what training computes."""
    b, root, net = _setup(backend, options)
    world_size, rank = dist.get_world_size(), dist.get_rank()
    with b.context():
        fv = flatview.wrap(root)
        optimizers = make_optimizers(net)
        none_per_step = []
        stats = []
        seed = 0
        for micro in schedule:
            for index, plan in enumerate(micro):
                x, y = batch(seed, world_size, rank)
                seed += 1
                last = index == len(micro) - 1
                sync = contextlib.nullcontext() if last else root.no_sync()  # type: ignore[operator]
                with sync, fv.step(skip=skip_names(plan, options.depth)):
                    loss_of(root(x, **plan.kwargs()), y).backward()
            none_per_step.append(_none_grads(fv.named_parameters()))
            stats.append(fv.stats)
            for opt in optimizers:
                opt.step()
                opt.zero_grad()
            if evaluate:
                # The forward without backward leaves views stepped aside until the next
                # forward; the one without autograd brings them back at its end.
                x, _ = batch(-1, world_size, rank)
                root(x)
                with torch.no_grad(), fv.step(skip=skip_names(PLANS[0], options.depth)):
                    root(x, **PLANS[0].kwargs())
        names = [name for name, _ in fv.named_parameters()]
        empty = sorted(name for name, p in fv.named_parameters() if p.numel() == 0)
        module_params = {id(p) for p in net.parameters()}
        full = b.full_state_dict(root)
    return {
        "full": full,
        "none": none_per_step,
        "names": names,
        "empty": empty,
        "stats": stats,
        # Views (or, with use_orig_params=True, torch's own parameters) are what the
        # submodules hold, and nothing else is.
        "module_params_are_views": module_params == {id(p) for p in fv.parameters()},
    }


def uninstall_task(backend: str, options: Options) -> list[str]:
    """What the adapter leaves behind after ``uninstall``: should be nothing."""
    _, root, _ = _setup(backend, options)
    x, y = batch(0, dist.get_world_size(), dist.get_rank())
    fv = flatview.wrap(root)
    with fv.step(skip=["body.1"]):
        loss_of(root(x, skip_blocks=(1,)), y).backward()
    patched = [(owner, name) for owner, name in fv.adapter._patched]  # type: ignore[attr-defined]
    fv.adapter.uninstall()
    left = [f"{type(owner).__name__}.{name}" for owner, name in patched if name in vars(owner)]
    units = [m for m in root.modules() if isinstance(m, type(root))]
    left += [f"comm hook on {type(u).__name__}" for u in units if u._comm_hook is not None]
    hooks = [m for m in root.modules() if m._forward_pre_hooks or m._forward_hooks]
    left += [f"module hooks on {type(m).__name__}" for m in hooks]
    return left


# ------------------------------------------------------------------------ views


def views_task(backend: str, options: Options) -> dict[str, Any]:
    """Facts about the views on this rank, checked by the test."""
    b, root, net = _setup(backend, options)
    world_size, rank = dist.get_world_size(), dist.get_rank()
    with b.context():
        before = {k: v.clone() for k, v in b.full_state_dict(root).items()}
        fv = flatview.wrap(root)
        units: list[Any] = [m for m in root.modules() if _is_unit(m)]
        flats = [unit._handle.flat_param for unit in units]
        facts: dict[str, Any] = {
            "names": [n for n, _ in fv.named_parameters()],
            "module_names": [n for n, _ in net.named_parameters()],
            "root_param_ids": sorted(id(p) for p in root.parameters()),
            "view_ids": sorted(id(p) for p in fv.parameters()),
            "flat_in_parameters": any(id(p) == id(f) for p in root.parameters() for f in flats),
        }
        shapes = {name: p.shape for name, p in build_model(options.depth).named_parameters()}
        kinds: dict[str, str] = {}
        for name, view in fv.named_parameters():
            assert isinstance(view, nn.Parameter) and view.is_leaf, name
            assert _owner_flat(view, flats) is not None, f"{name} aliases no local shard"
            if view.numel() == 0:
                kinds[name] = PieceKind.EMPTY.value
            elif view.shape == shapes[name]:
                kinds[name] = PieceKind.FULL.value
            else:
                assert view.dim() == 1 and view.numel() < shapes[name].numel(), name
                kinds[name] = PieceKind.PARTIAL.value
        facts["kinds"] = kinds
        # An optimizer step on views writes into the local shard; the next forward
        # gathers the new values.
        x, y = batch(0, world_size, rank)
        with fv.step():
            loss_of(root(x), y).backward()
        grad_alias = all(
            v.grad is None
            or v.grad.numel() == 0
            or v.grad.untyped_storage().data_ptr()
            == _owner_flat(v, flats).grad.untyped_storage().data_ptr()
            for v in fv.parameters()
        )
        facts["grad_alias"] = grad_alias
        # FSDP's clip_grad_norm_ adds parameters it does not manage: views must not count.
        squares = torch.stack([v.grad.pow(2).sum() for v in fv.parameters() if v.grad is not None])
        by_views = squares.sum().reshape(1)
        dist.all_reduce(by_views)
        clipped = root.clip_grad_norm_(1e9)  # type: ignore[operator]
        facts["clip_norm"] = (float(clipped), float(by_views.sqrt()))
        with torch.no_grad():
            for view in fv.parameters():
                view.add_(1.0)
        after = b.full_state_dict(root)
        facts["shifted"] = all(torch.allclose(after[k], before[k] + 1.0) for k in before)
        facts["world_size"] = world_size
    return facts


def _is_unit(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return isinstance(module, FSDP) and module._handle is not None


def _owner_flat(view: torch.Tensor, flats: list[Any]) -> Any:
    ptr = view.untyped_storage().data_ptr()
    for flat in flats:
        if flat._local_shard.untyped_storage().data_ptr() == ptr:
            return flat
    return None


# ------------------------------------------------------------------- state dicts


def state_dict_task(backend: str, options: Options, kind: str) -> dict[str, Any]:
    """``state_dict`` (``kind``: FULL_STATE_DICT or SHARDED_STATE_DICT) before and after
    wrapping, a load round trip, and ``summon_full_params`` with views."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    b, root, net = _setup(backend, options)
    world_size, rank = dist.get_world_size(), dist.get_rank()
    state_type = StateDictType[kind]
    with b.context():
        # One step first, so that the sharded gradients exist too.
        x, y = batch(0, world_size, rank)
        loss_of(root(x), y).backward()
        with FSDP.state_dict_type(root, state_type):
            plain = _local_values(root.state_dict())
        fv = flatview.wrap(root)
        view_ids = sorted(id(p) for p in net.parameters())
        with FSDP.state_dict_type(root, state_type):
            wrapped_state = root.state_dict()
            wrapped = _local_values(wrapped_state)
        same_views = sorted(id(p) for p in net.parameters()) == view_ids
        # Load a shifted copy; the views must see the new values.
        with torch.no_grad():
            for value in _local_tensors(wrapped_state):
                value.add_(0.5)
        with FSDP.state_dict_type(root, state_type):
            root.load_state_dict(wrapped_state)
        with FSDP.state_dict_type(root, state_type):
            reloaded = _local_values(root.state_dict())
        # summon_full_params (torch's static method) shows full parameters, then views.
        with FSDP.summon_full_params(root):
            summoned = {n: tuple(p.shape) for n, p in net.named_parameters()}
        after_summon = sorted(id(p) for p in net.parameters()) == view_ids
        with fv.step():
            loss_of(root(x), y).backward()
    return {
        "plain": plain,
        "wrapped": wrapped,
        "reloaded": reloaded,
        "same_views": same_views,
        "summoned": summoned,
        "after_summon": after_summon,
        "view_count": len(view_ids),
    }


def _local_tensors(state: dict[str, Any]) -> Iterator[torch.Tensor]:
    for value in state.values():
        if isinstance(value, torch.Tensor) and hasattr(value, "local_shards"):
            for shard in value.local_shards():
                yield shard.tensor
        elif isinstance(value, torch.Tensor):
            yield value


def _local_values(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in state.items():
        if hasattr(value, "local_shards"):
            out[key] = [s.tensor.detach().clone() for s in value.local_shards()]
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().clone()
        else:
            out[key] = value
    return out


# ------------------------------------------------------------------------ prefetch


def prefetch_task(
    backend: str, options: Options, use_flatview: bool, abandon_first: bool = False
) -> tuple[list[list[str]], list[list[str]]]:
    """Per step of :data:`PLANS`: the body units whose parameters were all-gathered
    although the step skips them (the model does not call skipped blocks), and the units
    whose parameters were already prefetched when their forward began.

    ``abandon_first``: start with a forward (autograd on, every block) that no backward
    follows, as a validation pass without ``no_grad`` would."""
    b, root, _ = _setup(backend, options)
    world_size, rank = dist.get_world_size(), dist.get_rank()
    from flatview.backends.torch_fsdp import clean_name

    units = [(clean_name(n), m._handle.flat_param) for n, m in root.named_modules() if _is_unit(m)]
    gathered: list[str] = []
    original = dist.all_gather

    @functools.wraps(original)
    def counting(tensor_list: Any, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        # FSDP1 on CPU all-gathers the local shard itself (list form).
        gathered.extend(n for n, f in units if tensor.data_ptr() == f._local_shard.data_ptr())
        return original(tensor_list, tensor, *args, **kwargs)

    prefetched_now: list[str] = []

    def note_prefetch(name: str, module: nn.Module, args: Any) -> None:
        if module._handle._prefetched:  # type: ignore[union-attr]
            prefetched_now.append(name)

    wasted = []
    prefetched = []
    with b.context():
        fv = flatview.wrap(root) if use_flatview else None
        for name, module in root.named_modules():
            if _is_unit(module):
                # Registered after flatview's hooks, so it runs right before FSDP unshards.
                module.register_forward_pre_hook(functools.partial(note_prefetch, clean_name(name)))
        if abandon_first:
            root(batch(-1, world_size, rank)[0])
        dist.all_gather = counting
        try:
            for step, plan in enumerate(PLANS):
                gathered.clear()
                prefetched_now.clear()
                x, y = batch(step, world_size, rank)
                step_ctx = (
                    fv.step(skip=skip_names(plan)) if fv is not None else contextlib.nullcontext()
                )
                with step_ctx:
                    loss_of(root(x, **plan.kwargs()), y).backward()
                skipped = {f"body.{i}" for i in plan.skip_blocks}
                wasted.append(sorted(set(gathered) & skipped))
                prefetched.append(sorted(prefetched_now))
        finally:
            dist.all_gather = original
    return wasted, prefetched


# -------------------------------------------------------------------------- errors


def undeclared_task(backend: str, options: Options) -> None:
    """The model leaves block 1 out, the skip set does not say so."""
    _, root, _ = _setup(backend, options)
    x, y = batch(0, dist.get_world_size(), dist.get_rank())
    fv = flatview.wrap(root)
    with fv.step(skip=["aux"]):
        loss_of(root(x, skip_blocks=(1,), gated=(0, 1, 2, 3)), y).backward()


def call_skipped_unit_task(backend: str, options: Options) -> None:
    """Block 1 is declared skipped, the model calls it anyway."""
    _, root, _ = _setup(backend, options)
    x, y = batch(0, dist.get_world_size(), dist.get_rank())
    fv = flatview.wrap(root)
    with fv.step(skip=["body.1", "aux"]):
        loss_of(root(x, gated=(0, 1, 2, 3)), y).backward()


def use_skipped_param_task(backend: str, options: Options, name: str) -> None:
    """Parameter ``name`` is declared skipped, the model uses it (all gates and aux run)."""
    _, root, _ = _setup(backend, options)
    x, y = batch(0, dist.get_world_size(), dist.get_rank())
    fv = flatview.wrap(root)
    with fv.step(skip=[name]):
        loss_of(root(x, gated=(0, 1, 2, 3), aux=True), y).backward()


def wrap_error_task(backend: str, options: Options, case: str) -> str:
    """Try to wrap something flatview must refuse; return the error message."""
    net = build_model(options.depth)
    if case == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in net.body:
            fully_shard(block)
        target: Any = fully_shard(net)
    elif case == "nested":
        root = BACKENDS[backend].wrap(net, options)
        root(batch(0, dist.get_world_size(), dist.get_rank())[0])
        target = BACKENDS[backend].inner(root).body[0]
    elif case == "version":
        root = BACKENDS[backend].wrap(net, options)
        import flatview.backends.torch_fsdp as torch_fsdp

        tested = torch_fsdp.TESTED_TORCH
        torch_fsdp.TESTED_TORCH = ((1, 0),)
        try:
            flatview.wrap(root)
        except FlatViewError as err:
            return str(err)
        finally:
            torch_fsdp.TESTED_TORCH = tested
        raise AssertionError("no error")
    elif case == "comm_hook":
        root = BACKENDS[backend].wrap(net, options)

        def hook(state: Any, grad: torch.Tensor, output: torch.Tensor | None = None) -> None:
            raise AssertionError("not called")

        root.register_comm_hook(None, hook)  # type: ignore[operator]
        target = root
    elif case == "plain":
        target = net
    else:
        target = BACKENDS[backend].wrap(net, replace(options, strategy=case))
    try:
        flatview.wrap(target)
    except FlatViewError as err:
        return str(err)
    raise AssertionError(f"flatview.wrap accepted case {case!r}")


# ---------------------------------------------------------- shared scenarios


def scenario_task(scenario: Any, strategy: str) -> dict[str, Any] | None:
    """``tests.scenarios.run_distributed`` with torch FSDP1 (``strategy``) as the wrapper:
    the shared scenarios (varied shapes, ties, freezing, zeroing) checked on this backend."""
    from tests import scenarios as sc

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _torch_wrap_scenario(sc.make_net(scenario), scenario.nested, strategy)
    fv = flatview.wrap(model, check_skip_agreement=scenario.check)
    sc.freeze(fv.named_parameters(), scenario)
    optimizers = sc.optimizers(sc._original_tree(model))
    for step, skip in enumerate(scenario.skips):
        x, y = sc.batch(scenario, step)
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        with fv.step(skip=[f"body.{i}" for i in skip]):
            nn.functional.cross_entropy(model(xs, skip), ys).backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=scenario.set_to_none)
    return sc.full_state(model, scenario)


def _torch_wrap_scenario(net: nn.Module, nested: bool, strategy: str) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    kwargs: dict[str, Any] = {
        "sharding_strategy": ShardingStrategy[strategy],
        "device_id": torch.device("cpu"),
    }
    if nested:
        body = net.body
        assert isinstance(body, nn.Sequential)
        for index in range(len(body)):
            body[index] = FSDP(body[index], **kwargs)
    return FSDP(net, **kwargs)


# --------------------------------------------------------------- plain wrapper

FULL_PLAN = Plan(skip_blocks=(), gated=tuple(range(DEPTH)), aux=True)


def plain_task(backend: str, options: Options, steps: int) -> dict[str, torch.Tensor]:
    """Train ``steps`` steps of :data:`FULL_PLAN` with plain FSDP and no flatview,
    optimizers over the flat parameters (the same optimizer for the same elements as
    :func:`make_optimizers`): what flatview with nothing skipped must reproduce."""
    b, root, net = _setup(backend, options)
    world_size, rank = dist.get_world_size(), dist.get_rank()
    with b.context():
        body = [p for p in net.body.parameters()]
        body_ids = {id(p) for p in body}
        rest = [p for p in root.parameters() if id(p) not in body_ids]
        optimizers = [
            torch.optim.AdamW(body, lr=0.03, weight_decay=0.1),
            torch.optim.SGD(rest, lr=0.05, momentum=0.9),
        ]
        for step in range(steps):
            x, y = batch(step, world_size, rank)
            loss_of(root(x, **FULL_PLAN.kwargs()), y).backward()
            for opt in optimizers:
                opt.step()
                opt.zero_grad()
        return b.full_state_dict(root)
