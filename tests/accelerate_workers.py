"""Worker functions of ``test_integrations`` for Hugging Face accelerate (see
:mod:`tests.integration_workers` for the environment and the reference). Called
through :func:`tests.integration_workers.call`, so only the workers import accelerate.

accelerate's state is a process-wide singleton: every function resets it on the way
out, so that the next task in the same worker starts from a fresh one."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import FullyShardedDataParallelPlugin

import flatview
import flatview.optim
from flatview.integrations.accelerate import prepare
from tests.integration_workers import Run, framework_env, local_batches, make_optimizers, params_of
from tests.scenarios import loss_of, make_net, skip_names


@contextlib.contextmanager
def _accelerator(**kwargs: Any) -> Iterator[Accelerator]:
    with framework_env():
        try:
            yield Accelerator(cpu=True, **kwargs)
        finally:
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()


@contextlib.contextmanager
def _deepspeed_accelerator(run: Run, stage: int, bf16: bool = False) -> Iterator[Accelerator]:
    """An ``Accelerator`` with the DeepSpeed plugin, on CPU: accelerate runs DeepSpeed
    when the launcher's environment says so and the accelerator is not told ``cpu=True``
    (which falls back to DDP). The run's clipping is DeepSpeed's ``gradient_clipping``
    (over all parameters: one optimizer)."""
    from accelerate.utils import DeepSpeedPlugin

    from flatview.testing import deepspeed_on_cpu

    with framework_env(), deepspeed_on_cpu():
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        plugin = DeepSpeedPlugin(
            zero_stage=stage,
            gradient_accumulation_steps=run.accumulate,
            gradient_clipping=run.clip or 0.0,
        )
        micro = run.scenario.batch_per_rank
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = micro
        world = dist.get_world_size()
        plugin.deepspeed_config["train_batch_size"] = micro * run.accumulate * world
        precision = "bf16" if bf16 else "no"
        try:
            yield Accelerator(
                deepspeed_plugin=plugin,
                gradient_accumulation_steps=run.accumulate,
                mixed_precision=precision,
            )
        finally:
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()


def train(
    run: Run, resume: bool = False, deepspeed_stage: int | None = None
) -> dict[str, np.ndarray] | None:
    """Train ``run`` through :func:`prepare` with ``accelerator.accumulate`` and
    ``accelerator.clip_grad_norm_``; rank 0's final parameters. ``resume``: save the
    state (``accelerator.save_state``) after the first half, train on, then load it back
    (``load_state``) and train the second half again: the end must not differ. With
    ``deepspeed_stage``, accelerate's DeepSpeed plugin at that ZeRO stage."""
    accelerating = (
        _accelerator(gradient_accumulation_steps=run.accumulate)
        if deepspeed_stage is None
        else _deepspeed_accelerator(run, deepspeed_stage)
    )
    with accelerating as accelerator:
        net = make_net(run.scenario)
        model, fv, opts = prepare(accelerator, net, lambda m: make_optimizers(m, run))
        batches = list(enumerate(local_batches(run)))
        half = len(batches) // 2
        epoch(run, accelerator, model, fv, opts, batches[:half])
        if resume:
            accelerator.save_state("state")
            epoch(run, accelerator, model, fv, opts, batches[half:])
            accelerator.load_state("state")
        epoch(run, accelerator, model, fv, opts, batches[half:])
        if deepspeed_stage is None:
            params = params_of(net)
        else:  # views are this rank's pieces of DeepSpeed's partitions
            from tests.deepspeed_workers import full_params

            params = full_params(fv, model)
    return params if dist.get_rank() == 0 else None


def epoch(
    run: Run,
    accelerator: Accelerator,
    model: Any,
    fv: flatview.FlatView,
    opts: list[Any],
    batches: list[Any],
) -> None:
    for micro, (x, y) in batches:
        skip = skip_names(run.scenario, micro)
        with accelerator.accumulate(model), fv.step(skip=skip):
            accelerator.backward(loss_of(model(x, skip), y))
            if accelerator.sync_gradients and run.clip is not None:
                for opt in opts:
                    params = [p for group in opt.param_groups for p in group["params"]]
                    accelerator.clip_grad_norm_(params, run.clip)
            for opt in opts:
                opt.step()
            for opt in opts:
                opt.zero_grad()


def refused_fsdp_on_cpu() -> str:
    """What :func:`prepare` says of an FSDP plugin accelerate turned into DDP on CPU."""
    with _accelerator(fsdp_plugin=FullyShardedDataParallelPlugin()) as accelerator:
        try:
            prepare(accelerator, make_net(Run().scenario), lambda m: make_optimizers(m, Run()))
        except flatview.WrapError as error:
            return f"{accelerator.distributed_type.value}: {error}"
    return "nothing raised"


def deepspeed_bf16_bare_and_wrapped(run: Run, stage: int) -> dict[str, Any]:
    """accelerate's DeepSpeed plugin in bf16 (``mixed_precision="bf16"``), trained bare
    (the model and its one optimizer prepared together, as accelerate users do) and
    through :func:`prepare`, in the same processes, nothing skipped (bare DeepSpeed
    cannot skip): the fp32 masters, whole, by name, of each."""
    from deepspeed.utils import safe_get_full_fp32_param

    from tests.deepspeed_workers import full_params

    out: dict[str, Any] = {}
    for wrapped in (False, True):
        with _deepspeed_accelerator(run, stage, bf16=True) as accelerator:
            net = make_net(run.scenario)
            fv = None
            if wrapped:
                model, fv, opts = prepare(accelerator, net, lambda m: make_optimizers(m, run))
            else:
                (optimizer,) = make_optimizers(net, run)
                model, optimizer = accelerator.prepare(net, optimizer)
                opts = [optimizer]
            for x, y in local_batches(run):
                step = fv.step() if fv is not None else contextlib.nullcontext()
                with accelerator.accumulate(model), step:
                    accelerator.backward(loss_of(model(x.bfloat16(), ()), y))
                    for opt in opts:
                        opt.step()
                        opt.zero_grad()
            if fv is not None:
                out["flatview"] = full_params(fv, model)
            else:
                out["bare"] = {
                    n: safe_get_full_fp32_param(p).detach().numpy().copy()
                    for n, p in model.module.named_parameters()
                }
            del model, fv, opts
    return out


def muon(accumulate: int) -> float:
    """``flatview.optim.Whole(torch.optim.Muon)`` built by :func:`prepare`'s factory of
    ``(model, fv)``, prepared by accelerate (its optimizer wrapper steps only at the end
    of each accumulation), ``mid`` skipped every other micro-batch; this rank's largest
    relative difference from ``torch.optim.Muon`` on the unwrapped net."""
    import torch

    from tests.integration_workers import (
        MUON_OPTIONS,
        MuonNet,
        muon_batch,
        muon_reference,
        skips_mid,
        worst_difference,
    )
    from tests.whole_workers import newton_schulz

    micros = 4 * accumulate
    with (
        _accelerator(gradient_accumulation_steps=accumulate) as accelerator,
        newton_schulz(float32=True),
    ):
        net = MuonNet()
        model, fv, (opt,) = prepare(
            accelerator,
            net,
            lambda m, fv: flatview.optim.Whole(
                torch.optim.Muon, fv, m.parameters(), **MUON_OPTIONS
            ),
        )
        for micro in range(micros):
            x, y = muon_batch(micro, dist.get_rank())
            skip = ["mid"] if skips_mid(micro) else []
            with accelerator.accumulate(model), fv.step(skip=skip):
                accelerator.backward(torch.nn.functional.mse_loss(model(x, skips_mid(micro)), y))
                opt.step()
                opt.zero_grad()
        mine = {n: p.detach().clone() for n, p in net.named_parameters()}
        return worst_difference(mine, muon_reference(micros, accumulate))


def fsdp1_optimizers_full_on_rank0(scenario: Any, split: int, out_dir: str) -> dict[str, Any]:
    """accelerate's own ``save_fsdp_optimizer`` / ``load_fsdp_optimizer`` (what
    ``accelerator.save_state`` / ``load_state`` and the Hugging Face ``Trainer`` call
    under the FSDP1 plugin) with ``FULL_STATE_DICT`` and the configs accelerate gives it
    (offloaded to CPU, on rank 0 alone: ``torch.save`` there, ``torch.load`` there and
    ``None`` elsewhere), on a flatview-wrapped torch FSDP1 model whose optimizers hold
    views: after ``split`` steps each optimizer is saved, training goes on (the
    uninterrupted run); a fresh model gets the weights of the save and each optimizer
    is loaded, then trains the remaining steps. The states saved and loaded (as
    ``fv.optim_state_dict`` gives them) and both runs' final parameters."""
    import types

    import torch
    from accelerate.utils.fsdp_utils import load_fsdp_optimizer, save_fsdp_optimizer
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        StateDictType,
    )

    from tests.checkpoint_workers import consolidated
    from tests.scenarios import (
        backend_context,
        distributed_model,
        distributed_training,
        full_state,
        optimizer_steps,
    )

    plugin = types.SimpleNamespace(
        fsdp_version=1,
        state_dict_type=StateDictType.FULL_STATE_DICT,
        state_dict_config=FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
        optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True),
    )
    steps = optimizer_steps(scenario)
    out: dict[str, Any] = {}
    with _accelerator() as accelerator, backend_context(scenario.backend):
        model, fv, opts = distributed_model(scenario)
        for _ in distributed_training(scenario, model, fv, opts, steps[:split]):
            pass
        out["saved"] = consolidated(fv, opts)
        weights = [p.detach().clone() for p in fv.parameters()]
        for i, opt in enumerate(opts):
            save_fsdp_optimizer(plugin, accelerator, opt, model, out_dir, optimizer_index=i)
        for _ in distributed_training(scenario, model, fv, opts, steps[split:]):
            pass
        out["uninterrupted"] = full_state(model, scenario)
        model, fv, opts = distributed_model(scenario)
        with torch.no_grad():
            for view, value in zip(fv.parameters(), weights, strict=True):
                view.copy_(value)
        for i, opt in enumerate(opts):
            load_fsdp_optimizer(plugin, accelerator, opt, model, out_dir, optimizer_index=i)
        out["loaded"] = consolidated(fv, opts)
        for _ in distributed_training(scenario, model, fv, opts, steps[split:]):
            pass
        out["resumed"] = full_state(model, scenario)
    return out


def ddp_comm_hook_bare_and_wrapped(run: Run, hook: str) -> dict[str, Any]:
    """accelerate's DDP with ``DistributedDataParallelKwargs(comm_hook=...)`` (``"NO"``,
    ``"FP16"``, ``"BF16"``: accelerate registers torch's hook as it prepares the model),
    the run's batches, nothing skipped, SGD over the model: bare (``prepare(model,
    optimizer)``) and through :func:`prepare` with flatview; rank 0's final parameters
    of each."""
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    out: dict[str, Any] = {}
    for wrapped in (False, True):
        kind = DDPCommunicationHookType[hook]
        handler = DistributedDataParallelKwargs(comm_hook=kind)
        if hook == "BF16":
            # torch's bf16 hook refuses to be registered without NCCL; accelerate's
            # registration is what is tested, so its check is lifted for the run.
            from torch.nn.parallel import DistributedDataParallel

            check = DistributedDataParallel._check_comm_hook
            DistributedDataParallel._check_comm_hook = lambda self, hook: None  # type: ignore[assignment,method-assign]
        try:
            with _accelerator(kwargs_handlers=[handler]) as accelerator:
                net = make_net(run.scenario)
                if wrapped:
                    model, fv, (opt,) = prepare(
                        accelerator, net, lambda m: [torch.optim.SGD(m.parameters(), lr=0.1)]
                    )
                else:
                    model, opt = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
                for _, (x, y) in enumerate(local_batches(run)):
                    with fv.step() if wrapped else contextlib.nullcontext():
                        accelerator.backward(loss_of(model(x), y))
                    opt.step()
                    opt.zero_grad()
                out["flatview" if wrapped else "bare"] = params_of(net)
        finally:
            if hook == "BF16":
                DistributedDataParallel._check_comm_hook = check  # type: ignore[method-assign]
    return out if dist.get_rank() == 0 else {}
