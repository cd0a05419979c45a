"""The model half of :mod:`flatview.checkpoint`: a wrapped model's state for
``torch.distributed.checkpoint``, and loading it back; what torch's own model-state
functions are routed to on a wrapped model (:mod:`flatview.checkpoint_routing`). Over
the runtime (its table, adapter and model), so that the routing, installed by the
handle, reaches it.

On DDP and FSDP2, and on torch FSDP1 in the full form, torch's own
``get_model_state_dict`` / ``set_model_state_dict`` (which communicate); fairscale's own
full ``state_dict()``; DeepSpeed's full form gathered from the views (its engine's own
``state_dict`` names everything ``module.*`` and, under ZeRO 3, holds empty parameters
between passes); the sharded form on torch FSDP1, fairscale and DeepSpeed is flatview's:
a ``ShardedTensor`` per sharded parameter built from the views, plain tensors for every
other parameter and persistent buffer, loaded by local copies (DeepSpeed's full form
too).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from flatview import optim_state, state_gather
from flatview.backends.base import is_rank0
from flatview.checkpoint_experts import expert_keys, group_view
from flatview.errors import FlatViewError
from flatview.layout import Placement
from flatview.sharded_tensors import as_full, is_sharded, sharded_value

if TYPE_CHECKING:
    from flatview.backends.base import Adapter
    from flatview.runtime import Runtime


class IncompatibleKeys(NamedTuple):
    """What :func:`flatview.checkpoint.set_state_dict` did not match in the model state
    (as ``load_state_dict``)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def offload(value: Any, cpu_offload: bool) -> Any:
    """``value`` on the CPU with ``cpu_offload``."""
    if cpu_offload and isinstance(value, torch.Tensor):
        return value.detach().to("cpu")
    return value


_TORCH_MODEL_STATE = ("ddp", "fsdp2")
"""Backends whose model keeps its own parameters under their own names (DDP's plain
tensors, FSDP2's ``DTensor`` s): torch's model state functions serve them as they are."""
_VIEWS_MODEL_STATE = ("deepspeed",)
"""Backends whose full model state flatview assembles from the views, and loads into the
views in either form."""


def model_state_dict(runtime: Runtime, info: Any) -> dict[str, Any]:
    """The model state of :func:`flatview.checkpoint.get_state_dict` (a collective;
    ``info``: the checked options), experts keyed by their group
    (:mod:`flatview.checkpoint_experts`)."""
    return expert_keys(runtime).model_out(_model_state_dict(runtime, info))


def _model_state_dict(runtime: Runtime, info: Any) -> dict[str, Any]:
    model, adapter, table = runtime.model, runtime.adapter, runtime.table
    if adapter.backend in _TORCH_MODEL_STATE or (
        info.full_state_dict and adapter.backend == "torch"
    ):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model, options=info)
    if info.full_state_dict and adapter.backend in _VIEWS_MODEL_STATE:
        return _gathered_model_state(runtime, info)
    if info.full_state_dict:
        # fairscale's default state_dict() is its full one, by original name.
        full = {k: v.detach() for k, v in model.state_dict().items()}
        if info.ignore_frozen_params:
            frozen = {p.name for p in table.params if not p.tensor.requires_grad}
            full = {k: v for k, v in full.items() if k not in frozen}
        if info.cpu_offload:
            return {k: v.to("cpu") for k, v in full.items()} if adapter.rank == 0 else {}
        return full
    out: dict[str, Any] = {}
    for param in table.params:
        if info.ignore_frozen_params and not param.tensor.requires_grad:
            continue
        home = param.placement
        value = param.tensor.detach()
        if home.layout is None:
            entry = offload(value.reshape(home.shape), info.cpu_offload)
        else:
            # An expert's pieces are its own group's.
            over = group_view(table, param.index, adapter.device) or adapter
            entry = sharded_value(home, value, value.dtype, over, info.cpu_offload)
        # Under every name, as the unwrapped model's state_dict() lists tied parameters.
        for name in param.names:
            out[name] = entry
    for name, buffer in persistent_buffers(adapter, model):
        out[name] = offload(buffer.detach(), info.cpu_offload)
    return out


def _gathered_model_state(runtime: Runtime, info: Any) -> dict[str, Any]:
    """Every parameter whole, assembled from the views (one gathering collective per
    bucket of sharded ones, as the optimizer state), by original name, and the persistent
    buffers; on rank 0 only with ``cpu_offload``."""
    model, adapter, table = runtime.model, runtime.adapter, runtime.table
    chosen = [
        p.index
        for p in table.params
        if not (info.ignore_frozen_params and not p.tensor.requires_grad)
    ]
    homes = [p.placement for p in table.params]
    sharded = [i for i in chosen if homes[i].layout is not None]
    position = {index: k for k, index in enumerate(sharded)}
    plan = {k: {"value": ("elem", table.tensor(i).dtype)} for k, i in enumerate(sharded)}
    states = {k: {"value": table.tensor(i).detach()} for k, i in enumerate(sharded)}
    rank0_only = bool(info.cpu_offload)
    gathered = state_gather.gather(
        plan, states, sharded, homes, adapter.group, adapter.world_size, adapter.device, rank0_only
    )
    if rank0_only and not is_rank0(adapter):
        return {}
    out: dict[str, Any] = {}
    for index in chosen:
        param = table.params[index]
        if homes[index].layout is None:
            value = param.tensor.detach().reshape(homes[index].shape).clone()
        else:
            value = gathered[(position[index], "value")]
        for name in param.names:
            out[name] = offload(value, info.cpu_offload)
    for name, buffer in persistent_buffers(adapter, model):
        out[name] = offload(buffer.detach(), info.cpu_offload)
    return out


def persistent_buffers(adapter: Adapter, model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every persistent buffer of the model once, under its wrapper-free name."""
    found = []
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for attr, buffer in module._buffers.items():
            if buffer is None or attr in module._non_persistent_buffers_set:
                continue
            if id(buffer) in seen:
                continue
            seen.add(id(buffer))
            prefix = adapter.clean_name(module_name)
            found.append((f"{prefix}.{attr}" if prefix else attr, buffer))
    return found


def torch_loads_model(runtime: Runtime, state_dict: Mapping[str, Any]) -> bool:
    """Whether torch's ``set_model_state_dict`` loads the model (collectives of its own),
    rather than flatview (local copies)."""
    sharded = any(is_sharded(v) for v in state_dict.values())
    backend = runtime.adapter.backend
    return backend in _TORCH_MODEL_STATE or (not sharded and backend == "torch")


def load_model_state_dict(
    runtime: Runtime, state_dict: Mapping[str, Any], info: Any
) -> IncompatibleKeys:
    """Load the model half of :func:`flatview.checkpoint.set_state_dict`."""
    model, adapter, table = runtime.model, runtime.adapter, runtime.table
    state_dict = expert_keys(runtime).model_in(state_dict)
    sharded = any(is_sharded(v) for v in state_dict.values())
    if torch_loads_model(runtime, state_dict):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        result = set_model_state_dict(model, dict(state_dict), options=info)
        return IncompatibleKeys(list(result.missing_keys), list(result.unexpected_keys))
    if not sharded and adapter.backend not in _VIEWS_MODEL_STATE:
        result = model.load_state_dict(dict(state_dict), strict=info.strict)
        return IncompatibleKeys(list(result.missing_keys), list(result.unexpected_keys))
    expected: dict[str, torch.Tensor] = {}
    homes: dict[str, Placement] = {}
    for param in table.params:
        if info.ignore_frozen_params and not param.tensor.requires_grad:
            continue
        for name in param.names:
            expected[name] = param.tensor
            homes[name] = param.placement
    for name, buffer in persistent_buffers(adapter, model):
        expected[name] = buffer
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    if info.strict and (missing or unexpected):
        raise FlatViewError(
            f"the model state dict does not fit the model: missing {missing}, "
            f"unexpected {unexpected}"
        )
    with torch.no_grad():
        for name, target in expected.items():
            if name not in state_dict:
                continue
            home = homes.get(name)
            value = state_dict[name]
            if home is None or home.layout is None:
                source = as_full(value)
                target.copy_(source.reshape(target.shape))
            else:
                target.copy_(optim_state.local_part(home, value, target).view(target.shape))
    return IncompatibleKeys(missing, unexpected)
