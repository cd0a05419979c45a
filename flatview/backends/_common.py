"""Plumbing every adapter shares: hooks and instance-level patches that ``uninstall``
removes, lending wrappers and the wrapper methods that lend, wrapper-free names, and the
wrap-time check that the wrapper internals an adapter touches exist."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from flatview.views import Owner

if TYPE_CHECKING:
    from flatview.backends.base import Runtime


class AdapterBase:
    """What both adapters do the same way. Everything they attach goes through
    :meth:`patch` (an instance attribute shadowing a method of one object, never a
    class) or :meth:`_hook`, so that :meth:`uninstall` can take it all back."""

    root: Any
    group: dist.ProcessGroup | None
    overlaps_agreement = False
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
