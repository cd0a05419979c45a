"""Wrapper configurations at the edges of what the backends describe (issue 15): a nested
unit given to ``wrap``, fairscale units without parameters of their own or with
parameters shared across units, fairscale's ``clip_grad_norm_`` and CPU offload after
wrapping, and ``summon_full_params`` inside an iteration of torch ``NO_SHARD`` computed
on views. Each is checked against bare FSDP or the single-process reference."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import pytest

from tests import edge_workers as ew
from tests import ignored_workers as iw
from tests.scenarios import (
    DDP,
    FAIRSCALE,
    FSDP2,
    FSDP2_HSDP,
    GATED,
    HYBRID_CONFIGS,
    TORCH_NO_SHARD_RUNTIME,
    BackendConfig,
    backend_param,
    check_equivalent,
    compare,
)

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

TIMEOUT = 90.0
NO_SHARD = BackendConfig("torch", "NO_SHARD")


def _needs_fairscale() -> None:
    pytest.importorskip("fairscale")


@pytest.mark.parametrize(
    "backend", [backend_param(FAIRSCALE), backend_param(BackendConfig("torch", "FULL_SHARD"))]
)
def test_nested_unit_refused_before_first_forward(
    dist_pool: PoolFactory, backend: BackendConfig
) -> None:
    """Before the first forward no unit knows it is nested (``_is_root`` is None on all).
    torch marks a unit that another FSDP was built around; fairscale marks nothing until
    the root's lazy initialisation, so wrap looks for an enclosing unit among live
    objects: refused at wrap on both, before anything is installed (fairscale's used to
    be refused at every later forward, and before that trained 0.021 away from bare
    FSDP). The message names where the unit sits in the outer model."""
    if backend.backend == "fairscale":
        _needs_fairscale()
    for message in dist_pool(2).run(
        ew.wrap_nested_before_forward, backend.scenario(), timeout=TIMEOUT
    ):
        assert message.startswith("wrap: "), message
        assert "nested FSDP unit" in message and "'body.0'" in message, message
        assert "around a Net" in message, message


@pytest.mark.parametrize(
    ("kind", "skips"),
    [
        ("all_wrapped", [(), ("l2",), ("l1", "l3")]),
        ("shared", [(), ("l2",), ()]),
    ],
)
def test_fairscale_units_without_own_or_with_shared_parameters(
    dist_pool: PoolFactory, kind: str, skips: list[tuple[str, ...]]
) -> None:
    """``all_wrapped``: every layer its own unit, the root without parameters of its own
    (its name group is empty); ``shared``: a weight shared by sibling units through
    fairscale's ``append_shared_param`` (listed in the second unit's parameters without
    a name). ``wrap`` used to fail in ``describe`` (zip of names and parameters). Both
    train like bare fairscale and, with nested units skipped, like the reference."""
    _needs_fairscale()
    out = dist_pool(2).run(ew.fairscale_units_edge, kind, skips, timeout=TIMEOUT)[0]
    reference = out["reference"]
    compare(out["plain"], reference["False"])
    compare(out["flatview-False"], out["plain"], tolerance=1e-6)
    compare(out["flatview-True"], reference["True"])
    assert out["names-True"] == list(reference["True"])


@pytest.mark.parametrize("norm_type", [math.inf, 2.0], ids=["inf", "2"])
def test_fairscale_clip_grad_norm_after_wrap(dist_pool: PoolFactory, norm_type: float) -> None:
    """fairscale's ``clip_grad_norm_`` takes the norm over ``self.parameters()``: after
    wrapping those were the views, some empty on each rank, and ``max()`` over an empty
    gradient failed for ``inf``. The views now step aside for it: the same norms (with
    steps that skip blocks) and the same training as without flatview."""
    _needs_fairscale()
    scenario = FAIRSCALE.scenario(nested=False, skips=((), (1,), (0,)))
    results = dist_pool(2).run(ew.fairscale_clip, scenario, norm_type, 0.05, timeout=TIMEOUT)
    assert all(r["empty"] for r in results), "some view must be empty on each rank"
    for r in results:
        np.testing.assert_allclose(r["flatview-norms"], r["plain-norms"], rtol=1e-6)
        assert max(r["plain-norms"]) > 0.05  # the clipping scaled the gradients
    compare(results[0]["flatview-state"], results[0]["plain-state"], tolerance=1e-6)


@pytest.mark.parametrize("alone", [True, False], ids=["unsharded", "sharded"])
def test_fairscale_unflatten_params_after_wrap(dist_pool: PoolFactory, alone: bool) -> None:
    """fairscale's public ``unflatten_params()`` (what the first seed was told to use)
    takes the flat parameters off the module, which the views had hidden: it failed
    with "no attribute flat_param_0". The views now step aside for it: unsharded (each
    rank's FSDP on a group of its own, as at world size 1) the original parameters
    inside, a write there kept, the same training as bare fairscale; sharded, where a
    shard cannot be unflattened, fairscale's own error."""
    _needs_fairscale()
    scenario = FAIRSCALE.scenario(nested=False, skips=((), (), ()), world_size=2)
    out = dist_pool(2).run(ew.fairscale_unflatten_params, scenario, alone, timeout=TIMEOUT)[0]
    if alone:
        assert out["flatview-shapes"] == out["plain-shapes"] == [(3, 4), (3,)]
        compare(out["flatview"], out["plain"], tolerance=0.0)
    else:
        assert out["flatview-error"] == out["plain-error"]
        assert out["plain-error"].startswith("ValueError"), out["plain-error"]


@pytest.mark.parametrize("options", [{}, {"use_orig_params": True}], ids=["flat", "orig-params"])
def test_no_shard_summon_between_forwards(dist_pool: PoolFactory, options: dict[str, bool]) -> None:
    """torch ``NO_SHARD`` computed on views: ``summon_full_params`` writes the local shard
    back onto itself in place. The views aliased it with its version counter, so a
    backward through a forward taken before the summoning failed ("modified by an
    inplace operation"); bare FSDP runs it. Same training as bare FSDP."""
    scenario = NO_SHARD.scenario(skips=((), (), ()), options=options)
    out = dist_pool(2).run(ew.no_shard_summon_mid_iteration, scenario, timeout=TIMEOUT)[0]
    assert out["adapter"] == "TorchReplicatedAdapter"
    compare(out["flatview"], out["plain"], tolerance=1e-6)


def test_fairscale_cpu_offload_with_skip_sets(dist_pool: PoolFactory) -> None:
    """``move_params_to_cpu=True`` with nested units skipped from the first step: flatview
    initialises a skipped unit's attributes, which pins the CPU shard; the CPU harness
    stood in for pinning during fairscale's lazy init only ("Cannot access accelerator
    device"). Trains like the reference."""
    _needs_fairscale()
    scenario = FAIRSCALE.scenario(
        skips=((1,), (0,), (), (0, 1)), options={"move_params_to_cpu": True}
    )
    check_equivalent(dist_pool, scenario, timeout=TIMEOUT)


@pytest.mark.parametrize("backend", ["torch", "torch:orig", "torch:NO_SHARD", "fsdp2", "ddp"])
def test_ignored_parameters_with_skip_sets_train_like_the_reference(
    dist_pool: PoolFactory, backend: str
) -> None:
    """Parameters the wrapper ignores (torch FSDP1's ``ignored_modules``, FSDP2's
    ``ignored_params``, DDP's ``parameters_to_ignore``), averaged by hand: a step that
    skips every managed parameter of a unit but uses an ignored one under it (the root's
    ignored head, block 1's ignored aux, whose unit is still called) trains like the
    reference, clipped by the global norm of every parameter, the ignored ones
    included. Such a step raised UndeclaredUnusedError (torch FSDP1: the root took no
    part although its head was not skipped) or refused the unit's forward."""
    results = dist_pool(2).run(iw.train_ignoring, backend, timeout=TIMEOUT)
    assert min(results[0]["norms"]) > iw.CLIP, results[0]["norms"]  # clipping bites
    want = iw.reference(2)
    for rank, got in enumerate(results):
        assert sorted(got["params"]) == sorted(want), rank
        for name, value in want.items():
            np.testing.assert_allclose(got["params"][name], value, atol=1e-6, err_msg=name)
    # Skipped parameters have no gradient; the ignored ones used have theirs.
    for step, skip in enumerate(iw.SKIPS):
        none = set(results[0]["nones"][step])
        assert {"head.weight", "head.bias"} & none == (
            {"head.weight", "head.bias"} if "head" in skip else set()
        ), step
        aux_off = "body.1" in skip or "body.1.aux" in skip
        assert ("body.1.aux.weight" in none) == aux_off, step


FULL_SHARD = BackendConfig("torch", "FULL_SHARD")
CAST_BACKENDS = [
    backend_param(FAIRSCALE, True, False),
    backend_param(FULL_SHARD, True, False),
    backend_param(FULL_SHARD, False, False),
    backend_param(FULL_SHARD, True, True, slow=True),
    backend_param(BackendConfig("torch", "SHARD_GRAD_OP"), True, False),
    backend_param(NO_SHARD, True, False),
    backend_param(TORCH_NO_SHARD_RUNTIME, True, False),
    backend_param(DDP, True, False),
    backend_param(FSDP2, True, False, ci=True),
    backend_param(FSDP2_HSDP, True, False),
    *(backend_param(config, True, False) for config in HYBRID_CONFIGS),
]


@pytest.mark.parametrize(("backend", "optimizers_first", "orig"), CAST_BACKENDS)
def test_a_model_cast_after_the_wrap_trains_in_its_new_dtype(
    dist_pool: PoolFactory, backend: BackendConfig, optimizers_first: bool, orig: bool
) -> None:
    """torch's FSDP1 and FSDP2 let a model be cast between their construction and the
    first forward (their lazy initialisation reads the dtype then); flatview runs that
    initialisation at wrap, so ``model.double()`` after ``flatview.wrap`` used to fail
    (FSDP1: an all-gather of float64 shards into a float32 buffer; FSDP2: float32
    gradients assigned to float64 parameters). Now the views are float64 at once, every
    gradient is, and training ends where the float64 reference does (to 1e-12: a
    float32 training would be 1e-7 off), optimizers built before the cast or after
    (``orig``: torch FSDP1 with ``use_orig_params=True``), and after ``unwrap()`` the
    bare wrapper goes on from there (torch ``NO_SHARD`` computed on views failed that
    step with float32 state of torch's own); on DDP ``unwrap()`` warns instead."""
    if backend.backend == "fairscale":
        _needs_fairscale()
    scenario = backend.scenario(GATED, options={"use_orig_params": True} if orig else {})
    results = dist_pool(scenario.world_size).run(
        ew.cast_after_wrap, scenario, optimizers_first, timeout=TIMEOUT
    )
    ddp = backend.backend == "ddp"
    for result in results:
        assert result["after_cast"] == ["torch.float64"], result["after_cast"]
        assert result["grads"] == ["torch.float64"], result["grads"]
        # unwrap() hands the model back to the wrapper: torch FSDP1 and FSDP2 follow the
        # cast (one more bare step below); bare DDP's reducer, built for float32, would
        # not average the gradients any more: said when it is handed back.
        warned = result["unwrap_warnings"]
        if ddp:
            assert len(warned) == 1 and "cast after DDP was built" in warned[0], warned
            assert "DDP was built for float, the parameters are double now" in warned[0]
        else:
            assert warned == [], warned
    want = ew.cast_reference(scenario, bare_step=not ddp)
    compare(results[0]["params"], want, tolerance=1e-12)


@pytest.mark.parametrize(
    "backend",
    [
        backend_param(FAIRSCALE),
        backend_param(FULL_SHARD),
        backend_param(NO_SHARD),
        backend_param(DDP),
        backend_param(FSDP2, ci=True),
    ],
)
def test_parameters_added_after_the_wrap_are_refused(
    dist_pool: PoolFactory, backend: BackendConfig
) -> None:
    """A module added to the model after the wrap: neither the wrapper nor flatview
    reduces its gradients, so every rank trains its own copy (0.08 apart after 3 steps,
    in silence, before this check; the bare wrappers alike). An optimizer holding its
    parameters is
    refused at its first step, on every rank, naming them."""
    if backend.backend == "fairscale":
        _needs_fairscale()
    for message in dist_pool(2).run(ew.added_after_wrap, backend.scenario(), timeout=TIMEOUT):
        assert message.startswith("OptimStateError: optimizer SGD holds parameters"), message
        assert "after it was wrapped ('extra.weight', 'extra.bias')" in message, message
