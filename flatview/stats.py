"""Per-step communication figures, from the collectives flatview itself issued."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepStats:
    """What one backward pass (one micro-batch) communicated for gradients.

    Byte counts are the sizes of the tensors handed to the collective calls.
    """

    reduced_bytes: int
    """Input bytes of flatview's gradient-reduction collectives (under hybrid sharding
    those of both groups: :attr:`replica_bytes` included)."""
    reduce_calls: int
    dense_bytes: int
    """What the wrapper's own reduce-scatters would take as input with nothing skipped:
    every flat parameter's padded gradient (0 where the wrapper communicates nothing:
    fairscale on one rank). Under hybrid sharding, the padded gradient plus the shard
    that the replica group all-reduces."""
    used_bytes: int
    """Gradient bytes of the parameters that took part (what an exact exchange moves; 0
    where nothing needs exchanging)."""
    skipped_bytes: int
    """Gradient bytes of skipped parameters, which stayed local (but inside an FSDP2
    HSDP window of ``set_requires_all_reduce(False)``, where the units that run
    reduce-scatter zeros for them: :attr:`reduced_bytes` counts what moved)."""
    params_skipped: int
    units_skipped: int
    units: int
    agreement_bytes: int
    """Input bytes of the skip-set agreement check (0 when it is turned off)."""
    synced: bool
    """False for a backward under ``no_sync()`` (FSDP2: ``set_requires_gradient_sync(False)``,
    or ``set_requires_all_reduce(False)`` on HSDP): gradients were only accumulated."""
    replica_bytes: int = 0
    """Under hybrid sharding, the part of :attr:`reduced_bytes` moved across the replica
    group (the all-reduce of each rank's used shard elements); 0 otherwise."""
