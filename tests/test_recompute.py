"""Activation checkpointing under flatview equals the unwrapped model: recomputed inside
each block (within its FSDP unit), or around each block's call, so that the unit's whole
forward runs again in the backward; reentrant and not (``torch.utils.checkpoint``), and
fairscale's ``checkpoint_wrapper`` inside and around its units; with skip sets of every
kind. torch's ``test_fsdp_checkpoint.py`` and fairscale's FSDP tests wrap both ways.

Where the bare wrapper fails (:func:`tests.scenarios.recomputing` says which), flatview
must fail too or train right: never train otherwise. ``test_equivalence`` also draws
checkpointing into its scenarios."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import pytest

from tests.dist_pool import WorkerError
from tests.scenarios import (
    BACKEND_CONFIGS,
    FAIRSCALE,
    GATED,
    BackendConfig,
    backend_param,
    check_equivalent,
    recomputing,
)

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

TIMEOUT = 120.0
MODES = ["inside-plain", "inside-reentrant", "around-plain", "around-reentrant", "inside-wrapper"]
IN_CI = ("around-plain", "inside-reentrant")
"""The rest run in the thorough profile (and ``test_equivalence`` draws them all)."""


@pytest.mark.parametrize(
    ("backend", "mode", "nested"),
    [
        backend_param(config, mode, nested, slow=mode not in IN_CI or not nested)
        for config in BACKEND_CONFIGS
        for mode in MODES
        for nested in (True, False)
    ],
)
def test_recomputed_blocks_train_as_the_reference(
    dist_pool: PoolFactory, backend: BackendConfig, mode: str, nested: bool
) -> None:
    scenario = backend.scenario(GATED, recompute=mode, nested=nested)
    if mode in recomputing(scenario):
        check_equivalent(dist_pool, scenario, timeout=TIMEOUT)
        return
    # The bare wrapper fails here: flatview may fail too, not train otherwise.
    with contextlib.suppress(WorkerError):
        check_equivalent(dist_pool, scenario, timeout=TIMEOUT)


@pytest.mark.parametrize("place", ["inside", "around"])
def test_fairscale_checkpoint_wrapper_trains_as_the_reference(
    dist_pool: PoolFactory, place: str
) -> None:
    # Blocks inside one unit (not nested) fail in bare fairscale on CPU too: the
    # wrapper's recomputation reads the freed unsharded parameters.
    scenario = FAIRSCALE.scenario(GATED, recompute=f"{place}-fairscale")
    check_equivalent(dist_pool, scenario, timeout=TIMEOUT)


def test_torch_wrapper_around_a_fairscale_unit_that_never_ran(dist_pool: PoolFactory) -> None:
    """torch's ``apply_activation_checkpointing`` after fairscale's FSDP puts a wrapper
    around each unit's module, which fairscale's unflattening (``state_dict``) tripped
    over until the unit's first forward (bare fairscale too). A unit every step skips
    never runs one: the state is read all the same, and training is the reference's."""
    scenario = FAIRSCALE.scenario(recompute="inside-wrapper", skips=((0,), (0,), (0, "body.1")))
    check_equivalent(dist_pool, scenario, timeout=TIMEOUT)
