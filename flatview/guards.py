"""Guards that catch a model using a parameter its step declared skipped.

A skipped parameter gets no gradient and no communication, so a model that uses it
anyway would train wrongly in silence. :class:`SkipGuards` hooks the tensors of skipped
parameters so that their gradient raises
:class:`~flatview.errors.SkippedParameterUsedError` in the backward:

* the compute tensors the wrapper sets for a flat parameter's skipped segments (made
  anew each forward, so their guards are removed when the iteration ends). fairscale
  and torch FSDP1 cut them all from the unsharded flat parameter by one ``split`` (each
  output, or a ``view`` of it, set on its submodule), so one hook per flat parameter
  and forward guards them all: a pre-hook on the split's autograd node, whose
  gradients of the skipped outputs must be undefined (a gradient reaches an output
  exactly when it reaches the compute tensor cut from it). With half of a large model
  skipped that is one hook per unit instead of thousands per step. Which output each
  segment is is learnt once per flat parameter, from every compute tensor; each
  forward then checks it on the first and the last skipped segment. Compute tensors of
  another make (a parameter, a tensor subclass, not cut by one split) are hooked one by
  one, in the tensor's hook dictionary directly, as ``Tensor.register_hook`` does but
  without its per-call overhead (:func:`flatview.autograd.hook_gradient`);
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
) -> Callable[[torch.Tensor | None], None]:
    """The persistent guard hook of plain parameter ``index`` (weakly bound: a
    parameter that outlives its model's runtime must not keep it alive)."""

    def refuse(grad: torch.Tensor | None) -> None:
        # Called with None when autograd reaches the parameter without a gradient: DDP
        # with find_unused_parameters=True passes every output through one node, whose
        # backward hands on None for outputs the loss did not use.
        if grad is None:
            return
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


def _refuse(name: str, grad: torch.Tensor | None) -> None:
    # Put in the hook dictionary of a tensor that is one output of a node with several
    # (a split output itself, not a view of one), the hook is also called, with None,
    # when the node runs for another output's gradient: this one received none.
    if grad is not None:
        raise skipped_used(name)


SPLITS = frozenset({"SplitWithSizesBackward0", "SplitBackward0"})
"""The autograd nodes of ``torch.split`` (with sizes, or with one size)."""

VIEW = "ViewBackward0"

Skipped = tuple[tuple[int, str], ...]
"""A step's skipped segments of one flat parameter: (split output, parameter name)."""


def _refuse_outputs(skipped: Skipped, grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
    """The split node's pre-hook: a gradient for a skipped output is a skipped
    parameter used."""
    for output, name in skipped:
        if grad_outputs[output] is not None:
            raise skipped_used(name)


def _split_output(tensor: object) -> tuple[Any, int] | None:
    """(the split node, output index) that ``tensor`` is cut from, directly or through
    one ``view``; ``None`` for a tensor of another make."""
    if type(tensor) is not torch.Tensor or not tensor.requires_grad:
        return None
    node = tensor.grad_fn
    if node is None:
        return None
    if node.name() == VIEW:
        node, output = node.next_functions[0]
        if node is None:
            return None
    else:
        output = tensor.output_nr
    if node.name() not in SPLITS:
        return None
    return node, output


class _Unsplit:
    """A flat parameter whose compute tensors are not all cut by one split: hooked one
    by one."""


UNSPLIT = _Unsplit()


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
        # Per flat record index: which split output each segment's compute tensor is
        # (learnt at its first guarded forward), or UNSPLIT.
        self._outputs: dict[int, tuple[int, ...] | _Unsplit] = {}
        # Per skipped-segments tuple (bound once per skip set, so the same object every
        # step it repeats; kept here so that its id is not reused): the split node's
        # pre-hook arguments.
        self._skipped: dict[int, tuple[Sequence[tuple[int, str]], Skipped]] = {}
        # The split nodes' pre-hooks of the iteration in flight.
        self._node_guards: list[torch.utils.hooks.RemovableHandle] = []

    def _places_of(self, record: FlatRecord) -> tuple[tuple[_Place, ...], ...]:
        found = self._places.get(record.index)
        if found is None:
            found = self._places[record.index] = tuple(
                tuple((o.module.__dict__, o.module._parameters, o.attr) for o in owners)
                for owners in record.spec.owners
            )
        return found

    def guard_segments(self, record: FlatRecord, segments: Sequence[tuple[int, str]]) -> None:
        """Guard the compute tensors the wrapper just set on the submodules for the
        skipped ``(segment, name)`` s of ``record``: one pre-hook on the split they were
        cut by, or one hook each (see the module docstring)."""
        if not segments:
            return
        places_of = self._places_of(record)
        node = self._split_node(record, places_of, segments)
        if node is not None:
            self._node_guards.append(node.register_prehook(self._node_guard(record, segments)))
            return
        self._guard_each(places_of, segments)

    def _split_node(
        self,
        record: FlatRecord,
        places_of: tuple[tuple[_Place, ...], ...],
        segments: Sequence[tuple[int, str]],
    ) -> Any:
        """The split node every compute tensor of ``record`` was cut by in this
        forward, checked on the first and last of ``segments``; ``None`` when they are
        not so made."""
        outputs = self._outputs.get(record.index)
        if outputs is None:
            outputs = self._outputs[record.index] = _learn_outputs(places_of)
        if isinstance(outputs, _Unsplit):
            return None
        node = None
        for segment, _ in (segments[0], segments[-1]):
            found = _split_output(_compute_tensor(places_of[segment][0]))
            if found is None or found[1] != outputs[segment]:
                return None
            if node is None:
                node = found[0]
            elif found[0] is not node:
                return None
        return node

    def _node_guard(
        self, record: FlatRecord, segments: Sequence[tuple[int, str]]
    ) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
        cached = self._skipped.get(id(segments))
        if cached is None or cached[0] is not segments:
            outputs = self._outputs[record.index]
            assert not isinstance(outputs, _Unsplit)
            skipped = tuple((outputs[segment], name) for segment, name in segments)
            if len(self._skipped) >= 4096:
                self._skipped.clear()  # skip sets vary freely: keep recent ones only
            cached = self._skipped[id(segments)] = (segments, skipped)
        return functools.partial(_refuse_outputs, cached[1])

    def _guard_each(
        self, places_of: tuple[tuple[_Place, ...], ...], segments: Sequence[tuple[int, str]]
    ) -> None:
        """One hook per compute tensor of the skipped ``segments``."""
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
        for handle in self._node_guards:
            handle.remove()
        self._node_guards.clear()

    def remove_plain(self) -> None:
        """Remove the persistent hooks of plain parameters (unwrap)."""
        for handle in self._plain_guards.values():
            handle.remove()
        self._plain_guards.clear()


def _compute_tensor(place: _Place) -> object:
    """What the wrapper set at ``place``: plain tensors land in the instance dict while
    the views are stepped aside; torch with use_orig_params registers its own."""
    instance, params, attr = place
    tensor = instance.get(attr)
    return params.get(attr) if tensor is None else tensor


def _learn_outputs(places_of: tuple[tuple[_Place, ...], ...]) -> tuple[int, ...] | _Unsplit:
    """Per segment, the split output its compute tensor (the same at every tied place)
    is, when one split cut every segment's, each a distinct output; else UNSPLIT."""
    node = None
    outputs: list[int] = []
    for places in places_of:
        tensors = [_compute_tensor(place) for place in places]
        if any(t is not tensors[0] for t in tensors):
            return UNSPLIT
        found = _split_output(tensors[0])
        if found is None or (node is not None and found[0] is not node):
            return UNSPLIT
        node = found[0]
        outputs.append(found[1])
    if len(set(outputs)) != len(outputs):
        return UNSPLIT
    return tuple(outputs)
