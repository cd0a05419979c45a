"""Plumbing every adapter shares: hooks and instance-level patches that ``uninstall``
removes, lending wrappers and the wrapper methods that lend, wrapper-free names, and the
wrap-time check that the wrapper internals an adapter touches exist."""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from flatview.errors import StateError, WrapError
from flatview.views import Owner

if TYPE_CHECKING:
    from flatview.backends.base import Runtime


LENDING_METHODS = ("state_dict", "load_state_dict", "_apply")
"""Wrapper methods that run with the views stepped aside (they read or replace the flat
parameters the wrapper registered), on every unit."""
ROOT_LENDING_METHODS = ("clip_grad_norm_",)
"""Lending methods of the root unit only. The FSDP wrappers' gradient clipping takes the
norm over ``self.parameters()``: views there would be counted besides (torch) or instead
of (fairscale: empty ones included, whose ``max()`` fails for ``norm_type=inf``) the flat
parameters the wrapper manages."""


def require_attrs(obj: object, names: Iterable[str], what: str, tested: str) -> None:
    """Refuse to wrap unless ``obj`` has every attribute in ``names``: wrapper internals an
    adapter reads, calls or replaces, checked before anything is patched so that a
    wrapper version that renamed one fails here, not in the middle of a backward.

    ``what`` names ``obj`` in the message, ``tested`` the versions the adapter was checked
    against (and the one found)."""
    missing = [name for name in names if not hasattr(obj, name)]
    if missing:
        raise WrapError(
            f"{what} has no {', '.join(missing)}, which flatview relies on: this version "
            f"is not one flatview supports (checked against {tested})"
        )


def require_autograd_internals(tested: str) -> None:
    """The autograd internals every adapter uses: the running backward's id (a forward
    inside a backward is a recomputation) and the end-of-backward callback queue."""
    require_attrs(torch._C, ("_current_graph_task_id",), "torch._C", tested)
    engine = torch.autograd.Variable
    require_attrs(engine, ("_execution_engine",), "torch.autograd.Variable", tested)
    require_attrs(
        engine._execution_engine, ("queue_callback",), "autograd's execution engine", tested
    )


def join(*parts: str) -> str:
    """A dotted name from parts, empty parts dropped."""
    return ".".join(p for p in parts if p)


def without_segments(name: str, segments: Iterable[str]) -> str:
    """``name`` with the wrapper levels in ``segments`` dropped: an original name."""
    dropped = frozenset(segments)
    return ".".join(part for part in name.split(".") if part and part not in dropped)


def owners_and_names(
    unit_name: str,
    params: Iterable[tuple[str, nn.Module, str]],
    tied: Iterable[tuple[str, nn.Module, str, nn.Module, str]],
    clean: Callable[[str], str],
) -> tuple[tuple[tuple[Owner, ...], ...], tuple[tuple[str, ...], ...]]:
    """Per original parameter of one flat parameter, every ``module.attr`` it is
    registered at and its original names, primary first.

    ``params`` lists ``(module_name, module, attr)`` per parameter in flat order; ``tied``
    lists ``(module_name, module, attr, primary_module, primary_attr)`` for each extra
    place a parameter is shown (names relative to the unit, in the wrapped tree).
    """
    owners: list[list[Owner]] = []
    names: list[list[str]] = []
    primary: dict[tuple[int, str], int] = {}
    for module_name, module, attr in params:
        primary[(id(module), attr)] = len(owners)
        owners.append([Owner(module, attr)])
        names.append([join(unit_name, clean(module_name), attr)])
    for module_name, module, attr, primary_module, primary_attr in tied:
        segment = primary[(id(primary_module), primary_attr)]
        owners[segment].append(Owner(module, attr))
        names[segment].append(join(unit_name, clean(module_name), attr))
    return tuple(tuple(o) for o in owners), tuple(tuple(n) for n in names)


_FPW = "FlattenParamsWrapper"


def nested_unit_message(
    unit: nn.Module, unit_type: type[nn.Module], clean: Callable[[str], str]
) -> str:
    """Why ``unit`` cannot be wrapped: it is nested in another FSDP unit, named if found."""
    outer = _outermost_enclosing(unit, unit_type)
    where = ""
    if outer is not None:
        root, name = outer
        inner = getattr(root, "module", root)
        # fairscale's unit holds the user's module inside its flattening wrapper.
        inner = getattr(inner, "module", inner) if type(inner).__name__ == _FPW else inner
        where = (
            f" (it is {clean(name)!r} inside the {type(root).__name__} around a "
            f"{type(inner).__name__})"
        )
    return (
        f"flatview.wrap was given a nested FSDP unit{where}; wrap the outermost FSDP model, "
        "the one the training loop calls"
    )


def _outermost_enclosing(
    module: nn.Module, unit_type: type[nn.Module]
) -> tuple[nn.Module, str] | None:
    """The outermost ``unit_type`` module whose tree holds ``module``, and ``module``'s
    name in it. A module does not know its parents: they are found through the garbage
    collector's referrers, which scans the heap (slow: for error messages only)."""
    found = None
    path: list[str] = []
    current = module
    seen = {id(module)}
    while True:
        parent = _parent_of(current)
        if parent is None or id(parent[0]) in seen:
            return found
        current, attr = parent
        seen.add(id(current))
        path.insert(0, attr)
        if isinstance(current, unit_type):
            found = (current, ".".join(path))


def _parent_of(module: nn.Module) -> tuple[nn.Module, str] | None:
    for children in gc.get_referrers(module):
        if not isinstance(children, dict):
            continue
        names = [k for k, v in children.items() if v is module and isinstance(k, str)]
        if not names:
            continue
        for owner in gc.get_referrers(children):
            if isinstance(owner, nn.Module) and owner._modules is children:
                return owner, names[0]
            # The owner's attributes may live in a materialised __dict__ it refers to.
            if isinstance(owner, dict) and owner.get("_modules") is children:
                for candidate in gc.get_referrers(owner):
                    if isinstance(candidate, nn.Module) and candidate._modules is children:
                        return candidate, names[0]
    return None


class AdapterBase:
    """What both adapters do the same way. Everything they attach goes through
    :meth:`patch` (an instance attribute shadowing a method of one object, never a
    class) or :meth:`_hook`, so that :meth:`uninstall` can take it all back."""

    root: Any
    group: dist.ProcessGroup | None
    overlaps_agreement = False
    trains_inside_forward = False
    wrapper_reduces = True
    replicas = 1

    @property
    def agreement_group(self) -> dist.ProcessGroup | None:
        """The adapter's group, or the world where shards have replicas (see
        :attr:`flatview.backends.base.Adapter.agreement_group`)."""
        return self.group if self.replicas == 1 else None

    def __init__(self) -> None:
        self._core: Runtime | None = None
        self._patched: list[tuple[object, str]] = []
        self._hooks: list[RemovableHandle] = []

    @property
    def core(self) -> Runtime:
        assert self._core is not None, "adapter used before install()"
        return self._core

    def patch(self, owner: object, name: str, replacement: Callable[..., Any]) -> None:
        """Set ``owner.name`` to ``replacement`` (an instance attribute on the wrapper's
        object) until :meth:`uninstall`, which deletes it again."""
        object.__setattr__(owner, name, replacement)
        self._patched.append((owner, name))

    def _hook(self, handle: RemovableHandle) -> None:
        self._hooks.append(handle)

    def uninstall(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        for owner, name in self._patched:
            owner.__dict__.pop(name, None)
        self._patched.clear()

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse an optimizer this backend cannot serve (checked at its first step)."""

    def view_owners(self) -> list[Owner]:
        """Where views are shown that the core does not know as views (an adapter that
        describes its views as plain parameters lists their places here)."""
        return []

    def describe_flat(self, tensor: object) -> tuple[str, tuple[str, ...]] | None:
        """(unit name, original names) of a flat parameter the core does not know (its
        views described as plain parameters), else ``None``."""
        return None

    def _lend(self) -> contextlib.AbstractContextManager[None]:
        """Views step aside for one of the wrapper's own operations."""
        return self.core.lend()

    def _patch_lending(self, unit: Any, methods: Iterable[str]) -> None:
        """Shadow each of ``unit``'s ``methods`` with one that lends the views."""
        for method in methods:
            self.patch(unit, method, self._lending(getattr(unit, method)))

    def _lending(self, method: Callable[..., Any]) -> Callable[..., Any]:
        """``method`` run with the views stepped aside (a wrapper operation)."""

        @functools.wraps(method)
        def lent(*args: Any, **kwargs: Any) -> Any:
            with self._lend():
                return method(*args, **kwargs)

        return lent

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        """Registered on the root: a forward without autograd has no backward to wait for.
        A skip-set check that ran alongside the forward settles here, so that a rank's
        error raises from the forward, before the wrapper's backward begins."""
        self.core.settle_agreement()
        if not torch.is_grad_enabled():
            self.core.end_forward_only()


def _refuse_summoned_backward(grad: torch.Tensor) -> None:
    raise StateError(
        "backward of a forward that ran inside summon_full_params: the summoned full "
        "parameters are temporary, so their gradients would be lost (FSDP does not "
        "support a backward started inside summon_full_params either). Run forwards that "
        "train outside the summoning; inside it, evaluate or generate (torch.no_grad())."
    )


def forward_in_summon(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Run ``module`` (a unit's wrapped module) on the full parameters a summoning put on
    the submodules, without the wrapper's forward logic or flatview's.

    Inside ``summon_full_params`` every summoned unit's original attributes already hold
    its full parameters, so evaluation and generation need nothing from the wrapper; its
    forward would unshard and reshard again, which breaks the summoning (torch FSDP1 and
    fairscale fail at its exit, or with ``use_orig_params=True`` train on from stale
    shards). A backward of such a forward is refused when it starts."""
    output = module(*args, **kwargs)
    if torch.is_grad_enabled():
        for leaf in tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(_refuse_summoned_backward)
    return output


def optional_class(module: str, name: str) -> type[nn.Module] | None:
    """``module.name`` if that backend can be imported here, else ``None`` (flatview runs
    with either FSDP implementation missing)."""
    try:
        found: type[nn.Module] = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    return found
