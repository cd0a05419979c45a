"""Worker functions of ``test_inside_forward``: steps and backwards inside the wrapped
model's forward, the way Lightning's Trainer runs manual optimization (its
``training_step`` runs inside the wrapper's forward, and the user's
``with fv.step(...): loss = self(x); self.manual_backward(loss)`` runs the inner
module's forward and backward there)."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from tests.scenarios import (
    Net,
    Scenario,
    backend_context,
    local_batch,
    loss_of,
    make_net,
    optimizers,
    skip_names,
    wrap_fsdp,
    zero_grads,
)

VARIANTS = ("step_inside", "lightning", "step_outside", "no_step", "two_per_forward", "returns")
"""How the training step meets the wrapper's forward (see :func:`train_inside`)."""
MISUSES = ("skipped_used", "skipped_first")
"""Skipped parameters used inside the forward (see :func:`train_inside`)."""


class Step(nn.Module):
    """What the wrapper wraps: the training step runs inside its forward, around the
    user's model ``net`` (Lightning's wrapper module around the LightningModule)."""

    def __init__(self, net: Net) -> None:
        super().__init__()
        self.net = net
        self.run: Any = None

    @property
    def body(self) -> nn.Sequential:
        # wrap_fsdp nests the blocks it finds here.
        return self.net.body

    def forward(self, *args: Any) -> Any:
        return self.run(*args)


def _prepare_like_lightning(model: Any) -> None:
    """What Lightning's DDP strategy does before a manual backward
    (``lightning.pytorch.overrides.distributed.prepare_for_backward``)."""
    if torch.is_grad_enabled() and model.require_backward_grad_sync:
        model.require_forward_param_sync = True
        model.reducer._rebuild_buckets()
        model.reducer.prepare_for_backward([])
    else:
        model.require_forward_param_sync = False


def full_state_of(model: nn.Module, scenario: Scenario) -> dict[str, np.ndarray] | None:
    """The unsharded parameters by the inner net's names, on rank 0 (collective)."""
    if scenario.backend == "torch":
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

        config = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
        with TorchFSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            state = model.state_dict()
    elif scenario.backend == "ddp":
        state = model.module.state_dict()  # type: ignore[operator]
    elif scenario.backend == "fsdp2":
        state = {k: v.full_tensor() for k, v in model.state_dict().items()}
    else:
        state = model.state_dict()
    if dist.get_rank() != 0:
        return None
    names = {k for k, _ in make_net(scenario).named_parameters()}
    state = {k.removeprefix("net."): v for k, v in state.items()}
    return {k: v.detach().float().numpy().copy() for k, v in state.items() if k in names}


def _model(scenario: Scenario, bare_root: bool = False) -> tuple[Step, nn.Module]:
    """The scenario's net inside :class:`Step`, wrapped; ``bare_root``: every parameter
    in a nested unit (the root unit holds none)."""
    outer = Step(make_net(scenario))
    if bare_root:
        from tests.scenarios import _torch_kwargs

        if scenario.backend == "torch":
            from torch.distributed.fsdp import FullyShardedDataParallel as Wrapper

            kwargs = _torch_kwargs(scenario)
        else:
            from fairscale.nn.data_parallel import FullyShardedDataParallel as Wrapper

            kwargs = {"flatten_parameters": True}
        for name in ("stem", "head"):
            setattr(outer.net, name, Wrapper(getattr(outer.net, name), **kwargs))
    return outer, wrap_fsdp(scenario, outer)


def _inner(model: nn.Module) -> Net:
    tree: Any = getattr(model, "module", model)
    tree = getattr(tree, "module", tree)
    return tree.net  # type: ignore[no-any-return]


def train_inside(scenario: Scenario, variant: str) -> dict[str, Any]:
    """Every optimizer step of ``scenario`` (one micro-batch each) inside a call of the
    wrapped model whose forward zeroes the gradients, runs the inner net's forward and
    backward and steps the optimizers (Lightning's manual optimization). ``variant``:

    * ``"step_inside"``: ``fv.step`` entered inside the forward, around the inner
      forward and backward;
    * ``"lightning"``: the same, and on DDP what Lightning does around it
      (``prepare_for_backward`` before the backward, ``require_backward_grad_sync``
      cleared after the inner forward and set after the outer);
    * ``"step_outside"``: ``fv.step`` entered before calling the wrapped model;
    * ``"no_step"``: no step (a scenario that skips nothing);
    * ``"two_per_forward"``: two steps inside each forward (two optimizers' steps in one
      ``training_step``), each its own micro-batch;
    * ``"returns"``: as ``"step_inside"``, the forward returning the loss with its graph;
    * ``"skipped_used"``: as ``"step_inside"``, the net running what the step skips;
    * ``"skipped_first"``: as ``"step_inside"``, then inside the same step a second
      backward whose first gradient is a skipped parameter's (``body.1.up.weight``).
    * a variant ending in ``"+bare"``: every parameter in a nested unit (FSDP1 only).

    Errors of flatview's are caught (the gradients zeroed) and reported; training goes
    on with the next micro-batch."""
    import flatview

    assert scenario.accumulate == 1
    bare_root = variant.endswith("+bare")
    variant = variant.removesuffix("+bare")
    lightning = variant == "lightning" and scenario.backend == "ddp"
    with backend_context(scenario.backend):
        outer, model = _model(scenario, bare_root)
        fv = flatview.wrap(model, check_skip_agreement=scenario.check, **scenario.flatview_options)
        net = _inner(model)
        opts = optimizers(net)
        errors: list[str] = []

        def declared(micro: int) -> Any:
            skip = [f"net.{s}" for s in skip_names(scenario, micro)]
            return fv.step(skip=skip) if variant != "no_step" else contextlib.nullcontext()

        def one(micro: int, inside: bool) -> torch.Tensor:
            xs, ys = local_batch(scenario, micro)
            runs = () if variant == "skipped_used" else skip_names(scenario, micro)
            with declared(micro) if inside else contextlib.nullcontext():
                loss = loss_of(net(xs, runs), ys)
                if lightning:
                    _prepare_like_lightning(model)
                loss.backward()
                if variant == "skipped_first":
                    (net.body[1].up.weight ** 2).sum().backward()
            for opt in opts:
                opt.step()
            zero_grads(scenario, opts)
            return loss

        def run(micros: list[int]) -> Any:
            inside = variant != "step_outside"
            losses = [one(micro, inside) for micro in micros]
            if lightning:
                model.require_backward_grad_sync = False  # type: ignore[assignment]
            return losses[-1] if variant == "returns" else None

        outer.run = run
        per_forward = 2 if variant == "two_per_forward" else 1
        count = len(scenario.skips)
        for first in range(0, count, per_forward):
            micros = list(range(first, min(first + per_forward, count)))
            outside = declared(micros[0]) if variant == "step_outside" else None
            try:
                with outside or contextlib.nullcontext():
                    model(micros)
            except Exception as err:
                errors.append(f"{type(err).__name__}: {err}")
                zero_grads(scenario, opts)
            if lightning:
                model.require_backward_grad_sync = True  # type: ignore[assignment]
        if errors:
            # Refused: the wrapped model then trains every micro-batch the usual way
            # (steps entered before its forward, backwards after it), exactly.
            for opt in opts:
                opt.zero_grad(set_to_none=True)
            outer.run = net
            for micro in range(count):
                xs, ys = local_batch(scenario, micro)
                skip = skip_names(scenario, micro)
                with declared(micro):
                    loss_of(model(xs, skip), ys).backward()
                for opt in opts:
                    opt.step()
                zero_grads(scenario, opts)
        return {"errors": errors, "params": full_state_of(model, scenario), "phase": fv.phase.name}


def train_inside_all(cases: list[tuple[Scenario, str]]) -> list[dict[str, Any]]:
    """:func:`train_inside` of each ``(scenario, variant)``, one after another in one task."""
    return [train_inside(scenario, variant) for scenario, variant in cases]
