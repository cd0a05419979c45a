"""How torch FSDP1's flat parameters become flatview's specs: the layout of a
``FlatParameter`` (alignment padding as gaps), its original parameters' owners and names,
and the parameters a unit manages without flattening. Plain functions of the units."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from flatview.backends.base import FlatSpec, PlainSpec, UnitGroup, UnitSpec
from flatview.backends.names import join, owners_and_names, without_segments
from flatview.errors import WrapError
from flatview.layout import FlatLayout, Segment
from flatview.views import Owner

_WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module"})
_FLAT_PARAM = "_flat_param"


def clean_name(name: str) -> str:
    """An original name from a name in the wrapped tree (wrapper levels dropped)."""
    return without_segments(name, _WRAPPER_SEGMENTS)


def flat_layout(flat: Any, world_size: int) -> FlatLayout:
    """The layout of a torch ``FlatParameter`` sharded over ``world_size`` ranks.

    Alignment padding between parameters (``use_orig_params=True``) becomes gaps between
    segments; the padding at the end that makes the flat divisible by the world size is
    the layout's own.
    """
    shapes = iter(flat._shapes)
    segments = []
    offset = 0
    for numel, is_padding in zip(flat._numels_with_padding, flat._is_padding_mask, strict=True):
        if not is_padding:
            segments.append(Segment(offset, int(numel), tuple(next(shapes))))
        offset += int(numel)
    return FlatLayout(tuple(segments), int(flat._unpadded_unsharded_size.numel()), world_size)


def describe_units(
    units: list[tuple[str, Any]], root: Any, groups: Mapping[int, UnitGroup]
) -> list[UnitSpec]:
    """Every unit of ``units`` (``(original name, unit)``, root first), as specs, each
    sharded over its own group (``unit.rank`` and ``unit.world_size``; ``groups``: those
    of units on process groups of their own, by index)."""
    unit_ids = {id(unit) for _, unit in units}
    specs = []
    for index, (unit_name, unit) in enumerate(units):
        handle = unit._handle
        flats = (
            ()
            if handle is None
            else (_describe_flat(unit_name, unit, handle, unit.rank, unit.world_size),)
        )
        plain = _plain_params(unit_name, unit, unit_ids)
        specs.append(UnitSpec(unit_name, unit, flats, plain, unit is root, groups.get(index)))
    return specs


def _describe_flat(unit_name: str, unit: Any, handle: Any, rank: int, world_size: int) -> FlatSpec:
    flat = handle.flat_param
    sharded = bool(handle.uses_sharded_strategy)
    layout = flat_layout(flat, world_size if sharded else 1)
    if flat._local_shard.numel() != layout.shard_numel:
        raise WrapError(
            f"the flat parameter of FSDP unit {unit_name or '<root>'!r} holds "
            f"{flat._local_shard.numel()} elements per rank, but its layout says "
            f"{layout.shard_numel}"
        )
    owners, names = owners_and_names(
        unit_name,
        ((name, m, a) for a, m, name in flat._param_infos),
        ((name, m, a, pm, pa) for a, m, name, pa, pm, _ in flat._shared_param_infos),
        clean_name,
    )

    def local_shard() -> torch.Tensor:
        shard: torch.Tensor = flat._local_shard
        return shard

    return FlatSpec(
        flat=flat,
        flat_owner=Owner(unit.module, _FLAT_PARAM),
        layout=layout,
        rank=rank if sharded else 0,
        owners=owners,
        names=names,
        local_shard=local_shard,
        wrapper_views=tuple(flat._params) if handle._use_orig_params else None,
    )


def _plain_params(unit_name: str, unit: Any, unit_ids: set[int]) -> tuple[PlainSpec, ...]:
    """Parameters under ``unit`` (not under a nested unit) that FSDP did not flatten:
    those it was told to ignore."""
    handle = unit._handle
    managed: set[int] = set()
    if handle is not None:
        flat = handle.flat_param
        managed.add(id(flat))
        managed.update(id(p) for p in flat._params or ())
        managed.update(id(p) for p in flat._shared_params or ())
    plain = []
    for module_name, module in _own_modules(unit, unit_ids):
        for attr, param in module._parameters.items():
            if param is None or id(param) in managed:
                continue
            managed.add(id(param))
            name = join(unit_name, clean_name(module_name), attr)
            plain.append(PlainSpec(name, param, tuple(param.shape), ignored=True))
    return tuple(plain)


def _own_modules(unit: nn.Module, unit_ids: set[int]) -> Iterator[tuple[str, nn.Module]]:
    """``unit`` and its submodules, without descending into nested units."""
    stack: list[tuple[str, nn.Module]] = [("", unit)]
    while stack:
        name, module = stack.pop()
        yield name, module
        for child_name, child in reversed(list(module.named_children())):
            if id(child) not in unit_ids:
                stack.append((join(name, child_name), child))
