"""Detaching flatview with ``unwrap()``, on both backends. Self-contained: its own tiny
model."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import flatview
from flatview.errors import StateError

BACKENDS = ["fairscale", "torch"]


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, skip_b: bool = False) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if not skip_b:
            h = h + torch.tanh(self.b(h))
        return self.c(h)


def _wrapped(backend: str) -> nn.Module:
    net = Tiny()
    if backend == "fairscale":
        from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

        net.b = FSDP(net.b)
        return FSDP(net)
    from torch.distributed.fsdp import FullyShardedDataParallel as TFSDP

    net.b = TFSDP(net.b, device_id=torch.device("cpu"))
    return TFSDP(net, device_id=torch.device("cpu"))


def _context(backend: str) -> Any:
    if backend == "fairscale":
        from flatview.testing import fairscale_on_cpu

        return fairscale_on_cpu()
    import contextlib

    return contextlib.nullcontext()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(dist.get_rank())
    return torch.randn(4, 3, generator=g), torch.randint(0, 2, (4,), generator=g)


def unwrap_restores_plain_fsdp(backend: str) -> dict[str, Any]:
    with _context(backend):
        model = _wrapped(backend)
        before = {id(p) for p in model.parameters()}
        fv = flatview.wrap(model)
        views = {id(p) for p in fv.parameters()}
        fv.unwrap()
        after = {id(p) for p in model.parameters()}
        x, y = _batch()
        nn.functional.cross_entropy(model(x), y).backward()  # plain FSDP still trains
        try:
            with fv.step(skip=[]):
                pass
            step_refused = False
        except StateError:
            step_refused = True
        flatview.wrap(model).unwrap()  # and can be wrapped again
        return {
            "flats_back": after == before and not (after & views),
            "step_refused": step_refused,
        }


@pytest.mark.parametrize("backend", BACKENDS)
def test_unwrap_gives_back_plain_fsdp(dist_pool: Any, backend: str) -> None:
    for result in dist_pool(2).run(unwrap_restores_plain_fsdp, backend):
        assert result == {"flats_back": True, "step_refused": True}, result
