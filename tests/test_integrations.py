"""flatview where users train: the Lightning Trainer (FlatViewCallback), Fabric and
accelerate, against the real packages (the ``integrations`` extra), each run compared
with a single-process reference of the same semantics (:mod:`tests.integration_workers`).

The frameworks join the suite's worker pools instead of starting processes of their own;
every run is a few batches of the stochastic-depth scenario ``GATED``, whose skip sets
cover whole blocks, gates inside blocks and a top-level layer. Only the workers import
the frameworks (through :func:`tests.integration_workers.call`).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from tests import integration_workers as iw
from tests.scenarios import compare

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

LIGHTNING = "tests.lightning_workers"
ACCELERATE = "tests.accelerate_workers"
# The first task in a pool imports the framework (seconds to tens of seconds on a busy
# 2-core machine).
TIMEOUT = 240.0

needs_lightning = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None, reason="lightning is not installed"
)
needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed"
)
needs_accelerate = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None, reason="accelerate is not installed"
)


SLOW = pytest.mark.slow


def _run(pool: Any, module: str, name: str, *args: Any, **kwargs: Any) -> list[Any]:
    results: list[Any] = pool.run(iw.call, module, name, *args, timeout=TIMEOUT, **kwargs)
    return results


def _check(results: list[Any], run: iw.Run) -> None:
    compare(results[0], iw.reference(run))


# ------------------------------------------------------------------------ Trainer


@needs_lightning
@pytest.mark.parametrize(
    "run",
    [
        pytest.param(iw.Run(), id="automatic"),
        pytest.param(iw.Run(clip=0.05), id="gradient_clip_val"),
        pytest.param(iw.Run(iw.EVEN, accumulate=2), id="accumulate_grad_batches=2"),
        pytest.param(iw.Run(manual=True), id="manual"),
    ],
)
def test_trainer_ddp_trains_like_the_reference(dist_pool: PoolFactory, run: iw.Run) -> None:
    _check(_run(dist_pool(2), LIGHTNING, "trainer", run), run)


@needs_lightning
@pytest.mark.parametrize(
    "strategy",
    [
        "ddp",
        "fsdp2",
        "fsdp1_cpu",
        pytest.param("deepspeed2", marks=[SLOW, needs_deepspeed]),
        pytest.param("deepspeed3", marks=[SLOW, needs_deepspeed]),
    ],
)
def test_trainer_validating_every_batch_trains_like_the_reference(
    dist_pool: PoolFactory, strategy: str
) -> None:
    # Lightning's validation loop (under inference_mode on DDP, no_grad on FSDP; its
    # sanity check before the first batch; a loss logged with sync_dist) after every
    # training batch, between flatview's steps: training is the reference's.
    run = iw.Run(validate=True)
    _check(_run(dist_pool(2), LIGHTNING, "trainer", run, strategy=strategy), run)


@needs_lightning
def test_trainer_manual_with_steps_written_in_training_step(dist_pool: PoolFactory) -> None:
    # FlatViewCallback(enter_steps=False): training_step enters `with fv.step(...)` itself,
    # around the forward and manual_backward.
    run = iw.Run(manual=True)
    _check(_run(dist_pool(2), LIGHTNING, "trainer", run, user_steps="callback"), run)


@needs_lightning
def test_trainer_manual_own_wrap_trains_exactly(dist_pool: PoolFactory) -> None:
    # No callback: the LightningModule wraps itself at on_fit_start and writes
    # `with fv.step(...)` in training_step. Lightning runs training_step inside DDP's
    # forward, so that forward began before the step: on DDP flatview binds the step
    # there and finds the end of each backward inside the forward, so it trains exactly
    # (before that, each rank trained on its own gradients, silently; sharded wrappers
    # refuse it on every rank: tests/test_inside_forward.py).
    run = iw.Run(manual=True)
    _check(_run(dist_pool(2), LIGHTNING, "trainer", run, user_steps="own_wrap"), run)


@needs_lightning
@pytest.mark.parametrize(
    "run",
    [
        pytest.param(iw.Run(clip=0.05), id="gradient_clip_val"),
        pytest.param(iw.Run(manual=True), id="manual"),
    ],
)
def test_trainer_fsdp2_trains_like_the_reference(dist_pool: PoolFactory, run: iw.Run) -> None:
    # ModelParallelStrategy, sharding the LightningModule's net in configure_model.
    _check(_run(dist_pool(2), LIGHTNING, "trainer", run, strategy="fsdp2"), run)


@needs_lightning
@pytest.mark.parametrize(
    "run",
    [
        pytest.param(iw.Run(clip=0.05), id="gradient_clip_val"),
        pytest.param(iw.Run(manual=True, clip=0.05), id="manual"),
    ],
)
def test_flatview_fsdp_strategy_gives_views_to_configure_optimizers(
    dist_pool: PoolFactory, run: iw.Run
) -> None:
    # FlatViewFSDPStrategy (torch FSDP1, flat parameters) with FSDP built on CPU by the
    # test: configure_optimizers builds over views, and Lightning's clipping (which its
    # FSDP precision plugin refuses, and torch would take over this rank's pieces) is
    # routed to the norm of the whole gradients.
    _check(_run(dist_pool(2), LIGHTNING, "trainer", run, strategy="fsdp1_cpu"), run)


@needs_lightning
def test_flatview_fsdp_strategy_with_activation_checkpointing(dist_pool: PoolFactory) -> None:
    # activation_checkpointing_policy: torch's CheckpointWrapper inside every block's unit;
    # the scenario's skip sets name gates below it (body.i.gate).
    run = iw.Run(clip=0.05)
    _check(_run(dist_pool(2), LIGHTNING, "trainer", run, strategy="fsdp1_cpu_recompute"), run)


def _deepspeed_runs() -> list[object]:
    """(stage, run) cases of Lightning's DeepSpeedStrategy: resumed after the first epoch
    (ZeRO 2 in CI), and with accumulate_grad_batches=2 (ZeRO 1 in CI)."""
    resumed = iw.Run(iw.EVEN, epochs=2, clip=0.05)
    accumulated = iw.Run(iw.EVEN, accumulate=2, clip=0.05)
    return [
        pytest.param(stage, run, id=f"{name}-zero{stage}", marks=() if stage == ci else SLOW)
        for name, run, ci in (("resume", resumed, 2), ("accumulate", accumulated, 1))
        for stage in (1, 2, 3)
    ]


@needs_lightning
@needs_deepspeed
@pytest.mark.parametrize(("stage", "run"), _deepspeed_runs())
def test_trainer_deepspeed_trains_like_the_reference(
    dist_pool: PoolFactory, stage: int, run: iw.Run
) -> None:
    # Lightning's DeepSpeedStrategy (on CPU through a test subclass) with the callback,
    # skip sets and gradient_clip_val (DeepSpeed's gradient_clipping). "resume":
    # trainer.save_checkpoint after the first epoch (DeepSpeed's engine.save_checkpoint),
    # a new Trainer resuming with ckpt_path (its load_checkpoint): the reference's
    # training, uninterrupted. "accumulate": accumulate_grad_batches=2 (DeepSpeed's
    # gradient_accumulation_steps; Lightning hands DeepSpeed every micro-batch), a skip
    # set per micro-batch.
    _check(_run(dist_pool(2), LIGHTNING, "trainer", run, strategy=f"deepspeed{stage}"), run)


@needs_lightning
@needs_deepspeed
@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_trainer_deepspeed_bf16_trains_as_bare(dist_pool: PoolFactory, stage: int) -> None:
    # Lightning's DeepSpeedStrategy with precision="bf16-mixed": adding the callback to a
    # working Trainer gives the training it had, bit for bit (the fp32 masters). Nothing
    # skipped: bare DeepSpeed cannot skip (ZeRO 3 steps an unused parameter with the
    # gradient it had last; docs/limitations.md).
    run = iw.Run(replace(iw.EVEN, skips=((),) * len(iw.EVEN.skips)))
    for got in _run(dist_pool(2), LIGHTNING, "deepspeed_bf16_bare_and_wrapped", run, stage):
        assert got["bare"].keys() == got["flatview"].keys()
        for name, value in got["bare"].items():
            np.testing.assert_array_equal(got["flatview"][name], value, err_msg=name)


@needs_lightning
def test_flatview_fsdp_strategy_refuses_cpu(dist_pool: PoolFactory) -> None:
    for message in _run(dist_pool(2), LIGHTNING, "refused_fsdp1_on_cpu"):
        assert "FlatViewFSDPStrategy" in message and "needs a GPU" in message, message


@needs_lightning
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_trainer_checkpoint_resumes_exactly(dist_pool: PoolFactory, strategy: str) -> None:
    # trainer.save_checkpoint after the first epoch; a new Trainer, module and callback
    # resume from it (Lightning's own checkpointing: torch's get_state_dict under FSDP2).
    # Manual optimization: AdamW and SGD with momentum, state for every parameter.
    run = iw.Run(iw.EVEN, manual=True, epochs=2)
    _check(_run(dist_pool(2), LIGHTNING, "trainer", run, strategy=strategy), run)


@needs_lightning
@pytest.mark.parametrize(
    ("again", "clip"),
    [(False, None), (True, None), (False, 0.05)],
    ids=["fresh_module", "same_module", "clipped"],
)
def test_trainer_with_experts_resumes_like_the_reference(
    dist_pool: PoolFactory, again: bool, clip: float | None
) -> None:
    # Experts on meshes of their own (FSDP2, one rank each: the pool of 2 has Lightning
    # imported already; groups of 2 out of 4 checkpoint alike, tests/test_moe.py) under
    # ModelParallelStrategy, experts skipped per batch through FlatViewCallback;
    # trainer.save_checkpoint after the first epoch and a fresh module (other initial
    # values) resumed from it: each group's experts come back to its own ranks (torch's
    # functions, which Lightning calls, are routed to flatview.checkpoint's keys).
    # "same_module": the same module and callback fit again, resumed from the checkpoint
    # (the callback goes on with the model it kept wrapped after the first fit).
    # "clipped": self.clip_gradients by the norm over every group's experts, as the
    # reference (holding them all) clips.
    from tests import moe_workers as mw

    case = mw.MoECase("fsdp2", 2, group_size=1, unit_per_expert=True, steps=4, clip=clip)
    for rank, worst in enumerate(_run(dist_pool(2), LIGHTNING, "trainer_moe", case, again)):
        assert worst <= 1e-5, (rank, worst)


@needs_lightning
@pytest.mark.parametrize(
    ("how", "strategy"), [("wrap", "fsdp2"), ("flatview_of", "fsdp2"), ("flatview_of", "ddp")]
)
def test_trainer_automatic_optimization_with_whole_muon(
    dist_pool: PoolFactory, how: str, strategy: str
) -> None:
    # flatview.optim.Whole(torch.optim.Muon) built in configure_optimizers over the views
    # of flatview.wrap(self) (FlatViewCallback adopts that FlatView) or of
    # flatview_of(self.trainer) (the callback wraps then); Lightning's automatic
    # optimization steps it with a closure; a layer skipped every other batch; FSDP2
    # (ModelParallelStrategy) or DDP: as torch's Muon on the unwrapped net.
    found = _run(dist_pool(2), LIGHTNING, "trainer_muon", how, strategy)
    for rank, worst in enumerate(found):
        assert worst <= 1e-5, (rank, worst)


@needs_lightning
@pytest.mark.parametrize("form", ["sharded", "full", pytest.param("orig", marks=pytest.mark.slow)])
def test_flatview_fsdp_strategy_checkpoints_optimizers_over_views(
    dist_pool: PoolFactory, form: str
) -> None:
    # FlatViewFSDPStrategy(use_orig_params=False), two optimizers over views, in either
    # of Lightning's checkpoint forms: Lightning saves them with FSDP.optim_state_dict
    # and loads them with FSDP.optim_state_dict_to_load (sharded: through torch's recipe,
    # a template cut FSDP's way filled by DCP), both served over views; the resumed fit
    # ends where the reference does. (The full form's context does not offload to CPU
    # here: torch FSDP1 cannot, for a model on CPU.) "orig": Lightning's default
    # use_orig_params=True, optimizers over torch's own parameters, sharded.
    run = iw.Run(iw.EVEN, manual=True, epochs=2)
    strategy = "fsdp1_cpu_checkpoint" + ("" if form == "sharded" else f"_{form}")
    _check(_run(dist_pool(2), LIGHTNING, "trainer", run, strategy=strategy), run)


# ------------------------------------------------------------------------- Fabric


@needs_lightning
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
@pytest.mark.parametrize(
    "run",
    [
        pytest.param(iw.Run(manual=True, clip=0.05), id="clip"),
        pytest.param(iw.Run(iw.EVEN, accumulate=2), id="accumulate"),
    ],
)
def test_fabric_trains_like_the_reference(
    dist_pool: PoolFactory, strategy: str, run: iw.Run
) -> None:
    _check(_run(dist_pool(2), LIGHTNING, "fabric", run, strategy), run)


@needs_lightning
@needs_deepspeed
@pytest.mark.parametrize(
    ("stage", "run"),
    [
        pytest.param(2, iw.Run(iw.EVEN, clip=0.05), id="zero2-clip"),
        pytest.param(
            3, iw.Run(iw.EVEN, manual=True), id="zero3-two_optimizers", marks=pytest.mark.slow
        ),
    ],
)
def test_fabric_deepspeed_trains_and_resumes_like_the_reference(
    dist_pool: PoolFactory, stage: int, run: iw.Run
) -> None:
    # Fabric's DeepSpeedStrategy (on CPU through a test subclass): fabric.setup(model,
    # Deferred), flatview.wrap, the optimizers built from views handed to the Deferred;
    # fabric.save / fabric.load (the engine's checkpoints) resume exactly.
    _check(_run(dist_pool(2), LIGHTNING, "fabric_deepspeed", run, stage), run)


# --------------------------------------------------------------------- accelerate


@needs_accelerate
def test_accelerate_fsdp1_optimizers_resume_from_full_state_on_rank0(
    dist_pool: PoolFactory, tmp_path: Path
) -> None:
    # accelerate's save_fsdp_optimizer / load_fsdp_optimizer with FULL_STATE_DICT as its
    # FSDP1 plugin configures it (offloaded, rank 0 alone), over views: every rank gets
    # its pieces of rank 0's dict (FSDP.optim_state_dict_to_load with rank0_only, which
    # flatview used to refuse), the loaded state is the saved one, and the resumed run
    # ends where the uninterrupted one does. Blocks 0 and 1 are never used before the
    # save (no state for them; one optimizer has none at all).
    from tests.scenarios import BackendConfig, Scenario
    from tests.test_checkpoint_api import assert_same_state

    layerdrop = Scenario(
        inner=(5, 3, 4), norms=(True, False, True), skips=((0, 1), (0, 1), (), (2,))
    )
    scenario = BackendConfig("torch", "FULL_SHARD").scenario(layerdrop)
    out = dist_pool(2).run(
        iw.call,
        ACCELERATE,
        "fsdp1_optimizers_full_on_rank0",
        scenario,
        2,
        str(tmp_path),
        timeout=TIMEOUT,
    )[0]
    assert_same_state(out["loaded"], out["saved"])
    compare(out["resumed"], out["uninterrupted"])


@needs_accelerate
@pytest.mark.parametrize(
    "run",
    [
        pytest.param(iw.Run(iw.EVEN, accumulate=2, clip=0.05), id="accumulate_clip"),
        pytest.param(iw.Run(manual=True, clip=0.05), id="two_optimizers"),
    ],
)
def test_accelerate_ddp_trains_like_the_reference(dist_pool: PoolFactory, run: iw.Run) -> None:
    # prepare(model) -> flatview.wrap -> optimizers from views -> prepare(optimizers).
    _check(_run(dist_pool(2), ACCELERATE, "train", run), run)


@needs_accelerate
@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT)
def test_accelerate_ddp_under_torchrun_trains_like_the_reference() -> None:
    """The same run (accumulation and clipping) launched by a real ``torchrun``:
    accelerate makes the process group from the launcher's environment itself, not the
    suite's pool (tests/torchrun_accelerate.py; rank 0 compares with the reference).
    Slow (8-12 s: a launcher and two fresh interpreters); the pool's runs above train
    the same way through the same prepare."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", "2", "-m", "tests.torchrun_accelerate"]
    done = subprocess.run(
        command, cwd=root, env=env, capture_output=True, text=True, timeout=TIMEOUT - 10
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "same as the single-process reference" in done.stdout, done.stdout[-3000:]


@needs_accelerate
@needs_deepspeed
@pytest.mark.parametrize(
    ("stage", "run"),
    [
        pytest.param(1, iw.Run(iw.EVEN, accumulate=2, clip=0.05), id="zero1-accumulate_clip"),
        pytest.param(
            2, iw.Run(iw.EVEN, manual=True), id="zero2-two_optimizers", marks=pytest.mark.slow
        ),
        pytest.param(
            3, iw.Run(iw.EVEN, accumulate=2), id="zero3-accumulate", marks=pytest.mark.slow
        ),
    ],
)
def test_accelerate_deepspeed_trains_and_resumes_like_the_reference(
    dist_pool: PoolFactory, stage: int, run: iw.Run
) -> None:
    # accelerate's DeepSpeed plugin on CPU (not cpu=True, which falls back to DDP): the
    # engine built with a Deferred, wrapped, handed the optimizers built from views;
    # accelerator.backward steps it at its boundary; save_state / load_state are the
    # engine's checkpoints. (Two optimizers: no clipping, which DeepSpeed does over all.)
    _check(_run(dist_pool(2), ACCELERATE, "train", run, resume=True, deepspeed_stage=stage), run)


@needs_accelerate
@needs_deepspeed
@pytest.mark.parametrize("stage", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_accelerate_deepspeed_bf16_trains_as_bare(dist_pool: PoolFactory, stage: int) -> None:
    # accelerate's DeepSpeed plugin in bf16 with accumulation: going through prepare
    # gives the training the bare prepare(model, optimizer) gave, bit for bit (the fp32
    # masters). Nothing skipped: bare DeepSpeed cannot skip.
    run = iw.Run(replace(iw.EVEN, skips=((),) * len(iw.EVEN.skips)), accumulate=2)
    for got in _run(dist_pool(2), ACCELERATE, "deepspeed_bf16_bare_and_wrapped", run, stage):
        assert got["bare"].keys() == got["flatview"].keys()
        for name, value in got["bare"].items():
            np.testing.assert_array_equal(got["flatview"][name], value, err_msg=name)


@needs_accelerate
@pytest.mark.parametrize("hook", ["FP16", pytest.param("BF16", marks=pytest.mark.slow)])
def test_accelerate_ddp_comm_hook_trains_as_bare(dist_pool: PoolFactory, hook: str) -> None:
    # DistributedDataParallelKwargs(comm_hook=...): accelerate registers torch's
    # compression hook as it prepares the model; through prepare with flatview the
    # training is bare accelerate's with the hook, bit for bit, and not the one without
    # it (flatview used to refuse these hooks).
    run = iw.Run(replace(iw.EVEN, skips=((),) * len(iw.EVEN.skips)))
    got = _run(dist_pool(2), ACCELERATE, "ddp_comm_hook_bare_and_wrapped", run, hook)[0]
    plain = _run(dist_pool(2), ACCELERATE, "ddp_comm_hook_bare_and_wrapped", run, "NO")[0]
    moved = max(np.abs(plain["bare"][n] - v).max() for n, v in got["bare"].items())
    assert moved > 1e-6  # the hook changes the numbers: a bypassed hook would show
    for name, value in got["bare"].items():
        np.testing.assert_array_equal(got["flatview"][name], value, err_msg=name)


@needs_accelerate
def test_accelerate_save_and_load_state_resume_exactly(dist_pool: PoolFactory) -> None:
    run = iw.Run(iw.EVEN, manual=True)
    _check(_run(dist_pool(2), ACCELERATE, "train", run, resume=True), run)


@needs_accelerate
@pytest.mark.parametrize("accumulate", [1, 2])
def test_accelerate_whole_muon_trains_like_the_reference(
    dist_pool: PoolFactory, accumulate: int
) -> None:
    # prepare's factory of (model, fv) builds flatview.optim.Whole(torch.optim.Muon) over
    # the views (DDP: every view whole); accelerate's optimizer wrapper steps it at the
    # end of each accumulation; a layer skipped every other micro-batch.
    for rank, worst in enumerate(_run(dist_pool(2), ACCELERATE, "muon", accumulate)):
        assert worst <= 1e-5, (rank, worst)


@needs_accelerate
def test_accelerate_fsdp_plugin_turned_ddp_is_refused(dist_pool: PoolFactory) -> None:
    for message in _run(dist_pool(2), ACCELERATE, "refused_fsdp_on_cpu"):
        assert message.startswith("MULTI_CPU: ") and "FSDP plugin" in message, message


@pytest.mark.parametrize("clip", [None, 0.05])
def test_accelerate_fsdp1_order_gives_views_and_whole_norm_clipping(
    dist_pool: PoolFactory, clip: float | None
) -> None:
    # accelerate's FSDP1 runs only on GPUs: a stand-in Accelerator that wraps in torch
    # FSDP1 on CPU (flat parameters) shows prepare's order and clip_grad_norm_'s routing.
    run = iw.Run(manual=True, clip=clip)
    _check(dist_pool(2).run(iw.accelerate_fsdp1_order, run, timeout=TIMEOUT), run)


@needs_lightning
def test_trainer_exception_leaves_the_step(dist_pool: PoolFactory) -> None:
    for result in _run(dist_pool(2), LIGHTNING, "exception_leaves_the_step"):
        assert result == {"raised": "boom before the backward", "phase": "IDLE", "patched": False}


@needs_lightning
def test_fabric_with_experts_saves_and_loads_exactly(dist_pool: PoolFactory) -> None:
    # Fabric's ModelParallelStrategy, experts on meshes of their own (one rank each):
    # fabric.save, trained on, fabric.load, trained on again: the load undoes the extra
    # steps, each group's experts back to its own ranks.
    from tests import moe_workers as mw

    case = mw.MoECase("fsdp2", 2, group_size=1, unit_per_expert=True, steps=4)
    for rank, worst in enumerate(_run(dist_pool(2), LIGHTNING, "fabric_moe", case)):
        assert worst <= 1e-5, (rank, worst)


@needs_lightning
def test_fabric_setup_optimizers_over_views(dist_pool: PoolFactory) -> None:
    for result in _run(dist_pool(2), LIGHTNING, "fabric_optimizers_over_views"):
        assert "does not seem to reference any FSDP parameters" in result["fabric"], result
        assert result["helper"] == "same" and result["restored"] == "True", result
        assert result["flat"].startswith("OptimStateError: "), result
