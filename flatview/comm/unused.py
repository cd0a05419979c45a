"""Which parameters some rank's backward, or every rank's, gave no gradient although the
step did not declare them skipped: :class:`UsageFlags`, the one exchange of that fact,
and :func:`undeclared_unused`, the one error that reports it.

One flag per parameter says that this rank's backward gave it a gradient; summed over the
ranks (or averaged: a zero stays a zero), a parameter whose flags sum to zero got no
gradient anywhere: the model left it out without declaring it. The flags travel

* in the last bucket of a replicating wrapper's own all-reduce (:meth:`UsageFlags.carried`:
  the caller reduces :attr:`UsageFlags.tensor` with its gradients, so the check costs no
  collective of its own), or
* in an all-reduce of their own, started as soon as they are known so that it runs
  alongside the wrapper's last collective (:meth:`UsageFlags.exchanged`, FSDP2: the
  wrapper reduces the gradients, flatview cannot add to its buffers). A second row then
  flags the parameters this rank lacked although they are used: FSDP2 would leave them
  out of this rank's reduce-scatter, so any rank lacking one is an error on every rank;
  a third the skipped parameters this rank's backward gave a gradient: the model used
  them, on one rank or several, and every rank raises.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from flatview.comm.ledger import Ledger
from flatview.errors import StateError, UndeclaredUnusedError, listing

_GAVE, _LACKED, _USED_SKIPPED = 1, 0, 2
"""Rows of an exchanged tensor: this rank gave a gradient; it lacked one although used;
it gave one although skipped."""


class UsageFlags:
    """One rank's flags, reduced over the ranks (see the module docstring)."""

    def __init__(self, tensor: torch.Tensor, work: dist.Work | None, all_gave: bool) -> None:
        self.tensor = tensor
        """The flags; for :meth:`carried` ones the caller reduces it in place."""
        self._work = work
        self._exchanged = work is not None
        self._all_gave = all_gave
        self._host: torch.Tensor | None = None

    @classmethod
    def carried(cls, gave: Sequence[bool], dtype: torch.dtype, device: torch.device) -> UsageFlags:
        """Flags per parameter (in ``gave``'s order, every one used) for the caller to
        reduce with its gradients, in their dtype, so that they can share a bucket."""
        # Ones, and a fill per missing gradient: a copy from the host would wait for the
        # GPU to finish the backward.
        flags = torch.ones(len(gave), dtype=dtype, device=device)
        all_gave = all(gave)
        if not all_gave:
            for position, present in enumerate(gave):
                if not present:
                    flags[position] = 0
        return cls(flags, None, all_gave)

    @classmethod
    def exchanged(
        cls,
        gave: set[int],
        lacking: Sequence[int],
        used_skipped: set[int],
        count: int,
        group: dist.ProcessGroup | None,
        ledger: Ledger,
        device: torch.device,
    ) -> UsageFlags:
        """Flags of parameters ``0 .. count - 1`` (this rank gave ``gave`` a gradient,
        lacked one for ``lacking``, which are used, and gave one to ``used_skipped``,
        which are skipped), summed over ``group`` by one asynchronous all-reduce of
        their own, started now."""
        flags = torch.zeros(3, count, dtype=torch.int32, device=device)
        if lacking:
            flags[_LACKED, list(lacking)] = 1
        if gave:
            flags[_GAVE, sorted(gave)] = 1
        if used_skipped:
            flags[_USED_SKIPPED, sorted(used_skipped)] = 1
        ledger.record("flags", flags)
        work = dist.all_reduce(flags, group=group, async_op=True)
        return cls(flags, work, False)

    def unused(self) -> list[int]:
        """The parameters no rank gave a gradient (positions in ``gave`` for
        :meth:`carried` flags, once the caller's reduction is done)."""
        if self._all_gave:
            # This rank's own flags make every sum positive; reading them back would only
            # make the host wait for the GPU.
            return []
        if not self._exchanged:
            return [k for k, v in enumerate(self.tensor.tolist()) if v == 0]
        flags = self._read()
        return [i for i in _flagged(flags, _LACKED) if int(flags[_GAVE, i]) == 0]

    def lacked(self) -> list[int]:
        """The parameters some rank lacked a gradient for (:meth:`exchanged` flags)."""
        return _flagged(self._read(), _LACKED)

    def used_skipped(self) -> list[int]:
        """The skipped parameters some rank gave a gradient (:meth:`exchanged` flags)."""
        return _flagged(self._read(), _USED_SKIPPED)

    def _read(self) -> torch.Tensor:
        work, self._work = self._work, None
        if work is not None:
            work.wait()
            self._host = self.tensor.cpu()
        assert self._host is not None, "flags of an exchange never started"
        return self._host


def _flagged(flags: torch.Tensor, row: int) -> list[int]:
    """The parameters some rank set ``row`` of the summed (host) flags for."""
    return [int(i) for i in flags[row].nonzero().flatten().tolist()]


def undeclared_unused(
    subject: str, names: Sequence[str], where: str, why: str = ""
) -> UndeclaredUnusedError:
    """The error of parameters that got no gradient on ``where`` (``"any rank"``, ``"some
    rank"``, ``"this rank"``) in a backward although the step does not skip them:
    ``subject`` says what ``names`` are (``"parameter(s)"``, ``"the parameters of FSDP
    unit(s)"``), ``why`` what that does to the wrapper's reduction, if anything."""
    return UndeclaredUnusedError(
        f"{subject} {listing(names)} got no gradient on {where} in this backward pass, but are "
        f"not declared skipped{why}. Pass what a step does not use to FlatView.step(skip=...)."
    )


def replaced_parameters(names: Sequence[str]) -> StateError:
    """The error of parameters that got no gradient because the model no longer holds the
    tensors flatview was built with (``names``): they were replaced on their modules."""
    return StateError(
        f"parameter(s) {listing(names)} got no gradient: the model no longer holds the tensors "
        "flatview.wrap found there (they were replaced, by load_state_dict(assign=True) or "
        "by assigning a new parameter), and flatview, like DDP itself, reduces the tensors "
        "it was built with. Load values in place (load_state_dict without assign), or "
        "replace parameters before wrapping"
    )


def gradients_taken_in_backward(names: Sequence[str]) -> StateError:
    """The error of parameters (``names``) whose gradient was gone by the end of the
    backward while a post-accumulate-grad hook is registered on them: an optimizer
    stepped inside the backward (and zeroed), on this rank's unreduced gradient."""
    return StateError(
        f"parameter(s) {listing(names)} had no gradient left at the end of the backward, and "
        "carry post-accumulate-grad hooks: an optimizer stepped inside the backward took "
        "this rank's own gradient before it was averaged over the ranks (each rank would "
        "train apart). Step the optimizers after the backward"
    )
