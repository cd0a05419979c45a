"""Worker functions of ``test_integrations`` for the Lightning Trainer and Fabric (see
:mod:`tests.integration_workers` for the environment and the reference). Called
through :func:`tests.integration_workers.call`, so only the workers import Lightning."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy as FabricDDP
from lightning.fabric.strategies import DeepSpeedStrategy as FabricDeepSpeed
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallel
from torch import nn
from torch.utils.data import DataLoader

import flatview
from flatview.integrations.lightning import FlatViewCallback, FlatViewFSDPStrategy, flatview_of
from flatview.testing import deepspeed_on_cpu
from tests import moe_workers as mw
from tests.deepspeed_workers import full_params
from tests.integration_workers import (
    MUON_OPTIONS,
    MuonNet,
    Run,
    framework_env,
    local_batches,
    make_optimizers,
    muon_batch,
    muon_reference,
    names,
    params_of,
    skips_mid,
    without_prefix,
    worst_difference,
)
from tests.scenarios import Block, local_batch, loss_of, make_net, skip_names

PREFIX = "net."
"""Where the LightningModule keeps the scenario's net: skip names are relative to it."""


class Lit(pl.LightningModule):
    """The scenario's net as a LightningModule. Its data loader yields batch numbers
    within the epoch; ``training_step`` trains on this rank's chunk of batch
    ``epoch * per_epoch + batch_idx`` and skips what the scenario's batch skips.

    ``user_steps``: manual optimization with ``with fv.step(...)`` written in
    ``training_step`` around the forward and ``manual_backward``; ``fv`` comes from
    ``flatview_of`` (``"callback"``) or from ``flatview.wrap(self)`` at ``on_fit_start``
    (``"own_wrap"``, no callback)."""

    def __init__(self, run: Run, user_steps: str = "") -> None:
        super().__init__()
        self.run = run
        self.net = make_net(run.scenario)
        self.automatic_optimization = not run.manual
        self.user_steps = user_steps
        self.fv: flatview.FlatView | None = None

    def forward(self, x: torch.Tensor, skip: tuple[str, ...] = ()) -> torch.Tensor:
        out: torch.Tensor = self.net(x, skip)
        return out

    def micro(self, batch_idx: int) -> int:
        return self.current_epoch * self.run.per_epoch + batch_idx

    def skipped(self, batch: Any, batch_idx: int) -> list[str]:
        """The batch's skip set, relative to this module (what FlatViewCallback takes)."""
        return names(skip_names(self.run.scenario, self.micro(batch_idx)), PREFIX)

    def on_fit_start(self) -> None:
        if self.user_steps == "own_wrap":
            self.fv = flatview.wrap(self)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        micro = self.micro(batch_idx)
        x, y = local_batch(self.run.scenario, micro)
        x = x.to(self.net.stem.weight.dtype)  # bf16 under DeepSpeed's bf16
        skip = skip_names(self.run.scenario, micro)
        if not self.run.manual:
            return loss_of(self(x, skip), y)
        opts = self.optimizers()
        opts = opts if isinstance(opts, list) else [opts]
        for opt in opts:
            opt.zero_grad()
        if self.user_steps:
            fv = self.fv if self.fv is not None else flatview_of(self.trainer)
            with fv.step(skip=self.skipped(batch, batch_idx)):
                self.manual_backward(loss_of(self(x, skip), y))
        else:
            self.manual_backward(loss_of(self(x, skip), y))
        if self.run.clip is not None:
            for opt in opts:
                self.clip_gradients(opt, self.run.clip, gradient_clip_algorithm="norm")
        for opt in opts:
            opt.step()
        return None

    def configure_optimizers(self) -> Any:
        return make_optimizers(self.net, self.run)

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        # Lightning calls it under no_grad or inference_mode, outside any step, between
        # training batches (run.validate), and twice before the first (its sanity check).
        x, y = local_batch(self.run.scenario, 1_000 + batch_idx)
        loss = loss_of(self(x.to(self.net.stem.weight.dtype)), y)
        self.log("val_loss", loss, sync_dist=True, batch_size=len(x))
        return loss


class ShardedLit(Lit):
    """:class:`Lit` for ``ModelParallelStrategy``: FSDP2 on every block and the net
    (Lightning's idiom: the LightningModule itself stays unsharded)."""

    def configure_model(self) -> None:
        _fully_shard(self.net, self.device_mesh)


class CPUFlatViewFSDP(FlatViewFSDPStrategy):
    """FlatViewFSDPStrategy on CPU for tests: Lightning builds FSDP without a device
    there, which torch refuses, so the test builds it with one (flat parameters, a
    unit per block); the rest is the strategy under test."""

    def _setup_model(self, model: nn.Module) -> nn.Module:
        from lightning.fabric.strategies.fsdp import _setup_activation_checkpointing
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FSDP(
            model,
            device_id=torch.device("cpu"),
            use_orig_params=self.kwargs["use_orig_params"],
            auto_wrap_policy=ModuleWrapPolicy({Block}),
        )
        # As Lightning's own _setup_model ends (activation_checkpointing_policy).
        _setup_activation_checkpointing(model, self._activation_checkpointing_kwargs)
        return model


class CPUFlatViewFSDPFull(CPUFlatViewFSDP):
    """:class:`CPUFlatViewFSDP` with ``state_dict_type="full"``: Lightning's full state
    dict context offloads to CPU, which torch FSDP1 cannot do for a model on CPU (it
    fails in torch, with or without flatview), so the test's context does not offload;
    the rest is Lightning's full-form checkpointing as it runs on GPUs (the model on
    rank 0 alone, the optimizers through ``FSDP.optim_state_dict`` with ``rank0_only``,
    every rank loading the full dicts)."""

    def __init__(self) -> None:
        super().__init__(use_orig_params=False, state_dict_type="full")

    def lightning_module_state_dict(self) -> Any:
        with _not_offloading():
            return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: Any) -> Any:
        with _not_offloading():
            return super().optimizer_state(optimizer)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        with _not_offloading():
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)


@contextlib.contextmanager
def _not_offloading() -> Iterator[None]:
    from lightning.pytorch.strategies import fsdp as module
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    def context(model: nn.Module, world_size: int, rank0_only: bool = True) -> Any:
        del world_size
        return FSDP.state_dict_type(
            module=model,
            state_dict_type=StateDictType.FULL_STATE_DICT,
            state_dict_config=FullStateDictConfig(rank0_only=rank0_only),
            optim_state_dict_config=FullOptimStateDictConfig(rank0_only=rank0_only),
        )

    original = module._get_full_state_dict_context
    module._get_full_state_dict_context = context  # type: ignore[assignment]
    try:
        yield
    finally:
        module._get_full_state_dict_context = original


class CPUDeepSpeed(pl.strategies.DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy on CPU for tests, under
    :func:`flatview.testing.deepspeed_on_cpu` (Lightning refuses every accelerator but
    CUDA): DDP's environment setup without that check, no check of device indices, and
    the local rank as the device index (DeepSpeed's engine takes one). The rest is the
    strategy as users run it, ``trainer.save_checkpoint`` and ``ckpt_path`` included."""

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu", self.local_rank)

    def setup_environment(self) -> None:
        pl.strategies.DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()


def strategy_of(name: str) -> Any:
    """The Lightning strategy the tests call ``name`` (on CPU where Lightning would not
    run it: :class:`CPUDeepSpeed`, ``CPUFlatViewFSDP``)."""
    if name.startswith("deepspeed"):
        return CPUDeepSpeed(stage=int(name.removeprefix("deepspeed")), logging_batch_size_per_gpu=1)
    if name == "fsdp2":
        return pl.strategies.ModelParallelStrategy(
            data_parallel_size=dist.get_world_size(), tensor_parallel_size=1
        )
    if name == "fsdp1_cpu":
        return CPUFlatViewFSDP(use_orig_params=False)
    if name == "fsdp1_cpu_recompute":
        # Blocks checkpointed by torch's apply_activation_checkpointing: skip sets name
        # modules below its CheckpointWrapper.
        return CPUFlatViewFSDP(use_orig_params=False, activation_checkpointing_policy={Block})
    if name == "fsdp1_cpu_checkpoint":
        # Lightning's full state dict offloads to CPU, which torch cannot do from CPU.
        return CPUFlatViewFSDP(use_orig_params=False, state_dict_type="sharded")
    if name == "fsdp1_cpu_checkpoint_orig":
        return CPUFlatViewFSDP(use_orig_params=True, state_dict_type="sharded")
    if name == "fsdp1_cpu_checkpoint_full":
        return CPUFlatViewFSDPFull()
    if name == "fsdp1":
        return FlatViewFSDPStrategy(use_orig_params=False)
    return name


def _trainer(
    run: Run, strategy: str, tmp: str, callbacks: list[Any], epochs: int, precision: str = "32"
) -> Any:
    clip = None if run.manual else run.clip
    return quiet_trainer(
        strategy_of(strategy),
        tmp,
        callbacks,
        epochs,
        run.accumulate,
        clip,
        precision,
        validate=run.validate,
    )


def quiet_trainer(
    strategy: Any,
    tmp: str,
    callbacks: list[Any],
    epochs: int,
    accumulate: int = 1,
    clip: float | None = None,
    precision: str = "32",
    *,
    validate: bool = False,
) -> Any:
    """A Lightning Trainer on this pool's ranks (CPU), writing and printing nothing, the
    data loaders' own order kept; ``validate``: validating after every training batch,
    and before training as Lightning's sanity check does by default."""
    return pl.Trainer(
        precision=precision,  # type: ignore[arg-type]
        accelerator="cpu",
        devices=dist.get_world_size(),
        strategy=strategy,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=2 if validate else 0,
        val_check_interval=1 if validate else None,
        default_root_dir=tmp,
        callbacks=callbacks,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
    )


def _module(run: Run, strategy: str, user_steps: str) -> Lit:
    return ShardedLit(run, user_steps) if strategy == "fsdp2" else Lit(run, user_steps)


def _loader(run: Run) -> DataLoader[int]:
    return DataLoader(list(range(run.per_epoch)), batch_size=None)


def _validation_loader() -> DataLoader[int]:
    return DataLoader(list(range(2)), batch_size=None)


def trainer(run: Run, strategy: str = "ddp", user_steps: str = "") -> dict[str, np.ndarray] | None:
    """Fit ``run`` with the Trainer and FlatViewCallback; rank 0's final parameters.
    With ``run.epochs == 2`` the first epoch ends in ``trainer.save_checkpoint`` and a
    new Trainer, module and callback resume from it for the second."""
    deepspeed = strategy.startswith("deepspeed")
    with framework_env() as tmp, deepspeed_on_cpu() if deepspeed else contextlib.nullcontext():
        path = os.path.join(tmp, "resume.ckpt")
        for epoch in range(run.epochs):
            module = _module(run, strategy, user_steps)
            callbacks = []
            if user_steps != "own_wrap":
                skip = None if user_steps else Lit.skipped
                callbacks.append(FlatViewCallback(skip=skip, enter_steps=not user_steps))
            fit = _trainer(run, strategy, tmp, callbacks, epochs=epoch + 1)
            validation = _validation_loader() if run.validate else None
            fit.fit(module, _loader(run), validation, ckpt_path=path if epoch else None)
            if epoch + 1 < run.epochs:
                fit.save_checkpoint(path)
        if deepspeed:
            params = without_prefix(full_params(flatview_of(fit), fit.strategy.model), PREFIX)
        else:
            params = without_prefix(params_of(fit.strategy.model), PREFIX)
    return params if dist.get_rank() == 0 else None


def refused_fsdp1_on_cpu() -> str:
    """What FlatViewFSDPStrategy says on CPU."""
    with framework_env() as tmp:
        run = Run()
        fit = _trainer(run, "fsdp1", tmp, [FlatViewCallback(skip=Lit.skipped)], epochs=1)
        try:
            fit.fit(Lit(run), _loader(run))
        except flatview.WrapError as error:
            return str(error)
    return "nothing raised"


def fabric(run: Run, strategy: str) -> dict[str, np.ndarray] | None:
    """Train ``run`` with Fabric: ``flatview.wrap(fabric.setup_module(model))``,
    optimizers from views through ``fabric.setup_optimizers``, ``with fv.step(...)``
    around each batch."""
    with framework_env():
        net = make_net(run.scenario)
        if strategy == "fsdp2":
            chosen: Any = FabricModelParallel(
                parallelize_fn=_fully_shard,
                data_parallel_size=dist.get_world_size(),
                tensor_parallel_size=1,
            )
        else:
            chosen = strategy
        fab = Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=chosen)
        fab.launch()
        model = fab.setup_module(net)
        fv = flatview.wrap(model)
        made = fab.setup_optimizers(*make_optimizers(net, run))
        opts = made if isinstance(made, tuple) else (made,)
        for micro, (x, y) in enumerate(local_batches(run)):
            skip = skip_names(run.scenario, micro)
            last = (micro + 1) % run.accumulate == 0
            if micro % run.accumulate == 0:
                for opt in opts:
                    opt.zero_grad()
            sync = fab.no_backward_sync(model, enabled=not last)
            with sync, fv.step(skip=skip):
                fab.backward(loss_of(model(x, skip), y) / run.accumulate)
            if last:
                if run.clip is not None:
                    for opt in opts:
                        fab.clip_gradients(model, opt, max_norm=run.clip)
                for opt in opts:
                    opt.step()
        params = params_of(net)
    return params if dist.get_rank() == 0 else None


class CPUFabricDeepSpeed(FabricDeepSpeed):
    """Fabric's DeepSpeedStrategy on CPU for tests (Fabric refuses every accelerator but
    CUDA), as :class:`CPUDeepSpeed` is the Trainer's: DDP's environment setup without
    that check, no check of device indices, the local rank as the device index."""

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu", self.local_rank)

    def setup_environment(self) -> None:
        FabricDDP.setup_environment(self)

    def _setup_distributed(self) -> None:
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self._set_world_ranks()
        self._init_deepspeed_distributed()
        if not self._config_initialized:
            self._format_config()
            self._config_initialized = True


def fabric_deepspeed(run: Run, stage: int) -> dict[str, np.ndarray] | None:
    """Train ``run`` with Fabric's DeepSpeedStrategy: the engine set up with a
    :class:`flatview.optim.Deferred` (Fabric sets up a DeepSpeed model only together
    with its one optimizer), wrapped, handed the optimizers built from views;
    ``fabric.backward`` and the optimizer's ``step()``; ``fabric.save`` after the first
    half, ``fabric.load`` after training on, and the second half trained again."""
    import flatview.optim

    with framework_env() as tmp, deepspeed_on_cpu():
        net = make_net(run.scenario)
        config = {
            "train_micro_batch_size_per_gpu": run.scenario.batch_per_rank,
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,
            "gradient_clipping": run.clip or 0.0,
        }
        strategy = CPUFabricDeepSpeed(config=config)
        fab = Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy)
        fab.launch()
        deferred = flatview.optim.Deferred(net.parameters())
        model, opt = fab.setup(net, deferred)
        fv = flatview.wrap(model)
        deferred.set(*make_optimizers(net, run))
        batches = list(enumerate(local_batches(run)))
        half = len(batches) // 2

        def train(part: list[Any]) -> None:
            for micro, (x, y) in part:
                skip = skip_names(run.scenario, micro)
                with fv.step(skip=skip):
                    fab.backward(loss_of(model(x, skip), y))
                opt.step()
                opt.zero_grad()

        train(batches[:half])
        # fabric.save / load: the engine's save_checkpoint / load_checkpoint. Trained on
        # past the save, loaded, trained again: the end must not differ.
        state = {"model": model, "optimizer": opt}
        fab.save(os.path.join(tmp, "fabric_ckpt"), state)
        train(batches[half:])
        fab.load(os.path.join(tmp, "fabric_ckpt"), state)
        train(batches[half:])
        params = full_params(fv, fv.model)
    return params if dist.get_rank() == 0 else None


def _fully_shard(module: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    mesh = mesh["data_parallel"]
    for block in module.body:
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


class _Failing(Lit):
    """Raises before the second batch's backward, after its forward (flatview's
    iteration is then in flight: only leaving the step with the error ends it)."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.batch_now = batch_idx
        return super().training_step(batch, batch_idx)

    def on_before_backward(self, loss: torch.Tensor) -> None:
        if self.batch_now == 1:
            raise RuntimeError("boom before the backward")


def exception_leaves_the_step() -> dict[str, Any]:
    """A batch that raises: the step is left (the next one can be entered), the
    patches are gone, and the error is the user's."""
    with framework_env() as tmp:
        run = Run()
        callback = FlatViewCallback(skip=Lit.skipped)
        fit = _trainer(run, "ddp", tmp, [callback], epochs=1)
        try:
            fit.fit(_Failing(run), _loader(run))
            raised = "nothing"
        except RuntimeError as error:
            raised = str(error)
        fv = callback.fv
        assert fv is not None
        phase = fv.phase.name
        with fv.step(skip=["net.body.1"]):
            pass  # would raise "cannot be nested" if the failed batch's step were open
        patched = "training_step" in vars(fit.strategy) or "clip_grad_by_norm" in vars(
            fit.precision_plugin
        )
    return {"raised": raised, "phase": phase, "patched": patched}


class _FakeFabric:
    """What :func:`flatview.integrations.lightning.setup_optimizers` uses of Fabric, with
    Fabric's real FSDPStrategy (Fabric itself refuses FSDP on CPU)."""

    def __init__(self) -> None:
        from lightning.fabric.strategies import FSDPStrategy

        self.strategy = FSDPStrategy(use_orig_params=False)

    def setup_optimizers(self, *optimizers: Any) -> Any:
        made = tuple(self.strategy.setup_optimizer(o) for o in optimizers)
        return made if len(made) > 1 else made[0]


def fabric_optimizers_over_views() -> dict[str, str]:
    """Fabric's FSDPStrategy refuses optimizers over views; setup_optimizers takes them,
    and refuses one over a flat parameter, naming it."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from flatview.integrations.lightning import setup_optimizers

    net = make_net(Run().scenario)
    model = FSDP(net, device_id=torch.device("cpu"), use_orig_params=False)
    flat = list(model.parameters())
    fv = flatview.wrap(model)
    fabric = _FakeFabric()
    out = {}
    over_views = torch.optim.SGD(net.head.parameters(), lr=0.1)
    try:
        fabric.setup_optimizers(over_views)
        out["fabric"] = "accepted"
    except ValueError as error:
        out["fabric"] = str(error)
    out["helper"] = "same" if setup_optimizers(fabric, fv, over_views) is over_views else "other"
    try:
        setup_optimizers(fabric, fv, torch.optim.SGD(flat, lr=0.1))
        out["flat"] = "accepted"
    except flatview.FlatViewError as error:
        out["flat"] = f"{type(error).__name__}: {error}"
    out["restored"] = str("setup_optimizer" not in vars(fabric.strategy))
    fv.unwrap()
    return out


def deepspeed_bf16_bare_and_wrapped(run: Run, stage: int) -> dict[str, Any]:
    """Lightning's DeepSpeedStrategy in ``precision="bf16-mixed"`` (DeepSpeed's bf16),
    fitted bare and with FlatViewCallback (nothing skipped: bare DeepSpeed cannot skip),
    in the same processes: the fp32 masters, whole, by name, of each."""
    from deepspeed.utils import safe_get_full_fp32_param

    out: dict[str, Any] = {}
    with framework_env() as tmp, deepspeed_on_cpu():
        for wrapped in (False, True):
            callbacks = [FlatViewCallback(skip=None)] if wrapped else []
            fit = _trainer(run, f"deepspeed{stage}", tmp, callbacks, 1, precision="bf16-mixed")
            fit.fit(Lit(run), _loader(run))
            engine = fit.strategy.model
            if wrapped:
                masters = full_params(flatview_of(fit), engine)
            else:
                masters = {
                    n: safe_get_full_fp32_param(p).detach().numpy().copy()
                    for n, p in engine.module.named_parameters()
                }
            out["flatview" if wrapped else "bare"] = {
                name[name.index(PREFIX) :]: value for name, value in masters.items()
            }
            del fit, engine
    return out


# ----------------------------------------------------------- mixture of experts


MOE_PER_EPOCH = 2


class MoELit(pl.LightningModule):
    """:class:`tests.moe_workers.MoE` as a LightningModule for ``ModelParallelStrategy``:
    ``configure_model`` puts each expert unit on its expert group's mesh and the rest on
    the world's (as :func:`tests.moe_workers.wrap`); Adam, manual optimization, the
    experts no token reaches skipped through :class:`FlatViewCallback`. ``seed``: other
    initial values, for a run that must resume from a checkpoint."""

    def __init__(self, case: Any, seed: int) -> None:
        super().__init__()
        self.case = case
        self.group = case.group_of(dist.get_rank())
        self.net = mw.MoE(dataclasses.replace(case, seed=seed), self.group)
        self.automatic_optimization = False
        # State outside the sharded net, checkpointed with it: the steps taken.
        self.register_buffer("steps_taken", torch.zeros((), dtype=torch.int64))

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(self.net, FSDPModule):  # idempotent, as Lightning asks
            mw.wrap(self.case, self.net)

    def at(self, batch_idx: int) -> int:
        return self.current_epoch * MOE_PER_EPOCH + batch_idx

    def skipped(self, batch: Any, batch_idx: int) -> list[str]:
        return names(mw.skipped(self.case, self.group, self.at(batch_idx)), PREFIX)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        at = self.at(batch_idx)
        x, y = mw.batch(self.case, dist.get_rank(), at)
        _, rows = mw.routing(self.case, self.group, at)
        opt = self.optimizers()
        self.manual_backward(torch.nn.functional.mse_loss(self.net(x, rows), y))
        if self.case.clip is not None:
            # Lightning's clipping, by the norm over every group's experts (flatview's).
            self.clip_gradients(opt, self.case.clip, gradient_clip_algorithm="norm")
        opt.step()
        opt.zero_grad()
        self.steps_taken += 1
        return None

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.net.parameters(), lr=0.01, eps=mw.ADAM_EPS)


def trainer_moe(case: Any, again: bool = False) -> float:
    """Fit a model with experts on their own meshes (FSDP2, ``ModelParallelStrategy``)
    for one epoch, ``trainer.save_checkpoint``; a new Trainer, module (other initial
    values) and callback resume from it for the second epoch (Lightning's own
    checkpointing: torch's ``get_model_state_dict`` / ``get_optimizer_state_dict``, DCP).
    ``again``: the same module and callback fit again (the model stayed wrapped). This
    rank's largest relative difference from the single-process reference holding every
    group's experts."""
    assert case.backend == "fsdp2" and case.steps == 2 * MOE_PER_EPOCH, case
    run = Run(manual=True)
    with framework_env() as tmp:
        path = os.path.join(tmp, "resume.ckpt")
        module = callback = None
        for epoch in range(2):
            if module is None or not again:
                module = MoELit(case, seed=case.seed + 17 * epoch)
                callback = FlatViewCallback(skip=MoELit.skipped)
            callbacks = [callback]
            fit = _trainer(run, "fsdp2", tmp, callbacks, epochs=epoch + 1)
            loader = DataLoader(list(range(MOE_PER_EPOCH)), batch_size=None)
            fit.fit(module, loader, ckpt_path=path if epoch else None)
            if epoch == 0:
                fit.save_checkpoint(path)
        mine = mw.whole_parameters(case, module.net, None)
        # Resumed with the module's own state too (a fresh module counts from 0).
        assert int(module.steps_taken) == case.steps, int(module.steps_taken)
    return mw.worst(mine, mw.reference(case)[dist.get_rank()])


def fabric_moe(case: Any) -> float:
    """Fabric's ``ModelParallelStrategy`` over a model with experts on meshes of their
    own (its ``parallelize_fn``: :func:`tests.moe_workers.wrap`), experts skipped per
    step: the first half trained, ``fabric.save``, the second half trained, ``fabric.load``
    and the second half trained again (the load must undo it, each group's experts to
    its own ranks). This rank's largest relative difference from the reference."""
    assert case.backend == "fsdp2" and case.steps % 2 == 0, case
    rank = dist.get_rank()
    group = case.group_of(rank)
    with framework_env() as tmp:
        strategy = FabricModelParallel(
            parallelize_fn=lambda module, mesh: mw.wrap(case, module),
            data_parallel_size=dist.get_world_size(),
            tensor_parallel_size=1,
        )
        fab = Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy)
        fab.launch()
        model = fab.setup_module(mw.MoE(case, group))
        fv = flatview.wrap(model)
        opt = fab.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.01, eps=mw.ADAM_EPS))

        def train(steps: range) -> None:
            for at in steps:
                x, y = mw.batch(case, rank, at)
                _, rows = mw.routing(case, group, at)
                with fv.step(skip=mw.skipped(case, group, at)):
                    fab.backward(torch.nn.functional.mse_loss(model(x, rows), y))
                opt.step()
                opt.zero_grad()

        half = case.steps // 2
        state = {"model": model, "optimizer": opt}
        path = os.path.join(tmp, "fabric_ckpt")
        train(range(half))
        fab.save(path, state)
        train(range(half, case.steps))
        fab.load(path, state)
        train(range(half, case.steps))
        mine = mw.whole_parameters(case, fv.model, None)
    return mw.worst(mine, mw.reference(case)[rank])


# ------------------------------------------------------- Muon, automatic optimization


MUON_STEPS = 4


class MuonLit(pl.LightningModule):
    """Automatic optimization (Lightning calls ``optimizer.step(closure)``) with
    ``flatview.optim.Whole(torch.optim.Muon)`` built in ``configure_optimizers`` over the
    views of ``flatview.wrap(self)`` (``how="wrap"``; FlatViewCallback adopts that
    FlatView) or of ``flatview_of(self.trainer)`` (the callback wraps then); the callback
    enters each batch's step, ``mid`` skipped every other batch."""

    def __init__(self, how: str, sharded: bool) -> None:
        super().__init__()
        self.net = MuonNet()
        self.how = how
        self.sharded = sharded

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if self.sharded and not isinstance(self.net, FSDPModule):
            for layer in (self.net.inp, self.net.mid, self.net.out):
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def skipped(self, batch: Any, batch_idx: int) -> list[str]:
        return ["net.mid"] if skips_mid(batch_idx) else []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = muon_batch(batch_idx, dist.get_rank())
        return torch.nn.functional.mse_loss(self.net(x, skips_mid(batch_idx)), y)

    def configure_optimizers(self) -> Any:
        import flatview.optim

        fv = flatview.wrap(self) if self.how == "wrap" else flatview_of(self.trainer)
        return flatview.optim.Whole(torch.optim.Muon, fv, fv.parameters(), **MUON_OPTIONS)


def trainer_muon(how: str, strategy: str) -> float:
    """Fit :class:`MuonLit` under ``strategy`` (``"fsdp2"``: ``ModelParallelStrategy``,
    or ``"ddp"``); this rank's largest relative difference from ``torch.optim.Muon`` on
    the unwrapped net (:func:`tests.integration_workers.muon_reference`)."""
    from tests.whole_workers import newton_schulz

    run = Run()
    with framework_env() as tmp, newton_schulz(float32=True):
        module = MuonLit(how, sharded=strategy == "fsdp2")
        fit = _trainer(run, strategy, tmp, [FlatViewCallback(skip=MuonLit.skipped)], epochs=1)
        fit.fit(module, DataLoader(list(range(MUON_STEPS)), batch_size=None))
        mine = {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
            for n, p in module.net.named_parameters()
        }
        return worst_difference(mine, muon_reference(MUON_STEPS, accumulate=1))
