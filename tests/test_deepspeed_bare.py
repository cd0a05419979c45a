"""Bare DeepSpeed (no flatview) against the single-process reference: what "the training
you had" is on DeepSpeed, settled before flatview is compared with it.

Finding (DeepSpeed 0.19.8): its config's ``gradient_clipping`` defaults to 1.0, not 0, so
an engine built without that key clips every step's gradients by their global norm at
1.0. A probe that compared such an engine with an unclipped reference matched to 1.5e-8
after one step and drifted 7.6e-3 after five: exactly from the first step whose gradient
norm exceeded 1. With ``"gradient_clipping": 0.0`` ZeRO 1, 2 and 3 train like torch's
AdamW on the whole batch in one process (about 1e-7 after 8 steps, world sizes 1-3); left
at its default, like that reference with ``torch.nn.utils.clip_grad_norm_(params, 1.0)``
before each step. Nothing else differs: no loss scaling in fp32 (scale 1), gradients
averaged over the ranks, the client's torch AdamW stepped as given (DeepSpeed swaps in
its own Adam only when the config names the optimizer), no learning-rate scheduler
unless configured, one micro-batch per step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pytest

from tests import deepspeed_workers as w
from tests.scenarios import compare

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

pytest.importorskip("deepspeed")

STEPS = 6
TIMEOUT = 240
NO_CLIPPING = {"gradient_clipping": 0.0}
slow = pytest.mark.slow


def _stage_sizes() -> list[object]:
    """ZeRO 1 and 2 on 2 ranks in CI; ZeRO 3 (about 1 s a case) and the other world sizes
    in the thorough run."""
    return [
        pytest.param(
            stage,
            world,
            id=f"zero{stage}-ws{world}",
            marks=() if world == 2 and stage != 3 else slow,
        )
        for stage in (1, 2, 3)
        for world in (1, 2, 3)
    ]


@pytest.mark.parametrize(("stage", "world"), _stage_sizes())
def test_bare_zero_matches_the_reference_without_clipping(
    dist_pool: PoolFactory, stage: int, world: int
) -> None:
    results = dist_pool(world).run(w.bare_deepspeed_mlp, stage, STEPS, NO_CLIPPING, timeout=TIMEOUT)
    reference = w.reference_mlp(STEPS, world, clip=None)
    for result in results:
        # DeepSpeed steps the client optimizer itself (no fused or CPU Adam swapped in).
        assert result["optimizers"][1] == "AdamW"
        compare(result["params"], reference["params"])


def test_bare_zero_clips_at_one_by_default(dist_pool: PoolFactory) -> None:
    """The cause of the probe's drift: DeepSpeed's default config clips."""
    results = dist_pool(2).run(w.bare_deepspeed_mlp, 1, STEPS, {}, timeout=TIMEOUT)
    clipped = w.reference_mlp(STEPS, 2, clip=1.0)
    unclipped = w.reference_mlp(STEPS, 2, clip=None)
    # The gradients are large enough for clipping to act in these steps.
    assert max(clipped["norms"]) > 1.5
    for result in results:
        assert result["clipping"] == 1.0
        compare(result["params"], clipped["params"])
        drift = max(
            float(np.abs(result["params"][k] - unclipped["params"][k]).max())
            for k in unclipped["params"]
        )
        assert drift > 1e-3


@pytest.mark.parametrize("stage", [1, 2, pytest.param(3, marks=slow)])
def test_bare_zero_steps_parameters_a_step_skipped(dist_pool: PoolFactory, stage: int) -> None:
    """What flatview corrects: bare DeepSpeed gives a parameter its forward did not use a
    zero gradient (``ignore_unused_parameters``), and AdamW then decays it and moves it by
    its momentum, where the unwrapped model's AdamW leaves it alone. (It does leave such
    gradients out of its reduction: the bytes equal flatview's, see
    test_deepspeed_backend.py.)"""
    from tests.test_deepspeed_backend import SC

    results = dist_pool(2).run(w.bare_scenario, SC, stage, timeout=TIMEOUT)
    reference = w.run_reference(SC, "one", 0.0).params
    assert reference is not None
    for params in results:
        drift = {k: float(np.abs(params[k] - reference[k]).max()) for k in reference}
        # body.3 is skipped in the last step: bare DeepSpeed moved it anyway.
        assert max(v for k, v in drift.items() if k.startswith("body.3.")) > 1e-3, drift
