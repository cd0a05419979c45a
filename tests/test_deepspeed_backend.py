"""flatview on DeepSpeed's ZeRO engine (stages 1, 2 and 3): training exactly like the
unwrapped model with per-submodule optimizers and skip sets, the bytes reduced, errors.

DeepSpeed's first import in a worker takes 5-10 s on a busy 2-core machine, and a ZeRO 3
case about 1 s where a ZeRO 1/2 one takes 0.2 s, so the CI profile runs one world size
(2): every stage of the exact-training test and of the refusals that differ by stage,
ZeRO 1 and 2 of the rest; the other world sizes, ZeRO 3 of the rest and the drawn
scenarios are ``slow`` (``nox -s tests_thorough``).
"""

from __future__ import annotations

import operator
import re
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import deepspeed_workers as w
from tests.scenarios import FAIRSCALE, GATED, Scenario, assert_equivalent, compare, scenarios

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

pytest.importorskip("deepspeed")

TIMEOUT = 300
STAGES = (1, 2, 3)
SLOW = pytest.mark.slow
# Six steps: every block skipped in some and used in others, gates and aux too.
SC = replace(GATED, skips=(*GATED.skips, (3, "aux")))
slow = pytest.mark.slow


def _cases(
    worlds: tuple[int, ...], quick_world: int = 2, ci_stages: tuple[int, ...] = STAGES
) -> list[object]:
    """(stage, world size) cases: those of ``quick_world`` and ``ci_stages`` in CI."""
    return [
        pytest.param(
            stage,
            world,
            id=f"zero{stage}-ws{world}",
            marks=() if world == quick_world and stage in ci_stages else slow,
        )
        for stage in STAGES
        for world in worlds
    ]


def _stages(ci: tuple[int, ...] = STAGES) -> list[object]:
    """Every stage, those outside ``ci`` ``slow``."""
    return [
        pytest.param(stage, id=str(stage), marks=() if stage in ci else slow) for stage in STAGES
    ]


@pytest.mark.parametrize(("stage", "world"), _cases((1, 2, 3)))
def test_several_optimizers_and_skip_sets_train_like_the_reference(
    dist_pool: PoolFactory, stage: int, world: int
) -> None:
    """Per-submodule optimizers (AdamW and SGD with and without momentum) handed to
    flatview.optim.Deferred, DeepSpeed's default clipping (1.0, active in these steps),
    six steps of stochastic depth: the unwrapped model's training, skipped parameters
    without gradients (no weight decay, no momentum)."""
    _trains_like_the_reference(dist_pool, replace(SC, world_size=world), stage, 1.0)


def _trains_like_the_reference(
    dist_pool: PoolFactory, scenario: Scenario, stage: int, clip: float
) -> None:
    """Per-submodule optimizers and clipping at ``clip`` (which must act): the
    reference's training, and the norms engine.get_global_grad_norm() reports (before
    clipping, as DeepSpeed does) the reference's."""
    world = scenario.world_size
    results = dist_pool(world).run(
        w.run_flatview, scenario, stage, "several", clip, timeout=TIMEOUT
    )
    reference = w.run_reference(scenario, "several", clip)
    assert max(reference.norms) > clip  # clipping acts
    assert_equivalent(results, reference, scenario)
    for got in results:
        assert got.grad_norms == pytest.approx(reference.norms, rel=1e-5)


def test_a_model_built_under_zero_init_trains_like_the_reference(dist_pool: PoolFactory) -> None:
    """ZeRO 3 with the net built under deepspeed.zero.Init (each parameter partitioned as
    its module is made, as large models are loaded): per-submodule optimizers, clipping
    and skip sets train like the unwrapped model."""
    results = dist_pool(2).run(
        w.run_flatview, SC, 3, "several", 1.0, None, False, True, timeout=TIMEOUT
    )
    assert_equivalent(results, w.run_reference(SC, "several", 1.0), SC)


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp32"])
def test_no_sync_on_zero1_trains_as_bare_deepspeed(dist_pool: PoolFactory, bf16: bool) -> None:
    """ZeRO 1's engine.no_sync(): the micro-steps inside it keep their gradients on
    DeepSpeed's parameters, the next backward outside it reduces the sums (masked by
    what any of them used), as bare DeepSpeed: bit for bit, skipping against bare
    running the skipped blocks times zero."""
    skips = ((), (1,), (0,), (1,), (1,), (1,))
    scenario = Scenario(world_size=2, skips=skips)
    _assert_as_bare(
        dist_pool(2).run(w.against_bare, scenario, 1, True, bf16, 2, True, timeout=TIMEOUT)
    )


@pytest.mark.parametrize(("stage", "world"), _cases((1, 2, 3)))
def test_gradient_accumulation_trains_like_the_reference(
    dist_pool: PoolFactory, stage: int, world: int
) -> None:
    """gradient_accumulation_steps=2 with per-submodule optimizers, clipping and a skip
    set per micro-step: the unwrapped model accumulating two micro-batches per step
    (each loss divided by 2, as engine.backward does). At each boundary a parameter's
    view has a gradient exactly where some micro-step of the window used it."""
    skips = (*SC.skips, (0, 1, 2, 3), (0, 1, 2, 3))  # the last window skips every block
    scenario = replace(SC, world_size=world, accumulate=2, skips=skips)
    _trains_like_the_reference(dist_pool, scenario, stage, 0.6)


@pytest.mark.parametrize("stage", [1, pytest.param(2, marks=SLOW), pytest.param(3, marks=SLOW)])
def test_writes_through_views_inside_an_accumulation_window(
    dist_pool: PoolFactory, stage: int
) -> None:
    """A value written through a view between the micro-steps of a window (ZeRO 1 keeps
    the window's gradients on DeepSpeed's parameters meanwhile) is what the next
    micro-step computes with and what the step updates: the unwrapped model doing the
    same between its micro-batches."""
    scenario = replace(SC, accumulate=2, skips=((),) * 4)
    for found in dist_pool(2).run(w.written_in_window, scenario, stage, timeout=TIMEOUT):
        assert max(found.values()) <= 1e-5, found


@pytest.mark.parametrize("stage", STAGES)
def test_accumulation_communicates_as_the_stage_does(dist_pool: PoolFactory, stage: int) -> None:
    """gradient_accumulation_steps=2, bytes counted at the calls (the exact exchange):
    ZeRO 1 makes no collective at all before the boundary (its skip-set check waits for
    the boundary's) and reduces there exactly what the window used; ZeRO 2/3 reduce in
    every micro-step exactly what it used. Bare DeepSpeed reduces in the same
    micro-steps."""
    pool = dist_pool(2)
    flatview_rows = pool.run(w.gradient_bytes, SC, stage, "all_to_all", False, 2, timeout=TIMEOUT)
    bare_rows = pool.run(w.gradient_bytes, SC, stage, "auto", True, 2, timeout=TIMEOUT)
    for mine, bare in zip(flatview_rows, bare_rows, strict=True):
        rows = mine["rows"]
        for micro, row in enumerate(rows):
            assert row["counted"] == row["ledger"], (micro, row)
            if stage == 1 and micro % 2 == 0:
                assert row["all calls"] == {}, (micro, row)
                assert bare["rows"][micro]["counted"] == 0, micro
                continue
            flats = row["flats"]
            if stage == 1:  # the window's: this micro-step's and the one before
                earlier = rows[micro - 1]["flats"]
                flats = [
                    (layout, tuple(map(operator.or_, used, before)))
                    for (layout, used), (_, before) in zip(flats, earlier, strict=True)
                ]
            assert row["counted"] == _used_bytes(flats) > 0, (micro, row)
            assert bare["rows"][micro]["counted"] > 0, micro


@pytest.mark.parametrize(("stage", "world"), _cases((1, 2, 3), ci_stages=(1, 2)))
def test_the_engines_own_optimizer_steps_views(
    dist_pool: PoolFactory, stage: int, world: int
) -> None:
    """The script DeepSpeed users have (one AdamW given to deepspeed.initialize,
    engine.backward, engine.step) plus fv.step(skip=...): AdamW leaves skipped
    parameters alone, as on the unwrapped model; no clipping configured. ZeRO 2 calls
    the loss's own backward() (DeepSpeed supports both)."""
    scenario = replace(SC, world_size=world)
    direct = stage == 2
    results = dist_pool(world).run(
        w.run_flatview, scenario, stage, "one", 0.0, None, direct, timeout=TIMEOUT
    )
    assert_equivalent(results, w.run_reference(scenario, "one", 0.0), scenario)


ZERO_OPTIONS = {
    # Every parameter gathered and freed per submodule (none persistent), several
    # sub-groups, prefetching, small buckets.
    "zero3-unpersistent": (
        3,
        {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "sub_group_size": 40,
            "stage3_prefetch_bucket_size": 50,
            "reduce_bucket_size": 60,
        },
    ),
    # Flat buffers in round-robin order, DeepSpeed's overlap and buckets (idle: flatview
    # reduces), flatview's own buckets of 60 elements.
    "zero2-round-robin": (
        2,
        {
            "stage": 2,
            "round_robin_gradients": True,
            "overlap_comm": True,
            "reduce_bucket_size": 60,
            "contiguous_gradients": False,
        },
    ),
    "zero1-groups": (1, {"stage": 1, "reduce_bucket_size": 60}),
}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=slow if n.startswith("zero3") else ()) for n in ZERO_OPTIONS]
)
def test_zero_options_train_like_the_reference(dist_pool: PoolFactory, name: str) -> None:
    """ZeRO's own options that move parameters or lay them out otherwise, and an engine
    optimizer with two parameter groups (two flat partitions under ZeRO 1/2, one
    sub-group split in several under ZeRO 3)."""
    stage, zero = ZERO_OPTIONS[name]
    extra = {"zero_optimization": zero}
    results = dist_pool(2).run(w.run_flatview, SC, stage, "groups", 0.0, extra, timeout=TIMEOUT)
    assert_equivalent(results, w.run_reference(SC, "groups", 0.0), SC)


EXPECTED = {
    "used": r"SkippedParameterUsedError: parameter 'body\.1\.[a-z]+\.(weight|bias)' is declared",
    "mismatch": r"SkipSetMismatchError",
}


@pytest.mark.parametrize("stage", _stages(ci=(1, 2)))
def test_errors_raise_on_every_rank_and_training_goes_on_exactly(
    dist_pool: PoolFactory, stage: int
) -> None:
    """A declared-skipped parameter used, and ranks that skip differently: raised on
    every rank (no hang), and after engine.zero_grad() the training is the reference's."""
    kinds = ("used", "mismatch")
    results = dist_pool(2).run(w.recovery, SC, stage, kinds, timeout=TIMEOUT)
    for got in results:
        assert len(got["errors"]) == len(kinds), got["errors"]
        for kind, message in zip(kinds, got["errors"], strict=True):
            assert re.search(EXPECTED[kind], message), (kind, message)
        assert got["phase"] == "IDLE"
    compare(results[0]["params"], w.run_reference(SC).params)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("kind", ["used", "mismatch"])
def test_errors_inside_an_accumulation_window(
    dist_pool: PoolFactory, stage: int, kind: str
) -> None:
    """gradient_accumulation_steps=2: the boundary's micro-step raises on every rank after
    a micro-step that used every parameter; engine.zero_grad() drops the window, so the
    next boundary steps only what follows (a parameter only the dropped micro-step used
    has no gradient: no weight decay, no momentum), as the unwrapped model after
    zero_grad(set_to_none=True)."""
    scenario = replace(SC, accumulate=2, skips=SC.skips[:5])
    got = dist_pool(2).run(w.recovery_in_window, scenario, stage, kind, timeout=TIMEOUT)
    steps = [range(0, 1), range(1, 3), range(3, 5)]  # the first ends the broken window
    reference = w.run_reference(scenario, "several", 0.0, steps)
    for rank in got:
        (message,) = rank["errors"]
        assert re.search(EXPECTED[kind], message), (kind, message)
        # Views without elements on a rank never have a gradient there.
        assert set(rank["none_grads"][0]) == {*reference.none_grads[0], *rank["empty"]}
    assert "body.1.up.weight" in reference.none_grads[0]  # the dropped micro-step used it
    compare(got[0]["params"], reference.params)


@pytest.mark.parametrize("stage", _stages())
def test_backwards_of_unseen_forwards_raise_on_every_rank(
    dist_pool: PoolFactory, stage: int
) -> None:
    """A backward through a forward run before flatview.wrap (which under ZeRO 1/2 lost
    the step without a word, and crashed inside DeepSpeed's hooks under ZeRO 3), or a
    second backward through one forward: a StateError on every rank, before anything is
    reduced or stepped; after engine.zero_grad() the training is the reference's."""
    results = dist_pool(2).run(w.unseen_backwards, SC, stage, timeout=TIMEOUT)
    expected = ["before wrap", "second backward"] + (["module before wrap"] if stage != 3 else [])
    for got in results:
        assert sorted(got["errors"]) == sorted(expected), got["errors"]
        for name, message in got["errors"].items():
            assert message.startswith("StateError: "), (name, message)
            assert "retain_graph=True" in message, (name, message)
            if name != "second backward":
                assert "the forward ran before flatview.wrap" in message, (name, message)
        assert got["phase"] == "IDLE"
        compare(got["params"], w.run_reference(SC, "one", 0.0).params)


def _used_bytes(flats: list[tuple[object, tuple[bool, ...]]]) -> int:
    """4 bytes per element of every used segment (fp32), from the layouts alone."""
    return 4 * sum(
        segment.numel
        for layout, used in flats
        for segment, flag in zip(layout.segments, used, strict=True)  # type: ignore[attr-defined]
        if flag
    )


@pytest.mark.parametrize(("stage", "world"), _cases((2, 3), ci_stages=(1, 2)))
def test_skipping_reduces_only_the_used_gradients(
    dist_pool: PoolFactory, stage: int, world: int
) -> None:
    """Bytes counted at the collective calls of each backward: with the exact exchange
    (reduce_strategy="all_to_all") exactly the used gradients; by default one collective
    per backward moving what bare DeepSpeed moves (ZeRO 1/2: the used gradients when
    something is skipped, the padded flat buffer when nothing is; ZeRO 3: each used
    parameter padded to a multiple of the world size, as DeepSpeed's reduce-scatter)."""
    pool = dist_pool(world)
    scenario = replace(SC, world_size=world)
    exact = pool.run(w.gradient_bytes, scenario, stage, "all_to_all", False, timeout=TIMEOUT)
    default = pool.run(w.gradient_bytes, scenario, stage, "auto", False, timeout=TIMEOUT)
    bare = pool.run(w.gradient_bytes, scenario, stage, "auto", True, timeout=TIMEOUT)
    for rank in range(world):
        rows = zip(exact[rank]["rows"], default[rank]["rows"], bare[rank]["rows"], strict=True)
        for micro, (e, d, p) in enumerate(rows):
            used = _used_bytes(e["flats"])
            assert e["counted"] == e["ledger"] == e["used"] == used, (micro, e)
            assert d["counted"] == d["ledger"], (micro, d)
            assert sum(d["calls"].values()) == 1, (micro, d)
            if SC.skips[micro] or stage == 3:
                assert d["counted"] == p["counted"], (micro, d, p)
            if SC.skips[micro] and stage != 3:
                assert d["counted"] == used, (micro, d)
            assert used <= d["counted"] <= d["dense"], (micro, d)


@pytest.mark.parametrize("stage", _stages(ci=(1, 2)))
def test_optimizer_and_model_state_by_original_name(dist_pool: PoolFactory, stage: int) -> None:
    """FlatView.optim_state_dict of each per-submodule optimizer, and flatview.checkpoint's
    full model and optimizer state, by original name: the reference's."""
    results = dist_pool(2).run(w.optimizer_states, SC, stage, timeout=TIMEOUT)
    reference = w.reference_optimizer_states(SC)
    reference_params = w.run_reference(SC).params
    merged_reference = {name: s for states in reference for name, s in states.items()}
    for got in results:
        assert len(got["optimizers"]) == len(reference)
        for state, want in zip(got["optimizers"], reference, strict=True):
            _compare_states(state, want)
        _compare_states(got["merged"], merged_reference)
        compare(got["model"], reference_params)
        assert got["views_back"]
        shapes = got["module_shapes"]
        assert set(shapes) == set(reference_params)
        if stage != 3:
            assert all(shapes[k] == reference_params[k].shape for k in shapes)


def _compare_states(got: dict[str, dict], want: dict[str, dict]) -> None:
    # Parameters skipped in every step they could have stepped in have no state on
    # either side.
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for name, entries in want.items():
        assert got[name].keys() == entries.keys(), name
        for key, value in entries.items():
            if isinstance(value, np.ndarray) and value.ndim:
                np.testing.assert_allclose(got[name][key], value, rtol=1e-4, atol=1e-5)
            else:
                assert float(got[name][key]) == pytest.approx(float(value)), (name, key)


@pytest.mark.parametrize(
    ("first", "then", "sharded"),
    [
        pytest.param(1, 3, True, id="zero1-to-zero3-dcp", marks=slow),
        pytest.param(3, 2, False, id="zero3-to-zero2-full", marks=slow),
        pytest.param(2, 1, True, id="zero2-to-zero1-dcp"),
    ],
)
def test_resume_from_a_checkpoint_on_another_stage(
    dist_pool: PoolFactory, first: int, then: int, sharded: bool
) -> None:
    """Saved with flatview.checkpoint after three steps, loaded into a fresh engine of
    another ZeRO stage (values written into the views, published at the next forward),
    trained on: the reference's training, uninterrupted."""
    results = dist_pool(2).run(w.resume, SC, first, then, 3, sharded, timeout=TIMEOUT)
    reference = w.run_reference(SC).params
    for got in results:
        compare(got["params"], reference)


REFUSED = {
    "stage0": r"ZeRO stages 1, 2 and 3; this engine runs stage 0",
    "fp16 as reported": r"fp32 and bf16 training; this engine trains with fp16",
    "offload": r"does not support ZeRO offload",
    "unmanaged accumulation": r"managed_gradient_accumulation",
    "fp32 accumulation": r"accumulates gradients in torch.float32 \(data_types.grad_accum_dtype\)",
    "fp32 accumulation, ZeRO 1": r"data_types.grad_accum_dtype",
    "communication": r"communication_data_type",
    "prescale": r"prescale_gradients",
    "quantized": r"ZeRO\+\+ quantized",
    "scheduler": r"Deferred and a learning-rate scheduler",
    "stepped": r"has state already",
    "adagrad": r"Adagrad",
}


def test_unsupported_configurations_are_refused_at_wrap(dist_pool: PoolFactory) -> None:
    """Every configuration flatview has not made exact is a WrapError naming it. (fp16:
    DeepSpeed itself refuses it on CPU, "Type fp16 is not supported on your device";
    flatview's check is the one bf16 takes.)"""
    labels = tuple(REFUSED)
    for got in dist_pool(2).run(w.refusals, labels, timeout=TIMEOUT):
        for label, pattern in REFUSED.items():
            assert got[label].startswith("WrapError: "), (label, got[label])
            assert re.search(pattern, got[label]), (label, got[label])


def test_internals_and_version_checked_at_wrap(dist_pool: PoolFactory) -> None:
    """An engine or ZeRO internal the adapter touches taken away (as a DeepSpeed that
    renamed it would), or a DeepSpeed outside the tested series: a WrapError naming it
    and the versions, before anything is patched; the engine wraps once it is back."""
    for got in dist_pool(2).run(w.internals_refused, timeout=TIMEOUT):
        assert set(got) == {"_backward_prologue", "partitions", "masters", "version"}
        for label, result in got.items():
            message = result["message"]
            assert message != "no error", label
            if label == "version":
                assert "tested with DeepSpeed 0.19.x (DeepSpeed 0.19.8), found 0.20.0" in message
            else:
                assert re.search(rf"\b{re.escape(result['name'])}\b", message), message
                assert "checked against DeepSpeed 0.19.8; found DeepSpeed 0.19.8" in message
            assert not result["patched"], label
            assert result["wraps"], label


@pytest.mark.parametrize("stage", _stages())
def test_deepspeed_operations_that_would_be_wrong_are_refused(
    dist_pool: PoolFactory, stage: int
) -> None:
    """coalesce_grad_reduction accumulates in a way flatview does not drive;
    an optimizer built before wrapping over DeepSpeed's own parameters would train
    copies the engine overwrites (refused at its first step). torch's get_state_dict,
    which would take a view's optimizer state for a whole parameter's, gives what
    flatview.checkpoint.get_state_dict gives, and torch's set_state_dict loads it back
    (routed)."""
    for got in dist_pool(2).run(w.refused_while_wrapped, stage, timeout=TIMEOUT):
        early = got.pop("early optimizer")
        assert early.startswith("StateError: "), early
        assert "holds DeepSpeed's own module parameters" in early, early
        assert got.pop("torch get_state_dict") == "routed"
        assert got.pop("torch set_state_dict") == "routed"
        for name, message in got.items():
            assert message.startswith("StateError: "), (name, message)
            assert "not supported while flatview wraps" in message, (name, message)


@pytest.mark.parametrize("stage", _stages(ci=(2,)))
def test_a_step_before_the_accumulation_boundary_is_refused(
    dist_pool: PoolFactory, stage: int
) -> None:
    """The ZeRO optimizer stepped directly inside an accumulation window (as Fabric steps
    it; engine.step() steps only at the boundary) would step views without gradients
    and drop what the window accumulated: StateError on every rank, before any
    collective of the step."""
    for message in dist_pool(2).run(w.stepped_inside_window, stage, timeout=TIMEOUT):
        assert message.startswith("StateError: "), message
        assert "before the engine's gradient accumulation boundary" in message, message


@pytest.mark.parametrize("stage", _stages(ci=(3,)))
def test_evaluations_and_writes_between_steps_train_like_the_reference(
    dist_pool: PoolFactory, stage: int
) -> None:
    """tests/test_leftovers.py's programs on DeepSpeed (which keeps no unsharded copy
    past a forward but ZeRO 3's persistent parameters, which its step gathers anew):
    evaluations between a backward and ``engine.step()``, writes through the views after
    one. A validation loss with autograd on between them is refused at ``engine.step()``
    on every rank, with the remedy (the model is still computing then)."""
    scenario = Scenario(world_size=2, skips=((), (1,), (0,), (1,), ()), batch_per_rank=2)
    for program in ("TESTESTES", "TSEWTSEW"):
        got = dist_pool(2).run(w.leftover_program, scenario, stage, program, timeout=TIMEOUT)
        assert "params" in got[0], (program, got[0])
        compare(got[0]["params"], w.leftover_reference(scenario, program))
    for got in dist_pool(2).run(w.leftover_program, scenario, stage, "TGS", timeout=TIMEOUT):
        message = got.get("error", "")
        assert message.startswith("StateError: engine.step() while the model is COMPUTING")
        assert "under torch.no_grad()" in message, message


@pytest.mark.parametrize("stage", _stages(ci=(1, 2)))
def test_one_rank_refusing_raises_on_every_rank(dist_pool: PoolFactory, stage: int) -> None:
    """tests/test_refusals.py's cases on DeepSpeed: every collective entry point of the
    public API misused on rank 1 only raises on every rank (the pool checks that the
    ranks' collective counts agree; its timeout fails a hang), and everything works
    again afterwards, training included. Rank 1's odd optimizer holds DeepSpeed's own
    parameters (built before wrapping)."""
    from tests.test_refusals import EXPECTED

    # The odd optimizer holds DeepSpeed's own parameters: named by shape, or refused by
    # the adapter's optimizer check where flatview.checkpoint primes it.
    odd = r"Parameter of shape \(|holds DeepSpeed's own module parameters"
    expected = {
        case: pattern.replace(r"Parameter of shape \(2, 3\)", odd)
        for case, pattern in EXPECTED.items()
    }
    results = dist_pool(2).run(w.one_rank_refuses, SC, stage, timeout=TIMEOUT)
    for rank, out in enumerate(results):
        assert sorted(out) == sorted(expected), rank
        for case, pattern in expected.items():
            assert re.search(pattern, out[case]), (rank, case, out[case])


@pytest.mark.parametrize("stage", _stages(ci=(1, 2)))
def test_unwrap_hands_back_bare_deepspeed(dist_pool: PoolFactory, stage: int) -> None:
    """After fv.unwrap() the engine trains as bare DeepSpeed: its gradient hooks and
    step are its own again, its optimizer steps its partitions (with fresh state)."""
    split = 3
    scenario = replace(SC, skips=(*SC.skips[:split], (), (), ()))
    results = dist_pool(2).run(w.unwrap_then_bare, scenario, stage, split, timeout=TIMEOUT)
    reference = w.reference_unwrapped(scenario, split)
    for got in results:
        compare(got["params"], reference)


@slow
@given(data=st.data())
@settings(max_examples=max(4, settings().max_examples // 4))
def test_drawn_scenarios_train_like_the_reference(
    dist_pool: PoolFactory, data: st.DataObject
) -> None:
    """Drawn models (block widths, gates, norms, tied weights, frozen parameters), skip
    sets, world sizes 1-3, ZeRO stage, one optimizer or several, clipping, one or two
    micro-batches per step (gradient_accumulation_steps)."""
    drawn = data.draw(scenarios(world_sizes=(2, 3, 1), configs=(FAIRSCALE,)))
    scenario = replace(
        drawn,
        backend="deepspeed",
        set_to_none=True,
        zero_grad_at="after_step",
        evaluate=False,
        unwrap_after=None,
        options={},
        # torch's activation checkpointing inside the blocks stays (the net does it);
        # apply_activation_checkpointing is the wrapping code's, which DeepSpeed's runs
        # leave out.
        recompute="" if drawn.recompute == "inside-wrapper" else drawn.recompute,
    )
    stage = data.draw(st.sampled_from(STAGES), label="stage")
    mode = data.draw(st.sampled_from(("several", "one")), label="mode")
    clip = data.draw(st.sampled_from((0.0, 1.0, 0.05)), label="clip")
    results = dist_pool(scenario.world_size).run(
        w.run_flatview, scenario, stage, mode, clip, timeout=TIMEOUT
    )
    assert_equivalent(results, w.run_reference(scenario, mode, clip), scenario)


@pytest.mark.parametrize("stage", [1, pytest.param(3, marks=slow)])
def test_whole_matrix_optimizers_over_the_partitions(dist_pool: PoolFactory, stage: int) -> None:
    """flatview.optim.Whole(torch.optim.Muon, ...) on the matrices, AdamW on the rest, both
    given to a Deferred: torch's Muon on the unwrapped model (float32 Newton-Schulz in
    both runs, see tests/test_whole.py)."""
    from tests.whole_workers import MuonRun
    from tests.whole_workers import reference as muon_reference

    run = MuonRun(SC, float32=True)
    results = dist_pool(2).run(w.muon_whole, run, stage, timeout=TIMEOUT)
    reference = muon_reference(run)
    for got in results:
        compare(got["params"], reference["params"])
        state = got["state"]["state"]
        for name, buffer in reference["momentum"].items():
            np.testing.assert_allclose(
                state[name]["momentum_buffer"].numpy(), buffer, rtol=1e-4, atol=1e-5
            )


@pytest.mark.parametrize("stage", [1, pytest.param(3, marks=slow)])
def test_whole_parameter_norms(dist_pool: PoolFactory, stage: int) -> None:
    """FlatView.param_norms / grad_norms of the pieces: the whole parameters' norms,
    None for the gradients of skipped parameters, every step."""
    results = dist_pool(2).run(w.norms, SC, stage, timeout=TIMEOUT)
    reference = w.reference_norms(SC)
    for got in results:
        assert len(got) == len(reference)
        for step, (mine, want) in enumerate(zip(got, reference, strict=True)):
            assert mine["params"] == pytest.approx(want["params"], rel=1e-5), step
            assert mine["grads"].keys() == want["grads"].keys()
            for name, value in want["grads"].items():
                if value is None:
                    assert mine["grads"][name] is None, (step, name)
                else:
                    assert mine["grads"][name] == pytest.approx(value, rel=1e-4), (step, name)


@pytest.mark.parametrize("stage", _stages(ci=(3,)))
def test_gathered_parameters_over_views_is_refused(dist_pool: PoolFactory, stage: int) -> None:
    """ZeRO 3 code's deepspeed.zero.GatheredParameters(module.parameters()) on a wrapped
    engine would gather nothing (views are not DeepSpeed's): refused on every rank,
    naming the view; disabled, it passes; after fv.unwrap() it gathers again."""
    for got in dist_pool(2).run(w.gathered_parameters, SC, stage, timeout=TIMEOUT):
        for case in ("all views", "one view, modifier"):
            assert got[case].startswith("StateError: deepspeed.zero.GatheredParameters"), got
        assert "stem.weight" in got["one view, modifier"], got
        assert got["disabled"] == "nothing raised", got
        assert got["after unwrap"] == "whole", got


@pytest.mark.parametrize(
    ("stage", "world", "skipping"),
    [
        pytest.param(2, 2, True, id="zero2-ws2-skipping"),
        pytest.param(1, 2, True, id="zero1-ws2-skipping", marks=slow),
        pytest.param(3, 2, True, id="zero3-ws2-skipping"),
        pytest.param(1, 2, False, id="zero1-ws2-adamw", marks=slow),
        pytest.param(2, 2, False, id="zero2-ws2-adamw", marks=slow),
        pytest.param(3, 2, False, id="zero3-ws2-adamw", marks=slow),
        pytest.param(1, 3, False, id="zero1-ws3", marks=slow),
    ],
)
def test_bf16_trains_as_bare_deepspeed_bf16(
    dist_pool: PoolFactory, stage: int, world: int, skipping: bool
) -> None:
    """bf16 over fp32 masters: gradients reduced as DeepSpeed reduces them (divided,
    then summed in bf16), so wrapped and bare give the same bf16 parameters (ZeRO 1/2)
    and fp32 masters, bit for bit; skipping against bare DeepSpeed running the skipped
    blocks times zero. (On three ranks and more a masked or differently bucketed sum may
    differ in its last bf16 bit: on ZeRO 1 with nothing skipped, one bucket, it does not.
    Clipping is left out: flatview clips as torch's clip_grad_norm_, which DeepSpeed's
    formula matches only to the last fp32 bit.)"""
    scenario = Scenario(world_size=world, skips=((), (1,), (0,), (), (1,)))
    _assert_as_bare(dist_pool(world).run(w.against_bare, scenario, stage, skipping))


def _assert_as_bare(results: list[dict[str, Any]]) -> None:
    for got in results:
        assert got["bare"].keys() == got["flatview"].keys()
        for name, value in got["bare"].items():
            np.testing.assert_array_equal(got["flatview"][name], value, err_msg=name)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp32"])
@pytest.mark.parametrize(
    "skipping", [True, pytest.param(False, marks=slow)], ids=["skipping", "adamw"]
)
def test_gradient_accumulation_trains_as_bare_deepspeed(
    dist_pool: PoolFactory, stage: int, bf16: bool, skipping: bool
) -> None:
    """gradient_accumulation_steps=2: ZeRO 1 accumulates on DeepSpeed's parameters and
    reduces at the boundary, ZeRO 2/3 reduce every micro-step and add the averaged
    shards in the parameters' dtype, as bare DeepSpeed does: bit for bit, bf16 and
    fp32, skipping against bare DeepSpeed running the skipped blocks times zero."""
    skips = ((), (1,), (0,), (1,), (1,), (1,))  # the last window never uses body.1
    scenario = Scenario(world_size=2, skips=skips)
    _assert_as_bare(
        dist_pool(2).run(w.against_bare, scenario, stage, skipping, bf16, 2, timeout=TIMEOUT)
    )
