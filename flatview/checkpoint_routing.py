"""torch's own checkpoint functions on models wrapped by flatview, with optimizers over
views: torch's DCP functions routed to flatview's DCP state, torch FSDP1's own
optimizer-state functions refused.

``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizers)`` (and
``get_optimizer_state_dict``, ``set_state_dict``, ``set_optimizer_state_dict``, the
model-only pair) is what frameworks checkpoint with: Lightning's and Fabric's
``ModelParallelStrategy``, accelerate's FSDP2 plugin, torchtitan. Left alone, torch would
take each view's optimizer state for the state of a whole flat parameter (or of a whole
parameter). So every call of one of them on a model flatview wraps (the handle installs
:func:`route_torch_checkpoint` on every backend) gives what the :mod:`flatview.checkpoint`
function of the same name gives (model and optimizer state by original name,
DCP-savable, loadable at another world size or backend, or into the unwrapped model;
:mod:`flatview.checkpoint_model`, :mod:`flatview.checkpoint_optim`), and loads what it
loads:

* the model state is always flatview's, model-only calls included, so that any pair
  of calls saves and loads one form: in the full form it is torch's own (fairscale's
  full ``state_dict()`` on fairscale; gathered from the views on DeepSpeed, whose engine's
  own names everything ``module.*``); in the sharded form a ``ShardedTensor`` per
  sharded parameter cut as flatview's views are (torch's own cuts the flat parameter
  into ranks' chunks, and torch's sharded load of one form into the other all-gathers
  mismatched shards: it hung), the same tensors; on fairscale torch's model-state
  functions fail without flatview (its ``load_state_dict`` takes no ``assign``);
* the optimizer state is flatview's when an optimizer of the call holds parameters of
  the model (views, flatview's or torch's with ``use_orig_params=True``, where torch's
  own fails for optimizers that hold part of a flat parameter); torch's otherwise
  (optimizers over flat parameters, which flatview refuses at their first step).

On DDP and FSDP2 flatview adds no views, and the model state is torch's own; the
optimizer state is flatview's there too, for two reasons. torch's ``get_state_dict``
first primes an optimizer that has no state yet (every parameter skipped so far) with
a zero step at learning rate 0: an Adam then counts a step it never took, in the
training that goes on (0.05 off after three more steps, measured) and in the
checkpoint; and a checkpoint without state for some parameters does not load into
torch's template (DCP: ``Missing key``). flatview's never steps the optimizer and saves
such parameters as placeholders (:mod:`flatview.fresh_state`). With experts (units on
process groups of their own) ranks of different expert groups hold different experts
under the same names, which torch's functions would key alike (DCP keeps one group's,
silently): their keys are :mod:`flatview.checkpoint_experts`'s.

A call on a module that holds the marked model (a framework's module around it:
Lightning's ``ModelParallelStrategy`` checkpoints the LightningModule) is routed alike,
its keys under the marked model's path there. On DDP and FSDP2 the model state is
torch's own of that module, the experts' keys under the path renamed; on the wrappers
that flatten it is flatview's, and a module holding parameters or buffers outside the
wrapped model is refused, before any collective. With experts the marked
model also takes its group's expert keys in its own ``load_state_dict`` (a pre-hook),
which such a framework loads the routed state with.

How every caller is reached: torch's public functions call their module's private
helpers (``_verify_options``, ``_get_model_state_dict``, ``_get_optim_state_dict``,
``_load_model_state_dict``, ``_load_optim_state_dict``) through the module's globals,
when called. Those globals are replaced, once per process, by wrappers that act only
on a model carrying this module's instance ``_fqn_modifiers`` (which torch reads for
the names of every model: the *mark*) and pass everything else to torch's helper
unchanged. Whoever imported the public functions, and however (``from ... import`` at
import time included), goes through them. ``FlatView.unwrap()`` removes the mark with
the handle's other patches: torch's functions then see the plain model again.

As :mod:`flatview.checkpoint`'s own functions, a routed call raises a refusal on every
rank even where one rank alone decides it (:func:`flatview.comm.refusals.raise_everywhere`):
``_verify_options`` exchanges what this rank refused and what decides the collectives
that follow (the options, the number of optimizers, whether flatview's path is taken)
before any collective of the call, and the loads that copy locally exchange their
refusals afterwards, before anything else communicates.

The helpers are private to torch: their names and parameters are checked before they
are replaced. Where they differ (another torch), nothing is replaced and the mark
refuses instead, before any collective, naming :mod:`flatview.checkpoint`.

torch FSDP1's own optimizer-state functions are refused on optimizers over views
(:mod:`flatview.checkpoint_fsdp1`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import fields
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from flatview import checkpoint_experts, checkpoint_fsdp1, checkpoint_model, checkpoint_optim
from flatview.checkpoint_fsdp1 import params_of, shown, signature_of, views_held
from flatview.comm.refusals import raise_everywhere
from flatview.errors import FlatViewError
from flatview.runtime import Runtime

Patch = Callable[[object, str, Callable[..., Any]], None]
"""Sets an instance attribute that the handle takes back at ``unwrap()``."""


@dataclasses.dataclass(frozen=True)
class RoutingSite:
    """Where :func:`route_torch_checkpoint` marks a model: the wrapped model's runtime
    (its model, table and adapter) and the handle's ways of patching it and of keeping
    a hook on it."""

    runtime: Runtime
    patch: Patch
    hook: Callable[[RemovableHandle], None]


_ROUTED = "_flatview_routes_to"
"""The attribute of a ``_StateDictInfo`` (torch's per-call options) holding the
:class:`RoutingSite` of a routed model."""
_PATH = "_flatview_path"
"""The attribute of a ``_StateDictInfo`` holding where the routed model sits in the model
of the call (``"net."`` for a LightningModule holding it as ``net``; ``""`` for itself)."""
_PIECES = "_flatview_pieces"
"""The attribute of a ``_StateDictInfo`` saying that an optimizer of the call holds
original parameters of the model (its optimizer state is then flatview's)."""

_originals: dict[str, Callable[..., Any]] = {}
"""torch's DCP helpers, once replaced (empty before, or where they could not be)."""


class _Routing(threading.local):
    active = False
    """flatview's own functions run (for a routed call, or called by the user): the
    torch functions they call (the model-state pair, on DDP, FSDP2 and torch FSDP1's
    full form) are torch's."""


_routing = _Routing()


@contextlib.contextmanager
def bypassed() -> Iterator[None]:
    """torch's checkpoint functions called inside are torch's own, unrouted: what
    flatview's checkpoint halves call (they are what a routed call reaches)."""
    before = _routing.active
    _routing.active = True
    try:
        yield
    finally:
        _routing.active = before


class _Mark:
    """The instance ``_fqn_modifiers`` of a routed model: torch's names as before (the
    class's own, if any), and, where torch's helpers could not be replaced, the refusal
    of optimizers over views (torch calls it while it checks its arguments, before any
    collective)."""

    def __init__(self, site: RoutingSite, previous: Any, routed: bool) -> None:
        self.site = site
        self.previous = previous
        self.routed = routed

    def __call__(self) -> dict[str, str]:
        if not self.routed:
            _refuse_view_optimizers(self.site.runtime)
        found = self.previous() if callable(self.previous) else {}
        return dict(found)


def route_torch_checkpoint(site: RoutingSite) -> None:
    """Route torch's ``torch.distributed.checkpoint.state_dict`` functions, called on the
    site's model with optimizers over its views, to flatview's checkpoint halves (where
    this torch's helpers cannot be replaced, make them refuse such calls instead), and
    make torch FSDP1's own optimizer-state functions refuse optimizers over its views
    (see the module docstring)."""
    root = site.runtime.model
    previous = getattr(root, "_fqn_modifiers", None)
    routed = _install_routes()
    checkpoint_fsdp1.install_refusals(_runtime_of)
    site.patch(root, "_fqn_modifiers", _Mark(site, previous, routed))
    keys = checkpoint_experts.expert_keys(site.runtime)
    if keys.index is not None:
        # A framework that loads the routed model state with the model's own
        # load_state_dict (Lightning's ModelParallelStrategy) hands it the experts' keys.
        site.hook(root.register_load_state_dict_pre_hook(keys.load_pre_hook))


def _site_of(model: object) -> RoutingSite | None:
    """The site of ``model`` if it carries :func:`route_torch_checkpoint`'s mark."""
    own = vars(model).get("_fqn_modifiers") if isinstance(model, nn.Module) else None
    return own.site if isinstance(own, _Mark) else None


def _runtime_of(module: nn.Module) -> Runtime | None:
    site = _site_of(module)
    return None if site is None else site.runtime


def _located(model: object) -> tuple[RoutingSite, str] | None:
    """The site of ``model`` or of the one module inside it that carries the mark (a
    framework's module around the wrapped model: Lightning's ``ModelParallelStrategy``
    checkpoints the LightningModule), and its path there (``"net."``; ``""``: itself)."""
    site = _site_of(model)
    if site is not None:
        return site, ""
    if not isinstance(model, nn.Module):
        return None
    found = [(name, s) for name, m in model.named_modules() if (s := _site_of(m)) is not None]
    if not found:
        return None
    if len(found) > 1:
        raise FlatViewError(
            f"torch.distributed.checkpoint.state_dict was given {type(model).__name__}, which "
            f"holds {len(found)} models flatview wraps ({', '.join(n for n, _ in found)}): "
            "save each wrapped model apart (or with flatview.checkpoint)"
        )
    name, site = found[0]
    if site.runtime.adapter.flattens:
        # flatview's own state covers the wrapped model only; DDP's and FSDP2's model
        # state is torch's, of the whole module of the call.
        outside = [
            n
            for n, _ in itertools.chain(model.named_parameters(), model.named_buffers())
            if not n.startswith(f"{name}.")
        ]
        if outside:
            raise FlatViewError(
                f"torch.distributed.checkpoint.state_dict was given {type(model).__name__}, "
                f"which holds a model flatview wraps ({name!r}) and state outside it "
                f"({shown(outside)}): flatview routes torch's functions on the wrapped "
                "model only; call them on it (fv.model), or use flatview.checkpoint"
            )
    return site, f"{name}."


# ----------------------------------------------------------------------- routing


def _install_routes() -> bool:
    """Replace torch's DCP helpers by the routing wrappers (once per process); whether
    they are in place."""
    if _originals:
        return True
    from torch.distributed.checkpoint import state_dict as dsd

    found = {name: getattr(dsd, name, None) for name in _WRAPPERS}
    for name, wrapper in _WRAPPERS.items():
        helper = found[name]
        if not callable(helper) or signature_of(helper) != signature_of(wrapper):
            return False  # another torch: its helpers are not the ones routed here
    _originals.update({name: helper for name, helper in found.items() if helper is not None})
    for name, wrapper in _WRAPPERS.items():
        setattr(dsd, name, wrapper)
    return True


def _verify_options(
    model: nn.Module,
    optims: tuple[torch.optim.Optimizer, ...],
    optim_only: bool,
    *,
    submodules: set[nn.Module] | None = None,
    options: Any = None,
) -> Any:
    info = _originals["_verify_options"](
        model, optims, optim_only, submodules=submodules, options=options
    )
    # _located refuses on every rank alike (their models are alike), before any
    # collective of the call.
    located = None if _routing.active else _located(model)
    if located is None:
        return info
    site, path = located
    failure: BaseException | None = None
    try:
        checkpoint_optim.refuse_options(info)
        checkpoint_experts.refuse_rank0_form(site.runtime.table, info)
        if submodules:
            raise FlatViewError(
                "torch.distributed.checkpoint.state_dict's submodules= (deprecated) is not "
                "supported on models wrapped by flatview: filter the state dict by name"
            )
    except FlatViewError as err:
        failure = err
    pieces = any(_holds_pieces(site.runtime, o) for o in optims)
    # What decides the collectives that follow, flatview's or torch's path included.
    request = (info.full_state_dict, info.cpu_offload, info.ignore_frozen_params, len(optims))
    # Before any collective of the call; a rank refusing alone raises on every rank.
    raise_everywhere(failure, (*request, pieces), _group(site), _caller())
    setattr(info, _ROUTED, site)
    setattr(info, _PATH, path)
    setattr(info, _PIECES, pieces)
    return info


def _group(site: RoutingSite) -> Any:
    return site.runtime.adapter.agreement_group


def _caller() -> str:
    """The public torch function this call came through, for messages."""
    entries = _torch_entry_points()
    frame = sys._getframe(1)
    while frame is not None and frame.f_code not in entries:
        frame = frame.f_back  # type: ignore[assignment]
    name = entries[frame.f_code] if frame is not None else "a function"
    return f"torch.distributed.checkpoint.state_dict.{name} (routed to flatview.checkpoint)"


def _options_of(info: Any) -> Any:
    """The plain ``StateDictOptions`` of torch's per-call ``info`` (which flatview's
    functions hand on to torch's model-state functions)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**{f.name: getattr(info, f.name) for f in fields(StateDictOptions)})


def _get_model_state_dict(model: nn.Module, info: Any) -> Any:
    site = getattr(info, _ROUTED, None)
    if site is None or not info.handle_model:
        return _originals["_get_model_state_dict"](model, info)
    if not site.runtime.adapter.flattens:
        # DDP and FSDP2 keep their parameters: torch's own state of the model of the
        # call, experts keyed by group.
        state = _originals["_get_model_state_dict"](model, info)
        return checkpoint_experts.expert_keys(site.runtime).model_out(state, getattr(info, _PATH))
    with bypassed():
        state = checkpoint_model.model_state_dict(site.runtime, _options_of(info))
    return _with_path(state, getattr(info, _PATH))


def _get_optim_state_dict(
    model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], info: Any
) -> Any:
    site = getattr(info, _ROUTED, None)
    if site is None or not info.handle_optim or not getattr(info, _PIECES, False):
        return _originals["_get_optim_state_dict"](model, optimizers, info)
    with bypassed():
        state = checkpoint_optim.optimizers_state(site.runtime, optimizers, _options_of(info))
    return _optim_with_path(state, getattr(info, _PATH))


def _load_model_state_dict(model: nn.Module, state_dict: dict[str, Any], info: Any) -> Any:
    site = getattr(info, _ROUTED, None)
    if site is None or not info.handle_model or not state_dict:
        return _originals["_load_model_state_dict"](model, state_dict, info)
    from torch.nn.modules.module import _IncompatibleKeys

    runtime = site.runtime
    path = getattr(info, _PATH)
    failure: BaseException | None = None
    if not runtime.adapter.flattens:
        # torch's own load of the model of the call (see _get_model_state_dict), the
        # experts' keys named again; another group's, on any rank, raise on every rank.
        try:
            state_dict = checkpoint_experts.expert_keys(runtime).model_in(state_dict, path)
        except FlatViewError as err:
            failure = err
        raise_everywhere(failure, (), _group(site), _caller())
        return _originals["_load_model_state_dict"](model, state_dict, info)
    if path:
        # A dict with keys outside the path on one rank raises on every rank.
        try:
            state_dict = _without_path(state_dict, path)
        except FlatViewError as err:
            failure = err
        raise_everywhere(failure, (), _group(site), _caller())
    if checkpoint_model.torch_loads_model(runtime, state_dict):
        with bypassed():
            result = checkpoint_model.load_model_state_dict(runtime, state_dict, _options_of(info))
        return _IncompatibleKeys(*_keys_with_path(result, path))
    # Local copies: a rank that refuses the dict raises on every rank.
    try:
        result = checkpoint_model.load_model_state_dict(runtime, state_dict, _options_of(info))
    except Exception as err:
        failure = err
    raise_everywhere(failure, (), _group(site), _caller())
    return _IncompatibleKeys(*_keys_with_path(result, path))


def _load_optim_state_dict(
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    state_dict: dict[str, Any],
    info: Any,
) -> None:
    site = getattr(info, _ROUTED, None)
    if site is None or not info.handle_optim or not getattr(info, _PIECES, False):
        _originals["_load_optim_state_dict"](model, optimizers, state_dict, info)
        return
    failure: BaseException | None = None
    try:
        state_dict = _optim_without_path(state_dict, getattr(info, _PATH))
        checkpoint_optim.load_optimizers_state(site.runtime, optimizers, state_dict)
    except Exception as err:
        failure = err
    # Local loading: a rank that refuses the dict raises on every rank.
    raise_everywhere(failure, (), _group(site), _caller())


def _with_path(state: dict[str, Any], path: str) -> dict[str, Any]:
    """Keys of the routed model's state as names in the model of the call."""
    return {f"{path}{k}": v for k, v in state.items()} if path else state


def _without_path(state: dict[str, Any], path: str) -> dict[str, Any]:
    return {_unprefixed(k, path): v for k, v in state.items()} if path else state


def _unprefixed(key: str, path: str) -> str:
    """The routed model's name for ``key`` of the model of the call."""
    if not key.startswith(path):
        raise FlatViewError(
            f"the state dict holds {key!r}, outside the model flatview wraps "
            f"({path[:-1]!r}), which is all torch's functions are routed to"
        )
    return key[len(path) :]


def _keys_with_path(result: Any, path: str) -> tuple[list[str], list[str]]:
    return (
        [f"{path}{k}" for k in result.missing_keys],
        [f"{path}{k}" for k in result.unexpected_keys],
    )


def _optim_with_path(state: dict[str, Any], path: str) -> dict[str, Any]:
    if not path or not state:
        return state
    groups = [
        {**group, "params": [f"{path}{n}" for n in group["params"]]}
        for group in state["param_groups"]
    ]
    return {**state, "state": _with_path(state["state"], path), "param_groups": groups}


def _optim_without_path(state: Any, path: str) -> Any:
    if not path or not isinstance(state, dict) or "state" not in state:
        return state
    groups = [
        {**group, "params": [_unprefixed(n, path) for n in group["params"]]}
        for group in state.get("param_groups", ())
    ]
    return {**state, "state": _without_path(dict(state["state"]), path), "param_groups": groups}


_WRAPPERS: dict[str, Callable[..., Any]] = {
    "_verify_options": _verify_options,
    "_get_model_state_dict": _get_model_state_dict,
    "_get_optim_state_dict": _get_optim_state_dict,
    "_load_model_state_dict": _load_model_state_dict,
    "_load_optim_state_dict": _load_optim_state_dict,
}


# --------------------------------------------------------------------- refusing


def _torch_entry_points() -> dict[Any, str]:
    module = sys.modules.get("torch.distributed.checkpoint.state_dict")
    if module is None:
        return {}
    entries = {}
    for name in (
        "get_state_dict",
        "get_optimizer_state_dict",
        "set_state_dict",
        "set_optimizer_state_dict",
        "get_model_state_dict",
        "set_model_state_dict",
    ):
        fn = getattr(module, name, None)
        fn = getattr(fn, "__wrapped__", fn)
        code = getattr(fn, "__code__", None)
        if code is not None:
            entries[code] = name
    return entries


def _refuse_view_optimizers(runtime: Runtime) -> None:
    """Where torch's helpers could not be replaced: refuse the calling torch function's
    optimizers over views (found on the stack), naming :mod:`flatview.checkpoint`."""
    entries = _torch_entry_points()
    frame = sys._getframe(1)
    while frame is not None and frame.f_code not in entries:
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return
    name = entries[frame.f_code]
    optimizers = frame.f_locals.get("optimizers") or ()
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = (optimizers,)
    for optimizer in optimizers:
        if not isinstance(optimizer, torch.optim.Optimizer):
            continue
        held = views_held(runtime, optimizer)
        if held:
            raise FlatViewError(
                f"torch.distributed.checkpoint.state_dict.{name} cannot handle optimizer "
                f"{type(optimizer).__name__}, which holds flatview's views ({shown(held)}) "
                f"of a {runtime.adapter.backend} model, on this torch ({torch.__version__}): "
                "torch would take each view's state for the state of a whole flat parameter "
                f"(or of a whole parameter). Use flatview.checkpoint.{name}(fv, model, ...) "
                "instead: the same arguments and options after fv, a state dict keyed by "
                "original names that torch.distributed.checkpoint.save / load handle and "
                "reshard"
            )


def _holds_pieces(runtime: Runtime, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` holds original parameters of the model (views, flatview's or
    torch's with ``use_orig_params=True``, or parameters fairscale leaves unflattened):
    only an optimizer over flat parameters (which flatview refuses at its first step)
    does not."""
    return any(runtime.index_of(tensor) is not None for tensor in params_of(optimizer))
