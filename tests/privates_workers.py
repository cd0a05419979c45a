"""Worker functions for tests/test_backend_privates.py: a wrapper internal that an
adapter touches is taken away (as a wrapper version that renamed it would), and
``flatview.wrap`` must refuse the model, naming it, before patching anything.

Each returns plain data for the test process to assert on.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

import flatview
from flatview.errors import WrapError
from tests.scenarios import FAIRSCALE, Scenario, backend_context, make_net, wrap_fsdp


@contextlib.contextmanager
def _without(obj: Any, name: str) -> Iterator[None]:
    """``obj`` without its attribute ``name`` (found on the object itself, or on the class
    that defines it) for the length of the block."""
    owner = obj
    if name not in vars(obj):
        owner = next(k for k in type(obj).__mro__ if name in vars(k))
    value = vars(owner)[name]
    delattr(owner, name)
    try:
        yield
    finally:
        setattr(owner, name, value)


def _refusal(model: nn.Module, obj: Any, name: str) -> dict[str, Any]:
    """What wrapping ``model`` with ``obj.name`` gone raises, and whether it patched
    anything (an instance-level forward on the model) or still wraps afterwards."""
    with _without(obj, name):
        try:
            flatview.wrap(model)
        except WrapError as err:
            message = str(err)
        else:
            message = "no error"
        patched = "forward" in vars(model)
    fv = flatview.wrap(model)
    wraps = bool(dict(fv.named_parameters()))
    fv.unwrap()
    return {"message": message, "patched": patched, "wraps": wraps}


def torch_fsdp_task() -> dict[str, dict[str, Any]]:
    """torch FSDP1: the runtime functions called for units without a backward, the
    execution-order record's prefetch choices (replaced), and a handle attribute the
    refusal of a pending backward reads."""
    from torch.distributed.fsdp import _runtime_utils

    scenario = Scenario(backend="torch", strategy="FULL_SHARD")
    out = {}
    for label in ("_post_backward_hook", "_reshard", "prefetch", "handle"):
        model = wrap_fsdp(scenario, make_net(scenario))
        model.check_is_root()  # type: ignore[operator]
        target: Any = _runtime_utils
        name = label
        if label == "prefetch":
            target, name = model._exec_order_data, "get_handle_to_forward_prefetch"
        elif label == "handle":
            target, name = model._handle, "_needs_pre_backward_unshard"
        out[label] = {"name": name, **_refusal(model, target, name)}
    return out


def fairscale_task() -> dict[str, dict[str, Any]]:
    """fairscale: a method the adapter replaces (the masked gather), one it calls for
    units without a backward, and an attribute the refusal of a pending backward reads."""
    scenario = FAIRSCALE.scenario(Scenario())
    out = {}
    with backend_context("fairscale"):
        for name in ("_rebuild_full_params", "_post_backward_hook"):
            model = wrap_fsdp(scenario, make_net(scenario))
            out[name] = {"name": name, **_refusal(model, model, name)}
        model = wrap_fsdp(scenario, make_net(scenario))
        fsdp_module = sys.modules[type(model).__module__]
        out["dist"] = {"name": "dist", **_refusal(model, fsdp_module, "dist")}
        model = wrap_fsdp(scenario, make_net(scenario))
        name = "_output_pre_backward_hook_registered"
        out["pending"] = {"name": name, **_refusal(model, model, name)}
    return out


def ddp_task() -> dict[str, dict[str, Any]]:
    """DDP: attributes the adapter's refusals read (they would pass silently if
    missing)."""
    from torch.nn.parallel import DistributedDataParallel

    out = {}
    for name in ("_use_python_reducer", "_comm_hooks", "static_graph"):
        model = DistributedDataParallel(make_net(Scenario()))
        out[name] = {"name": name, **_refusal(model, model, name)}
    return out


def autograd_task() -> dict[str, Any]:
    """The autograd internal every adapter relies on."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(make_net(Scenario()))
    return {"name": "_current_graph_task_id", **_refusal(model, torch._C, "_current_graph_task_id")}
