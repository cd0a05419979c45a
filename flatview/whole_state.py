"""The optimizer state of :class:`flatview.optim.Whole`: made eagerly, read and loaded by
original name, in the consolidated form and in :mod:`flatview.checkpoint`'s sharded form.

Each matrix's state lives on its owner only, in the inner optimizer, keyed by the tensor
that optimizer steps (a whole copy or an alias, see :mod:`flatview.whole_members`).

Eager state
    torch's optimizers make a parameter's state at its first step with a gradient. A
    matrix that never had one (an expert no token was routed to, a skipped layer) then
    has none on its owner while others do, and a distributed checkpoint, which every
    rank must describe alike, cannot be loaded back into a fresh optimizer (whose state
    is empty: ``torch.distributed.checkpoint.load`` fills only what the destination
    holds). :func:`make_eager` gives every matrix at construction exactly the state
    the inner optimizer's first step would make before updating it (``torch.optim.Muon``:
    a zero ``momentum_buffer``; ``Adam`` / ``AdamW``: ``step`` 0 and zero moments),
    which its step then finds and uses: training is unchanged, bit for bit. For other
    optimizers flatview does not know that state; theirs stays lazy, and the sharded
    checkpoint form refuses them (the consolidated form works).

By name
    A parameter stepped as several matrices (experts, heads) has one state entry:
    per-element tensors laid end to end in the parameter's shape, scalars (``step``)
    once. :func:`consolidated` all-gathers the owners' state; :func:`sharded` builds,
    for ``torch.distributed.checkpoint``, each per-element tensor as a ``ShardedTensor``
    of the parameter's shape whose local shards on each owner are its matrices' state
    tensors themselves (aliases: a load writes them in place), after one exchange of
    descriptions so that every rank describes every entry alike. :func:`load` takes
    either form back, at any world size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from flatview.comm.consolidate import exchange
from flatview.errors import OptimStateError
from flatview.optim_state import snapshot
from flatview.sharded_tensors import Box, boxes, global_rank, is_sharded
from flatview.whole_members import EVERY_RANK, Matrix, Member

Run = Callable[[Matrix], "torch.Tensor | None"]
"""The tensor this rank's inner optimizer steps for a matrix (``None``: not stepped here)."""


# ------------------------------------------------------------------------ eager state


def _fresh(optimizer: torch.optim.Optimizer, param: torch.Tensor, group: Mapping[str, Any]) -> Any:
    """The state ``optimizer``'s first step makes for ``param`` before updating it, or
    ``None`` where flatview does not know it (see the module docstring)."""
    kind = type(optimizer)
    if kind is torch.optim.Muon:
        return {"momentum_buffer": torch.zeros_like(param, memory_format=torch.preserve_format)}
    if kind in (torch.optim.Adam, torch.optim.AdamW):
        fused = bool(group.get("fused"))
        wide = torch.get_default_dtype() == torch.float64 and not fused
        scalar = torch.float64 if wide else torch.float32
        if group.get("capturable") or fused:
            step = torch.zeros((), dtype=scalar, device=param.device)
        else:
            step = torch.tensor(0.0, dtype=scalar, device="cpu")
        state = {"step": step}
        keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group.get("amsgrad") else [])
        for key in keys:
            state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state
    return None


def knows_fresh_state(optimizer_cls: type) -> bool:
    """Whether :func:`make_eager` can make ``optimizer_cls``'s state."""
    return optimizer_cls in (torch.optim.Muon, torch.optim.Adam, torch.optim.AdamW)


def make_eager(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter of ``optimizer`` without state its first step's state."""
    if not knows_fresh_state(type(optimizer)):
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not optimizer.state.get(param):
                optimizer.state[param] = _fresh(optimizer, param, group)


# ------------------------------------------------------------------- reading state


def _elementwise(value: Any, numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == numel


def _stepped_here(m: Matrix, rank: int, sharded: bool) -> bool:
    """Whether this rank reports ``m``'s state: its owner, or rank 0 for a replicated
    matrix of a sharded model (every rank holds the same)."""
    if m.owner == EVERY_RANK:
        return not sharded or rank == 0
    return m.owner == rank


def consolidated(
    members: Sequence[Member],
    state: Mapping[torch.Tensor, Mapping[Any, Any]],
    run: Run,
    rank: int,
    group: dist.ProcessGroup | None,
    sharded: bool,
) -> dict[str, dict[Any, Any]]:
    """Every member's state by name, whole CPU tensors in the parameter's shape, on
    every rank (an all-gather of objects where the model is sharded)."""
    mine: dict[tuple[str, int], dict[Any, Any]] = {}
    for member in members:
        for m in member.matrices:
            tensor = run(m) if _stepped_here(m, rank, sharded) else None
            found = state.get(tensor) if tensor is not None else None
            if found:
                mine[(member.name, m.number)] = {k: snapshot(v) for k, v in found.items()}
    parts = exchange(mine, group) if sharded else [mine]
    everything = {k: v for part in parts for k, v in part.items()}
    out: dict[str, dict[Any, Any]] = {}
    for member in members:
        states = [everything.get((member.name, m.number)) for m in member.matrices]
        if not any(states):
            continue
        out[member.name] = _joined(member, states)
    return out


def _complete(member: Member, states: Sequence[Mapping[Any, Any] | None]) -> None:
    if not all(states):
        missing = [m.name for m, s in zip(member.matrices, states, strict=True) if not s]
        raise OptimStateError(
            f"the matrices {missing} of parameter {member.name!r} have no optimizer state "
            "while its other matrices have some"
        )


def _joined(member: Member, states: Sequence[Mapping[Any, Any] | None]) -> dict[Any, Any]:
    """One member's state from its matrices' (per-element tensors end to end)."""
    _complete(member, states)
    first = states[0]
    assert first is not None
    joined: dict[Any, Any] = {}
    for key, value in first.items():
        parts = [s[key] for s in states if s is not None]
        if _elementwise(value, member.matrices[0].numel):
            joined[key] = torch.cat([p.reshape(-1) for p in parts]).reshape(member.shape)
        else:
            joined[key] = value
    return joined


def sharded(
    members: Sequence[Member],
    state: Mapping[torch.Tensor, Mapping[Any, Any]],
    run: Run,
    rank: int,
    group: dist.ProcessGroup | None,
    world: int,
    sharded_model: bool,
    cpu_offload: bool,
) -> dict[str, dict[Any, Any]]:
    """Every member's state by name for ``torch.distributed.checkpoint``: per-element
    tensors of sharded members as ``ShardedTensor`` s over the owners' own state tensors
    (``rank`` of ``world`` in ``group``, the members' domain), scalars plain and alike on
    every rank (see the module docstring)."""
    description: dict[tuple[str, int], dict[Any, Any]] = {}
    for member in members:
        for m in member.matrices:
            tensor = run(m) if _stepped_here(m, rank, sharded_model) else None
            found = state.get(tensor) if tensor is not None else None
            if found:
                description[(member.name, m.number)] = {
                    key: ("elem", value.dtype)
                    if _elementwise(value, m.numel)
                    else ("value", snapshot(value))
                    for key, value in found.items()
                }
    parts = exchange(description, group) if sharded_model else [description]
    described = {k: v for part in parts for k, v in part.items()}
    out: dict[str, dict[Any, Any]] = {}
    for member in members:
        kinds = [described.get((member.name, m.number)) for m in member.matrices]
        if not any(kinds):
            continue
        _complete(member, kinds)
        entry: dict[Any, Any] = {}
        first = kinds[0]
        assert first is not None
        for key, (kind, value) in first.items():
            if kind != "elem":
                entry[key] = value
                continue
            if not member.placement.sharded:
                # Replicated: every rank steps every matrix alike.
                locals_ = [(m, state[t][key]) for m in member.matrices if (t := run(m)) is not None]
                joined = torch.cat([t.detach().reshape(-1) for _, t in locals_])
                entry[key] = joined.reshape(member.shape).to(
                    "cpu" if cpu_offload else joined.device
                )
            else:
                owned = [
                    (m, state[t][key])
                    for m in member.matrices
                    if m.owner == rank and (t := run(m)) is not None
                ]
                entry[key] = _sharded_tensor(member, owned, value, group, rank, world, cpu_offload)
        out[member.name] = entry
    return out


def _sharded_tensor(
    member: Member,
    owned: Sequence[tuple[Matrix, torch.Tensor]],
    dtype: torch.dtype,
    group: dist.ProcessGroup | None,
    rank: int,
    world: int,
    cpu_offload: bool,
) -> Any:
    """A ``ShardedTensor`` of the member's shape whose shards are its matrices, each on
    its owner; this rank's local shards are views of ``owned`` state tensors."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
        TensorProperties,
    )

    shape = tuple(member.shape)
    device = torch.device("cpu") if cpu_offload or not owned else owned[0][1].device
    # A rank owning none of the matrices gets an empty block past the end (as in
    # flatview.sharded_tensors.sharded_value: torch's load planner drops a ShardedTensor
    # without local shards from the keys it expects).
    nothing: Box = ((shape[0], *(0 for _ in shape[1:])), (0,) * len(shape))
    metadata = []
    owners = {m.owner for m in member.matrices}
    for m in member.matrices:
        placement = f"rank:{global_rank(group, m.owner)}/{device}"
        for offsets, sizes in boxes(shape, *m.span):
            metadata.append(ShardMetadata(list(offsets), list(sizes), placement))
    here = f"rank:{global_rank(group, rank)}/{device}"
    for r in range(world):
        if r not in owners:
            placement = f"rank:{global_rank(group, r)}/{device}"
            metadata.append(ShardMetadata(list(nothing[0]), list(nothing[1]), placement))
    local_shards = []
    for m, tensor in owned:
        flat = tensor.detach().reshape(-1)
        if cpu_offload:
            flat = flat.to("cpu")
        cursor = 0
        for offsets, sizes in boxes(shape, *m.span):
            numel = math.prod(sizes)
            block = flat[cursor : cursor + numel].view(sizes)
            cursor += numel
            local_shards.append(Shard(block, ShardMetadata(list(offsets), list(sizes), here)))
    if not owned:
        empty = torch.empty(nothing[1], dtype=dtype, device=device)
        local_shards.append(Shard(empty, ShardMetadata(list(nothing[0]), list(nothing[1]), here)))
    properties = TensorProperties(dtype=dtype, requires_grad=False)
    global_metadata = ShardedTensorMetadata(metadata, torch.Size(shape), properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, global_metadata, process_group=group
    )


# -------------------------------------------------------------------- loading state


def matrix_value(member: Member, m: Matrix, key: Any, value: Any) -> Any:
    """The state ``key`` of matrix ``m`` from its member's ``value`` (a full tensor of
    the parameter's elements, a ``ShardedTensor`` of :func:`sharded`, or a scalar)."""
    if is_sharded(value):
        return _from_shards(member, m, key, value)
    if not isinstance(value, torch.Tensor):
        return value
    if value.dim() == 0:
        # Each matrix its own: optimizers count in place (Adam's ``step += 1``), and a
        # tensor shared by an expert tensor's matrices would count once per matrix.
        return value.detach().clone()
    if value.numel() != member.placement.numel:
        raise OptimStateError(
            f"state {key!r} of parameter {member.name!r} has {value.numel()} elements, the "
            f"parameter {member.placement.numel} (shape {tuple(member.shape)})"
        )
    start, end = m.span
    return value.detach().reshape(-1)[start:end].clone().view(m.shape)


def _from_shards(member: Member, m: Matrix, key: Any, value: Any) -> torch.Tensor:
    shape = tuple(member.shape)
    inner = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    start, end = m.span
    out: torch.Tensor | None = None
    covered = 0
    for shard in value.local_shards():
        numel = shard.tensor.numel()
        first = sum(o * s for o, s in zip(shard.metadata.shard_offsets, inner, strict=True))
        if numel == 0 or first + numel <= start or first >= end:
            continue
        if out is None:
            out = shard.tensor.new_zeros(m.numel)
        lo, hi = max(first, start), min(first + numel, end)
        out[lo - start : hi - start] = shard.tensor.reshape(-1)[lo - first : hi - first]
        covered += hi - lo
    if out is None or covered != m.numel:
        raise OptimStateError(
            f"the ShardedTensor given for state {key!r} of {member.name!r} does not hold "
            f"matrix {m.name!r} on this rank, its owner: load the sharded form into the "
            "dict flatview.checkpoint.get_state_dict returned for this optimizer "
            "(torch.distributed.checkpoint.load reshards it)"
        )
    return out.view(m.shape)


def load(
    members: Sequence[Member],
    matrices: Sequence[Matrix],
    inner: torch.optim.Optimizer,
    run: Run,
    param_groups: Sequence[dict[str, Any]],
    state_dict: Mapping[str, Any],
) -> None:
    """The body of :meth:`flatview.optim.Whole.load_state_dict`: check the dict against
    ``param_groups`` (the ``Whole``'s, over views), load each matrix this rank steps
    into ``inner``, then the hyperparameters into ``param_groups``."""
    groups = state_dict.get("param_groups")
    if not isinstance(groups, list) or len(groups) != len(param_groups):
        raise OptimStateError(
            f"the state dict has {len(groups) if isinstance(groups, list) else 'no'} "
            f"parameter groups, this optimizer {len(param_groups)}"
        )
    names = {id(m.tensor): m.name for m in members}
    for number, (saved, group) in enumerate(zip(groups, param_groups, strict=True)):
        want = [names[id(t)] for t in group["params"]]
        if list(saved.get("params", ())) != want:
            raise OptimStateError(
                f"parameter group {number} of the state dict holds {saved.get('params')}, "
                f"this optimizer's {want}"
            )
    states: Mapping[str, Mapping[Any, Any]] = state_dict.get("state", {})
    unknown = sorted(set(states) - set(names.values()))
    if unknown:
        raise OptimStateError(f"the state dict has state for unknown parameters {unknown}")
    inner_state: dict[int, dict[Any, Any]] = {}
    position = 0
    for m in matrices:
        if run(m) is None:
            continue
        state = states.get(m.member.name)
        if state is not None:
            inner_state[position] = {k: matrix_value(m.member, m, k, v) for k, v in state.items()}
        position += 1
    inner_groups = []
    position = 0
    for saved, inner_group in zip(groups, inner.param_groups, strict=True):
        count = len(inner_group["params"])
        inner_groups.append(
            {
                **{k: v for k, v in saved.items() if k != "params"},
                "params": list(range(position, position + count)),
            }
        )
        position += count
    inner.load_state_dict({"state": inner_state, "param_groups": inner_groups})
    make_eager(inner)
    for saved, group in zip(groups, param_groups, strict=True):
        for key, value in saved.items():
            if key != "params":
                group[key] = value
