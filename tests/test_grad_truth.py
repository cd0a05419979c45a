"""Gradients and values are what the unwrapped model would have (issue 15): wherever
``zero_grad`` is called, whatever is written through a view, after ``unwrap()`` (and
wrapping again), and optimizers flatview cannot serve are refused before they step."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import pytest

from tests import grad_workers as gw
from tests.scenarios import (
    BACKEND_CONFIGS,
    FAIRSCALE,
    BackendConfig,
    Scenario,
    backend_param,
    check_equivalent,
    compare,
)

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

TIMEOUT = 90.0
# Two optimizer steps, the second skipping a whole unit and a root-unit parameter.
BASE = Scenario(
    inner=(3, 4),
    norms=(True, False),
    gates=(False, True),
    aux=True,
    skips=((), (0, "aux"), ("body.1.gate",)),
)


def _zero_grad_params() -> list[Any]:
    # Every configuration, zero_grad between forward and backward, both set_to_none;
    # before the forward once per configuration; use_orig_params on torch's strategies.
    # set_to_none=False (zeroing in place) and the placement before the forward only in
    # the thorough profile: the suite's hypothesis draws cover them too.
    params = []
    for config in BACKEND_CONFIGS:
        params.append(backend_param(config, "between", True, {}))
        params.append(backend_param(config, "between", False, {}, slow=True))
        params.append(backend_param(config, "before_forward", True, {}, slow=True))
        if config.backend == "torch" and not config.runtime and config.strategy != "NO_SHARD":
            slow = config.strategy != "FULL_SHARD"
            orig = {"use_orig_params": True}
            params.append(backend_param(config, "between", True, orig, slow=slow))
    return params


@pytest.mark.parametrize(("backend", "at", "set_to_none", "options"), _zero_grad_params())
def test_zero_grad_after_forward(
    dist_pool: PoolFactory,
    backend: BackendConfig,
    at: str,
    set_to_none: bool,
    options: dict[str, Any],
) -> None:
    """A zero_grad between forward and backward (or before the forward) clears the last
    step's gradient, as on the unwrapped model: nothing accumulates onto it."""
    scenario = backend.scenario(BASE, zero_grad_at=at, set_to_none=set_to_none, options=options)
    check_equivalent(dist_pool, scenario, timeout=TIMEOUT)


@pytest.mark.slow
def test_zero_grad_after_forward_with_accumulation(dist_pool: PoolFactory) -> None:
    """Under no_sync() the gradients zeroed after the window's first forward are what
    the window accumulates onto."""
    scenario = FAIRSCALE.scenario(
        BASE,
        skips=((), (1,), (0,), ()),
        accumulate=2,
        zero_grad_at="between",
        set_to_none=False,
    )
    check_equivalent(dist_pool, scenario, timeout=TIMEOUT)


WRITE = replace(BASE, set_to_none=False)
REFUSED_CONFIGS = [c for c in BACKEND_CONFIGS if c.flattens and not c.on_views]


QUICK = ("fairscale", "torch-full-shard", "torch-no-shard", "ddp")


def _written_params() -> list[Any]:
    return [backend_param(c, slow=str(c) not in QUICK) for c in BACKEND_CONFIGS if c.flattens]


@pytest.mark.parametrize("backend", _written_params())
def test_writes_through_views_reach_the_shard(
    dist_pool: PoolFactory, backend: BackendConfig
) -> None:
    """``view.data = t``, ``module.weight = nn.Parameter(t)`` (which becomes the view)
    and ``view.grad.data = t`` behave as on the unwrapped model; a value that cannot be
    written back is refused at the next forward, naming the parameter."""
    scenario = backend.scenario(WRITE)
    got = dist_pool(scenario.world_size).run(gw.write_back, scenario, timeout=TIMEOUT)[0]
    want = gw.write_back_reference(scenario)
    assert got["head_in_parameters"]
    if backend.on_views:
        assert "'head.weight'" in got["replaced"] and "FlatViewError" in got["replaced"]
    else:
        assert got["head_is_view"]
    compare(got["written"], want["written"])
    compare(got["final"], want["final"])
    assert "'stem.weight'" in got["bad_shape"] and "FlatViewError" in got["bad_shape"]
    assert got["phase"] == "IDLE"


@pytest.mark.parametrize(
    "backend", [backend_param(c, slow=str(c) not in QUICK) for c in BACKEND_CONFIGS]
)
def test_unwrap_then_train_and_wrap_again(dist_pool: PoolFactory, backend: BackendConfig) -> None:
    """After unwrap the model trains as bare FSDP would (the flat parameters carry the
    zeroed gradients), wrapping again trains exactly, and optimizers over the detached
    views raise at their step (DDP and FSDP2 make no views: theirs keep the model's own
    parameters)."""
    scenario = backend.scenario(
        BASE, skips=((1,), (0, "aux"), (), ("body.1.gate",), (1,)), set_to_none=False
    )
    got = dist_pool(scenario.world_size).run(gw.unwrap_and_rewrap, scenario, timeout=TIMEOUT)[0]
    compare(got["final"], gw.unwrap_reference(scenario))
    for key in ("stale", "stale_after_rewrap"):
        if backend.flattens:
            assert got[key].startswith("StateError") and "unwrap()" in got[key], got[key]
        else:  # DDP, FSDP2: no views, the optimizers hold the model's own parameters
            assert got[key] == "own parameters", got[key]


@pytest.mark.parametrize(
    "backend", [backend_param(c, slow=str(c) not in QUICK) for c in REFUSED_CONFIGS]
)
def test_flat_optimizer_and_swapped_views_refused(
    dist_pool: PoolFactory, backend: BackendConfig
) -> None:
    """An optimizer over flat parameters built before wrap() is refused at its first
    step before touching anything (it would step skipped parameters); swapping a view
    for its flat parameter in a group of the same length is caught."""
    got = dist_pool(backend.ranks(2)).run(
        gw.refused_optimizers, backend.scenario(BASE), timeout=TIMEOUT
    )
    for rank, out in enumerate(got):
        assert out["flat"].startswith("OptimStateError") and "unit" in out["flat"], out
        assert "views" in out["flat"], out
        assert out["flat_unchanged"], rank
        assert out["swapped"].startswith("DoubleCountError"), out
