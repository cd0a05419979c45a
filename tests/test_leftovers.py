"""What a forward without a backward leaves unsharded in the wrapper (``flatview.leftovers``)
must never stand in for the shards: evaluations between a backward and the optimizer
step, writes through the parameters after an evaluation, a validation loss computed
with autograd on; each program must train as the single-process reference does.

Bare FSDP fails the first (torch FSDP1, hybrid included, fairscale and FSDP2: every
parameter 3e-4 to 4e-2 off the reference after three steps, the root unit's most): its
next forward reuses the root's unsharded copy, gathered before the optimizer moved the
shards. With flatview's release disabled every program fails on every sharded
configuration. Workers in :mod:`tests.leftover_workers`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from tests import leftover_workers as lw
from tests.scenarios import (
    BACKEND_CONFIGS,
    FAIRSCALE,
    FSDP2,
    BackendConfig,
    backend_param,
    compare,
)

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

PROGRAMS = {
    # An evaluation between each backward and its optimizer step.
    "eval-before-step": "TESTESTES",
    # A validation loss with autograd on there instead: the next step abandons it.
    "loss-before-step": "TGSTGSTS",
    # A moving average swapped in for an evaluation and swapped back, then trained on
    # (docs/recipes.md: the evaluation leaves the swapped-in values unsharded).
    "swap-for-eval": "TSWEWTSWEWTS",
    # Parameters written after an evaluation (a moving average copied in), trained on,
    # and written again before the full state dict is read.
    "write-after-eval": "TSEWTSEW",
    # The same inside an accumulation window (Lightning validates between micro-batches).
    "write-in-window": "aEWTSaGWTS",
}
"""The programs (:mod:`tests.leftover_workers` says what each letter does)."""

OPTIONS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "orig-params": {"use_orig_params": True},
    "no-reshard": {"reshard_after_forward": False},
}
"""Wrapper options: torch's own views, or more than the root kept unsharded."""

TORCH_FULL_SHARD = BackendConfig("torch", "FULL_SHARD")
VARIANTS = [
    (TORCH_FULL_SHARD, "orig-params"),
    (FAIRSCALE, "no-reshard"),
    (FSDP2, "no-reshard"),
]

CI = (FSDP2, BackendConfig("torch", "SHARD_GRAD_OP"))
"""Run in the CI profile besides the quick configurations: FSDP2 (the root's copy) and
SHARD_GRAD_OP (every unit's)."""


@pytest.mark.parametrize(
    ("backend", "option"),
    [backend_param(c, "defaults", ci=c in CI) for c in BACKEND_CONFIGS]
    + [backend_param(c, option, slow=True) for c, option in VARIANTS],
)
def test_what_a_forward_leaves_unsharded_never_goes_stale(
    dist_pool: PoolFactory, backend: BackendConfig, option: str
) -> None:
    """Every program of :data:`PROGRAMS` ends at the reference's parameters (and the
    full state dict read after the last write shows it)."""
    scenario = backend.scenario(
        world_size=backend.ranks(2),
        skips=((), (1,), (0,), (1,), ()),
        batch_per_rank=2,
        options=OPTIONS[option],
    )
    pool = dist_pool(scenario.world_size)
    for name, program in PROGRAMS.items():
        got = pool.run(lw.play_wrapped, scenario, program, timeout=60)[0]
        want = lw.play_reference(scenario, program)
        try:
            compare(got, want)
        except AssertionError as err:
            raise AssertionError(f"program {name} ({program}): {err}") from None


@pytest.mark.parametrize("backend", [backend_param(FAIRSCALE)])
def test_low_precision_gradient_given_back_after_an_evaluation(
    dist_pool: PoolFactory, backend: BackendConfig
) -> None:
    """fairscale on one rank with ``mixed_precision`` computes on fp16 ``.data`` and leaves
    the fp16 gradient on the fp32 flat parameter. An evaluation between the backward and
    the step (flatview takes the gradient off the flat parameter for each forward, and
    gives it back after one without autograd) must leave training as it was without it,
    bit for bit (torch's gradient setter refused the fp16 gradient back: a crash)."""
    scenario = backend.scenario(
        world_size=1, skips=((),) * 3, batch_per_rank=2, options={"mixed_precision": True}
    )
    pool = dist_pool(1)
    plain = pool.run(lw.play_wrapped, scenario, "TSTSTS", True, timeout=60)[0]
    assert plain is not None
    for program in ("TESTESTES", "TGSTGSTS"):
        got = pool.run(lw.play_wrapped, scenario, program, True, timeout=60)[0]
        assert got is not None and got.keys() == plain.keys()
        for name, value in plain.items():
            assert np.array_equal(got[name], value), (program, name)


@pytest.mark.parametrize("backend", [backend_param(TORCH_FULL_SHARD)])
def test_torch_mixed_precision_after_an_unused_loss_names_the_cause(
    dist_pool: PoolFactory, backend: BackendConfig
) -> None:
    """torch FSDP1 with a parameter dtype in ``MixedPrecision`` hooks no unit in the
    backward after a forward with autograd that no backward followed (bare torch fails
    there with a size mismatch): the error flatview raises on every rank names every
    unit and that cause, with the remedy."""
    scenario = backend.scenario(
        world_size=2,
        skips=((),) * 3,
        batch_per_rank=2,
        options={"mixed_precision": ("bfloat16", None)},
    )
    for message in dist_pool(2).run(lw.raised_by, scenario, "TGST", timeout=60):
        assert message.startswith("UndeclaredUnusedError: the parameters of FSDP unit(s)"), message
        assert "'<root>', 'body.0', 'body.1'" in message, message
        assert "compute losses you do not backward, for validation, under torch.no_grad()" in (
            message
        ), message
