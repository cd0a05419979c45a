"""Every wrapper internal an adapter touches is checked at wrap time: taking one away
(as a wrapper version that renamed it would) makes ``flatview.wrap`` raise a WrapError
naming it and the versions checked against, before anything is patched; the model
wraps as before once it is back."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import pytest

from tests import privates_workers as w
from tests.scenarios import torch_backend_tested

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

TIMEOUT = 120.0


def _check(result: dict[str, Any], versions: str) -> None:
    message = result["message"]
    assert re.search(rf"\b{re.escape(result['name'])}\b", message), message
    assert re.search(rf"checked against {versions}", message), message
    assert not result["patched"], result
    assert result["wraps"], result


@pytest.mark.skipif(not torch_backend_tested(), reason="torch FSDP1 backend untested here")
def test_torch_fsdp_internals_checked_at_wrap(dist_pool: PoolFactory) -> None:
    (out,) = dist_pool(1).run(w.torch_fsdp_task, timeout=TIMEOUT)
    assert set(out) == {"_post_backward_hook", "_reshard", "prefetch", "handle"}
    for result in out.values():
        _check(result, r"torch 2\.13\.x; found torch ")


def test_fairscale_internals_checked_at_wrap(dist_pool: PoolFactory) -> None:
    pytest.importorskip("fairscale")
    (out,) = dist_pool(1).run(w.fairscale_task, timeout=TIMEOUT)
    assert len(out) == 4
    for result in out.values():
        _check(result, r"fairscale 0\.4\.x; found fairscale ")


def test_ddp_internals_checked_at_wrap(dist_pool: PoolFactory) -> None:
    (out,) = dist_pool(1).run(w.ddp_task, timeout=TIMEOUT)
    assert len(out) == 3
    for result in out.values():
        _check(result, r"torch 2\.13\.x; found torch ")
    (autograd,) = dist_pool(1).run(w.autograd_task, timeout=TIMEOUT)
    _check(autograd, r"torch 2\.13\.x; found torch ")
