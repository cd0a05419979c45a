"""accelerate DDP under a real ``torchrun`` (``test_integrations``): accelerate makes the
process group from the launcher's environment itself, flatview comes in with one
``prepare`` call, and rank 0 compares the final parameters with the single-process
reference, exiting non-zero on any difference.

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m tests.torchrun_accelerate
"""

from __future__ import annotations

import sys

import torch.distributed as dist
from accelerate import Accelerator

from flatview.integrations.accelerate import prepare
from tests import integration_workers as iw
from tests.accelerate_workers import epoch
from tests.scenarios import compare, make_net

RUN = iw.Run(iw.EVEN, accumulate=2, clip=0.05)


def main() -> int:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=RUN.accumulate)
    assert dist.is_initialized() and dist.get_world_size() == 2, "run me under torchrun"
    net = make_net(RUN.scenario)
    model, fv, opts = prepare(accelerator, net, lambda m: iw.make_optimizers(m, RUN))
    epoch(RUN, accelerator, model, fv, opts, list(enumerate(iw.local_batches(RUN))))
    params = iw.params_of(net)
    if dist.get_rank() == 0:
        compare(params, iw.reference(RUN))
        print("torchrun accelerate: same as the single-process reference")
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
