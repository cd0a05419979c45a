"""Setting a wrapper's compute tensors on the submodules in fewer Python steps.

fairscale and torch FSDP1 set each original parameter's compute tensor (a plain tensor
cut from the unsharded flat parameter) on its submodule through ``setattr``, once per
parameter tensor and forward (torch FSDP1 also deletes what was there first). At
thousands of tensors ``nn.Module.__setattr__``'s checks are a large part of what a step
costs on the host. For a plain tensor under a name that is no registered parameter,
buffer or submodule of a module whose class keeps ``nn.Module``'s ``__setattr__`` and
has no attribute of that name (a property would take the value itself), those checks
end in ``object.__setattr__``, which stores it in the instance dictionary (over what the
last forward left there): :func:`set_directly` does just that store, and leaves every
other case to the wrapper's own way.
"""

from __future__ import annotations

import torch
from torch import nn

_MODULE_SETATTR: object = nn.Module.__setattr__

_plain: dict[tuple[type, str], bool] = {}
"""Per module class and name: whether ``setattr`` on an instance reaches the instance
dictionary by ``nn.Module``'s own way (worked out once; a class swapped at run time, as
``torch.nn.utils.parametrize`` does, is another key)."""


def _plain_class(cls: type, name: str) -> bool:
    found = _plain.get((cls, name))
    if found is None:
        found = _plain[(cls, name)] = cls.__setattr__ is _MODULE_SETATTR and not hasattr(cls, name)
    return found


def set_directly(module: nn.Module, name: str, tensor: object) -> bool:
    """Store ``tensor`` as ``module.<name>`` where ``setattr`` would store it in the
    instance dictionary itself; return whether it did (else the caller sets it)."""
    if (
        type(tensor) is torch.Tensor
        and _plain_class(type(module), name)
        and name not in module._parameters
        and name not in module._buffers
        and name not in module._modules
    ):
        module.__dict__[name] = tensor
        return True
    return False
