"""Reduce-scatters held back and run as one: for a wrapper that reduce-scatters each unit
on its own (FSDP2), where on CPU a step's time goes more by the number of collectives
than by their bytes.

A held reduce-scatter is the wrapper's own: its input is the wrapper's entire padded
layout (``world_size`` equal chunks, chunk ``r`` for rank ``r``), its output the
wrapper's buffer that this rank's sharded gradients are (views of) or are added from.
:meth:`HeldReduceScatters.run` lays the held inputs side by side within each rank's
chunk, so that one reduce-scatter hands every rank its chunks of all of them, and copies
each result into its output. Each element meets the same ranks' values under the same
op as in its own collective; only where it sits in the buffer differs, which on 2 ranks
(one addition) cannot change a bit.

Nothing may read a held output before :meth:`HeldReduceScatters.run`: the wrapper's
code after its collective only makes views of it, or adds it to a gradient that already
exists (``accumulate``: those additions are redone at the run). To make the early
addition a no-op, a held output reads ``-0.0`` until then: ``x + (-0.0)`` is ``x`` for
every ``x``, ``-0.0`` and ``+0.0`` included (``+0.0`` would turn a ``-0.0`` into ``+0.0``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from flatview.comm._compat import reduce_scatter_single
from flatview.comm.bucketing import BucketFill
from flatview.comm.ledger import Ledger

HELD_CAP_NUMEL = 2**23
"""Elements (32 MiB in float32) held at most before the held reduce-scatters run, which
bounds the memory holding costs: bare FSDP2 frees a reduce-scatter's input once it ran,
a held one lives until the run (and is copied once into the combined input). Not tuned:
the benchmarks' held inputs stay far below it."""


@dataclass(frozen=True)
class Accumulate:
    """A gradient the wrapper adds a piece of a held output to: ``target += output[start :
    start + target.numel()]`` (viewed as the target)."""

    target: torch.Tensor
    start: int


@dataclass(frozen=True)
class Held:
    output: torch.Tensor
    input: torch.Tensor
    accumulate: tuple[Accumulate, ...]
    fresh: tuple[torch.Tensor, ...]
    """Parameters whose gradient the wrapper makes a view of ``output`` (to be cleared if
    the held reduce-scatter is dropped: a gradient never reduced must not exist)."""


class HeldReduceScatters:
    """The reduce-scatters held since the last run, over one process group with one op
    and dtype (a call of another key runs what is held first); full once their inputs
    reach ``cap`` elements."""

    def __init__(self, ledger: Ledger, cap: int = HELD_CAP_NUMEL) -> None:
        self.ledger = ledger
        self._fill = BucketFill(cap)
        self._held: list[Held] = []
        self._key: tuple[Any, ...] | None = None
        self._group: dist.ProcessGroup | None = None
        self._op: Any = None

    def __len__(self) -> int:
        return len(self._held)

    def hold(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        accumulate: Sequence[Accumulate] = (),
        fresh: Sequence[torch.Tensor] = (),
    ) -> None:
        """Hold one reduce-scatter of ``input`` into ``output`` (running what is held
        first if its key differs, and everything once the cap is reached)."""
        key = (id(group), op, input.dtype, input.device)
        if self._held and key != self._key:
            self.run()
        self._key, self._group, self._op = key, group, op
        if self._fill.add(input.numel()):
            # Run now, this one included: its output is final before the wrapper reads
            # it, and the wrapper adds it to its gradients itself.
            self._held.append(Held(output, input, (), ()))
            self.run()
            return
        output.fill_(-0.0)
        self._held.append(Held(output, input, tuple(accumulate), tuple(fresh)))

    def run(self) -> None:
        """Run every held reduce-scatter as one collective and hand out the results."""
        held, self._held = self._held, []
        self._fill.empty()
        if not held:
            return
        group = self._group
        if len(held) == 1:
            source, result = held[0].input, held[0].output
        else:
            world = dist.get_world_size(group)
            source = torch.cat([h.input.view(world, -1) for h in held], dim=1).view(-1)
            result = source.new_empty(source.numel() // world)
        self.ledger.record("reduce_scatter", source)
        reduce_scatter_single(result, source, group=group, op=self._op)
        start = 0
        for h in held:
            piece = result if len(held) == 1 else result[start : start + h.output.numel()]
            if piece is not h.output:
                h.output.copy_(piece)
            for acc in h.accumulate:
                numel = acc.target.numel()
                acc.target.add_(piece[acc.start : acc.start + numel].view_as(acc.target))
            start += h.output.numel()

    def drop(self) -> list[Held]:
        """Forget what is held (an aborted backward), returning it: the wrapper is to clear
        the gradients it made views of held outputs (``fresh``), which were never reduced;
        the ones they were to be added to keep what they had."""
        held, self._held = self._held, []
        self._fill.empty()
        return held
