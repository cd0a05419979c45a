"""Models, backends, training runs and the reference every equivalence test compares with.

A :class:`Scenario` is a picklable description of one training run: model shapes,
wrapper (fairscale FSDP, or torch FSDP1 with a sharding strategy) and its options,
world size, optimizers and the skip set of every micro-batch. The same scenario is run
twice: distributed, with FSDP and flatview, in the worker pool (:func:`run_distributed`),
and as the reference, in one process without any wrapper (:func:`run_reference`), where
whatever a step skips simply does not run. Both return an :class:`Outcome`;
:func:`assert_equivalent` compares them. Their training loops,
:func:`distributed_training` and :func:`reference_training`, pause at every optimizer
step for workers that look at more than the outcome (norms, optimizer state).

The model has three kinds of optional parts, so a skip set can cover a whole FSDP unit
(``body.1`` when blocks are nested), parameters inside a unit (a block's ``gate``, or a
block of an unnested model) and parameters of the root unit (``aux``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

if TYPE_CHECKING:
    from flatview import FlatView
    from tests.conftest import PoolFactory

Test = TypeVar("Test", bound=Callable[..., None])

# ---------------------------------------------------------------------- backends

TORCH_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")


@dataclass(frozen=True)
class BackendConfig:
    """One wrapper (fairscale FSDP, torch FSDP1, FSDP2 ``fully_shard``, DDP), and for
    torch FSDP1 its sharding strategy (for FSDP2: ``"FULL_SHARD"``, or ``"HSDP"`` on a 2-D
    mesh of shard groups of :data:`HYBRID_SHARD_SIZE` ranks)."""

    backend: str
    strategy: str = "FULL_SHARD"
    """torch's ``ShardingStrategy`` name (FSDP2: ``"FULL_SHARD"`` or ``"HSDP"``);
    fairscale and DDP ignore it."""
    runtime: bool = False
    """torch: keep torch's unit runtime (``flatview.wrap(compute_on_views=False)``).
    Otherwise a model whose units all replicate (``NO_SHARD``, or any strategy on one
    rank) computes on flatview's views."""

    def __str__(self) -> str:
        if self.backend == "fsdp2":
            return "fsdp2-hsdp" if self.strategy == "HSDP" else "fsdp2"
        if self.backend in ("fairscale", "ddp"):
            return self.backend
        name = f"torch-{self.strategy.lower().strip('_').replace('_', '-')}"
        return f"{name}-runtime" if self.runtime else name

    @property
    def flattens(self) -> bool:
        """Whether the wrapper packs parameters into flat parameters (fairscale, torch
        FSDP1), so that flatview makes views; DDP and FSDP2 keep the originals."""
        return self.backend in ("fairscale", "torch")

    @property
    def sharded_originals(self) -> bool:
        """Whether the wrapper shards the original parameters themselves (FSDP2: each a
        ``DTensor`` whose local tensor flatview works on, no views)."""
        return self.backend == "fsdp2"

    @property
    def hybrid(self) -> bool:
        """Whether parameters are sharded within shard groups and replicated across them
        (torch FSDP1 ``HYBRID_SHARD`` / ``_HYBRID_SHARD_ZERO2``, FSDP2 HSDP)."""
        return self.strategy in HYBRID_STRATEGIES or (
            self.backend == "fsdp2" and self.strategy == "HSDP"
        )

    @property
    def world_sizes(self) -> tuple[int, ...]:
        """The world sizes the configuration runs on: hybrid layouts only on
        :data:`HYBRID_WORLD_SIZE` ranks (2 x 2)."""
        return (HYBRID_WORLD_SIZE,) if self.hybrid else (1, 2, 3, 4)

    @property
    def replicated(self) -> bool:
        """Whether every rank holds every parameter (torch ``NO_SHARD``, DDP)."""
        return self.backend == "ddp" or (self.backend == "torch" and self.strategy == "NO_SHARD")

    @property
    def on_views(self) -> bool:
        """Whether flatview all-reduces the gradients itself, DDP-style (DDP, and torch
        ``NO_SHARD`` computed on views): what the wrapper's runtime did is not done."""
        return self.backend == "ddp" or (self.replicated and not self.runtime)

    def ranks(self, world_size: int) -> int:
        """The world size a test asking for ``world_size`` ranks runs this configuration
        on: hybrid layouts on :data:`HYBRID_WORLD_SIZE` (as :meth:`scenario` makes them)."""
        return HYBRID_WORLD_SIZE if self.hybrid else world_size

    def scenario(self, base: Scenario | None = None, **fields: Any) -> Scenario:
        """``base`` (or a default :class:`Scenario`) on this backend, with ``fields`` changed.
        A hybrid configuration runs on :data:`HYBRID_WORLD_SIZE` ranks whatever world size
        the test names (its layout needs that many)."""
        if self.runtime:
            options = fields.get("options", base.options if base is not None else {})
            fields["options"] = {**options, "compute_on_views": False}
        if self.hybrid:
            fields["world_size"] = HYBRID_WORLD_SIZE
        return replace(base or Scenario(), backend=self.backend, strategy=self.strategy, **fields)


HYBRID_STRATEGIES = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
HYBRID_SHARD_SIZE = 2
HYBRID_WORLD_SIZE = 4
"""Hybrid layouts run as 2 x 2: shard groups of :data:`HYBRID_SHARD_SIZE`, 2 replicas."""

FAIRSCALE = BackendConfig("fairscale")
DDP = BackendConfig("ddp")
TORCH_NO_SHARD = BackendConfig("torch", "NO_SHARD")
TORCH_NO_SHARD_RUNTIME = BackendConfig("torch", "NO_SHARD", runtime=True)
FSDP2 = BackendConfig("fsdp2")
FSDP2_HSDP = BackendConfig("fsdp2", "HSDP")
HYBRID_CONFIGS: tuple[BackendConfig, ...] = tuple(
    BackendConfig("torch", strategy) for strategy in HYBRID_STRATEGIES
)
"""torch FSDP1 hybrid sharding, on a grid of shard groups of :data:`HYBRID_SHARD_SIZE`
ranks (the option ``hybrid``, see :func:`hybrid_groups`; ``"mesh"`` by default)."""

QUICK_CONFIGS: tuple[BackendConfig, ...] = (
    FAIRSCALE,
    *(BackendConfig("torch", strategy) for strategy in TORCH_STRATEGIES),
    TORCH_NO_SHARD_RUNTIME,
    DDP,
)
"""The configurations every parametrized suite runs in the CI profile."""
THOROUGH_CONFIGS: tuple[BackendConfig, ...] = (FSDP2, FSDP2_HSDP, *HYBRID_CONFIGS)
"""FSDP2 (per block and one unit, as drawn or as the test says), FSDP2 HSDP and torch
FSDP1 hybrid sharding: in every parametrized suite, but (to keep CI under its time) only
in the thorough profile, except where a suite asks for them in CI (``slow=False``)."""
BACKEND_CONFIGS: tuple[BackendConfig, ...] = (*QUICK_CONFIGS, *THOROUGH_CONFIGS)
SAMPLED_IN_CI: tuple[BackendConfig, ...] = (
    BackendConfig("torch", "SHARD_GRAD_OP"),
    TORCH_NO_SHARD,
    TORCH_NO_SHARD_RUNTIME,
)
"""Quick configurations that are close variants of another (``SHARD_GRAD_OP`` is
``FULL_SHARD`` kept unsharded from forward to backward; ``NO_SHARD`` replicates and
all-reduces as DDP does, on torch FSDP1's hooks, which ``FULL_SHARD`` runs; ``NO_SHARD``
on torch's runtime is the opt-out ``compute_on_views=False`` of ``NO_SHARD`` computed on
views): in the CI profile only where a suite asks for them (``ci=True``) or draws them,
in every suite in the thorough profile (to keep CI under its time)."""


def torch_backend_tested() -> bool:
    """Whether flatview's torch backend accepts this torch (it refuses untested versions)."""
    from flatview.backends import torch_versions

    return torch_versions.torch_version() in torch_versions.TESTED_TORCH


def only_on_tested_torch(backend: str) -> pytest.MarkDecorator:
    """A module's ``pytestmark`` for flatview's torch-based ``backend`` (``"torch"``,
    ``"FSDP2"``): skipped on a torch it was not tested with (it refuses those)."""
    from flatview.backends import torch_versions

    return pytest.mark.skipif(
        not torch_backend_tested(),
        reason=f"flatview's {backend} backend is tested with torch {torch_versions.TESTED_TORCH}",
    )


THOROUGH = False
"""Whether this session runs the thorough profile's tests (set by tests/conftest.py)."""


def available_configs() -> tuple[BackendConfig, ...]:
    """The configurations this environment can run, for draws over configurations:
    those of :data:`THOROUGH_CONFIGS` only when the thorough tests run."""
    configs = BACKEND_CONFIGS if THOROUGH else QUICK_CONFIGS
    return tuple(
        c for c in configs if c.backend not in ("torch", "fsdp2") or torch_backend_tested()
    )


_SKIP_TORCH = pytest.mark.skipif(
    not torch_backend_tested(), reason="flatview's torch backend refuses this torch version"
)


def backend_param(
    config: BackendConfig,
    *values: Any,
    slow: bool = False,
    ci: bool = False,
    marks: Sequence[Any] = (),
) -> Any:
    """A ``pytest.param`` of ``config`` (and ``values``), skipped where it cannot run.
    ``slow``: thorough profile only, as is every one of :data:`THOROUGH_CONFIGS` and
    :data:`SAMPLED_IN_CI` unless ``ci``."""
    marks = [*marks, _SKIP_TORCH] if config.backend in ("torch", "fsdp2") else [*marks]
    if (config in THOROUGH_CONFIGS or config in SAMPLED_IN_CI) and not ci:
        slow = True
    if slow:
        marks.append(pytest.mark.slow)
    ident = "-".join([str(config), *(str(v) for v in values)])
    return pytest.param(config, *values, marks=marks, id=ident)


BACKENDS = [backend_param(config) for config in BACKEND_CONFIGS]
"""Every configuration once: ``@pytest.mark.parametrize("backend", BACKENDS)`` (those of
:data:`THOROUGH_CONFIGS` in the thorough profile only)."""

FLAT_CONFIGS = tuple(c for c in BACKEND_CONFIGS if c.flattens)
FLAT_BACKENDS = [backend_param(config) for config in FLAT_CONFIGS]
"""Every configuration that flattens parameters (FSDP: all but DDP) once."""


def spread(world_sizes: Sequence[int], quick: Sequence[int]) -> Any:
    """``(backend, world_size)`` params for every configuration and world size it runs on
    (hybrid layouts: 4 only), of which only ``quick[i]`` runs for configuration ``i``
    outside the thorough profile (none for configurations past the end of ``quick``)."""
    return [
        backend_param(
            config, ws, slow=i >= len(quick) or ws != quick[i], ci=config in SAMPLED_IN_CI
        )
        for i, config in enumerate(BACKEND_CONFIGS)
        for ws in world_sizes
        if ws in config.world_sizes
    ]


def draws_per_backend(share: int, quick: Collection[BackendConfig] = ()) -> Callable[[Test], Test]:
    """Run a hypothesis test (arguments ``backend`` and ``data``) as one example set per
    backend configuration, each with ``1/share`` of the profile's examples (at least 2):
    drawn configurations would cluster (hypothesis starts from the simplest draws),
    parametrized ones are each covered at a fixed total cost. Of
    :data:`THOROUGH_CONFIGS` and :data:`SAMPLED_IN_CI`, those in ``quick`` also run in
    the CI profile."""

    def mark(test: Test) -> Test:
        test = given(data=st.data())(test)
        test = settings(max_examples=max(2, settings().max_examples // share))(test)
        params = [backend_param(c, ci=c in quick) for c in BACKEND_CONFIGS]
        return pytest.mark.parametrize("backend", params)(test)

    return mark


# Per backend, the wrapper options that change how it gathers, reduces or keeps
# parameters. torch's sharding strategies are the backend configurations themselves.
WRAPPER_OPTIONS: dict[str, dict[str, dict[str, Any]]] = {
    "fairscale": {
        "no-reshard": {"reshard_after_forward": False},
        "unflattened": {"flatten_parameters": False},
        "unbucketed": {"bucket_cap_mb": 0},
    },
    "torch": {
        "use-orig-params": {"use_orig_params": True},
        "auto-wrap": {"auto_wrap": True},
        "prefetch": {"forward_prefetch": True, "backward_prefetch": "BACKWARD_POST"},
        "no-backward-prefetch": {"backward_prefetch": None},
    },
    "fsdp2": {
        "no-reshard": {"reshard_after_forward": False},
        "prefetch": {"prefetch": True},
        "no-reshard-prefetch": {"reshard_after_forward": False, "prefetch": True},
        # FSDP2's own unused-parameter handling (zeros reduced for parameters without a
        # gradient): what flatview's skip sets leave out must still get no gradient.
        "reduce-unused": {"reduce_scatter_unused_params": True},
    },
    "ddp": {
        # DDP's own unused-parameter search, left on by users: flatview reduces anyway.
        "find-unused": {"find_unused_parameters": True},
        "bucket-view": {"gradient_as_bucket_view": True},
        # About 100 elements per bucket: flatview's buckets flush many times per step.
        "small-buckets": {"bucket_cap_mb": 0.0004},
        "no-buffer-broadcast": {"broadcast_buffers": False},
        # flatview's own option (not DDP's): buckets start during the backward.
        "overlap": {"overlap": True, "bucket_cap_mb": 0.0004},
    },
}


def wrapper_options(
    names: Collection[str] | None = None,
) -> Iterator[tuple[int, BackendConfig, int, str]]:
    """Every configuration with each of its backend's :data:`WRAPPER_OPTIONS` (only those
    in ``names``), in name order: ``(index of the configuration, configuration, index of
    the option among its backend's, option name)``."""
    for index, config in enumerate(BACKEND_CONFIGS):
        options = WRAPPER_OPTIONS[config.backend]
        chosen = sorted(o for o in options if names is None or o in names)
        for number, option in enumerate(chosen):
            yield index, config, number, option


# ------------------------------------------------------------------------- model


class Block(nn.Module):
    """A residual block whose inner width differs from the model width, so parameter
    sizes vary and pieces straddle shard boundaries; the gate is optional per step."""

    def __init__(self, width: int, inner: int, norm: bool, gate: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width) if norm else None
        self.up = nn.Linear(width, inner)
        self.down = nn.Linear(inner, width, bias=False)
        self.gain = nn.Parameter(torch.ones(1))
        self.gate = nn.Linear(width, width) if gate else None
        self.recompute: bool | None = None
        """Activation checkpointing inside the block (reentrant or not); None: off."""

    def forward(self, x: torch.Tensor, gated: bool = True) -> torch.Tensor:
        if self.recompute is not None:
            from torch.utils.checkpoint import checkpoint

            out: torch.Tensor = checkpoint(self._forward, x, gated, use_reentrant=self.recompute)
            return out
        return self._forward(x, gated)

    def _forward(self, x: torch.Tensor, gated: bool) -> torch.Tensor:
        h = self.norm(x) if self.norm is not None else x
        out = self.gain * self.down(torch.tanh(self.up(h)))
        if self.gate is not None and gated:
            out = out * torch.sigmoid(self.gate(h))
        return x + out


class Net(nn.Module):
    def __init__(self, scenario: Scenario) -> None:
        super().__init__()
        s = scenario
        gates = s.gates or (False,) * len(s.inner)
        self.stem = nn.Linear(s.in_dim, s.width)
        self.body = nn.Sequential(
            *[
                Block(s.width, inner, norm, gate)
                for inner, norm, gate in zip(s.inner, s.norms, gates, strict=True)
            ]
        )
        self.aux = nn.Linear(s.width, s.width) if s.aux else None
        self.head = nn.Linear(s.width, s.classes)
        self._autocast = s.autocast
        self._calls = s.first_block_calls
        if s.compiled:
            # A fresh start per model: dynamo's cache of recompilations per code object is
            # bounded (past it, it runs eager without a word).
            torch._dynamo.reset()
            for block in self.body:
                block.compile(backend="aot_eager")
        place, _, kind = s.recompute.partition("-")
        self._recompute: bool | None = None
        if kind == "fairscale":
            pass  # fairscale's checkpoint_wrapper, put on by wrap_fsdp
        elif place == "inside":
            for block in self.body:
                block.recompute = kind == "reentrant"
        elif place == "around":
            self._recompute = kind == "reentrant"
        if s.tie:
            # A tied pair inside the root unit: an extra module sharing the head's weight.
            self.head_copy = nn.Linear(s.width, s.classes)
            self.head_copy.weight = self.head.weight

    def forward(self, x: torch.Tensor, skip: Collection[str] = ()) -> torch.Tensor:
        if self._autocast:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self._forward(x, skip).float()
        return self._forward(x, skip)

    def _forward(self, x: torch.Tensor, skip: Collection[str]) -> torch.Tensor:
        x = self.stem(x)
        for index, block in enumerate(self.body):
            if f"body.{index}" not in skip:
                gated = f"body.{index}.gate" not in skip
                for _ in range(self._calls if index == 0 else 1):
                    if self._recompute is None:
                        x = block(x, gated)
                    else:
                        from torch.utils.checkpoint import checkpoint

                        x = checkpoint(block, x, gated, use_reentrant=self._recompute)
        if self.aux is not None and "aux" not in skip:
            x = x + torch.tanh(self.aux(x))
        out: torch.Tensor = self.head(x)
        if hasattr(self, "head_copy"):
            out = out + 0.5 * self.head_copy(x)
        return out


@dataclass(frozen=True)
class Scenario:
    world_size: int = 2
    in_dim: int = 3
    width: int = 4
    inner: tuple[int, ...] = (5, 3)
    norms: tuple[bool, ...] = (True, False)
    gates: tuple[bool, ...] = ()
    """Per block, whether it has a ``gate`` layer (empty: none has)."""
    aux: bool = False
    classes: int = 3
    nested: bool = True
    """Each block its own FSDP unit; otherwise the root unit holds everything."""
    tie: bool = False
    recompute: str = ""
    """Activation checkpointing of every block: ``"inside-..."`` within the block's forward
    (inside its FSDP unit when nested), ``"around-..."`` around the call of the block (the
    unit's whole forward runs again in the backward), each ``"...-reentrant"`` or
    ``"...-plain"`` (``use_reentrant=False``), or on fairscale ``"...-fairscale"``: its
    ``checkpoint_wrapper`` inside or around each block's unit; ``"inside-wrapper"``:
    torch's ``apply_activation_checkpointing`` on the blocks after wrapping (the
    reference runs without the wrappers); empty: off."""
    first_block_calls: int = 1
    """How often the forward applies ``body.0`` in a row (weight sharing: its unit runs
    that many times per forward)."""
    autocast: bool = False
    """The forward under ``torch.autocast`` (CPU, bfloat16), the output cast back."""
    compiled: bool = False
    """Each block compiled in place (``block.compile()``, as torchtitan compiles each
    transformer block; dynamo's ``aot_eager`` backend: traced, without generated code)."""
    skips: tuple[tuple[int | str, ...], ...] = ((), (1,), (0,))
    """Per micro-batch, what it leaves out: ``i`` for ``body.i``, or one of the names
    ``body.i``, ``body.i.gate`` and ``aux``."""
    accumulate: int = 1
    """Micro-batches per optimizer step; all but the last run under ``no_sync()``."""
    set_to_none: bool = True
    zero_grad_at: str = "after_step"
    """Where the optimizers zero their gradients: ``"after_step"`` (right after each
    optimizer step), ``"before_forward"`` (before each step's first forward) or
    ``"between"`` (between the first forward of each step and its backward)."""
    unwrap_after: int | None = None
    """After this optimizer step (counting from 0), ``fv.unwrap()``; training goes on as
    bare FSDP with one fresh optimizer over ``model.parameters()`` (the reference: a
    fresh one over the plain net's), and later micro-batches must skip nothing."""
    batch_per_rank: int = 3
    seed: int = 0
    backend: str = "fairscale"
    strategy: str = "FULL_SHARD"
    """torch's sharding strategy; ignored for fairscale."""
    check: bool = True
    """Check with every step that all ranks pass the same skip set."""
    declare: bool = True
    """Run each backward inside ``fv.step(skip=...)``; False runs it outside any step,
    as bare FSDP (only for scenarios that skip nothing)."""
    evaluate: bool = False
    """After every optimizer step, a forward whose graph no backward consumes (a
    validation loss computed with autograd on), then ``zero_grad``, then a forward under
    ``no_grad`` inside a step: neither may change what training computes."""
    evaluate_before_step: bool = False
    """With :attr:`evaluate`, the evaluation passes run between the backward passes and the
    optimizer step instead (``zero_grad`` after the step, where the scenario puts it):
    bare FSDP's next forward then reuses the root's unsharded parameters from before the
    step (:mod:`flatview.leftovers`)."""
    inference: bool = False
    """With :attr:`evaluate`, the forward without autograd runs under
    ``torch.inference_mode()`` instead of ``no_grad`` (Lightning's validation loop on
    DDP, many hand-written evaluation loops): tensors it makes can never join a graph."""
    frozen: tuple[str, ...] = ()
    """Name prefixes of parameters frozen (``requires_grad_(False)``) before training."""
    mask_gather_min_saved: int = 0
    """fairscale: ``ReduceOptions.mask_gather_min_saved``. The suite's models are tiny:
    with the library's default (``MASK_GATHER_MIN_SAVED``) every partly skipped unit
    would be gathered whole and the masked gather go untested, so 0 unless a test asks
    for the default."""
    options: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    """Wrapper options, passed to the FSDP constructor; for torch by name (see
    :func:`_torch_kwargs`), plus ``auto_wrap`` (nest blocks with a wrap policy)."""

    @property
    def config(self) -> BackendConfig:
        runtime = self.options.get("compute_on_views") is False
        return BackendConfig(self.backend, self.strategy, runtime=runtime)

    @property
    def flatview_options(self) -> dict[str, Any]:
        """The options of ``flatview.wrap`` the scenario's ``options`` hold."""
        keys = {"overlap": "overlap_reduction", "compute_on_views": "compute_on_views"}
        chosen = {keys[k]: v for k, v in self.options.items() if k in keys}
        reduce: dict[str, Any] = {}
        if "bucket_all_used" in self.options:
            reduce["bucket_all_used"] = self.options["bucket_all_used"]
        if self.backend == "fairscale":
            reduce["mask_gather_min_saved"] = self.mask_gather_min_saved
        if reduce:
            import flatview

            chosen["reduce_options"] = flatview.ReduceOptions(**reduce)
        return chosen


# Four blocks with gates, and an aux layer: across these steps every kind of skip
# occurs (whole units, parameters inside a unit, root-unit parameters), the first
# step skips something, and every block is skipped in some step and used in another.
GATED = Scenario(
    width=5,
    inner=(6, 4, 5, 3),
    norms=(True, False, True, False),
    gates=(True, True, True, True),
    aux=True,
    skips=(
        (1, "body.2.gate", "body.3.gate", "aux"),
        (),
        (0, 3, "body.1.gate", "aux"),
        (2, "body.0.gate", "body.1.gate", "body.3.gate"),
        (1, 2, "body.0.gate", "aux"),
    ),
)


def as_names(skip: Sequence[int | str]) -> tuple[str, ...]:
    """A skip set as names (``i`` stands for ``body.i``)."""
    return tuple(f"body.{s}" if isinstance(s, int) else s for s in skip)


def skip_names(scenario: Scenario, micro: int) -> tuple[str, ...]:
    """The skip set of micro-batch ``micro``, as names."""
    return as_names(scenario.skips[micro])


def optimizer_steps(scenario: Scenario) -> list[range]:
    """The micro-batches of each optimizer step."""
    n, k = len(scenario.skips), scenario.accumulate
    assert n % k == 0, f"{n} micro-batches do not split into steps of {k}"
    return [range(i, i + k) for i in range(0, n, k)]


ZERO_GRAD_PLACES = ("after_step", "before_forward", "between")
"""Where :attr:`Scenario.zero_grad_at` may zero gradients."""


@st.composite
def scenarios(
    draw: st.DrawFn,
    world_sizes: Sequence[int] = (2, 3, 4, 1),
    configs: Sequence[BackendConfig] | None = None,
    unwrap: bool = False,
) -> Scenario:
    """Random scenarios on a random backend configuration.
    The first world size is the one hypothesis starts from and shrinks towards: one rank
    would shard nothing. ``unwrap``: also draw :attr:`Scenario.unwrap_after` (for
    workers that look at nothing but the outcome: after unwrap there is no FlatView to
    ask)."""
    config = draw(st.sampled_from(configs or available_configs()))
    # Hybrid layouts run on their own world size only.
    world_sizes = [w for w in world_sizes if w in config.world_sizes] or config.world_sizes
    blocks = draw(st.integers(1, 4))
    width = draw(st.integers(1, 6))
    # A LayerNorm over one feature normalises every input to zero: its weight's gradient
    # is rounding noise (~1e-7) whose value depends on how the batch is split, and AdamW
    # scales noise up to full-size steps, so no two runs agree on any backend. Over two
    # features it gives +-(1, -1) up to its eps: its input gradient is an eps-sized
    # remainder of cancelling terms, which amplifies the rounding of the batch split
    # ~100-1000x (one process summing the batch in 3 chunks instead of 1 moves the
    # parameters 2e-6, 3e-8 at width 3; a thorough draw missed 1e-5 by 2x on every
    # backend, and agreed in float64). Over three it still can: a thorough draw (FSDP2
    # HSDP on 4 ranks, three norms over 3 features, AdamW, nothing skipped) ended 6.7e-5
    # off the reference, bare FSDP2 alike to the bit, and 3e-8 without the norms. Such
    # draws compare nothing; they are not generated.
    norms = tuple(width > 3 and draw(st.booleans()) for _ in range(blocks))
    gates = tuple(draw(st.booleans()) for _ in range(blocks))
    aux = draw(st.booleans())
    optional = [f"body.{i}" for i in range(blocks)]
    optional += [f"body.{i}.gate" for i in range(blocks) if gates[i]]
    optional += ["aux"] if aux else []
    set_to_none = draw(st.booleans())
    evaluate = draw(st.booleans())
    accumulate = draw(st.sampled_from((1, 1, 2)))
    micro = accumulate * draw(st.integers(2, 3))
    skips = tuple(tuple(sorted(draw(st.sets(st.sampled_from(optional))))) for _ in range(micro))
    options: dict[str, Any] = {}
    frozen: tuple[str, ...] = ()
    if config.backend == "torch" and draw(st.booleans()):
        options["use_orig_params"] = True
    elif draw(st.booleans()):
        # With use_orig_params the parameters are torch's, not flatview's to freeze.
        names = ("stem.weight", "head.bias", "body.0.up", f"body.{blocks - 1}.down.weight")
        frozen = tuple(sorted(draw(st.sets(st.sampled_from(names), min_size=1, max_size=2))))
    if config.backend == "fairscale" and draw(st.booleans()):
        options["reshard_after_forward"] = False
    world: int | None = None
    if config.backend == "fsdp2" and draw(st.booleans()):
        # Kept unsharded after the forward, or resharded to groups of 2 (on 4 shards),
        # and explicit prefetching of neighbouring blocks.
        world = draw(st.sampled_from(world_sizes))
        shards = HYBRID_SHARD_SIZE if config.hybrid else world
        options["reshard_after_forward"] = draw(
            st.sampled_from((False, 2) if shards == 4 else (False,))
        )
        options["prefetch"] = draw(st.booleans())
    if config.backend == "fsdp2" and not config.hybrid and draw(st.booleans()):
        # Small reduce-scatters held and run as one (the default on 2 shards) or not.
        options["bucket_all_used"] = draw(st.sampled_from((True, False)))
    if config.strategy in HYBRID_STRATEGIES:
        options["hybrid"] = draw(st.sampled_from(("mesh", "tuple")))
    if config.backend == "ddp" and draw(st.booleans()):
        # Buckets started during the backward (off by default on CPU), of a few
        # parameters each or of the whole model.
        options.update(overlap=True, bucket_cap_mb=draw(st.sampled_from((1e-5, 4e-4, 25.0))))
    if config.on_views and config.backend == "torch" and not options and draw(st.booleans()):
        # Computed on views (not with use_orig_params), reduced as for DDP: buckets
        # started during the backward.
        options["overlap"] = True
    zero_grad_at = draw(st.sampled_from(ZERO_GRAD_PLACES))
    unwrap_after = None
    # Bare FSDP cannot skip or freeze parts of a flat parameter: unwrapping is drawn
    # only where it would train the same afterwards.
    # With use_orig_params, torch zeroes (in a no_sync() window, until a synchronising
    # backward) what accumulates for a parameter whose .grad is None while others of its
    # flat parameter have one: after a step that skipped it, bare torch training does
    # that too (docs/limitations.md).
    orig_window = bool(options.get("use_orig_params")) and accumulate > 1
    # Bare FSDP2 (torch 2.13) trains otherwise than the unwrapped model after a forward
    # with autograd on and no backward (the evaluate passes): up to 2e-2 off on 2 and 4
    # ranks without flatview ever wrapping it, while wrapped it trains right.
    plain_fsdp2_evaluates = config.backend == "fsdp2" and evaluate
    if (
        unwrap
        and not frozen
        and not orig_window
        and not plain_fsdp2_evaluates
        and draw(st.integers(0, 3)) == 3
    ):
        steps = micro // accumulate
        unwrap_after = draw(st.integers(0, steps - 2))
        skips = skips[: (unwrap_after + 1) * accumulate] + ((),) * (
            micro - (unwrap_after + 1) * accumulate
        )
    scenario = config.scenario(
        world_size=draw(st.sampled_from(world_sizes)) if world is None else world,
        in_dim=draw(st.integers(1, 5)),
        width=width,
        inner=tuple(draw(st.integers(1, 7)) for _ in range(blocks)),
        norms=norms,
        gates=gates,
        aux=aux,
        classes=draw(st.integers(2, 4)),
        nested=draw(st.booleans()),
        tie=draw(st.booleans()),
        skips=skips,
        accumulate=accumulate,
        set_to_none=set_to_none,
        zero_grad_at=zero_grad_at,
        unwrap_after=unwrap_after,
        batch_per_rank=draw(st.integers(1, 3)),
        seed=draw(st.integers(0, 2**16)),
        evaluate=evaluate,
        frozen=frozen,
        options=options,
    )
    # Drawn last, so that the draws before it stay what they were.
    scenario = replace(scenario, recompute=draw(st.sampled_from(recomputing(scenario))))
    extra: dict[str, Any] = {}
    if config.backend == "fsdp2" and config.hybrid and accumulate > 1 and draw(st.booleans()):
        # HSDP's other window: reduce-scattered every micro-batch, all-reduced once.
        extra["window"] = "all_reduce"
    if config.backend == "fsdp2" and accumulate > 1 and draw(st.booleans()):
        # Accumulated in a reduce dtype of FSDP2's own; float64, so that the reference
        # tells a wrong sum from rounding.
        extra["mixed_precision"] = ("float32", "float64")
    if extra:
        scenario = replace(scenario, options={**options, **extra})
    scenario = replace(scenario, inference=evaluate and draw(st.booleans()))
    # Not with unwrap: bare FSDP would train on stale parameters after it.
    before = evaluate and unwrap_after is None and draw(st.booleans())
    return replace(scenario, evaluate_before_step=before)


def recomputing(scenario: Scenario) -> tuple[str, ...]:
    """What :func:`scenarios` draws for :attr:`Scenario.recompute`, mostly nothing: what
    the bare wrapper trains with. Bare fairscale refuses non-reentrant checkpointing
    around a unit (the unit is still in ``FORWARD`` in the backward), and bare fairscale
    and torch FSDP1 sharding one unit fail under reentrant checkpointing (the
    recomputation reads freed unsharded parameters): ``tests/test_recompute.py``."""
    modes = ["inside-plain", "around-plain", "inside-reentrant", "around-reentrant"]
    modes.append("inside-wrapper")
    if scenario.backend == "fairscale":
        modes.remove("around-plain")
    one_sharded_unit = scenario.backend == "fairscale" or (
        scenario.backend == "torch" and scenario.strategy != "NO_SHARD"
    )
    if one_sharded_unit and not scenario.nested:
        modes = [m for m in modes if not m.endswith("reentrant")]
    return ("",) * 4 + tuple(modes)


def batch(scenario: Scenario, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one micro-batch: rank ``r`` trains on its ``r``-th chunk."""
    g = torch.Generator().manual_seed(scenario.seed * 1000 + micro)
    n = scenario.batch_per_rank * scenario.world_size
    return torch.randn(n, scenario.in_dim, generator=g), torch.randint(
        0, scenario.classes, (n,), generator=g
    )


def local_batch(scenario: Scenario, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's chunk of :func:`batch`."""
    x, y = batch(scenario, micro)
    world, rank = dist.get_world_size(), dist.get_rank()
    return x.chunk(world)[rank], y.chunk(world)[rank]


def make_net(scenario: Scenario) -> Net:
    torch.manual_seed(scenario.seed)
    return Net(scenario)


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # Mean over the local batch: FSDP averages over ranks, so the gradient is that of
    # the mean over the global batch, as in the reference.
    return nn.functional.cross_entropy(out, y)


def optimizers(net_like: Any) -> list[torch.optim.Optimizer]:
    """Per-submodule optimizers of different kinds, built from ``.parameters()`` of the
    original submodules (views, once wrapped)."""
    body = net_like.body
    # AdamW's eps at 1e-4, not 1e-8: a gradient element that is rounding noise (a
    # thorough draw had 3.5e-8 beside a largest element of 0.017, torch FSDP1
    # _HYBRID_SHARD_ZERO2 on 4 ranks) turns into a step of lr * g / (|g| + eps), and with
    # eps at 1e-8 the noise of the batch split decides it (4.5e-5 apart, against
    # 1e-5). At 1e-4 such elements move by lr * g / eps, and AdamW also sees a gradient
    # scaled wrongly.
    groups = [
        torch.optim.AdamW(body[0::2].parameters(), lr=0.05, weight_decay=0.1, eps=1e-4),
        torch.optim.SGD(net_like.head.parameters(), lr=0.1, momentum=0.9),
        torch.optim.SGD(net_like.stem.parameters(), lr=0.1),
    ]
    if len(body) > 1:
        # AdamW's step barely changes when every gradient is scaled alike, so a
        # reduction that averages wrongly could pass unseen on AdamW's parameters alone.
        groups.append(torch.optim.SGD(body[1::2].parameters(), lr=0.1, momentum=0.5))
    if net_like.aux is not None:
        groups.append(torch.optim.SGD(net_like.aux.parameters(), lr=0.1))
    if hasattr(net_like, "head_copy"):
        own = [p for n, p in net_like.head_copy.named_parameters() if n != "weight"]
        groups.append(torch.optim.SGD(own, lr=0.1))
    return groups


def freeze(named: Iterator[tuple[str, nn.Parameter]], scenario: Scenario) -> None:
    for name, param in named:
        if scenario.frozen and name.startswith(scenario.frozen):
            param.requires_grad_(False)


def _none_grads(named: Iterator[tuple[str, nn.Parameter]]) -> list[str]:
    return sorted(name for name, p in named if p.grad is None)


@dataclass
class Outcome:
    """What one rank saw of a training run."""

    names: list[str]
    """Parameter names in order (``fv.named_parameters()`` or the plain model's)."""
    none_grads: list[list[str]]
    """Per optimizer step, the parameters whose gradient was None before it."""
    params: dict[str, np.ndarray] | None
    """The final full parameters by original name (distributed: rank 0 only)."""
    empty: list[str] = field(default_factory=list)
    """Parameters of which this rank holds no element."""
    views_on_modules: bool = True
    """Whether the submodules held exactly ``fv.parameters()`` after every step."""


def reference_model(scenario: Scenario) -> tuple[Net, list[torch.optim.Optimizer]]:
    """The unwrapped net, frozen as the scenario says, and its per-submodule optimizers."""
    net = make_net(scenario)
    freeze(net.named_parameters(), scenario)
    return net, optimizers(net)


def reference_backward(
    scenario: Scenario,
    net: Net,
    micros: Iterable[int],
    before_backward: Callable[[], None] | None = None,
    loss_scale: float = 1.0,
) -> None:
    """The backward passes of micro-batches ``micros`` in one process, on the whole batch;
    skipped parts do not run. ``before_backward`` runs between the first forward and its
    backward; each loss is multiplied by ``loss_scale`` (DeepSpeed divides by the
    accumulation steps)."""
    for number, micro in enumerate(micros):
        x, y = batch(scenario, micro)
        loss = loss_of(net(x, skip_names(scenario, micro)), y)
        if loss_scale != 1.0:
            loss = loss * loss_scale
        if number == 0 and before_backward is not None:
            before_backward()
        loss.backward()


def zero_grads(scenario: Scenario, opts: Sequence[torch.optim.Optimizer]) -> None:
    for opt in opts:
        opt.zero_grad(set_to_none=scenario.set_to_none)


def plain_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer a bare FSDP user trains with after :attr:`Scenario.unwrap_after`
    (elementwise, so flat and original parameters step alike)."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def reference_training(
    scenario: Scenario,
    net: Net,
    opts: Sequence[torch.optim.Optimizer],
    steps: Sequence[range] | None = None,
    loss_scale: float = 1.0,
) -> Iterator[None]:
    """The training loop of :func:`run_reference` on ``net``, for ``steps`` (by default
    every optimizer step of the scenario). Pauses (yields) once per optimizer step: after
    its backward passes, before ``opts`` step (zeroing their gradients where the
    scenario says)."""
    opts = list(opts)
    at = scenario.zero_grad_at
    for number, micros in enumerate(optimizer_steps(scenario) if steps is None else steps):
        if at == "before_forward":
            zero_grads(scenario, opts)
        between = functools.partial(zero_grads, scenario, opts) if at == "between" else None
        reference_backward(scenario, net, micros, between, loss_scale)
        yield
        for opt in opts:
            opt.step()
        if at == "after_step":
            zero_grads(scenario, opts)
        if number == scenario.unwrap_after:
            opts = [plain_optimizer(net.parameters())]


def run_reference(scenario: Scenario) -> Outcome:
    """The scenario in one process, without any wrapper; skipped parts do not run."""
    net, opts = reference_model(scenario)
    none_grads = []
    for _ in reference_training(scenario, net, opts):
        none_grads.append(_none_grads(net.named_parameters()))
    if scenario.unwrap_after is not None:
        none_grads = none_grads[: scenario.unwrap_after + 1]
    params = {k: v.detach().numpy().copy() for k, v in net.named_parameters()}
    return Outcome([n for n, _ in net.named_parameters()], none_grads, params)


# ---------------------------------------------------------------- distributed side


def flatview_error(call: Callable[[], Any]) -> str:
    """``"ClassName: message"`` of the flatview error ``call`` raises, else
    ``"accepted"`` (what workers send back for tests to match)."""
    import flatview

    try:
        call()
    except flatview.FlatViewError as err:
        return f"{type(err).__name__}: {err}"
    return "accepted"


@contextlib.contextmanager
def backend_context(backend: str) -> Iterator[None]:
    if backend == "fairscale":
        from flatview.testing import fairscale_on_cpu

        with fairscale_on_cpu():
            yield
    else:
        yield


def _torch_kwargs(scenario: Scenario) -> dict[str, Any]:
    """torch FSDP1 constructor arguments; options name enums and dtypes so that they
    pickle and read well in test ids."""
    from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy

    # auto_wrap and hybrid are the tests' own; compute_on_views and overlap are flatview's.
    options = {
        k: v
        for k, v in scenario.options.items()
        if k not in ("auto_wrap", "compute_on_views", "overlap", "hybrid")
    }
    if scenario.strategy in HYBRID_STRATEGIES:
        options.update(hybrid_groups(scenario.options.get("hybrid", "mesh")))
    if "backward_prefetch" in options:
        name = options["backward_prefetch"]
        options["backward_prefetch"] = None if name is None else BackwardPrefetch[name]
    if "mixed_precision" in options:
        # (param dtype, reduce dtype[, keep_low_precision_grads]), None for full precision.
        param, reduce, *keep = options.pop("mixed_precision")
        param, reduce = (None if d is None else getattr(torch, d) for d in (param, reduce))
        options["mixed_precision"] = MixedPrecision(
            param_dtype=param, reduce_dtype=reduce, keep_low_precision_grads=any(keep)
        )
    return {
        "sharding_strategy": ShardingStrategy[scenario.strategy],
        "device_id": torch.device("cpu"),
        **options,
    }


# Per worker process, the hybrid grids made so far: made once (every rank of the world
# takes part), kept for later tasks, so that tasks neither pay for new groups nor pile
# them up. A respawned pool starts without.
_HYBRID_GROUPS: dict[tuple[str, int, int], dict[str, Any]] = {}


_FSDP2_MESHES: dict[tuple[tuple[int, ...], tuple[str, ...]], Any] = {}
"""Per worker process, FSDP2's meshes by shape and dimension names, kept as
:data:`_HYBRID_GROUPS` (an HSDP mesh makes process groups: a thorough run piled up
hundreds per worker, each with its own gloo threads)."""


def hybrid_groups(kind: str, shard_size: int = HYBRID_SHARD_SIZE) -> dict[str, Any]:
    """torch FSDP1's hybrid-sharding argument for a grid of shard groups of ``shard_size``
    consecutive ranks: a 2-D ``device_mesh`` (``kind="mesh"``, dimensions replicate x
    shard) or a ``process_group=(shard group, replica group)`` pair (``kind="tuple"``).
    Collective on first use per worker (every rank must call it)."""
    world = dist.get_world_size()
    key = (kind, shard_size, world)
    if key not in _HYBRID_GROUPS:
        if world % shard_size:
            raise ValueError(f"a shard size of {shard_size} does not divide {world} ranks")
        replicas = world // shard_size
        if kind == "mesh":
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(
                "cpu", (replicas, shard_size), mesh_dim_names=("replicate", "shard")
            )
            _HYBRID_GROUPS[key] = {"device_mesh": mesh}
        elif kind == "tuple":
            rank = dist.get_rank()
            rows = [[r * shard_size + s for s in range(shard_size)] for r in range(replicas)]
            columns = [[r * shard_size + s for r in range(replicas)] for s in range(shard_size)]
            # Every rank creates every group, in the same order.
            made = [(dist.new_group(ranks), ranks) for ranks in rows + columns]
            shard = next(g for g, ranks in made[:replicas] if rank in ranks)
            replica = next(g for g, ranks in made[replicas:] if rank in ranks)
            _HYBRID_GROUPS[key] = {"process_group": (shard, replica)}
        else:
            raise ValueError(f"unknown hybrid grid kind {kind!r}")
    return _HYBRID_GROUPS[key]


def wrap_fsdp(scenario: Scenario, net: Net) -> nn.Module:
    """FSDP-wrap ``net`` as the scenario says (each block its own unit when nested)."""
    if scenario.recompute == "inside-wrapper":
        # torch's apply_activation_checkpointing, as its FSDP tutorial applies it: after
        # wrapping, each block inside its unit becomes CheckpointWrapper(block).
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            apply_activation_checkpointing,
        )

        model = wrap_fsdp(replace(scenario, recompute=""), net)
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
        assert any(type(m).__name__ == "CheckpointWrapper" for m in model.modules())
        return model
    if scenario.backend == "fairscale":
        from fairscale.nn.data_parallel import FullyShardedDataParallel as FairscaleFSDP

        opts = {"flatten_parameters": True, **scenario.options}
        place, _, kind = scenario.recompute.partition("-")
        if kind == "fairscale":
            from fairscale.nn.checkpoint import checkpoint_wrapper
        for i in range(len(net.body)):
            if kind == "fairscale" and place == "inside":
                net.body[i] = checkpoint_wrapper(net.body[i])
            if scenario.nested:
                net.body[i] = FairscaleFSDP(net.body[i], **opts)
            if kind == "fairscale" and place == "around":
                net.body[i] = checkpoint_wrapper(net.body[i])
        return FairscaleFSDP(net, **opts)
    if scenario.backend == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        kwargs = _torch_kwargs(scenario)
        if scenario.nested and scenario.options.get("auto_wrap"):
            return TorchFSDP(net, auto_wrap_policy=ModuleWrapPolicy({Block}), **kwargs)
        if scenario.nested:
            for i in range(len(net.body)):
                net.body[i] = TorchFSDP(net.body[i], **kwargs)
        return TorchFSDP(net, **kwargs)
    if scenario.backend == "fsdp2":
        return _fully_shard(scenario, net)
    if scenario.backend == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # ``overlap`` is flatview's (see distributed_model), the rest DDP's.
        options = {k: v for k, v in scenario.options.items() if k != "overlap"}
        return DistributedDataParallel(net, **options)
    raise ValueError(f"unknown backend {scenario.backend}")


def _fully_shard(scenario: Scenario, net: Net) -> nn.Module:
    """FSDP2: ``fully_shard`` each block (when nested) and the root. Options:
    ``hsdp`` (replicas: a 2-D mesh of that many replicas of ``world_size / hsdp``
    shards), ``reshard_after_forward``, ``mixed_precision`` ((param, reduce) dtype
    names), ``prefetch`` (explicit forward and backward prefetching of neighbours) and
    ``reduce_scatter_unused_params`` (``set_reduce_scatter_unused_params(True)``) and
    ``window="all_reduce"`` (HSDP: :func:`no_sync` accumulates with
    ``set_requires_all_reduce(False)``, reduce-scattering every micro-batch)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    options = dict(scenario.options)
    replicas = options.pop("hsdp", None)
    if replicas is None and scenario.strategy == "HSDP":
        replicas = scenario.world_size // HYBRID_SHARD_SIZE
    shape = (replicas, scenario.world_size // replicas) if replicas else (scenario.world_size,)
    names = ("replicate", "shard") if replicas else ("shard",)
    key = (shape, names)
    if key not in _FSDP2_MESHES:
        _FSDP2_MESHES[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    kwargs: dict[str, Any] = {"mesh": _FSDP2_MESHES[key]}
    if "reshard_after_forward" in options:
        kwargs["reshard_after_forward"] = options.pop("reshard_after_forward")
    if "mixed_precision" in options:
        param, reduce = (
            None if d is None else getattr(torch, d) for d in options.pop("mixed_precision")
        )
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)
    prefetch = options.pop("prefetch", False)
    reduce_unused = options.pop("reduce_scatter_unused_params", False)
    window = options.pop("window", None)
    assert window in (None, "all_reduce"), window
    options.pop("bucket_all_used", None)  # flatview's (Scenario.flatview_options)
    blocks: list[Any] = []
    if scenario.nested:
        blocks = [fully_shard(block, **kwargs) for block in net.body]
    model: Any = fully_shard(net, **kwargs)
    if reduce_unused:
        model.set_reduce_scatter_unused_params(True)
    if prefetch:
        for before, after in itertools.pairwise(blocks):
            before.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([before])
    assert not options, f"unknown FSDP2 options {options}"
    if window is not None:
        model._test_window = window
    return model  # type: ignore[no-any-return]


def no_sync(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """``model.no_sync()``, or for FSDP2 ``set_requires_gradient_sync(False)`` until exit."""
    if hasattr(model, "no_sync"):
        return model.no_sync()  # type: ignore[no-any-return,operator]
    return _fsdp2_no_sync(model)


@contextlib.contextmanager
def _fsdp2_no_sync(model: Any) -> Iterator[None]:
    # HSDP's other window (torchtitan's): reduce-scatter each micro-batch, all-reduce once.
    setting = (
        model.set_requires_all_reduce
        if getattr(model, "_test_window", None) == "all_reduce"
        else model.set_requires_gradient_sync
    )
    setting(False)
    try:
        yield
    finally:
        setting(True)


def full_state(
    model: nn.Module, scenario: Scenario, names: Collection[str] | None = None
) -> dict[str, np.ndarray] | None:
    """The unsharded parameters by original name (``names``: those of the scenario's
    net), on rank 0 (collective)."""
    if scenario.backend == "torch":
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

        # rank0_only fails on CPU in torch 2.13 (rank 0 reads a freed unsharded flat
        # parameter); every rank gathers instead.
        config = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
        with TorchFSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            state = model.state_dict()
    elif scenario.backend == "ddp":
        state = model.module.state_dict()
    elif scenario.backend == "fsdp2":
        state = {k: v.full_tensor() for k, v in model.state_dict().items()}
    else:
        state = model.state_dict()
    if dist.get_rank() != 0:
        return None
    if names is None:
        names = {k for k, _ in make_net(scenario).named_parameters()}
    # float32 but for float64, which keeps its precision (a model cast to double).
    wide = torch.float64
    return {
        k: v.detach().to(wide if v.dtype == wide else torch.float32).numpy().copy()
        for k, v in state.items()
        if k in names
    }


def distributed_model(
    scenario: Scenario, net: Net | None = None
) -> tuple[nn.Module, FlatView, list[torch.optim.Optimizer]]:
    """``net`` (by default the scenario's) wrapped in FSDP and flatview, frozen as the
    scenario says, and the per-submodule optimizers over its views (call it inside
    :func:`backend_context`)."""
    import flatview

    model = wrap_fsdp(scenario, make_net(scenario) if net is None else net)
    fv = flatview.wrap(model, check_skip_agreement=scenario.check, **scenario.flatview_options)
    freeze(fv.named_parameters(), scenario)
    return model, fv, optimizers(_original_tree(model))


def synced_backward(
    scenario: Scenario,
    model: nn.Module,
    fv: FlatView | None,
    micros: range,
    before_backward: Callable[[], None] | None = None,
) -> None:
    """The backward passes of micro-batches ``micros`` (one optimizer step's) on this
    rank's chunks: all but the last under ``no_sync()``, each inside
    ``fv.step(skip=...)`` unless the scenario does not declare its skips (or ``fv`` is
    None: bare FSDP, after unwrap). ``before_backward`` runs between the first forward
    and its backward."""
    for micro in micros:
        xs, ys = local_batch(scenario, micro)
        skip = skip_names(scenario, micro)
        sync = contextlib.nullcontext() if micro == micros[-1] else no_sync(model)
        declared = (
            fv.step(skip=list(skip))
            if scenario.declare and fv is not None
            else contextlib.nullcontext()
        )
        with sync, declared:
            loss = loss_of(model(xs, skip), ys)
            if micro == micros[0] and before_backward is not None:
                before_backward()
            loss.backward()


def distributed_training(
    scenario: Scenario,
    model: nn.Module,
    fv: FlatView | None,
    opts: Sequence[torch.optim.Optimizer],
    steps: Sequence[range] | None = None,
) -> Iterator[bool]:
    """The training loop of :func:`run_distributed`, for ``steps`` (by default every
    optimizer step of the scenario). Pauses twice per optimizer step: after its
    backward passes, before ``opts`` step (yields False), and right after they stepped
    (yields True), before the evaluate passes and ``zero_grad``. ``fv`` ``None``: bare FSDP."""
    opts = list(opts)
    at = scenario.zero_grad_at
    wrapped: FlatView | None = fv
    for number, micros in enumerate(optimizer_steps(scenario) if steps is None else steps):
        if at == "before_forward":
            zero_grads(scenario, opts)
        between = functools.partial(zero_grads, scenario, opts) if at == "between" else None
        synced_backward(scenario, model, wrapped, micros, between)
        yield False
        before = scenario.evaluate_before_step
        if before:
            _evaluate(scenario, model, wrapped, micros[-1])
        for opt in opts:
            opt.step()
        yield True
        if scenario.evaluate and not before:
            _evaluate(scenario, model, wrapped, micros[-1], opts if at == "after_step" else ())
        elif at == "after_step":
            zero_grads(scenario, opts)
        if number == scenario.unwrap_after:
            fv.unwrap()
            wrapped = None
            opts = [plain_optimizer(plain_parameters(scenario, model))]


def _evaluate(
    scenario: Scenario,
    model: nn.Module,
    fv: FlatView | None,
    micro: int,
    zeroed: Sequence[torch.optim.Optimizer] = (),
) -> None:
    """The evaluate passes after micro-batch ``micro``: a forward with autograd on whose
    loss no backward uses, ``zeroed`` zero their gradients, then a forward without
    autograd inside a step."""
    model(local_batch(scenario, 10_000 + micro)[0])
    if zeroed:
        zero_grads(scenario, zeroed)
    skip = skip_names(scenario, micro)
    step = fv.step(skip=list(skip)) if fv else contextlib.nullcontext()
    autograd_off = torch.inference_mode() if scenario.inference else torch.no_grad()
    with autograd_off, step:
        model(local_batch(scenario, 20_000 + micro)[0], skip)


def plain_parameters(scenario: Scenario, model: nn.Module) -> list[nn.Parameter]:
    """``model.parameters()`` as a bare FSDP user builds an optimizer over them.

    torch FSDP1 ``SHARD_GRAD_OP`` with ``use_orig_params=True`` keeps a unit unsharded
    after a forward with autograd on but no backward, and registers non-leaf views of the
    unsharded flat parameter in place of its parameters until the next reshard (torch's
    own behaviour, without flatview too): no optimizer accepts them. Leaving
    ``summon_full_params`` reshards and registers the parameters again."""
    if scenario.backend == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

        with TorchFSDP.summon_full_params(model, writeback=False):
            pass
    return list(model.parameters())


def run_distributed(scenario: Scenario) -> Outcome:
    """Train with FSDP + flatview in the worker pool (every rank reports)."""
    with backend_context(scenario.backend):
        model, fv, opts = distributed_model(scenario)
        tree = _original_tree(model)
        none_grads = []
        on_modules = []

        def held() -> set[int]:
            return {id(p) for p in tree.parameters()}

        # After an evaluation FSDP2 keeps the root's unsharded parameters on its modules
        # until the next pass (flatview.leftovers), and torch SHARD_GRAD_OP with
        # use_orig_params its unsharded views of units the evaluation under no_grad
        # skipped (below), without flatview too.
        shown_after_step = not scenario.evaluate_before_step or not (
            scenario.backend == "fsdp2" or _wrapper_views(scenario)
        )
        for stepped in distributed_training(scenario, model, fv, opts):
            if fv.phase.name == "DETACHED":
                continue
            if stepped:
                if shown_after_step:
                    on_modules.append(held() == {id(p) for p in fv.parameters()})
            else:
                none_grads.append(_none_grads(fv.named_parameters()))
        if (
            not _wrapper_views(scenario)
            and scenario.unwrap_after is None
            and not (scenario.backend == "fsdp2" and scenario.evaluate)
        ):
            # Also after the evaluation passes. torch's own per-parameter views are not
            # checked here: after a forward without backward, SHARD_GRAD_OP leaves its
            # unsharded parameters on the modules until the next pass.
            on_modules.append(held() == {id(p) for p in fv.parameters()})
        names = [n for n, _ in fv.named_parameters()]
        empty = sorted(n for n, p in fv.named_parameters() if p.numel() == 0)
        params = full_state(model, scenario)
        return Outcome(names, none_grads, params, empty, all(on_modules))


def _wrapper_views(scenario: Scenario) -> bool:
    """Whether the wrapper keeps its own per-parameter views (torch ``use_orig_params``),
    which flatview then uses instead of making its own."""
    return scenario.backend == "torch" and bool(scenario.options.get("use_orig_params"))


def _original_tree(model: nn.Module) -> Any:
    """The user's module inside the outermost wrapper: ``model.module`` for torch, one
    level further (the flattening wrapper's ``module``) for fairscale."""
    inner = getattr(model, "module", model)  # FSDP2: the model itself
    return getattr(inner, "module", inner)


def compare(
    got: dict[str, np.ndarray] | None, want: dict[str, np.ndarray] | None, tolerance: float = 1e-5
) -> None:
    assert got is not None and want is not None
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for name in want:
        np.testing.assert_allclose(
            got[name], want[name], rtol=10 * tolerance, atol=tolerance, err_msg=name
        )


def check_equivalent(
    dist_pool: PoolFactory, scenario: Scenario, *, timeout: float, tolerance: float = 1e-5
) -> None:
    """Train ``scenario`` with FSDP + flatview in a pool of its world size and in one
    process, and :func:`assert_equivalent` the two."""
    results = dist_pool(scenario.world_size).run(run_distributed, scenario, timeout=timeout)
    assert_equivalent(results, run_reference(scenario), scenario, tolerance)


def assert_equivalent(
    results: list[Outcome], reference: Outcome, scenario: Scenario, tolerance: float = 1e-5
) -> None:
    """Rank 0 ended at the reference parameters; on every rank the views are what the
    submodules hold, and gradients were None exactly where the reference had none."""
    compare(results[0].params, reference.params, tolerance)
    # With use_orig_params torch keeps its own per-parameter views, and those of
    # parameters outside this rank's shard have no gradient whatever the step did;
    # flatview's own views of parameters held wholly elsewhere get none either.
    wrapper_views = _wrapper_views(scenario)
    assert reference.params is not None
    for rank, got in enumerate(results):
        assert got.names == reference.names, rank
        assert got.views_on_modules, rank
        elsewhere = {n for n in got.empty if reference.params[n].size > 0}
        steps = zip(got.none_grads, reference.none_grads, strict=True)
        for step, (none, expected) in enumerate(steps):
            if wrapper_views:
                assert set(expected) <= set(none), (rank, step)
                assert set(none) - set(expected) <= set(got.empty), (rank, step)
            else:
                assert set(none) == set(expected) | elsewhere, (rank, step)
