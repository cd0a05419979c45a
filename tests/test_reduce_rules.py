"""Rules of the masked reductions: when a gradient is reduced whole and in place instead
of packed, what that does to the elements a plan does not use, and the one-pass packing
and placing (with the division fused) into the reductions' reusable buffers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from flatview.comm.ledger import Ledger
from flatview.comm.options import (
    IN_PLACE_MIN_NUMEL,
    IN_PLACE_TOLERANCE,
    ReduceOptions,
    Strategy,
)
from flatview.comm.packing import PlanIndex
from flatview.comm.reduction import Reduction
from flatview.comm.replicated import ReplicatedReduction
from flatview.comm.sharded import ShardedReduction
from flatview.layout import FlatLayout, MaskPlan
from tests.conftest import PoolFactory

TIMEOUT = 60.0
CPU = torch.device("cpu")


def _reducer(world_size: int = 1, rank: int = 0, **options: object) -> Reduction:
    """The reduction for plans of ``world_size`` ranks: replicated at 1, else sharded."""
    kind = ReplicatedReduction if world_size == 1 else ShardedReduction
    return kind(None, rank, world_size, Ledger(), ReduceOptions(**options), 2**62)  # type: ignore[arg-type]


def _replicated(**options: object) -> ReplicatedReduction:
    world = dist.get_world_size()
    opts = ReduceOptions(**options)  # type: ignore[arg-type]
    return ReplicatedReduction(None, dist.get_rank(), world, Ledger(), opts, 2**62)


def _sharded(**options: object) -> ShardedReduction:
    world = dist.get_world_size()
    opts = ReduceOptions(**options)  # type: ignore[arg-type]
    return ShardedReduction(None, dist.get_rank(), world, Ledger(), opts, 2**62)


def _plan(numels: list[int], used: list[bool], world_size: int = 1) -> MaskPlan:
    return MaskPlan.build(FlatLayout.packed([(n,) for n in numels], world_size), used)


# ----------------------------------------------------------------------- the in-place rule


def test_defaults() -> None:
    options = _reducer().options
    assert options.in_place_tolerance == IN_PLACE_TOLERANCE == 0.05
    assert options.in_place_min_numel == IN_PLACE_MIN_NUMEL


def test_fully_used_replicated_gradient_is_reduced_in_place() -> None:
    reducer = _reducer()
    plan = _plan([IN_PLACE_MIN_NUMEL, 10], [True, True])
    assert reducer.reduces_in_place(torch.zeros(IN_PLACE_MIN_NUMEL + 10), plan)


def test_small_gradients_go_to_the_bucket() -> None:
    plan = _plan([100, 10], [True, True])
    assert not _reducer().reduces_in_place(torch.zeros(110), plan)
    assert _reducer(in_place_min_numel=0).reduces_in_place(torch.zeros(110), plan)


@pytest.mark.parametrize(
    ("skipped", "expected"),
    [(0, True), (400, True), (476, True), (477, False), (5000, False)],
)
def test_skipped_share_within_the_byte_tolerance(skipped: int, expected: bool) -> None:
    # Whole, the gradient moves numel elements against `used`: at most 5% more.
    reducer = _reducer(in_place_min_numel=0)
    used = 9524
    plan = _plan([used, skipped], [True, False]) if skipped else _plan([used], [True])
    assert reducer.reduces_in_place(torch.zeros(used + skipped), plan) is expected


def test_tolerance_none_turns_the_rule_off() -> None:
    reducer = _reducer(in_place_tolerance=None)
    plan = _plan([IN_PLACE_MIN_NUMEL], [True])
    assert not reducer.reduces_in_place(torch.zeros(IN_PLACE_MIN_NUMEL), plan)


def test_nothing_used_or_wrong_shape_or_non_contiguous_is_packed() -> None:
    reducer = _reducer(in_place_min_numel=0)
    assert not reducer.reduces_in_place(torch.zeros(8), _plan([8], [False]))
    assert not reducer.reduces_in_place(torch.zeros(9), _plan([8], [True]))
    strided = torch.zeros(16)[::2]
    assert not reducer.reduces_in_place(strided, _plan([8], [True]))


def test_sharded_rule_counts_padding_and_honours_a_named_all_to_all() -> None:
    plan = _plan([IN_PLACE_MIN_NUMEL + 1], [True], world_size=2)
    padded = torch.zeros(plan.layout.padded_numel)
    assert _reducer(2).reduces_in_place(padded, plan)
    assert _reducer(2, strategy=Strategy.REDUCE_SCATTER).reduces_in_place(padded, plan)
    assert not _reducer(2, strategy=Strategy.ALL_TO_ALL).reduces_in_place(padded, plan)
    half = _plan([IN_PLACE_MIN_NUMEL, IN_PLACE_MIN_NUMEL], [True, False], world_size=2)
    assert not _reducer(2).reduces_in_place(torch.zeros(half.layout.padded_numel), half)


# ------------------------------------------------------------- plan index: pack, place, unused


@given(
    numels=st.lists(st.integers(0, 40), min_size=1, max_size=12),
    data=st.data(),
    world_size=st.integers(1, 3),
)
def test_unused_runs_tile_the_row_with_the_used_ones(
    numels: list[int], data: st.DataObject, world_size: int
) -> None:
    used = data.draw(st.lists(st.booleans(), min_size=len(numels), max_size=len(numels)))
    plan = _plan(numels, used, world_size)
    index = PlanIndex(plan, CPU)
    for rank in range(world_size):
        runs = sorted(plan.per_rank[rank] + index.unused(rank))
        cursor = 0
        for start, end in runs:
            assert start == cursor and end > start
            cursor = end
        assert cursor == plan.layout.shard_numel


@pytest.mark.parametrize("many_short_runs", [False, True], ids=["runs", "index"])
@pytest.mark.parametrize("divisor", [1.0, 2.0, 3.0])
def test_pack_and_place_divide_like_div_(many_short_runs: bool, divisor: float) -> None:
    numels = [3, 5] * 40 if many_short_runs else [300, 500, 200]
    used = [True, False] * 40 if many_short_runs else [True, False, True]
    plan = _plan(numels, used)
    index = PlanIndex(plan, CPU)
    assert (index.runs[0] is None) is many_short_runs
    row = torch.randn(plan.layout.shard_numel)
    packed = torch.empty(plan.counts[0])
    index.pack(row, packed, 0, divisor)
    assert torch.equal(packed, index.pick(row, 0).clone().div_(divisor))
    target = torch.full_like(row, 7.0)
    index.place(target, packed, 0, divisor)
    expected = torch.full_like(row, 7.0)
    index.place(expected, packed.clone().div_(divisor), 0)
    assert torch.equal(target, expected)
    for start, end in index.unused(0):
        assert torch.all(target[start:end] == 7.0)


def test_place_casts_like_a_copy() -> None:
    plan = _plan([4, 4], [True, False])
    index = PlanIndex(plan, CPU)
    target = torch.zeros(8, dtype=torch.float64)
    values = torch.tensor([1.0, 2.0, 3.0, 5.0], dtype=torch.float16)
    index.place(target, values, 0, 3.0)
    assert torch.equal(target[:4], (values / 3.0).double())


# -------------------------------------------------------------- distributed: the reductions


def _replicated_buckets() -> dict[str, object]:
    """Two flushes of replicated gradients of two dtypes; the buffer has to grow halfway
    through the first bucket, and is reused by the second."""
    rank = dist.get_rank()
    reducer = _replicated()
    got: dict[str, torch.Tensor] = {}

    def keep(name: str) -> object:
        return lambda values: got.__setitem__(name, values.clone())

    small = _plan([4, 4], [True, False])
    large = _plan([100, 3, 50], [True, False, True])
    grads = {
        "small": torch.arange(8.0) + 10 * rank,
        "large": torch.arange(153.0) * (rank + 1),
        "double": torch.arange(8.0, dtype=torch.float64) - rank,
    }
    reducer.add(grads["small"], small, keep("small"), predivide=2.0)
    reducer.add(grads["large"], large, keep("large"), predivide=2.0)
    reducer.add(grads["double"], small, keep("double"))
    buffers_after_first = {k: v.numel() for k, v in reducer._buffers.items()}
    reducer.finish()
    first = dict(got)
    got.clear()
    reducer.add(grads["small"], small, keep("again"), predivide=2.0)
    reducer.finish()
    return {
        "first": first,
        "again": got["again"],
        "calls": dict(reducer.ledger.calls),
        "bytes": dict(reducer.ledger.bytes),
        "buffers": buffers_after_first,
        "grads_untouched": all(
            torch.equal(grads[k], v)
            for k, v in {
                "small": torch.arange(8.0) + 10 * rank,
                "large": torch.arange(153.0) * (rank + 1),
            }.items()
        ),
    }


def test_replicated_buckets_pack_into_reused_buffers(dist_pool: PoolFactory) -> None:
    results = dist_pool(2).run(_replicated_buckets, timeout=TIMEOUT)
    small_sum = ((torch.arange(8.0) / 2) + (torch.arange(8.0) + 10) / 2)[:4]
    large = torch.arange(153.0)
    large_used = torch.cat([large[:100], large[103:]])
    for r in results:
        first = r["first"]
        assert torch.equal(first["small"], small_sum)
        assert torch.equal(first["large"], large_used / 2 + large_used * 2 / 2)
        assert first["double"].dtype == torch.float64
        assert torch.equal(first["double"], (torch.arange(8.0, dtype=torch.float64) * 2 - 1)[:4])
        assert torch.equal(r["again"], small_sum)
        # One all-reduce per dtype per flush, of the used elements only.
        assert r["calls"] == {"all_reduce": 3}
        assert r["bytes"] == {"all_reduce": (4 + 150) * 4 + 4 * 8 + 4 * 4}
        assert r["buffers"][(torch.float32, CPU)] >= 154
        assert r["grads_untouched"]


def _in_place_all_reduce() -> dict[str, object]:
    rank = dist.get_rank()
    reducer = _replicated()
    plan = _plan([6, 2, 4], [True, False, True])
    # Skipped region non-zero and different per rank: it must come back as it was.
    grad = torch.arange(12.0) + 100 * rank
    before = grad.clone()
    reducer.all_reduce_in_place(grad, plan, predivide=2.0, postdivide=1.5)
    in_flight = reducer.in_flight(grad)
    reducer.finish()
    return {
        "grad": grad,
        "before": before,
        "in_flight": in_flight,
        "after": reducer.in_flight(grad),
        "bytes": dict(reducer.ledger.bytes),
    }


def test_in_place_all_reduce_restores_what_the_plan_does_not_use(
    dist_pool: PoolFactory,
) -> None:
    results = dist_pool(2).run(_in_place_all_reduce, timeout=TIMEOUT)
    reduced = (torch.arange(12.0).div(2.0) + (torch.arange(12.0) + 100).div(2.0)).div(1.5)
    for r in results:
        grad, before = r["grad"], r["before"]
        assert torch.equal(grad[:6], reduced[:6])
        assert torch.equal(grad[8:], reduced[8:])
        assert torch.equal(grad[6:8], before[6:8])
        assert r["in_flight"] and not r["after"]
        assert r["bytes"] == {"all_reduce": 12 * 4}


def _in_place_reduce_scatter() -> dict[str, object]:
    rank = dist.get_rank()
    reducer = _sharded()
    # 11 elements over 2 ranks: shards of 6, one padding element at the end.
    plan = _plan([5, 1, 5], [True, False, True], world_size=2)
    whole = torch.arange(12.0) + rank
    whole[11] = 99.0  # padding: must not reach the shard
    output = torch.full((6,), -1.0)
    reducer.reduce_scatter_in_place(whole, output, plan, postdivide=2.0)
    reducer.finish()
    return {"output": output, "bytes": dict(reducer.ledger.bytes)}


def test_in_place_reduce_scatter_zeroes_what_the_plan_does_not_use(
    dist_pool: PoolFactory,
) -> None:
    results = dist_pool(2).run(_in_place_reduce_scatter, timeout=TIMEOUT)
    total = (torch.arange(12.0) * 2 + 1).div(2.0)
    total[5] = 0.0  # the skipped segment
    total[11] = 0.0  # padding
    for rank, r in enumerate(results):
        assert torch.equal(r["output"], total[6 * rank : 6 * rank + 6])
        assert r["bytes"] == {"reduce_scatter": 12 * 4}


def _kept_buffers(keep_bytes: int) -> dict[str, object]:
    rank = dist.get_rank()
    options = {"strategy": Strategy.REDUCE_SCATTER, "keep_buffer_bytes": keep_bytes}
    replicated, sharded = _replicated(**options), _sharded(**options)
    got: list[torch.Tensor] = []
    plan = _plan([64, 64], [True, True])
    half = _plan([30, 34], [True, False], world_size=2)
    kept = []
    for step in range(2):
        replicated.add(torch.ones(128) * (rank + step), plan, lambda v: got.append(v.clone()))
        # Two sharded entries: packed into the reduce-scatter's send buffer.
        for _ in range(2):
            grad = torch.arange(64.0) + rank
            sharded.add(list(grad.view(2, -1).unbind(0)), half, lambda v: got.append(v.clone()))
        replicated.finish()
        sharded.finish()
        buffers = [*replicated._buffers, *sharded._buffers]
        kept.append(sorted(str(k[0]) for k in buffers))
    return {"got": got, "kept": kept}


@pytest.mark.parametrize("keep_bytes", [0, 2**25])
def test_bucket_buffers_kept_up_to_a_size(dist_pool: PoolFactory, keep_bytes: int) -> None:
    results = dist_pool(2).run(_kept_buffers, keep_bytes, timeout=TIMEOUT)
    shard = [(torch.arange(64.0) * 2 + 1)[:30], torch.zeros(32)]
    for rank, r in enumerate(results):
        assert r["kept"] == ([[], []] if keep_bytes == 0 else [["send", "torch.float32"]] * 2)
        for step in range(2):
            replicated, first, second = r["got"][3 * step : 3 * step + 3]
            assert torch.equal(replicated, torch.full((128,), 1.0 + 2 * step))
            mine = torch.cat([shard[0], torch.zeros(2)]) if rank == 0 else shard[1]
            assert torch.equal(first, mine) and torch.equal(second, mine)


# ------------------------------------------- a unit reduced twice in one backward (torch)


class _Checkpointed(torch.nn.Module):
    """One FSDP unit whose first layer runs under reentrant activation checkpointing: its
    gradient reaches the flat parameter in a nested backward, the second layer's in the
    outer one, so torch reduces the unit twice in one backward."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        hidden = checkpoint(self.a, x, use_reentrant=True)
        return self.b(torch.relu(hidden))


def _reduced_twice(strategy: str, unpacked: bool | None) -> dict[str, object]:
    """``unpacked`` None: computed on views (NO_SHARD), buckets overlapped."""
    import warnings

    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    import flatview

    warnings.filterwarnings("ignore")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net, ref = _Checkpointed(), _Checkpointed()
    ref.load_state_dict(net.state_dict())
    model = FullyShardedDataParallel(
        net, sharding_strategy=ShardingStrategy[strategy], device_id=CPU
    )
    if unpacked is None:
        fv = flatview.wrap(model, compute_on_views=True, overlap_reduction=True)
    else:
        # torch's runtime reduces (a NO_SHARD model would otherwise compute on views).
        options = (
            flatview.ReduceOptions(in_place_min_numel=0)
            if unpacked
            else flatview.ReduceOptions(in_place_tolerance=None)
        )
        fv = flatview.wrap(model, compute_on_views=False, reduce_options=options)
    inputs = [
        torch.randn(8, 64, generator=torch.Generator().manual_seed(r + 1)) for r in range(world)
    ]
    try:
        with fv.step():
            model(inputs[rank].clone().requires_grad_()).sum().backward()
        for x in inputs:
            ref(x.clone().requires_grad_()).sum().backward()
        expected = dict(ref.named_parameters())
        errors = {}
        for name, view in fv.named_parameters():
            if view.numel():
                want = expected[name].grad.reshape(-1) / world
                got = view.grad.reshape(-1)
                # A partial view holds this rank's piece of the parameter.
                start = _piece_start(fv, name)
                errors[name] = (got - want[start : start + got.numel()]).abs().max().item()
        return {"errors": errors, "calls": dict(fv.ledger.calls)}
    finally:
        fv.unwrap()


def _piece_start(fv: object, name: str) -> int:
    table = fv.table  # type: ignore[attr-defined]
    for param in table.params:
        if param.name == name and param.flat is not None:
            flat = table.flats[param.flat]
            return int(flat.views.pieces[param.segment].param_offset)
    return 0


@pytest.mark.parametrize("strategy", ["NO_SHARD", "FULL_SHARD"])
@pytest.mark.parametrize("unpacked", [False, True], ids=["packed", "unpacked"])
def test_a_unit_reduced_twice_in_one_backward(
    dist_pool: PoolFactory, strategy: str, unpacked: bool
) -> None:
    """The second reduction must wait for an unpacked first one still in flight: torch
    accumulates into the tensor that one writes (NO_SHARD: the flat gradient, through
    autograd; sharded: the shard, right after the hook)."""
    results = dist_pool(2).run(_reduced_twice, strategy, unpacked, timeout=TIMEOUT)
    for r in results:
        assert max(r["errors"].values()) < 1e-5, r
        reductions = r["calls"].get("all_reduce", 0) + r["calls"].get("reduce_scatter", 0)
        # Packed, NO_SHARD's two share a bucket; a sharded gradient used whole is
        # reduce-scattered on its own, as torch does (ShardedReduction bucket_all_used).
        alone = unpacked or strategy == "FULL_SHARD"
        assert reductions == (2 if alone else 1), r


def test_computed_on_views_reduced_again_after_a_nested_backward(dist_pool: PoolFactory) -> None:
    """NO_SHARD computed on views, overlapped: the checkpointed layer's gradient arrives
    in a nested backward, after the outer layer's bucket may have started; the result
    is still the average of the local gradients."""
    for r in dist_pool(2).run(_reduced_twice, "NO_SHARD", None, timeout=TIMEOUT):
        assert max(r["errors"].values()) < 1e-5, r
        assert r["calls"].get("all_reduce", 0) >= 1, r


# ------------------------------------------------------------------ options at wrap time


def test_wrap_keywords_fill_in_reduce_options_and_contradictions_are_refused() -> None:
    import flatview
    from flatview.errors import WrapError

    model = torch.nn.Linear(2, 2)
    with pytest.raises(WrapError, match="reduce_strategy='all_to_all' contradicts"):
        flatview.wrap(
            model,
            reduce_strategy="all_to_all",
            reduce_options=ReduceOptions(strategy=Strategy.REDUCE_SCATTER),
        )
    with pytest.raises(WrapError, match="overlap_reduction=True contradicts"):
        flatview.wrap(model, overlap_reduction=True, reduce_options=ReduceOptions(overlap=False))
    with pytest.raises(ValueError, match="'bogus' is not a valid Strategy"):
        ReduceOptions(strategy="bogus")  # type: ignore[arg-type]
    assert ReduceOptions(strategy="all_to_all").strategy is Strategy.ALL_TO_ALL  # type: ignore[arg-type]


def test_bucket_whole_is_a_deprecated_alias_of_bucket_all_used() -> None:
    """``ReduceOptions.bucket_whole``, renamed ``bucket_all_used`` ("whole" names whole
    parameters only), still works, with a DeprecationWarning, read and written."""
    for value in (True, False):
        with pytest.warns(DeprecationWarning, match="bucket_all_used"):
            options = ReduceOptions(bucket_whole=value)
        assert options == ReduceOptions(bucket_all_used=value)
        with pytest.warns(DeprecationWarning, match="bucket_all_used"):
            assert options.bucket_whole is value
    contradicts = pytest.raises(ValueError, match="contradicts bucket_all_used=True")
    with contradicts, pytest.warns(DeprecationWarning):
        ReduceOptions(bucket_all_used=True, bucket_whole=False)
