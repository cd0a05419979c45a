"""flatview sets fairscale's and torch FSDP1's compute tensors on the submodules in fewer
Python steps (`flatview.backends.compute_tensors`): every module must end exactly as the
wrapper's own way leaves it, on every kind of value, of what the name held before and of
module class (one with its own ``__setattr__`` keeps it called)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flatview.backends.torch_fsdp import _SAFE_SETATTR, _setattr_stepped_aside

BEFORE = ("nothing", "instance tensor", "parameter", "instance int")
VALUES = ("tensor", "parameter", "tensor subclass")


class _Sub(torch.Tensor):
    pass


class _Noting(nn.Linear):
    """A module class with its own ``__setattr__`` (it notes every name set)."""

    def __setattr__(self, name: str, value: object) -> None:
        super().__setattr__(name, value)
        if name != "noted":
            self.__dict__.setdefault("noted", []).append(name)


class _Kept(nn.Linear):
    """A module class with a property of the parameter's name (its setter keeps the value
    elsewhere, as a parametrized module's class does)."""

    @property
    def weight(self) -> object:
        return self.__dict__.get("kept")

    @weight.setter
    def weight(self, value: object) -> None:
        self.__dict__["kept"] = value

    @weight.deleter
    def weight(self) -> None:
        self.__dict__.pop("kept", None)


def _module(before: str, noting: bool | str) -> nn.Module:
    if noting == "property":
        module = nn.Linear(2, 2)
        del module.weight
        module.__class__ = _Kept
        return module
    module = _Noting(2, 2) if noting else nn.Linear(2, 2)
    module.__dict__.pop("noted", None)
    if before != "parameter":
        del module.weight
    if before == "instance tensor":
        module.__dict__["weight"] = torch.ones(2, 2)
    elif before == "instance int":
        module.__dict__["weight"] = 3
    return module


def _value(kind: str) -> torch.Tensor:
    base = torch.full((2, 2), 7.0)
    if kind == "parameter":
        return nn.Parameter(base)
    if kind == "tensor subclass":
        return base.as_subclass(_Sub)
    return base


def _state(module: nn.Module) -> tuple[object, ...]:
    own = {k: v for k, v in module.__dict__.items() if not k.startswith("_")}
    return (
        {k: v if isinstance(v, list) else (type(v), id(v)) for k, v in own.items()},
        {k: id(v) for k, v in module._parameters.items()},
        dict(module._buffers),
        dict(module._modules),
    )


def _twins(before: str, noting: bool | str) -> tuple[nn.Module, nn.Module]:
    theirs, ours = _module(before, noting), _module(before, noting)
    # The same objects on both, so that ids compare.
    ours._parameters["bias"] = theirs._parameters["bias"]
    if before == "parameter":
        ours._parameters["weight"] = theirs._parameters["weight"]
    elif before == "instance tensor":
        ours.__dict__["weight"] = theirs.__dict__["weight"]
    return theirs, ours


CASES = [
    (before, kind, noting)
    for before in BEFORE
    for kind in VALUES
    for noting in (False, True, "property")
    # A class with a property of the name holds nothing else under it and takes no
    # parameter there.
    if noting != "property" or (before == "nothing" and kind != "parameter")
]


@pytest.mark.skipif(_SAFE_SETATTR is None, reason="torch without the setter")
@pytest.mark.parametrize(("before", "kind", "noting"), CASES)
def test_torch_setter_matches_torchs(before: str, kind: str, noting: bool | str) -> None:
    value = _value(kind)
    theirs, ours = _twins(before, noting)
    _SAFE_SETATTR(theirs, "weight", value)
    _setattr_stepped_aside(ours, "weight", value)
    assert _state(ours) == _state(theirs)
    assert ours.weight is value


@pytest.mark.skipif(_SAFE_SETATTR is None, reason="torch without the setter")
def test_torch_setter_on_a_buffer_name_takes_torchs_way() -> None:
    """A name that holds a buffer is set as torch sets it (the buffer deleted)."""
    theirs, ours = nn.Module(), nn.Module()
    shared = torch.zeros(1)
    theirs.register_buffer("w", shared)
    ours.register_buffer("w", shared)
    value = torch.ones(1)
    _SAFE_SETATTR(theirs, "w", value)
    _setattr_stepped_aside(ours, "w", value)
    assert _state(ours) == _state(theirs)


class _Tied(nn.Module):
    def __init__(self, noting: bool) -> None:
        super().__init__()
        self.a = _Noting(3, 4) if noting else nn.Linear(3, 4)
        self.b = nn.Linear(4, 3)
        self.c = nn.Linear(3, 4, bias=False)
        self.c.weight = self.a.weight


def _fpw_state(fpw: nn.Module) -> list[object]:
    inner = fpw.module
    found: list[object] = []
    for name, module in inner.named_modules():
        own = {k: v for k, v in module.__dict__.items() if not k.startswith("_")}
        found.append(
            (
                name,
                sorted(own.get("noted", [])),
                {
                    k: (tuple(v.shape), v.data_ptr(), v.grad_fn.name() if v.grad_fn else None)
                    for k, v in own.items()
                    if isinstance(v, torch.Tensor)
                },
                sorted(module._parameters),
            )
        )
    views = inner.__dict__.get("_unflattened_param_views")
    found.append([(tuple(v.shape), v.data_ptr()) for v in views or ()])
    return found


@pytest.mark.parametrize("noting", [False, True])
def test_fairscale_unflattening_matches_fairscales(noting: bool) -> None:
    """flatview's unflattening of a FlattenParamsWrapper (tied parameters included)
    leaves the same compute tensors (shapes, storage, autograd node) at the same names,
    and the same list of them, as fairscale's own."""
    fairscale = pytest.importorskip("fairscale.nn.misc")
    from flatview.backends.fairscale import _unflatten_as_views

    torch.manual_seed(0)
    fpw = fairscale.FlattenParamsWrapper(_Tied(noting))
    for module in fpw.module.modules():
        module.__dict__.pop("noted", None)
    fpw._unflatten_params_as_views()
    theirs = _fpw_state(fpw)
    for module in fpw.module.modules():
        module.__dict__.pop("noted", None)
    del fpw.module._unflattened_param_views
    _unflatten_as_views(fpw)
    ours = _fpw_state(fpw)
    assert ours == theirs
    assert fpw.module.c.__dict__["weight"] is fpw.module.a.__dict__["weight"]
