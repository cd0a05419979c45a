"""An optimizer that stands in for optimizers that can only be built later:
:class:`Deferred` (``flatview.optim.Deferred``).

A DeepSpeed engine takes exactly one optimizer, and takes it when it is built, before
``flatview.wrap`` has made the views that optimizers by submodule are built from. Build
the engine with a :class:`Deferred` over the model's parameters; once wrapped, hand it
the real optimizers (:meth:`Deferred.set`), built over views. ``engine.step()`` then
steps every one of them, after the engine's gradient clipping.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from flatview.errors import StateError


class Deferred(torch.optim.Optimizer):
    """One optimizer in the place of several that are built later (see the module
    docstring)::

        deferred = flatview.optim.Deferred(model.parameters())
        engine, *_ = deepspeed.initialize(model=model, optimizer=deferred, config=config)
        fv = flatview.wrap(engine)
        deferred.set(
            torch.optim.AdamW(engine.module.body.parameters(), lr=3e-4),
            torch.optim.SGD(engine.module.head.parameters(), lr=1e-2, momentum=0.9),
        )
        ...
        engine.backward(loss)
        engine.step()  # clips (the config's gradient_clipping), then steps both

    Its own parameter groups are what the engine partitions (one group: one flat
    partition); their hyperparameters mean nothing (``lr`` is 0), so a learning-rate
    scheduler belongs on the real optimizers, not on the engine. DeepSpeed's ZeRO
    accepts it with ``"zero_allow_untested_optimizer": true`` in its config.
    """

    def __init__(self, params: Iterable[Any]) -> None:
        super().__init__(params, {"lr": 0.0})
        self.optimizers: tuple[torch.optim.Optimizer, ...] = ()
        """The optimizers :meth:`step` steps, in order."""

    def set(self, *optimizers: torch.optim.Optimizer) -> None:
        """The optimizers to step from now on (replacing any set before)."""
        for optimizer in optimizers:
            if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, Deferred):
                raise TypeError(
                    f"Deferred.set takes torch optimizers, got {type(optimizer).__name__}"
                )
        if len({id(o) for o in optimizers}) != len(optimizers):
            raise ValueError("Deferred.set was given the same optimizer twice")
        self.optimizers = tuple(optimizers)

    def _require_set(self, method: str) -> None:
        if not self.optimizers:
            raise StateError(
                f"Deferred.{method}() before Deferred.set(...): hand it the optimizers "
                "built over the views once the model is wrapped"
            )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Step every optimizer given to :meth:`set`, in order."""
        if closure is not None:
            raise ValueError("Deferred.step takes no closure (each optimizer steps once)")
        self._require_set("step")
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or drop) the gradients of every optimizer's parameters."""
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The state dicts of the optimizers given to :meth:`set`, in order."""
        self._require_set("state_dict")
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` gave into the optimizers given to :meth:`set`."""
        self._require_set("load_state_dict")
        states = state_dict.get("optimizers")
        if not isinstance(states, list) or len(states) != len(self.optimizers):
            raise ValueError(f"a Deferred state dict of {len(self.optimizers)} optimizers expected")
        for optimizer, state in zip(self.optimizers, states, strict=True):
            optimizer.load_state_dict(state)
