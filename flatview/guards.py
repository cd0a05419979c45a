"""Guards that catch a model using a parameter its step declared skipped.

A skipped parameter gets no gradient and no communication, so a model that uses it
anyway would train wrongly in silence. :class:`SkipGuards` hooks the tensors of skipped
parameters so that their gradient raises
:class:`~flatview.errors.SkippedParameterUsedError` in the backward:

* the compute tensors the wrapper sets for a flat parameter's skipped segments (made
  anew each forward, so their hooks are removed when the iteration ends);
* skipped plain parameters, which persist: each gets one hook, the first time it is
  skipped, that checks the iteration in flight when it fires (registering and removing
  hooks on every skipped parameter every step cost more than a check per gradient).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Protocol

import torch

from flatview.iteration import Iteration
from flatview.phase import Phase
from flatview.skip import skipped_used
from flatview.table import FlatRecord, ParamTable


class InFlight(Protocol):
    """What a plain parameter's guard asks when it fires: the runtime's state."""

    phase: Phase
    iteration: Iteration | None


def _plain_guard(
    owner: weakref.ref[InFlight], index: int, name: str
) -> Callable[[torch.Tensor], None]:
    """The persistent guard hook of plain parameter ``index`` (weakly bound: a
    parameter that outlives its model's runtime must not keep it alive)."""

    def refuse(grad: torch.Tensor) -> None:
        runtime = owner()
        if runtime is None or runtime.phase is not Phase.COMPUTING:
            return
        iteration = runtime.iteration
        if iteration is not None and index in iteration.skipped:
            raise skipped_used(name)

    return refuse


class SkipGuards:
    """The guard hooks of one wrapped model (see the module docstring)."""

    def __init__(self, table: ParamTable) -> None:
        self.table = table
        self._guards: list[torch.utils.hooks.RemovableHandle] = []
        # Per plain parameter index: its guard hook, kept from step to step.
        self._plain_guards: dict[int, torch.utils.hooks.RemovableHandle] = {}

    def guard_segments(self, record: FlatRecord, segments: list[tuple[int, str]]) -> None:
        """Hook the compute tensors the wrapper just set on the submodules for the
        skipped ``(segment, name)`` s of ``record``."""
        for segment, name in segments:
            seen: set[int] = set()
            for owner in record.spec.owners[segment]:
                # Wrappers set plain tensors, which land in the instance dict while the
                # views are stepped aside; torch with use_orig_params registers its own.
                tensor = owner.module.__dict__.get(owner.attr)
                if tensor is None:
                    tensor = owner.module._parameters.get(owner.attr)
                if isinstance(tensor, torch.Tensor) and id(tensor) not in seen:
                    seen.add(id(tensor))
                    self._guard(tensor, name)

    def _guard(self, tensor: torch.Tensor, name: str) -> None:
        def refuse(grad: torch.Tensor) -> None:
            raise skipped_used(name)

        if tensor.requires_grad:
            self._guards.append(tensor.register_hook(refuse))

    def guard_plain(self, runtime: InFlight, iteration: Iteration) -> None:
        """Give every skipped plain parameter of ``iteration`` its persistent hook."""
        for index in iteration.skipped:
            if index in self._plain_guards:
                continue
            param = self.table.params[index]
            if param.flat is None and param.tensor.requires_grad:
                hook = _plain_guard(weakref.ref(runtime), index, param.name)
                self._plain_guards[index] = param.tensor.register_hook(hook)

    def remove(self) -> None:
        """Remove the hooks on compute tensors (the iteration ended)."""
        for handle in self._guards:
            handle.remove()
        self._guards.clear()

    def remove_plain(self) -> None:
        """Remove the persistent hooks of plain parameters (unwrap)."""
        for handle in self._plain_guards.values():
            handle.remove()
        self._plain_guards.clear()
