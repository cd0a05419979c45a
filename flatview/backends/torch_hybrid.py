"""Hybrid sharding on torch FSDP1 (``ShardingStrategy.HYBRID_SHARD`` and
``_HYBRID_SHARD_ZERO2``): which layouts the torch adapter takes, and the groups it then
reduces over.

Where torch keeps things (torch 2.13, measured with a ``process_group=(shard, replica)``
pair and with a 2-D ``device_mesh``, dimensions (replicate, shard)):

* ``unit.process_group`` is the *shard group* (each flat parameter is sharded over it as
  with ``FULL_SHARD``; ``unit.rank`` and ``unit.world_size`` are the shard rank and
  size), ``unit._inter_node_pg`` the *replica group* (one member of every shard group,
  all of one shard rank); every unit holds the root's two group objects.
* ``unit._gradient_predivide_factor`` and ``_postdivide_factor`` are computed from the
  whole grid's size; torch's own reduction reduce-scatters in the shard group,
  all-reduces the shard across the replica group, then post-divides.
* ``register_comm_hook`` refuses hybrid strategies, but the post-backward calls a
  unit's ``_comm_hook`` whenever one is set (and then skips its own replica all-reduce):
  the adapter sets ``_comm_hook`` and ``_comm_hook_state`` on every unit itself, and its
  sharded reduction all-reduces across the replica group
  (:class:`~flatview.comm.sharded.ShardedReduction`, ``replica=``).
* A hybrid strategy whose shard group has one rank becomes ``NO_SHARD`` but keeps the
  replica group, and torch then reduces over the one-rank shard group only: replicas
  never sum their gradients (each keeps its own, divided by the grid size). Refused.

What is refused here is refused before any collective; :func:`hybrid_groups` then runs
one ``all_gather_object`` over the world to check that the groups form a grid
(:func:`~flatview.comm.hybrid.check_grid`): a replica group that pairs different shard
ranks would mix different shards, silently in torch. The grid must span every rank of
the run, since flatview's skip-set check runs on the world (replicas that skip
differently would otherwise pair different units' gradients).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from flatview.backends.internals import require_attrs
from flatview.comm.collectives import gather_objects
from flatview.comm.hybrid import HybridGroups, check_grid
from flatview.errors import WrapError

HYBRID_PRIVATES = ("_inter_node_pg",)
"""What the adapter reads of a hybrid unit besides what it reads of every unit."""


def is_hybrid(unit: Any) -> bool:
    """Whether ``unit`` was built for hybrid sharding (also when torch turned a shard
    group of one rank into ``NO_SHARD``: it keeps the replica group)."""
    from torch.distributed.fsdp import ShardingStrategy

    hybrid = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
    return unit.sharding_strategy in hybrid or hasattr(unit, "_inter_node_pg")


def hybrid_groups(root: Any, units: list[tuple[str, Any]], tested: str) -> HybridGroups | None:
    """This rank's place in the grid of a hybrid model (``None``: not hybrid), after
    refusing what the adapter cannot reduce correctly. ``units``: ``(name, unit)``, root
    first, all on the root's shard group already. Collective when hybrid (every rank of
    the world calls it)."""
    from torch.distributed.fsdp import ShardingStrategy

    hybrid = [is_hybrid(unit) for _, unit in units]
    if not any(hybrid):
        return None
    for (name, unit), is_it in zip(units, hybrid, strict=True):
        label = name or "<root>"
        if not is_it:
            raise WrapError(
                f"FSDP unit {label!r} does not use hybrid sharding, its root does; flatview "
                "needs every unit on the same hybrid grid"
            )
        require_attrs(unit, HYBRID_PRIVATES, f"hybrid FSDP unit {label!r}", tested)
        if unit.sharding_strategy is ShardingStrategy.NO_SHARD:
            raise WrapError(
                f"FSDP unit {label!r} uses hybrid sharding with a shard group of one rank "
                "(torch switched it to NO_SHARD): torch then reduces gradients over the "
                "one-rank shard group only, never across replicas, so replicas train "
                "apart; use NO_SHARD (or DDP) over all ranks, or a shard group of two or "
                "more ranks"
            )
        if unit._inter_node_pg is not root._inter_node_pg:
            raise WrapError(
                f"FSDP unit {label!r} uses its own replica group; flatview needs all units "
                "on the root's hybrid grid"
            )
    shard, replica = root.process_group, root._inter_node_pg
    mine = (dist.get_process_group_ranks(shard), dist.get_process_group_ranks(replica))
    world = dist.get_world_size()
    if len(mine[0]) * len(mine[1]) != world:
        # Decided locally, before the world-wide exchange below: the processes outside
        # the model never call wrap, and the exchange would wait for them for ever.
        raise WrapError(
            f"hybrid sharding over {len(mine[0])} x {len(mine[1])} ranks (shard group x "
            f"replica group) in a world of {world} processes: flatview's grid and "
            "skip-set checks run over every process, so the grid must span the default "
            "process group"
        )
    places = gather_objects(mine, None)
    try:
        check_grid(places)
    except ValueError as err:
        raise WrapError(
            f"the hybrid sharding groups (shard group, replica group) do not form a grid "
            f"over the {len(places)} ranks: {err}; each replica group must hold one rank "
            "of every shard group, all of the same shard rank"
        ) from err
    if list(places[0][0]).index(0) != 0:
        raise WrapError(
            "hybrid sharding with global rank 0 at another place than its shard group's "
            "first rank; flatview sends rank0_only results to global rank 0, which must "
            "be shard rank 0"
        )
    return HybridGroups(shard, int(root.rank), int(root.world_size), replica, replica.size())


def replica_of(hybrid: HybridGroups | None) -> tuple[dist.ProcessGroup | None, int] | None:
    """The replica group and its size for :class:`~flatview.comm.sharded.ShardedReduction`
    (``None``: not hybrid)."""
    return None if hybrid is None else (hybrid.replica, hybrid.replica_size)


def set_comm_hook(
    root: Any, units: list[tuple[str, Any]], hook: Callable[..., None], hybrid: object
) -> None:
    """Make ``hook`` every unit's communication hook: through ``register_comm_hook``,
    or under hybrid sharding (which that refuses) by setting what it would set."""
    if hybrid is None:
        root.register_comm_hook(None, hook)
        return
    for _, unit in units:
        unit._comm_hook = hook
