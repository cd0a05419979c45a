"""Real model code, unchanged (workers in :mod:`tests.lib_workers`): a tiny BERT decoder
from ``transformers`` with a unit per layer, on torch FSDP1 and fairscale, 2 ranks.

* ``model.module.generate(...)`` inside ``summon_full_params`` gives the unwrapped model's
  tokens, as bare FSDP with one unit does;
* timm's ``p.ndim <= 1`` grouping on views is refused by ``check_param_groups``;
  ``flatview.optim.param_groups`` trains as timm's rule on the unwrapped model;
* PEFT LoRA: ``fv.numel`` gives the counts PEFT's ``get_nb_trainable_parameters`` gives
  for the unwrapped model.

Needs the ``libs`` extra (``pip install -e .[libs]``); skipped without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests import lib_workers as w
from tests.scenarios import torch_backend_tested

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

pytest.importorskip("transformers")
pytest.importorskip("peft")

TIMEOUT = 240.0
BACKENDS = [
    pytest.param(
        "torch",
        marks=pytest.mark.skipif(not torch_backend_tested(), reason="untested torch"),
    ),
    "fairscale",
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_bert_generation_and_groups(dist_pool: PoolFactory, backend: str) -> None:
    results = dist_pool(2).run(w.bert_task, backend, timeout=TIMEOUT)
    for rank, got in enumerate(results):
        assert got["plain_tokens"] == got["want_tokens"], rank
        assert got["tokens"] == got["want_tokens"], rank
        assert "p.ndim" in got["timm_check"], rank
        assert got["warnings"] == [], rank
        assert got["names_match"], rank
        assert got["max_diff"] < 1e-5, (rank, got["max_diff"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_peft_counts(dist_pool: PoolFactory, backend: str) -> None:
    results = dist_pool(2).run(w.peft_task, backend, timeout=TIMEOUT)
    for rank, got in enumerate(results):
        assert got["got"] == tuple(got["want"]), rank
        assert f"numel={got['want'][1]}" in got["repr"], rank
        # PEFT itself counts this rank's pieces (as on bare FSDP1).
        assert got["peft_on_wrapped"][1] < got["want"][1], rank
