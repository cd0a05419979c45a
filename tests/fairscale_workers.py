"""Worker functions for the fairscale view and skip-set tests (run in the process pool).

Each returns plain data (or raises) so the test process can assert on it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import flatview
from flatview.comm.counting import CollectiveCounter
from tests.scenarios import Scenario, backend_context, batch, full_state, make_net, wrap_fsdp


@contextlib.contextmanager
def wrapped(
    scenario: Scenario, **wrap_kwargs: Any
) -> Iterator[tuple[nn.Module, flatview.FlatView]]:
    with backend_context(scenario.backend):
        model = wrap_fsdp(scenario, make_net(scenario))
        yield model, flatview.wrap(model, **wrap_kwargs)


def local_batch(scenario: Scenario, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(scenario, step)
    world, rank = dist.get_world_size(), dist.get_rank()
    return x.chunk(world)[rank], y.chunk(world)[rank]


def train_step(
    model: nn.Module, fv: flatview.FlatView, scenario: Scenario, step: int, skip: tuple[int, ...]
) -> None:
    x, y = local_batch(scenario, step)
    with fv.step(skip=[f"body.{i}" for i in skip]):
        nn.functional.cross_entropy(model(x, skip), y).backward()


# ------------------------------------------------------------------- views


def describe_views(scenario: Scenario) -> dict[str, Any]:
    """What a user sees right after wrapping, before any forward."""
    with wrapped(scenario) as (model, fv):
        body = model.module.body
        named = list(fv.named_parameters())
        return {
            "names": [n for n, _ in named],
            "shapes": {n: tuple(p.shape) for n, p in named},
            "leaf_params": all(isinstance(p, nn.Parameter) and p.is_leaf for _, p in named),
            "submodule_is_views": all(any(p is q for _, q in named) for p in body.parameters()),
            "forwarded_same": [id(p) for p in model.body.parameters()]
            == [id(p) for p in body.parameters()],
            "model_params_are_views": {id(p) for p in model.parameters()}
            == {id(p) for _, p in named},
            "numel_here": sum(p.numel() for _, p in named),
            "tied_same_object": (
                model.module.head.weight is model.module.head_copy.weight if scenario.tie else None
            ),
        }


def alias_after_operations(scenario: Scenario) -> dict[str, bool]:
    """Views alias the live shard across forward/backward, summon, state_dict, clip."""
    out: dict[str, bool] = {}
    with wrapped(scenario) as (model, fv):
        views = dict(fv.named_parameters())
        flats = [u.params[0] for u in model.modules() if hasattr(u, "params") and u.params]

        def aliased() -> bool:
            for name, view in fv.named_parameters():
                if view.numel() and not any(
                    view.untyped_storage().data_ptr() == f._fp32_shard.untyped_storage().data_ptr()
                    for f in flats
                    if hasattr(f, "_fp32_shard")
                ):
                    return False
                if views[name] is not view:
                    return False
            return True

        opt = torch.optim.SGD(fv.parameters(), lr=0.1)
        train_step(model, fv, scenario, 0, ())
        out["after_backward"] = aliased()
        out["grads_alias_flat_grad"] = all(
            view.grad is None
            or view.numel() == 0
            or any(
                f.grad is not None
                and view.grad.untyped_storage().data_ptr() == f.grad.untyped_storage().data_ptr()
                for f in flats
            )
            for _, view in fv.named_parameters()
        )
        before = {n: v.detach().clone() for n, v in fv.named_parameters()}
        opt.step()
        out["step_changes_views"] = any(
            not torch.equal(before[n], v) for n, v in fv.named_parameters()
        )
        with model.summon_full_params():
            out["hidden_in_summon"] = not any(
                p is v for p in model.module.head.parameters() for v in views.values()
            )
            model.module.head.bias.data.fill_(7.0)
        out["summon_write_reaches_view"] = bool(
            (views["head.bias"] == 7.0).all() or views["head.bias"].numel() < scenario.classes
        )
        full_head_bias = model.state_dict()["head.bias"]
        out["state_dict_sees_write"] = bool((full_head_bias == 7.0).all())
        out["after_state_dict"] = aliased()
        train_step(model, fv, scenario, 1, ())
        norm = model.clip_grad_norm_(1e-3)
        total = sum(
            (v.grad.double() ** 2).sum() for _, v in fv.named_parameters() if v.grad is not None
        )
        t = torch.tensor([float(total)])
        dist.all_reduce(t)
        out["clip_scaled_view_grads"] = bool(
            float(norm) > 1e-3 and abs(t.sqrt().item() - 1e-3) < 1e-5
        )
        out["after_clip"] = aliased()
        out["views_back_on_modules"] = model.module.head.bias is views["head.bias"]
    return out


def state_dict_with_and_without(scenario: Scenario) -> dict[str, Any]:
    """state_dict keys and values are the same with and without flatview, and a
    checkpoint saved without it loads with it (and back)."""
    with backend_context(scenario.backend):
        plain = wrap_fsdp(scenario, make_net(scenario))
        viewed = wrap_fsdp(scenario, make_net(scenario))
        fv = flatview.wrap(viewed)
        for model in (plain, viewed):
            x, y = local_batch(scenario, 0)
            nn.functional.cross_entropy(model(x), y).backward()
        a, b = plain.state_dict(), viewed.state_dict()
        same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        # Load a modified checkpoint into the flatview model: the views see it.
        modified = {k: v + 1 for k, v in a.items()}
        viewed.load_state_dict(modified)
        after = viewed.state_dict()
        loaded = all(torch.allclose(after[k], modified[k]) for k in a)
        head_bias_view = dict(fv.named_parameters())["stem.bias"]
        shard_moved = bool(
            head_bias_view.numel() == 0
            or torch.allclose(head_bias_view, head_bias_view.detach() * 0 + head_bias_view)
        )
        return {
            "same": same,
            "loaded": loaded,
            "keys": sorted(a.keys()),
            "views_intact": shard_moved and viewed.module.stem.bias is head_bias_view,
        }


def double_count(scenario: Scenario) -> None:
    with wrapped(scenario) as (model, fv):
        flat = next(iter(model.params))
        view = next(fv.parameters())
        opt = torch.optim.SGD([flat, view], lr=0.1)
        train_step(model, fv, scenario, 0, ())
        opt.step()  # must raise DoubleCountError


def wrap_twice(scenario: Scenario) -> None:
    with wrapped(scenario) as (model, _):
        flatview.wrap(model)


def wrap_not_fsdp(scenario: Scenario) -> None:
    flatview.wrap(make_net(scenario))


def wrap_inner_after_outer(scenario: Scenario) -> None:
    with wrapped(scenario) as (model, _):
        flatview.wrap(model.module.body[0])


def mixed_precision_run(scenario: Scenario) -> dict[str, Any]:
    with wrapped(scenario) as (model, fv):
        opt = torch.optim.SGD(fv.parameters(), lr=0.1)
        before = {n: v.detach().clone() for n, v in fv.named_parameters()}
        train_step(model, fv, scenario, 0, scenario.skips[0])
        dtypes = {str(v.dtype) for _, v in fv.named_parameters()}
        grad_dtypes = {str(v.grad.dtype) for _, v in fv.named_parameters() if v.grad is not None}
        opt.step()
        changed = [n for n, v in fv.named_parameters() if not torch.equal(before[n], v)]
        return {"dtypes": dtypes, "grad_dtypes": grad_dtypes, "changed": changed}


# ------------------------------------------------------------------- skips


def count_step(scenario: Scenario, skip: tuple[int, ...], strategy: str) -> dict[str, Any]:
    """Collective bytes of one training step, counted at the calls, and fv.stats."""
    with wrapped(scenario, reduce_strategy=strategy, check_skip_agreement=False) as (model, fv):
        train_step(model, fv, scenario, 0, ())  # warm up lazy init
        torch.optim.SGD(fv.parameters(), lr=0.0).zero_grad(set_to_none=True)
        with CollectiveCounter() as counter:
            train_step(model, fv, scenario, 1, skip)
        stats = fv.stats
        assert stats is not None
        return {
            "bytes": dict(counter.bytes),
            "calls": dict(counter.calls),
            "reduced_bytes": stats.reduced_bytes,
            "used_bytes": stats.used_bytes,
            "dense_bytes": stats.dense_bytes,
            "units_skipped": stats.units_skipped,
            "grads_none": sorted(n for n, v in fv.named_parameters() if v.grad is None),
        }


def mismatched_skips(scenario: Scenario) -> None:
    with wrapped(scenario) as (model, fv):
        skip = (dist.get_rank() % len(scenario.inner),)
        train_step(model, fv, scenario, 0, skip)


def skipped_but_used(scenario: Scenario) -> None:
    """Declare block 0 skipped but run it anyway."""
    with wrapped(scenario) as (model, fv):
        x, y = local_batch(scenario, 0)
        with fv.step(skip=["body.0"]):
            nn.functional.cross_entropy(model(x, ()), y).backward()


def undeclared_unused(scenario: Scenario) -> None:
    """Skip block 0 in the model without telling flatview."""
    with wrapped(scenario) as (model, fv):
        x, y = local_batch(scenario, 0)
        with fv.step(skip=[]):
            nn.functional.cross_entropy(model(x, (0,)), y).backward()


def bad_skip_item(scenario: Scenario, item: str) -> None:
    with wrapped(scenario) as (_model, fv):
        items: dict[str, Any] = {
            "name": "body.9.up.weight",
            "module": nn.Linear(2, 2),
            "tensor": torch.zeros(3),
            "number": 3,
        }
        with fv.step(skip=[items[item]]):
            pass


def resolve_items(scenario: Scenario) -> dict[str, list[str]]:
    with wrapped(scenario) as (model, fv):
        body0 = model.module.body[0]
        return {
            "unit": fv.resolve(body0),
            "inner_module": fv.resolve(_inner(body0).up),
            "view": fv.resolve(model.module.head.bias),
            "names": fv.resolve(["body.0", "head.weight"]),
        }


def _inner(unit: nn.Module) -> Any:
    module = getattr(unit, "module", unit)
    return getattr(module, "module", module)


def backward_outside_step(scenario: Scenario) -> dict[str, np.ndarray] | None:
    """Plain FSDP behaviour (nothing skipped) when backward runs outside fv.step."""
    from tests.scenarios import optimizers

    with wrapped(scenario) as (model, _fv):
        opts = optimizers(model.module)
        for step in range(len(scenario.skips)):
            x, y = local_batch(scenario, step)
            nn.functional.cross_entropy(model(x), y).backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()
        return full_state(model, scenario)


def accumulate(scenario: Scenario, micro: tuple[tuple[int, ...], ...]) -> dict[str, Any]:
    """Gradient accumulation over micro-batches with different skip sets; the last one
    synchronises. Returns, per original name, the full reduced gradient (or None)."""
    with wrapped(scenario) as (model, fv):
        for index, skip in enumerate(micro):
            sync = index == len(micro) - 1
            ctx = contextlib.nullcontext() if sync else model.no_sync()
            with ctx:
                train_step(model, fv, scenario, index, skip)
        grads: dict[str, Any] = {}
        for name, view in fv.named_parameters():
            grads[name] = None if view.grad is None else view.grad.detach().reshape(-1).clone()
        return {"grads": _gather_pieces(fv, grads)}


def _gather_pieces(fv: flatview.FlatView, grads: dict[str, Any]) -> dict[str, Any]:
    """Reassemble full per-parameter gradients from every rank's pieces (rank 0)."""
    pieces: list[Any] = [None] * dist.get_world_size()
    local = {name: (None if g is None else g.numpy()) for name, g in grads.items()}
    dist.all_gather_object(pieces, local)
    merged: dict[str, Any] = {}
    for name in grads:
        parts = [p[name] for p in pieces]
        if all(p is None for p in parts):
            merged[name] = None
        else:
            merged[name] = np.concatenate([p for p in parts if p is not None])
    return merged


def abandoned_forward_then_zero(scenario: Scenario) -> dict[str, np.ndarray] | None:
    """A forward with autograd on but no backward (a validation loss computed without
    no_grad), then zero_grad, then training: no stale gradient may survive."""
    from tests.scenarios import optimizers

    with wrapped(scenario) as (model, fv):
        opts = optimizers(model.module)
        for step, skip in enumerate(scenario.skips):
            train_step(model, fv, scenario, step, skip)
            for opt in opts:
                opt.step()
            x, _ = local_batch(scenario, 100 + step)
            model(x)  # validation forward, graph discarded
            for opt in opts:
                opt.zero_grad(set_to_none=scenario.set_to_none)
        return full_state(model, scenario)
