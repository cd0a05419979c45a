"""The ZeRO optimizer's ``step`` and ``zero_grad`` as flatview runs them on a wrapped
DeepSpeed engine (``engine.step()`` calls both): :class:`ZeroStep`.

The step: ZeRO 3's preparation, the global norm of the views' gradients (one all-reduce
of one number, as DeepSpeed's ``get_global_grad_norm`` reports it) and the config's
``gradient_clipping`` by it (torch's ``clip_grad_norm_`` formula), the engine's
optimizer (over views), DeepSpeed's own publishing of the stepped masters
(:meth:`flatview.backends.deepspeed_zero.FlatGroups.publish`,
:meth:`~flatview.backends.deepspeed_zero.ShardedParams.publish`), then the gradients
dropped, as DeepSpeed's step frees them. The masters' version
counters are recorded then, so that values written into views later (outside a step)
are seen and published before the next forward.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from flatview.backends.deepspeed_zero import ZeroLayout
from flatview.comm.collectives import all_reduce_sum
from flatview.errors import StateError
from flatview.phase import Phase

if TYPE_CHECKING:
    from flatview.backends.base import Runtime

CLIP_KIND = "clip_norm"
"""The ledger kind of the all-reduce of the gradient-clipping norm (not a reduction)."""


def unseen_backward(evidence: str) -> str:
    """The message of a backward whose forward flatview did not see begin."""
    return (
        f"a backward ran through a forward flatview did not see begin ({evidence}): the "
        "forward ran before flatview.wrap (wrap the engine between iterations), or its "
        "backward had run already (retain_graph=True: flatview reduces once per forward). "
        "No gradient reached the views; drop the gradients (engine.zero_grad()) and run "
        "the forward again"
    )


class ZeroStep:
    """The step of one wrapped engine (see the module docstring). ``lent`` runs DeepSpeed's
    parts with its own parameters registered on the submodules (they walk them);
    ``drop_accumulated`` forgets the gradients accumulated towards the next boundary."""

    def __init__(
        self,
        engine: Any,
        layout: ZeroLayout,
        group: dist.ProcessGroup | None,
        world_size: int,
        lent: Callable[[], AbstractContextManager[None]],
        drop_accumulated: Callable[[], None],
    ) -> None:
        self.engine = engine
        self.zero = engine.optimizer
        self.layout = layout
        self.group = group
        self.world_size = world_size
        self._lent = lent
        self._drop_accumulated = drop_accumulated
        self._installed: Runtime | None = None
        self.trained: list[int] = []
        """Table indices of the views the engine's optimizer trains (set at install)."""
        self._published = self._versions()

    def install(self, runtime: Runtime, trained: list[int]) -> None:
        """Step through ``runtime``'s views: ``trained`` are the table indices of those
        the engine's optimizer steps."""
        self._installed = runtime
        self.trained = trained

    def _runtime(self) -> Runtime:
        assert self._installed is not None, "ZeroStep used before install()"
        return self._installed

    def step(self, closure: Callable[[], float] | None = None) -> None:
        """The ZeRO optimizer's ``step``."""
        runtime = self._runtime()
        if closure is not None:
            raise ValueError("DeepSpeed's ZeRO optimizer takes no closure")
        if runtime.phase is not Phase.IDLE:
            raise StateError(
                f"engine.step() while the model is {runtime.phase.name}: step after the "
                "backward has ended (a forward with autograd on since the last backward, "
                "whose loss no backward used, leaves the model computing until the next "
                "forward: compute such losses, for validation, under torch.no_grad())"
            )
        if runtime.accumulating:
            # engine.step() steps only at the boundary, which ends the window: this is the
            # ZeRO optimizer stepped directly (as Fabric does), whose step would find no
            # reduced gradient on any view. Every rank is in the same window: all raise.
            raise StateError(
                "DeepSpeed's ZeRO optimizer stepped before the engine's gradient "
                "accumulation boundary: the micro-steps since the last one are not reduced "
                "yet. Call engine.step() after every micro-batch (it steps the optimizer at "
                "the boundary); code that steps the ZeRO optimizer itself (Fabric) needs "
                "gradient_accumulation_steps=1"
            )
        if any(param.grad is not None for param, _ in self.layout.compute_params()):
            # flatview's end of the backward takes every gradient DeepSpeed's parameters
            # get: these come from a backward it did not see.
            raise StateError(
                unseen_backward("engine.step() found gradients on DeepSpeed's parameters")
            )
        with self._lent():
            self.layout.prepare_step()
            self.zero.overflow = False
            clipping = float(self.engine.gradient_clipping())
            # DeepSpeed computes the norm every step (engine.get_global_grad_norm())
            # unless its config turns that off, which it allows without clipping only.
            if clipping > 0 or self.engine.zero_compute_grad_norm():
                self.zero._global_grad_norm = self.clip(clipping)
            else:
                self.zero._global_grad_norm = None
            self.zero.optimizer.step()
            self.publish()
        # DeepSpeed's own step frees every gradient it consumed, whoever calls it: a
        # caller that steps the ZeRO optimizer without the engine's zero_grad (Fabric
        # calls DeepSpeed's class method on a wrapper, which this instance's zero_grad
        # never sees) must not find them added to by the next backward.
        self.zero_grad(set_to_none=True)

    def _versions(self) -> list[int]:
        return [flat.holder._version for flat in self.layout.flats]

    def publish(self) -> None:
        """The masters into what DeepSpeed computes from (a collective)."""
        self.layout.publish()
        self._published = self._versions()

    def publish_written(self) -> None:
        """Masters written outside ``engine.step()`` (through views, or loaded) into what
        DeepSpeed computes from: what it keeps gathered is released first, so that
        publishing gathers it again from the new partitions."""
        self.layout.release()
        self.publish()

    def mark_published(self) -> None:
        """The masters are what DeepSpeed computes from (it copied them itself)."""
        self._published = self._versions()

    def changed(self) -> bool:
        """Whether a master partition was written since it was last published."""
        return self._versions() != self._published

    @torch.no_grad()
    def clip(self, max_norm: float) -> torch.Tensor:
        """The global 2-norm of the views' gradients, and (``max_norm`` > 0) the gradients
        scaled as ``torch.nn.utils.clip_grad_norm_(params, max_norm)`` would on the
        unwrapped model: every element lives on exactly one rank, so the global norm is
        the root of one all-reduced sum of squares."""
        runtime = self._runtime()
        grads = [g for i in self.trained if (g := runtime.tensor(i).grad) is not None]
        flats = self.layout.flats
        device = flats[0].holder.device if flats else torch.device("cpu")
        squares = torch.zeros((), dtype=torch.float32, device=device)
        for grad in grads:
            squares += torch.linalg.vector_norm(grad, 2.0, dtype=torch.float32) ** 2
        if self.world_size > 1:
            runtime.ledger.record(CLIP_KIND, squares)
            all_reduce_sum(squares, self.group)
        total = squares.sqrt()
        if max_norm > 0:
            coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for grad in grads:
                grad.mul_(coefficient.to(grad.dtype))
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        """DeepSpeed's ``zero_grad``: its parameters' gradients, the views' and what was
        accumulated towards the next boundary."""
        runtime = self._runtime()
        self._drop_accumulated()
        tensors = [p for p, _ in self.layout.compute_params()]
        tensors += [runtime.tensor(i) for i in self.trained]
        for tensor in tensors:
            if set_to_none:
                tensor.grad = None
            elif tensor.grad is not None:
                tensor.grad.detach_()
                tensor.grad.zero_()
