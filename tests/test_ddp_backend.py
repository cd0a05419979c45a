"""flatview on DDP (``torch.nn.parallel.DistributedDataParallel``): skip sets without
``find_unused_parameters``. Training equals the reference in the suites parametrized
over every backend (``DDP`` in :data:`tests.scenarios.BACKEND_CONFIGS`); here is what is
DDP's own: the originals stay the parameters, DDP's reducer stays idle, buffers are
still broadcast, and what flatview cannot drive is refused."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flatview.backends.bucket_order import readiness_order
from flatview.backends.ddp_checks import cast_since_built
from flatview.comm.bucketing import plan_buckets
from tests import ddp_workers as w
from tests.scenarios import DDP, GATED, Scenario

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

TIMEOUT = 60.0


def test_originals_stay_and_only_flatview_communicates(dist_pool: PoolFactory) -> None:
    scenario = DDP.scenario(world_size=3)
    for result in dist_pool(3).run(w.originals_and_collectives, scenario, timeout=TIMEOUT):
        assert result["names"] and result["same_objects"], result
        # The skip-set check and one all-reduce: DDP's own reducer sent nothing.
        assert result["calls"] == {"all_gather": 1, "all_reduce": 1}, result
        assert result["none"] == [
            "body.1.down.weight",
            "body.1.gain",
            "body.1.up.bias",
            "body.1.up.weight",
        ]
        assert result["averaged"] and result["ddp_sync_flag"] is True, result


def test_buffers_are_broadcast_as_ddp_does(dist_pool: PoolFactory) -> None:
    # Rank r adds r + 1 per forward. Forward 1 starts from zeros, forward 2 from rank 0's
    # value (broadcast after a synced step), forward 3 from its own (after no_sync).
    results = dist_pool(2).run(w.buffers_broadcast, DDP.scenario(), timeout=TIMEOUT)
    assert results[0] == [1.0, 2.0, 3.0]
    assert results[1] == [2.0, 3.0, 5.0]


REFUSED = {
    "static_graph": "static_graph=True",
    "comm_hook": "communication hook flatview does not reproduce ('_own_hook')",
    "comm_hook_group": "fp16_compress_hook was registered with a process group other",
    "mixed_precision": "mixed_precision",
    "sparse": "module 'emb' produces sparse gradients",
    "join": "inside an enabled Join already",
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_configurations_are_named(dist_pool: PoolFactory, case: str) -> None:
    for message in dist_pool(2).run(w.refused, DDP.scenario(), case, timeout=TIMEOUT):
        assert message.startswith("WrapError: ") and REFUSED[case] in message, message


HOOKS = (
    "allreduce_hook",
    "builtin_allreduce",
    "fp16_compress_hook",
    "builtin_fp16",
    "bf16_compress_hook",
)
COMPRESSED = {"fp16_compress_hook": 2, "builtin_fp16": 2, "bf16_compress_hook": 2}
"""Hooks that all-reduce in 2-byte floats: half the bytes of float32."""


@pytest.mark.parametrize("hook", HOOKS)
def test_torch_comm_hooks_train_as_on_bare_ddp(dist_pool: PoolFactory, hook: str) -> None:
    """torch's averaging and compression hooks, registered on DDP before the wrap, are
    reproduced in flatview's reduction: bit for bit the training of bare DDP with the
    hook (2 ranks; blocks skipped, bare DDP searching for them), and the compressing
    ones move half the bytes of the same run without a hook. A C++ hook
    (``_register_builtin_comm_hook``) used to be bypassed in silence (the fp16 one:
    3e-5 off bare DDP after 3 steps); torch's ``bf16_compress_hook`` refuses gloo, so
    bare DDP runs the same arithmetic as a hook of the test's own."""
    scenario = DDP.scenario(GATED, world_size=2)
    pool = dist_pool(2)
    bare = pool.run(w.with_comm_hook, scenario, hook, False, timeout=TIMEOUT)[0]
    wrapped = pool.run(w.with_comm_hook, scenario, hook, True, timeout=TIMEOUT)
    plain = pool.run(w.with_comm_hook, scenario, "", True, timeout=TIMEOUT)[0]
    for name, value in bare["params"].items():
        np.testing.assert_array_equal(wrapped[0]["params"][name], value, err_msg=name)
    per_element = COMPRESSED.get(hook, 4)
    for result in wrapped:
        expected = [b * per_element // 4 for b in plain["reduced"]]
        assert result["reduced"] == expected, (result["reduced"], plain["reduced"])
    if hook in COMPRESSED:
        # A compressing hook changes the numbers: the test could tell one bypassed.
        moved = [np.abs(plain["params"][n] - v).max() for n, v in bare["params"].items()]
        assert max(moved) > 1e-6


def test_join_for_uneven_inputs_is_refused(dist_pool: PoolFactory) -> None:
    """DDP's ``join()`` shadows DDP's own all-reduces on ranks out of inputs, not
    flatview's: a loop over uneven inputs hung. Refused as an enabled join is built, on
    every rank, before any collective, naming what to do: a rank without any batch too
    (refused at the first forward, it waited in the join's exit); where only the first
    forward can tell, refused there; a disabled
    one (accelerate's ``join_uneven_inputs`` with even batches) trains; after
    ``unwrap()`` bare DDP joins again."""
    for out in dist_pool(2).run(w.uneven_inputs, DDP.scenario(), timeout=TIMEOUT):
        assert "ran" not in out
        for case in ("error", "no_batch", "at_forward"):
            assert out[case].startswith("StateError: DDP's join()"), (case, out[case])
            assert "drop_last=True" in out[case]
        assert out["disabled"] == "trained"
        assert out["bare"] == "finished"


def test_parameters_replaced_after_wrap_are_named(dist_pool: PoolFactory) -> None:
    """Parameters replaced on their modules after the wrap (``load_state_dict(assign=
    True)``) get gradients flatview never sees, as DDP never sees them: the error said
    to declare them skipped; it now names the replacement, on every rank."""
    for message in dist_pool(2).run(w.assigned_anew, DDP.scenario(), timeout=TIMEOUT):
        assert message.startswith("StateError: parameter(s) 'stem.weight'"), message
        assert "replaced" in message and "assign" in message, message


def test_second_backward_through_one_forward_is_refused(dist_pool: PoolFactory) -> None:
    dist_pool(2).run_expecting_error(
        w.second_backward,
        DDP.scenario(),
        match=r"StateError: a second backward through a forward",
        timeout=TIMEOUT,
    )


def test_forward_that_raises_keeps_ddp_in_sync(dist_pool: PoolFactory) -> None:
    for result in dist_pool(2).run(w.forward_that_raises, DDP.scenario(), timeout=TIMEOUT):
        assert result == {"flag": True, "averaged": True}


def test_overlapped_buckets_equal_end_of_backward(dist_pool: PoolFactory) -> None:
    # About 100 elements per bucket: several buckets start while the backward runs.
    scenario = DDP.scenario(
        world_size=3,
        inner=(5, 3, 4),
        norms=(True, False, True),
        skips=((1,), (), (0, 2), (2,)),
        options={"bucket_cap_mb": 0.0004},
    )
    for result in dist_pool(3).run(w.overlapped_and_end_of_backward, scenario, timeout=TIMEOUT):
        assert result["equal"], result
        assert len(result["started_early"]) == 4 and sum(result["started_early"]) > 0, result


def test_buckets_follow_the_order_the_first_backward_produced(dist_pool: PoolFactory) -> None:
    """A model whose backward runs opposite to its registration order: in the first
    backward no bucket can start before (nearly) every gradient is ready (the first
    bucket's, the first layer's bias, comes next to last); from the second on, buckets
    follow the order the first one produced, and each starts as soon as its gradient is
    ready, as DDP's do after its rebuild."""
    for result in dist_pool(2).run(w.learned_bucket_order, DDP.scenario(), timeout=TIMEOUT):
        first, *later = result["ready_at_start"]
        assert min(first) >= 7 and len(first) == 7, result
        assert later == [list(range(1, 8))] * 2 and result["averaged"], result


@given(
    registration=st.lists(st.integers(0, 40), unique=True, max_size=12),
    data=st.data(),
)
def test_readiness_order(registration: list[int], data: st.DataObject) -> None:
    """Observed parameters in the observed order; each one not observed right after the
    one before it in reverse registration order; a total order over all."""
    observed = data.draw(st.permutations(registration)).copy()
    observed = observed[: data.draw(st.integers(0, len(observed)))]
    keys = readiness_order(registration, observed)
    assert sorted(keys) == sorted(registration)
    order = sorted(registration, key=keys.__getitem__)
    assert len(set(keys.values())) == len(keys)
    assert [i for i in order if i in observed] == observed
    backward = registration[::-1]
    for position, index in enumerate(backward):
        if index not in observed and position > 0:
            before = backward[position - 1]
            assert order.index(index) == order.index(before) + 1, (order, index)


def test_gradient_that_grows_after_its_bucket_started(dist_pool: PoolFactory) -> None:
    """Reentrant checkpointing accumulates a gradient again after its bucket started:
    flatview discards what is in flight and reduces everything again."""
    results = dist_pool(2).run(
        w.gradient_grows_after_its_bucket_started, DDP.scenario(), timeout=TIMEOUT
    )
    for result in results:
        assert result == {"refired": [True], "equal": True}, result


def test_parameter_no_backward_reached_across_micro_batches(dist_pool: PoolFactory) -> None:
    scenario = DDP.scenario(inner=(5, 3, 4), norms=(True, False, True))
    dist_pool(2).run_expecting_error(
        w.undeclared_in_an_earlier_micro_batch,
        scenario,
        match=r"UndeclaredUnusedError: parameter\(s\) 'body\.0\.",
        timeout=TIMEOUT,
    )


@given(
    sizes=st.lists(st.tuples(st.integers(0, 50), st.sampled_from("ab")), max_size=30),
    first_cap=st.integers(1, 60),
    cap=st.integers(1, 120),
)
def test_buckets_partition_in_order_and_fill_greedily(
    sizes: list[tuple[int, str]], first_cap: int, cap: int
) -> None:
    buckets = plan_buckets(sizes, first_cap, cap)
    assert [p for bucket in buckets for p in bucket] == list(range(len(sizes)))
    for number, bucket in enumerate(buckets):
        limit = first_cap if number == 0 else cap
        assert bucket and len({sizes[p][1] for p in bucket}) == 1, "one dtype and device"
        filled = sum(sizes[p][0] for p in bucket)
        assert filled <= limit or len(bucket) == 1, (number, bucket)
        if number + 1 < len(buckets):
            following = buckets[number + 1][0]
            # A new bucket opens only when the next parameter does not fit or differs.
            assert (
                sizes[following][1] != sizes[bucket[0]][1] or filled + sizes[following][0] > limit
            )


def test_checkpointed_whole_model(dist_pool: PoolFactory) -> None:
    scenario = DDP.scenario(inner=(5, 3, 4), norms=(True, False, True))
    for result in dist_pool(2).run(w.checkpointed_whole_model, scenario, timeout=TIMEOUT):
        assert result == {"overlap=False": True, "overlap=True": True}, result


def test_find_unused_keeps_a_skipped_parameter_behind_an_unused_output(
    dist_pool: PoolFactory,
) -> None:
    # The Hugging Face Trainer's DDP default for transformers models: a BART whose decoder
    # drops every layer leaves its encoder reached only through an unused output.
    pool = dist_pool(2)
    for result in pool.run(w.skipped_behind_an_unused_output, ["unused"]):
        assert result == {"none": ["unused.bias", "unused.weight"]}, result
    for result in pool.run(w.skipped_behind_an_unused_output, []):
        assert result == {"error": "UndeclaredUnusedError"}, result


@pytest.mark.parametrize("overlap", [False, True])
def test_parameters_frozen_before_the_wrap(dist_pool: PoolFactory, overlap: bool) -> None:
    # Was: RuntimeError "cannot register a hook on a tensor that doesn't require
    # gradient" from flatview.wrap (a PEFT model under the Hugging Face Trainer's DDP).
    for result in dist_pool(2).run(w.frozen_before_the_wrap, Scenario(), overlap):
        frozen = ["body.0.gain", "body.0.norm.bias", "body.0.norm.weight"]
        frozen += ["body.0.up.bias", "body.0.up.weight", "body.0.down.weight"]
        assert result["none"] == [sorted(frozen)] * 2 + [[]] * 2, result["none"]
        assert result["worst"] <= 1e-6, result["worst"]
        assert result["hooked"]


class _FakeDDP:
    """What :func:`cast_since_built` reads of DDP: its logging data and its module."""

    def __init__(self, built: str, module: torch.nn.Module) -> None:
        self.module = module
        self._built = built

    def _get_ddp_logging_data(self) -> dict[str, str]:
        return {"dtypes": self._built}


def test_cast_since_built_reads_ddps_record() -> None:
    """The warning at ``unwrap()`` of a model cast after DDP was built compares DDP's own
    record of the dtypes it was built for (its logging data's names) with the
    parameters' now: silent when they agree, in any order; ``None`` for a dtype it cannot
    name (it could not tell)."""
    mixed = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).double())
    assert cast_since_built(_FakeDDP("float", torch.nn.Linear(2, 2))) is None
    assert cast_since_built(_FakeDDP("double, float", mixed)) is None
    bf16 = torch.nn.Linear(2, 2).bfloat16()
    assert cast_since_built(_FakeDDP("c10::BFloat16", bf16)) is None
    said = cast_since_built(_FakeDDP("float", bf16))
    assert said == "DDP was built for float, the parameters are c10::BFloat16 now"
    assert (
        cast_since_built(_FakeDDP("float", torch.nn.Linear(2, 2).to(torch.float8_e4m3fn))) is None
    )
