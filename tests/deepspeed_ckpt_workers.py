"""Tasks for the tests of DeepSpeed's own checkpoints on a wrapped engine
(``engine.save_checkpoint`` / ``load_checkpoint``), run on every rank of a worker pool."""

from __future__ import annotations

import contextlib
import glob
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from flatview.testing import deepspeed_on_cpu
from tests.deepspeed_workers import (
    _train,
    ds_config,
    flatview_engine,
    full_params,
    grouped_optimizer,
    muon_engine,
    one_optimizer,
)


@contextlib.contextmanager
def _shared_directory() -> Iterator[str]:
    """A directory rank 0 made, the same path on every rank (one machine)."""
    with tempfile.TemporaryDirectory() as local:
        box = [local]
        dist.broadcast_object_list(box, src=0)
        yield box[0]
        dist.barrier()


def _bare_engine(deepspeed: Any, scenario: Any, stage: int, grouped: bool = True) -> Any:
    from tests.scenarios import make_net

    net = make_net(scenario)
    client = grouped_optimizer(net) if grouped else one_optimizer(net.parameters())
    engine, _, _, _ = deepspeed.initialize(
        model=net, optimizer=client, config=ds_config(scenario, stage, 0.0, None)
    )
    return engine


def _bare_params(engine: Any, stage: int) -> dict[str, np.ndarray]:
    import deepspeed

    out = {}
    for name, param in engine.module.named_parameters():
        gathered = deepspeed.zero.GatheredParameters([param]) if stage == 3 else None
        with gathered or contextlib.nullcontext():
            out[name] = param.detach().clone().numpy()
    return out


def engine_checkpoints(scenario: Any, stage: int, split: int) -> dict[str, Any]:
    """The scenario on ZeRO ``stage`` with per-submodule optimizers: ``split`` steps,
    ``engine.save_checkpoint`` (with a client state), the rest; a fresh engine, wrapped,
    ``engine.load_checkpoint``, the rest again. Also what a wrapped engine loads with
    ``load_module_only``, what ``zero_to_fp32`` exports from the files, and what bare
    DeepSpeed loads from them (weights only)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    steps = range(len(scenario.skips))
    out: dict[str, Any] = {}
    with deepspeed_on_cpu() as deepspeed, _shared_directory() as directory:
        engine, fv, opts = flatview_engine(deepspeed, scenario, stage, "several", 0.0)
        _train(engine, fv, scenario, range(split))
        out["at_save"] = full_params(fv, engine)
        engine.save_checkpoint(directory, client_state={"epoch": 7})
        _train(engine, fv, scenario, range(split, steps.stop))
        out["continued"] = full_params(fv, engine)
        del engine, fv, opts
        engine, fv, opts = flatview_engine(deepspeed, scenario, stage, "several", 0.0)
        _, client = engine.load_checkpoint(directory)
        out["client"] = {k: v for k, v in client.items() if k == "epoch"}
        out["global_steps"] = engine.global_steps
        out["loaded"] = full_params(fv, engine)
        _train(engine, fv, scenario, range(split, steps.stop))
        out["resumed"] = full_params(fv, engine)
        del engine, fv, opts
        # Weights only (a warm start), wrapped: DeepSpeed's own paths for it. (Bare
        # DeepSpeed 0.19.8 under ZeRO 3 restores no weight with load_module_only alone,
        # and flatview does as it does: it needs load_optimizer_states=False too.)
        engine, fv, opts = flatview_engine(deepspeed, scenario, stage, "several", 0.0)
        engine.load_checkpoint(directory, load_module_only=True, load_optimizer_states=False)
        out["module_only"] = full_params(fv, engine)
        out["fresh_state"] = all(not o.state for o in opts)
        del engine, fv, opts
        dist.barrier()
        exported = get_fp32_state_dict_from_zero_checkpoint(directory)
        out["exported"] = {k: v.detach().numpy().copy() for k, v in exported.items()}
        bare = _bare_engine(deepspeed, scenario, stage)
        bare.load_checkpoint(directory, load_optimizer_states=False)
        out["bare_loaded"] = _bare_params(bare, stage)
        del bare
    return out


def bare_then_flatview(scenario: Any, stage: int, split: int) -> dict[str, Any]:
    """A run bare DeepSpeed started (the engine's own AdamW in two groups, nothing
    skipped) saved with ``engine.save_checkpoint``; a fresh engine with the same
    optimizer, wrapped by flatview, loads it and trains the rest with skip sets."""
    from tests.scenarios import local_batch, loss_of

    with deepspeed_on_cpu() as deepspeed, _shared_directory() as directory:
        bare = _bare_engine(deepspeed, scenario, stage)
        for micro in range(split):
            assert not scenario.skips[micro]
            xs, ys = local_batch(scenario, micro)
            bare.backward(loss_of(bare(xs), ys))
            bare.step()
        bare.save_checkpoint(directory)
        del bare
        engine, fv, opts = flatview_engine(deepspeed, scenario, stage, "groups", 0.0)
        engine.load_checkpoint(directory)
        _train(engine, fv, scenario, range(split, len(scenario.skips)))
        params = full_params(fv, engine)
        del engine, fv, opts
    return {"params": params}


def _error(call: Any, *args: Any, **kwargs: Any) -> str:
    try:
        call(*args, **kwargs)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "allowed"


def refused_checkpoints(scenario: Any, stage: int) -> dict[str, str]:
    """What a wrapped engine refuses of DeepSpeed's checkpoints, each on every rank:
    saving inside an iteration; loading into an optimizer built otherwise than the one
    that saved; a bare DeepSpeed file into flatview.optim.Deferred; a file damaged on
    one rank only (every rank raises, none waits). Training goes on."""
    from tests.scenarios import local_batch, loss_of

    out = {}
    with deepspeed_on_cpu() as deepspeed, _shared_directory() as directory:
        engine, fv, opts = flatview_engine(deepspeed, scenario, stage, "several", 0.0)
        _train(engine, fv, scenario, range(1))
        xs, ys = local_batch(scenario, 1)
        with fv.step():
            loss = loss_of(engine(xs), ys)
            out["inside an iteration"] = _error(engine.save_checkpoint, directory)
            engine.backward(loss)
        engine.step()
        engine.save_checkpoint(directory, tag="views")
        del engine, fv, opts
        engine, fv, opts = flatview_engine(deepspeed, scenario, stage, "one", 0.0)
        out["another optimizer"] = _error(engine.load_checkpoint, directory, tag="views")
        _train(engine, fv, scenario, range(1))
        del engine, fv, opts
        bare = _bare_engine(deepspeed, scenario, stage, grouped=False)
        bare.save_checkpoint(directory, tag="bare")
        del bare
        engine, fv, opts = flatview_engine(deepspeed, scenario, stage, "several", 0.0)
        out["bare into Deferred"] = _error(engine.load_checkpoint, directory, tag="bare")
        _train(engine, fv, scenario, range(1))
        del engine, fv, opts
        # One rank's ZeRO file damaged (its masters gone): that rank alone refuses it.
        if dist.get_rank() == 1:
            (path,) = glob.glob(f"{directory}/views/*zero_pp_rank_1_*optim_states.pt")
            damaged = torch.load(path, weights_only=False)
            damaged["optimizer_state_dict"].pop(_MASTERS[stage])
            torch.save(damaged, path)
        dist.barrier()
        engine, fv, opts = flatview_engine(deepspeed, scenario, stage, "several", 0.0)
        out["one rank's file"] = _error(engine.load_checkpoint, directory, tag="views")
        _train(engine, fv, scenario, range(1))
        del engine, fv, opts
    return out


_FLAT_GROUPS = "single_partition_of_fp32_groups"
_MASTERS = {1: _FLAT_GROUPS, 2: _FLAT_GROUPS, 3: "fp32_flat_groups"}
"""Where DeepSpeed's ZeRO files keep the fp32 masters, per stage."""


def writes_between_steps(scenario: Any, stage: int) -> dict[str, float]:
    """After a step, every view written in place (as a user's re-initialisation or a
    loaded checkpoint writes it): the next forward computes on the written values;
    written again, ``engine.save_16bit_model`` saves them; written again and
    ``fv.unwrap()``, bare DeepSpeed's forward computes on them."""
    from tests.scenarios import local_batch, make_net

    zero = {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True}
    extra = {"zero_optimization": zero}
    out = {}
    with deepspeed_on_cpu() as deepspeed, _shared_directory() as directory:
        engine, fv, opts = flatview_engine(deepspeed, scenario, stage, "several", 0.0, extra)
        _train(engine, fv, scenario, range(2))
        xs, _ = local_batch(scenario, 2)
        for case, scale in (("forward", 0.5), ("save_16bit_model", 1.5), ("after unwrap", 2.0)):
            with torch.no_grad():
                for number, view in enumerate(fv.parameters()):
                    view.mul_(scale).add_(0.01 * number)
            written = full_params(fv, engine)
            if case == "save_16bit_model":
                engine.save_16bit_model(directory)
                dist.barrier()
                saved = torch.load(f"{directory}/pytorch_model.bin", weights_only=True)
                out[case] = max(
                    float(np.abs(saved[k].numpy() - v).max()) for k, v in written.items()
                )
                continue
            if case == "after unwrap":
                fv.unwrap()
            with torch.no_grad():
                got = engine(xs)
            net = make_net(scenario)
            net.load_state_dict({k: torch.from_numpy(v) for k, v in written.items()}, strict=False)
            with torch.no_grad():
                want = net(xs)
            out[case] = float((got - want).abs().max())
        del engine, fv, opts
    return out


def _continued_and_resumed(
    build: Any, train: Any, split: int, steps: int
) -> dict[str, dict[str, np.ndarray]]:
    """``split`` steps of ``build(deepspeed)``'s engine, ``engine.save_checkpoint``, the
    rest (``"continued"``); a fresh engine loads and trains the rest again
    (``"resumed"``): the full parameters after each."""
    out = {}
    with deepspeed_on_cpu() as deepspeed, _shared_directory() as directory:
        engine, fv = build(deepspeed)
        train(engine, fv, range(split))
        engine.save_checkpoint(directory)
        train(engine, fv, range(split, steps))
        out["continued"] = full_params(fv, engine)
        del engine, fv
        engine, fv = build(deepspeed)
        engine.load_checkpoint(directory)
        train(engine, fv, range(split, steps))
        out["resumed"] = full_params(fv, engine)
        del engine, fv
    return out


def whole_engine_checkpoints(scenario: Any, stage: int, split: int) -> dict[str, Any]:
    """``Whole(torch.optim.Muon)`` on the matrices and AdamW on the rest, handed to the
    engine's Deferred, resumed through the engine's checkpoints
    (:func:`_continued_and_resumed`)."""

    def build(deepspeed: Any) -> tuple[Any, Any]:
        engine, fv, _, _ = muon_engine(deepspeed, scenario, stage, {"lr": 0.02})
        return engine, fv

    def train(engine: Any, fv: Any, micros: range) -> None:
        _train(engine, fv, scenario, micros)

    return _continued_and_resumed(build, train, split, len(scenario.skips))


def bf16_engine_checkpoints(scenario: Any, stage: int, split: int) -> dict[str, Any]:
    """DeepSpeed's bf16 with the engine's AdamW, skip sets and clipping, resumed through
    the engine's checkpoints (:func:`_continued_and_resumed`; the fp32 masters, whole)."""
    import flatview
    from tests.scenarios import local_batch, loss_of, make_net, skip_names

    def build(deepspeed: Any) -> tuple[Any, Any]:
        net = make_net(scenario)
        config = ds_config(scenario, stage, 1.0, {"bf16": {"enabled": True}})
        engine, _, _, _ = deepspeed.initialize(
            model=net, optimizer=one_optimizer(net.parameters()), config=config
        )
        return engine, flatview.wrap(engine)

    def train(engine: Any, fv: Any, micros: range) -> None:
        for micro in micros:
            x, y = local_batch(scenario, micro)
            skip = list(skip_names(scenario, micro))
            with fv.step(skip=skip):
                engine.backward(loss_of(engine(x.bfloat16(), skip), y))
            engine.step()

    return _continued_and_resumed(build, train, split, len(scenario.skips))
