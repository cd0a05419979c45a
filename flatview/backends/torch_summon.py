"""Views step aside for the length of a torch FSDP1 summoning, for both torch FSDP1
adapters.

Summoning (``summon_full_params``, which is a static method, and the full and sharded
``state_dict`` / ``load_state_dict`` hooks) unshards through ``handle.pre_unshard()``
with ``handle._training_state == SUMMON_FULL_PARAMS`` before it touches any module
attribute, and ends with ``handle.post_reshard()`` after the flat parameter is
registered again: views step aside between the two. A unit's forward inside a summoning
runs the wrapped module on the summoned parameters (:func:`summonable`)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed import utils as dist_utils

from flatview.backends.patches import Lend, Patches
from flatview.backends.summoning import forward_in_summon


class SummonLending:
    """Views step aside for the length of a summoning (``summon_full_params``, full or
    sharded ``state_dict``): torch unshards each unit through ``handle.pre_unshard()``
    with ``handle._training_state == SUMMON_FULL_PARAMS`` before it touches any module
    attribute, and ends with ``handle.post_reshard()`` after the flat parameter is
    registered again. The views step aside at the first unit's entry and come back at
    the last unit's exit, through ``lend``."""

    def __init__(self, lend: Lend) -> None:
        self._state = _summoning_states()[1]
        self._lend = lend
        self._units: set[int] = set()
        self._lent = contextlib.ExitStack()

    def patch(self, handle: Any, patches: Patches) -> None:
        """Shadow ``handle``'s two methods with bracketing ones (through ``patches``,
        which removes them with the rest)."""
        patches.patch(handle, "pre_unshard", self._entry(handle))
        patches.patch(handle, "post_reshard", self._exit(handle))

    def close(self) -> None:
        self._units.clear()
        self._lent.close()

    def _entry(self, handle: Any) -> Callable[[], bool]:
        original = handle.pre_unshard

        def pre_unshard() -> bool:
            if handle._training_state is self._state and id(handle) not in self._units:
                if not self._units:
                    self._lent.enter_context(self._lend())
                self._units.add(id(handle))
            result: bool = original()
            return result

        return pre_unshard

    def _exit(self, handle: Any) -> Callable[[], None]:
        original = handle.post_reshard

        def post_reshard() -> None:
            original()
            # torch registered the flat parameter again before resharding: the summoning
            # of this unit is over.
            if handle._training_state is self._state and id(handle) in self._units:
                self._units.discard(id(handle))
                if not self._units:
                    self._lent.close()

        return post_reshard


@functools.cache
def _summoning_states() -> tuple[Any, Any]:
    """torch's states of a unit and of a handle inside a summoning."""
    from torch.distributed.fsdp._common_utils import HandleTrainingState, TrainingState

    return TrainingState.SUMMON_FULL_PARAMS, HandleTrainingState.SUMMON_FULL_PARAMS


def summoning(unit: Any) -> bool:
    """Whether ``unit`` is inside ``summon_full_params`` (its submodules hold the full
    parameters)."""
    return bool(unit.training_state is _summoning_states()[0])


def summonable(
    unit: Any, original: Callable[..., Any], device: torch.device | None
) -> Callable[..., Any]:
    """``unit.forward`` (``original``), except inside ``summon_full_params`` of the unit
    (:func:`summoning`), where its submodules hold the full parameters and the wrapped
    module runs on them directly (see :func:`~flatview.backends.summoning.forward_in_summon`);
    ``device``: the root's compute device, which inputs are moved to as torch's root
    pre-forward does (``None`` for other units)."""

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not summoning(unit):
            return original(*args, **kwargs)
        if device is not None and device.type != "cpu":
            moved_args, moved_kwargs = dist_utils._to_kwargs(args, kwargs, device, False)
            args = moved_args[0] if moved_args else ()
            kwargs = moved_kwargs[0] if moved_kwargs else {}
        return forward_in_summon(unit._fsdp_wrapped_module, *args, **kwargs)

    return forward
