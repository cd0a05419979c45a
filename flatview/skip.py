"""Skip sets: what a user may put in one, and how it resolves to original parameters.

A skip set may hold modules (plain submodules or FSDP units), views or plain
parameters, flat parameters, and names (an original parameter's name as in
``FlatView.named_parameters()``, or an original module path such as ``"body.3"``).
Everything resolves to a frozen set of original-parameter indices; anything that is
not part of the wrapped model is an error naming it.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from typing import TypeAlias

import torch
from torch import nn

from flatview.errors import SkippedParameterUsedError, SkipSetError, listing

SkipItem: TypeAlias = nn.Module | torch.Tensor | str
SkipSet: TypeAlias = SkipItem | Iterable[SkipItem] | None


class SkipResolver:
    """Maps skip items to original-parameter indices; built once per wrapped model."""

    def __init__(
        self,
        modules: Mapping[str, Sequence[nn.Module]],
        direct: Mapping[int, Sequence[int]],
        children: Mapping[int, Sequence[nn.Module]],
        param_names: Sequence[Sequence[str]],
        tensors: Mapping[int, Sequence[int]],
    ) -> None:
        """
        Args:
            modules: clean module path -> the modules at that path (wrappers included).
            direct: ``id(module)`` -> indices of parameters registered on it directly.
            children: ``id(module)`` -> its child modules.
            param_names: per parameter index, all its original names.
            tensors: ``id(tensor)`` -> parameter indices (a view or plain parameter maps
                to its own index, a flat parameter to all the parameters inside it).
        """
        self._modules = modules
        self._direct = direct
        self._children = children
        self._tensors = tensors
        self._names: dict[str, int] = {
            name: index for index, names in enumerate(param_names) for name in names
        }
        self._under: dict[int, frozenset[int]] = {}

    def resolve(self, skip: SkipSet) -> frozenset[int]:
        if skip is None:
            return frozenset()
        items: Iterable[SkipItem]
        if isinstance(skip, (nn.Module, torch.Tensor, str)):
            items = (skip,)
        elif isinstance(skip, Iterable) and not isinstance(skip, (bytes, bytearray)):
            items = skip
        else:
            # bytes iterate as ints: never what was meant.
            raise SkipSetError(
                "a skip set must be None, a module, a parameter, a name, or an iterable "
                f"(list, tuple, set) of those; got {type(skip).__name__}: {_value(skip)}"
            )
        resolved: set[int] = set()
        for item in items:
            resolved |= self._resolve_item(item)
        return frozenset(resolved)

    def _resolve_item(self, item: object) -> frozenset[int]:
        if isinstance(item, nn.Module):
            if id(item) not in self._direct:
                raise SkipSetError(
                    f"skip set holds a module that is not part of the wrapped model: "
                    f"{type(item).__name__} {_short(item)}"
                )
            return self._params_under(item)
        if isinstance(item, torch.Tensor):
            found = self._tensors.get(id(item))
            if found is None:
                raise SkipSetError(
                    "skip set holds a tensor that is neither a view, a parameter nor a flat "
                    f"parameter of the wrapped model: {type(item).__name__} of shape "
                    f"{tuple(item.shape)}"
                )
            return frozenset(found)
        if isinstance(item, str):
            return self._resolve_name(item)
        raise SkipSetError(
            f"skip set items must be modules, parameters or names, got {type(item).__name__}: "
            f"{_value(item)}"
        )

    def _resolve_name(self, name: str) -> frozenset[int]:
        if name in self._names:
            return frozenset((self._names[name],))
        if name in self._modules:
            under: set[int] = set()
            for module in self._modules[name]:
                under |= self._params_under(module)
            return frozenset(under)
        close = difflib.get_close_matches(name, [*self._names, *self._modules], n=3)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise SkipSetError(
            f"skip set names {name!r}, which is neither an original parameter name nor a "
            f"module path of the wrapped model{hint}"
        )

    def _params_under(self, module: nn.Module) -> frozenset[int]:
        key = id(module)
        cached = self._under.get(key)
        if cached is None:
            found = set(self._direct.get(key, ()))
            for child in self._children.get(key, ()):
                found |= self._params_under(child)
            cached = frozenset(found)
            self._under[key] = cached
        return cached


def _short(module: nn.Module) -> str:
    text = repr(module).splitlines()[0]
    return text if len(text) <= 80 else text[:77] + "..."


def _value(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def skipped_unit_called(name: str) -> SkippedParameterUsedError:
    """The error of a unit ``name`` whose parameters are all skipped, called anyway."""
    return SkippedParameterUsedError(
        f"FSDP unit {name!r} is declared skipped for this step, but its forward was "
        "called. Don't call skipped units (skipping them is what saves their "
        "communication), or don't put them in the skip set."
    )


def skipped_used_in_backward(names: Sequence[str], here: bool) -> SkippedParameterUsedError:
    """The error of skipped parameters (``names``) that received a gradient in a
    backward on some rank (``here``: this one among them), raised on every rank."""
    where = "this rank" if here else "another rank"
    return SkippedParameterUsedError(
        f"parameter(s) {listing(names)} are declared skipped for this step but received a "
        f"gradient on {where}: the model used them. Remove them from the skip set or "
        "don't use them (every rank raises; zero the gradients before training on)."
    )


def skipped_used(name: str) -> SkippedParameterUsedError:
    """The error of a skipped parameter ``name`` that received a gradient."""
    return SkippedParameterUsedError(
        f"parameter {name!r} is declared skipped for this step but received a "
        "gradient: the model used it. Remove it from the skip set or don't use it."
    )
