"""Detaching flatview with ``unwrap()``, on each backend configuration."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import pytest

from tests import unwrap_workers as uw
from tests import workers as w
from tests.scenarios import (
    BACKEND_CONFIGS,
    BACKENDS,
    FSDP2,
    FSDP2_HSDP,
    TORCH_NO_SHARD,
    BackendConfig,
    Scenario,
    backend_param,
    compare,
    run_reference,
)

if TYPE_CHECKING:
    from tests.conftest import PoolFactory


def check_unwrap(dist_pool: PoolFactory, scenario: Scenario) -> None:
    results = dist_pool(scenario.world_size).run(w.unwrap_restores_plain_fsdp, scenario, timeout=60)
    for result in results:
        assert result == {"flats_back": True, "step_refused": True, "hooks_left": False}, result


@pytest.mark.parametrize("backend", BACKENDS)
def test_unwrap_gives_back_plain_fsdp(dist_pool: PoolFactory, backend: BackendConfig) -> None:
    check_unwrap(dist_pool, backend.scenario(world_size=backend.ranks(2)))


@pytest.mark.parametrize("backend", [backend_param(FSDP2)])
def test_unwrap_gives_back_plain_fsdp2_as_one_unit(
    dist_pool: PoolFactory, backend: BackendConfig
) -> None:
    """FSDP2 with only the root sharded (BACKENDS shards each block too)."""
    check_unwrap(dist_pool, backend.scenario(world_size=2, nested=False))


@pytest.mark.parametrize(
    ("backend", "window"),
    [
        *(backend_param(c, "no-sync", ci=c == FSDP2_HSDP) for c in BACKEND_CONFIGS),
        # HSDP's other window (torchtitan's): reduce-scattered every micro-batch, the
        # replicas' all-reduce held back by set_requires_all_reduce(False).
        backend_param(FSDP2_HSDP, "all-reduce", ci=True),
    ],
)
def test_unwrap_inside_an_accumulation_window_is_refused(
    dist_pool: PoolFactory, backend: BackendConfig, window: str
) -> None:
    """``unwrap()`` between the micro-batches of one optimizer step, inside the
    wrapper's accumulation window, is refused on every rank with a
    :class:`~flatview.StateError` that says how to go on (the flat parameters then hold
    the window's gradients and the views the earlier ones, not merged). Finishing the
    step and unwrapping after it trains on as the single-process reference: the refusal
    lost or doubled none of the window's gradients."""
    options = {"window": "all_reduce"} if window == "all-reduce" else {}
    scenario = backend.scenario(
        world_size=backend.ranks(2),
        accumulate=2,
        skips=((0,), (1,), (), ()),
        unwrap_after=0,
        options=options,
    )
    pool = dist_pool(scenario.world_size)
    results = pool.run(uw.unwrap_refused_inside_a_window, scenario, timeout=60)
    for result in results:
        refused = result["refused"]
        assert refused.startswith("StateError: unwrap() inside an accumulation window"), refused
        assert "finish the accumulation with a synchronising backward" in refused, refused
    compare(results[0]["params"], run_reference(scenario).params)


HOOKED = (
    BackendConfig("ddp"),
    BackendConfig("torch", "FULL_SHARD"),
    BackendConfig("torch", "NO_SHARD"),
)


@pytest.mark.parametrize("backend", [backend_param(c, ci=True) for c in HOOKED])
def test_comm_hook_registered_after_wrap_is_refused(
    dist_pool: PoolFactory, backend: BackendConfig
) -> None:
    """A communication hook registered after the wrap (fp16 compression): flatview reduces
    the gradients itself, so on DDP and torch ``NO_SHARD`` computed on views the hook was
    bypassed in silence (DDP trained 6e-5 away from bare DDP with the hook); on sharded
    torch FSDP1 torch's assertion failed. Refused on every rank, as at the wrap; after
    ``unwrap()`` bare training takes the hook."""
    scenario = backend.scenario(world_size=2)
    for out in dist_pool(2).run(w.comm_hook_after_wrap, scenario, timeout=60):
        assert out["error"].startswith("StateError: "), out
        assert "register_comm_hook" in out["error"] and "unwrap" in out["error"], out
        assert out["bare"] == "trained"


@pytest.mark.parametrize(
    "backend",
    [backend_param(c, ci=c in (TORCH_NO_SHARD, FSDP2)) for c in BACKEND_CONFIGS],
)
def test_a_dropped_model_is_freed(dist_pool: PoolFactory, backend: BackendConfig) -> None:
    """A wrapped model dropped without ``unwrap()`` (a sweep, a notebook that builds the
    model again, evaluating several checkpoints in one process) is freed with its views
    and handle, as the bare wrapper's model is. Until flatview held what its hooks in
    torch's C++ call weakly, every such model stayed alive, on DDP and torch
    ``NO_SHARD`` computed on views through a gradient hook per parameter, on every
    backend through the table of wrapped units: on a GPU its parameters, gradients and
    optimizer state. fairscale's own gradient hooks keep a bare model alive too."""
    scenario = backend.scenario(world_size=backend.ranks(2), skips=((), (0,), ()))
    pool = dist_pool(scenario.world_size)
    bare = pool.run(w.dropped_models_are_freed, replace(scenario, skips=((), (), ())), False)
    wrapped = pool.run(w.dropped_models_are_freed, scenario, True)
    for rank, (alive, bare_alive) in enumerate(zip(wrapped, bare, strict=True)):
        expected = ["handle", "model", "parameter"] if "model" in bare_alive else []
        assert alive == expected, (rank, alive, bare_alive)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_model_keeps_its_handle(dist_pool: PoolFactory, backend: BackendConfig) -> None:
    """``flatview.wrap(model)`` without keeping what it returns: the handle lives with
    the model, so wrapping the model again is still refused."""
    scenario = backend.scenario(world_size=backend.ranks(2))
    for out in dist_pool(scenario.world_size).run(w.model_keeps_its_handle, scenario):
        assert out == {"alive": True, "wrapped_again": False}, out
