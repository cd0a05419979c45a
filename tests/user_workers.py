"""Worker tasks of ``tests/test_user_api.py``: what users of real training scripts call on
a wrapped model, each compared with the unwrapped model trained alike in one process.

Every task trains a :class:`~tests.scenarios.Scenario` twice, in lockstep: on this rank,
wrapped (FSDP + flatview), and in this process, unwrapped (the reference, on the whole
batch), so that checks in the middle of training compare with the reference at the
same point. Rank 0 returns the final full parameters for :func:`~tests.scenarios.compare`.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.utils import parametrize

import flatview
from flatview import optim as fv_optim
from flatview.testing.counting import CollectiveCounter
from tests.scenarios import (
    Scenario,
    _original_tree,
    backend_context,
    batch,
    distributed_model,
    full_state,
    local_batch,
    loss_of,
    make_net,
    optimizer_steps,
    reference_backward,
    reference_model,
    skip_names,
    synced_backward,
)

# ------------------------------------------------------------------------ helpers


def timm_param_groups(
    named: Iterable[tuple[str, nn.Parameter]], weight_decay: float
) -> list[dict[str, Any]]:
    """timm's ``param_groups_weight_decay`` rule (``timm.optim``), as a plain function: no
    decay for ``p.ndim <= 1`` and ``.bias``; frozen parameters left out. timm itself does
    not import beside this torch (it imports torchvision)."""
    decay, no_decay = [], []
    for name, param in named:
        if not param.requires_grad:
            continue
        if param.ndim <= 1 or name.endswith(".bias"):
            no_decay.append(param)
        else:
            decay.append(param)
    return [
        {"params": no_decay, "weight_decay": 0.0},
        {"params": decay, "weight_decay": weight_decay},
    ]


@contextlib.contextmanager
def summoned(model: nn.Module, scenario: Scenario, recurse: bool = True) -> Iterator[None]:
    """The wrapper's ``summon_full_params`` (torch's static method, fairscale's method)."""
    if scenario.backend == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

        with TorchFSDP.summon_full_params(model, recurse=recurse):
            yield
    else:
        with model.summon_full_params(recurse=recurse):
            yield


def final_params(model: nn.Module, scenario: Scenario) -> dict[str, np.ndarray] | None:
    return full_state(model, scenario)


def reference_params(net: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in net.named_parameters()}


# ------------------------------------------------------------- summon_full_params


def summon_forward_task(scenario: Scenario) -> dict[str, Any]:
    """Forwards inside ``summon_full_params`` between a backward and its optimizer step:
    the user's module (``model.module``) under ``no_grad``, and the FSDP root with
    autograd on and no backward; each equals the unwrapped model's output at that point.
    A backward of such a forward is refused. Training goes on exactly."""
    out: dict[str, Any] = {"errors": []}
    with backend_context(scenario.backend):
        model, fv, opts = distributed_model(scenario)
        net, ref_opts = reference_model(scenario)
        rank = torch.distributed.get_rank()
        for step, micros in enumerate(optimizer_steps(scenario)):
            synced_backward(scenario, model, fv, micros)
            reference_backward(scenario, net, micros)
            x = local_batch(scenario, 30_000 + step)[0]
            with torch.no_grad():
                want = net(x)
            with summoned(model, scenario):
                with torch.no_grad():
                    inner = _original_tree(model)(x)
                outer = model(x)
                try:
                    model(x).sum().backward()
                except flatview.StateError as error:
                    out["errors"].append(str(error))
            if step == 1:
                # Only the root summoned: its nested units' forwards are refused.
                try:
                    with summoned(model, scenario, recurse=False), torch.no_grad():
                        model(x)
                except flatview.StateError as error:
                    out["not_summoned"] = str(error)
            torch.testing.assert_close(inner, want, msg=f"rank {rank} step {step}: module")
            torch.testing.assert_close(outer.detach(), want, msg=f"rank {rank} step {step}: root")
            for opt in [*opts, *ref_opts]:
                opt.step()
                opt.zero_grad(set_to_none=scenario.set_to_none)
        out["params"] = final_params(model, scenario)
        out["reference"] = reference_params(net)
    return out


# -------------------------------------------------------------- parameter groups


def groups_task(scenario: Scenario) -> dict[str, Any]:
    """Whole-parameter facts (``shape_of``, ``numel``, ``repr``), timm's ``ndim`` rule on
    views (warned at the first step, refused by ``check_param_groups``) and the same rule
    by original shape (``flatview.optim.param_groups``), trained against timm's rule on
    the unwrapped model."""
    out: dict[str, Any] = {}
    with backend_context(scenario.backend):
        model, fv, _ = distributed_model(scenario)
        net, _ = reference_model(scenario)
        shapes = dict(net.named_parameters())
        out["shapes"] = all(fv.shape_of(p) == shapes[n].shape for n, p in fv.named_parameters())
        out["shapes_by_name"] = all(fv.shape_of(n) == shapes[n].shape for n in shapes)
        out["numel"] = (fv.numel(), sum(p.numel() for p in net.parameters()))
        out["numel_one"] = (fv.numel("head.weight"), shapes["head.weight"].numel())
        out["trainable"] = fv.numel(trainable=True)
        out["repr"] = repr(fv)
        try:
            fv.shape_of(torch.zeros(2))
        except flatview.ParameterError as error:
            out["unknown"] = str(error)
        # Matrices of which this rank holds a 1-D piece.
        out["pieces"] = [
            n
            for n, p in fv.named_parameters()
            if p.numel() and len(fv.shape_of(p)) > 1 and p.shape != fv.shape_of(p)
        ]

        # timm's rule on views: warned at the first step (on ranks that hold a piece of a
        # matrix), and the exact check refuses it on every rank.
        timm = torch.optim.AdamW(timm_param_groups(fv.named_parameters(), 0.1), lr=0.05)
        xs, ys = local_batch(scenario, 0)
        loss_of(model(xs), ys).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            timm.step()
            timm.step()
        out["timm_warnings"] = [str(w.message) for w in caught if "shape_of" in str(w.message)]
        try:
            fv.check_param_groups(timm)
        except flatview.ParamGroupError as error:
            out["timm_check"] = str(error)
        # The helper exempting exactly the matrices cut here, by name: intended, no warning.
        by_name = torch.optim.AdamW(
            fv_optim.param_groups(fv, weight_decay=0.1, no_decay=out["pieces"]), lr=0.05
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            by_name.step()
        out["by_name_warnings"] = [str(w.message) for w in caught if "shape_of" in str(w.message)]
        timm.zero_grad()

    # The fix, trained from the start against timm's rule on the unwrapped model.
    with backend_context(scenario.backend):
        model, fv, _ = distributed_model(scenario)
        net, _ = reference_model(scenario)
        groups = fv_optim.param_groups(fv, weight_decay=0.1, lr=0.05)
        opt = torch.optim.AdamW(groups, lr=0.05)
        ref = torch.optim.AdamW(timm_param_groups(net.named_parameters(), 0.1), lr=0.05)
        out["groups"] = [sorted(fv_name(fv, g["params"])) for g in groups]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step, micros in enumerate(optimizer_steps(scenario)):
                synced_backward(scenario, model, fv, micros)
                reference_backward(scenario, net, micros)
                opt.step()
                ref.step()
                opt.zero_grad()
                ref.zero_grad()
                if step == 0:
                    fv.check_param_groups(opt)
        out["fixed_warnings"] = [str(w.message) for w in caught if "shape_of" in str(w.message)]
        out["params"] = final_params(model, scenario)
        out["reference"] = reference_params(net)
    return out


def fv_name(fv: flatview.FlatView, params: Iterable[torch.Tensor]) -> list[str]:
    names = {id(p): n for n, p in fv.named_parameters()}
    return [names[id(p)] for p in params]


# ---------------------------------------------------------------------- clipping

CLIPS: tuple[tuple[float, float, str | None], ...] = (
    (0.05, 2.0, None),
    (0.02, math.inf, "body"),
    (0.05, 1.5, None),
)
"""Per optimizer step: ``(max_norm, norm_type, params)``; ``"body"`` for the blocks'
parameters only."""


def clip_task(scenario: Scenario) -> dict[str, Any]:
    """``fv.clip_grad_norm_`` against ``torch.nn.utils.clip_grad_norm_`` on the unwrapped
    model, every step, on all parameters and on a subset: the same total norms (one
    all-reduce each), and the same training."""
    out: dict[str, Any] = {"totals": [], "reference_totals": [], "all_reduces": []}
    with backend_context(scenario.backend):
        model, fv, opts = distributed_model(scenario)
        net, ref_opts = reference_model(scenario)
        tree = _original_tree(model)
        for step, micros in enumerate(optimizer_steps(scenario)):
            max_norm, norm_type, which = CLIPS[step % len(CLIPS)]
            synced_backward(scenario, model, fv, micros)
            reference_backward(scenario, net, micros)
            params = list(tree.body.parameters()) if which == "body" else None
            with CollectiveCounter() as counter:
                total = fv.clip_grad_norm_(max_norm, norm_type, params)
            out["all_reduces"].append(dict(counter.calls))
            ref_params = net.body.parameters() if which == "body" else net.parameters()
            want = torch.nn.utils.clip_grad_norm_(ref_params, max_norm, norm_type)
            out["totals"].append(float(total))
            out["reference_totals"].append(float(want))
            for opt in [*opts, *ref_opts]:
                opt.step()
                opt.zero_grad(set_to_none=scenario.set_to_none)
        for bad in ("big", math.nan):
            try:
                fv.clip_grad_norm_(bad)  # type: ignore[arg-type]
            except flatview.NormError as error:
                out.setdefault("bad", []).append(str(error))
        out["params"] = final_params(model, scenario)
        out["reference"] = reference_params(net)
    return out


# --------------------------------------------------------------- parametrizations


class Double(nn.Module):
    """A parametrization that works on any shape (weight_norm fails on empty views)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x


def parametrization_task(scenario: Scenario) -> dict[str, Any]:
    """A parametrization registered on views after wrapping is refused at the next
    forward, on every rank, naming the module and the fix; one registered before FSDP
    (on a module whose other parameters become views) trains as on the unwrapped model."""
    out: dict[str, Any] = {}
    with backend_context(scenario.backend):
        # Before wrapping: weight_norm on the head; its bias stays a view of the head.
        net = make_net(scenario)
        nn.utils.parametrizations.weight_norm(net.head)
        model, fv, _ = distributed_model(scenario, net)
        ref = make_net(scenario)
        nn.utils.parametrizations.weight_norm(ref.head)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        opt = torch.optim.SGD(fv.parameters(), lr=0.1)
        for micros in optimizer_steps(scenario):
            for micro in micros:
                xs, ys = local_batch(scenario, micro)
                loss_of(model(xs), ys).backward()
                x, y = batch(scenario, micro)
                loss_of(ref(x), y).backward()
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
        out["params"] = _by_original_name(full_state_any(model, scenario))
        out["reference"] = _by_original_name(reference_params(ref))

        # After wrapping: refused at the next forward.
        tree = _original_tree(model)
        parametrize.register_parametrization(tree.stem, "weight", Double())
        try:
            model(local_batch(scenario, 0)[0])
        except flatview.WrapError as error:
            out["error"] = str(error)
    return out


def full_state_any(model: nn.Module, scenario: Scenario) -> dict[str, np.ndarray] | None:
    """Every floating tensor of the full state dict (on rank 0), whatever its names."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    if scenario.backend == "torch":
        config = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
        with TorchFSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            state = model.state_dict()
    else:
        state = model.state_dict()
    if torch.distributed.get_rank() != 0:
        return None
    return {k: v.detach().float().numpy().copy() for k, v in state.items()}


def _by_original_name(state: dict[str, np.ndarray] | None) -> dict[str, np.ndarray] | None:
    """The head's entries (weight-normed), under names without wrapper levels."""
    if state is None:
        return None
    wrappers = ("_fsdp_wrapped_module.", "_fpw_module.")
    out = {}
    for key, value in state.items():
        for wrapper in wrappers:
            key = key.replace(wrapper, "")
        if key.startswith("head."):
            out[key] = value
    return out


def contrastive_task(scenario: Scenario) -> dict[str, Any]:
    """Two forwards of the root, then one backward through the sum of their losses (the
    contrastive pattern: two views of each sample through one model), per step inside
    one ``fv.step``; rank 0's final parameters and the unwrapped model's, trained alike
    in this process."""

    def losses(model: nn.Module, x: torch.Tensor, y: torch.Tensor, skip: Any) -> torch.Tensor:
        return loss_of(model(x, skip), y) + 0.5 * loss_of(model(x * 0.5, skip), y)

    with backend_context(scenario.backend):
        model, fv, opts = distributed_model(scenario)
        for micro in range(len(scenario.skips)):
            x, y = local_batch(scenario, micro)
            skip = skip_names(scenario, micro)
            with fv.step(skip=list(skip)):
                losses(model, x, y, skip).backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()
        params = full_state(model, scenario)
    net, ref_opts = reference_model(scenario)
    for micro in range(len(scenario.skips)):
        x, y = batch(scenario, micro)
        losses(net, x, y, skip_names(scenario, micro)).backward()
        for opt in ref_opts:
            opt.step()
            opt.zero_grad()
    return {"params": params, "reference": reference_params(net)}
