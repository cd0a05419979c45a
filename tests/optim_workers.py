"""Worker functions for the optimizer-state tests (run in the pool), and the
single-process reference they are compared with.

Training is that of :func:`tests.scenarios.run_distributed` and
:func:`tests.scenarios.run_reference` (their loops,
:func:`~tests.scenarios.distributed_training` and
:func:`~tests.scenarios.reference_training`: same model, data, per-submodule optimizers,
skip sets, accumulation, evaluation passes and zeroing), but can stop after any
optimizer step and start again from a checkpoint: parameters by name, and each
optimizer's consolidated state.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import flatview
from flatview.errors import OptimStateError
from flatview.testing.counting import CollectiveCounter
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
    reference_model,
    reference_training,
    wrap_fsdp,
)
from tests.workers import flats_and_shards

State = dict[str, Any]
"""A consolidated optimizer state dict with numpy arrays for tensors."""


def as_numpy(state: dict[str, Any]) -> State:
    """``state`` with every tensor as a numpy array (0-dim tensors too), for pickling and
    comparing in the test process."""

    def convert(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.detach().cpu().numpy().copy()
        return value

    return {
        "state": {
            name: {key: convert(value) for key, value in entry.items()}
            for name, entry in state["state"].items()
        },
        "param_groups": state["param_groups"],
    }


def as_torch(state: State) -> dict[str, Any]:
    """The inverse of :func:`as_numpy`."""
    return {
        "state": {
            name: {
                key: torch.from_numpy(np.array(value)) if isinstance(value, np.ndarray) else value
                for key, value in entry.items()
            }
            for name, entry in state["state"].items()
        },
        "param_groups": state["param_groups"],
    }


# ----------------------------------------------------------------------- reference


def reference(
    scenario: Scenario, steps: int | None = None
) -> tuple[dict[str, np.ndarray], list[State]]:
    """Train ``scenario`` in one process without any wrapper (as
    :func:`~tests.scenarios.run_reference`) for its first ``steps`` optimizer steps (all
    by default); return the parameters and each optimizer's ``state_dict()`` with
    parameter names in place of numbers."""
    net, opts = reference_model(scenario)
    for _ in reference_training(scenario, net, opts, optimizer_steps(scenario)[:steps]):
        pass
    names = {id(p): n for n, p in net.named_parameters()}
    states = []
    for opt in opts:
        saved = opt.state_dict()
        order = [names[id(p)] for group in opt.param_groups for p in group["params"]]
        states.append(
            as_numpy(
                {
                    "state": {order[k]: v for k, v in saved["state"].items()},
                    "param_groups": [
                        {**g, "params": [order[k] for k in g["params"]]}
                        for g in saved["param_groups"]
                    ],
                }
            )
        )
    params = {k: v.detach().numpy().copy() for k, v in net.named_parameters()}
    return params, states


# ------------------------------------------------------------------- distributed side


def _build(
    scenario: Scenario, params: dict[str, np.ndarray] | None = None
) -> tuple[nn.Module, flatview.FlatView, list[torch.optim.Optimizer]]:
    net = make_net(scenario)
    if params is not None:
        # A checkpoint of the parameters by name (tied copies are one parameter).
        missing, unexpected = net.load_state_dict(
            {k: torch.from_numpy(v) for k, v in params.items()}, strict=False
        )
        assert not unexpected and all(k == "head_copy.weight" for k in missing), missing
    return distributed_model(scenario, net)


def _train(
    model: nn.Module,
    fv: flatview.FlatView,
    opts: Sequence[torch.optim.Optimizer],
    scenario: Scenario,
    steps: Sequence[range],
) -> None:
    """The training loop of :func:`~tests.scenarios.run_distributed`, for ``steps``."""
    for _ in distributed_training(scenario, model, fv, opts, steps):
        pass


def consolidated(scenario: Scenario, rank0_only: bool = False) -> list[State]:
    """Train the whole scenario with FSDP + flatview; every rank returns each optimizer's
    consolidated state."""
    with backend_context(scenario.backend):
        model, fv, opts = _build(scenario)
        _train(model, fv, opts, scenario, optimizer_steps(scenario))
        return [as_numpy(fv.optim_state_dict(opt, rank0_only=rank0_only)) for opt in opts]


def both_ways(scenario: Scenario) -> tuple[list[State], list[State], int]:
    """After training: each optimizer's state consolidated on every rank and on rank 0
    only, and how many collectives the latter issued."""
    with backend_context(scenario.backend):
        model, fv, opts = _build(scenario)
        _train(model, fv, opts, scenario, optimizer_steps(scenario))
        everywhere = [as_numpy(fv.optim_state_dict(opt)) for opt in opts]
        with CollectiveCounter() as counter:
            only = [as_numpy(fv.optim_state_dict(opt, rank0_only=True)) for opt in opts]
        return everywhere, only, sum(counter.calls.values())


def save(scenario: Scenario, steps: int) -> tuple[dict[str, np.ndarray], list[State]] | None:
    """Train the first ``steps`` optimizer steps; rank 0 returns the checkpoint: the full
    parameters and each optimizer's consolidated state (gathered on rank 0 only)."""
    with backend_context(scenario.backend):
        model, fv, opts = _build(scenario)
        _train(model, fv, opts, scenario, optimizer_steps(scenario)[:steps])
        states = [fv.optim_state_dict(opt, rank0_only=True) for opt in opts]
        params = full_state(model, scenario)
        if dist.get_rank() != 0:
            return None
        assert params is not None
        return params, [as_numpy(s) for s in states]


def resume(
    scenario: Scenario,
    checkpoint: tuple[dict[str, np.ndarray], list[State]],
    steps: int,
) -> tuple[dict[str, np.ndarray] | None, list[State]]:
    """Build the model from the checkpoint's parameters, load each optimizer's state,
    train the optimizer steps from ``steps`` on; return the final parameters (rank 0)
    and optimizer states."""
    params, states = checkpoint
    with backend_context(scenario.backend):
        model, fv, opts = _build(scenario, params)
        assert len(opts) == len(states)
        for opt, state in zip(opts, states, strict=True):
            fv.load_optim_state_dict(opt, as_torch(state))
        _train(model, fv, opts, scenario, optimizer_steps(scenario)[steps:])
        final = [as_numpy(fv.optim_state_dict(opt)) for opt in opts]
        return full_state(model, scenario), final


def fairscale_methods(scenario: Scenario) -> tuple[list[State | None], list[str], bool]:
    """After training on fairscale: what the root's ``gather_full_optim_state_dict``
    returns for each optimizer, the error ``get_shard_from_optim_state_dict`` raises
    with it (empty if none), and whether ``unwrap()`` gave fairscale its methods back."""
    names = ("gather_full_optim_state_dict", "get_shard_from_optim_state_dict")
    with backend_context(scenario.backend):
        model, fv, opts = _build(scenario)
        _train(model, fv, opts, scenario, optimizer_steps(scenario))
        gathered = [model.gather_full_optim_state_dict(opt) for opt in opts]
        # Every rank loads the saved file: rank 0's state.
        shared: list[Any] = [gathered]
        dist.broadcast_object_list(shared, src=0)
        refusals = []
        for state in shared[0]:
            try:
                model.get_shard_from_optim_state_dict(state)
            except OptimStateError as error:
                refusals.append(str(error))
            else:
                refusals.append("")
        fv.unwrap()
        restored = all(name not in vars(unit) for unit in model.modules() for name in names)
        return [None if s is None else as_numpy(s) for s in gathered], refusals, restored


def resumes_bare(
    scenario: Scenario, saved_at: int
) -> tuple[dict[str, np.ndarray] | None, dict[str, np.ndarray] | None, str]:
    """The bare wrapper (one Adam over ``model.parameters()``, as fairseq builds it) trains
    ``saved_at`` optimizer steps, saves the optimizer state its own way (fairscale:
    ``gather_full_optim_state_dict``, by position; torch FSDP1: ``FSDP.optim_state_dict``,
    by name) and its parameters, rank 0's loaded by every rank as a file, and trains on.
    The same checkpoint resumes under flatview: Adam over the views, loaded with
    ``FlatView.load_optim_state_dict``, trains the same steps. Rank 0 returns both final
    parameters; every rank the error of loading the state into the model with other
    units (one root unit; empty if it loads)."""
    steps = optimizer_steps(scenario)
    with backend_context(scenario.backend):
        model = wrap_fsdp(scenario, make_net(scenario))
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        _train_bare(model, opt, scenario, steps[:saved_at])
        if scenario.backend == "fairscale":
            # fairscale turns each live `step` tensor into an int (it edits the entries
            # of opt.state_dict(), which are the optimizer's own): torch's Adam then
            # refuses to step. The bare run goes on from its state as it was.
            kept = copy.deepcopy(opt.state_dict())
            state = model.gather_full_optim_state_dict(opt)
            opt.load_state_dict(kept)
        else:
            from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

            state = TorchFSDP.optim_state_dict(model, opt)
        shared: list[Any] = [(state, full_state(model, scenario))]
        dist.broadcast_object_list(shared, src=0)
        saved, params = shared[0]
        _train_bare(model, opt, scenario, steps[saved_at:])
        bare = full_state(model, scenario)

        def resumed(
            scenario: Scenario,
        ) -> tuple[nn.Module, flatview.FlatView, torch.optim.Optimizer]:
            net = make_net(scenario)
            net.load_state_dict({k: torch.from_numpy(v) for k, v in params.items()}, strict=False)
            model = wrap_fsdp(scenario, net)
            fv = flatview.wrap(model)
            opt = torch.optim.Adam(fv.parameters(), lr=0.05)
            fv.load_optim_state_dict(opt, copy.deepcopy(saved))
            return model, fv, opt

        model, fv, opt = resumed(scenario)
        for step in steps[saved_at:]:
            for micro in step:
                x, y = local_batch(scenario, micro)
                with fv.step():
                    loss_of(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        got = full_state(model, scenario)
        try:
            resumed(replace(scenario, nested=False))
        except OptimStateError as error:
            other_units = str(error)
        else:
            other_units = ""
        return bare, got, other_units


def _train_bare(
    model: nn.Module, opt: torch.optim.Optimizer, scenario: Scenario, steps: Sequence[range]
) -> None:
    for step in steps:
        for micro in step:
            x, y = local_batch(scenario, micro)
            loss_of(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def ignored_head(scenario: Scenario) -> dict[str, Any]:
    """torch FSDP told to ignore the head: its parameters stay plain (replicated, not
    flattened) and their state is taken as it is; a round trip loads it back."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    net = make_net(scenario)
    model = TorchFSDP(net, ignored_modules=[net.head], device_id=torch.device("cpu"))
    fv = flatview.wrap(model)
    opt = torch.optim.AdamW(fv.parameters(), lr=0.1)
    x, y = local_batch(scenario, 0)
    with fv.step():
        loss_of(model(x), y).backward()
    opt.step()
    head = {n: p for n, p in fv.named_parameters() if n.startswith("head.")}
    state = fv.optim_state_dict(opt)
    fresh = torch.optim.AdamW(fv.parameters(), lr=0.5)
    fv.load_optim_state_dict(fresh, state)
    return {
        "plain": all(p is getattr(net.head, n.split(".")[1]) for n, p in head.items()),
        "as_is": all(
            torch.equal(state["state"][n][k], opt.state[p][k])
            for n, p in head.items()
            for k in opt.state[p]
        ),
        "reloaded": all(
            torch.equal(fresh.state[p][k], opt.state[p][k])
            for p in fv.parameters()
            for k in opt.state[p]
        ),
        "lr": fresh.param_groups[0]["lr"],
    }


# -------------------------------------------------------------------------- errors


def _attempt(call: Any) -> tuple[str, int]:
    """The error ``call`` raised (type and message) and the collectives it issued."""
    with CollectiveCounter() as counter:
        try:
            call()
        except OptimStateError as err:
            return f"{type(err).__name__}: {err}", sum(counter.calls.values())
    return "no error", sum(counter.calls.values())


def _local_numel(param: torch.Tensor) -> int:
    """How many elements of ``param`` this rank holds (FSDP2: its DTensor's local piece;
    ``numel()`` counts the whole parameter)."""
    return int(getattr(param, "to_local", lambda: param)().numel())


def error_cases(scenario: Scenario) -> dict[str, tuple[str, int]]:
    """Every way to misuse consolidation and loading, one after the other on the same
    model: per case, the error and how many collectives ran before it."""
    out: dict[str, tuple[str, int]] = {}
    rank = dist.get_rank()
    with backend_context(scenario.backend):
        model, fv, opts = _build(scenario)
        _train(model, fv, opts, scenario, optimizer_steps(scenario))
        adamw = opts[0]
        named = dict(fv.named_parameters())

        if scenario.config.flattens:  # FSDP2 has no flat parameters to pass by mistake
            flat, _ = flats_and_shards(model, scenario.backend)[0]
            over_flat = torch.optim.SGD([named["stem.bias"], flat], lr=0.1)
            out["flat"] = _attempt(lambda: fv.optim_state_dict(over_flat))
        stranger = nn.Parameter(torch.zeros(2, 3))
        foreign = torch.optim.SGD([{"params": [named["head.bias"]]}, {"params": [stranger]}])
        out["foreign"] = _attempt(lambda: fv.optim_state_dict(foreign, rank0_only=True))
        # Only rank 1's optimizer holds a stranger: every rank must raise, none may hang.
        lonely = foreign if rank == 1 else torch.optim.SGD([named["head.bias"]], lr=0.1)
        out["foreign_one_rank"] = _attempt(lambda: fv.optim_state_dict(lonely))
        out["foreign_load"] = _attempt(
            lambda: fv.load_optim_state_dict(foreign, {"state": {}, "param_groups": []})
        )

        good = fv.optim_state_dict(adamw)
        some = good["param_groups"][0]["params"][0]

        def renamed() -> dict[str, Any]:
            groups = [dict(g, params=list(g["params"])) for g in good["param_groups"]]
            groups[0]["params"][0] = "body.0.nonexistent"
            return {"state": good["state"], "param_groups": groups}

        def dropped() -> dict[str, Any]:
            groups = [dict(g, params=list(g["params"][1:])) for g in good["param_groups"]]
            state = {k: v for k, v in good["state"].items() if k != some}
            return {"state": state, "param_groups": groups}

        def stray_state() -> dict[str, Any]:
            return {
                "state": {**good["state"], "stem.weight": {}},
                "param_groups": good["param_groups"],
            }

        def misshapen() -> dict[str, Any]:
            name = next(n for n, s in good["state"].items() if "exp_avg" in s)
            entry = dict(good["state"][name])
            entry["exp_avg"] = torch.zeros(entry["exp_avg"].numel() + 1)
            return {"state": {**good["state"], name: entry}, "param_groups": good["param_groups"]}

        def extra_group() -> dict[str, Any]:
            return {"state": good["state"], "param_groups": [*good["param_groups"], {"params": []}]}

        for case, make in (
            ("unknown_name", renamed),
            ("missing_name", dropped),
            ("stray_state", stray_state),
            ("shape", misshapen),
            ("groups", extra_group),
        ):
            bad = make()
            out[case] = _attempt(lambda bad=bad: fv.load_optim_state_dict(adamw, bad))

        # Ranks that disagree: every rank must raise the same error, none may hang. (Not
        # under NO_SHARD: there every rank holds everything and nothing is compared.)
        if dist.get_world_size() > 1 and not scenario.config.replicated:
            # A parameter that ranks 0 and 1 both hold elements of (others are not asked).
            group = adamw.param_groups[0]["params"]
            here = torch.tensor([_local_numel(p) > 0 for p in group])
            everywhere = [torch.empty_like(here) for _ in range(dist.get_world_size())]
            dist.all_gather(everywhere, here)
            shared = group[int((everywhere[0] & everywhere[1]).nonzero()[0])]
            # (A rank holding none of it has no state for it: its view got no gradient.)
            if rank == 1:
                saved_step = adamw.state[shared]["step"].clone()
                adamw.state[shared]["step"] += 1
            out["step_disagrees"] = _attempt(lambda: fv.optim_state_dict(adamw))
            if rank == 1:
                adamw.state[shared]["step"] = saved_step
            # Rank 1 lost the state of a parameter it holds elements of.
            held = next(p for p in adamw.param_groups[0]["params"] if _local_numel(p) > 0)
            kept = adamw.state[held]
            if rank == 1:
                del adamw.state[held]
            out["state_missing"] = _attempt(lambda: fv.optim_state_dict(adamw))
            adamw.state[held] = kept
            # Rank 1 passes a different optimizer.
            other = opts[1] if rank == 1 else adamw
            out["different_optimizers"] = _attempt(lambda: fv.optim_state_dict(other))
        # State that is neither per-element nor scalar (a factored statistic, say).
        odd = adamw.param_groups[0]["params"][-1]
        before = adamw.state.get(odd)
        adamw.state[odd] = {**(before or {}), "factored": torch.zeros(odd.numel() + 2)}
        out["not_consolidable"] = _attempt(lambda: fv.optim_state_dict(adamw))
        if before is None:
            del adamw.state[odd]
        else:
            adamw.state[odd] = before
        # After all that, consolidation still works (no rank was left behind).
        out["still_works"] = (
            "same" if _same_state(fv.optim_state_dict(adamw), good) else "changed",
            0,
        )
    return out


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    return all(
        a["state"][n].keys() == b["state"][n].keys()
        and all(
            torch.equal(v, b["state"][n][k])
            if isinstance(v, torch.Tensor)
            else v == b["state"][n][k]
            for k, v in a["state"][n].items()
        )
        for n in a["state"]
    )


def regrouped(scenario: Scenario) -> dict[str, Any]:
    """One AdamW over every view (one group) trains two steps; its consolidated state
    loads with ``regroup=True`` into two new AdamWs, the body's in two groups (weight
    decay on matrices only) and the rest's: each one's state afterwards, the saved
    state, their groups' weight decays, and what loading without ``regroup`` raised."""
    with backend_context(scenario.backend):
        model, fv, _ = _build(scenario)
        opt = torch.optim.AdamW(fv.parameters(), lr=0.05, weight_decay=0.1)
        _train(model, fv, [opt], scenario, optimizer_steps(scenario)[:2])
        saved = fv.optim_state_dict(opt)
        named = dict(fv.named_parameters())
        matrices = [
            p for n, p in named.items() if n.startswith("body.") and len(fv.shape_of(p)) > 1
        ]
        others = [p for n, p in named.items() if n.startswith("body.") and len(fv.shape_of(p)) <= 1]
        rest = [p for n, p in named.items() if not n.startswith("body.")]
        split = torch.optim.AdamW(
            [{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}],
            lr=0.05,
        )
        head = torch.optim.AdamW(rest, lr=0.05, weight_decay=0.1)
        try:
            fv.load_optim_state_dict(split, copy.deepcopy(saved))
            refused = ""
        except OptimStateError as error:
            refused = str(error)
        for new in (split, head):
            fv.load_optim_state_dict(new, copy.deepcopy(saved), regroup=True)
        return {
            "saved": as_numpy(saved),
            "loaded": [as_numpy(fv.optim_state_dict(new)) for new in (split, head)],
            "decays": [[g["weight_decay"] for g in new.param_groups] for new in (split, head)],
            "refused": refused,
        }
