"""What a backend adapter tells the core, and what the core asks of an adapter.

An adapter maps one FSDP implementation onto flatview's backend-neutral core: it
describes the flat parameters (layout, owners, names, where the local shard lives),
calls the core at the points of the wrapper's lifecycle (a pass begins, a backward
ends, a wrapper operation such as ``state_dict`` runs), and routes gradient reduction
through the core's masked reducer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
from torch import nn

from flatview.layout import FlatLayout
from flatview.views import Owner

if TYPE_CHECKING:
    from flatview.core import FlatView


@dataclass(frozen=True)
class FlatSpec:
    """One flat parameter, as the core needs to know it."""

    flat: nn.Parameter
    flat_owner: Owner
    """Where the wrapper registers the flat parameter (hidden while views are shown)."""
    layout: FlatLayout
    rank: int
    owners: tuple[tuple[Owner, ...], ...]
    """Per original parameter, every ``module.attr`` it is registered at (tied: several)."""
    names: tuple[tuple[str, ...], ...]
    """Per original parameter, its original names, in the same order as ``owners``."""
    local_shard: Callable[[], torch.Tensor]
    """The current full-precision local shard (its storage can move, e.g. on ``.to()``)."""
    wrapper_views: tuple[nn.Parameter, ...] | None = None
    """Set when the wrapper already keeps its own per-parameter views (torch FSDP with
    ``use_orig_params=True``): the core then uses them as they are and neither creates,
    shows, hides nor feeds gradients to views for this flat parameter."""


@dataclass(frozen=True)
class PlainSpec:
    """A parameter a unit manages without flattening it."""

    name: str
    """Its original name."""
    param: nn.Parameter
    shape: tuple[int, ...]
    """The original shape (the parameter itself may hold a shard of it)."""
    layout: FlatLayout | None = None
    """Set when the wrapper shards the parameter on its own (fairscale's
    ``flatten_parameters=False``): a one-segment layout, of which the parameter holds
    rank ``rank``'s whole padded shard. ``None``: every rank holds all of it."""
    rank: int = 0
    reduced: bool = False
    """flatview all-reduces its gradient itself (DDP): counted in ``FlatView.stats``."""
    aliases: tuple[str, ...] = ()
    """Its other original names: a tied parameter is registered at several places."""
    whole_shard: bool = True
    """With ``layout``: the parameter holds rank ``rank``'s whole padded shard (True), or
    only its piece of the segment, unpadded (False: FSDP2's ``DTensor`` local tensors)."""


@dataclass(frozen=True)
class UnitSpec:
    """One FSDP unit: a wrapper module and the parameters it manages directly."""

    name: str
    """The original name of the wrapped module (``""`` for the root)."""
    module: nn.Module
    flats: tuple[FlatSpec, ...]
    plain: tuple[PlainSpec, ...]
    """Parameters the unit manages without flattening."""
    is_root: bool


class Adapter(Protocol):
    """The backend side of a :class:`~flatview.FlatView`."""

    backend: str
    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    device: torch.device
    bucket_numel: int
    overlaps_agreement: bool
    """The wrapper communicates nothing the skip set decides before flatview's own
    gradient collectives, so the skip-set check may run alongside the forward; the
    adapter calls ``FlatView.settle_agreement`` before its first collective."""

    wrapper_reduces: bool
    """The wrapper alone would communicate gradients (fairscale at world size 1 does not:
    its unsharded gradients are final). :attr:`flatview.StepStats.dense_bytes` and
    ``used_bytes`` are 0 otherwise."""

    def clean_name(self, name: str) -> str:
        """An original name from a module or parameter name in the wrapped tree."""

    def describe(self) -> list[UnitSpec]:
        """Every unit of the wrapped model, root first, in module order."""

    def install(self, core: FlatView) -> None:
        """Attach the core to the wrapper's lifecycle."""

    def uninstall(self) -> None:
        """Detach everything :meth:`install` attached."""

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Raise if ``optimizer`` holds parameters this backend cannot serve."""

    def view_owners(self) -> list[Owner]:
        """Where views are shown that :meth:`describe` reports as plain parameters."""

    def describe_flat(self, tensor: object) -> tuple[str, tuple[str, ...]] | None:
        """(unit name, original names) of a flat parameter whose views the adapter
        describes as plain parameters, else ``None``."""
