"""The masked gather of fairscale's ``_rebuild_full_params``: while some of a unit's
flat parameters are partly skipped, fairscale's module-level ``dist`` is pointed at
:class:`MaskedGatherDist` for the length of one call (``FairscaleAdapter._masking_gather``),
so that their all-gathers move only the segments the step uses."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from flatview.layout import MaskPlan

if TYPE_CHECKING:
    from flatview.backends.base import Runtime


class MaskedGatherDist:
    """``torch.distributed`` as fairscale's ``_rebuild_full_params`` sees it while some
    of the unit's flat parameters are partly skipped: their gathers are masked, every
    other call passes through."""

    def __init__(
        self, real: Any, runtime: Runtime, plans: dict[int, tuple[Any, MaskPlan]], unit: int
    ):
        self._real = real
        self._runtime = runtime
        self._plans = plans
        self._unit = unit

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def _plan_for(self, source: torch.Tensor) -> MaskPlan | None:
        # The gather's input is the flat parameter's current data (its fp32 or fp16
        # shard); anything else (e.g. a copy moved to another device) goes unmasked.
        for flat, plan in self._plans.values():
            if flat.data.data_ptr() == source.data_ptr():
                return plan
        return None

    def _all_gather_base(self, output: torch.Tensor, source: torch.Tensor, **kw: Any) -> Any:
        plan = self._plan_for(source)
        if plan is None:
            return self._real._all_gather_base(output, source, **kw)
        world = plan.layout.world_size
        rows = list(output.view(world, -1).unbind(0))
        self._runtime.gather_masked(rows, source, plan, self._unit)
        return None

    def all_gather(self, chunks: list[torch.Tensor], source: torch.Tensor, **kw: Any) -> Any:
        plan = self._plan_for(source)
        if plan is None:
            return self._real.all_gather(chunks, source, **kw)
        self._runtime.gather_masked(chunks, source, plan, self._unit)
        return None
