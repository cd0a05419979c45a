"""Worker tasks of tests/test_checkpoint_api.py: checkpoints through
``torch.distributed.checkpoint`` (DCP) with optimizers over views.

A run trains the first ``split`` optimizer steps of a scenario, saves model and
optimizers with DCP, trains on to the end (the uninterrupted run), then builds a fresh
model, flatview and optimizers, loads the checkpoint and trains the remaining steps
(the resumed run). Both runs' final parameters come back, with the consolidated
optimizer state (``fv.optim_state_dict``) at the save and right after the load.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions

import flatview.checkpoint as fcp
from flatview import FlatView, FlatViewError
from tests.scenarios import (
    Scenario,
    backend_context,
    distributed_model,
    distributed_training,
    full_state,
    local_batch,
    loss_of,
    make_net,
    optimizer_steps,
    wrap_fsdp,
)

State = dict[str, Any]
"""A consolidated optimizer state with numpy arrays for tensors (picklable, comparable)."""


def as_numpy(state: dict[str, Any]) -> State:
    """Tensors of a (nested) state dict as numpy arrays, 0-dim ones as python numbers."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out[key] = as_numpy(value)
        elif isinstance(value, list):
            out[key] = [as_numpy(v) if isinstance(v, dict) else v for v in value]
        elif isinstance(value, torch.Tensor):
            array = value.detach().cpu().numpy().copy()
            out[key] = array.item() if array.ndim == 0 else array
        else:
            out[key] = value
    return out


def consolidated(fv: FlatView, opts: list[torch.optim.Optimizer]) -> State:
    """Every optimizer's ``fv.optim_state_dict``, merged as flatview.checkpoint merges them."""
    merged: dict[str, Any] = {"state": {}, "param_groups": []}
    for opt in opts:
        part = fv.optim_state_dict(opt)
        merged["state"].update(part["state"])
        merged["param_groups"].extend(part["param_groups"])
    return as_numpy(merged)


def _options(full: bool) -> StateDictOptions:
    return StateDictOptions(full_state_dict=full)


def _sequence() -> int:
    group: Any = dist.distributed_c10d._get_default_group()
    return int(group._get_sequence_number_for_group())


def torch_api_refused(scenario: Scenario) -> dict[str, Any]:
    """On a torch whose private helpers flatview cannot route through (simulated: the
    model is wrapped while ``_install_routes`` answers no), torch's four functions, full
    and sharded, each raise FlatViewError with optimizers over views, before any
    collective; a model-only call still works; so does flatview's own pair, afterwards
    (nothing was left half done)."""
    from torch.distributed.checkpoint import state_dict as dsd

    from flatview import checkpoint_routing

    out: dict[str, Any] = {"messages": [], "collectives": []}
    install = checkpoint_routing._install_routes
    with backend_context(scenario.backend):
        checkpoint_routing._install_routes = lambda: False  # type: ignore[assignment]
        try:
            model, fv, opts = distributed_model(scenario)
        finally:
            checkpoint_routing._install_routes = install  # type: ignore[assignment]
        for _ in distributed_training(scenario, model, fv, opts, optimizer_steps(scenario)[:1]):
            pass
        before = consolidated(fv, opts)
        for full in (False, True):
            for call in _torch_calls(model, opts, _options(full)):
                start = _sequence()
                try:
                    call()
                except FlatViewError as err:
                    out["messages"].append(str(err))
                else:
                    out["messages"].append(None)
                out["collectives"].append(_sequence() - start)
        refused = (
            StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
            StateDictOptions(flatten_optimizer_state_dict=True),
        )
        for options in refused:
            start = _sequence()
            try:
                fcp.get_state_dict(fv, model, opts, options=options)
            except FlatViewError as err:
                out["messages"].append(str(err))
            else:
                out["messages"].append(None)
            out["collectives"].append(_sequence() - start)
        if scenario.backend == "torch":
            model_sd = dsd.get_model_state_dict(model, options=_options(True))
            out["model_keys"] = sorted(model_sd)
        out["unchanged"] = _same(consolidated(fv, opts), before)
        fcp.get_state_dict(fv, model, opts, options=_options(False))
        out["flatview_ok"] = _same(consolidated(fv, opts), before)
        fv.unwrap()
        out["mark_removed"] = "_fqn_modifiers" not in vars(model)
    return out


FSDP_OPTIM_FUNCTIONS = (
    "full_optim_state_dict",
    "sharded_optim_state_dict",
    "shard_full_optim_state_dict",
    "flatten_sharded_optim_state_dict",
    "scatter_full_optim_state_dict",
)
"""torch FSDP1's own optimizer-state functions (static methods of the wrapper class)
that flatview refuses over views; ``optim_state_dict`` and ``optim_state_dict_to_load``
it serves."""


def _fsdp_calls(model: Any, opt: torch.optim.Optimizer) -> list[Any]:
    """Each of :data:`FSDP_OPTIM_FUNCTIONS`, called on ``model`` with ``opt`` (the load
    side with an empty state: flatview refuses before reading it)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return [
        lambda: FSDP.full_optim_state_dict(model, opt),
        lambda: FSDP.sharded_optim_state_dict(model, opt),
        lambda: FSDP.shard_full_optim_state_dict({}, model, optim=opt),
        lambda: FSDP.flatten_sharded_optim_state_dict({}, model, opt),
        lambda: FSDP.scatter_full_optim_state_dict({}, model, optim=opt),
    ]


def fsdp_optim_api(scenario: Scenario) -> dict[str, Any]:
    """torch FSDP1's own optimizer-state functions on a flatview-wrapped model, after one
    optimizer step: each refused one called with every optimizer over views (its error
    message or ``None``, and the collectives it issued), the consolidated state before
    and after; the two served (``optim_state_dict`` in FSDP's default full form, as
    Lightning's FSDPStrategy and accelerate's FSDP1 plugin call it): whether it equals
    ``fv.optim_state_dict``, and whether ``optim_state_dict_to_load`` of it, loaded,
    leaves the state as it was, a dict one rank alone refuses refused on every rank, and
    a full dict on rank 0 alone (``rank0_only``: ``None`` elsewhere) loaded unchanged on
    every rank, or refused on every rank where rank 0 cannot load it;
    then, in the same process, a bare FSDP model of the same scenario (no flatview) with
    an optimizer over its flat parameters: torch's ``optim_state_dict`` and
    ``optim_state_dict_to_load`` there, as without flatview (the keys it gives, and
    whether the state loads back unchanged)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from flatview import rank0_state

    out: dict[str, Any] = {"messages": [], "collectives": []}
    with backend_context(scenario.backend):
        model, fv, opts = distributed_model(scenario)
        for _ in distributed_training(scenario, model, fv, opts, optimizer_steps(scenario)[:1]):
            pass
        before = consolidated(fv, opts)
        for opt in opts:
            for call in _fsdp_calls(model, opt):
                start = _sequence()
                try:
                    call()
                except FlatViewError as err:
                    out["messages"].append(str(err))
                else:
                    out["messages"].append(None)
                out["collectives"].append(_sequence() - start)
        out["unchanged"] = _same(consolidated(fv, opts), before)
        out["served"] = []
        for opt in opts:
            served = FSDP.optim_state_dict(model, opt)
            equal = _same(as_numpy(served), as_numpy(fv.optim_state_dict(opt)))
            opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, served))
            out["served"].append(equal)
        out["served_unchanged"] = _same(consolidated(fv, opts), before)
        # A dict only rank 0 refuses: every rank raises, none goes on alone.
        good = FSDP.optim_state_dict(model, opts[0])
        mine = {"state": {}, "param_groups": None} if dist.get_rank() == 0 else good
        try:
            opts[0].load_state_dict(FSDP.optim_state_dict_to_load(model, opts[0], mine))
        except FlatViewError as err:
            out["one_rank_refuses"] = str(err)
        from torch.distributed.fsdp import (
            FullOptimStateDictConfig,
            FullStateDictConfig,
            StateDictType,
        )

        # The full form on rank 0 alone, loaded as accelerate's FSDP1 plugin loads it
        # (every other rank passes None): every rank gets its pieces, for every optimizer.
        rank0 = FullOptimStateDictConfig(rank0_only=True)
        with FSDP.state_dict_type(
            model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(), rank0
        ):
            kept = [FSDP.optim_state_dict(model, opt) for opt in opts]
            out["rank0_saved"] = [bool(k.get("state")) for k in kept]
            bucket = rank0_state.BUCKET_NUMEL
            rank0_state.BUCKET_NUMEL = 7  # many broadcasts, some tensors larger than one
            try:
                for opt, full in zip(opts, kept, strict=True):
                    opt.load_state_dict(
                        FSDP.optim_state_dict_to_load(
                            model, opt, full if dist.get_rank() == 0 else None
                        )
                    )
            finally:
                rank0_state.BUCKET_NUMEL = bucket
            out["rank0_loaded"] = _same(consolidated(fv, opts), before)
            # What rank 0 alone cannot load raises on every rank, none waits for it.
            try:
                opts[0].load_state_dict(FSDP.optim_state_dict_to_load(model, opts[0], {}))
            except FlatViewError as err:
                out["rank0_refused"] = str(err)
        bare = wrap_fsdp(scenario, make_net(scenario))
        opt = torch.optim.Adam(bare.parameters(), lr=0.01)
        xs, ys = local_batch(scenario, 0)
        loss_of(bare(xs, ()), ys).backward()
        opt.step()
        saved = FSDP.optim_state_dict(bare, opt)
        out["bare_keys"] = sorted(saved["state"])
        own = as_numpy(opt.state_dict())
        opt.load_state_dict(FSDP.optim_state_dict_to_load(bare, opt, saved))
        out["bare_reloaded"] = _same(as_numpy(opt.state_dict()), own)
    return out


def torch_options_refused(scenario: Scenario) -> dict[str, Any]:
    """torch's functions routed to flatview.checkpoint refuse what it refuses
    (``broadcast_from_rank0``, ``flatten_optimizer_state_dict``, ``submodules=``), before
    any collective, on every rank: each error's message and collectives issued."""
    from torch.distributed.checkpoint import state_dict as dsd

    out: dict[str, Any] = {"messages": [], "collectives": []}
    with backend_context(scenario.backend):
        model, fv, opts = distributed_model(scenario)
        calls = [
            lambda: dsd.get_state_dict(
                model,
                opts,
                options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
            ),
            lambda: dsd.get_optimizer_state_dict(
                model, opts, options=StateDictOptions(flatten_optimizer_state_dict=True)
            ),
            lambda: dsd.get_model_state_dict(model, submodules={fv.model}),
        ]
        for call in calls:
            start = _sequence()
            try:
                call()
            except FlatViewError as err:
                out["messages"].append(str(err))
            else:
                out["messages"].append(None)
            out["collectives"].append(_sequence() - start)
    return out


def _torch_calls(model: Any, opts: list[Any], options: StateDictOptions) -> list[Any]:
    """torch's four state-dict functions, each called with optimizers over views."""
    from torch.distributed.checkpoint import state_dict as dsd

    return [
        lambda: dsd.get_state_dict(model, opts, options=options),
        lambda: dsd.get_optimizer_state_dict(model, opts[0], options=options),
        lambda: dsd.set_state_dict(
            model, opts, model_state_dict={}, optim_state_dict={}, options=options
        ),
        lambda: dsd.set_optimizer_state_dict(model, opts, {}, options=options),
    ]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.shape == b.shape and bool(np.array_equal(a, b))
    return bool(a == b)


def _get(api: str, fv: FlatView, model: Any, opts: list[Any], full: bool) -> tuple[Any, Any]:
    """The model and optimizer state dicts through ``api``: ``"flatview"``
    (flatview.checkpoint) or ``"torch"`` (torch's own functions, routed to it)."""
    if api == "torch":
        from torch.distributed.checkpoint import state_dict as dsd

        return dsd.get_state_dict(model, opts, options=_options(full))
    return fcp.get_state_dict(fv, model, opts, options=_options(full))


def save_and_resume(
    scenario: Scenario, paths: dict[bool, str], split: int, api: str = "flatview"
) -> dict[str, Any]:
    """Train ``split`` steps, save through ``api`` (:func:`_get`) + DCP (sharded to
    ``paths[False]``, full to ``paths[True]``), train on; then resume a fresh model from
    each checkpoint and train the same remaining steps."""
    steps = optimizer_steps(scenario)
    out: dict[str, Any] = {}
    with backend_context(scenario.backend):
        model, fv, opts = distributed_model(scenario)
        for _ in distributed_training(scenario, model, fv, opts, steps[:split]):
            pass
        out["saved"] = consolidated(fv, opts)
        for full, path in paths.items():
            model_sd, optim_sd = _get(api, fv, model, opts, full)
            if full:
                out["full_equal"] = _same(as_numpy(optim_sd), out["saved"])
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        for _ in distributed_training(scenario, model, fv, opts, steps[split:]):
            pass
        out["uninterrupted"] = full_state(model, scenario)
        for full, path in paths.items():
            out[full] = resume(scenario, path, split, full, api)
    return out


def resume(
    scenario: Scenario, path: str, split: int, full: bool, api: str = "flatview"
) -> dict[str, Any]:
    """A fresh model, flatview and optimizers loaded from ``path`` through ``api``
    (:func:`_get`), then trained from step ``split`` on: the consolidated state after
    the load, the final parameters."""
    model, fv, opts = distributed_model(scenario)
    model_sd, optim_sd = _get(api, fv, model, opts, full)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    if api == "torch":
        from torch.distributed.checkpoint import state_dict as dsd

        dsd.set_state_dict(
            model,
            opts,
            model_state_dict=model_sd,
            optim_state_dict=optim_sd,
            options=_options(full),
        )
    else:
        fcp.set_state_dict(
            fv,
            model,
            opts,
            model_state_dict=model_sd,
            optim_state_dict=optim_sd,
            options=_options(full),
        )
    loaded = consolidated(fv, opts)
    for _ in distributed_training(scenario, model, fv, opts, optimizer_steps(scenario)[split:]):
        pass
    return {"loaded": loaded, "params": full_state(model, scenario)}


def resume_elsewhere(
    scenario: Scenario, paths: dict[bool, str], split: int, api: str = "flatview"
) -> dict[str, Any]:
    """:func:`resume` from each checkpoint (saved at another world size or backend)."""
    with backend_context(scenario.backend):
        return {full: resume(scenario, path, split, full, api) for full, path in paths.items()}


def read_states_midway(scenario: Scenario, split: int) -> dict[str, np.ndarray] | None:
    """Train, read every form of the state after ``split`` steps (``fv.optim_state_dict``,
    flatview.checkpoint's sharded and full dicts, torch's ``get_state_dict`` and
    ``get_optimizer_state_dict`` as frameworks call them, and on torch FSDP1 its own
    ``FSDP.optim_state_dict``), train on: rank 0's final parameters. Reading must leave
    the optimizers and the model as they were."""
    from torch.distributed.checkpoint import state_dict as dsd

    steps = optimizer_steps(scenario)
    with backend_context(scenario.backend):
        model, fv, opts = distributed_model(scenario)
        for _ in distributed_training(scenario, model, fv, opts, steps[:split]):
            pass
        for opt in opts:
            fv.optim_state_dict(opt)
        for full in (False, True):
            fcp.get_state_dict(fv, model, opts, options=_options(full))
            dsd.get_state_dict(model, opts, options=_options(full))
            for opt in opts:
                dsd.get_optimizer_state_dict(model, opt, options=_options(full))
        if scenario.backend == "torch":
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            for opt in opts:
                FSDP.optim_state_dict(model, opt)
        for _ in distributed_training(scenario, model, fv, opts, steps[split:]):
            pass
        return full_state(model, scenario)


def _forms(value: Any) -> Any:
    """A state dict's tensors as numpy (ShardedTensors as their local shards with offsets,
    DTensors as their local tensor): two dicts with equal forms are the same state in the
    same form."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(value, dict):
        return {k: _forms(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_forms(v) for v in value]
    if isinstance(value, ShardedTensor):
        shards = value.local_shards()
        return {
            "sharded": list(value.size()),
            "offsets": [list(s.metadata.shard_offsets) for s in shards],
            "shards": [s.tensor.detach().cpu().numpy().copy() for s in shards],
        }
    if isinstance(value, DTensor):
        local = value.to_local().detach().cpu().numpy().copy()
        return {"dtensor": list(value.size()), "local": local}
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy().copy()
    return value


def torch_functions_resume(
    scenario: Scenario, paths: dict[bool, str], split: int
) -> dict[str, Any]:
    """torch's own functions, on a flatview-wrapped model with optimizers over views:
    after ``split`` steps, ``get_state_dict`` (sharded to ``paths[False]``, full to
    ``paths[True]``) compared with flatview.checkpoint's and saved with DCP; training
    goes on (the uninterrupted run); then a fresh model per checkpoint, loaded with
    torch's ``get_state_dict`` + DCP + ``set_state_dict`` (the sharded one with the
    optimizer-only and model-only pairs instead), trained to the end."""
    from torch.distributed.checkpoint import state_dict as dsd

    steps = optimizer_steps(scenario)
    out: dict[str, Any] = {}
    with backend_context(scenario.backend):
        model, fv, opts = distributed_model(scenario)
        for _ in distributed_training(scenario, model, fv, opts, steps[:split]):
            pass
        out["saved"] = consolidated(fv, opts)
        for full, path in paths.items():
            options = _options(full)
            theirs = dsd.get_state_dict(model, opts, options=options)
            ours = fcp.get_state_dict(fv, model, opts, options=options)
            out[("same", full)] = _same(_forms(theirs), _forms(ours))
            optim_only = dsd.get_optimizer_state_dict(model, opts, options=options)
            model_only = dsd.get_model_state_dict(model, options=options)
            out[("same_optim", full)] = _same(_forms(optim_only), _forms(ours[1])) and _same(
                _forms(model_only), _forms(ours[0])
            )
            dcp.save({"model": theirs[0], "optim": theirs[1]}, checkpoint_id=path)
        out["unchanged"] = _same(consolidated(fv, opts), out["saved"])
        for _ in distributed_training(scenario, model, fv, opts, steps[split:]):
            pass
        out["uninterrupted"] = full_state(model, scenario)
        for full, path in paths.items():
            # strict=False: torch's strict load wants state for every parameter, and
            # plain SGD keeps none (stem's optimizer; on DDP torch loads it itself).
            options = StateDictOptions(full_state_dict=full, strict=False)
            model, fv, opts = distributed_model(scenario)
            model_sd, optim_sd = dsd.get_state_dict(model, opts, options=options)
            dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
            if full:
                dsd.set_state_dict(
                    model,
                    opts,
                    model_state_dict=model_sd,
                    optim_state_dict=optim_sd,
                    options=options,
                )
            else:
                dsd.set_optimizer_state_dict(model, opts, optim_sd, options=options)
                dsd.set_model_state_dict(model, model_sd, options=options)
            loaded = consolidated(fv, opts)
            for _ in distributed_training(scenario, model, fv, opts, steps[split:]):
                pass
            out[full] = {"loaded": loaded, "params": full_state(model, scenario)}
    return out


def fsdp1_recipe(scenario: Scenario, path: str, split: int, save: bool) -> dict[str, Any]:
    """torch's recipe for FSDP1's sharded checkpoints (what Lightning's ``FSDPStrategy``
    runs), on a flatview-wrapped model with optimizers over views. With ``save``: train
    ``split`` steps, save under ``SHARDED_STATE_DICT`` the model's ``state_dict`` and
    each optimizer's ``FSDP.optim_state_dict`` with DCP, train on (the uninterrupted
    run). Then a fresh model loads the model state with DCP, each optimizer's through
    ``load_sharded_optimizer_state_dict`` (a template cut from the model's sharded
    state dict, FSDP's way) and ``FSDP.optim_state_dict_to_load``, and trains the
    remaining steps. ``moved``: the entries the load moved to the views' pieces."""
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    from flatview import reshard

    steps = optimizer_steps(scenario)
    out: dict[str, Any] = {"moved": 0}
    with backend_context(scenario.backend):
        if save:
            model, fv, opts = distributed_model(scenario)
            for _ in distributed_training(scenario, model, fv, opts, steps[:split]):
                pass
            out["saved"] = consolidated(fv, opts)
            with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
                saved = {"model": model.state_dict()}
                for i, opt in enumerate(opts):
                    saved[f"optim_{i}"] = FSDP.optim_state_dict(model, opt)
                dcp.save(saved, checkpoint_id=path)
            for _ in distributed_training(scenario, model, fv, opts, steps[split:]):
                pass
            out["uninterrupted"] = full_state(model, scenario)
        model, fv, opts = distributed_model(scenario)
        plan = reshard.plan

        def counted(*args: Any) -> reshard.Plan:
            decided = plan(*args)
            out["moved"] += len(decided.moving)
            return decided

        reshard.plan = counted  # type: ignore[assignment]
        try:
            with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
                model_sd = {"model": model.state_dict()}
                dcp.load(model_sd, checkpoint_id=path)
                model.load_state_dict(model_sd["model"])
                reader = dcp.FileSystemReader(path)
                for i, opt in enumerate(opts):
                    key = f"optim_{i}"
                    loaded = load_sharded_optimizer_state_dict(
                        model_state_dict=model_sd["model"], optimizer_key=key, storage_reader=reader
                    )
                    opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, loaded[key]))
        finally:
            reshard.plan = plan  # type: ignore[assignment]
        out["loaded"] = consolidated(fv, opts)
        for _ in distributed_training(scenario, model, fv, opts, steps[split:]):
            pass
        out["params"] = full_state(model, scenario)
    return out


def _adamw(params: Any) -> torch.optim.Optimizer:
    """The one optimizer of the bare-run checkpoints: AdamW over every parameter."""
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1, eps=1e-4)


def _bare_run(scenario: Scenario, steps: Any) -> tuple[Any, torch.optim.Optimizer]:
    """A bare FSDP model of ``scenario`` (no flatview) and its :func:`_adamw`, trained
    ``steps`` (nothing may be skipped: bare FSDP cannot)."""
    model = wrap_fsdp(scenario, make_net(scenario))
    opt = _adamw(model.parameters())
    for _ in distributed_training(scenario, model, None, [opt], steps):
        pass
    return model, opt


def bare_fsdp1_resumed(scenario: Scenario, path: str, split: int) -> dict[str, Any]:
    """A run bare torch FSDP1 started (flat parameters, one AdamW over them), saved after
    ``split`` steps through FSDP's own pair in both forms (sharded with DCP to ``path``;
    full, kept), trained on (the uninterrupted run); then resumed under flatview, one
    AdamW over the views, from each form through torch's recipe (sharded:
    ``load_sharded_optimizer_state_dict`` + ``FSDP.optim_state_dict_to_load``) and
    trained to the end. Nothing is skipped (bare FSDP cannot): the runs should agree."""
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    import flatview

    steps = optimizer_steps(scenario)
    kinds = {"sharded": StateDictType.SHARDED_STATE_DICT, "full": StateDictType.FULL_STATE_DICT}
    out: dict[str, Any] = {}
    with backend_context(scenario.backend):
        model, opt = _bare_run(scenario, steps[:split])
        with FSDP.state_dict_type(model, kinds["sharded"]):
            saved = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}
            dcp.save(saved, checkpoint_id=path)
        with FSDP.state_dict_type(model, kinds["full"]):
            full = (model.state_dict(), FSDP.optim_state_dict(model, opt))
        for _ in distributed_training(scenario, model, None, [opt], steps[split:]):
            pass
        out["uninterrupted"] = full_state(model, scenario)
        for form, kind in kinds.items():
            model = wrap_fsdp(scenario, make_net(scenario))
            fv = flatview.wrap(model)
            opt = _adamw(fv.parameters())
            with FSDP.state_dict_type(model, kind):
                if form == "full":
                    model.load_state_dict(full[0])
                    osd = full[1]
                else:
                    model_sd = {"model": model.state_dict()}
                    dcp.load(model_sd, checkpoint_id=path)
                    model.load_state_dict(model_sd["model"])
                    osd = load_sharded_optimizer_state_dict(
                        model_state_dict=model_sd["model"],
                        optimizer_key="optim",
                        storage_reader=dcp.FileSystemReader(path),
                    )["optim"]
                opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, osd))
            for _ in distributed_training(scenario, model, fv, [opt], steps[split:]):
                pass
            out[form] = full_state(model, scenario)
    return out


def bare_fsdp2_both_ways(scenario: Scenario, path: str, split: int) -> dict[str, Any]:
    """FSDP2 checkpoints through torch's own functions across adding and removing
    flatview (one AdamW over all parameters, nothing skipped): a bare run saves after
    ``split`` steps (``DTensor`` s) and trains on (the uninterrupted run); a run under
    flatview resumes from it (torch's functions routed: ``ShardedTensor`` s), saves
    after the same steps and trains on; a bare run resumes from that one. Every run's
    final parameters."""
    from torch.distributed.checkpoint import state_dict as dsd

    import flatview

    def resumed(saved: str, wrap: bool, then_save: str | None) -> Any:
        model = wrap_fsdp(scenario, make_net(scenario))
        fv = flatview.wrap(model) if wrap else None
        opt = _adamw(model.parameters())
        model_sd, optim_sd = dsd.get_state_dict(model, opt)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=saved)
        dsd.set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        if then_save is not None:
            model_sd, optim_sd = dsd.get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=then_save)
        for _ in distributed_training(scenario, model, fv, [opt], steps[split:]):
            pass
        return full_state(model, scenario)

    steps = optimizer_steps(scenario)
    out: dict[str, Any] = {}
    with backend_context(scenario.backend):
        model, opt = _bare_run(scenario, steps[:split])
        model_sd, optim_sd = dsd.get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{path}/bare")
        for _ in distributed_training(scenario, model, None, [opt], steps[split:]):
            pass
        out["uninterrupted"] = full_state(model, scenario)
        out["flatview"] = resumed(f"{path}/bare", True, f"{path}/flatview")
        out["bare_again"] = resumed(f"{path}/flatview", False, None)
    return out


class Delegating(torch.optim.Optimizer):
    """An optimizer wrapper as accelerate's ``AcceleratedOptimizer`` is one: ``state``
    and ``param_groups`` are properties over the optimizer it wraps, setters included."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.defaults = optimizer.defaults

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, state: Any) -> None:
        self.optimizer.state = state

    @property
    def param_groups(self) -> Any:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: Any) -> None:
        self.optimizer.param_groups = groups

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)


def through_a_wrapper(scenario: Scenario, split: int, api: str) -> dict[str, Any]:
    """Train ``split`` steps (some parameters never stepped: no state), then take the
    state dicts (sharded and full, through ``api``: :func:`_get`) of the optimizers
    wrapped in :class:`Delegating`: whether the state dicts equal those of the bare
    optimizers, and whether the optimizers kept their parameters and state."""
    out: dict[str, Any] = {}
    with backend_context(scenario.backend):
        model, fv, opts = distributed_model(scenario)
        for _ in distributed_training(scenario, model, fv, opts, optimizer_steps(scenario)[:split]):
            pass
        held = [[list(g["params"]) for g in o.param_groups] for o in opts]
        before = consolidated(fv, opts)
        for full in (False, True):
            _, through = _get(api, fv, model, [Delegating(o) for o in opts], full)
            _, bare = _get(api, fv, model, opts, full)
            out[full] = _same(as_numpy(_local(through)), as_numpy(_local(bare)))
        out["params_kept"] = all(
            a is b
            for o, groups in zip(opts, held, strict=True)
            for g, params in zip(o.param_groups, groups, strict=True)
            for a, b in zip(g["params"], params, strict=True)
        )
        out["state_kept"] = _same(consolidated(fv, opts), before)
    return out


def _local(state: Any) -> Any:
    """``state`` with each ``ShardedTensor`` as this rank's local shards, concatenated."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(state, dict):
        return {key: _local(value) for key, value in state.items()}
    if isinstance(state, list):
        return [_local(value) for value in state]
    if isinstance(state, ShardedTensor):
        shards = [shard.tensor.reshape(-1) for shard in state.local_shards()]
        return torch.cat(shards) if shards else torch.zeros(0)
    return state


# ------------------------------------------------- optimizers that step optimizers


class Lookahead(torch.optim.Optimizer):
    """Lookahead's design (timm's): steps the optimizer it keeps as an attribute, whose
    parameter groups it shares (its step counter lives in them), and every ``k`` steps
    pulls the weights halfway back towards slow copies kept in that optimizer's state;
    its state dicts are the inner optimizer's. Its own ``state`` stays empty, so every
    parameter looks stateless to a reader."""

    def __init__(self, inner: torch.optim.Optimizer, k: int = 2) -> None:
        self.inner = inner
        self.param_groups = inner.param_groups
        self.defaults = dict(inner.defaults, lookahead_k=k, lookahead_step=0)
        self.state: Any = defaultdict(dict)
        self._optimizer_step_pre_hooks: Any = OrderedDict()
        self._optimizer_step_post_hooks: Any = OrderedDict()
        for group in self.param_groups:
            group.setdefault("lookahead_k", k)
            group.setdefault("lookahead_step", 0)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)
        # torch's load makes new group dicts: share them again.
        self.param_groups = self.inner.param_groups

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = self.inner.step(closure)
        for group in self.inner.param_groups:
            group["lookahead_step"] += 1
            if group["lookahead_step"] % group["lookahead_k"]:
                continue
            for p in group["params"]:
                if p.grad is not None:
                    slow = self.inner.state[p].setdefault("slow", p.detach().clone())
                    slow.add_(p - slow, alpha=0.5)
                    p.copy_(slow)
        return loss


class Chained(torch.optim.Optimizer):
    """Steps the optimizers it keeps in a list, where no attribute reaches them."""

    def __init__(self, inner: list[torch.optim.Optimizer]) -> None:
        self.inner = list(inner)
        self.param_groups = [g for o in self.inner for g in o.param_groups]
        self.defaults = dict(self.inner[0].defaults)
        self.state: Any = defaultdict(dict)
        self._optimizer_step_pre_hooks: Any = OrderedDict()
        self._optimizer_step_post_hooks: Any = OrderedDict()

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        for optimizer in self.inner:
            optimizer.step()


def _stepping(
    design: str, opts: list[torch.optim.Optimizer], k: int = 2
) -> list[torch.optim.Optimizer]:
    """The design over ``opts`` (a Lookahead pulling every ``k`` steps), of a class of its
    own: torch hooks an optimizer class's step at its first ``zero_grad`` where its
    ``__init__`` is not torch's (as here), so a class shared between runs would be hooked
    from the start of the later ones."""
    if design == "lookahead":
        fresh = type("Lookahead", (Lookahead,), {})
        return [fresh(o, k) for o in opts]
    return [type("Chained", (Chained,), {})(opts)]


def reading_stepping_optimizers(
    scenario: Scenario, design: str, pause: int | None
) -> dict[str, Any]:
    """Train the scenario with its optimizers inside ``design`` (``"lookahead"``: each in
    a :class:`Lookahead`; ``"chained"``: all in one :class:`Chained`), twice: once
    plain, once reading the state (flatview's and torch's functions, sharded and full)
    at pause ``pause`` of :func:`~tests.scenarios.distributed_training` (even: between
    a backward and its step, gradients in place; ``None``: after the first step's
    ``zero_grad``, no gradients). Rank 0's final parameters of both runs, and what each
    read raised."""
    out: dict[str, Any] = {"errors": []}

    def read(fv: FlatView, model: Any, stepping: list[torch.optim.Optimizer]) -> None:
        for api in ("flatview", "torch"):
            for full in (False, True):
                try:
                    _get(api, fv, model, stepping, full)
                except FlatViewError as err:
                    out["errors"].append(f"{type(err).__name__}: {err}")

    steps = optimizer_steps(scenario)
    with backend_context(scenario.backend):
        for reading in (False, True):
            model, fv, opts = distributed_model(scenario)
            stepping = _stepping(design, opts)
            halves = (steps[:1], steps[1:]) if pause is None else (steps,)
            for half, part in enumerate(halves):
                for number, _ in enumerate(
                    distributed_training(scenario, model, fv, stepping, part)
                ):
                    if reading and number == pause:
                        read(fv, model, stepping)
                if reading and pause is None and half == 0:
                    read(fv, model, stepping)
            out[reading] = full_state(model, scenario)
            fv.unwrap()
    return out


def lookahead_resumes(scenario: Scenario, path: str, split: int) -> dict[str, Any]:
    """The scenario's optimizers inside :class:`Lookahead`: train ``split`` steps, save
    (flatview.checkpoint's sharded form + DCP), train on; then a fresh model with fresh
    Lookaheads loads it and trains the same remaining steps. Rank 0's final parameters
    of both runs (placeholders for the parameters without state carry the inner
    optimizer's keys, which the fresh template's priming creates). Every third step
    pulls, after the save: DCP loads only the keys of a template from fresh optimizers,
    which slow weights made at an earlier pull would not be among (torch's functions
    alike)."""
    steps = optimizer_steps(scenario)
    out: dict[str, Any] = {}
    with backend_context(scenario.backend):
        model, fv, opts = distributed_model(scenario)
        stepping = _stepping("lookahead", opts, k=3)
        for _ in distributed_training(scenario, model, fv, stepping, steps[:split]):
            pass
        model_sd, optim_sd = fcp.get_state_dict(fv, model, stepping, options=_options(False))
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        for _ in distributed_training(scenario, model, fv, stepping, steps[split:]):
            pass
        out["uninterrupted"] = full_state(model, scenario)
        model, fv, opts = distributed_model(scenario)
        stepping = _stepping("lookahead", opts, k=3)
        model_sd, optim_sd = fcp.get_state_dict(fv, model, stepping, options=_options(False))
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        fcp.set_state_dict(
            fv, model, stepping, model_state_dict=model_sd, optim_state_dict=optim_sd
        )
        for _ in distributed_training(scenario, model, fv, stepping, steps[split:]):
            pass
        out["resumed"] = full_state(model, scenario)
    return out
