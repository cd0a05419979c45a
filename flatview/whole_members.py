"""The members of a :class:`flatview.optim.Whole` optimizer and how they are assigned.

Each parameter a ``Whole`` optimizer steps is a :class:`Member`: where its elements
live, which rank owns it (steps it whole) and, on that owner, its whole copy. This
module holds the member record, the owner assignment (:func:`assign_owners`, the same
on every rank), the probe that builds the inner optimizer over meta tensors so that a
refused parameter is named on every rank alike (:func:`probe`), and the small helpers
of its state and its change detection.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flatview.errors import OptimStateError
from flatview.layout import Interval, Placement
from flatview.norms import local_elements

EVERY_RANK = -1
"""The owner of a replicated parameter: every rank steps its own copy alike."""


@dataclass
class Member:
    """One parameter of a :class:`Whole` optimizer."""

    name: str
    tensor: nn.Parameter
    """The user's view (or plain parameter), as in ``param_groups``."""
    placement: Placement
    group: int
    owner: int
    """The rank that steps it; :data:`EVERY_RANK` for a replicated parameter."""
    pieces: tuple[Interval, ...]
    """Per rank, its elements in the flattened parameter (empty where it holds none)."""
    split: bool
    """Several ranks hold elements of it: its owner keeps a whole copy."""
    whole: nn.Parameter | None = None
    """The whole copy, on the owner of a split parameter only."""
    alias: torch.Tensor | None = None
    """Where this rank holds all of a parameter in another shape (torch's own views are
    1-D): a leaf of the original shape over the same storage, which the inner optimizer
    steps in place (its gradient is the view's, reshaped, at every step)."""
    checksum: float | None = None
    """The sum of this rank's piece when this optimizer last wrote or read it."""

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.placement.shape)

    def local(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's elements of ``tensor`` (the parameter or its gradient), 1-D, a
        view that writes through; ``None`` where the tensor has no such elements."""
        return None if tensor is None else local_elements(self.placement, tensor)


def assign_owners(members: Sequence[Member], world: int) -> None:
    """A parameter wholly on one rank is owned there; split ones go, largest first,
    to the rank owning the fewest elements so far (the same on every rank)."""
    load = [0] * world
    split = []
    for m in members:
        holders = [r for r, (s, e) in enumerate(m.pieces) if e > s]
        if not m.placement.sharded:
            m.owner = EVERY_RANK
        elif len(holders) <= 1:
            m.owner = holders[0] if holders else 0
            load[m.owner] += m.placement.numel
        else:
            split.append(m)
    for m in sorted(split, key=lambda m: (-m.placement.numel, m.name)):
        m.owner = min(range(world), key=lambda r: (load[r], r))
        load[m.owner] += m.placement.numel


def requires_closure(optimizer_cls: type) -> bool:
    step = getattr(optimizer_cls, "step", None)
    if step is None:
        return False
    parameter = inspect.signature(step).parameters.get("closure")
    return parameter is not None and parameter.default is inspect.Parameter.empty


def probe(
    optimizer_cls: type[torch.optim.Optimizer],
    groups: Sequence[Sequence[tuple[str, torch.Size, torch.dtype]]],
    hyper: Sequence[Mapping[str, Any]],
    kwargs: Mapping[str, Any],
) -> None:
    """Build the inner optimizer over meta tensors of the original shapes, on every rank
    alike: what it refuses (Muon a parameter that is not 2-D) is refused on every rank,
    before any collective, naming the parameter."""

    def meta(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="meta", requires_grad=True)

    try:
        optimizer_cls(
            [
                {"params": [meta(s, d) for _, s, d in members], **h}
                for members, h in zip(groups, hyper, strict=True)
            ],
            **kwargs,
        )
    except Exception as err:
        for members, h in zip(groups, hyper, strict=True):
            for name, shape, dtype in members:
                try:
                    optimizer_cls([{"params": [meta(shape, dtype)], **h}], **kwargs)
                except Exception as alone:
                    raise OptimStateError(
                        f"{optimizer_cls.__name__} refuses parameter {name!r} (original "
                        f"shape {tuple(shape)}): {alone}"
                    ) from alone
        raise OptimStateError(
            f"{optimizer_cls.__name__} could not be built over these parameters: {err}"
        ) from err


def checksum(piece: torch.Tensor) -> float:
    # A sum in double precision changes with any write to the piece (short of one that
    # keeps the sum to the last bit); read back with the step's flags, it costs one pass.
    return float(piece.double().sum()) if piece.numel() else 0.0


def whole_shaped(value: Any, like: torch.Tensor, name: str, key: Any) -> Any:
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    if value.numel() != like.numel():
        raise OptimStateError(
            f"state {key!r} of parameter {name!r} has {value.numel()} elements, the "
            f"parameter {like.numel()} (shape {tuple(like.shape)})"
        )
    return value.reshape(like.shape)
