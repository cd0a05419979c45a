"""Checkpoints with torch.distributed.checkpoint (DCP) and optimizers over views.

``flatview.checkpoint``'s ``get_state_dict`` / ``set_state_dict`` give the model and
optimizer state keyed by original names, sharded or full, which DCP saves at one world
size and loads at another or into the unwrapped model with torch's own functions;
training resumes exactly. torch's own functions (``get_state_dict``, ``set_state_dict``,
the optimizer-only and model-only pairs), called on a model wrapped by flatview (issue
23: frameworks checkpoint with them), give the same dicts and resume the same way on
every backend; where this torch could not be routed they would refuse optimizers over
views with a FlatViewError, before any collective.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict as dsd

from flatview.sharded_tensors import boxes
from tests import checkpoint_workers as cw
from tests.scenarios import (
    BACKEND_CONFIGS,
    BACKENDS,
    FAIRSCALE,
    FSDP2,
    HYBRID_CONFIGS,
    BackendConfig,
    Scenario,
    backend_param,
    compare,
    make_net,
    optimizer_steps,
    optimizers,
    reference_model,
    reference_training,
    run_reference,
)

if TYPE_CHECKING:
    from pathlib import Path

    from tests.conftest import PoolFactory

TIMEOUT = 120.0
FULL_SHARD = BackendConfig("torch", "FULL_SHARD")
BASE = Scenario(skips=((), (1,), (0,), ()), tie=True)
SPLIT = 2
UNUSED_ADAMW = Scenario(
    inner=(5, 3, 4), norms=(True, False, True), skips=((0, 2), (0, 2), (), (1,))
)
"""Blocks 0 and 2, the AdamW's, not used before :data:`SPLIT` steps: it has no state then."""
LAYERDROP = Scenario(inner=(5, 3, 4), norms=(True, False, True), skips=((0, 1), (0, 1), (), (2,)))
"""Blocks 0 and 1 dropped in every step before the save (after :data:`SPLIT` steps):
AdamW (blocks 0 and 2) has no state for block 0, the SGD with momentum over block 1
none at all. Both first get a gradient after the resume."""


def assert_same_state(got: cw.State, want: cw.State, context: Any = "") -> None:
    assert got["param_groups"] == want["param_groups"], context
    assert sorted(got["state"]) == sorted(want["state"]), context
    for name, entry in want["state"].items():
        assert sorted(got["state"][name]) == sorted(entry), (context, name)
        for key, value in entry.items():
            mine = got["state"][name][key]
            if isinstance(value, np.ndarray):
                np.testing.assert_allclose(
                    mine, value, rtol=1e-6, atol=1e-7, err_msg=f"{name} {key}"
                )
            else:
                assert mine == value, (context, name, key)


def reference_resumed(first: Scenario, then: Scenario, split: int) -> dict[str, np.ndarray]:
    """The single-process run: ``first``'s batches up to ``split``, ``then``'s after."""
    net, opts = reference_model(first)
    steps = optimizer_steps(first)
    for _ in reference_training(first, net, opts, steps[:split]):
        pass
    for _ in reference_training(then, net, opts, steps[split:]):
        pass
    return {k: v.detach().numpy().copy() for k, v in net.named_parameters()}


# ------------------------------------------------------------------- pure helpers


@pytest.mark.parametrize(
    ("shape", "start", "end"),
    [((7,), 2, 5), ((3, 4), 1, 11), ((3, 4), 4, 8), ((2, 3, 4), 5, 23), ((2, 3, 4), 0, 24)],
)
def test_boxes_cover_a_flat_range_in_order(shape: tuple[int, ...], start: int, end: int) -> None:
    full = torch.arange(int(np.prod(shape))).view(shape)
    got = [
        full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))].reshape(-1)
        for offsets, sizes in boxes(shape, start, end)
    ]
    assert torch.equal(torch.cat(got), torch.arange(start, end))


# ------------------------------------------------------------------ torch's functions


def _torch_function_params() -> list[Any]:
    """Every backend once (hybrid layouts and FSDP2 in the thorough profile), and torch's
    own views (``use_orig_params=True``)."""
    return [
        *(backend_param(c, "") for c in BACKEND_CONFIGS),
        backend_param(FULL_SHARD, "use-orig-params"),
    ]


@pytest.mark.parametrize(("backend", "variant"), _torch_function_params())
def test_torch_functions_save_and_resume_exactly(
    dist_pool: PoolFactory, backend: BackendConfig, variant: str, tmp_path: Path
) -> None:
    """torch's get_state_dict with optimizers over views, sharded and full, saved with
    DCP; a fresh model loads it with torch's get_state_dict + DCP + set_state_dict (the
    sharded one with the optimizer-only and model-only setters): every load gives back
    the state saved, both runs end at the single-process reference, and on fairscale and
    torch FSDP1 torch's dicts are flatview.checkpoint's, tensor for tensor (torch refused
    them before; on NO_SHARD computed on views it failed inside); so are the optimizer
    halves on DDP and FSDP2 (routed there too: torch's own primed optimizers without
    state, and its full-form load failed for an optimizer without tensor state)."""
    extra = {"use_orig_params": True} if variant == "use-orig-params" else {}
    scenario = backend.scenario(BASE, options=extra) if extra else backend.scenario(BASE)
    paths = {False: str(tmp_path / "sharded"), True: str(tmp_path / "full")}
    results = dist_pool(scenario.world_size).run(
        cw.torch_functions_resume, scenario, paths, SPLIT, timeout=TIMEOUT
    )
    reference = run_reference(scenario).params
    out = results[0]
    compare(out["uninterrupted"], reference)
    for rank, got in enumerate(results):
        assert got["unchanged"], rank
        for full in paths:
            assert got[("same", full)] and got[("same_optim", full)], (rank, full)
    for full in paths:
        assert_same_state(out[full]["loaded"], out["saved"], full)
        compare(out[full]["params"], reference)


@pytest.mark.parametrize("backend", [backend_param(FULL_SHARD), backend_param(FAIRSCALE)])
def test_torch_functions_refuse_what_flatview_refuses(
    dist_pool: PoolFactory, backend: BackendConfig
) -> None:
    """Routed to flatview.checkpoint, torch's functions refuse broadcast_from_rank0,
    flatten_optimizer_state_dict and submodules= on every rank, before any collective but
    the one small exchange that raises a refusal on every rank (the same on each)."""
    results = dist_pool(2).run(cw.torch_options_refused, backend.scenario(BASE), timeout=TIMEOUT)
    for rank, out in enumerate(results):
        messages = out["messages"]
        assert out["collectives"] == results[0]["collectives"], rank
        assert len(set(out["collectives"])) == 1, out["collectives"]
        assert "broadcast_from_rank0" in messages[0], messages
        assert "flatten_optimizer_state_dict" in messages[1], messages
        assert "submodules=" in messages[2], messages


@pytest.mark.parametrize("backend", [backend_param(FULL_SHARD), backend_param(FAIRSCALE)])
def test_torch_state_dict_api_refuses_where_it_cannot_route(
    dist_pool: PoolFactory, backend: BackendConfig
) -> None:
    """On a torch whose private helpers differ (simulated), torch's functions refuse
    optimizers over views with a FlatViewError naming flatview.checkpoint, before any
    collective, as before routing existed."""
    results = dist_pool(2).run(cw.torch_api_refused, backend.scenario(BASE), timeout=TIMEOUT)
    for rank, out in enumerate(results):
        assert len(out["messages"]) == 10, rank
        for message, collectives in zip(out["messages"][:8], out["collectives"][:8], strict=True):
            assert message is not None, rank
            assert collectives == 0, (rank, message)
        # flatview's own refusals travel in one small exchange first, so that a rank
        # refusing alone raises on every rank (none waits for it in a collective).
        assert out["messages"][8] is not None and out["messages"][9] is not None, rank
        assert out["collectives"][8] == out["collectives"][9] == results[0]["collectives"][8]
        for message in out["messages"][:8]:
            assert "flatview.checkpoint." in message and "views" in message, message
        assert "broadcast_from_rank0" in out["messages"][8]
        assert "flatten_optimizer_state_dict" in out["messages"][9]
        assert out["unchanged"] and out["flatview_ok"] and out["mark_removed"], rank
    if backend.backend == "torch":
        names = sorted(make_net(BASE).state_dict())
        assert results[0]["model_keys"] == names


@pytest.mark.parametrize(
    "backend",
    [
        backend_param(FULL_SHARD),
        backend_param(BackendConfig("torch", "NO_SHARD")),
        backend_param(HYBRID_CONFIGS[0]),
    ],
)
def test_fsdp_own_optimizer_state_functions_serve_or_refuse_views(
    dist_pool: PoolFactory, backend: BackendConfig
) -> None:
    """torch FSDP1's own optimizer-state functions, given an optimizer over flatview's
    views. The pair Lightning's FSDPStrategy and accelerate's FSDP1 plugin (so the Hugging
    Face Trainer) call, ``optim_state_dict`` / ``optim_state_dict_to_load``: served by
    flatview.checkpoint (the dict is ``fv.optim_state_dict``'s, and loads back
    unchanged; a dict one rank alone refuses raises on every rank; a full dict on rank
    0 alone, as accelerate's FSDP1 plugin loads it, loads unchanged on every rank, and
    what rank 0 cannot load raises on every rank). The other five (deprecated): a
    FlatViewError on every rank naming the functions to use instead, before any
    collective (torch failed inside a collective with mismatched sizes on gloo), the
    optimizers' state untouched. On a bare FSDP model in the same process they are
    torch's, unchanged."""
    scenario = backend.scenario(BASE)
    results = dist_pool(scenario.world_size).run(cw.fsdp_optim_api, scenario, timeout=TIMEOUT)
    count = len(cw.FSDP_OPTIM_FUNCTIONS)
    for rank, out in enumerate(results):
        assert out["messages"] and len(out["messages"]) % count == 0, rank  # per optimizer
        assert out["collectives"] == [0] * len(out["messages"]), rank
        for k, message in enumerate(out["messages"]):
            name = cw.FSDP_OPTIM_FUNCTIONS[k % count]
            assert message is not None, (rank, name)
            assert "views" in message and "torch.distributed.checkpoint" in message, message
            assert "flatview.checkpoint" in message, message
        assert out["unchanged"], rank
        assert out["served"] and all(out["served"]), rank
        assert out["served_unchanged"], rank
        # rank0_only: the state is on rank 0 alone (plain SGD keeps none anywhere).
        assert any(out["rank0_saved"]) == (rank == 0), (rank, out["rank0_saved"])
        assert out["rank0_loaded"], rank
        assert "rank 0" in out["rank0_refused"], out["rank0_refused"]
        assert "'state'" in out.get("one_rank_refuses", ""), (rank, out)
        assert out["bare_keys"] and out["bare_reloaded"], rank
    assert results[0]["bare_keys"] == results[1]["bare_keys"]


# ------------------------------------------------------------------- save and resume


def _check_run(out: dict[str, Any], scenario: Scenario) -> None:
    reference = run_reference(scenario).params
    compare(out["uninterrupted"], reference)
    for full in (False, True):
        assert_same_state(out[full]["loaded"], out["saved"], full)
        compare(out[full]["params"], reference)


@pytest.mark.parametrize(
    ("backend", "api"),
    [
        # torch's functions on FULL_SHARD are routed to flatview's: CI runs those
        # (fairscale's, at another world size, through test_whole.py's checkpoint test).
        backend_param(FULL_SHARD, "flatview", slow=True),
        backend_param(FAIRSCALE, "flatview", slow=True),
        backend_param(FULL_SHARD, "torch"),
    ],
)
def test_checkpoint_resumes_at_other_world_sizes_and_unwrapped(
    dist_pool: PoolFactory, backend: BackendConfig, api: str, tmp_path: Path
) -> None:
    """Saved at world size 2 (sharded and full) through flatview.checkpoint or torch's
    own functions (``api``), resumed the same way at 2 and 3 (fairscale's also on torch
    FSDP1) and into the plain model with torch's own functions: every run ends where the
    uninterrupted one does, and every load gives back the consolidated state that was
    saved."""
    scenario = backend.scenario(BASE)
    paths = {False: str(tmp_path / "sharded"), True: str(tmp_path / "full")}
    results = dist_pool(2).run(cw.save_and_resume, scenario, paths, SPLIT, api, timeout=TIMEOUT)
    out = results[0]
    assert out["full_equal"]
    _check_run(out, scenario)
    saved = out["saved"]

    wider = replace(scenario, world_size=3)
    want = reference_resumed(scenario, wider, SPLIT)
    # fairscale's checkpoint also resumes on torch FSDP1 (names and forms are the same).
    targets = [wider] + ([replace(wider, backend="torch")] if backend == FAIRSCALE else [])
    for target in targets:
        elsewhere = dist_pool(3).run(
            cw.resume_elsewhere, target, paths, SPLIT, api, timeout=TIMEOUT
        )[0]
        for full in (False, True):
            assert_same_state(elsewhere[full]["loaded"], saved, (target.backend, full))
            compare(elsewhere[full]["params"], want)

    # The unwrapped model, one process, torch's own functions.
    for full, path in paths.items():
        net = make_net(scenario)
        opts = optimizers(net)
        model_sd, optim_sd = dsd.get_state_dict(net, opts)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        # strict=False: torch's strict load wants state for every parameter, and plain
        # SGD keeps none (stem's optimizer); the comparisons below are exact anyway.
        dsd.set_state_dict(
            net,
            opts,
            model_state_dict=model_sd,
            optim_state_dict=optim_sd,
            options=dsd.StateDictOptions(strict=False),
        )
        assert_same_state(cw.as_numpy(dsd.get_state_dict(net, opts)[1]), saved, ("plain", full))
        for _ in reference_training(scenario, net, opts, optimizer_steps(scenario)[SPLIT:]):
            pass
        got = {k: v.detach().numpy().copy() for k, v in net.named_parameters()}
        compare(got, run_reference(scenario).params)


@pytest.mark.parametrize(
    ("backend", "options"),
    [
        backend_param(FULL_SHARD, "use-orig-params"),
        backend_param(BackendConfig("torch", "NO_SHARD"), "plain"),
    ],
)
def test_checkpoint_resumes_on_other_torch_configurations(
    dist_pool: PoolFactory, backend: BackendConfig, options: str, tmp_path: Path
) -> None:
    """torch's own views (use_orig_params) and replicated units (NO_SHARD, computed on
    views) through flatview.checkpoint, sharded and full, at world size 2."""
    extra = {"use_orig_params": True} if options == "use-orig-params" else {}
    scenario = backend.scenario(BASE, options=extra)
    paths = {False: str(tmp_path / "sharded"), True: str(tmp_path / "full")}
    out = dist_pool(2).run(cw.save_and_resume, scenario, paths, SPLIT, timeout=TIMEOUT)[0]
    assert out["full_equal"]
    _check_run(out, scenario)


@pytest.mark.parametrize(
    "backend",
    [
        backend_param(BackendConfig("torch", "HYBRID_SHARD")),
        backend_param(BackendConfig("torch", "_HYBRID_SHARD_ZERO2")),
        backend_param(BackendConfig("fsdp2", "HSDP")),
    ],
)
def test_hybrid_checkpoint_resumes_on_its_grid_and_on_two_ranks(
    dist_pool: PoolFactory, backend: BackendConfig, tmp_path: Path
) -> None:
    """Hybrid sharding (2 x 2), where replica peers hold the same shard: saved sharded and
    full on the grid, resumed on the grid and on 2 ranks of FULL_SHARD, every run ends
    where the uninterrupted one does and every load gives back the state saved (FSDP2's
    also on torch FSDP1)."""
    scenario = backend.scenario(BASE, world_size=4)
    paths = {False: str(tmp_path / "sharded"), True: str(tmp_path / "full")}
    out = dist_pool(4).run(cw.save_and_resume, scenario, paths, SPLIT, timeout=TIMEOUT)[0]
    assert out["full_equal"]
    _check_run(out, scenario)
    narrower = replace(scenario, world_size=2, strategy="FULL_SHARD")
    want = reference_resumed(scenario, narrower, SPLIT)
    # FSDP2's checkpoint (DTensors) also resumes on torch FSDP1 (ShardedTensors).
    others = [replace(narrower, backend="torch")] if backend.backend == "fsdp2" else []
    for target in [narrower, *others]:
        elsewhere = dist_pool(2).run(cw.resume_elsewhere, target, paths, SPLIT, timeout=TIMEOUT)[0]
        for full in (False, True):
            assert_same_state(elsewhere[full]["loaded"], out["saved"], (target.backend, full))
            compare(elsewhere[full]["params"], want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reading_the_state_midway_leaves_training_alone(
    dist_pool: PoolFactory, backend: BackendConfig
) -> None:
    """``fv.optim_state_dict``, flatview.checkpoint's dicts and torch's own functions
    between two steps, with the blocks of the AdamW not used so far (it has no state
    yet): the run still ends where the reference does. FSDP2 once lost its optimizers'
    DTensor state to the local pieces a read put in its place, and the next step failed;
    torch's ``get_state_dict`` on DDP and FSDP2, which flatview left to torch, primed
    an optimizer without state with a zero step (Adam's step count 1 before its first
    gradient: 0.05 off after three more steps)."""
    scenario = backend.scenario(UNUSED_ADAMW)
    results = dist_pool(scenario.world_size).run(
        cw.read_states_midway, scenario, SPLIT, timeout=TIMEOUT
    )
    compare(results[0], run_reference(scenario).params)


# ------------------------------------------------------------ blocks never used


def _placeholders_dropped(state: dict[str, Any]) -> dict[str, Any]:
    """What a user loading flatview's checkpoint with torch's own functions does first:
    drop the entries of parameters saved without state (every value ``None``)."""
    kept = {k: v for k, v in state["state"].items() if any(x is not None for x in v.values())}
    return {**state, "state": kept}


@pytest.mark.parametrize(
    "backend", [backend_param(c, ci=c == FSDP2) for c in BACKEND_CONFIGS if not c.runtime]
)
def test_checkpoint_after_blocks_never_used_resumes_exactly(
    dist_pool: PoolFactory, backend: BackendConfig, tmp_path: Path
) -> None:
    """LayerDrop: saved after steps that never used blocks 0 and 1, so that their
    optimizers have no state for them, resumed by a run whose template comes from fresh
    (primed) optimizers, at the same and at another world size, sharded and full: every
    run ends where the uninterrupted one does (torch's DCP load refused with ``Missing
    key ... .step``), and the resumed optimizers again have no state for those blocks
    (a partial load left the primed ``step`` there, 1.8e-2 off)."""
    scenario = backend.scenario(LAYERDROP)
    paths = {False: str(tmp_path / "sharded"), True: str(tmp_path / "full")}
    out = dist_pool(scenario.world_size).run(
        cw.save_and_resume, scenario, paths, SPLIT, timeout=TIMEOUT
    )[0]
    assert not any(n.startswith(("body.0.", "body.1.")) for n in out["saved"]["state"])
    _check_run(out, scenario)
    if backend.hybrid:
        other = replace(scenario, world_size=2, strategy="FULL_SHARD")
    else:
        other = replace(scenario, world_size=3)
    want = reference_resumed(scenario, other, SPLIT)
    elsewhere = dist_pool(other.world_size).run(
        cw.resume_elsewhere, other, paths, SPLIT, timeout=TIMEOUT
    )[0]
    for full in (False, True):
        assert_same_state(elsewhere[full]["loaded"], out["saved"], full)
        compare(elsewhere[full]["params"], want)
    if backend != FULL_SHARD:
        return
    # The unwrapped model with torch's own functions, placeholders dropped first.
    for path in paths.values():
        net = make_net(scenario)
        opts = optimizers(net)
        model_sd, optim_sd = dsd.get_state_dict(net, opts)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        dsd.set_state_dict(
            net,
            opts,
            model_state_dict=model_sd,
            optim_state_dict=_placeholders_dropped(optim_sd),
            options=dsd.StateDictOptions(strict=False),
        )
        for _ in reference_training(scenario, net, opts, optimizer_steps(scenario)[SPLIT:]):
            pass
        got = {k: v.detach().numpy().copy() for k, v in net.named_parameters()}
        compare(got, run_reference(scenario).params)


@pytest.mark.parametrize("backend", [backend_param(FULL_SHARD), backend_param(HYBRID_CONFIGS[0])])
def test_fsdp1_sharded_recipe_resumes_exactly(
    dist_pool: PoolFactory, backend: BackendConfig, tmp_path: Path
) -> None:
    """torch's own recipe for FSDP1's sharded optimizer checkpoints, as Lightning's
    ``FSDPStrategy`` runs it, over views: ``FSDP.optim_state_dict`` saved with DCP,
    loaded through ``load_sharded_optimizer_state_dict``, whose template is cut from the
    model's sharded state dict (dim 0 in even chunks, not the views' pieces), and
    ``FSDP.optim_state_dict_to_load``. The elements move to the views' pieces (it used
    to refuse: "holds 20 of this rank's 33 elements"). Saved at 2 ranks after steps that
    never used blocks 0 and 1 (no state for them), resumed at 2 and at 3 (hybrid: on its
    2 x 2 grid, and FULL_SHARD on 2): the loaded state is the saved one and training ends
    where the uninterrupted run does."""
    scenario = backend.scenario(LAYERDROP)
    path = str(tmp_path / "fsdp1")
    out = dist_pool(scenario.world_size).run(
        cw.fsdp1_recipe, scenario, path, SPLIT, True, timeout=TIMEOUT
    )[0]
    assert out["moved"] > 0
    assert not any(n.startswith(("body.0.", "body.1.")) for n in out["saved"]["state"])
    reference = run_reference(scenario).params
    compare(out["uninterrupted"], reference)
    assert_same_state(out["loaded"], out["saved"])
    compare(out["params"], reference)
    if backend.hybrid:
        other = replace(scenario, world_size=2, strategy="FULL_SHARD")
    else:
        other = replace(scenario, world_size=3)
    elsewhere = dist_pool(other.world_size).run(
        cw.fsdp1_recipe, other, path, SPLIT, False, timeout=TIMEOUT
    )[0]
    assert elsewhere["moved"] > 0
    assert_same_state(elsewhere["loaded"], out["saved"])
    compare(elsewhere["params"], reference_resumed(scenario, other, SPLIT))


def test_a_bare_fsdp1_run_resumes_under_flatview(dist_pool: PoolFactory, tmp_path: Path) -> None:
    """A user adds flatview to a torch FSDP1 run and resumes from the checkpoint the
    bare run saved with FSDP's own pair (one AdamW over the flat parameters, sharded
    with DCP and full), loading it into one AdamW over the views through the same
    pair: training ends where the bare run does (nothing skipped)."""
    scenario = FULL_SHARD.scenario(Scenario(skips=((), (), (), ())))
    out = dist_pool(2).run(
        cw.bare_fsdp1_resumed, scenario, str(tmp_path / "bare"), SPLIT, timeout=TIMEOUT
    )[0]
    for form in ("sharded", "full"):
        compare(out[form], out["uninterrupted"])


@pytest.mark.parametrize("backend", [backend_param(FSDP2, ci=True)])
def test_fsdp2_checkpoints_pass_between_bare_and_flatview(
    dist_pool: PoolFactory, backend: BackendConfig, tmp_path: Path
) -> None:
    """torch's own functions on FSDP2, which flatview routes on a wrapped model (its
    optimizer state then comes as ``ShardedTensor`` s, torch's as ``DTensor`` s): a
    bare run's checkpoint resumes under flatview, and that run's checkpoint resumes
    bare again, each ending where the uninterrupted bare run does."""
    scenario = backend.scenario(Scenario(skips=((), (), (), ())))
    out = dist_pool(scenario.world_size).run(
        cw.bare_fsdp2_both_ways, scenario, str(tmp_path), SPLIT, timeout=TIMEOUT
    )[0]
    compare(out["flatview"], out["uninterrupted"])
    compare(out["bare_again"], out["uninterrupted"])


@pytest.mark.parametrize("api", ["flatview", "torch"])
def test_optimizer_wrappers_are_read_not_rewritten(dist_pool: PoolFactory, api: str) -> None:
    """An optimizer wrapped as accelerate wraps it (``state`` and ``param_groups``
    properties over the real one), some of its parameters never stepped: its state dicts
    are the bare optimizer's, and it keeps its parameters and state. (Finding the keys
    of the missing state on a scratch copy of the wrapper wrote through its setters:
    the real optimizer was left over zero tensors, without state.)"""
    scenario = FULL_SHARD.scenario(LAYERDROP)
    for out in dist_pool(scenario.world_size).run(
        cw.through_a_wrapper, scenario, SPLIT, api, timeout=TIMEOUT
    ):
        assert out["params_kept"] and out["state_kept"], out
        assert out[False] and out[True], out


# ------------------------------------------------- optimizers that step optimizers


@pytest.mark.parametrize(
    "pause", [2, 3, None], ids=["before-step", "after-step", "after-zero-grad"]
)
@pytest.mark.parametrize(
    "backend", [backend_param(c, slow=c != FULL_SHARD) for c in BACKEND_CONFIGS]
)
def test_reading_a_lookahead_leaves_training_alone(
    dist_pool: PoolFactory, backend: BackendConfig, pause: int | None
) -> None:
    """Optimizers inside a Lookahead (it steps the optimizer it keeps, counts its steps in
    the shared parameter groups, and keeps no state of its own, so every parameter looks
    stateless): reading the state with flatview's and torch's functions, between a
    backward and its step, after the step or after ``zero_grad``, leaves training as it
    was. (Finding the
    state a first step would create by stepping a scratch copy of the Lookahead stepped
    the real inner optimizer and advanced the real counters: 0.02 off.)"""
    scenario = backend.scenario(UNUSED_ADAMW)
    results = dist_pool(scenario.world_size).run(
        cw.reading_stepping_optimizers, scenario, "lookahead", pause, timeout=TIMEOUT
    )
    assert results[0]["errors"] == []
    compare(results[0][True], results[0][False], tolerance=0.0)


def test_a_lookahead_resumes_exactly(dist_pool: PoolFactory, tmp_path: Path) -> None:
    """Optimizers inside a Lookahead, the AdamW's parameters without state at the save:
    saved sharded and resumed by a fresh model and fresh Lookaheads, the run ends where
    the uninterrupted one does (the placeholders carry the inner AdamW's keys)."""
    scenario = FULL_SHARD.scenario(UNUSED_ADAMW)
    out = dist_pool(scenario.world_size).run(
        cw.lookahead_resumes, scenario, str(tmp_path / "ckpt"), SPLIT, timeout=TIMEOUT
    )[0]
    compare(out["resumed"], out["uninterrupted"], tolerance=0.0)


def test_an_optimizer_stepping_unreachable_optimizers_is_refused(dist_pool: PoolFactory) -> None:
    """Optimizers stepped by one that keeps them in a list: flatview cannot find the
    state a first step would create without stepping them, so a read raises
    OptimStateError on every rank (between a backward and its step: gradients in
    place), and nothing was stepped: training goes on as without the read."""
    scenario = FULL_SHARD.scenario(UNUSED_ADAMW)
    results = dist_pool(scenario.world_size).run(
        cw.reading_stepping_optimizers, scenario, "chained", 2, timeout=TIMEOUT
    )
    for got in results:
        assert len(got["errors"]) == 4, got["errors"]
        assert all("Chained's step steps another optimizer" in e for e in got["errors"])
    compare(results[0][True], results[0][False], tolerance=0.0)


def _momentum_sgd() -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2, 2))]
    for p in params:
        p.grad = torch.ones_like(p)
    return params, torch.optim.SGD(params, lr=0.5, momentum=0.9)


def test_fresh_keys_of_a_stepping_optimizer_step_nothing_real() -> None:
    """The keys of a first step's state, found through a Lookahead whose inner optimizer
    points back at it (no endless walk): the inner optimizer's keys; the parameters
    (gradients in place), the inner state and the counters in the groups are as they
    were. Two optimizers as attributes, or one kept in a list, are refused."""
    from flatview import OptimStateError, fresh_state

    params, sgd = _momentum_sgd()
    lookahead = cw.Lookahead(sgd)
    sgd.back = lookahead  # type: ignore[attr-defined]
    before = [p.detach().clone() for p in params]
    assert fresh_state.fresh_keys(lookahead, params) == [("momentum_buffer",)] * 2
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    assert not sgd.state
    assert [g["lookahead_step"] for g in sgd.param_groups] == [0]

    lookahead.spare = torch.optim.SGD(params, lr=0.1)  # type: ignore[attr-defined]
    with pytest.raises(OptimStateError, match=r"Lookahead keeps 2 optimizers as attributes"):
        fresh_state.fresh_keys(lookahead, params)

    chained = cw.Chained([sgd])
    with pytest.raises(OptimStateError, match=r"Chained's step steps another optimizer \(SGD\)"):
        fresh_state.fresh_keys(chained, params)
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    assert not sgd.state

    # Stateless: by the inner optimizer's state (the wrapper keeps none of its own).
    del lookahead.spare  # type: ignore[attr-defined]
    params[1].grad = None
    sgd.step()
    assert fresh_state.stateless(lookahead) == [params[1]]
