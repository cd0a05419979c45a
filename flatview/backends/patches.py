"""What an adapter attaches to a wrapper, and takes back: :class:`Patches`, instance
attributes that shadow a method of one object (never a class) and hooks, all removed by
:meth:`Patches.remove`; and the wrapper methods that lend the model (run with the views
stepped aside)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

from torch.utils.hooks import RemovableHandle

LENDING_METHODS = ("state_dict", "load_state_dict", "_apply")
"""Wrapper methods that run with the views stepped aside (they read or replace the flat
parameters the wrapper registered), on every unit."""

ROOT_LENDING_METHODS = ("clip_grad_norm_",)
"""Lending methods of the root unit only. The FSDP wrappers' gradient clipping takes the
norm over ``self.parameters()``: views there would be counted besides (torch) or instead
of (fairscale: empty ones included, whose ``max()`` fails for ``norm_type=inf``) the flat
parameters the wrapper manages."""

_NOTHING = object()
"""No instance attribute was there before a patch."""

Lend = Callable[[], AbstractContextManager[None]]
"""Views step aside for one of the wrapper's own operations (``Runtime.lend``, or an
adapter's own lending around it)."""


class Patches:
    """Everything one adapter attached to the wrapper's objects, so that :meth:`remove`
    takes it all back: every change goes through :meth:`patch` or :meth:`hook`."""

    def __init__(self) -> None:
        self._patched: list[tuple[object, str, object]] = []
        self._hooks: list[RemovableHandle] = []

    def patch(self, owner: object, name: str, replacement: Callable[..., Any]) -> None:
        """Set ``owner.name`` to ``replacement`` (an instance attribute on the wrapper's
        object) until :meth:`remove`, which deletes it again, or puts back the instance
        attribute it replaced (a function the wrapper keeps per object)."""
        previous = owner.__dict__.get(name, _NOTHING)
        object.__setattr__(owner, name, replacement)
        self._patched.append((owner, name, previous))

    def hook(self, handle: RemovableHandle) -> None:
        """Keep a hook's handle until :meth:`remove`."""
        self._hooks.append(handle)

    def lending(self, owner: object, methods: Iterable[str], lend: Lend) -> None:
        """Shadow each of ``owner``'s ``methods`` with one that runs inside ``lend()``."""
        for method in methods:
            self.patch(owner, method, lending(getattr(owner, method), lend))

    def refusing(self, owner: object, method: str, error: Callable[[], Exception]) -> None:
        """Shadow ``owner``'s ``method`` with one that raises ``error()``: a method of the
        wrapper that would change what flatview took over (its reduction), called after
        the wrap, where the wrap would have refused what it sets."""

        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise error()

        self.patch(owner, method, refuse)

    def remove(self) -> None:
        """Remove every hook, and every patch, the last made first (a name patched twice
        ends as it was before the first)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        for owner, name, previous in reversed(self._patched):
            if previous is _NOTHING:
                owner.__dict__.pop(name, None)
            else:
                object.__setattr__(owner, name, previous)
        self._patched.clear()


def lending(method: Callable[..., Any], lend: Lend) -> Callable[..., Any]:
    """``method`` run with the views stepped aside (a wrapper operation)."""

    @functools.wraps(method)
    def lent(*args: Any, **kwargs: Any) -> Any:
        with lend():
            return method(*args, **kwargs)

    return lent
