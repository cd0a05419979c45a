"""Unsharded parameters that a forward without a backward leaves in the wrapper, and
when flatview has the adapter free them: :class:`Leftovers`.

FSDP keeps the root unit's unsharded parameters after its forward (every unit's under
``SHARD_GRAD_OP``, FSDP2's ``reshard_after_forward=False`` or fairscale's
``reshard_after_forward=False``), to spare the all-gather of the backward that usually
comes next; fairscale with mixed precision keeps the low-precision copy of a unit it
does not shard. When no backward comes (an evaluation under ``torch.no_grad()``), the
wrapper's next forward reuses that copy instead of gathering the shards again, so
whatever moved the shards in between is not seen: an optimizer stepped after that
evaluation (a backward, an evaluation, then ``optimizer.step()``), a moving average
copied in through the views, a checkpoint loaded in place. The model then trains, or
saves a full ``state_dict``, from stale parameters, silently; bare FSDP does the same
(torch's FSDP2 documentation asks for ``model.reshard()``; DDP and ``NO_SHARD`` keep no
copy). Measured with torch 2.13 and fairscale 0.4.13, bare, 2 ranks, an evaluation
between each backward and its optimizer step, three steps: the root unit's parameters
4e-3 to 4e-2 off the single-process reference, the others (trained through it) 3e-4 to
2e-2.

flatview frees the copy (:meth:`~flatview.backends.base.Adapter.release_unsharded`, no
collective) at points every rank passes alike, so that the next forward gathers on
every rank or on none:

* the next root forward with autograd after a forward without (:attr:`Gathered.LEFT`);
* the root forward of a new step while a forward of an earlier iteration never had
  its backward (a validation loss computed with autograd on);
* a wrapper operation (``state_dict``, ``summon_full_params``...) or ``unwrap()`` after
  a forward without autograd.

Forwards without autograd in a row keep reusing the copy, as bare FSDP does: an
evaluation loop or a generation pays no extra all-gather. What that leaves as bare FSDP
leaves it: values written between two forwards without autograd, with no training step
between them, are not seen by the second on the units the wrapper kept
(``docs/limitations.md``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from flatview.states import Transitions


class Gathered(enum.Enum):
    """What forwards without a backward may have left unsharded in the wrapper."""

    RELEASED = "released"
    """Nothing: no forward without autograd since the last release."""
    LEFT = "left"
    """A forward without autograd ran since: the wrapper may hold its unsharded copy."""


_MOVES = {
    Gathered.RELEASED: (Gathered.LEFT,),
    Gathered.LEFT: (Gathered.LEFT, Gathered.RELEASED),
}


class Leftovers:
    """Whether the wrapper may hold a stale unsharded copy, and its release (see the
    module docstring); ``release`` is the adapter's
    :meth:`~flatview.backends.base.Adapter.release_unsharded`."""

    def __init__(self, release: Callable[[], None]) -> None:
        self._release = release
        self._gathered = Transitions(Gathered.RELEASED, _MOVES)

    def left_by_forward(self) -> None:
        """A root forward without autograd returned."""
        self._gathered.move(Gathered.LEFT)

    def release(self, *, abandoned: bool = False) -> None:
        """Free what forwards without autograd left (``abandoned``: also what a forward
        whose backward never came left, whatever ran since)."""
        if self._gathered.state is Gathered.LEFT:
            self._gathered.move(Gathered.RELEASED)
        elif not abandoned:
            return
        self._release()
