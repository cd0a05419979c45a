"""torch FSDP1's own optimizer-state functions on optimizers over the original parameters
of a model flatview wraps: two served by flatview.checkpoint, the others refused over
flatview's views (installed by
:mod:`flatview.checkpoint_routing` with its mark), and what both modules read of an
optimizer: the views it holds.

torch FSDP1's own optimizer-state functions (``FSDP.optim_state_dict``,
``optim_state_dict_to_load``, ``full_optim_state_dict``, ``sharded_optim_state_dict``,
``shard_full_optim_state_dict``, ``flatten_sharded_optim_state_dict``,
``scatter_full_optim_state_dict``), which Lightning's ``FSDPStrategy`` and accelerate's
FSDP1 plugin call, know FSDP's flat parameters (or torch's own original parameters),
not flatview's views: given an optimizer over views they pair collectives of different
sizes across ranks (an error on gloo, possibly a hang on NCCL). All of them go through
two private static methods of ``FullyShardedDataParallel`` (``_optim_state_dict_impl``,
``_optim_state_dict_to_load_impl``) before any collective; those are replaced once per
process (after the same check of their parameters) by wrappers that refuse, with a
:class:`flatview.FlatViewError` naming what to use instead, a call whose model holds a
marked one and whose optimizer holds flatview's views. The decision is local and the
same on every rank whose optimizers are counterparts, so every rank raises.

Served instead, where the call's model is the marked one: ``FSDP.optim_state_dict`` and
``FSDP.optim_state_dict_to_load``, the pair frameworks save and load with (Lightning's
``FSDPStrategy``, accelerate's FSDP1 plugin and through it the Hugging Face
``Trainer``), for one optimizer, in the form ``FSDP.state_dict_type`` says
(:func:`_routed`), so that what they write with torch's DCP resumes exactly: a sharded
dict cut FSDP's way (torch's recipe) is moved to the views' pieces first
(:mod:`flatview.reshard`), a full dict on rank 0 alone (``rank0_only``, accelerate's
way) handed to every rank (:mod:`flatview.rank0_state`). Not an ``optim_input``,
another process group or a named optimizer: those stay refused.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from flatview.comm.refusals import raise_everywhere
from flatview.errors import FlatViewError

if TYPE_CHECKING:
    from flatview.runtime import Runtime

RuntimeOf = Callable[[nn.Module], "Runtime | None"]
"""The runtime of a module carrying the routing's mark; ``None`` for any other."""

_fsdp_originals: dict[str, Callable[..., Any]] = {}
"""torch FSDP1's optimizer-state implementations, once replaced."""


def signature_of(fn: Callable[..., Any]) -> list[tuple[str, Any]]:
    """Names and kinds of ``fn``'s parameters: a wrapper stands in for a helper of
    torch's only where torch can call it the same way."""
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


def install_refusals(runtime_of: RuntimeOf) -> None:
    """Replace torch FSDP1's two optimizer-state implementations by refusing wrappers
    (once per process; not where their parameters differ from this torch's).
    ``runtime_of``: the runtime of a marked module, ``None`` for any other."""
    if _fsdp_originals:
        return
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    found = {name: vars(FSDP).get(name) for name in _FSDP_PARAMETERS}
    for name, expected in _FSDP_PARAMETERS.items():
        impl = found[name]
        if not isinstance(impl, staticmethod) or signature_of(impl.__func__)[:3] != expected:
            return  # another torch
    for name, impl in found.items():
        assert isinstance(impl, staticmethod)
        _fsdp_originals[name] = impl.__func__
        setattr(FSDP, name, staticmethod(_refusing(name, impl.__func__, runtime_of)))


_FSDP_PARAMETERS = {
    "_optim_state_dict_impl": [
        ("model", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ("optim", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ("optim_state_dict", inspect.Parameter.POSITIONAL_OR_KEYWORD),
    ],
    "_optim_state_dict_to_load_impl": [
        ("optim_state_dict", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ("model", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ("optim_input", inspect.Parameter.POSITIONAL_OR_KEYWORD),
    ],
}
"""The leading parameters of each implementation the wrappers read."""


def _refusing(name: str, original: Callable[..., Any], runtime_of: RuntimeOf) -> Callable[..., Any]:
    signature = inspect.signature(original)

    def impl(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind_partial(*args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        model = given.get("model")
        if isinstance(model, nn.Module):
            held: list[Any] = []
            optim = given.get("optim")
            if isinstance(optim, torch.optim.Optimizer):
                held.append(optim)
            optim_input = given.get("optim_input")
            if optim_input is not None:
                held.append(optim_input)
            caller = sys._getframe(1).f_code.co_name
            runtime = runtime_of(model)
            served = isinstance(optim, torch.optim.Optimizer) and _routable(caller, given)
            if runtime is not None and served and params_held(runtime, optim):
                return _routed(caller, runtime, given)
            _refuse_call(caller, model, held, runtime_of)
        return original(*args, **kwargs)

    return impl


_ROUTED_CALLERS = ("optim_state_dict", "optim_state_dict_to_load")
"""The two FSDP functions served over views (what Lightning's ``FSDPStrategy``,
accelerate's FSDP1 plugin and the Hugging Face ``Trainer`` call); the others, deprecated
in torch, stay refused."""


def _routable(caller: str, given: Mapping[str, Any]) -> bool:
    """Whether a call of FSDP's ``caller`` can be served by flatview.checkpoint: one
    optimizer, no ``optim_input`` or process group of its own."""
    if caller not in _ROUTED_CALLERS or given.get("optim_input") is not None:
        return False
    return given.get("group") is None and not given.get("is_named_optimizer")


def _routed(caller: str, runtime: Runtime, given: Mapping[str, Any]) -> Any:
    """FSDP's ``caller`` on an optimizer over the model's original parameters (flatview's
    views, or torch's own with ``use_orig_params=True``), served by flatview.checkpoint's
    optimizer half: ``optim_state_dict`` gives the dict of
    ``flatview.checkpoint.get_optimizer_state_dict`` in the form of the model's
    ``FSDP.state_dict_type`` (full: whole tensors, on rank 0 only with ``rank0_only``;
    sharded: a ``ShardedTensor`` per parameter), keyed by original name as FSDP's own;
    ``optim_state_dict_to_load`` loads such a dict (or one cut FSDP's way, or a full one
    on rank 0 alone) into the optimizer and hands back its ``state_dict()`` for the
    caller's ``load_state_dict`` (which then changes nothing)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from flatview import checkpoint_optim, expert_state, rank0_state, reshard

    optim = given["optim"]
    if caller == "optim_state_dict":
        full = bool(given["full_state_dict"])
        offload = bool(given["rank0_only"]) if full else bool(given["cpu_offload"])
        options = StateDictOptions(full_state_dict=full, cpu_offload=offload)
        return checkpoint_optim.optimizers_state(runtime, [optim], options)
    state_dict = given["optim_state_dict"]
    if (
        isinstance(state_dict, Mapping)
        and "state" not in state_dict
        and "param_groups" in state_dict
    ):
        # DCP saves no empty dict: an optimizer without state (its parameters never
        # used yet) comes back from torch's sharded recipe without "state".
        state_dict = {**state_dict, "state": {}}
    if given["full_state_dict"] and given["rank0_only"]:
        # accelerate's FSDP1 plugin loads a full dict on rank 0 alone (others: None).
        expert_state.refuse_rank0_only(runtime.table, f"FullyShardedDataParallel.{caller}")
        state_dict = rank0_state.from_rank0(runtime, state_dict)
    elif not given["full_state_dict"]:
        # torch's recipe cuts the template of a sharded load from the model's state
        # dict, FSDP's way: the elements move to the views' pieces first (collective).
        state_dict = reshard.to_pieces(runtime, state_dict)
    failure: BaseException | None = None
    try:
        checkpoint_optim.load_optimizers_state(runtime, [optim], state_dict)
    except Exception as err:
        failure = err
    # The load is local: a rank refusing its dict alone raises on every rank (the others
    # would go on to the framework's next collective and wait there).
    call = f"FullyShardedDataParallel.{caller} (served by flatview.checkpoint)"
    raise_everywhere(failure, (), runtime.adapter.agreement_group, call)
    return optim.state_dict()


def _refuse_call(caller: str, model: nn.Module, held: list[Any], runtime_of: RuntimeOf) -> None:
    """Refuse FSDP's optimizer-state function ``caller`` on ``model`` if a module of it
    carries the mark and an optimizer (or ``optim_input``) of the call holds flatview's
    views of it, before any collective."""
    if not held:
        return
    runtimes = [r for module in model.modules() if (r := runtime_of(module)) is not None]
    for runtime in runtimes:
        for optimizer in held:
            names = views_held(runtime, optimizer)
            if names:
                kind = type(optimizer).__name__
                raise FlatViewError(
                    f"FullyShardedDataParallel.{caller} cannot handle optimizer {kind}, "
                    f"which holds flatview's views ({shown(names)}) of a torch FSDP model: "
                    "FSDP's optimizer-state functions know its flat parameters, not views, "
                    "and would pair collectives of different sizes across ranks. Save and "
                    "load through torch.distributed.checkpoint.state_dict (get_state_dict / "
                    "set_state_dict, which flatview routes to flatview.checkpoint), "
                    "flatview.checkpoint, or fv.optim_state_dict / fv.load_optim_state_dict"
                )


def params_of(optimizer: Any) -> Iterable[Any]:
    """The tensors of an optimizer, or of an ``optim_input`` (parameters, or parameter
    groups as dicts)."""
    groups = optimizer.param_groups if isinstance(optimizer, torch.optim.Optimizer) else optimizer
    for entry in groups:
        if isinstance(entry, dict):
            yield from entry.get("params", ())
        else:
            yield entry


def params_held(runtime: Runtime, optimizer: Any) -> bool:
    """Whether ``optimizer`` holds original parameters of the model: flatview's views, or
    torch's own (``use_orig_params=True``), whose optimizer state torch's functions
    cannot save or load where some have none yet (parameters skipped so far)."""
    return any(
        isinstance(tensor, torch.Tensor) and runtime.index_of(tensor) is not None
        for tensor in params_of(optimizer)
    )


def views_held(runtime: Runtime, optimizer: Any) -> list[str]:
    """Names of the parameters of ``optimizer`` that torch's functions would misread:
    flatview's own views, and parameters the wrapper shards one by one."""
    table = runtime.table
    names = []
    for tensor in params_of(optimizer):
        index = runtime.index_of(tensor) if isinstance(tensor, torch.Tensor) else None
        if index is None:
            continue
        # A plain parameter with a padded-shard placement is one the wrapper shards by
        # itself (fairscale's flatten_parameters=False).
        if table.own_view(index) or table.placement_of(index).padded_shard:
            names.append(table.name(index))
    return names


def shown(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")
