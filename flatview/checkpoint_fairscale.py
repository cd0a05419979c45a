"""fairscale's own optimizer-state methods on a model wrapped by flatview.

fairscale's ``gather_full_optim_state_dict(optim)`` and
``get_shard_from_optim_state_dict(state)`` (fairseq checkpoints through this pair) know
its flat parameters: ``gather_full_optim_state_dict`` all-gathers every tensor of each
entry of ``optim.state_dict()["state"]`` as the state of one flat parameter. An
optimizer over views has other entries on each rank (one per view, and none where a
view holds nothing of this rank's, or where a step skipped it), so ranks pair different
collectives: rank 0 waited forever on gloo while rank 1 failed an assertion.

* ``gather_full_optim_state_dict(optim)`` is routed to
  :meth:`flatview.FlatView.optim_state_dict` ``(optim, rank0_only=True)``: rank 0 gets
  the consolidated state keyed by original name, the other ranks ``None``, as fairscale
  returns. A training script that saves through it keeps working.
* ``get_shard_from_optim_state_dict(state)`` is refused: it cuts a state for the flat
  parameters, and its result would be loaded by position into an optimizer over views.
  The error names :meth:`flatview.FlatView.load_optim_state_dict`, which loads the
  consolidated state matching parameters by name. The decision is local and the method
  communicates nothing, so no rank waits on another.

Installed by the handle on every unit that has both methods; ``unwrap()`` removes them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from flatview.backends.base import is_rank0
from flatview.checkpoint_optim import consolidated
from flatview.checkpoint_routing import Patch
from flatview.errors import OptimStateError
from flatview.runtime import Runtime

_GATHER = "gather_full_optim_state_dict"
_SHARD = "get_shard_from_optim_state_dict"


def route_fairscale_optim_state(runtime: Runtime, units: Sequence[nn.Module], patch: Patch) -> None:
    """On each of ``units`` that has fairscale's two optimizer-state methods, route the
    gathering to flatview's consolidated state and refuse the cutting (see the module
    docstring)."""
    for unit in units:
        if callable(getattr(unit, _GATHER, None)) and callable(getattr(unit, _SHARD, None)):
            patch(unit, _GATHER, functools.partial(_gather, runtime))
            patch(unit, _SHARD, _refuse_shard)


def _gather(
    runtime: Runtime, optim: torch.optim.Optimizer, **ignored: Any
) -> dict[str, Any] | None:
    """fairscale's ``gather_full_optim_state_dict``, on views: rank 0 gets
    :meth:`flatview.FlatView.optim_state_dict` ``(optim, rank0_only=True)``, the others
    ``None``. A collective, as fairscale's."""
    state = consolidated(runtime, optim, rank0_only=True)
    return state if is_rank0(runtime.adapter) else None


def _refuse_shard(full_optim_state_dict: Any, *args: Any, **kwargs: Any) -> Any:
    raise OptimStateError(
        f"fairscale's {_SHARD} cuts an optimizer state into pieces of FSDP's flat "
        "parameters, to be loaded by position; on a model wrapped by flatview the "
        "optimizers hold views. Load the state on every rank with "
        "fv.load_optim_state_dict(optimizer, state) (FlatView.load_optim_state_dict), "
        f"which takes what {_GATHER} returns on a wrapped model (the consolidated state "
        "by original name, as FlatView.optim_state_dict gives) and matches parameters by "
        "name"
    )
