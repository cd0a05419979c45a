"""The parameters and matrices of a :class:`flatview.optim.Whole` optimizer, and their owners.

Each parameter a ``Whole`` optimizer steps is a :class:`Member`; it is stepped as one or
more :class:`Matrix` es, each a run of whole rows of the flattened parameter:

* a 2-D parameter is one matrix;
* a 3-D parameter ``(n, rows, cols)`` (experts stored as one tensor, as torchtitan
  stores them) is ``n`` matrices of ``(rows, cols)``;
* ``heads=k`` cuts each of those into ``k`` matrices of ``rows / k`` rows (per-head
  attention projections: the output dimension is heads times head size);
* any other parameter is one tensor of its own shape (the inner optimizer decides
  whether it takes it: Muon refuses it, AdamW does not).

Each matrix has one *owner*, the rank that steps it whole. This module holds the records,
the owner assignment (:func:`assign_owners`: by the cost of orthogonalising, largest
first, kept where it is held while that rank is not overloaded, else onto the least
loaded rank; the same on every rank), the probe that builds the
inner optimizer over meta tensors so that a refused parameter is named on every rank alike
(:func:`probe`), and the small helpers of change detection.

Words used here and in :mod:`flatview.whole`: a matrix *travels* when its owner does not
hold all of it (its owner then keeps a *whole copy*, and the other holders' slices go to
it and back); a rank's *slice* of a matrix is the part of the matrix inside that rank's
piece of the parameter.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from flatview.errors import OptimStateError
from flatview.layout import Interval, Placement
from flatview.norms import local_elements

EVERY_RANK = -1
"""The owner of a replicated matrix: every rank steps its own copy alike."""


@dataclass
class Member:
    """One parameter of a :class:`Whole` optimizer."""

    name: str
    tensor: nn.Parameter
    """The user's view (or plain parameter), as in ``param_groups``."""
    placement: Placement
    group: int
    rank: int
    """This rank, in the ranks ``pieces`` counts (those of its domain's group, see
    :mod:`flatview.whole_domains`; 0 where the parameter is not sharded)."""
    pieces: tuple[Interval, ...]
    """Per rank, its elements of the flattened parameter (empty where it holds none)."""
    matrices: list[Matrix] = field(default_factory=list)
    checksum: float | None = None
    """The sum of this rank's piece when this optimizer last wrote or read it."""

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.placement.shape)

    def local(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's elements of ``tensor`` (the parameter or its gradient), 1-D, a
        view that writes through; ``None`` where the tensor has no such elements."""
        return None if tensor is None else local_elements(self.placement, tensor)


@dataclass(eq=False)
class Matrix:
    """One matrix of a member: what the inner optimizer steps as one parameter."""

    member: Member
    number: int
    """Its place among the member's matrices."""
    span: Interval
    """Its elements in the flattened parameter (whole rows)."""
    shape: torch.Size
    slices: tuple[Interval, ...]
    """Per rank, the elements of the matrix that rank holds, in the matrix's own
    flattened coordinates (empty where it holds none)."""
    owner: int = EVERY_RANK
    """The rank that steps it; :data:`EVERY_RANK` for a replicated one."""
    whole: nn.Parameter | None = None
    """The whole copy, on the owner of a travelling matrix only."""
    alias: torch.Tensor | None = None
    """Where this rank holds all of the matrix in another tensor (a piece of a view,
    a 1-D view of torch's, an expert of a 3-D parameter, FSDP2's local tensor): a leaf
    of the matrix's shape over the same storage, which the inner optimizer steps in
    place (its gradient is rebound at every step)."""

    @property
    def name(self) -> str:
        if len(self.member.matrices) == 1:
            return self.member.name
        return f"{self.member.name}[{self.number}]"

    @property
    def numel(self) -> int:
        return self.span[1] - self.span[0]

    @property
    def travels(self) -> bool:
        """Its owner does not hold all of it: slices travel to the owner and back, and
        the owner keeps a whole copy."""
        if self.owner == EVERY_RANK:
            return False
        start, end = self.slices[self.owner]
        return end - start != self.numel

    @property
    def owned_here(self) -> bool:
        """This rank is its owner (not merely one of every rank stepping a replicated one)."""
        return self.owner != EVERY_RANK and self.owner == self.member.rank

    @property
    def cost(self) -> int:
        """What orthogonalising it costs, up to a constant: Newton-Schulz multiplies
        ``(m, n)`` by its Gram matrix, ``m * n * min(m, n)``; elementwise for any other
        shape."""
        if len(self.shape) == 2:
            rows, cols = self.shape
            return rows * cols * min(rows, cols)
        return max(self.numel, 1)

    def local(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's slice of ``tensor`` (the parameter or its gradient), 1-D, a view
        that writes through; ``None`` where the tensor has no elements here."""
        piece = self.member.local(tensor)
        if piece is None:
            return None
        rank = self.member.rank
        start, end = self.slices[rank]
        if end <= start:
            return piece[:0]
        offset = self.span[0] + start - self.member.pieces[rank][0]
        return piece[offset : offset + end - start]


def cut(member: Member, heads: int, world: int) -> None:
    """Fill ``member.matrices``: 3-D parameters per leading index, each cut into
    ``heads`` row blocks (see the module docstring)."""
    shape = tuple(member.shape)
    if len(shape) == 3:
        count, rows, cols = shape
    elif len(shape) == 2:
        count, (rows, cols) = 1, shape
    else:
        if heads != 1:
            raise OptimStateError(
                f"heads= cuts 2-D and 3-D parameters into row blocks; {member.name!r} has "
                f"shape {shape}"
            )
        member.matrices = [_matrix(member, 0, (0, math.prod(shape)), torch.Size(shape), world)]
        return
    if heads < 1 or rows % heads:
        raise OptimStateError(
            f"heads={heads} for parameter {member.name!r} of shape {shape}: its "
            f"{rows} rows do not split into {heads} equal blocks"
        )
    block = (rows // heads) * cols
    matrices = []
    for number in range(count * heads):
        span = (number * block, (number + 1) * block)
        matrices.append(_matrix(member, number, span, torch.Size((rows // heads, cols)), world))
    member.matrices = matrices


def cut_all(
    members: Sequence[Member], heads: Mapping[torch.Tensor | str, int], world: int
) -> dict[str, int]:
    """Every member's matrices (:func:`cut`), with ``heads`` given by view or original
    name (checked: every key names a member). Returns ``heads`` by name."""
    by_name = {m.name: m for m in members}
    by_id = {id(m.tensor): m for m in members}
    chosen: dict[str, int] = {}
    for key, count in heads.items():
        member = by_name.get(key) if isinstance(key, str) else by_id.get(id(key))
        if member is None:
            shown = key if isinstance(key, str) else f"a tensor of shape {tuple(key.shape)}"
            raise OptimStateError(
                f"heads= names {shown!r}, which is not a parameter given to this "
                "flatview.optim.Whole (name views by their original names, or pass "
                "the views themselves)"
            )
        if not isinstance(count, int) or isinstance(count, bool):
            raise OptimStateError(f"heads= for {member.name!r} must be an int, got {count!r}")
        chosen[member.name] = count
    for member in members:
        cut(member, chosen.get(member.name, 1), world)
    return chosen


def _matrix(member: Member, number: int, span: Interval, shape: torch.Size, world: int) -> Matrix:
    lo, hi = span
    slices = []
    for start, end in member.pieces:
        first, last = max(start, lo), min(end, hi)
        slices.append((first - lo, last - lo) if last > first else (0, 0))
    return Matrix(member, number, span, shape, tuple(slices))


BALANCE_SLACK = 0.05
"""How far above the mean cost a rank may own matrices it holds before they go to the
least loaded rank instead (each costs its bytes twice then: gradient in, update out)."""


def assign_owners(matrices: Sequence[Matrix], world: int) -> list[int]:
    """Owners for every matrix, the same on every rank. A replicated one is stepped
    everywhere. The others, in decreasing cost (longest processing time first), stay
    with the rank holding most of them while its cost stays within
    :data:`BALANCE_SLACK` of the mean (nothing, or the least, travels), and go to the
    least loaded rank otherwise (among equally loaded ones, the one holding most of it).
    Returns the cost each rank owns."""
    load = [0] * world
    placed = []
    for m in matrices:
        if m.member.placement.sharded:
            placed.append(m)
        else:
            m.owner = EVERY_RANK
    cap = sum(m.cost for m in placed) / world * (1 + BALANCE_SLACK)
    for m in sorted(placed, key=lambda m: (-m.cost, m.member.name, m.number)):
        held = [m.slices[r][1] - m.slices[r][0] for r in range(world)]
        home = max(range(world), key=lambda r: (held[r], -r))
        if load[home] + m.cost <= cap:
            m.owner = home
        else:
            least = min(load)
            m.owner = max(
                (r for r in range(world) if load[r] == least), key=lambda r: (held[r], -r)
            )
        load[m.owner] += m.cost
    return load


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
    """Build the inner optimizer over meta tensors of the matrices' shapes, on every rank
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
                        f"{optimizer_cls.__name__} refuses parameter {name!r} (stepped as "
                        f"shape {tuple(shape)}): {alone}"
                    ) from alone
        raise OptimStateError(
            f"{optimizer_cls.__name__} could not be built over these parameters: {err}"
        ) from err


def checksum(piece: torch.Tensor) -> float:
    # A sum in double precision changes with any write to the piece (short of one that
    # keeps the sum to the last bit); read back with the step's flags, it costs one pass.
    return float(piece.double().sum()) if piece.numel() else 0.0
