"""What a forward without a backward leaves unsharded in the wrapper (``flatview.leftovers``)
must never stand in for the shards: evaluations between a backward and the optimizer
step, writes through the parameters after an evaluation, a validation loss computed
with autograd on; each program must train as the single-process reference does.

Bare FSDP fails these (measured on torch 2.13: after ``TESTESTES`` the root's parameters
were up to 4e-2 off the reference on torch FSDP1, fairscale and FSDP2, every parameter
on ``SHARD_GRAD_OP``): its next forward reuses the root's unsharded copy, gathered
before the optimizer moved the shards. Workers in :mod:`tests.leftover_workers`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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
    # Parameters written after an evaluation (a moving average copied in), trained on,
    # and written again before the full state dict is read.
    "write-after-eval": "TSEWTSEW",
    # The same inside an accumulation window (Lightning validates between micro-batches).
    "write-in-window": "aEWTSaGWTS",
}
"""The programs (:mod:`tests.leftover_workers` says what each letter does)."""

TORCH_FULL = BackendConfig("torch", "FULL_SHARD")
VARIANTS: list[tuple[BackendConfig, dict[str, Any]]] = [
    (TORCH_FULL, {"use_orig_params": True}),
    (FAIRSCALE, {"reshard_after_forward": False}),
    (FSDP2, {"reshard_after_forward": False}),
]
"""Wrapper options that keep more than the root unsharded, or expose torch's own views."""

CI = {str(FSDP2), "torch-shard-grad-op"}
"""Configurations run in the CI profile besides the quick ones (the root's copy alone on
FSDP2; every unit's on SHARD_GRAD_OP)."""


def _params() -> list[Any]:
    plain = [backend_param(c, {}, ci=str(c) in CI) for c in BACKEND_CONFIGS]
    options = [backend_param(c, o, slow=True, marks=[]) for c, o in VARIANTS]
    return plain + options


@pytest.mark.parametrize(("backend", "options"), _params())
def test_what_a_forward_leaves_unsharded_never_goes_stale(
    dist_pool: PoolFactory, backend: BackendConfig, options: dict[str, Any]
) -> None:
    """Every program of :data:`PROGRAMS` ends at the reference's parameters (and the
    full state dict read after the last write shows it)."""
    scenario = backend.scenario(
        world_size=backend.ranks(2),
        skips=((), (1,), (0,), (1,), ()),
        batch_per_rank=2,
        options=options,
    )
    pool = dist_pool(scenario.world_size)
    for name, program in PROGRAMS.items():
        got = pool.run(lw.play_wrapped, scenario, program, timeout=60)[0]
        want = lw.play_reference(scenario, program)
        try:
            compare(got, want)
        except AssertionError as err:
            raise AssertionError(f"program {name} ({program}): {err}") from None
