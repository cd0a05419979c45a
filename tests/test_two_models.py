"""Two models, each wrapped by its own FSDP (or DDP) and flatview, trained in one
backward (an encoder and a decoder as separate roots) or alternately as a GAN trains
(the second model on the first one's detached output, then the first through the
second, whose gradients are thrown away), each with its own skip sets: the same
parameters as both models unwrapped in one process."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch

from tests.scenarios import (
    BACKENDS,
    BackendConfig,
    Scenario,
    backend_context,
    batch,
    full_state,
    local_batch,
    loss_of,
    make_net,
    wrap_fsdp,
)

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

TIMEOUT = 120.0
SKIPS = [((), (1,)), ((0,), ()), ((1,), (0,)), ((), ())]
"""Per iteration, the blocks the first and the second model skip."""
FIRST = Scenario(in_dim=3, width=5, inner=(6, 4), norms=(True, False), classes=4, seed=1)
SECOND = Scenario(in_dim=4, width=3, inner=(5, 2), norms=(False, True), classes=3, seed=2)

Step = Callable[[list[str]], contextlib.AbstractContextManager[Any]]


def _train(
    nets: tuple[Any, Any],
    opts: tuple[torch.optim.Optimizer, torch.optim.Optimizer],
    steps: tuple[Step, Step],
    data: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    pattern: str,
) -> None:
    (a, b), (opt_a, opt_b), (step_a, step_b) = nets, opts, steps

    @contextlib.contextmanager
    def both(skip_a: list[str], skip_b: list[str]) -> Iterator[None]:
        with step_a(skip_a), step_b(skip_b):
            yield

    for number, (skipped_a, skipped_b) in enumerate(SKIPS):
        x, y = data(number)
        skip_a = [f"body.{i}" for i in skipped_a]
        skip_b = [f"body.{i}" for i in skipped_b]
        if pattern == "joint":
            with both(skip_a, skip_b):
                loss_of(b(a(x, skip_a), skip_b), y).backward()
            opt_a.step()
            opt_b.step()
        else:
            with both(skip_a, skip_b):
                loss_of(b(a(x, skip_a).detach(), skip_b), y).backward()
            opt_b.step()
            opt_a.zero_grad()
            opt_b.zero_grad()
            with both(skip_a, skip_b):
                loss_of(b(a(x, skip_a), skip_b), y).backward()
            opt_a.step()
        opt_a.zero_grad()
        opt_b.zero_grad()


def _labels(xy: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The first scenario's batch with labels among the second model's classes."""
    return xy[0], xy[1] % SECOND.classes


def _optimizers(a: Any, b: Any) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    return (
        torch.optim.SGD(a, lr=0.1, momentum=0.9),
        torch.optim.AdamW(b, lr=0.05, eps=1e-4),
    )


def _distributed(config: BackendConfig, pattern: str) -> list[dict[str, np.ndarray] | None]:
    import flatview

    first, second = config.scenario(FIRST), config.scenario(SECOND)
    with backend_context(config.backend):
        a, b = wrap_fsdp(first, make_net(first)), wrap_fsdp(second, make_net(second))
        fv_a, fv_b = flatview.wrap(a), flatview.wrap(b)
        opts = _optimizers(fv_a.parameters(), fv_b.parameters())
        steps = (
            lambda skip: fv_a.step(skip=skip),
            lambda skip: fv_b.step(skip=skip),
        )
        _train((a, b), opts, steps, lambda m: _labels(local_batch(first, m)), pattern)
        return [full_state(a, first), full_state(b, second)]


def _reference(first: Scenario, pattern: str) -> list[dict[str, np.ndarray]]:
    a, b = make_net(first), make_net(SECOND)
    opts = _optimizers(a.parameters(), b.parameters())
    none = (lambda _: contextlib.nullcontext(), lambda _: contextlib.nullcontext())
    _train((a, b), opts, none, lambda m: _labels(batch(first, m)), pattern)
    return [{k: v.detach().numpy() for k, v in net.named_parameters()} for net in (a, b)]


@pytest.mark.parametrize("pattern", ["joint", "alternate"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_wrapped_models_train_as_the_reference(
    dist_pool: PoolFactory, backend: BackendConfig, pattern: str
) -> None:
    first = backend.scenario(FIRST)
    results = dist_pool(first.world_size).run(_distributed, backend, pattern, timeout=TIMEOUT)
    for got, want in zip(results[0], _reference(first, pattern), strict=True):
        assert got is not None and got.keys() == want.keys()
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5, err_msg=name)
