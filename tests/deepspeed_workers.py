"""Tasks for DeepSpeed tests, run on every rank of a worker pool (see tests/dist_pool.py).

Each task enters :func:`flatview.testing.deepspeed_on_cpu` itself, builds its engine
inside and drops it before leaving, so the pool's processes hold nothing of DeepSpeed's
between tasks but the imported modules.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from flatview.testing import deepspeed_on_cpu

IN, HIDDEN, OUT = 5, 7, 3
PER_RANK = 3
SEED = 11


def mlp() -> nn.Module:
    torch.manual_seed(SEED)
    layers = [nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(HIDDEN, OUT))


def global_batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    # Targets far from the initial outputs: the first gradients' global norm is well
    # above 1, where DeepSpeed's default clipping acts.
    return torch.randn(world * PER_RANK, IN, generator=g), 4 * torch.randn(
        world * PER_RANK, OUT, generator=g
    )


def config(stage: int, **extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": PER_RANK,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        **extra,
    }


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _state(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().clone().numpy() for k, v in model.state_dict().items()}


def reference_mlp(steps: int, world: int, clip: float | None) -> dict[str, Any]:
    """One process, the whole batch, torch's AdamW; ``clip``: torch's
    ``clip_grad_norm_`` before each step. Also the gradient norm of every step."""
    model = mlp()
    opt = adamw(model.parameters())
    norms = []
    for step in range(steps):
        x, y = global_batch(step, world)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        norms.append(
            float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip or float("inf")))
        )
        opt.step()
    return {"params": _state(model), "norms": norms}


def bare_deepspeed_mlp(stage: int, steps: int, extra: dict[str, Any]) -> dict[str, Any]:
    """Bare DeepSpeed (no flatview): ZeRO ``stage`` with torch's AdamW, ``steps``
    steps; the final full parameters (gathered under ZeRO 3)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    with deepspeed_on_cpu() as deepspeed:
        model = mlp()
        engine, optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=adamw(model.parameters()), config=config(stage, **extra)
        )
        for step in range(steps):
            x, y = global_batch(step, world)
            mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            engine.backward(nn.functional.mse_loss(engine(x[mine]), y[mine]))
            engine.step()
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            params = _state(engine.module)
        kinds = (type(optimizer).__name__, type(optimizer.optimizer).__name__)
        clipping = engine.gradient_clipping()
        del engine, optimizer
    return {"params": params, "optimizers": kinds, "clipping": clipping}


# ------------------------------------------------------------------ the harness


def _extension_lock_dirs() -> list[str]:
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    return sorted(str(p) for p in root.glob("*/deepspeed_*")) if root.exists() else []


def _globals_snapshot() -> dict[str, Any]:
    import torch.distributed.distributed_c10d as c10d

    comm_torch = sys.modules["deepspeed.comm.torch"]
    builder = sys.modules["deepspeed.ops.op_builder.builder"].OpBuilder
    groups = sys.modules["deepspeed.utils.groups"]
    return {
        "build_shm_op": comm_torch.build_shm_op,
        "jit_load": vars(builder)["jit_load"],
        "cdb": sys.modules["deepspeed.comm.comm"].cdb,
        "world_group": groups._WORLD_GROUP,
        "accelerator": sys.modules["deepspeed.accelerator.real_accelerator"].ds_accelerator,
        "process_groups": len(c10d._world.pg_map),
    }


def _env() -> dict[str, str | None]:
    names = ("DS_ACCELERATOR", "LOCAL_RANK", "TORCHINDUCTOR_CACHE_DIR")
    return {name: os.environ.get(name) for name in names}


def harness_leaves_nothing(stages: tuple[int, ...]) -> dict[str, Any]:
    """Enter and leave the harness around a short training run per ZeRO stage: every
    global DeepSpeed's setup touches is as before, and no op build started."""
    env_before = _env()
    locks_before = _extension_lock_dirs()
    with deepspeed_on_cpu():
        pass  # imports DeepSpeed (the first time) and nothing else
    snapshot = _globals_snapshot()
    inside: list[dict[str, Any]] = []
    for stage in stages:
        with deepspeed_on_cpu() as deepspeed:
            comm_torch = sys.modules["deepspeed.comm.torch"]
            backend = sys.modules["deepspeed.comm.comm"]
            model = mlp()
            engine, *_ = deepspeed.initialize(
                model=model, optimizer=adamw(model.parameters()), config=config(stage)
            )
            x, y = global_batch(0, dist.get_world_size())
            engine.backward(nn.functional.mse_loss(engine(x[:PER_RANK]), y[:PER_RANK]))
            engine.step()
            inside.append(
                {
                    "shm_op": comm_torch.build_shm_op() is None,
                    "backend_shm": getattr(backend.cdb, "shm_comm_op", 1),
                    "accelerator": sys.modules["deepspeed"].get_accelerator()._name,
                    "env": os.environ.get("DS_ACCELERATOR"),
                }
            )
            del engine
    after = _globals_snapshot()
    return {
        "unchanged": {k: after[k] is snapshot[k] or after[k] == snapshot[k] for k in snapshot},
        "env_same": _env() == env_before,
        "locks_same": _extension_lock_dirs() == locks_before,
        "inside": inside,
    }


def harness_refuses_builds() -> dict[str, Any]:
    """Inside the harness any DeepSpeed op build raises at once; nothing is compiled."""
    locks_before = _extension_lock_dirs()
    with deepspeed_on_cpu() as deepspeed:
        builder = deepspeed.get_accelerator().create_op_builder("ShareMemCommBuilder")
        try:
            builder.load()
        except RuntimeError as err:
            message = str(err)
        else:
            message = ""
    return {"message": message, "locks_same": _extension_lock_dirs() == locks_before}


# ------------------------------------------------------------- flatview on DeepSpeed


def ds_config(scenario: Any, stage: int, clip: float, extra: dict[str, Any] | None) -> dict:
    return {
        "train_micro_batch_size_per_gpu": scenario.batch_per_rank,
        "gradient_accumulation_steps": scenario.accumulate,
        "gradient_clipping": clip,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage},
        **(extra or {}),
    }


def one_optimizer(params: Any) -> torch.optim.Optimizer:
    """The engine's own optimizer when the run has only one (``mode="one"``)."""
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def grouped_optimizer(net: nn.Module) -> torch.optim.Optimizer:
    """The engine's own optimizer with the usual weight-decay groups by name
    (``mode="groups"``), the one without decay first: two flat partitions under ZeRO 1/2,
    each module's bias laid out before its weight."""
    undecayed = [p for n, p in net.named_parameters() if not n.endswith("weight")]
    decayed = [p for n, p in net.named_parameters() if n.endswith("weight")]
    return torch.optim.AdamW(
        [{"params": undecayed, "lr": 0.02, "weight_decay": 0.0}, {"params": decayed}],
        lr=0.05,
        weight_decay=0.1,
    )


def flatview_engine(
    deepspeed: Any,
    scenario: Any,
    stage: int,
    mode: str,
    clip: float,
    extra: Any = None,
    zero_init: bool = False,
) -> tuple[Any, Any, list[torch.optim.Optimizer]]:
    """The scenario's net in a ZeRO ``stage`` engine, wrapped by flatview; ``mode``:
    ``"several"`` (per-submodule optimizers over views, given to a Deferred) or
    ``"one"`` (the engine's own AdamW over every parameter). ``zero_init``: the net is
    built under ``deepspeed.zero.Init`` (ZeRO 3: partitioned as each module is made, as
    large models are loaded)."""
    import flatview
    import flatview.optim
    from tests.scenarios import freeze, make_net, optimizers

    config = ds_config(scenario, stage, clip, extra)
    building = (
        deepspeed.zero.Init(config_dict_or_path=config) if zero_init else contextlib.nullcontext()
    )
    with building:
        net = make_net(scenario)
    # Under zero.Init every parameter is partitioned as its module is made.
    assert not zero_init or all(hasattr(p, "ds_id") for p in net.parameters())
    if mode == "several":
        client: torch.optim.Optimizer = flatview.optim.Deferred(net.parameters())
    elif mode == "groups":
        client = grouped_optimizer(net)
    else:
        client = one_optimizer(net.parameters())
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=client, config=config)
    fv = flatview.wrap(engine, check_skip_agreement=scenario.check)
    freeze(fv.named_parameters(), scenario)
    if mode == "several":
        opts = optimizers(engine.module)
        client.set(*opts)
    else:
        opts = [client]
    return engine, fv, opts


def full_params(fv: Any, engine: Any) -> dict[str, np.ndarray]:
    """Every parameter whole by original name (flatview.checkpoint's full model state)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    import flatview.checkpoint

    options = StateDictOptions(full_state_dict=True)
    model_sd, _ = flatview.checkpoint.get_state_dict(fv, engine, [], options=options)
    names = {n for n, _ in fv.named_parameters()}
    return {k: v.detach().numpy().copy() for k, v in model_sd.items() if k in names}


def run_flatview(
    scenario: Any,
    stage: int,
    mode: str = "several",
    clip: float = 0.0,
    extra: Any = None,
    direct: bool = False,
    zero_init: bool = False,
) -> Any:
    """Train the scenario with DeepSpeed and flatview: each micro-batch one step (inside
    ``fv.step(skip=...)``: forward, ``engine.backward`` or with ``direct`` the loss's own
    ``backward()``, which DeepSpeed supports too), then engine.step(), which steps the
    optimizers every ``scenario.accumulate`` micro-batches (DeepSpeed's
    ``gradient_accumulation_steps``; gradients and norms recorded there)."""
    from tests.scenarios import Outcome, local_batch, loss_of, skip_names

    with deepspeed_on_cpu() as deepspeed:
        engine, fv, _ = flatview_engine(deepspeed, scenario, stage, mode, clip, extra, zero_init)
        module = engine.module
        none_grads, on_modules, grad_norms = [], [], []
        for micro in range(len(scenario.skips)):
            xs, ys = local_batch(scenario, micro)
            skip = skip_names(scenario, micro)
            with fv.step(skip=list(skip)):
                loss = loss_of(engine(xs, skip), ys)
                if direct:
                    loss.backward()
                else:
                    engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()
            if boundary:
                none_grads.append(sorted(n for n, p in fv.named_parameters() if p.grad is None))
            engine.step()
            if boundary:
                grad_norms.append(engine.get_global_grad_norm())
            held = {id(p) for p in module.parameters()}
            on_modules.append(held == {id(p) for p in fv.parameters()})
        names = [n for n, _ in fv.named_parameters()]
        empty = sorted(n for n, p in fv.named_parameters() if p.numel() == 0)
        params = full_params(fv, engine)
        del engine, fv
    outcome = Outcome(names, none_grads, params, empty, all(on_modules))
    outcome.grad_norms = [None if n is None else float(n) for n in grad_norms]  # type: ignore[attr-defined]
    return outcome


def run_reference(
    scenario: Any, mode: str = "several", clip: float = 0.0, steps: list[range] | None = None
) -> Any:
    """The scenario in one process, without any wrapper, as DeepSpeed steps: the
    optimizers after every ``scenario.accumulate`` micro-batches (each loss divided by
    that, as ``engine.backward`` does), the gradients clipped first (``clip`` > 0), then
    dropped (``zero_grad(set_to_none=True)``, as the engine does). ``steps``: the
    micro-batches of each optimizer step, if not every ``scenario.accumulate``."""
    from tests.scenarios import Outcome, optimizer_steps, reference_model, reference_training

    net, opts = reference_model(scenario)
    if mode == "one":
        opts = [one_optimizer(net.parameters())]
    elif mode == "groups":
        opts = [grouped_optimizer(net)]
    none_grads, norms = [], []
    steps = steps or optimizer_steps(scenario)
    for _ in reference_training(scenario, net, opts, steps, 1 / scenario.accumulate):
        none_grads.append(sorted(n for n, p in net.named_parameters() if p.grad is None))
        norm = torch.nn.utils.clip_grad_norm_(net.parameters(), clip if clip > 0 else math.inf)
        norms.append(float(norm))
    params = {k: v.detach().numpy().copy() for k, v in net.named_parameters()}
    outcome = Outcome([n for n, _ in net.named_parameters()], none_grads, params)
    outcome.norms = norms  # type: ignore[attr-defined]
    return outcome


def _train(
    engine: Any, fv: Any, scenario: Any, micros: range, before: Any = None
) -> list[list[str]]:
    """Micro-batches ``micros`` of the scenario, one engine step each; the names whose
    view gradient was None before each step."""
    from tests.scenarios import local_batch, loss_of, skip_names

    none_grads = []
    for micro in micros:
        xs, ys = local_batch(scenario, micro)
        skip = skip_names(scenario, micro)
        with fv.step(skip=list(skip)):
            engine.backward(loss_of(engine(xs, skip), ys))
        none_grads.append(sorted(n for n, p in fv.named_parameters() if p.grad is None))
        if before is not None:
            before()
        engine.step()
    return none_grads


WRITTEN = "stem.weight"
"""The parameter :func:`written_in_window` halves after each window's first micro-step."""


def written_in_window(scenario: Any, stage: int) -> dict[str, float]:
    """``gradient_accumulation_steps=2``: after the first micro-step of every window,
    ``stem.weight`` halved in place through its view (before the next micro-step's
    forward). Per parameter, the largest difference from the unwrapped model doing the
    same between its micro-batches."""
    from tests.scenarios import optimizer_steps, reference_backward, reference_model

    counter = [0]
    with deepspeed_on_cpu() as deepspeed:
        engine, fv, _ = flatview_engine(deepspeed, scenario, stage, "several", 0.0)
        views = fv.named_parameters

        def halve() -> None:
            if counter[0] % scenario.accumulate == 0:
                with torch.no_grad():
                    dict(views())[WRITTEN].mul_(0.5)
            counter[0] += 1

        _train(engine, fv, scenario, range(len(scenario.skips)), halve)
        mine = full_params(fv, engine)
        del engine, fv
    net, opts = reference_model(scenario)
    for micros in optimizer_steps(scenario):
        for micro in micros:
            reference_backward(scenario, net, (micro,), None, 1 / scenario.accumulate)
            if micro % scenario.accumulate == 0:
                with torch.no_grad():
                    dict(net.named_parameters())[WRITTEN].mul_(0.5)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {n: float(np.abs(mine[n] - p.detach().numpy()).max()) for n, p in net.named_parameters()}


def recovery(scenario: Any, stage: int, kinds: tuple[str, ...]) -> dict[str, Any]:
    """Before the scenario's training, one failing iteration of each kind, caught on
    every rank and the gradients dropped (``engine.zero_grad()``): training is then the
    reference's. ``used``: a step declares ``body.1`` skipped and runs it;
    ``mismatch``: rank 0 skips ``body.1``, the others nothing."""
    from tests.scenarios import local_batch

    errors = []
    with deepspeed_on_cpu() as deepspeed:
        engine, fv, _ = flatview_engine(deepspeed, scenario, stage, "several", 0.0)
        xs, ys = local_batch(scenario, 500)
        for kind in kinds:
            errors.append(_failing_iteration(engine, fv, kind, xs, ys))
            engine.zero_grad()
        _train(engine, fv, scenario, range(len(scenario.skips)))
        params = full_params(fv, engine)
        phase = fv.phase.name
        del engine, fv
    return {"errors": errors, "params": params, "phase": phase}


def _failing_iteration(engine: Any, fv: Any, kind: str, xs: Any, ys: Any) -> str:
    """One iteration that fails as :func:`recovery`'s ``kind`` says, caught: its error."""
    from tests.scenarios import loss_of

    declared = ["body.1"] if kind == "used" or dist.get_rank() == 0 else []
    try:
        with fv.step(skip=declared):
            engine.backward(loss_of(engine(xs, ()), ys))
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "nothing raised"


def recovery_in_window(scenario: Any, stage: int, kind: str) -> dict[str, Any]:
    """``scenario.accumulate`` = 2: a first micro-step that uses every parameter, then
    the boundary's micro-step fails (``kind`` as in :func:`recovery`), caught on every
    rank, and ``engine.zero_grad()`` drops what the window held. The scenario's
    micro-batches follow, the first of them ending that window alone."""
    from tests.scenarios import local_batch, loss_of

    errors = []
    with deepspeed_on_cpu() as deepspeed:
        engine, fv, _ = flatview_engine(deepspeed, scenario, stage, "several", 0.0)
        xs, ys = local_batch(scenario, 500)
        with fv.step(skip=[]):
            engine.backward(loss_of(engine(xs, ()), ys))
        engine.step()
        errors.append(_failing_iteration(engine, fv, kind, xs, ys))
        engine.zero_grad()
        none_grads = _train(engine, fv, scenario, range(len(scenario.skips)))
        params = full_params(fv, engine)
        empty = {n for n, p in fv.named_parameters() if p.numel() == 0}
        del engine, fv
    return {"errors": errors, "params": params, "none_grads": none_grads, "empty": empty}


def _error(call: Any, *args: Any) -> str:
    try:
        call(*args)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "nothing raised"


def unseen_backwards(scenario: Any, stage: int) -> dict[str, Any]:
    """Backwards of forwards flatview did not see begin, each caught on every rank and
    the gradients dropped (``engine.zero_grad()``), then the scenario's training with
    the engine's own AdamW: ``before wrap``, the backward of ``engine(...)`` run before
    ``flatview.wrap``; ``module before wrap`` (ZeRO 1/2), that of ``engine.module(...)``
    (no DeepSpeed hook on its outputs), then ``engine.step()``; ``second backward``, a
    second ``engine.backward`` through a forward whose first one had ``retain_graph``."""
    import flatview
    from tests.scenarios import freeze, local_batch, loss_of, make_net

    errors = {}
    with deepspeed_on_cpu() as deepspeed:
        net = make_net(scenario)
        engine, _, _, _ = deepspeed.initialize(
            model=net,
            optimizer=one_optimizer(net.parameters()),
            config=ds_config(scenario, stage, 0.0, None),
        )
        xs, ys = local_batch(scenario, 500)
        early = loss_of(engine(xs), ys)
        direct = loss_of(engine.module(xs), ys) if stage != 3 else None
        fv = flatview.wrap(engine, check_skip_agreement=scenario.check)
        freeze(fv.named_parameters(), scenario)
        errors["before wrap"] = _error(engine.backward, early)
        engine.zero_grad()
        if direct is not None:
            direct.backward()
            errors["module before wrap"] = _error(engine.step)
            engine.zero_grad()
        loss = loss_of(engine(xs), ys)
        engine.backward(loss, retain_graph=True)
        errors["second backward"] = _error(engine.backward, loss)
        engine.zero_grad()
        del early, direct, loss
        _train(engine, fv, scenario, range(len(scenario.skips)))
        params = full_params(fv, engine)
        phase = fv.phase.name
        del engine, fv
    return {"errors": errors, "params": params, "phase": phase}


def gradient_bytes(
    scenario: Any, stage: int, strategy: str, bare: bool, accumulate: int = 1
) -> dict[str, Any]:
    """Bytes of gradient-reducing collectives (counted at the calls) in the backward of
    each micro-batch of the scenario, with flatview (``bare=False``) or on the bare
    engine, ``accumulate`` micro-batches per optimizer step; the collectives of the whole
    micro-step (forward and backward) by kind; with flatview also what flatview's ledger
    says, and each flat parameter's layout and used flags, to compute the used bytes
    from."""
    import flatview
    from flatview.testing.counting import GRADIENT_KINDS, CollectiveCounter
    from tests.scenarios import local_batch, loss_of, make_net, skip_names

    rows = []
    with deepspeed_on_cpu() as deepspeed:
        net = make_net(scenario)
        engine, _, _, _ = deepspeed.initialize(
            model=net,
            optimizer=one_optimizer(net.parameters()),
            config=ds_config(scenario, stage, 0.0, {"gradient_accumulation_steps": accumulate}),
        )
        fv = None if bare else flatview.wrap(engine, reduce_strategy=strategy)
        for micro in range(len(scenario.skips)):
            xs, ys = local_batch(scenario, micro)
            skip = skip_names(scenario, micro)
            counter, whole = CollectiveCounter(), CollectiveCounter()
            step = fv.step(skip=list(skip)) if fv is not None else contextlib.nullcontext()
            with whole, step:
                loss = loss_of(engine(xs, skip), ys)
                with counter:
                    engine.backward(loss)
            row: dict[str, Any] = {
                "counted": sum(counter.bytes.get(k, 0) for k in GRADIENT_KINDS),
                "calls": {k: counter.calls[k] for k in GRADIENT_KINDS if counter.calls[k]},
                "all calls": {k: n for k, n in whole.calls.items() if n},
            }
            if fv is not None:
                stats = fv.stats
                row["ledger"] = stats.reduced_bytes
                row["used"] = stats.used_bytes
                row["dense"] = stats.dense_bytes
                row["skipped"] = stats.skipped_bytes
                row["flats"] = [
                    (flat.spec.layout, fv.runtime.iteration.used[flat.index])
                    for flat in fv.table.flats
                ]
            rows.append(row)
            engine.step()
        del engine, fv
    return {"rows": rows}


def bare_scenario(scenario: Any, stage: int) -> dict[str, np.ndarray]:
    """The scenario on bare DeepSpeed (no flatview), the engine's own AdamW; the final
    parameters by name."""
    from tests.scenarios import local_batch, loss_of, make_net, skip_names

    with deepspeed_on_cpu() as deepspeed:
        net = make_net(scenario)
        engine, _, _, _ = deepspeed.initialize(
            model=net,
            optimizer=one_optimizer(net.parameters()),
            config=ds_config(scenario, stage, 0.0, None),
        )
        for micro in range(len(scenario.skips)):
            xs, ys = local_batch(scenario, micro)
            skip = skip_names(scenario, micro)
            engine.backward(loss_of(engine(xs, skip), ys))
            engine.step()
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            params = {k: v.detach().clone().numpy() for k, v in engine.module.named_parameters()}
        del engine
    return params


def _numpy_state(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: {
            k: v.detach().cpu().numpy().copy() if isinstance(v, torch.Tensor) else v
            for k, v in entries.items()
        }
        for name, entries in state.items()
    }


def optimizer_states(scenario: Any, stage: int) -> dict[str, Any]:
    """After training the scenario: every optimizer's consolidated state by original name
    (FlatView.optim_state_dict), and the full model and optimizer state of
    flatview.checkpoint.get_state_dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    import flatview.checkpoint

    with deepspeed_on_cpu() as deepspeed:
        engine, fv, opts = flatview_engine(deepspeed, scenario, stage, "several", 0.0)
        _train(engine, fv, scenario, range(len(scenario.skips)))
        consolidated = [_numpy_state(fv.optim_state_dict(opt)["state"]) for opt in opts]
        options = StateDictOptions(full_state_dict=True)
        model_sd, optim_sd = flatview.checkpoint.get_state_dict(fv, engine, opts, options=options)
        # The engine's module state dict (DeepSpeed's parameters, lent): full under ZeRO
        # 1/2, empty between passes under ZeRO 3, as without flatview.
        module_sd = {k: tuple(v.shape) for k, v in engine.module.state_dict().items()}
        views_back = {id(p) for p in engine.module.parameters()} == {id(p) for p in fv.parameters()}
        out = {
            "optimizers": consolidated,
            "model": {k: v.detach().numpy().copy() for k, v in model_sd.items()},
            "merged": _numpy_state(optim_sd["state"]),
            "module_shapes": module_sd,
            "views_back": views_back,
        }
        del engine, fv
    return out


def reference_optimizer_states(scenario: Any) -> list[dict[str, dict[str, Any]]]:
    """The reference's per-optimizer state by parameter name, after the scenario."""
    from tests.scenarios import optimizer_steps, reference_model, reference_training

    net, opts = reference_model(scenario)
    for _ in reference_training(scenario, net, opts, optimizer_steps(scenario)):
        pass
    names = {id(p): n for n, p in net.named_parameters()}
    return [_numpy_state({names[id(p)]: dict(s) for p, s in opt.state.items()}) for opt in opts]


def resume(scenario: Any, first: int, then: int, split: int, sharded: bool) -> dict[str, Any]:
    """Train the scenario's first ``split`` steps on ZeRO ``first``, save the model and
    optimizer state with flatview.checkpoint (through torch.distributed.checkpoint when
    ``sharded``, else the full dicts in memory), load it into a fresh engine on ZeRO
    ``then`` and train the rest there; the final parameters."""
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    import flatview.checkpoint

    options = StateDictOptions(full_state_dict=not sharded)
    steps = len(scenario.skips)
    with deepspeed_on_cpu() as deepspeed, tempfile.TemporaryDirectory() as local:
        engine, fv, opts = flatview_engine(deepspeed, scenario, first, "several", 0.0)
        _train(engine, fv, scenario, range(split))
        saved = flatview.checkpoint.get_state_dict(fv, engine, opts, options=options)
        # Every rank writes to the directory rank 0 made (one machine).
        box = [local]
        dist.broadcast_object_list(box, src=0)
        if sharded:
            dcp.save({"model": saved[0], "optim": saved[1]}, checkpoint_id=box[0])
        del engine, fv, opts
        engine, fv, opts = flatview_engine(deepspeed, scenario, then, "several", 0.0)
        if sharded:
            model_sd, optim_sd = flatview.checkpoint.get_state_dict(fv, engine, opts)
            dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=box[0])
        else:
            model_sd, optim_sd = saved
        flatview.checkpoint.set_state_dict(
            fv, engine, opts, model_state_dict=model_sd, optim_state_dict=optim_sd
        )
        _train(engine, fv, scenario, range(split, steps))
        params = full_params(fv, engine)
        dist.barrier()
        del engine, fv, opts
    return {"params": params}


REFUSALS: dict[str, tuple[int, dict[str, Any], str]] = {
    # label: (stage, config entries, what the engine is built with)
    "stage0": (0, {}, "adamw"),
    # DeepSpeed cannot build fp16 on this CPU: an fp32 engine that says it trains in fp16.
    "fp16 as reported": (2, {}, "adamw+fp16"),
    "fp16": (2, {"fp16": {"enabled": True}}, "adamw"),
    "offload": (
        2,
        {
            "zero_force_ds_cpu_optimizer": False,
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        },
        "adamw",
    ),
    "unmanaged accumulation": (2, {"managed_gradient_accumulation": False}, "adamw"),
    "fp32 accumulation": (
        2,
        {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}},
        "adamw",
    ),
    "fp32 accumulation, ZeRO 1": (
        1,
        {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}},
        "adamw",
    ),
    "communication": (2, {"communication_data_type": "fp16"}, "adamw"),
    "prescale": (1, {"prescale_gradients": True}, "adamw"),
    "quantized": (
        3,
        {"zero_optimization": {"stage": 3, "zero_quantized_gradients": True}},
        "adamw",
    ),
    "scheduler": (1, {}, "deferred+scheduler"),
    "stepped": (2, {}, "adamw+stepped"),
    "adagrad": (1, {}, "adagrad"),
}


def refusals(labels: tuple[str, ...]) -> dict[str, str]:
    """Per label of :data:`REFUSALS`: ``"WrapError: ..."`` as flatview.wrap refused the
    engine, ``"wrapped"``, or ``"engine: ..."`` when DeepSpeed itself could not build it
    on this machine."""
    import flatview
    import flatview.optim
    from tests.scenarios import Scenario, local_batch, loss_of, make_net

    scenario = Scenario(world_size=dist.get_world_size())
    out: dict[str, str] = {}
    with deepspeed_on_cpu() as deepspeed:
        for label in labels:
            stage, extra, kind = REFUSALS[label]
            net = make_net(scenario)
            scheduler = None
            if kind.startswith("deferred"):
                client: torch.optim.Optimizer = flatview.optim.Deferred(net.parameters())
                scheduler = torch.optim.lr_scheduler.LambdaLR(client, lambda step: 1.0)
            elif kind == "adagrad":
                client = torch.optim.Adagrad(net.parameters(), lr=0.1)
            else:
                client = one_optimizer(net.parameters())
            config = ds_config(scenario, stage, 0.0, None)
            config.update(extra)
            try:
                engine, _, _, _ = deepspeed.initialize(
                    model=net, optimizer=client, lr_scheduler=scheduler, config=config
                )
                if kind.endswith("fp16"):
                    engine.fp16_enabled = lambda: True
                if kind.endswith("stepped"):
                    xs, ys = local_batch(scenario, 0)
                    engine.backward(loss_of(engine(xs), ys))
                    engine.step()
            except Exception as err:
                out[label] = f"engine: {type(err).__name__}: {err}"
                continue
            try:
                flatview.wrap(engine).unwrap()
                out[label] = "wrapped"
            except Exception as err:
                out[label] = f"{type(err).__name__}: {err}"
            del engine
    return out


@contextlib.contextmanager
def _replaced(owner: Any, name: str, value: Any = None) -> Any:
    """``owner.name`` gone (``value`` None) or set to ``value`` for the block; found on
    the object itself or on the class that defines it."""
    holder = (
        owner if name in vars(owner) else next(k for k in type(owner).__mro__ if name in vars(k))
    )
    saved = vars(holder)[name]
    if value is None:
        delattr(holder, name)
    else:
        setattr(holder, name, value)
    try:
        yield
    finally:
        setattr(holder, name, saved)


def internals_refused() -> dict[str, dict[str, Any]]:
    """What wrapping says when an internal the adapter touches is gone (as a DeepSpeed
    that renamed it would have it), or DeepSpeed's version is not the tested series:
    the message, whether anything was patched, and whether the engine wraps once the
    internal is back."""
    import flatview
    from flatview.errors import WrapError
    from tests.scenarios import Scenario, make_net

    scenario = Scenario(world_size=dist.get_world_size())
    out = {}
    with deepspeed_on_cpu() as deepspeed:
        cases = (
            ("_backward_prologue", 1, lambda e: (e, "_backward_prologue", None)),
            ("partitions", 1, lambda e: (e.optimizer, "single_partition_of_fp32_groups", None)),
            ("masters", 3, lambda e: (e.optimizer, "fp32_partitioned_groups_flat", None)),
            ("version", 1, lambda e: (deepspeed, "__version__", "0.20.0")),
        )
        for label, stage, target in cases:
            net = make_net(scenario)
            engine, _, _, _ = deepspeed.initialize(
                model=net,
                optimizer=one_optimizer(net.parameters()),
                config=ds_config(scenario, stage, 0.0, None),
            )
            owner, name, value = target(engine)
            wrapped = None
            with _replaced(owner, name, value):
                try:
                    wrapped = flatview.wrap(engine)
                    message = "no error"
                except WrapError as err:
                    message = str(err)
            patched = "step" in vars(engine.optimizer) or "allreduce_gradients" in vars(engine)
            if wrapped is not None:
                wrapped.unwrap()
            fv = flatview.wrap(engine)
            wraps = bool(dict(fv.named_parameters()))
            fv.unwrap()
            out[label] = {"name": name, "message": message, "patched": patched, "wraps": wraps}
            del engine, fv
    return out


def _flat_items(state: tuple[dict[str, Any], dict[str, Any]]) -> list[dict[str, Any]]:
    """A (model, optimizer) state-dict pair as flat dicts (the optimizer's per parameter
    and key)."""
    model_sd, optim_sd = state
    flat = {
        f"{name}.{key}": v for name, entry in optim_sd["state"].items() for key, v in entry.items()
    }
    return [model_sd, flat]


def _same_value(a: Any, b: Any) -> bool:
    """Equal values: tensors element for element, sharded ones shard for shard (this
    rank's pieces and where they lie)."""
    if hasattr(a, "local_shards"):
        mine, theirs = a.local_shards(), b.local_shards()
        return a.shape == b.shape and all(
            x.metadata.shard_offsets == y.metadata.shard_offsets and torch.equal(x.tensor, y.tensor)
            for x, y in zip(mine, theirs, strict=True)
        )
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and bool(torch.equal(a, b))
    return bool(a == b)


def _snapshot(state: tuple[dict[str, Any], dict[str, Any]]) -> list[dict[str, Any]]:
    """A (model, optimizer) state-dict pair's values copied (this rank's shards and where
    they lie, for sharded ones), comparable with ``==`` after training went on."""

    def copied(value: Any) -> Any:
        if hasattr(value, "local_shards"):
            return [(s.metadata.shard_offsets, s.tensor.tolist()) for s in value.local_shards()]
        if isinstance(value, torch.Tensor):
            return value.tolist()
        return value

    return [{k: copied(v) for k, v in flat.items()} for flat in _flat_items(state)]


def refused_while_wrapped(stage: int) -> dict[str, str]:
    """What flatview refuses on a wrapped engine (StateError messages by call), and what
    torch's routed get_state_dict / set_state_dict give and load."""
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import flatview
    import flatview.checkpoint
    from tests.scenarios import Scenario, local_batch, loss_of, make_net

    scenario = Scenario(world_size=dist.get_world_size())
    out = {}
    with deepspeed_on_cpu() as deepspeed, tempfile.TemporaryDirectory() as directory:
        net = make_net(scenario)
        # Built before wrapping, over what become DeepSpeed's own parameters.
        early = torch.optim.SGD(net.parameters(), lr=0.1)
        engine, _, _, _ = deepspeed.initialize(
            model=net,
            optimizer=one_optimizer(net.parameters()),
            config=ds_config(scenario, stage, 0.0, None),
        )
        fv = flatview.wrap(engine)
        xs, ys = local_batch(scenario, 0)
        engine.backward(loss_of(engine(xs), ys))
        engine.step()
        calls = {
            "early optimizer": (early.step,),
            "coalesce_grad_reduction": (_entered, engine.coalesce_grad_reduction),
        }
        for name, (method, *args) in calls.items():
            try:
                method(*args)
                out[name] = "allowed"
            except Exception as err:
                out[name] = f"{type(err).__name__}: {err}"
        # torch's own checkpoint functions would misread an optimizer over views: they
        # are routed to flatview.checkpoint's (flatview.checkpoint_routing).
        client = engine.optimizer.optimizer
        routed = get_state_dict(engine, client)
        own = flatview.checkpoint.get_state_dict(fv, engine, client)
        same = all(
            sorted(a) == sorted(b) and all(_same_value(a[k], b[k]) for k in a)
            for a, b in zip(_flat_items(routed), _flat_items(own), strict=True)
        )
        out["torch get_state_dict"] = "routed" if same else f"differs: {routed} vs {own}"
        # torch's pair as frameworks use it: saved with DCP, a step later loaded (DCP into
        # torch's template, then set_state_dict): the state of before, by
        # flatview.checkpoint's reading.
        shared = [f"{directory}/dcp"]
        dist.broadcast_object_list(shared, src=0)
        dcp.save({"model": routed[0], "optim": routed[1]}, checkpoint_id=shared[0])
        saved = _snapshot(routed)
        xs, ys = local_batch(scenario, 1)
        engine.backward(loss_of(engine(xs), ys))
        engine.step()
        moved = _snapshot(flatview.checkpoint.get_state_dict(fv, engine, client)) != saved
        model_sd, optim_sd = get_state_dict(engine, client)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=shared[0])
        set_state_dict(engine, client, model_state_dict=model_sd, optim_state_dict=optim_sd)
        back = _snapshot(flatview.checkpoint.get_state_dict(fv, engine, client)) == saved
        out["torch set_state_dict"] = "routed" if moved and back else f"moved {moved}, back {back}"
        del engine, fv, calls, early, client, routed, own, model_sd, optim_sd
    return out


def one_rank_refuses(scenario: Any, stage: int) -> dict[str, str]:
    """:func:`tests.refusal_workers.one_rank_refuses` on a DeepSpeed engine: each
    collective entry point misused on rank 1 only; per case, the error this rank saw.
    Rank 1's odd optimizer is one built before wrapping, over DeepSpeed's own
    parameters."""
    import flatview
    import flatview.optim
    from tests.scenarios import make_net, optimizers

    with deepspeed_on_cpu() as deepspeed:
        net = make_net(scenario)
        early = torch.optim.AdamW(net.parameters(), lr=0.01)
        deferred = flatview.optim.Deferred(net.parameters())
        engine, _, _, _ = deepspeed.initialize(
            model=net, optimizer=deferred, config=ds_config(scenario, stage, 0.0, None)
        )
        fv = flatview.wrap(engine, check_skip_agreement=scenario.check)
        opts = optimizers(engine.module)
        deferred.set(*opts)
        _train(engine, fv, scenario, range(1))
        out = _refusal_cases(scenario, engine, fv, early, opts[0])
        # Nothing was left half done: training goes on.
        _train(engine, fv, scenario, range(1, 2))
        del engine, fv, early, deferred, opts
    return out


def _refusal_cases(scenario: Any, engine: Any, fv: Any, early: Any, good: Any) -> dict[str, str]:
    import flatview.checkpoint as fcp
    from tests.refusal_workers import entry_point_refusals

    lonely = dist.get_rank() == 1
    chosen = early if lonely else good
    out, _ = entry_point_refusals(scenario, fv, engine, good, chosen, lonely)
    # The calls work again on every rank.
    fv.optim_state_dict(good)
    fcp.get_state_dict(fv, engine, [good])
    return out


def unwrap_then_bare(scenario: Any, stage: int, split: int) -> dict[str, Any]:
    """The engine's own AdamW, wrapped for the first ``split`` steps, then
    ``fv.unwrap()`` and bare DeepSpeed for the rest (which skip nothing)."""
    from tests.scenarios import local_batch, loss_of

    with deepspeed_on_cpu() as deepspeed:
        engine, fv, _ = flatview_engine(deepspeed, scenario, stage, "one", 0.0)
        _train(engine, fv, scenario, range(split))
        fv.unwrap()
        for micro in range(split, len(scenario.skips)):
            xs, ys = local_batch(scenario, micro)
            engine.backward(loss_of(engine(xs), ys))
            engine.step()
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            params = {k: v.detach().clone().numpy() for k, v in engine.module.named_parameters()}
        del engine, fv
    return {"params": params}


def reference_unwrapped(scenario: Any, split: int) -> dict[str, np.ndarray]:
    """The reference of :func:`unwrap_then_bare`: after ``split`` steps a fresh AdamW
    (the engine's optimizer starts afresh over DeepSpeed's partitions)."""
    from tests.scenarios import batch, loss_of, make_net, skip_names

    net = make_net(scenario)
    opt = one_optimizer(net.parameters())
    for micro in range(len(scenario.skips)):
        if micro == split:
            opt = one_optimizer(net.parameters())
        x, y = batch(scenario, micro)
        loss_of(net(x, skip_names(scenario, micro)), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().numpy().copy() for k, v in net.named_parameters()}


def muon_engine(
    deepspeed: Any, scenario: Any, stage: int, muon_kwargs: dict[str, Any]
) -> tuple[Any, Any, Any, torch.optim.Optimizer]:
    """A ZeRO ``stage`` engine of the scenario's net, wrapped, whose Deferred steps
    ``Whole(torch.optim.Muon, ...)`` on the matrices (by original shape) and AdamW on the
    rest: the engine, flatview, the two optimizers."""
    import flatview
    import flatview.optim
    from tests.scenarios import make_net
    from tests.whole_workers import ADAMW_EPS

    net = make_net(scenario)
    deferred = flatview.optim.Deferred(net.parameters())
    engine, _, _, _ = deepspeed.initialize(
        model=net, optimizer=deferred, config=ds_config(scenario, stage, 0.0, None)
    )
    fv = flatview.wrap(engine)
    named = list(fv.named_parameters())
    matrices = [p for _, p in named if fv.shape_of(p).ndim == 2]
    rest = [p for _, p in named if fv.shape_of(p).ndim != 2]
    muon = flatview.optim.Whole(torch.optim.Muon, fv, matrices, **muon_kwargs)
    adamw = torch.optim.AdamW(rest, lr=0.01, eps=ADAMW_EPS)  # as the reference's
    deferred.set(muon, adamw)
    return engine, fv, muon, adamw


def muon_whole(run: Any, stage: int) -> dict[str, Any]:
    """tests.whole_workers.MuonRun on DeepSpeed: ``Whole(torch.optim.Muon, ...)`` on the
    matrices (by original shape) and AdamW on the rest, handed to a Deferred; every step
    inside ``fv.step``, then ``engine.step()``."""
    from tests.whole_workers import newton_schulz

    scenario = run.scenario
    with deepspeed_on_cpu() as deepspeed, newton_schulz(run.float32):
        engine, fv, muon, adamw = muon_engine(deepspeed, scenario, stage, run.muon_kwargs)
        _train(engine, fv, scenario, range(len(scenario.skips)))
        state = fv.optim_state_dict(muon)
        params = full_params(fv, engine)
        del engine, fv, muon, adamw
    return {"params": params, "state": state}


def norms(scenario: Any, stage: int) -> list[dict[str, Any]]:
    """Per step, before the engine steps: every parameter's whole norm and its gradient's
    (``FlatView.param_norms`` / ``grad_norms``)."""
    out: list[dict[str, Any]] = []
    with deepspeed_on_cpu() as deepspeed:
        engine, fv, _ = flatview_engine(deepspeed, scenario, stage, "several", 0.0)
        record = functools.partial(_record_norms, fv, out)
        _train(engine, fv, scenario, range(len(scenario.skips)), before=record)
        del engine, fv, record
    return out


def _record_norms(fv: Any, out: list[dict[str, Any]]) -> None:
    out.append(
        {
            "params": {k: float(v) for k, v in fv.param_norms().items()},
            "grads": {k: None if v is None else float(v) for k, v in fv.grad_norms().items()},
        }
    )


def reference_norms(scenario: Any) -> list[dict[str, Any]]:
    """The same norms on the unwrapped model."""
    from tests.scenarios import optimizer_steps, reference_model, reference_training

    net, opts = reference_model(scenario)
    out = []
    for _ in reference_training(scenario, net, opts, optimizer_steps(scenario)):
        out.append(
            {
                "params": {n: float(p.detach().norm()) for n, p in net.named_parameters()},
                "grads": {
                    n: None if p.grad is None else float(p.grad.norm())
                    for n, p in net.named_parameters()
                },
            }
        )
    return out


def gathered_parameters(scenario: Any, stage: int) -> dict[str, str]:
    """``deepspeed.zero.GatheredParameters`` over a wrapped engine's views (refused: it
    would gather nothing), disabled (allowed), over DeepSpeed's own parameters while
    they are lent (allowed); then training goes on, and after ``fv.unwrap()`` bare
    DeepSpeed gathers its parameters again."""
    out = {}
    with deepspeed_on_cpu() as deepspeed:
        engine, fv, _ = flatview_engine(deepspeed, scenario, stage, "several", 0.0)
        _train(engine, fv, scenario, range(1))
        module = engine.module
        gathered = deepspeed.zero.GatheredParameters

        def enter(*args: Any, **kwargs: Any) -> None:
            with gathered(*args, **kwargs):
                pass

        out["all views"] = _error(enter, module.parameters())
        out["one view, modifier"] = _error(lambda: enter(module.stem.weight, modifier_rank=0))
        out["disabled"] = _error(lambda: enter(list(module.parameters()), enabled=False))
        _train(engine, fv, scenario, range(1, 2))
        fv.unwrap()
        with gathered(list(module.parameters())):
            shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
        out["after unwrap"] = "whole" if shapes["stem.weight"] == (5, 3) else str(shapes)
        del engine, fv
    return out


def stepped_inside_window(stage: int) -> str:
    """gradient_accumulation_steps=2: after the first micro-step's backward, the ZeRO
    optimizer stepped directly (as Fabric steps it) instead of ``engine.step()``: what it
    raises on this rank."""
    from tests.scenarios import Scenario, local_batch, loss_of

    scenario = Scenario(world_size=dist.get_world_size(), accumulate=2)
    with deepspeed_on_cpu() as deepspeed:
        engine, fv, _ = flatview_engine(deepspeed, scenario, stage, "one", 0.0)
        xs, ys = local_batch(scenario, 0)
        with fv.step(skip=[]):
            engine.backward(loss_of(engine(xs), ys))
        found = _error(engine.optimizer.step)
        del engine, fv
    return found


def _entered(context: Any) -> None:
    """Enter and leave the context manager ``context()`` makes."""
    with context():
        pass


def against_bare(
    scenario: Any,
    stage: int,
    skipping: bool,
    bf16: bool = True,
    accumulate: int = 1,
    no_sync: bool = False,
) -> dict[str, Any]:
    """Training bare and wrapped, in the same processes: bf16 (``"bf16": {"enabled":
    True}``: bf16 parameters and gradients over fp32 masters) or fp32, ``accumulate``
    micro-steps per optimizer step (``gradient_accumulation_steps``). Skipping: flatview
    skips the scenario's blocks, bare DeepSpeed runs them with their residual times zero
    (:class:`tests.precision_workers.ZeroedNet`: exactly zero gradients, every other
    gradient the skipping model's), and both step plain SGD, which zero gradients leave
    exactly where they were. Nothing skipped: AdamW. ``no_sync`` (ZeRO 1): instead of
    ``gradient_accumulation_steps``, the first ``accumulate - 1`` micro-steps of each
    step inside ``engine.no_sync()``, ``engine.step()`` after the last. Every rank's
    parameters (ZeRO 1/2) and fp32 masters after the run, bare's and flatview's."""
    import flatview
    from tests.precision_workers import _net
    from tests.scenarios import local_batch, loss_of, skip_names

    out: dict[str, Any] = {}
    extra = {"gradient_accumulation_steps": 1 if no_sync else accumulate, "bf16": {"enabled": bf16}}
    with deepspeed_on_cpu() as deepspeed:
        for wrapped in (False, True):
            net = _net(scenario, zeroed=skipping and not wrapped)
            if not bf16:
                net = net.float()
            params = net.parameters()
            client = torch.optim.SGD(params, lr=0.1) if skipping else one_optimizer(params)
            config = ds_config(scenario, stage, 0.0, extra)
            engine, _, _, _ = deepspeed.initialize(model=net, optimizer=client, config=config)
            fv = flatview.wrap(engine) if wrapped else None
            for micro in range(len(scenario.skips)):
                x, y = local_batch(scenario, micro)
                skip = list(skip_names(scenario, micro)) if skipping else []
                last = (micro + 1) % accumulate == 0
                unsynced = engine.no_sync() if no_sync and not last else contextlib.nullcontext()
                with unsynced, fv.step(skip=skip) if fv is not None else contextlib.nullcontext():
                    engine.backward(loss_of(engine(x.bfloat16() if bf16 else x, skip), y))
                if last or not no_sync:
                    engine.step()
            state = {}
            if stage < 3:  # ZeRO 3's module holds empty partitions between passes
                bit16 = engine.module_state_dict()
                state = {k: v.float().numpy().copy() for k, v in bit16.items()}
            # The fp32 masters, whole (ZeRO 3's partitions end in uninitialised padding).
            if fv is not None:
                masters = full_params(fv, engine)
            else:
                from deepspeed.utils import safe_get_full_fp32_param

                masters = {
                    n: safe_get_full_fp32_param(p).detach().numpy().copy()
                    for n, p in engine.module.named_parameters()
                }
            state.update({f"master {n}": v for n, v in masters.items()})
            out["flatview" if wrapped else "bare"] = state
            del engine, fv, client
    return out


class _EngineSteps:
    """``engine.step()`` as the ``S`` of a :mod:`tests.leftover_workers` program (the
    engine drops the gradients itself)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def step(self) -> None:
        self.engine.step()

    def zero_grad(self) -> None:
        pass


def leftover_program(scenario: Any, stage: int, program: str) -> dict[str, Any]:
    """A :mod:`tests.leftover_workers` program on a ZeRO ``stage`` engine (its own AdamW
    over every view; ``S`` is ``engine.step()``): the full parameters, or what the first
    action that raised raised (``"error"``)."""
    from tests.leftover_workers import play
    from tests.scenarios import local_batch

    with deepspeed_on_cpu() as deepspeed:
        engine, fv, _ = flatview_engine(deepspeed, scenario, stage, "one", 0.0)
        steps = [_EngineSteps(engine)]
        try:
            play(scenario, program, engine, fv, steps, fv.parameters, local_batch)  # type: ignore[arg-type]
        except Exception as err:  # reported to the test
            result: dict[str, Any] = {"error": f"{type(err).__name__}: {err}"}
        else:
            result = {"params": full_params(fv, engine)}
        del engine, fv
    return result


def leftover_reference(scenario: Any, program: str) -> dict[str, np.ndarray]:
    """:func:`leftover_program` on the unwrapped net, with the engine's AdamW."""
    from tests.leftover_workers import play
    from tests.scenarios import batch, reference_model

    net, _ = reference_model(scenario)
    opt = one_optimizer(net.parameters())
    play(scenario, program, net, None, [opt], net.parameters, batch, windows=False)
    return {k: v.detach().numpy().copy() for k, v in net.named_parameters()}
