"""The buckets of a replicating wrapper's reduction (:mod:`flatview.backends.replicated`),
cut in the order the backward is expected to produce the gradients: reverse registration
order until the first overlapped backward has run, then the order that one produced them
in, rank 0's, learnt at the next synchronising forward as DDP rebuilds its buckets.
Buckets follow from the skip set alone (and that order), so every rank forms the same
ones whatever order its own backward runs in."""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Sequence

import torch.distributed as dist

from flatview.backends.base import Runtime
from flatview.comm.bucketing import BucketRound, plan_buckets
from flatview.comm.collectives import broadcast_object
from flatview.states import Transitions


def readiness_order(
    registration: Sequence[int], observed: Sequence[int]
) -> dict[int, tuple[int, int]]:
    """Sort keys, per parameter of ``registration`` (model order), for the order their
    gradients are expected in: ``observed``, the order one backward produced them in,
    first-hand; a parameter it lacks (skipped in that step, say) right after the one
    before it in reverse registration order, the order a backward usually goes in.
    Keys are (position in ``observed`` of that anchor, -1 for none; steps after it)."""
    seen = {index: position for position, index in enumerate(observed)}
    keys: dict[int, tuple[int, int]] = {}
    anchor, after = -1, 0
    for index in reversed(registration):
        if index in seen:
            anchor, after = seen[index], 0
        else:
            after += 1
        keys[index] = (anchor, after)
    return keys


class Order(enum.Enum):
    """Which order the buckets follow."""

    REVERSE_REGISTRATION = "not learnt yet"
    OBSERVING = "an overlapped backward records the order its gradients come in"
    LEARNT = "rank 0's recorded order, learnt by every rank"


_ORDER_MOVES = {
    Order.REVERSE_REGISTRATION: (Order.OBSERVING, Order.REVERSE_REGISTRATION),
    Order.OBSERVING: (Order.LEARNT, Order.REVERSE_REGISTRATION),
    Order.LEARNT: (Order.REVERSE_REGISTRATION,),
}


class BucketPlans:
    """The bucket plan of each set of parameters to reduce (cached: skip sets repeat),
    in the expected order (see the module docstring); ``bucket_bytes``: the wrapper's
    bucket size."""

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes
        self._plans: OrderedDict[tuple[int, ...], list[list[int]]] = OrderedDict()
        """Per first-bucket size and parameters to reduce: their buckets."""
        self._order = Transitions(Order.REVERSE_REGISTRATION, _ORDER_MOVES)
        self._keys: dict[int, tuple[int, int]] = {}
        """Sort keys of the learnt order (:func:`readiness_order`)."""
        self._observed: list[int] = []
        """Runtime indices in the order the observed backward made them ready."""

    @property
    def observing(self) -> bool:
        """Whether an overlapped backward's order is being (or was) recorded, to be learnt."""
        return self._order.state is Order.OBSERVING

    def observe_next_backward(self) -> None:
        """The overlapped backward starting now records its order, if none was learnt."""
        if self._order.state is Order.REVERSE_REGISTRATION:
            self._observed = []
            self._order.move(Order.OBSERVING)

    def ready(self, index: int) -> None:
        """Parameter ``index``'s gradient is ready (recorded while observing)."""
        if self._order.state is Order.OBSERVING:
            self._observed.append(index)

    def learn(self, registration: list[int], group: dist.ProcessGroup | None) -> None:
        """Bucket from now on in the order the observed backward produced the gradients:
        rank 0's order, so that every rank forms the same buckets. Called at the next
        synchronising forward, the same point on every rank (as DDP's rebuild), with one
        broadcast of Python objects: the one time a step waits for the GPU (DDP's rebuild
        does too)."""
        observed = broadcast_object(self._observed, group)
        self._keys = readiness_order(registration, observed)
        self._observed = []
        self._order.move(Order.LEARNT)
        self._plans.clear()

    def forget(self) -> None:
        """Back to reverse registration order (the adapter is uninstalled)."""
        self._order.move(Order.REVERSE_REGISTRATION)
        self._keys = {}
        self._observed = []

    def round(self, indices: list[int], first_cap: int, runtime: Runtime) -> BucketRound:
        """The buckets of ``indices`` (a first one of at most ``first_cap`` bytes), none
        started yet; parameters used only in earlier micro-batches (under ``no_sync()``)
        are ready from the start."""
        key = (first_cap, *indices)
        plan = self._plans.get(key)
        if plan is None:
            # The order the backward produces them in: learnt, or until then reverse
            # registration order (roughly that for most models).
            keys = self._keys
            order = sorted(indices, key=keys.__getitem__) if keys else indices[::-1]
            sizes = []
            for index in order:
                param = runtime.tensor(index)
                sizes.append((param.numel() * param.element_size(), (param.dtype, param.device)))
            plan = [
                [order[p] for p in bucket]
                for bucket in plan_buckets(sizes, first_cap, self.bucket_bytes)
            ]
            self._plans[key] = plan
            if len(self._plans) > 256:  # skip sets vary: recent ones only
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        round_ = BucketRound.of(plan)
        used_now = set(runtime.plain_used())
        for index in indices:
            if index not in used_now:
                round_.mark_ready(index)
        return round_
