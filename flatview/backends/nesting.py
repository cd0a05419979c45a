"""Whether a wrapper unit given to ``flatview.wrap`` sits inside another one, before the
wrapper itself can tell.

A wrapper learns which of its units is the root at the root's first forward (its lazy
initialisation marks the others). Before it, a nested unit carries no mark on fairscale,
nor on torch FSDP1 when an auto-wrap policy created it, nor on FSDP2; and wrapping it
would be undone by nothing: flatview's own lazy initialisation (torch, FSDP2) would make
it a root the outer model's first forward then refuses, or its hooks (fairscale) would
refuse every forward of the outer model. So ``wrap`` asks here first, and refuses before
it changes anything.
"""

from __future__ import annotations

import gc

from torch import nn


def inside_another(module: nn.Module, unit_type: type) -> bool:
    """Whether a live ``unit_type`` module other than ``module`` holds ``module`` in its
    module tree. A module does not know its parents, but every instance of a class
    defined in Python refers to its class: one pass of the garbage collector's referrer
    search over ``unit_type`` and its subclasses (FSDP2 makes one per wrapped class)
    finds the units, whose trees are then searched. At wrap time only, and only while
    the wrapper has not marked its root yet."""
    kinds = _with_subclasses(unit_type)
    for candidate in gc.get_referrers(*kinds):
        if candidate is module or type(candidate) not in kinds:
            continue
        if any(inner is module for inner in candidate.modules()):
            return True
    return False


def _with_subclasses(cls: type) -> set[type]:
    found = {cls}
    stack = [cls]
    while stack:
        subclasses: list[type] = stack.pop().__subclasses__()
        for sub in subclasses:
            if sub not in found:
                found.add(sub)
                stack.append(sub)
    return found
