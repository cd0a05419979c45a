"""flatview on DDP (``torch.nn.parallel.DistributedDataParallel``): skip sets without
``find_unused_parameters``. Training equals the reference in the suites parametrized
over every backend (``DDP`` in :data:`tests.scenarios.BACKEND_CONFIGS`); here is what is
DDP's own: the originals stay the parameters, DDP's reducer stays idle, buffers are
still broadcast, and what flatview cannot drive is refused."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests import ddp_workers as w
from tests.scenarios import DDP

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
    "comm_hook": "communication hook",
    "mixed_precision": "mixed_precision",
    "sparse": "module 'emb' produces sparse gradients",
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_configurations_are_named(dist_pool: PoolFactory, case: str) -> None:
    for message in dist_pool(2).run(w.refused, DDP.scenario(), case, timeout=TIMEOUT):
        assert message.startswith("WrapError: ") and REFUSED[case] in message, message


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


def test_in_place_reduction_equals_packed(dist_pool: PoolFactory) -> None:
    scenario = DDP.scenario(world_size=2, inner=(5, 3, 4), norms=(True, False, True))
    for result in dist_pool(2).run(w.in_place_matches_packed, scenario, timeout=TIMEOUT):
        assert result == {"equal": True, "more_collectives": True}
