"""Worker functions for hybrid sharding (4 ranks as a 2 x 2 grid: shard groups {0, 1} and
{2, 3}, replica groups {0, 2} and {1, 3}): the masked hybrid reduction of
:mod:`flatview.comm.hybrid` on its own, and torch FSDP1 ``HYBRID_SHARD`` /
``_HYBRID_SHARD_ZERO2`` models with and without flatview.

The grids come from :func:`tests.scenarios.hybrid_groups`, made once per worker process.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import flatview
from flatview.comm.hybrid import HybridGroups, check_grid
from flatview.comm.ledger import Ledger
from flatview.comm.options import Strategy
from flatview.errors import FlatViewError
from flatview.layout import FlatLayout, MaskPlan, Segment
from tests.hybrid_reference import hybrid_reduce
from tests.scenarios import (
    Scenario,
    as_names,
    full_state,
    hybrid_groups,
    local_batch,
    loss_of,
    make_net,
    wrap_fsdp,
)

# ------------------------------------------------------------- counting per group

# Which argument of each c10d op holds the bytes it is charged for (as in
# flatview's CollectiveCounter), for the ops these tests meet.
_MEASURED = {
    "allreduce_": ("all_reduce", "tensors"),
    "_reduce_scatter_base_": ("reduce_scatter", "input_tensor"),
    "reduce_scatter_": ("reduce_scatter", "input_tensors"),
    "alltoall_base_": ("all_to_all", "input"),
    "allgather_": ("all_gather", "output_tensors"),
    "_allgather_base_": ("all_gather", "output_tensor"),
    "allgather_into_tensor_coalesced_": ("all_gather", "outputs"),
    "broadcast_": ("broadcast", "tensors"),
}


def _numel_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_numel_bytes(v) for v in value)
    return 0


class GroupCounter(TorchDispatchMode):
    """Bytes and calls of every collective, per (kind, global ranks of its group)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[tuple[str, tuple[int, ...]], int] = defaultdict(int)
        self.calls: dict[tuple[str, tuple[int, ...]], int] = defaultdict(int)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        if getattr(func, "namespace", "") == "c10d" and name in _MEASURED:
            kind, argument = _MEASURED[name]
            value, ranks = None, ()
            for index, spec in enumerate(func._schema.arguments):
                got = args[index] if index < len(args) else kwargs.get(spec.name)
                if spec.name == argument:
                    value = got
                elif "ProcessGroup" in str(spec.type) and got is not None:
                    # The dispatcher hands the group over boxed.
                    group = dist.ProcessGroup.unbox(got)
                    ranks = tuple(dist.get_process_group_ranks(group))
            self.bytes[(kind, ranks)] += _numel_bytes(value)
            self.calls[(kind, ranks)] += 1
        return func(*args, **kwargs)

    def by_group(self) -> dict[tuple[int, ...], dict[str, int]]:
        out: dict[tuple[int, ...], dict[str, int]] = defaultdict(dict)
        for (kind, ranks), size in self.bytes.items():
            out[ranks][kind] = size
        return dict(out)


def grid(kind: str = "mesh") -> HybridGroups:
    """This rank's place in the suite's 2 x 2 grid."""
    arg = hybrid_groups(kind)
    if "device_mesh" in arg:
        mesh = arg["device_mesh"]
        shard, replica = mesh.get_group(1), mesh.get_group(0)
    else:
        shard, replica = arg["process_group"]
    return HybridGroups(shard, shard.rank(), shard.size(), replica, replica.size())


def grid_places(kind: str) -> tuple[int, int]:
    """:func:`check_grid` on the real groups of every rank (one all_gather_object)."""
    groups = grid(kind)
    mine = (
        dist.get_process_group_ranks(groups.shard),
        dist.get_process_group_ranks(groups.replica),
    )
    places: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(places, mine)
    return check_grid(places)


# ----------------------------------------------------------- the reduction alone


@dataclass(frozen=True)
class Entry:
    """One flat gradient of a case: segments as (offset, numel), the flat's numel, which
    segments are used."""

    segments: tuple[tuple[int, int], ...]
    numel: int
    used: tuple[bool, ...]

    def plan(self, world_size: int) -> MaskPlan:
        layout = FlatLayout(
            tuple(Segment(o, n, (n,)) for o, n in self.segments), self.numel, world_size
        )
        return MaskPlan.build(layout, self.used)


@dataclass(frozen=True)
class Case:
    name: str
    entries: tuple[Entry, ...]
    strategy: str = "auto"
    predivide: float = 2.0
    postdivide: float = 2.0


# Gaps between segments (torch's alignment padding) and padding at the end; a plan whose
# used elements all sit on shard rank 0 (rank 1's replica group then has nothing to do);
# nothing used; two gradients in one reduction.
GAPS = ((0, 3), (4, 6), (12, 2))  # numel 15: shards of 8, one element of padding
HALVES = ((0, 4), (4, 4))  # numel 8: shards of 4
_SHAPES = (
    ("all-used", (Entry(GAPS, 15, (True, True, True)),)),
    ("ends-used", (Entry(GAPS, 15, (True, False, True)),)),
    ("middle-used", (Entry(GAPS, 15, (False, True, False)),)),
    ("rank0-only", (Entry(HALVES, 8, (True, False)),)),
    ("none-used", (Entry(GAPS, 15, (False, False, False)),)),
    ("two", (Entry(GAPS, 15, (True, False, True)), Entry(HALVES, 8, (False, True)))),
)
CASES = (
    *(
        Case(f"{name}-{strategy}", entries, strategy, *divide)
        for strategy, divide in (("auto", (2.0, 2.0)), ("reduce_scatter", (1.0, 4.0)))
        for name, entries in _SHAPES
    ),
    # Uneven parts (6 and 2 elements): the exact exchange, asked for by name.
    Case("uneven-all_to_all", (Entry(GAPS, 15, (False, True, True)),), "all_to_all"),
)


def case_grad(case: int, entry: int, rank: int, numel: int) -> torch.Tensor:
    """The padded gradient of entry ``entry`` of case ``case`` on global rank ``rank``."""
    g = torch.Generator().manual_seed(1000 * case + 10 * entry + rank)
    return torch.randn(numel, generator=g)


def reduce_cases(kind: str) -> list[dict[str, Any]]:
    """Every case of :data:`CASES` through :func:`hybrid_reduce` on the grid: shards,
    ledger, bytes per group measured at the collectives, inputs unchanged; last, what a
    plan for the wrong shard size raises (before any collective: the pool checks that
    the ranks' collective counts still agree)."""
    groups = grid(kind)
    rank = dist.get_rank()
    out = []
    for number, case in enumerate(CASES):
        plans = [e.plan(groups.shard_size) for e in case.entries]
        grads = [case_grad(number, i, rank, p.layout.padded_numel) for i, p in enumerate(plans)]
        before = [g.clone() for g in grads]
        ledger = Ledger()
        with GroupCounter() as counter:
            shards = hybrid_reduce(
                grads,
                plans,
                groups,
                ledger,
                predivide=case.predivide,
                postdivide=case.postdivide,
                strategy=Strategy(case.strategy),
            )
        out.append(
            {
                "shards": [s.tolist() for s in shards],
                "ledger": dict(ledger.bytes),
                "ledger_calls": dict(ledger.calls),
                "groups": counter.by_group(),
                "unchanged": all(torch.equal(a, b) for a, b in zip(grads, before, strict=True)),
            }
        )
    wrong = Entry(GAPS, 15, (True, True, True)).plan(4)
    try:
        hybrid_reduce([torch.zeros(16)], [wrong], groups, Ledger())
    except ValueError as err:
        out.append({"error": str(err)})
    return out


# ------------------------------------------------------------ torch FSDP1 models


def plain_training(scenario: Scenario) -> Any:
    """Bare torch FSDP1 hybrid training (nothing skipped, no flatview): the final full
    parameters on rank 0."""
    model = wrap_fsdp(scenario, make_net(scenario))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for micro in range(len(scenario.skips)):
        assert not scenario.skips[micro], "bare FSDP cannot skip"
        x, y = local_batch(scenario, micro)
        loss_of(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return full_state(model, scenario)


@contextlib.contextmanager
def _wrapped(scenario: Scenario, **kwargs: Any) -> Iterator[tuple[Any, flatview.FlatView]]:
    model = wrap_fsdp(scenario, make_net(scenario))
    yield model, flatview.wrap(model, **{**scenario.flatview_options, **kwargs})


def _step(model: Any, fv: flatview.FlatView, scenario: Scenario, micro: int, skip: Any) -> None:
    x, y = local_batch(scenario, micro)
    names = as_names(skip)
    with fv.step(skip=list(names)):
        loss_of(model(x, names), y).backward()


def bytes_per_group(scenario: Scenario, skips: Sequence[Sequence[int | str]]) -> dict[str, Any]:
    """Per skip set, one step (after a warm-up) counted per group at the collectives,
    with ``fv.stats``; reduced exactly (all-to-all) so that bytes are exact."""
    with _wrapped(scenario, reduce_strategy="all_to_all") as (model, fv):
        _step(model, fv, scenario, 0, ())
        out = []
        for number, skip in enumerate(skips):
            torch.optim.SGD(fv.parameters(), lr=0.0).zero_grad(set_to_none=True)
            with GroupCounter() as counter:
                _step(model, fv, scenario, 1 + number, skip)
            stats = fv.stats
            assert stats is not None
            out.append(
                {
                    "groups": counter.by_group(),
                    "reduced_bytes": stats.reduced_bytes,
                    "replica_bytes": getattr(stats, "replica_bytes", None),
                    "used_bytes": stats.used_bytes,
                    "units_skipped": stats.units_skipped,
                    "grads_none": sorted(n for n, p in fv.named_parameters() if p.grad is None),
                }
            )
        return {"steps": out}


def replicas_disagree(scenario: Scenario) -> None:
    """Each shard group agrees within itself, but the two groups skip different blocks:
    only a check that spans the replica groups too can see it."""
    with _wrapped(scenario) as (model, fv):
        _step(model, fv, scenario, 0, (dist.get_rank() // 2,))


def wrap_refused(case: str) -> str | None:
    """What flatview.wrap says of a hybrid layout it must refuse (None on a rank outside
    the model)."""
    from torch.distributed.device_mesh import init_device_mesh

    scenario = Scenario(world_size=4, backend="torch", strategy="HYBRID_SHARD")
    if case == "shard-of-one":
        # torch turns it into NO_SHARD, keeps the replica group and reduces only over
        # the (one-rank) shard group: measured, the replicas' gradients are divided by
        # the world size but never summed across replicas.
        arg: dict[str, Any] = {"device_mesh": init_device_mesh("cpu", (4, 1))}
    elif case == "not-a-grid":
        # Replica groups {0, 3} and {1, 2} pair shard rank 0 with shard rank 1.
        rank = dist.get_rank()
        made = [(dist.new_group(r), r) for r in ([0, 1], [2, 3], [0, 3], [1, 2])]
        shard = next(g for g, r in made[:2] if rank in r)
        replica = next(g for g, r in made[2:] if rank in r)
        arg = {"process_group": (shard, replica)}
    elif case == "subset":
        # A model on ranks 0 and 1 only (shard group {0, 1}, replicas of one): ranks 2
        # and 3 never call wrap, so a check over the world would hang on 0 and 1.
        rank = dist.get_rank()
        made = [(dist.new_group(r), r) for r in ([0, 1], [0], [1])]
        if rank >= 2:
            return None
        arg = {"process_group": (made[0][0], made[1 + rank][0])}
    else:
        raise ValueError(case)
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardingStrategy

    model = TorchFSDP(
        make_net(scenario),
        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        device_id=torch.device("cpu"),
        **arg,
    )
    try:
        flatview.wrap(model)
    except FlatViewError as err:
        return str(err)
    raise AssertionError(f"flatview.wrap accepted {case}")
