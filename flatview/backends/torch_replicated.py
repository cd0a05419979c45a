"""Adapter for torch FSDP1 models that replicate (every unit ``NO_SHARD``): the model
computes on flatview's views, and torch's unit runtime stays idle.

Why: ``NO_SHARD`` replicates like DDP, but torch's runtime still works per unit and per
step as if it sharded: every forward it sets plain tensor views of each flat parameter
on the submodules, the backward of those views gathers every original gradient into
the flat gradient (zeros for skipped parameters included), and each unit runs its
pre- and post-backward hooks. On 2 CPU processes that took 1.35-1.49x the step time of
the ideal (only the used blocks, gradients all-reduced by hand), against flatview + DDP's
1.02-1.15x (``benchmarks/README.md``). Since every rank holds every parameter whole and
the flat parameter's storage does not move between passes, none of that is needed.

How: each unit's ``forward`` (an instance attribute shadowing torch's) calls the wrapped
module directly. flatview's views, registered on the submodules as always, are the
leaves the model computes with (with ``use_orig_params=True``, torch's own parameters,
which alias the flat parameter too), so autograd gives each used one its own gradient
and a skipped one none. flatview all-reduces the used gradients in buckets, as for DDP
(:class:`~flatview.backends.replicated.ReplicatedBackward`). FSDP's own state stays
``IDLE`` throughout.

What torch's runtime did and still happens:

* inputs are moved to the compute device, as the root's pre-forward does;
* ``no_sync()``: read from the root's ``_sync_gradients`` at the forward;
* ``state_dict``, ``load_state_dict``, ``summon_full_params`` and ``.to()`` run with the
  views stepped aside, as with :class:`~flatview.backends.torch_fsdp.TorchFSDPAdapter`;
* FSDP's ``clip_grad_norm_`` works unchanged: the views are parameters FSDP does not
  manage, whose norm it takes locally, which under ``NO_SHARD`` is the whole norm.

What differs: the flat parameters get no gradient from the backward (``flat.grad`` stays
``None``; with ``use_orig_params=True`` torch may copy the parameters' gradients into it
when it unshards, for ``state_dict`` say, and point them at it: the values stay), so an
optimizer that holds a flat parameter (built before wrapping) is refused at its first
step. ``flatview.wrap(model, compute_on_views=False)`` keeps torch's runtime instead.

Eligible (:func:`ineligibility`): every unit ``NO_SHARD`` (torch picks it for every
strategy at world size 1), no mixed precision (torch would cast the parameters for
compute) and no optimizer in backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.utils import _to_kwargs

from flatview.autograd import in_backward
from flatview.backends.base import Adapter, PlainSpec, UnitSpec
from flatview.backends.messages import double_count
from flatview.backends.patches import LENDING_METHODS, Patches
from flatview.backends.recast import fsdp1_recasting
from flatview.backends.replicated import ReplicatedBackward
from flatview.backends.summoning import forward_in_summon
from flatview.backends.torch_fsdp_checks import TorchFSDPModel, refuse_comm_hooks
from flatview.backends.torch_fsdp_describe import clean_name, describe_units
from flatview.backends.torch_summon import SummonLending, summoning
from flatview.comm.options import ReduceOptions
from flatview.errors import OptimStateError
from flatview.views import Owner, Shown, ViewSet

if TYPE_CHECKING:
    from flatview.backends.base import Runtime

_DDP_BUCKET_BYTES = 25 * 2**20
"""DDP's default ``bucket_cap_mb``: the bucket size of the all-reduces."""


def ineligibility(model: TorchFSDPModel) -> str | None:
    """Why the model cannot compute on views (the first reason found), or ``None``."""
    from torch.distributed.fsdp import ShardingStrategy

    for index, (name, unit) in enumerate(model.units):
        label = name or "<root>"
        if index in model.groups:
            return f"FSDP unit {label!r} is on a process group of its own (torch reduces it there)"
        if unit.sharding_strategy is not ShardingStrategy.NO_SHARD:
            return f"FSDP unit {label!r} shards ({unit.sharding_strategy.name})"
        handle = unit._handle
        precision = unit.mixed_precision
        if any(
            getattr(precision, attr, None) is not None
            for attr in ("param_dtype", "reduce_dtype", "buffer_dtype")
        ):
            return f"FSDP unit {label!r} uses mixed precision"
        if handle is not None and getattr(handle, "_has_optim_in_backward", False):
            return f"FSDP unit {label!r} steps an optimizer in backward"
    return None


class TorchReplicatedAdapter(Adapter):
    """Maps the flatview runtime onto a torch FSDP1 model whose units all replicate,
    bypassing torch's unit runtime (see the module docstring)."""

    backend = "torch"
    clean_name = staticmethod(clean_name)
    flattens = True
    computes_on_views = True
    # The forward communicates nothing the skip set decides (nothing at all), and
    # ReplicatedBackward finds the end of a backward inside the root's forward.
    overlaps_agreement = True
    trains_inside_forward = True
    takes_overlap = True

    def __init__(self, model: TorchFSDPModel, options: ReduceOptions) -> None:
        reason = ineligibility(model)
        assert reason is None, reason
        self.root: Any = model.root
        self.units = model.units
        self.group = model.group
        self.rank = model.rank
        self.world_size = model.world_size
        self.device = model.device
        self._view_sets: list[ViewSet] = []
        self._view_names: list[list[str]] = []
        self._flat_names: dict[int, tuple[str, tuple[str, ...]]] = {}
        """Per flat parameter (by id): its unit's name and the original names it holds."""
        self._leaves: dict[int, tuple[nn.Parameter, ...]] = {}
        """Per flat parameter (by id): the parameters the model computes on in its place
        (flatview's views, or torch's own with use_orig_params=True)."""
        self._specs: list[UnitSpec] = []
        params: list[tuple[str, nn.Parameter]] = []
        reduced: set[int] = set()
        self._view_owners: list[Owner] = []
        """Where flatview's views (or torch's own) are shown."""
        for unit in describe_units(self.units, self.root, {}):
            plain: list[PlainSpec] = []
            for spec in unit.flats:
                self._view_owners.extend(o for owners in spec.owners for o in owners)
                if spec.wrapper_views is not None:
                    # use_orig_params=True: torch's own parameters alias the flat
                    # parameter already, registered where they belong.
                    leaves = spec.wrapper_views
                else:
                    # The model computes on the views, so autograd saves them. torch
                    # writes the local shard in place (summon_full_params copies it onto
                    # itself), which bumps the version counter of every tensor aliasing it
                    # as a view; `.data` is an alias with a counter of its own, so a write
                    # autograd must not see stays unseen, as for bare FSDP's tensors.
                    shard = spec.local_shard().data
                    views = ViewSet(spec.flat, spec.flat_owner, spec.layout, 0, shard, spec.owners)
                    self._view_sets.append(views)
                    self._view_names.append([names[0] for names in spec.names])
                    leaves = views.views
                own = spec.wrapper_views is None
                originals = tuple(names[0] for names in spec.names)
                self._flat_names[id(spec.flat)] = (unit.name or "<root>", originals)
                self._leaves[id(spec.flat)] = tuple(leaves)
                for view, names, segment in zip(
                    leaves, spec.names, spec.layout.segments, strict=True
                ):
                    # A tied parameter is one view shown at every place.
                    plain.append(
                        PlainSpec(
                            names[0],
                            view,
                            segment.shape,
                            reduced=True,
                            aliases=names[1:],
                            view=own,
                        )
                    )
                    params.append((names[0], view))
                    reduced.add(id(view))
            # Parameters FSDP was told to ignore: nobody reduces them, as without flatview.
            plain.extend(unit.plain)
            params.extend((p.name, p.param) for p in unit.plain)
            self._specs.append(UnitSpec(unit.name, unit.module, (), tuple(plain), unit.is_root))
        first = params[0][1] if params else None
        element = first.element_size() if first is not None else 4
        self.bucket_numel = _DDP_BUCKET_BYTES // element
        self._summon = SummonLending(self._lend)
        self._backward = ReplicatedBackward(
            params, reduced, _DDP_BUCKET_BYTES, options, self, self.root
        )
        self._patches = Patches()
        # Shown from the start: the runtime finds plain parameters where they are registered.
        for views in self._view_sets:
            views.show()

    def describe(self) -> list[UnitSpec]:
        return self._specs

    def view_owners(self) -> list[Owner]:
        return self._view_owners

    # ---------------------------------------------------------------- install

    def install(self, runtime: Runtime) -> None:
        self.runtime = runtime
        patches = self._patches
        for index, (_, unit) in enumerate(self.units):
            forward = self._root_forward if unit is self.root else self._unit_forward(index)
            patches.patch(unit, "forward", forward)
            handle = unit._handle
            if handle is not None:
                # torch's own state follows a cast too, for after unwrap(); inside the
                # lending below, so the views follow at once.
                patches.patch(unit, "_apply", fsdp1_recasting(handle, unit._apply))
            patches.lending(unit, LENDING_METHODS, self._lend)
            if handle is not None:
                self._summon.patch(handle, patches)
        self._backward.install(runtime, patches)
        refuse_comm_hooks(self.root, patches)

    def synchronizing(self) -> bool:
        # torch's no_sync() clears the flag on every unit; the root's decides.
        return bool(self.root._sync_gradients)

    def uninstall(self) -> None:
        self._patches.remove()
        self._backward.uninstall()
        self._summon.close()
        self._write_back()
        for views in self._view_sets:
            # Bare FSDP goes on from the flat parameters: they take the views' values
            # and gradients.
            views.push_grads()
            views.hide()

    def _write_back(self) -> None:
        """Values assigned to views (``view.data = t``) into the flat parameters, which
        torch's own operations read; a view replaced by a new parameter is refused."""
        for views, names in zip(self._view_sets, self._view_names, strict=True):
            views.write_back(names, replace=False)

    # ---------------------------------------------------------------- forward

    def _root_forward(self, *args: Any, **kwargs: Any) -> Any:
        wrapped = self.root._fsdp_wrapped_module
        if in_backward():
            return wrapped(*args, **kwargs)  # a recomputation (checkpointing)
        if summoning(self.root):
            return forward_in_summon(wrapped, *args, **kwargs)
        self._write_back()
        self._backward.begin_forward(bool(self.root._sync_gradients))
        if self.device.type != "cpu":
            moved_args, moved_kwargs = _to_kwargs(args, kwargs, self.device, False)
            args = moved_args[0] if moved_args else ()
            kwargs = moved_kwargs[0] if moved_kwargs else {}
        with self._backward.root_forward():
            output = wrapped(*args, **kwargs)
        self._backward.end_forward(output)
        return output

    def _unit_forward(self, index: int) -> Callable[..., Any]:
        wrapped = self.units[index][1]._fsdp_wrapped_module

        def forward(*args: Any, **kwargs: Any) -> Any:
            if summoning(self.units[index][1]):
                return forward_in_summon(wrapped, *args, **kwargs)
            self.runtime.check_not_lent()
            if not in_backward():
                self.runtime.check_unit_forward(index)
            return wrapped(*args, **kwargs)

        return forward

    # ---------------------------------------------------------------- lending

    @contextlib.contextmanager
    def _lend(self) -> Iterator[None]:
        """Views step aside (flat parameters registered again) for one of torch's own
        operations, inside the runtime's lending. The views are this adapter's, not the
        runtime's: the outermost of nested calls (``state_dict`` recurses into the units)
        finds them shown, hides them and shows them again; inner ones find them hidden."""
        with self.runtime.lend():
            if not any(views.shown is Shown.VIEWS for views in self._view_sets):
                yield
                return
            self._write_back()
            for views in self._view_sets:
                views.hide()
            try:
                yield
            finally:
                for views in self._view_sets:
                    # .to() may have moved the storage. Replicated, the flat parameter
                    # is its own local shard, and its data is what torch reads.
                    views.rebind(views.flat.data)
                    views.show()

    # ------------------------------------------------------------- optimizers

    def describe_flat(self, tensor: object) -> tuple[str, tuple[str, ...]] | None:
        return self._flat_names.get(id(tensor))

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for flat, leaves in self._leaves.items():
            if flat not in held:
                continue
            unit, _ = self._flat_names[flat]
            name = type(optimizer).__name__
            if any(id(leaf) in held for leaf in leaves):
                raise double_count(name, unit)
            raise OptimStateError(
                f"optimizer {name} holds the flat parameter of FSDP unit {unit!r}, which gets "
                "no gradient: with every unit NO_SHARD the model computes on flatview's views "
                "and they get the gradients. Build optimizers from views "
                "(submodule.parameters() or FlatView.parameters()), or wrap with "
                "flatview.wrap(model, compute_on_views=False)"
            )
