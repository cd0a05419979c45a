"""torch's own checkpoint functions on models wrapped by flatview, with optimizers over
views: routed to :mod:`flatview.checkpoint`.

``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizers)`` (and
``get_optimizer_state_dict``, ``set_state_dict``, ``set_optimizer_state_dict``, the
model-only pair) is what frameworks checkpoint with: Lightning's and Fabric's
``ModelParallelStrategy``, accelerate's FSDP2 plugin, torchtitan. Left alone, torch would
take each view's optimizer state for the state of a whole flat parameter (or of a whole
parameter). So every call of one of them on a model whose adapter installed
:func:`guard_torch_checkpoint` (fairscale, torch FSDP1) gives what the
:mod:`flatview.checkpoint` function of the same name gives (model and optimizer state by
original name, DCP-savable, loadable at another world size or backend, or into the
unwrapped model), and loads what it loads:

* the model state is always flatview's, model-only calls included, so that any pair
  of calls saves and loads one form: in the full form it is torch's own (fairscale's
  full ``state_dict()`` on fairscale); in the sharded form a ``ShardedTensor`` per
  sharded parameter cut as flatview's views are (torch's own cuts the flat parameter
  into ranks' chunks, and torch's sharded load of one form into the other all-gathers
  mismatched shards: it hung), the same tensors; on fairscale torch's model-state
  functions fail without flatview (its ``load_state_dict`` takes no ``assign``);
* the optimizer state is flatview's when an optimizer of the call holds parameters of
  the model (views, flatview's or torch's with ``use_orig_params=True``, where torch's
  own fails for optimizers that hold part of a flat parameter); torch's otherwise
  (optimizers over flat parameters, which flatview refuses at their first step).

On DDP and FSDP2 flatview adds no views, and torch's functions are torch's.

How every caller is reached: torch's public functions call their module's private
helpers (``_verify_options``, ``_get_model_state_dict``, ``_get_optim_state_dict``,
``_load_model_state_dict``, ``_load_optim_state_dict``) through the module's globals,
when called. Those globals are replaced, once per process, by wrappers that act only
on a model carrying this module's instance ``_fqn_modifiers`` (which torch reads for
the names of every model) and pass everything else to torch's helper unchanged.
Whoever imported the public functions, and however (``from ... import`` at import time
included), goes through them. ``FlatView.unwrap()`` removes the instance attribute with
the adapter's other patches: torch's functions then see the plain model again.

The helpers are private to torch: their names and parameters are checked before they
are replaced. Where they differ (another torch), nothing is replaced and the instance
``_fqn_modifiers`` refuses instead, before any collective, naming
:mod:`flatview.checkpoint`, as flatview did before it routed.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from flatview import checkpoint, registry
from flatview.errors import FlatViewError

if TYPE_CHECKING:
    from flatview.backends.base import Runtime

_ROUTED = "_flatview_routes_to"
"""The attribute of a ``_StateDictInfo`` (torch's per-call options) naming the
:class:`flatview.FlatView` of a routed model."""
_VIEWS = "_flatview_pieces"
"""The attribute of a ``_StateDictInfo`` saying that an optimizer of the call holds
original parameters of the model (its optimizer state is then flatview's)."""

_originals: dict[str, Callable[..., Any]] = {}
"""torch's helpers, once replaced (empty before, or where they could not be)."""


class _Routing(threading.local):
    active = False
    """flatview's own functions run for a routed call: the torch functions they call
    (the model-state pair, on DDP, FSDP2 and torch FSDP1's full form) are torch's."""


_routing = _Routing()


@contextlib.contextmanager
def _flatviews() -> Iterator[None]:
    _routing.active = True
    try:
        yield
    finally:
        _routing.active = False


class Guarded(Protocol):
    """The adapter :func:`guard_torch_checkpoint` patches (an ``AdapterBase``)."""

    backend: str
    root: Any

    @property
    def core(self) -> Runtime: ...

    def patch(self, owner: object, name: str, replacement: Callable[..., Any]) -> None: ...


def guard_torch_checkpoint(adapter: Guarded) -> None:
    """Route torch's ``torch.distributed.checkpoint.state_dict`` functions, called on the
    adapter's model with optimizers over its views, to :mod:`flatview.checkpoint` (see
    the module docstring); where this torch's helpers cannot be replaced, make them
    refuse such calls with a :class:`flatview.FlatViewError` instead.

    torch reads ``root._fqn_modifiers()`` (when present) while it checks its arguments,
    before any collective: the instance attribute set here (removed with the adapter's
    other patches) marks the model and, without routing, refuses there. The decision is
    local and the same on every rank whose optimizers are counterparts."""
    root = adapter.root
    previous = getattr(root, "_fqn_modifiers", None)
    core = adapter.core
    backend = adapter.backend
    routed = _install_routes()

    def _fqn_modifiers() -> dict[str, str]:
        if not routed:
            _refuse_view_optimizers(core, backend)
        found = previous() if callable(previous) else {}
        return dict(found)

    _fqn_modifiers.routes = routed  # type: ignore[attr-defined]
    adapter.patch(root, "_fqn_modifiers", _fqn_modifiers)


def _routes(model: object) -> bool:
    """Whether ``model`` carries :func:`guard_torch_checkpoint`'s attribute."""
    own = vars(model).get("_fqn_modifiers") if isinstance(model, nn.Module) else None
    return bool(getattr(own, "routes", False))


# ----------------------------------------------------------------------- routing


def _install_routes() -> bool:
    """Replace torch's helpers by the routing wrappers (once per process); whether
    they are in place."""
    if _originals:
        return True
    from torch.distributed.checkpoint import state_dict as dsd

    found = {name: getattr(dsd, name, None) for name in _WRAPPERS}
    for name, wrapper in _WRAPPERS.items():
        helper = found[name]
        if not callable(helper) or _parameters(helper) != _parameters(wrapper):
            return False  # another torch: its helpers are not the ones routed here
    _originals.update({name: helper for name, helper in found.items() if helper is not None})
    for name, wrapper in _WRAPPERS.items():
        setattr(dsd, name, wrapper)
    return True


def _parameters(fn: Callable[..., Any]) -> list[tuple[str, Any]]:
    """Names and kinds of ``fn``'s parameters: a wrapper stands in for a helper of
    torch's only where torch can call it the same way."""
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


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
    fv = registry.owner_of(model) if _routes(model) and not _routing.active else None
    if fv is not None:
        # Before any collective, on every rank alike.
        checkpoint.refuse_options(info)
        if submodules:
            raise FlatViewError(
                "torch.distributed.checkpoint.state_dict's submodules= (deprecated) is not "
                "supported on models wrapped by flatview: filter the state dict by name"
            )
        setattr(info, _ROUTED, fv)
        setattr(info, _VIEWS, any(_holds_pieces(fv.runtime, o) for o in optims))
    return info


def _options_of(info: Any) -> Any:
    """The plain ``StateDictOptions`` of torch's per-call ``info`` (which flatview's
    functions hand on to torch's model-state functions)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**{f.name: getattr(info, f.name) for f in fields(StateDictOptions)})


def _get_model_state_dict(model: nn.Module, info: Any) -> Any:
    fv = getattr(info, _ROUTED, None)
    if fv is None or not info.handle_model:
        return _originals["_get_model_state_dict"](model, info)
    with _flatviews():
        return checkpoint.model_state(fv, model, _options_of(info))


def _get_optim_state_dict(
    model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], info: Any
) -> Any:
    fv = getattr(info, _ROUTED, None)
    if fv is None or not info.handle_optim or not getattr(info, _VIEWS, False):
        return _originals["_get_optim_state_dict"](model, optimizers, info)
    with _flatviews():
        return checkpoint.optimizers_state(fv, optimizers, _options_of(info))


def _load_model_state_dict(model: nn.Module, state_dict: dict[str, Any], info: Any) -> Any:
    fv = getattr(info, _ROUTED, None)
    if fv is None or not info.handle_model or not state_dict:
        return _originals["_load_model_state_dict"](model, state_dict, info)
    from torch.nn.modules.module import _IncompatibleKeys

    with _flatviews():
        result = checkpoint.load_model_state(fv, model, state_dict, _options_of(info))
    return _IncompatibleKeys(result.missing_keys, result.unexpected_keys)


def _load_optim_state_dict(
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    state_dict: dict[str, Any],
    info: Any,
) -> None:
    fv = getattr(info, _ROUTED, None)
    if fv is None or not info.handle_optim or not getattr(info, _VIEWS, False):
        _originals["_load_optim_state_dict"](model, optimizers, state_dict, info)
        return
    with _flatviews():
        checkpoint.load_optimizers_state(fv, optimizers, state_dict)


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
    ):
        fn = getattr(module, name, None)
        fn = getattr(fn, "__wrapped__", fn)
        code = getattr(fn, "__code__", None)
        if code is not None:
            entries[code] = name
    return entries


def _refuse_view_optimizers(core: Runtime, backend: str) -> None:
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
        held = _views_held(core, optimizer)
        if held:
            shown = ", ".join(repr(n) for n in held[:3]) + (", ..." if len(held) > 3 else "")
            raise FlatViewError(
                f"torch.distributed.checkpoint.state_dict.{name} cannot handle optimizer "
                f"{type(optimizer).__name__}, which holds flatview's views ({shown}) of a "
                f"{backend} model, on this torch ({torch.__version__}): torch would take "
                "each view's state for the state of a whole flat parameter (or of a whole "
                f"parameter). Use flatview.checkpoint.{name}(fv, model, ...) instead: the "
                "same arguments and options after fv, a state dict keyed by original names "
                "that torch.distributed.checkpoint.save / load handle and reshard"
            )


def _holds_pieces(core: Runtime, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` holds original parameters of the model (views, flatview's or
    torch's with ``use_orig_params=True``, or parameters fairscale leaves unflattened):
    only an optimizer over flat parameters (which flatview refuses at its first step)
    does not."""
    return any(
        core.index_of(tensor) is not None
        for group in optimizer.param_groups
        for tensor in group["params"]
    )


def _views_held(core: Runtime, optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of the parameters of ``optimizer`` that torch's functions would misread:
    flatview's own views, and parameters the wrapper shards one by one."""
    names = []
    for group in optimizer.param_groups:
        for tensor in group["params"]:
            index = core.index_of(tensor)
            if index is None:
                continue
            table = core.table
            # A plain parameter with a whole-shard placement is one the wrapper shards
            # by itself (fairscale's flatten_parameters=False).
            if table.own_view(index) or table.placement_of(index).whole_shard:
                names.append(table.name(index))
    return names
