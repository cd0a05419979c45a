"""A refusal one rank decides alone is raised on every rank, at every collective entry
point of the public API; no rank hangs.

The audit's case: ranks whose optimizers hold different kinds of parameters (rank 1's
built over the flat parameters before wrapping, the others' over views). On torch
``NO_SHARD``, where every rank holds everything and consolidation used to exchange
nothing, ``fv.optim_state_dict`` raised on rank 1 only and the others went on to their
next collective, waiting there forever. Each case of
:func:`tests.refusal_workers.one_rank_refuses` misuses one call on rank 1 only:
``optim_state_dict`` (a divergent optimizer, ``rank0_only`` on one rank),
``flatview.checkpoint``'s get and set functions (an optimizer over flat parameters, the
wrong model, other options, a state dict that does not fit), ``clip_grad_norm_`` (a
bad ``max_norm``). Every rank must raise, after the same collectives (the pool checks
that the ranks' collective counts agree after the task; its timeout fails a hang).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from tests import refusal_workers as rw
from tests.scenarios import (
    BACKEND_CONFIGS,
    FSDP2,
    GATED,
    BackendConfig,
    backend_param,
)

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

TIMEOUT = 90.0

EXPECTED = {
    "optim_state_dict": r"OptimStateError: .*(flat parameter of FSDP unit|Parameter of shape "
    r"\(2, 3\))",
    "rank0_only": r"OptimStateError: ranks made this call with different options",
    "checkpoint_optimizer_False": r"OptimStateError: .*(flat parameter of FSDP unit|"
    r"Parameter of shape \(2, 3\))",
    "checkpoint_optimizer_True": r"OptimStateError: .*(flat parameter of FSDP unit|"
    r"Parameter of shape \(2, 3\))",
    "checkpoint_model": r"FlatViewError: .*that is not the one .* wraps",
    "checkpoint_options": r"FlatViewError: ranks called flatview\.checkpoint\.get_state_dict "
    r"with different options",
    "set_state_dict": r"OptimStateError: .*lists \['body\.0\.nonexistent'\]",
    "set_optimizer_state_dict": r"OptimStateError: .*lists \['body\.0\.nonexistent'\]",
    "clip_grad_norm_": r"NormError: .*max_norm must be non-negative",
}
ROUTED = {
    "torch_options": r"FlatViewError: .*flatten_optimizer_state_dict=True",
    "torch_optimizer": r"FlatViewError: ranks called torch\.distributed\.checkpoint\.state_dict\."
    r"get_optimizer_state_dict \(routed to flatview\.checkpoint\) with different options",
    "torch_set": r"OptimStateError: .*lists \['body\.0\.nonexistent'\]",
}
"""torch's own functions, routed to flatview.checkpoint where the wrapper flattens."""

CONFIGS = [
    backend_param(config, ci=config == FSDP2) for config in BACKEND_CONFIGS if not config.runtime
]


@pytest.mark.timeout(2 * TIMEOUT)
@pytest.mark.parametrize("backend", CONFIGS)
def test_one_rank_refusing_raises_on_every_rank(
    dist_pool: PoolFactory, backend: BackendConfig
) -> None:
    scenario = backend.scenario(GATED, world_size=2, skips=((), (), ()))
    results = dist_pool(scenario.world_size).run(rw.one_rank_refuses, scenario, timeout=TIMEOUT)
    expected = {**EXPECTED, **(ROUTED if backend.flattens else {})}
    for rank, out in enumerate(results):
        assert sorted(out) == sorted(expected), rank
        for case, pattern in expected.items():
            assert re.search(pattern, out[case]), (rank, case, out[case])


# ---------------------------------------------------------------- refused wraps

NESTED = r"WrapError: flatview\.wrap was given a nested (FSDP unit|FSDP2 module)"
# CI runs FSDP2 and torch FSDP1 through its auto-wrapped model; torch FSDP1's other
# layouts and fairscale (whose refusals CI also runs one rank at a time below) thorough.
WRAP_CONFIGS = [
    *(
        backend_param(c, {}, ci=c == FSDP2, slow=c.backend in ("torch", "fairscale"))
        for c in BACKEND_CONFIGS
        if not c.runtime
    ),
    backend_param(BackendConfig("torch", "FULL_SHARD"), {"auto_wrap": True}),
]


@pytest.mark.timeout(2 * TIMEOUT)
@pytest.mark.parametrize(("backend", "options"), WRAP_CONFIGS)
def test_a_refused_wrap_leaves_nothing_behind(
    dist_pool: PoolFactory, backend: BackendConfig, options: dict[str, Any]
) -> None:
    """``flatview.wrap`` given a nested unit (on DDP: a model built with
    ``static_graph=True``), before the first forward and after the first step, is
    refused with a WrapError, and the plain training that follows ends bit for bit where
    a run that never called wrap does. It was accepted before the first forward on
    fairscale (whose hooks then refused every forward), on FSDP2 and on torch units an
    auto-wrap policy made (both lazily initialised as roots, which the outer model's
    first forward refused)."""
    if backend.backend == "ddp":
        options = {"static_graph": True}
    scenario = backend.scenario(GATED, world_size=2, skips=((), (), ()), options=options)
    runs = dist_pool(scenario.world_size).run(
        rw.refused_wrap_then_plain, scenario, timeout=TIMEOUT
    )[0]
    pattern = (
        r"WrapError: DDP was built with static_graph=True" if backend.backend == "ddp" else NESTED
    )
    want = runs[None]["params"]
    for when in (0, 1):
        assert re.search(pattern, runs[when]["refused"]), (when, runs[when]["refused"])
        got = runs[when]["params"]
        assert sorted(got) == sorted(want)
        for name, value in want.items():
            assert np.array_equal(got[name], value), (when, name)
