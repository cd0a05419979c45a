"""Parameters an optimizer holds but has no state for yet, in checkpoints.

An optimizer creates a parameter's state at the first step that finds a gradient for
it: a block that LayerDrop or a skip set left out of every step so far has none. torch's
own ``get_state_dict`` then saves nothing for it, while the run that resumes builds its
load template from fresh optimizers primed with one zero step, which gives every
parameter state: ``torch.distributed.checkpoint.load`` refuses (``Missing key ...
.step``), and a partial load leaves the primed state in place (a ``step`` of 1 where the
uninterrupted run has no state, which moves Adam's bias correction).

:mod:`flatview.checkpoint` saves such a parameter instead as a *placeholder*: an entry
with every key a fresh optimizer's first step would create (found by stepping a scratch
copy of the optimizer over zero tensors shaped like the parameter's, never the optimizer
itself, nor any optimizer it steps), each ``None``. The resumed run's template has those
keys, so DCP's load works; the placeholder's ``None`` values replace the primed tensors, and
:func:`flatview.checkpoint.set_state_dict` drops every placeholder, so that the
parameter is again without state and gets fresh state at its first gradient, as in the
uninterrupted run.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from flatview import wrapped_models
from flatview.errors import OptimStateError

PLACEHOLDER = None
"""The value of every key of a placeholder entry."""


def is_placeholder(entry: Any) -> bool:
    """Whether a saved state entry stands for "no state yet"."""
    return (
        isinstance(entry, Mapping)
        and len(entry) > 0
        and all(value is PLACEHOLDER for value in entry.values())
    )


def placeholder(keys: Sequence[Any]) -> dict[Any, None]:
    """The entry saved for a parameter without state whose fresh state has ``keys``."""
    return dict.fromkeys(keys, PLACEHOLDER)


def without_placeholders(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` less its placeholder entries."""
    return {name: entry for name, entry in state.items() if not is_placeholder(entry)}


def stateless(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The trainable tensors ``optimizer`` holds without state on this rank (in its own
    ``state`` or in that of the optimizer it steps, :func:`stepper`: a Lookahead-style
    wrapper keeps none of its own)."""
    states = (optimizer.state, stepper(optimizer, strict=False).state)
    return [
        p
        for group in optimizer.param_groups
        for p in group["params"]
        if p.requires_grad and not any(state.get(p) for state in states)
    ]


def fresh_keys(
    optimizer: torch.optim.Optimizer, tensors: Sequence[torch.Tensor]
) -> list[tuple[Any, ...]]:
    """Per tensor of ``optimizer``, the keys of the state its first step would create,
    found by running the step of the optimizer that creates it (:func:`stepper`) on a
    scratch copy: the same hyperparameters and attributes, fresh state, no step hooks of
    its own, zero tensors with zero gradients in place of ``tensors``, learning rate 0.
    Neither the optimizers nor the tensors change: a step of any other optimizer during
    it raises :class:`~flatview.errors.OptimStateError` before it runs."""
    wanted = {id(t) for t in tensors}
    fakes: dict[int, torch.Tensor] = {}
    groups = []
    for group in optimizer.param_groups:
        members = [p for p in group["params"] if id(p) in wanted and p.requires_grad]
        if not members:
            continue
        made = []
        for p in members:
            fake = torch.zeros_like(p.detach()).requires_grad_(True)
            fake.grad = torch.zeros_like(fake)
            fakes[id(p)] = fake
            made.append(fake)
        lr = group.get("lr")
        scratch_group = {**group, "params": made}
        if lr is not None:
            scratch_group["lr"] = torch.tensor(0.0) if isinstance(lr, torch.Tensor) else 0.0
        groups.append(scratch_group)
    if not groups:
        return [() for _ in tensors]
    stepping = stepper(optimizer)
    scratch: Any = object.__new__(type(stepping))
    scratch.__dict__.update(vars(stepping))
    scratch.state = defaultdict(dict)
    scratch.param_groups = groups
    # Hooks registered on the optimizer itself (an LR scheduler's step counter, say)
    # must not see the scratch step.
    scratch._optimizer_step_pre_hooks = OrderedDict()
    scratch._optimizer_step_post_hooks = OrderedDict()
    guard = register_optimizer_step_pre_hook(_only(scratch, optimizer))
    try:
        type(stepping).step(scratch)
    finally:
        guard.remove()
    return [tuple(scratch.state.get(fakes[id(t)], ())) if id(t) in fakes else () for t in tensors]


def stepper(optimizer: torch.optim.Optimizer, *, strict: bool = True) -> torch.optim.Optimizer:
    """The optimizer whose class's step creates ``optimizer``'s state: its owner
    (:func:`flatview.wrapped_models.owner`), or, where that one keeps another optimizer
    as an attribute and steps it from its own step (Lookahead's design: the inner one
    shares its parameter groups and keeps the state its ``state_dict`` returns), the
    inner one, again and again. A scratch copy of the wrapper would step the real inner
    optimizer (and advance the wrapper's own counters in the real groups). Where it
    cannot be told, raises :class:`~flatview.errors.OptimStateError`, or (``strict``
    false) gives the last optimizer found."""
    found = wrapped_models.owner(optimizer)
    seen = {id(optimizer)}
    while True:
        if wrapped_models.delegates(type(found)):
            if not strict:
                return found
            raise OptimStateError(
                f"{type(found).__name__} keeps its state or param_groups as properties and "
                "wraps no torch optimizer in .optimizer: flatview cannot find the optimizer "
                "that holds them, to find the state a first step would create"
            )
        seen.add(id(found))
        inner = [
            value
            for value in getattr(found, "__dict__", {}).values()
            if isinstance(value, torch.optim.Optimizer) and id(value) not in seen
        ]
        if len(inner) != 1:
            if not inner or not strict:
                return found
            raise OptimStateError(
                f"{type(found).__name__} keeps {len(inner)} optimizers as attributes "
                f"({', '.join(type(o).__name__ for o in inner)}): flatview cannot tell which "
                "one creates the state of a parameter without state, to save a placeholder "
                "for it; checkpoint the inner optimizers instead"
            )
        found = wrapped_models.owner(inner[0])


def _only(scratch: object, optimizer: torch.optim.Optimizer) -> Any:
    """A global step pre-hook that refuses any step but ``scratch``'s, before it runs:
    an optimizer that steps another one it does not keep as an attribute (in a list,
    say) would otherwise step the real one, and training would change silently."""

    def refuse(stepped: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if stepped is not scratch:
            raise OptimStateError(
                f"{type(optimizer).__name__}'s step steps another optimizer "
                f"({type(stepped).__name__}) that flatview cannot reach as an attribute: "
                "finding the state a first step would create for a parameter without "
                "state would step it; checkpoint the inner optimizers instead"
            )

    return refuse
