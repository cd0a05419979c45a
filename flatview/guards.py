"""Guards that catch a model using a parameter its step declared skipped.

A skipped parameter gets no gradient and no communication, so a model that uses it
anyway would train wrongly in silence. :class:`SkipGuards` hooks the tensors of skipped
parameters so that their gradient raises
:class:`~flatview.errors.SkippedParameterUsedError` in the backward:

* the compute tensors the wrapper sets for a flat parameter's skipped segments (made
  anew each forward, so their hooks are removed when the iteration ends). With half of
  a large model skipped these are thousands of hooks per step, so they are put in the
  tensor's hook dictionary directly, as ``Tensor.register_hook`` does but without its
  per-call overhead (a third of the cost; :func:`flatview.autograd.hook_gradient`);
* skipped plain parameters, which persist: each gets one hook, the first time it is
  skipped, that checks the iteration in flight when it fires (registering and removing
  hooks on every skipped parameter every step cost more than a check per gradient).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from flatview.autograd import Hooked, hook_gradient, unhook_gradient
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


_Place = tuple[dict[str, Any], dict[str, Any], str]
"""Where a wrapper sets a compute tensor: the owner's instance dict, its registered
parameters, the attribute."""


def _refuse(name: str, grad: torch.Tensor) -> None:
    raise skipped_used(name)


class SkipGuards:
    """The guard hooks of one wrapped model (see the module docstring)."""

    def __init__(self, table: ParamTable) -> None:
        self.table = table
        # Per guarded compute tensor, where its guard is (hook_gradient).
        self._guards: list[Hooked] = []
        # Per plain parameter index: its guard hook, kept from step to step.
        self._plain_guards: dict[int, torch.utils.hooks.RemovableHandle] = {}
        # Per flat record index, per segment: the places the wrapper sets its compute
        # tensor at (owner's instance dict, registered parameters, attribute), resolved
        # once: the owners are fixed at wrap time, and a view replaced by a new
        # parameter keeps its owner's module and attribute.
        self._places: dict[int, tuple[tuple[_Place, ...], ...]] = {}
        # Per parameter name, its refusing hook: one callable for every step.
        self._refusals: dict[str, Callable[[torch.Tensor], None]] = {}

    def _places_of(self, record: FlatRecord) -> tuple[tuple[_Place, ...], ...]:
        found = self._places.get(record.index)
        if found is None:
            found = self._places[record.index] = tuple(
                tuple((o.module.__dict__, o.module._parameters, o.attr) for o in owners)
                for owners in record.spec.owners
            )
        return found

    def guard_segments(self, record: FlatRecord, segments: Sequence[tuple[int, str]]) -> None:
        """Hook the compute tensors the wrapper just set on the submodules for the
        skipped ``(segment, name)`` s of ``record``."""
        places_of = self._places_of(record)
        refusals = self._refusals
        guards = self._guards
        for segment, name in segments:
            refuse = refusals.get(name)
            if refuse is None:
                refuse = refusals[name] = functools.partial(_refuse, name)
            places = places_of[segment]
            seen: set[int] = set()
            for instance, params, attr in places:
                # Wrappers set plain tensors, which land in the instance dict while the
                # views are stepped aside; torch with use_orig_params registers its own.
                tensor = instance.get(attr)
                if tensor is None:
                    tensor = params.get(attr)
                if not isinstance(tensor, torch.Tensor) or not tensor.requires_grad:
                    continue
                if len(places) > 1:  # tied: one hook per tensor
                    if id(tensor) in seen:
                        continue
                    seen.add(id(tensor))
                guards.append(hook_gradient(tensor, refuse))

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
        for hooked in self._guards:
            unhook_gradient(hooked)
        self._guards.clear()

    def remove_plain(self) -> None:
        """Remove the persistent hooks of plain parameters (unwrap)."""
        for handle in self._plain_guards.values():
            handle.remove()
        self._plain_guards.clear()
