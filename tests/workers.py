"""Worker functions for the backend-neutral view and skip-set tests (run in the pool).

Every function takes a :class:`~tests.scenarios.Scenario`, which names the backend, and
returns plain data (or raises) so that the test process can assert on it. The few
places that must reach into a wrapper's internals (where the flat parameters and their
local shards live) are in :func:`flats_and_shards`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import flatview
from flatview.backends.torch_replicated import TorchReplicatedAdapter
from flatview.errors import SkipSetError, StateError
from flatview.layout import PieceKind
from flatview.testing.counting import CollectiveCounter
from tests.scenarios import (
    HYBRID_SHARD_SIZE,
    Scenario,
    _original_tree,
    as_names,
    backend_context,
    distributed_model,
    distributed_training,
    full_state,
    local_batch,
    loss_of,
    make_net,
    wrap_fsdp,
)


@contextlib.contextmanager
def wrapped(
    scenario: Scenario, **wrap_kwargs: Any
) -> Iterator[tuple[nn.Module, flatview.FlatView]]:
    with backend_context(scenario.backend):
        model = wrap_fsdp(scenario, make_net(scenario))
        yield model, flatview.wrap(model, **{**scenario.flatview_options, **wrap_kwargs})


def train_step(
    model: nn.Module,
    fv: flatview.FlatView,
    scenario: Scenario,
    micro: int,
    skip: Sequence[int | str],
) -> None:
    x, y = local_batch(scenario, micro)
    names = as_names(skip)
    with fv.step(skip=list(names)):
        loss_of(model(x, names), y).backward()


def flats_and_shards(model: nn.Module, backend: str) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """Every flat parameter under ``model``, root first, with the full-precision local
    shard that views alias (wrapper internals)."""
    if backend == "fairscale":
        from fairscale.nn.data_parallel import FullyShardedDataParallel as FairscaleFSDP

        # Before the first forward (fairscale's lazy initialisation) the shard is the
        # flat parameter's own data.
        return [
            (flat, getattr(flat, "_fp32_shard", flat.data))
            for unit in model.modules()
            if isinstance(unit, FairscaleFSDP)
            for flat in unit.params
        ]
    if backend == "ddp":
        return []
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    return [
        (unit._handle.flat_param, unit._handle.flat_param._local_shard)
        for unit in model.modules()
        if isinstance(unit, TorchFSDP) and unit._handle is not None
    ]


def empty_elsewhere(fv: flatview.FlatView) -> list[str]:
    """Views with none of their parameter's elements on this rank (which has some
    elsewhere): flatview gives them no gradient."""
    return sorted(n for n, v in fv.named_parameters() if v.numel() == 0 and fv.numel(v) > 0)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _replicated(scenario: Scenario) -> bool:
    return scenario.config.replicated or dist.get_world_size() == 1


def _global_grad_norm(fv: flatview.FlatView, scenario: Scenario) -> float:
    """The norm of the full gradient, from the views' pieces on every rank."""
    squares = sum(
        float((v.grad.double() ** 2).sum()) for v in fv.parameters() if v.grad is not None
    )
    total = torch.tensor([squares], dtype=torch.float64)
    if not _replicated(scenario):
        dist.all_reduce(total)
        if scenario.config.hybrid or "hsdp" in scenario.options:
            # Every replica (shard group) holds the same pieces: the world counts each
            # replicas-many times.
            total /= dist.get_world_size() // HYBRID_SHARD_SIZE
    return float(total.sqrt())


# ------------------------------------------------------------------- views


def describe_views(scenario: Scenario) -> dict[str, Any]:
    """What a user sees right after wrapping, before any forward."""
    with wrapped(scenario) as (model, fv):
        tree = _original_tree(model)
        named = list(fv.named_parameters())
        flats = flats_and_shards(model, scenario.backend)
        shapes = {n: tuple(p.shape) for n, p in make_net(scenario).named_parameters()}
        kinds = {}
        for name, view in named:
            if view.numel() == 0:
                kinds[name] = PieceKind.EMPTY.value
            elif tuple(view.shape) == shapes[name]:
                kinds[name] = PieceKind.FULL.value
            else:
                kinds[name] = PieceKind.PARTIAL.value if view.dim() == 1 else "misshapen"
        tied = tree.head.weight is tree.head_copy.weight if scenario.tie else None
        return {
            "names": [n for n, _ in named],
            "kinds": kinds,
            "leaf_params": all(isinstance(p, nn.Parameter) and p.is_leaf for _, p in named),
            "submodule_is_views": all(
                any(p is q for _, q in named) for p in tree.body.parameters()
            ),
            "forwarded_same": [id(p) for p in model.body.parameters()]
            == [id(p) for p in tree.body.parameters()],
            "model_params_are_views": {id(p) for p in model.parameters()}
            == {id(p) for _, p in named},
            "flats_hidden": not any(p is f for p in model.parameters() for f, _ in flats),
            "alias_a_shard": all(
                v.numel() == 0 or any(_same_storage(v, shard) for _, shard in flats)
                for _, v in named
            ),
            "numel_here": sum(p.numel() for _, p in named),
            "tied_same_object": tied,
        }


def alias_after_operations(scenario: Scenario) -> dict[str, bool]:
    """Views alias the live shard across forward/backward, summon, state_dict, clip."""
    out: dict[str, bool] = {}
    with wrapped(scenario) as (model, fv):
        tree = _original_tree(model)
        views = dict(fv.named_parameters())

        def aliased() -> bool:
            shards = [shard for _, shard in flats_and_shards(model, scenario.backend)]
            return all(
                views[name] is view
                and (view.numel() == 0 or any(_same_storage(view, s) for s in shards))
                for name, view in fv.named_parameters()
            )

        opt = torch.optim.SGD(fv.parameters(), lr=0.1)
        train_step(model, fv, scenario, 0, ())
        out["after_backward"] = aliased()
        flats = [flat for flat, _ in flats_and_shards(model, scenario.backend)]
        if isinstance(fv.adapter, TorchReplicatedAdapter):
            # Computed on views (torch, every unit NO_SHARD): the gradients are the views'
            # own, and the flat parameters get none.
            out["grads_alias_flat_grad"] = all(
                view.grad is not None for view in fv.parameters()
            ) and all(f.grad is None for f in flats)
        else:
            # A view with elements here aliases the sharded gradient; an empty one (its
            # parameter's elements are all on other ranks) gets no gradient.
            out["grads_alias_flat_grad"] = all(
                view.grad is None
                if view.numel() == 0 and fv.numel(view) > 0
                else view.grad is not None
                and (
                    view.numel() == 0
                    or any(f.grad is not None and _same_storage(view.grad, f.grad) for f in flats)
                )
                for view in fv.parameters()
            )
        before = {n: v.detach().clone() for n, v in fv.named_parameters()}
        opt.step()
        out["step_changes_views"] = any(
            not torch.equal(before[n], v) for n, v in fv.named_parameters() if v.numel()
        )
        # torch's summon_full_params is a static method taking the model; fairscale's an
        # instance method: called through the class, both take the model first.
        with type(model).summon_full_params(model):
            out["hidden_in_summon"] = not any(
                p is v for p in tree.head.parameters() for v in views.values()
            )
            tree.head.bias.data.fill_(7.0)
        out["summon_write_reaches_view"] = bool((views["head.bias"] == 7.0).all())
        out["state_dict_sees_write"] = bool((model.state_dict()["head.bias"] == 7.0).all())
        out["after_state_dict"] = aliased()
        train_step(model, fv, scenario, 1, ())
        norm_before = _global_grad_norm(fv, scenario)
        norm = float(model.clip_grad_norm_(1e-3))
        out["clip_reports_views_norm"] = abs(norm - norm_before) <= 1e-5 * norm_before
        out["clip_scaled_view_grads"] = norm > 1e-3 and (
            abs(_global_grad_norm(fv, scenario) - 1e-3) < 1e-6
        )
        out["after_clip"] = aliased()
        out["views_back_on_modules"] = tree.head.bias is views["head.bias"]
        # Writes to views are writes to the parameters: the full state moves with them.
        full_before = full_state(model, scenario)
        with torch.no_grad():
            for view in fv.parameters():
                view.add_(1.0)
        full_after = full_state(model, scenario)
        if full_before is not None and full_after is not None:
            out["writes_reach_full_state"] = all(
                np.allclose(full_after[k], full_before[k] + 1.0) for k in full_before
            )
    return out


def state_dict_with_and_without(scenario: Scenario) -> dict[str, Any]:
    """state_dict keys and values are the same with and without flatview, and a
    checkpoint saved without it loads with it, into the views."""
    with backend_context(scenario.backend):
        plain = wrap_fsdp(scenario, make_net(scenario))
        viewed = wrap_fsdp(scenario, make_net(scenario))
        fv = flatview.wrap(viewed, **scenario.flatview_options)
        for model in (plain, viewed):
            x, y = local_batch(scenario, 0)
            loss_of(model(x), y).backward()
        a, b = plain.state_dict(), viewed.state_dict()
        same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        views_before = {n: v.detach().clone() for n, v in fv.named_parameters()}
        modified = {k: v + 1 for k, v in a.items()}
        viewed.load_state_dict(modified)
        after = viewed.state_dict()
        return {
            "same": same,
            "keys": sorted(a),
            "loaded": all(torch.allclose(after[k], modified[k]) for k in a),
            # Every piece (empty ones trivially) moved by the loaded +1: views alias the
            # storage the checkpoint was loaded into.
            "views_loaded": all(
                torch.allclose(v, views_before[n] + 1) for n, v in fv.named_parameters()
            ),
            "views_intact": _original_tree(viewed).stem.bias
            is dict(fv.named_parameters())["stem.bias"],
        }


def _hook_counts(model: nn.Module) -> list[tuple[int, int]]:
    return [
        (len(p._backward_hooks or {}), len(p._post_accumulate_grad_hooks or {}))
        for p in model.parameters()
    ]


def _fsdp2_runtime(model: nn.Module) -> list[Any]:
    """What flatview changes on an FSDP2 model (wrapper internals): each module's forward
    hook counts, and per ``fully_shard`` state and parameter group the instance attributes
    shadowing the class's methods and the types of the collective objects."""
    from torch.distributed.fsdp import FSDPModule

    def shadows(obj: object) -> list[str]:
        return sorted(n for n, v in vars(obj).items() if callable(getattr(type(obj), n, None)))

    out: list[Any] = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state: Any = module._get_fsdp_state()
            out.append(shadows(state))
            for group in state._fsdp_param_groups:
                out.append(shadows(group))
                out.append((type(group._all_gather_comm), type(group._reduce_scatter_comm)))
    return out


def unwrap_restores_plain_fsdp(scenario: Scenario) -> dict[str, bool]:
    """``unwrap()`` gives the flat parameters back, without flatview's hooks: bare FSDP
    trains, the old handle refuses steps, and the model can be wrapped again."""
    with backend_context(scenario.backend):
        model = wrap_fsdp(scenario, make_net(scenario))
        before = {id(p) for p in model.parameters()}
        hooks_before = _hook_counts(model)
        fsdp2 = scenario.backend == "fsdp2"
        runtime_before = _fsdp2_runtime(model) if fsdp2 else []
        fv = flatview.wrap(model, **scenario.flatview_options)
        views = {id(p) for p in fv.parameters()}
        # Guards the test can fail on: wrap did change the FSDP2 runtime.
        assert not fsdp2 or _fsdp2_runtime(model) != runtime_before
        train_step(model, fv, scenario, 0, (1,))  # guards (DDP: on the originals)
        fv.unwrap()
        after = {id(p) for p in model.parameters()}
        hooks_left = _hook_counts(model) != hooks_before
        if fsdp2:
            # FSDP2's parameters are flatview's (nothing is flattened): what must come back
            # is FSDP2's own runtime, without flatview's hooks, shadows and counters.
            views = set() if _fsdp2_runtime(model) == runtime_before else after
        x, y = local_batch(scenario, 0)
        loss_of(model(x), y).backward()
        if scenario.backend == "ddp":
            # DDP's parameters are flatview's (nothing is flattened): what must come back
            # is DDP's own reduction, which averages, so every rank holds the same grad.
            grad = next(model.parameters()).grad
            assert grad is not None
            total = grad.clone()
            dist.all_reduce(total)
            views = set() if torch.allclose(total, grad * dist.get_world_size()) else after
        try:
            with fv.step(skip=[]):
                pass
            step_refused = False
        except StateError:
            step_refused = True
        flatview.wrap(model, **scenario.flatview_options).unwrap()
        return {
            "flats_back": after == before and not after & views,
            "step_refused": step_refused,
            "hooks_left": hooks_left,
        }


def double_count(scenario: Scenario) -> None:
    with wrapped(scenario) as (model, fv):
        root_flat, _ = flats_and_shards(model, scenario.backend)[0]
        view = dict(fv.named_parameters())["stem.weight"]  # lives in the root's flat
        opt = torch.optim.SGD([root_flat, view], lr=0.1)
        train_step(model, fv, scenario, 0, ())
        opt.step()  # must raise DoubleCountError


def wrap_twice(scenario: Scenario) -> None:
    with wrapped(scenario) as (model, _):
        flatview.wrap(model)


def wrap_not_fsdp(scenario: Scenario) -> None:
    flatview.wrap(make_net(scenario))


def wrap_inner_after_outer(scenario: Scenario) -> None:
    with wrapped(scenario) as (model, _):
        flatview.wrap(_original_tree(model).body[0])


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


def plain_and_flatview(scenario: Scenario) -> tuple[dict[str, np.ndarray], ...] | None:
    """Train the scenario (nothing may be skipped) twice with one optimizer over all
    parameters: bare FSDP over its flat parameters, and FSDP + flatview over views.
    Rank 0 returns both final states."""
    states = []
    for use_flatview in (False, True):
        with backend_context(scenario.backend):
            model = wrap_fsdp(scenario, make_net(scenario))
            fv = flatview.wrap(model, **scenario.flatview_options) if use_flatview else None
            params = list(fv.parameters() if fv is not None else model.parameters())
            # Momentum and weight decay, elementwise: any difference in a gradient shows.
            opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
            for micro in range(len(scenario.skips)):
                assert not scenario.skips[micro], "bare FSDP cannot skip"
                x, y = local_batch(scenario, micro)
                step = fv.step() if fv is not None else contextlib.nullcontext()
                with step:
                    loss_of(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            states.append(full_state(model, scenario))
    if dist.get_rank() != 0:
        return None
    return tuple(s for s in states if s is not None)


def comm_hook_after_wrap(scenario: Scenario) -> dict[str, str]:
    """A communication hook registered on a wrapped DDP or torch FSDP1 model (DDP's fp16
    compression; torch's default reduction as a hook, its fp16 one needs CUDA): what
    flatview raises; after ``unwrap()`` bare training with the hook."""
    state: Any
    if scenario.backend == "ddp":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as ddp_hooks

        state, hook = None, ddp_hooks.fp16_compress_hook
    else:
        from torch.distributed.algorithms._comm_hooks import default_hooks as hooks

        state = hooks.DefaultState(dist.group.WORLD)
        sharded = scenario.strategy != "NO_SHARD"
        hook = hooks.reduce_scatter_hook if sharded else hooks.allreduce_hook
    out: dict[str, str] = {}
    model = wrap_fsdp(scenario, make_net(scenario))
    fv = flatview.wrap(model)
    try:
        model.register_comm_hook(state, hook)  # type: ignore[operator]
    except flatview.FlatViewError as err:
        out["error"] = f"{type(err).__name__}: {err}"
    fv.unwrap()
    model.register_comm_hook(state, hook)  # type: ignore[operator]
    x, y = local_batch(scenario, 0)
    loss_of(model(x), y).backward()
    out["bare"] = "trained"
    return out


# ------------------------------------------------------------------- skips


def count_step(
    scenario: Scenario, skip: Sequence[int | str], strategy: str, **wrap_kwargs: Any
) -> dict[str, Any]:
    """Collective bytes of one training step, counted at the calls, and fv.stats."""
    kwargs = {"reduce_strategy": strategy, "check_skip_agreement": False, **wrap_kwargs}
    with wrapped(scenario, **kwargs) as (model, fv):
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
            "reduce_calls": stats.reduce_calls,
            "used_bytes": stats.used_bytes,
            "dense_bytes": stats.dense_bytes,
            "units_skipped": stats.units_skipped,
            "grads_none": sorted(n for n, v in fv.named_parameters() if v.grad is None),
            "empty_elsewhere": empty_elsewhere(fv),
        }


def mismatched_skips(scenario: Scenario) -> None:
    """An agreed step, then one whose skip set differs by rank (a fingerprint kept from
    the first must not stand for the second's)."""
    with wrapped(scenario) as (model, fv):
        train_step(model, fv, scenario, 0, ())
        skip = (dist.get_rank() % len(scenario.inner),)
        train_step(model, fv, scenario, 1, skip)


def skipped_but_used(scenario: Scenario, declared: str) -> None:
    """Declare ``declared`` skipped but run the whole model."""
    with wrapped(scenario) as (model, fv):
        x, y = local_batch(scenario, 0)
        with fv.step(skip=[declared]):
            loss_of(model(x), y).backward()


def undeclared_unused(scenario: Scenario) -> None:
    """Leave block 0 out of the model without telling flatview."""
    with wrapped(scenario) as (model, fv):
        x, y = local_batch(scenario, 0)
        with fv.step(skip=[]):
            loss_of(model(x, ("body.0",)), y).backward()


def bad_skip_items(scenario: Scenario) -> dict[str, str]:
    """The error each kind of unknown skip item raises (none reaches a collective)."""
    items: dict[str, Any] = {
        "name": "body.9.up.weight",
        "module": nn.Linear(2, 2),
        "tensor": torch.zeros(3),
        "number": 3,
    }
    messages = {}
    with wrapped(scenario, check_skip_agreement=False) as (_model, fv):
        for kind, item in items.items():
            try:
                with fv.step(skip=[item]):
                    pass
            except SkipSetError as err:
                messages[kind] = f"{type(err).__name__}: {err}"
            else:
                messages[kind] = "accepted"
    return messages


def resolve_items(scenario: Scenario) -> dict[str, list[str]]:
    with wrapped(scenario) as (model, fv):
        tree = _original_tree(model)
        unit = tree.body[0]
        return {
            "unit": fv.resolve(unit),
            "inner_module": fv.resolve(_inner(unit).up),
            "view": fv.resolve(tree.head.bias),
            "names": fv.resolve(["body.0", "head.weight"]),
            # The head's weight is tied to head_copy's when the scenario ties them.
            "tied_name": fv.resolve(["head_copy.weight"]) if scenario.tie else [],
            "tied_module": fv.resolve(tree.head_copy) if scenario.tie else [],
        }


def _inner(unit: nn.Module) -> Any:
    """The user's module inside a wrapper unit (the module itself when not wrapped)."""
    module = getattr(unit, "module", unit)
    return getattr(module, "module", module)


def dropped_models_are_freed(scenario: Scenario, wrapped: bool) -> list[str]:
    """Train ``scenario`` (with flatview when ``wrapped``), drop every reference without
    ``unwrap()``, collect: what is still alive (the wrapped model, its handle, a
    parameter). A handle's hooks kept in torch's C++ (tensor and autograd-node hooks)
    are not seen by Python's collector: a strong reference from one of them back to
    the model keeps it alive for the process's life."""
    import gc
    import weakref

    with backend_context(scenario.backend):
        if wrapped:
            model, fv, opts = distributed_model(scenario)
        else:
            model, fv = wrap_fsdp(scenario, make_net(scenario)), None
            opts = [torch.optim.SGD(model.parameters(), lr=0.1)]
        for _ in distributed_training(scenario, model, fv, opts):
            pass
        refs = {"model": weakref.ref(model), "parameter": weakref.ref(next(model.parameters()))}
        if fv is not None:
            refs["handle"] = weakref.ref(fv)
        del model, fv, opts
    gc.collect()
    return sorted(name for name, ref in refs.items() if ref() is not None)


def model_keeps_its_handle(scenario: Scenario) -> dict[str, bool]:
    """Wrap without keeping the handle: it lives as long as the model (its optimizer
    checks and the refusal to wrap the model twice still act), and the model trains."""
    import gc
    import weakref

    with backend_context(scenario.backend):
        model, fv, _opts = distributed_model(scenario)
        handle = weakref.ref(fv)
        del fv
        gc.collect()
        try:
            flatview.wrap(model)
            wrapped_again = True
        except flatview.WrapError:
            wrapped_again = False
        return {"alive": handle() is not None, "wrapped_again": wrapped_again}
