"""Optimizer state saved sharded one way, moved to flatview's pieces: what lets torch
FSDP1's own sharded recipe load over views.

torch's recipe for FSDP1's sharded optimizer checkpoints (the one Lightning's
``FSDPStrategy`` runs) fills a template cut from the *model*'s sharded state dict
(``load_sharded_optimizer_state_dict``): each rank gets the rows FSDP's sharded state
dict gives it (dim 0 cut in even chunks), not the elements its views hold (its range of
the flat parameter). :func:`to_pieces` moves the elements where flatview's load
(:func:`flatview.sharded_tensors.local_of_sharded`) expects them: one all-gather of
descriptions, then one all-to-all per dtype of the elements that move.

Words: an *entry* is one per-element state tensor of one parameter, ``(name, key)``; a
*run* is a range ``[lo, hi)`` of the flattened parameter. Each rank *holds* some runs of
an entry (the local shards of the ``ShardedTensor`` it was given) and *needs* one run
(its piece in flatview's layout). Every rank describes what it holds and needs, the
descriptions are all-gathered, and every rank derives the same :func:`plan` from them:
which rank sends which run to which, and which entries move at all (those where some
rank needs what it does not hold). Entries already cut flatview's way are left as they
are; where every rank holds exactly what it needs (flatview's own sharded form) one
flag per rank is all that is exchanged.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from flatview.checkpoint_experts import group_view
from flatview.comm.collectives import all_to_all, gather_objects
from flatview.errors import OptimStateError
from flatview.sharded_tensors import is_sharded, sharded_value

if TYPE_CHECKING:
    from flatview.runtime import Runtime

Run = tuple[int, int]
"""``[lo, hi)`` of a flattened parameter."""

Entry = tuple[str, str, tuple[int, ...]]
"""``(parameter name, state key, expert group)``: the key as ``repr`` so that every rank
orders alike; the global ranks of the parameter's own unit group (experts: ranks of
different groups hold different experts under one name), ``()`` on the adapter's."""


def block_runs(shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]) -> list[Run]:
    """The elements of the block at ``offsets`` of ``sizes`` in a row-major tensor of
    ``shape``, as runs of the flattened tensor in the block's own element order (the
    order of ``block.reshape(-1)``); the inverse of :func:`flatview.sharded_tensors.boxes`."""
    if math.prod(sizes) == 0:
        return []
    # Trailing dimensions the block spans whole join its rows into longer runs.
    whole = len(shape)
    while whole > 0 and offsets[whole - 1] == 0 and sizes[whole - 1] == shape[whole - 1]:
        whole -= 1
    if whole == 0:
        return [(0, math.prod(shape))]
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    partial = whole - 1  # rows of the block: one run each along this dimension
    length = sizes[partial] * strides[partial]
    first = offsets[partial] * strides[partial]
    rows = itertools.product(
        *(range(o, o + n) for o, n in zip(offsets[:partial], sizes[:partial], strict=True))
    )
    starts = (first + sum(i * s for i, s in zip(row, strides, strict=False)) for row in rows)
    return [(start, start + length) for start in starts]


@dataclass(frozen=True)
class Transfer:
    """Elements ``[lo, hi)`` of entry number ``entry`` (in the agreed order), from rank
    ``source`` to rank ``target`` (ranks of the exchange's group)."""

    entry: int
    source: int
    target: int
    lo: int
    hi: int


@dataclass(frozen=True)
class Plan:
    """What :func:`plan` decides, alike on every rank."""

    moving: list[int]
    """The entries some rank needs elements of that it does not hold."""
    transfers: list[Transfer]
    """Every run that moves (or is copied where it is), by entry, target, element."""
    gaps: list[tuple[int, int, list[Run]]]
    """``(entry, rank, runs)``: elements a rank needs and no rank holds."""


def plan(held: Sequence[Sequence[Sequence[Run]]], needed: Sequence[Sequence[Run | None]]) -> Plan:
    """Which entries move and how: ``held[rank][entry]`` the runs a rank holds,
    ``needed[rank][entry]`` the one it needs (``None``: the rank loads no such entry).
    An entry moves where some rank needs elements it does not hold; every needed element
    of it then comes from the lowest rank holding it, the needing rank itself first."""
    world = len(held)
    entries = len(needed[0]) if needed else 0
    moving = [
        e
        for e in range(entries)
        if any(not _covers(held[r][e], needed[r][e]) for r in range(world))
    ]
    transfers: list[Transfer] = []
    gaps: list[tuple[int, int, list[Run]]] = []
    for e in moving:
        for target in range(world):
            want = needed[target][e]
            if want is None or want[0] == want[1]:
                continue
            missing = [want]
            for source in (target, *(r for r in range(world) if r != target)):
                for lo, hi in held[source][e]:
                    left = []
                    for a, b in missing:
                        start, end = max(a, lo), min(b, hi)
                        if start >= end:
                            left.append((a, b))
                            continue
                        transfers.append(Transfer(e, source, target, start, end))
                        left += [r for r in ((a, start), (end, b)) if r[0] < r[1]]
                    missing = left
            if missing:
                gaps.append((e, target, missing))
    transfers.sort(key=lambda t: (t.entry, t.target, t.lo))
    return Plan(moving, transfers, gaps)


def _covers(runs: Sequence[Run], want: Run | None) -> bool:
    """Whether ``runs`` hold exactly ``want`` (nothing where nothing is wanted)."""
    if want is None or want[0] == want[1]:
        return not any(lo < hi for lo, hi in runs)
    ordered = sorted((lo, hi) for lo, hi in runs if lo < hi)
    cursor = want[0]
    for lo, hi in ordered:
        if lo != cursor:
            return False
        cursor = hi
    return cursor == want[1]


# ------------------------------------------------------------------- the exchange


@dataclass
class _Local:
    """What this rank was given of one entry: its runs and their elements."""

    runs: list[Run]
    values: list[torch.Tensor]

    def elements(self, lo: int, hi: int) -> torch.Tensor:
        for (start, end), value in zip(self.runs, self.values, strict=True):
            if start <= lo and hi <= end:
                return value[lo - start : hi - start]
        raise AssertionError((lo, hi, self.runs))


def _given(value: Any) -> _Local:
    runs: list[Run] = []
    values: list[torch.Tensor] = []
    for shard in value.local_shards():
        flat = shard.tensor.detach().reshape(-1)
        cursor = 0
        meta = shard.metadata
        for lo, hi in block_runs(tuple(value.shape), meta.shard_offsets, meta.shard_sizes):
            runs.append((lo, hi))
            values.append(flat[cursor : cursor + hi - lo])
            cursor += hi - lo
    return _Local(runs, values)


def to_pieces(runtime: Runtime, state_dict: Any) -> Any:
    """``state_dict`` (an optimizer state dict keyed by original name, as
    ``FSDP.optim_state_dict`` gives) with every per-element ``ShardedTensor`` cut
    flatview's way: each rank's local shards are its pieces. Collective over the
    adapter's ``agreement_group``: every rank calls it, whatever it was given (what is
    not such a dict comes back as it was, for the load to refuse on every rank)."""
    table, adapter = runtime.table, runtime.adapter
    group = adapter.agreement_group
    mine: dict[Entry, tuple[str, list[Run], Run]] = {}
    given: dict[Entry, tuple[str, Any, _Local]] = {}
    failure = None
    state = state_dict.get("state") if isinstance(state_dict, Mapping) else None
    try:
        for name, entry in (state or {}).items():
            index = table.index_of_name(name) if isinstance(name, str) else None
            if index is None or not isinstance(entry, Mapping):
                continue
            home = table.params[index].placement
            own = table.own_group(index)
            tag = tuple(dist.get_process_group_ranks(own.group)) if own is not None else ()
            for key, value in entry.items():
                if not is_sharded(value) or not home.shape:
                    continue
                if tuple(value.shape) != tuple(home.shape):
                    raise OptimStateError(
                        f"the ShardedTensor given for {name!r} ({key!r}) has shape "
                        f"{tuple(value.shape)}, the parameter {tuple(home.shape)}"
                    )
                held = _given(value)
                need = home.param_interval if home.layout is not None else (0, home.numel)
                mine[(name, repr(key), tag)] = (str(value.dtype), held.runs, need)
                given[(name, repr(key), tag)] = (name, key, held)
    except Exception as err:  # raised on every rank below, not on this one alone
        failure = f"{type(err).__name__}: {err}"
    # First one flag per rank: a dict cut flatview's way (its own sharded form, as
    # accelerate loads it) costs no exchange of descriptions, which grow with ranks.
    cut = all(_covers(runs, need) for _, runs, need in mine.values())
    flags = gather_objects((failure, cut), group)
    failed = [(r, why) for r, (why, _) in enumerate(flags) if why]
    if failed:
        raise OptimStateError(
            "cannot load the sharded optimizer state: "
            + "; ".join(f"rank {r}: {why}" for r, why in failed)
        )
    if all(cut for _, cut in flags):
        return state_dict
    everyone = gather_objects({"entries": mine}, group)
    order = sorted({e for told in everyone for e in told["entries"]})
    dtypes: dict[Entry, str] = {}
    for rank, told in enumerate(everyone):
        for entry, (dtype, _, _) in told["entries"].items():
            if dtypes.setdefault(entry, dtype) != dtype:
                raise OptimStateError(
                    f"ranks were given {entry[0]!r} ({entry[1]}) in different dtypes "
                    f"({dtypes[entry]} and, on rank {rank}, {dtype})"
                )
    holds = [[told["entries"].get(e, (None, [], None))[1] for e in order] for told in everyone]
    needed = [[told["entries"].get(e, (None, [], None))[2] for e in order] for told in everyone]
    decided = plan(holds, needed)
    if decided.gaps:
        e, rank, runs = decided.gaps[0]
        raise OptimStateError(
            f"cannot load the sharded optimizer state of {order[e][0]!r} ({order[e][1]}): "
            f"rank {rank} needs elements {runs} of it, which no rank was given"
        )
    if not decided.moving:
        return state_dict  # as given: flatview's own cut, or for the load to judge
    device = adapter.device
    needs = {e: mine[order[e]][2] for e in decided.moving if order[e] in mine}
    held_here = {e: given[order[e]][2] for e in decided.moving if order[e] in given}
    me = dist.get_rank(group)
    received = _exchange(order, decided, dtypes, needs, held_here, me, group, device)
    out_state = {name: dict(entry) for name, entry in state_dict["state"].items()}
    for e in decided.moving:
        entry = order[e]
        if entry not in given:
            continue
        name, key, _ = given[entry]
        index = table.index_of_name(name)
        assert index is not None
        home = table.params[index].placement
        out_state[name][key] = loadable(runtime, index, received[e])
    return {**state_dict, "state": out_state}


def loadable(runtime: Runtime, index: int, mine: torch.Tensor) -> Any:
    """The elements ``mine`` of parameter ``index``'s per-element state that this rank
    needs (its piece; all of them where the parameter is not sharded, or has no
    dimension) in the form flatview's load reads: a ``ShardedTensor`` whose local
    shards are this rank's pieces, the whole tensor where it is not sharded."""
    table = runtime.table
    home = table.params[index].placement
    if home.layout is None or not home.shape:
        return mine.view(home.shape)
    local = torch.zeros(home.local_numel, dtype=mine.dtype, device=mine.device)
    lo, hi = home.local_interval
    local[lo:hi] = mine
    over = group_view(table, index, mine.device) or runtime.adapter
    return sharded_value(home, local, mine.dtype, over, False)


def _exchange(
    order: Sequence[Entry],
    decided: Plan,
    dtypes: Mapping[Entry, str],
    needs: Mapping[int, Run],
    held_here: Mapping[int, _Local],
    me: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> dict[int, torch.Tensor]:
    """Run ``decided``'s transfers: one all-to-all per dtype (in the dtypes' order, alike
    on every rank), copies where a rank holds what it needs. ``needs``: the run this
    rank needs of each moving entry it loads; ``held_here``: what it holds of each.
    Returns the elements of each needed run, by entry number."""
    world = dist.get_world_size(group)
    out: dict[int, torch.Tensor] = {}
    for dtype_name in sorted({dtypes[order[e]] for e in decided.moving}):
        dtype = getattr(torch, dtype_name.removeprefix("torch."))
        chosen = [t for t in decided.transfers if dtypes[order[t.entry]] == dtype_name]
        for e, (lo, hi) in needs.items():
            if dtypes[order[e]] == dtype_name:
                out[e] = torch.empty(hi - lo, dtype=dtype, device=device)
        outgoing: list[torch.Tensor] = []
        outgoing_splits = [0] * world
        incoming_splits = [0] * world
        for t in sorted(chosen, key=lambda t: t.target):
            if t.source == me and t.target == me:
                start = needs[t.entry][0]
                out[t.entry][t.lo - start : t.hi - start].copy_(
                    held_here[t.entry].elements(t.lo, t.hi)
                )
            elif t.source == me:
                outgoing.append(held_here[t.entry].elements(t.lo, t.hi).to(device, dtype))
                outgoing_splits[t.target] += t.hi - t.lo
            elif t.target == me:
                incoming_splits[t.source] += t.hi - t.lo
        sending = torch.cat(outgoing) if outgoing else torch.empty(0, dtype=dtype, device=device)
        incoming = torch.empty(sum(incoming_splits), dtype=dtype, device=device)
        all_to_all(incoming, sending, incoming_splits, outgoing_splits, group)
        cursors = [sum(incoming_splits[:s]) for s in range(world)]
        for t in chosen:
            if t.target == me and t.source != me:
                start = needs[t.entry][0]
                size = t.hi - t.lo
                out[t.entry][t.lo - start : t.hi - start].copy_(
                    incoming[cursors[t.source] : cursors[t.source] + size]
                )
                cursors[t.source] += size
    return out
