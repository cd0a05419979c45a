"""Tests of flatview.testing.fairscale_on_cpu: real fairscale FSDP on CPU over gloo."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from flatview.testing import _fairscale_cpu, fairscale_on_cpu

if TYPE_CHECKING:
    from tests.conftest import PoolFactory

fsdp_module = pytest.importorskip("fairscale.nn.data_parallel.fully_sharded_data_parallel")
bucketer_module = pytest.importorskip("fairscale.internal.reduce_scatter_bucketer")
FSDP = fsdp_module.FullyShardedDataParallel

SEED = 1234
GLOBAL_BATCH = 8
IN, HIDDEN, OUT = 4, 9, 5

# Attributes the brief for the harness names; _patch_targets() must cover at least these.
EXPECTED_TARGETS: list[tuple[Any, str]] = [
    (torch.cuda, "is_available"),
    (torch.cuda, "Stream"),
    (torch.cuda, "current_stream"),
    (torch.cuda, "stream"),
    (torch.cuda, "synchronize"),
    (torch.Tensor, "record_stream"),
    (torch.Tensor, "cuda"),
    (FSDP, "_lazy_init"),
    (fsdp_module, "_get_default_cuda_device"),
    (fsdp_module, "enable_nccl_base_collectives"),
    (bucketer_module, "enable_nccl_base_collectives"),
]

_MISSING = object()


def _snapshot() -> dict[tuple[int, str], Any]:
    # The owner's own __dict__ entry, not getattr: a leftover override of an inherited
    # torch.Tensor method must count as a change even if it behaves the same.
    return {
        (id(owner), name): vars(owner).get(name, _MISSING)
        for owner, name in _fairscale_cpu._patch_targets()
    }


# ----------------------------------------------------------------- (a) scoping


def test_patch_targets_cover_what_fsdp_needs() -> None:
    targets = {(id(owner), name) for owner, name in _fairscale_cpu._patch_targets()}
    for owner, name in EXPECTED_TARGETS:
        assert (id(owner), name) in targets, name


def test_everything_restored_on_exit() -> None:
    before = _snapshot()
    real_is_available = torch.cuda.is_available
    with fairscale_on_cpu():
        assert _snapshot() != before
        assert torch.cuda.current_stream() is torch.cuda.Stream()
        assert isinstance(torch.cuda.current_stream(), torch.cuda.Stream)
        # Outside FSDP's lazy init the real answer stands.
        assert torch.cuda.is_available() == real_is_available()
        assert fsdp_module.enable_nccl_base_collectives is False
        assert bucketer_module.enable_nccl_base_collectives is False
        assert fsdp_module._get_default_cuda_device(nn.Linear(1, 1)) == torch.device("cpu")
    after = _snapshot()
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert after[key] is value, key
    assert torch.cuda.is_available is real_is_available
    assert "record_stream" not in vars(torch.Tensor)
    assert "cuda" not in vars(torch.Tensor)


def test_everything_restored_after_exception() -> None:
    before = _snapshot()
    with pytest.raises(KeyError, match="boom"), fairscale_on_cpu():
        raise KeyError("boom")
    after = _snapshot()
    for key, value in before.items():
        assert after[key] is value, key


def test_nested_contexts_restore_at_outermost_exit() -> None:
    before = _snapshot()
    with fairscale_on_cpu():
        inside = _snapshot()
        with fairscale_on_cpu():
            assert _snapshot() == inside
        # The inner exit must not undo the outer context's patches.
        assert _snapshot() == inside
        with pytest.raises(RuntimeError), fairscale_on_cpu():
            raise RuntimeError
        assert _snapshot() == inside
    after = _snapshot()
    for key, value in before.items():
        assert after[key] is value, key


def test_is_available_only_inside_lazy_init(monkeypatch: pytest.MonkeyPatch) -> None:
    real = torch.cuda.is_available()
    seen: list[tuple[str, bool]] = []

    def probe(self: Any) -> None:
        seen.append(("lazy_init", torch.cuda.is_available()))
        # Another thread at the same moment must get the real answer.
        other = threading.Thread(target=lambda: seen.append(("thread", torch.cuda.is_available())))
        other.start()
        other.join()
        if self == "raise":
            raise RuntimeError("lazy init failed")

    monkeypatch.setattr(FSDP, "_lazy_init", probe)
    with fairscale_on_cpu():
        FSDP._lazy_init("ok")
        with pytest.raises(RuntimeError, match="lazy init failed"):
            FSDP._lazy_init("raise")
        # A failed lazy init must not leave the flag raised.
        assert torch.cuda.is_available() == real
    assert seen == [("lazy_init", True), ("thread", real)] * 2
    assert FSDP._lazy_init is probe


def test_tensor_cuda_untouched_outside_clip_grad_norm() -> None:
    with fairscale_on_cpu():
        if not torch.cuda.is_available():
            with pytest.raises((AssertionError, RuntimeError)):
                torch.ones(1).cuda()
            with pytest.raises(RuntimeError):
                torch.ones(1).pin_memory()


@pytest.mark.slow  # a fresh interpreter (3-5 s) for the harness's own import error
def test_imports_without_fairscale_and_explains() -> None:
    # A fresh interpreter in which fairscale cannot be imported.
    code = textwrap.dedent(
        """
        import sys
        sys.modules["fairscale"] = None
        import flatview.testing
        assert not [m for m in sys.modules if m.startswith("fairscale") and sys.modules[m]]
        try:
            with flatview.testing.fairscale_on_cpu():
                pass
        except ImportError as exc:
            print("IMPORT-ERROR:", exc)
        """
    )
    # Run from the repository root so that `-c` finds flatview whether or not it is installed.
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=root,
    )
    assert "IMPORT-ERROR:" in out.stdout
    assert "pip install fairscale" in out.stdout


# ------------------------------------------------------------- (b) 2-process FSDP


class Block(nn.Module):
    """Linear + LayerNorm + tanh (smooth, so distributed and reference runs agree tightly)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d_in, d_out)
        self.norm = nn.LayerNorm(d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.norm(self.linear(x)))


def build_model() -> nn.Sequential:
    """The same initial model on every rank and in the reference."""
    torch.manual_seed(SEED)
    # Block 0 has 4*9 + 9 + 2*9 = 63 parameters: odd, so FSDP pads its flat parameter.
    return nn.Sequential(Block(IN, HIDDEN), Block(HIDDEN, HIDDEN), nn.Linear(HIDDEN, OUT))


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic global batch for a step."""
    g = torch.Generator().manual_seed(SEED + 1 + step)
    return torch.randn(GLOBAL_BATCH, IN, generator=g), torch.randn(GLOBAL_BATCH, OUT, generator=g)


def local_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's equal share of the global batch."""
    x, y = global_batch(step)
    rank, world = dist.get_rank(), dist.get_world_size()
    return x.chunk(world)[rank], y.chunk(world)[rank]


def wrap_nested(model: nn.Sequential, **fsdp_kwargs: Any) -> Any:
    """Each block its own FSDP unit inside an outer unit that holds the head."""
    for i in range(2):
        model[i] = FSDP(model[i], flatten_parameters=True, **fsdp_kwargs)
    return FSDP(model, flatten_parameters=True, **fsdp_kwargs)


def make_optimizer(params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with momentum, so optimizer state is exercised too."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of the model's full state_dict, in float32."""
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def task_train(steps: int, fsdp_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Train the nested-FSDP model on this rank's share of each global batch."""
    before = _snapshot()
    with fairscale_on_cpu():
        model = wrap_nested(build_model(), **fsdp_kwargs)
        opt = make_optimizer(model.parameters())
        losses = []
        output_dtype = None
        for step in range(steps):
            x, y = local_batch(step)
            opt.zero_grad()
            output = model(x)
            output_dtype = str(output.dtype)
            loss = nn.functional.mse_loss(output.float(), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        result: dict[str, Any] = {
            "losses": losses,
            "state": full_state(model),
            "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "output_dtype": output_dtype,
            "compute_device": str(model.compute_device),
        }
    # After a real run, too, every patched attribute is the original object again.
    after = _snapshot()
    result["restored"] = all(after[key] is value for key, value in before.items())
    return result


def reference_train(steps: int) -> dict[str, Any]:
    """The same training, single process, on the whole global batch (mean loss)."""
    model = build_model()
    opt = make_optimizer(model.parameters())
    losses = []
    for step in range(steps):
        x, y = global_batch(step)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "state": full_state(model)}


def assert_states_close(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float
) -> None:
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=atol, rtol=0, msg=key)


@pytest.mark.parametrize(
    ("fsdp_kwargs", "atol", "compute_dtype"),
    [
        ({}, 1e-5, torch.float32),
        ({"reshard_after_forward": False}, 1e-5, torch.float32),
        # float16 compute: same trajectory, coarser agreement.
        ({"mixed_precision": True}, 2e-2, torch.float16),
        ({"cpu_offload": True}, 1e-5, torch.float32),
    ],
    ids=["default", "no-reshard", "mixed-precision", "cpu-offload"],
)
def test_nested_fsdp_trains_like_single_process(
    dist_pool: PoolFactory, fsdp_kwargs: dict[str, Any], atol: float, compute_dtype: torch.dtype
) -> None:
    steps = 3
    results = dist_pool(2).run(task_train, steps, fsdp_kwargs)
    ref = reference_train(steps)
    for res in results:
        assert res["restored"]
        assert res["compute_device"] == "cpu"
        assert res["output_dtype"] == str(compute_dtype)
        # FSDP keeps float32 master shards, also under mixed precision.
        assert res["param_dtypes"] == ["torch.float32"]
        assert_states_close(res["state"], ref["state"], atol)
        # Both ranks hold the same full state after the all-gather.
        assert_states_close(res["state"], results[0]["state"], 0.0)
    # Each rank's loss is over its half of the batch; their mean is the global mean loss.
    mean_losses = [sum(r["losses"][i] for r in results) / len(results) for i in range(steps)]
    assert mean_losses == pytest.approx(ref["losses"], abs=atol)
    # Training moved the model: the comparison is not trivially between initial states.
    assert not torch.allclose(ref["state"]["2.weight"], build_model().state_dict()["2.weight"])


def task_features() -> dict[str, Any]:
    """clip_grad_norm_, no_sync, summon_full_params and the state-dict APIs on CPU."""
    out: dict[str, Any] = {}
    with fairscale_on_cpu():
        model = wrap_nested(build_model())
        opt = make_optimizer(model.parameters())

        # Step 0: micro-batches accumulated under no_sync, reduced by the last backward.
        x, y = local_batch(0)
        opt.zero_grad()
        with model.no_sync():
            nn.functional.mse_loss(model(x[:2]), y[:2]).backward()
        nn.functional.mse_loss(model(x[2:]), y[2:]).backward()
        out["clip_norm"] = model.clip_grad_norm_(0.05).item()
        opt.step()

        with model.summon_full_params():
            out["summoned"] = {
                name: p.detach().clone() for name, p in model.named_parameters() if p.dim() > 0
            }
        out["state"] = full_state(model)

        # Full state dict round trip: load a perturbed copy, read it back, restore.
        saved = model.state_dict()
        model.load_state_dict({k: v + 1.0 for k, v in saved.items()})
        out["perturbed"] = full_state(model)
        model.load_state_dict(saved)
        out["restored"] = full_state(model)

        # Local (sharded) state dict round trip.
        local = {k: v.clone() for k, v in model.local_state_dict().items()}
        out["local_shapes"] = {k: tuple(v.shape) for k, v in local.items()}
        model.load_local_state_dict({k: v * 0.0 for k, v in local.items()})
        out["zeroed_sum"] = sum(v.abs().sum().item() for v in model.local_state_dict().values())
        model.load_local_state_dict(local)
        out["after_local"] = full_state(model)

        # The model still trains after all that.
        x, y = local_batch(1)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        out["trained"] = full_state(model)
    return out


def reference_features() -> dict[str, Any]:
    """The same steps single-process: two accumulated half-batches, clipped, stepped."""
    model = build_model()
    opt = make_optimizer(model.parameters())
    x, y = global_batch(0)
    # Rank r's first micro-batch is global rows [4r, 4r+2), its second [4r+2, 4r+4).
    first = torch.cat([x[0:2], x[4:6]]), torch.cat([y[0:2], y[4:6]])
    second = torch.cat([x[2:4], x[6:8]]), torch.cat([y[2:4], y[6:8]])
    opt.zero_grad()
    nn.functional.mse_loss(model(first[0]), first[1]).backward()
    nn.functional.mse_loss(model(second[0]), second[1]).backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), 0.05).item()
    opt.step()
    state = full_state(model)
    x, y = global_batch(1)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    return {"clip_norm": norm, "state": state, "trained": full_state(model)}


def test_fsdp_features_run_on_cpu(dist_pool: PoolFactory) -> None:
    results = dist_pool(2).run(task_features)
    ref = reference_features()
    for res in results:
        assert res["clip_norm"] == pytest.approx(ref["clip_norm"], rel=1e-5)
        assert_states_close(res["state"], ref["state"], 1e-5)
        # summon_full_params exposes every original parameter at full size.
        summoned = sorted(tuple(p.shape) for p in res["summoned"].values())
        assert summoned == sorted(tuple(v.shape) for v in ref["state"].values())
        for key, value in res["state"].items():
            torch.testing.assert_close(res["perturbed"][key], value + 1.0)
            torch.testing.assert_close(res["restored"][key], value)
            torch.testing.assert_close(res["after_local"][key], value)
        assert res["zeroed_sum"] == 0.0
        # Sharded: one flat parameter per unit, about half of the model each.
        assert sum(len(s) and s[0] for s in res["local_shapes"].values()) < sum(
            v.numel() for v in ref["state"].values()
        )
        assert_states_close(res["trained"], ref["trained"], 1e-5)
