"""Forwards inside a summoning (``summon_full_params``), for every FSDP adapter: the
wrapped module runs on the summoned full parameters, without the wrapper's forward or
flatview's, and the backward of such a forward is refused."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from flatview.errors import StateError


def _refuse_summoned_backward(grad: torch.Tensor) -> None:
    raise StateError(
        "backward of a forward that ran inside summon_full_params: the summoned full "
        "parameters are temporary, so their gradients would be lost (FSDP does not "
        "support a backward started inside summon_full_params either). Run forwards that "
        "train outside the summoning; inside it, evaluate or generate (torch.no_grad())."
    )


def forward_in_summon(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Run ``module`` (a unit's wrapped module) on the full parameters a summoning put on
    the submodules, without the wrapper's forward logic or flatview's.

    Inside ``summon_full_params`` every summoned unit's original attributes already hold
    its full parameters, so evaluation and generation need nothing from the wrapper; its
    forward would unshard and reshard again, which breaks the summoning (torch FSDP1 and
    fairscale fail at its exit, or with ``use_orig_params=True`` train on from stale
    shards). A backward of such a forward is refused when it starts."""
    output = module(*args, **kwargs)
    if torch.is_grad_enabled():
        for leaf in tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(_refuse_summoned_backward)
    return output
