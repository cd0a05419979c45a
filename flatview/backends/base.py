"""The adapter contract: what a backend adapter tells the runtime, and what the runtime
asks of an adapter.

An adapter maps one wrapper onto flatview's backend-neutral runtime: it describes the
flat parameters (layout, owners, names, where the local shard lives: :class:`FlatSpec`,
:class:`PlainSpec`, :class:`UnitSpec`), calls the runtime (:class:`Runtime`) at the
points of the wrapper's lifecycle (a pass begins, a backward ends, a wrapper operation
such as ``state_dict`` runs), and reduces gradients with a reduction object of its own
(:mod:`flatview.comm.sharded`, :mod:`flatview.comm.replicated`) that counts into the
runtime's ledger. Every adapter class derives from :class:`Adapter` alone and is built
from components (``docs/internals.md``: "The components", "Adding a backend").

This module is the bottom of the backend side: it imports nothing of flatview's above
the layout, the views and the communication primitives, so the runtime and every adapter
can import it (:class:`Runtime` is a protocol that :class:`flatview.runtime.Runtime`
satisfies).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
from torch import nn

from flatview.layout import FlatLayout, MaskPlan, Placement
from flatview.phase import Phase
from flatview.views import Owner

if TYPE_CHECKING:
    from flatview.comm.ledger import Ledger


@dataclass(frozen=True)
class FlatSpec:
    """One flat parameter, as the runtime needs to know it."""

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
    ``use_orig_params=True``): the runtime then uses them as they are and neither creates,
    shows, hides nor feeds gradients to views for this flat parameter."""


@dataclass(frozen=True)
class PlainSpec:
    """A parameter under a unit that the wrapper does not flatten: managed as it is, or
    ignored (:attr:`ignored`)."""

    name: str
    """Its original name."""
    param: nn.Parameter
    shape: tuple[int, ...]
    """The original shape (the parameter itself may hold a shard of it)."""
    layout: FlatLayout | None = None
    """Set when the wrapper shards the parameter on its own (fairscale's
    ``flatten_parameters=False``): a one-segment layout, of which the parameter holds
    rank ``rank``'s padded shard. ``None``: every rank holds all of it."""
    rank: int = 0
    reduced: bool = False
    """flatview all-reduces its gradient itself (DDP): counted in ``FlatView.stats``."""
    aliases: tuple[str, ...] = ()
    """Its other original names: a tied parameter is registered at several places."""
    padded_shard: bool = True
    """With ``layout``: the parameter holds rank ``rank``'s padded shard (True), or
    only its piece of the segment, unpadded (False: FSDP2's ``DTensor`` local tensors)."""
    view: bool = False
    """The parameter is one of flatview's own views, described as a plain parameter
    (torch FSDP1 ``NO_SHARD`` computed on views), not one the wrapper registered: the
    wrapper's own functions do not know it."""
    ignored: bool = False
    """The wrapper was told to leave it alone (torch FSDP1's ``ignored_modules``, FSDP2's
    ``ignored_params``, DDP's ``parameters_to_ignore``; DeepSpeed's parameters outside
    the engine's groups): nobody gathers or reduces it, so whether the unit's
    collectives run does not depend on it."""


@dataclass(frozen=True)
class UnitGroup:
    """The process group of a unit that is not on the adapter's group: an expert unit on a
    group of its own (one per rank, or one per set of ranks), as the wrap-time exchange
    (:mod:`flatview.backends.unit_groups`) found it on every rank."""

    group: dist.ProcessGroup
    rank: int
    """This rank's rank in ``group``."""
    world_size: int
    peers: tuple[tuple[int, ...], ...]
    """Per rank of the adapter's :attr:`~Adapter.agreement_group`, the ranks (of that
    group) whose units on their own groups share its group: the same on every rank.
    Those ranks must skip the same parameters of such units; other ranks may not."""


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
    group: UnitGroup | None = None
    """Where the unit communicates when that is not the adapter's ``group``: its own
    process group (experts); ``None``: the adapter's."""


class ParamLookup(Protocol):
    """What adapters and their helpers may ask the parameter table
    (:class:`flatview.table.ParamTable`)."""

    def name(self, index: int) -> str:
        """The original name of parameter ``index``."""

    def placement_of(self, index: int) -> Placement:
        """Where the elements of parameter ``index`` live across ranks."""

    def own_view(self, index: int) -> bool:
        """Whether parameter ``index`` is one of flatview's own views."""


class Runtime(Protocol):
    """The runtime an adapter drives (:class:`flatview.runtime.Runtime`, whose methods
    document these): what :meth:`Adapter.install` receives."""

    @property
    def phase(self) -> Phase: ...

    @property
    def accumulating(self) -> bool: ...

    @property
    def ledger(self) -> Ledger: ...

    @property
    def table(self) -> ParamLookup: ...

    def begin_compute(self, outermost: bool) -> None: ...

    def check_unit_forward(self, unit: int) -> None: ...

    def check_backward_binding(self) -> None: ...

    def bind_inside_forward(self, first: int | None = None) -> None: ...

    def settle_agreement(self) -> None: ...

    def guard_skipped(self, flat: nn.Parameter) -> None: ...

    def guard_skipped_plain(self) -> None: ...

    def skipped_segments(self, flat: nn.Parameter) -> Sequence[tuple[int, str]]: ...

    def unit_skipped(self, unit: int) -> bool: ...

    def plain_used(self) -> frozenset[int]: ...

    def plain_used_so_far(self) -> frozenset[int]: ...

    def forget_plain_window(self) -> None: ...

    def forget_window(self) -> None: ...

    def flat_used_so_far(self, flat: nn.Parameter) -> bool: ...

    def reduction_plan(self, flat: nn.Parameter, *, window: bool = True) -> MaskPlan | None: ...

    def gather_plan(self, flat: nn.Parameter, min_saved: int) -> MaskPlan | None: ...

    def gather_masked(
        self, rows: Sequence[torch.Tensor], local_shard: torch.Tensor, plan: MaskPlan, unit: int
    ) -> None: ...

    def end_backward(self, synced: bool) -> None: ...

    def end_forward_only(self) -> None: ...

    def lend(self) -> AbstractContextManager[None]: ...

    def check_not_lent(self) -> None: ...

    def index_of(self, tensor: torch.Tensor) -> int | None: ...

    def tensor(self, index: int) -> nn.Parameter: ...

    def name(self, index: int) -> str: ...


def is_rank0(adapter: Adapter) -> bool:
    """Whether this rank gets "rank 0 only" results (``rank0_only=True``): rank 0 of the
    adapter's group, and under hybrid sharding rank 0 of :attr:`Adapter.agreement_group`
    (the world; the wrap checks that it is shard rank 0), not every replica's shard
    rank 0."""
    if adapter.rank != 0:
        return False
    return adapter.replicas == 1 or dist.get_rank(adapter.agreement_group) == 0


class Adapter(Protocol):
    """The backend side of a :class:`~flatview.FlatView`: one class per wrapper (or per
    way of driving one), deriving from this protocol and from nothing else. What it does
    it assembles from components that take what they need (``docs/internals.md``); the
    members with a body here are the defaults most adapters keep."""

    backend: str
    """The registry entry this adapter belongs to (:mod:`flatview.backends.registry`)."""
    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    device: torch.device
    bucket_numel: int
    overlaps_agreement: bool = False
    """The wrapper communicates nothing the skip set decides before flatview's own
    gradient collectives, so the skip-set check may run alongside the forward; the
    adapter calls ``Runtime.settle_agreement`` before its first collective."""

    trains_inside_forward: bool = False
    """A backward may run inside the root's forward, and a step may be entered there
    (Lightning's Trainer runs ``training_step``, the user's forward and backward
    included, inside the wrapper's forward): nothing the forward communicates depends
    on the skip set, and the adapter finds the end of a backward that does not go
    through the forward's outputs (``Runtime.bind_inside_forward`` binds the
    iteration of each). Otherwise ``Runtime.step`` refuses a step entered
    inside the root's forward, on every rank (:mod:`flatview.binding`)."""

    replicas: int = 1
    """How many ranks hold each shard: hybrid sharding's replica-group size (``group``,
    ``rank`` and ``world_size`` are then the shard group's), 1 otherwise."""

    wrapper_reduces: bool = True
    """The wrapper alone would communicate gradients (fairscale at world size 1 does not:
    its unsharded gradients are final). :attr:`flatview.StepStats.dense_bytes` and
    ``used_bytes`` are 0 otherwise."""

    takes_overlap: bool = False
    """The adapter reduces a replicating wrapper's gradients itself, so
    ``ReduceOptions.overlap`` applies (others reduce in the wrapper's own hooks and refuse
    it: :func:`flatview.backends.registry.detect`)."""

    masks_gathers: bool = False
    """The adapter has flatview all-gather partly skipped flat parameters masked, so
    ``ReduceOptions.mask_gather_min_saved`` applies (others refuse anything but its
    default: :func:`flatview.backends.registry.detect`)."""

    flattens: bool = False
    """The wrapper keeps the parameters in flat parameters, which flatview shows views of
    (fairscale FSDP, torch FSDP1, DeepSpeed ZeRO): torch's own checkpoint functions would
    misread an optimizer over those views, so the handle routes them to flatview's
    (:mod:`flatview.checkpoint_routing`)."""

    computes_on_views: bool = False
    """The model computes on flatview's views themselves (torch ``NO_SHARD`` computed on
    views): autograd reaches them, so hooks users register on them run. Elsewhere the
    model computes on the wrapper's tensors and a view's hooks never would
    (:mod:`flatview.view_hooks` refuses them)."""

    @property
    def agreement_group(self) -> dist.ProcessGroup | None:
        """The group every rank of the training run is in, on which the skip-set check and
        the parameter-group check run: ``group``, except under hybrid sharding (the
        world: replicas that skip differently must be caught too). Its rank 0 is the
        rank that "rank 0 only" results go to."""
        return self.group if self.replicas == 1 else None

    def clean_name(self, name: str) -> str:
        """An original name from a module or parameter name in the wrapped tree."""

    def describe(self) -> list[UnitSpec]:
        """Every unit of the wrapped model, root first, in module order."""

    def install(self, runtime: Runtime) -> None:
        """Attach the runtime to the wrapper's lifecycle."""

    def uninstall(self) -> None:
        """Detach everything :meth:`install` attached."""

    def synchronizing(self) -> bool:
        """Whether the next backward synchronises gradients (``False`` inside the wrapper's
        ``no_sync()``): the skip-set check of an iteration that does not is settled with
        the next one that does (:mod:`flatview.step_agreement`)."""
        return True

    def release_unsharded(self) -> None:
        """Free the unsharded parameters the wrapper kept after forwards that no backward
        followed (:mod:`flatview.leftovers`), so that its next forward gathers the shards
        as they are. Every rank calls it at the same point; it communicates nothing. A
        wrapper that keeps no such copy (DDP, ``NO_SHARD``) has nothing to free."""
        return None

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Raise if ``optimizer`` holds parameters this backend cannot serve (checked at
        its first step)."""
        return None

    def view_owners(self) -> list[Owner]:
        """Where views are shown that :meth:`describe` reports as plain parameters (an
        adapter that describes its views as plain parameters lists their places here)."""
        return []

    def describe_flat(self, tensor: object) -> tuple[str, tuple[str, ...]] | None:
        """(unit name, original names) of a flat parameter whose views the adapter
        describes as plain parameters, else ``None``."""
        return None


def end_root_forward(runtime: Runtime) -> None:
    """What every FSDP adapter does when its root unit's forward returns: a skip-set check
    that ran alongside the forward settles, so that a rank's error raises from the
    forward, before the wrapper's backward begins; and a forward without autograd has no
    backward to wait for."""
    runtime.settle_agreement()
    if not torch.is_grad_enabled():
        runtime.end_forward_only()
