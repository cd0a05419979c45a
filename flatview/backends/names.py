"""Original names from the names in a wrapped tree: wrapper levels dropped, tied
parameters' owners and names, and the message naming the outer unit around a nested one."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable

from torch import nn

from flatview.views import Owner


def join(*parts: str) -> str:
    """A dotted name from parts, empty parts dropped."""
    return ".".join(p for p in parts if p)


HIDDEN_LEVELS = frozenset({"_checkpoint_wrapped_module"})
"""Levels that module wrappers insert in module paths but leave out of
``named_parameters()`` and ``state_dict()``: torch's ``CheckpointWrapper`` and
``OffloadWrapper`` (``apply_activation_checkpointing``). Original names drop them on
every backend, so that parameter names, module paths in skip sets and state-dict keys
are those of the unwrapped model, wrapped alike."""


def without_segments(name: str, segments: Iterable[str] = ()) -> str:
    """``name`` with the wrapper's own levels ``segments`` and :data:`HIDDEN_LEVELS`
    dropped: an original name."""
    dropped = HIDDEN_LEVELS.union(segments)
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
