"""Worker functions for checks that only torch FSDP1 has: its state-dict types, its
prefetching, its communication hooks and the configurations flatview must refuse.

Backend-neutral workers live in :mod:`tests.workers`; models and scenarios in
:mod:`tests.scenarios`.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import flatview
from flatview.errors import FlatViewError
from tests.scenarios import (
    Scenario,
    _original_tree,
    local_batch,
    loss_of,
    make_net,
    skip_names,
    wrap_fsdp,
)


def _is_unit(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    return isinstance(module, TorchFSDP) and module._handle is not None


# ------------------------------------------------------------------- state dicts


def state_dict_task(scenario: Scenario, kind: str) -> dict[str, Any]:
    """``state_dict`` (``kind``: FULL_STATE_DICT or SHARDED_STATE_DICT) before and after
    wrapping, a load round trip, and ``summon_full_params`` with views."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import StateDictType

    root = wrap_fsdp(scenario, make_net(scenario))
    net = _original_tree(root)
    state_type = StateDictType[kind]
    # One step first, so that the sharded gradients exist too.
    x, y = local_batch(scenario, 0)
    loss_of(root(x), y).backward()
    with TorchFSDP.state_dict_type(root, state_type):
        plain = _local_values(root.state_dict())
    fv = flatview.wrap(root, **scenario.flatview_options)
    view_ids = sorted(id(p) for p in net.parameters())
    with TorchFSDP.state_dict_type(root, state_type):
        wrapped_state = root.state_dict()
        wrapped = _local_values(wrapped_state)
    same_views = sorted(id(p) for p in net.parameters()) == view_ids
    # Load a shifted copy; the views must see the new values.
    views_before = {n: v.detach().clone() for n, v in fv.named_parameters()}
    with torch.no_grad():
        for value in _local_tensors(wrapped_state):
            value.add_(0.5)
    with TorchFSDP.state_dict_type(root, state_type):
        root.load_state_dict(wrapped_state)
    with TorchFSDP.state_dict_type(root, state_type):
        reloaded = _local_values(root.state_dict())
    views_loaded = all(torch.allclose(v, views_before[n] + 0.5) for n, v in fv.named_parameters())
    # summon_full_params (torch's static method) shows full parameters, then views.
    with TorchFSDP.summon_full_params(root):
        summoned = {n: tuple(p.shape) for n, p in net.named_parameters()}
    after_summon = sorted(id(p) for p in net.parameters()) == view_ids
    with fv.step():
        loss_of(root(x), y).backward()
    return {
        "plain": plain,
        "wrapped": wrapped,
        "reloaded": reloaded,
        "same_views": same_views,
        "views_loaded": views_loaded,
        "summoned": summoned,
        "after_summon": after_summon,
    }


def _local_tensors(state: dict[str, Any]) -> Iterator[torch.Tensor]:
    for value in state.values():
        if isinstance(value, torch.Tensor) and hasattr(value, "local_shards"):
            for shard in value.local_shards():
                yield shard.tensor
        elif isinstance(value, torch.Tensor):
            yield value


def _local_values(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in state.items():
        if hasattr(value, "local_shards"):
            out[key] = [s.tensor.detach().clone() for s in value.local_shards()]
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().clone()
        else:
            out[key] = value
    return out


def uninstall_task(scenario: Scenario) -> list[str]:
    """What the adapter leaves behind after ``uninstall``: should be nothing."""
    root = wrap_fsdp(scenario, make_net(scenario))
    x, y = local_batch(scenario, 0)
    fv = flatview.wrap(root, **scenario.flatview_options)
    with fv.step(skip=["body.1"]):
        loss_of(root(x, ("body.1",)), y).backward()
    from flatview.backends import patches

    # (owner, name, what the patch shadowed: an instance attribute of torch's own, say)
    patched = list(fv.adapter._patches._patched)  # type: ignore[attr-defined]
    fv.adapter.uninstall()
    gone = patches._NOTHING
    # A name patched twice (a unit's _apply: recasting, then lending) ends as it was
    # before the first patch.
    first: dict[tuple[int, str], tuple[object, str, object]] = {}
    for owner, name, previous in patched:
        first.setdefault((id(owner), name), (owner, name, previous))
    left = [
        f"{type(owner).__name__}.{name}"
        for owner, name, previous in first.values()
        if vars(owner).get(name, gone) is not previous
    ]
    # Some patch did shadow one of torch's own (FlatParamHandle._setattr_tensor): put back.
    assert any(previous is not gone for _, _, previous in patched)
    units = [m for m in root.modules() if isinstance(m, type(root))]
    left += [f"comm hook on {type(u).__name__}" for u in units if u._comm_hook is not None]
    hooks = [m for m in root.modules() if m._forward_pre_hooks or m._forward_hooks]
    left += [f"module hooks on {type(m).__name__}" for m in hooks]
    return left


# ------------------------------------------------------------------------ prefetch


def prefetch_task(
    scenario: Scenario, use_flatview: bool, abandon_first: bool = False
) -> tuple[list[list[str]], list[list[str]]]:
    """Per step of the scenario: the body units whose parameters were all-gathered
    although the step skips them (the model does not call skipped blocks), and the units
    whose parameters were already prefetched when their forward began.

    ``abandon_first``: start with a forward (autograd on, every block) that no backward
    follows, as a validation pass without ``no_grad`` would."""
    from flatview.backends.torch_fsdp import clean_name

    root = wrap_fsdp(scenario, make_net(scenario))
    units = [(clean_name(n), m._handle.flat_param) for n, m in root.named_modules() if _is_unit(m)]
    gathered: list[str] = []
    original = dist.all_gather

    @functools.wraps(original)
    def counting(tensor_list: Any, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        # FSDP1 on CPU all-gathers the local shard itself (list form).
        gathered.extend(n for n, f in units if tensor.data_ptr() == f._local_shard.data_ptr())
        return original(tensor_list, tensor, *args, **kwargs)

    prefetched_now: list[str] = []

    def note_prefetch(name: str, module: nn.Module, args: Any) -> None:
        if module._handle._prefetched:  # type: ignore[union-attr]
            prefetched_now.append(name)

    wasted = []
    prefetched = []
    fv = (
        flatview.wrap(root, check_skip_agreement=False, **scenario.flatview_options)
        if use_flatview
        else None
    )
    for name, module in root.named_modules():
        if _is_unit(module):
            # Registered after flatview's hooks, so it runs right before FSDP unshards.
            module.register_forward_pre_hook(functools.partial(note_prefetch, clean_name(name)))
    if abandon_first:
        root(local_batch(scenario, -1)[0])
    dist.all_gather = counting
    try:
        for step in range(len(scenario.skips)):
            gathered.clear()
            prefetched_now.clear()
            x, y = local_batch(scenario, step)
            skip = skip_names(scenario, step)
            declared = fv.step(skip=list(skip)) if fv is not None else contextlib.nullcontext()
            with declared:
                loss_of(root(x, skip), y).backward()
            wasted.append(sorted(set(gathered) & set(skip)))
            prefetched.append(sorted(prefetched_now))
    finally:
        dist.all_gather = original
    return wasted, prefetched


# -------------------------------------------------------------------------- errors


def wrap_error_task(scenario: Scenario, case: str) -> str:
    """Try to wrap something flatview must refuse; return the error message."""
    net = make_net(scenario)
    kwargs: dict[str, Any] = {}
    if case == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in net.body:
            fully_shard(block)
        target: Any = fully_shard(net)
    elif case == "nested":
        # Without flatview first: torch's lazy initialisation marks the nested units.
        root = wrap_fsdp(scenario, net)
        root(local_batch(scenario, 0)[0])
        target = _original_tree(root).body[0]
    elif case == "version":
        root = wrap_fsdp(scenario, net)
        import flatview.backends.torch_versions as torch_versions

        tested = torch_versions.TESTED_TORCH
        torch_versions.TESTED_TORCH = ((1, 0),)
        try:
            try:
                flatview.wrap(root)
            except FlatViewError as err:
                refused = str(err)
            else:
                raise AssertionError("no error")
            # The escape hatch: a warning instead, and a working FlatView.
            os.environ[torch_versions.UNTESTED_TORCH_ENV] = "1"
            with pytest.warns(UserWarning, match="going ahead"):
                fv = flatview.wrap(root, **scenario.flatview_options)
            assert dict(fv.named_parameters())
            fv.unwrap()
            return refused
        finally:
            torch_versions.TESTED_TORCH = tested
            os.environ.pop(torch_versions.UNTESTED_TORCH_ENV, None)
    elif case == "overlap_reduction":
        target, kwargs = wrap_fsdp(scenario, net), {"overlap_reduction": False}
    elif case == "mask_gather_min_saved":
        target = wrap_fsdp(scenario, net)
        kwargs = {"reduce_options": flatview.ReduceOptions(mask_gather_min_saved=0)}
    elif case in ("views_sharded", "views_mixed_precision"):
        if case == "views_mixed_precision":
            options = {"mixed_precision": ("bfloat16", "float32")}
            scenario = replace(scenario, strategy="NO_SHARD", options=options)
        target, kwargs = wrap_fsdp(scenario, net), {"compute_on_views": True}
    elif case == "views_ddp":
        target, kwargs = DistributedDataParallel(net), {"compute_on_views": False}
    elif case == "comm_hook":
        root = wrap_fsdp(scenario, net)

        def hook(state: Any, grad: torch.Tensor, output: torch.Tensor | None = None) -> None:
            raise AssertionError("not called")

        root.register_comm_hook(None, hook)
        target = root
    elif case == "hybrid_shard_of_one":
        # Replicated across both ranks, shards of one rank: torch switches the units to
        # NO_SHARD and never reduces across the replicas.
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
        from torch.distributed.fsdp import ShardingStrategy

        mesh = init_device_mesh("cpu", (2, 1))
        strategy = ShardingStrategy.HYBRID_SHARD
        target = TorchFSDP(net, sharding_strategy=strategy, device_mesh=mesh, device_id="cpu")
    else:
        raise ValueError(case)
    try:
        flatview.wrap(target, **kwargs)
    except FlatViewError as err:
        return str(err)
    raise AssertionError(f"flatview.wrap accepted case {case!r}")


# ------------------------------------------------------------------ computed on views


def on_views_task(scenario: Scenario) -> dict[str, Any]:
    """Which adapter each NO_SHARD configuration gets, and what a step computed on views
    leaves behind: FSDP idle, flat parameters without gradients and hidden, views with
    their own; an optimizer over flat parameters refused at its first step."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    out: dict[str, Any] = {}
    for label, options, wrap_kwargs in (
        ("default", {}, {}),
        ("runtime", {}, {"compute_on_views": False}),
        ("mixed_precision", {"mixed_precision": ("bfloat16", "float32")}, {}),
        ("use_orig_params", {"use_orig_params": True}, {}),
    ):
        root = wrap_fsdp(replace(scenario, options=options), make_net(scenario))
        fv = flatview.wrap(root, **wrap_kwargs)
        out[label] = type(fv.adapter).__name__
        fv.unwrap()
    root = wrap_fsdp(scenario, make_net(scenario))
    units = [m for m in root.modules() if isinstance(m, TorchFSDP)]
    flats = [u._handle.flat_param for u in units if u._handle is not None]
    early = torch.optim.SGD(flats, lr=0.1)  # built before wrapping: flat parameters
    fv = flatview.wrap(root)
    x, y = local_batch(scenario, 0)
    with fv.step(skip=["body.1"]):
        loss_of(root(x, ("body.1",)), y).backward()
    out["units_idle"] = all(u.training_state.name == "IDLE" for u in units)
    out["flat_grads_none"] = all(f.grad is None for f in flats)
    held = {id(p) for p in root.parameters()}
    out["flats_hidden"] = not any(id(f) in held for f in flats)
    grads = {n: p.grad is not None for n, p in fv.named_parameters()}
    out["grads_on_used_views"] = all(grads[n] != n.startswith("body.1.") for n in grads)
    try:
        early.step()
    except FlatViewError as err:
        out["flat_optimizer"] = f"{type(err).__name__}: {err}"
    return out


def state_dict_mid_step_task(scenario: Scenario) -> list[list[str]]:
    """Per step: the parameters whose gradient a full ``state_dict`` and a
    ``summon_full_params`` taken between the backward and the optimizer step changed
    (identity of ``None``, or values). Skipped ones must keep ``None``."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    root = wrap_fsdp(scenario, make_net(scenario))
    fv = flatview.wrap(root, **scenario.flatview_options)
    opt = torch.optim.AdamW(fv.parameters(), lr=0.1, weight_decay=0.1)
    changed = []
    for step in range(len(scenario.skips)):
        x, y = local_batch(scenario, step)
        skip = skip_names(scenario, step)
        with fv.step(skip=list(skip)):
            loss_of(root(x, skip), y).backward()
        before = {n: None if p.grad is None else p.grad.clone() for n, p in fv.named_parameters()}
        config = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
        with TorchFSDP.state_dict_type(root, StateDictType.FULL_STATE_DICT, config):
            root.state_dict()
        with TorchFSDP.summon_full_params(root):
            pass
        after = dict(fv.named_parameters())
        changed.append(
            sorted(
                name
                for name, grad in before.items()
                if (grad is None) != (after[name].grad is None)
                or (grad is not None and not torch.equal(grad, after[name].grad))
            )
        )
        if any(after[n].grad is not None for n in after if n.startswith(skip)):
            changed[-1].append("a skipped parameter has a gradient")
        opt.step()
        opt.zero_grad()
    return changed


def on_views_edges_task(scenario: Scenario) -> dict[str, Any]:
    """Computed on views: an optimizer over a flat parameter that torch keeps beside its
    own parameters (use_orig_params=True) is refused too; after ``.double()`` the views
    follow the flat parameter's new storage, and a step on them writes into it."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    out: dict[str, Any] = {}
    root = wrap_fsdp(replace(scenario, options={"use_orig_params": True}), make_net(scenario))
    flats = [m._handle.flat_param for m in root.modules() if isinstance(m, TorchFSDP)]
    fv = flatview.wrap(root)
    early = torch.optim.SGD(flats[:1], lr=0.1)
    x, y = local_batch(scenario, 0)
    with fv.step():
        loss_of(root(x), y).backward()
    try:
        early.step()
    except FlatViewError as err:
        out["orig_flat_optimizer"] = f"{type(err).__name__}: {err}"
    fv.unwrap()

    root = wrap_fsdp(scenario, make_net(scenario))
    fv = flatview.wrap(root)
    root.double()
    units = [m for m in root.modules() if isinstance(m, TorchFSDP) and m._handle is not None]
    storages = {m._handle.flat_param.untyped_storage().data_ptr() for m in units}
    views = dict(fv.named_parameters())
    out["dtypes"] = sorted({str(v.dtype) for v in views.values()})
    out["alias_flats"] = all(v.untyped_storage().data_ptr() in storages for v in views.values())
    before = [m._handle.flat_param.detach().clone() for m in units]
    opt = torch.optim.SGD(views.values(), lr=0.1)
    with fv.step():
        loss_of(root(x.double()), y).backward()
    opt.step()
    out["grad_dtypes"] = sorted({str(v.grad.dtype) for v in views.values()})
    out["step_reaches_flats"] = all(
        not torch.equal(b, m._handle.flat_param) for b, m in zip(before, units, strict=True)
    )
    return out
