"""Every rank's description of its optimizer state, merged into one plan: what
:func:`flatview.optim_state.agreed_facts` decides from the one exchange of descriptions.

Every rank merges the same descriptions alike, so every rank raises the same error (a
rank's reported refusal, ranks that made the call differently, optimizers holding
different parameters, state missing where elements are held, scalars that disagree) or
none does: see :mod:`flatview.optim_state`, "Agreement and hangs".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from flatview.errors import OptimStateError
from flatview.layout import Placement
from flatview.state_gather import Kind
from flatview.table import ParamRecord


def raise_reported(
    descriptions: Sequence[Mapping[str, Any]], cause: BaseException | None = None
) -> None:
    """Raise, on every rank alike, the first error a rank reported in place of its
    description."""
    for rank, description in enumerate(descriptions):
        if "error" in description:
            raise OptimStateError(f"on rank {rank}: {description['error']}") from cause


def same_request(everyone: Sequence[Mapping[str, Any]]) -> None:
    """Raise, on every rank alike, if ranks made the call with different options (they
    would go on to different collectives)."""
    first = everyone[0]["request"]
    for rank, description in enumerate(everyone):
        if description["request"] != first:
            raise OptimStateError(
                f"ranks made this call with different options: rank 0 with {first}, rank "
                f"{rank} with {description['request']}; every rank must make the same call"
            )


def not_consolidable(home: Placement, key: Any, shape: Any, rank: int | None) -> OptimStateError:
    where = "" if rank is None else f" on rank {rank}"
    return OptimStateError(
        f"optimizer state {key!r} of parameter {home.name!r} is a tensor of shape "
        f"{tuple(shape)}{where}: neither per-element (shaped like the parameter's local "
        "elements) nor a scalar, so it cannot be consolidated by name"
    )


def merge(
    descriptions: Sequence[Mapping[str, Any]],
    order: Sequence[int],
    homes: Sequence[Placement],
    params: Sequence[ParamRecord],
) -> dict[int, dict[Any, Kind]]:
    """Every rank's description of its state merged into one plan (position -> key ->
    kind), or :class:`OptimStateError` when ranks disagree. Every rank computes it from
    the same descriptions, so all raise alike or none does."""
    world = len(descriptions)
    # Rank 0's list, not this rank's: every rank must word the error alike.
    expected = tuple(descriptions[0]["params"])
    for rank, description in enumerate(descriptions):
        held = description["params"]
        if held != expected:
            mine = [params[i].name for i in expected]
            theirs = [params[i].name for i in held]
            first = next(
                (k for k, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b),
                min(len(mine), len(theirs)),
            )
            raise OptimStateError(
                f"the optimizers passed on different ranks hold different parameters: "
                f"rank 0 holds {len(mine)}, rank {rank} holds {len(theirs)}; at position "
                f"{first} rank 0 has {mine[first] if first < len(mine) else 'none'!r}, rank "
                f"{rank} {theirs[first] if first < len(theirs) else 'none'!r}. Every rank "
                "must pass its counterpart of the same optimizer."
            )
    plan: dict[int, dict[Any, Kind]] = {}
    for position, index in enumerate(order):
        home = homes[index]
        if home.layout is None:
            continue
        having = [r for r in range(world) if position in descriptions[r]["state"]]
        if not having:
            continue
        lacking = [r for r in range(world) if r not in having and home.piece(r).numel > 0]
        if lacking:
            raise OptimStateError(
                f"optimizer state of parameter {home.name!r} exists on rank(s) {having} but "
                f"not on rank(s) {lacking}, which hold elements of it: the ranks did not "
                "step the same parameters (every rank must run the same optimizer steps)"
            )
        # Only ranks holding elements of the parameter speak for it. One holding none
        # may have state that has fallen behind: torch's use_orig_params views give it
        # no gradient, so after a load its `step` stays where the load put it.
        speaking = [r for r in having if home.piece(r).numel > 0] or having
        per_rank = {r: descriptions[r]["state"][position] for r in speaking}
        first = per_rank[speaking[0]]
        for rank in speaking[1:]:
            if set(per_rank[rank]) != set(first):
                raise OptimStateError(
                    f"ranks disagree on the optimizer state of parameter {home.name!r}: rank "
                    f"{speaking[0]} holds {sorted(map(str, first))}, rank {rank} holds "
                    f"{sorted(map(str, per_rank[rank]))}"
                )
        merged: dict[Any, Kind] = {}
        for key, kind in first.items():
            for rank in speaking:
                other = per_rank[rank][key]
                if other[0] == "other":
                    raise not_consolidable(home, key, other[1], rank)
            for rank in speaking[1:]:
                other = per_rank[rank][key]
                if other[0] != kind[0] or (kind[0] == "elem" and other[1] != kind[1]):
                    raise OptimStateError(
                        f"ranks disagree on optimizer state {key!r} of parameter "
                        f"{home.name!r}: rank {speaking[0]} holds {_show(kind)}, rank {rank} "
                        f"{_show(other)}"
                    )
                if kind[0] == "value" and not _same(kind[1], other[1]):
                    raise OptimStateError(
                        f"ranks disagree on optimizer state {key!r} of parameter "
                        f"{home.name!r}: rank {speaking[0]} has {kind[1]!r}, rank {rank} has "
                        f"{other[1]!r} (every rank must run the same optimizer steps)"
                    )
            merged[key] = kind
        plan[position] = merged
    return plan


def _show(kind: Kind) -> str:
    if kind[0] == "elem":
        return f"a per-element {kind[1]} tensor"
    return f"the scalar {kind[1]!r}"


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    try:
        return bool(a == b)
    except Exception:
        return False
