"""Where DeepSpeed's ZeRO (0.19.x) keeps each original parameter, described for flatview,
and what it needs from flatview around a step.

Two layouts (measured on 0.19.8, fp32, no offload):

* **ZeRO 1 and 2** (:class:`FlatGroups`): per parameter group of the optimizer the
  engine was built with, its trainable parameters are laid end to end (in
  ``round_robin_bit16_groups[i]`` order, at ``round_robin_bit16_offsets[i]``) in one
  flat buffer ``bit16_groups_flat[i]``, padded at its end to a multiple of twice the
  world size. Every module parameter is a view into that buffer: the forward computes
  on full, replicated parameters and communicates nothing. Rank ``r`` owns the ``r``-th
  of ``world_size`` equal partitions, whose fp32 master copy
  ``single_partition_of_fp32_groups[i]`` the optimizer steps; after the step DeepSpeed
  copies it into its partition of the flat buffer and all-gathers the partitions
  (``update_lp_params``). One flat parameter per group, in flatview's terms.
* **ZeRO 3** (:class:`ShardedParams`): every parameter is split on its own into
  ``world_size`` chunks of ``ceil(numel / world_size)`` elements (the last ones padded),
  rank ``r`` keeping the ``r``-th in ``param.ds_tensor``, and ``param.data`` is empty
  between passes; DeepSpeed's module hooks gather a submodule's parameters before it
  runs and free them after. The chunks of a sub-group (``fp16_groups[g]``) lie side by
  side in ``fp16_partitioned_groups_flat[g]``, and their fp32 master in
  ``fp32_partitioned_groups_flat[g]`` (on CPU in fp32 the same tensor). One flat
  parameter of one segment per parameter, in flatview's terms; parameters frozen before
  the engine was built have no master and their views show ``ds_tensor``.

flatview keeps one ``nn.Parameter`` per flat (a *holder*, aliasing the master
partition) whose ``grad`` is the reduced gradient of this rank's partition, and shows
views of it; while DeepSpeed computes, its own module parameters are registered again
(:meth:`compute_params`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flatview.backends.base import FlatSpec, PlainSpec
from flatview.backends.names import join
from flatview.errors import WrapError
from flatview.layout import FlatLayout, Segment
from flatview.views import Owner

Registrations = dict[int, list[tuple[str, Owner]]]
"""Per parameter (by id): every ``(original name, owner)`` it is registered at."""


def registrations(root: nn.Module) -> Registrations:
    """Every place each parameter of ``root`` is registered, in module order."""
    found: Registrations = {}
    seen: set[tuple[int, str]] = set()
    for module_name, module in root.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is None:
                continue
            places = found.setdefault(id(param), [])
            if (id(module), attr) in seen:
                # A submodule shared at two places: one owner, another name.
                places.append((join(module_name, attr), places[0][1]))
                continue
            seen.add((id(module), attr))
            places.append((join(module_name, attr), Owner(module, attr)))
    return found


def _owners_and_names(
    param: nn.Parameter, places: Registrations
) -> tuple[tuple[Owner, ...], tuple[str, ...]]:
    found = places.get(id(param))
    if not found:
        raise WrapError(
            f"DeepSpeed's optimizer holds a parameter of shape {tuple(param.shape)} that is "
            "registered on no submodule of engine.module; flatview gives views to module "
            "parameters only"
        )
    owners: list[Owner] = []
    for _, owner in found:
        if all(o is not owner for o in owners):
            owners.append(owner)
    return tuple(owners), tuple(name for name, _ in found)


@dataclass
class Flat:
    """One flat parameter: the holder, its layout, and the DeepSpeed parameters its
    segments are (their owners and names in the same order)."""

    holder: nn.Parameter
    layout: FlatLayout
    members: tuple[nn.Parameter, ...]
    owners: tuple[tuple[Owner, ...], ...]
    names: tuple[tuple[str, ...], ...]
    local_shard: Callable[[], torch.Tensor]

    def spec(self, flat_owner: Owner, rank: int) -> FlatSpec:
        return FlatSpec(
            flat=self.holder,
            flat_owner=flat_owner,
            layout=self.layout,
            rank=rank,
            owners=self.owners,
            names=self.names,
            local_shard=self.local_shard,
        )


def _holder(shard: torch.Tensor, requires_grad: bool) -> nn.Parameter:
    # Shares the partition's storage: a step on a view writes the master copy.
    return nn.Parameter(shard.detach(), requires_grad=requires_grad)


class FlatGroups:
    """ZeRO 1 and 2: one flat parameter per parameter group (see the module docstring)."""

    def __init__(
        self, zero: Any, places: Registrations, world_size: int, grad_dtype: torch.dtype
    ) -> None:
        self.zero = zero
        self.world_size = world_size
        flats = []
        for i, params in enumerate(zero.round_robin_bit16_groups):
            flat_buffer = zero.bit16_groups_flat[i]
            offsets = zero.round_robin_bit16_offsets[i]
            segments = tuple(
                Segment(int(offset), p.numel(), tuple(p.shape))
                for p, offset in zip(params, offsets, strict=True)
            )
            layout = FlatLayout(segments, flat_buffer.numel(), world_size)
            partition = zero.single_partition_of_fp32_groups[i]
            if layout.shard_numel != partition.numel() or partition.dtype != torch.float32:
                raise WrapError(
                    f"DeepSpeed's parameter group {i}: a flat buffer of {flat_buffer.numel()} "
                    f"{flat_buffer.dtype} elements over {world_size} ranks, but an fp32 "
                    f"partition of {partition.numel()} {partition.dtype} elements; flatview "
                    "supports fp32 masters, one partition per rank"
                )
            owners, names = zip(*(_owners_and_names(p, places) for p in params), strict=True)

            def local_shard(i: int = i) -> torch.Tensor:
                return self.zero.single_partition_of_fp32_groups[i].detach()

            flats.append(
                Flat(_holder(partition, True), layout, tuple(params), owners, names, local_shard)
            )
        self.flats: tuple[Flat, ...] = tuple(flats)
        self.grad_dtype = grad_dtype
        """What DeepSpeed's parameters and their gradients are (fp32, or bf16 over fp32
        masters): the padded gradients are, and are reduced in."""
        # The padded gradient of each group, kept between steps: gaps and the padding at
        # its end stay zero, so that a gradient used whole is reduced as it lies.
        self._buffers: list[torch.Tensor | None] = [None] * len(self.flats)

    def client_params(self) -> list[list[nn.Parameter]]:
        """Per parameter group of the engine's optimizer, the parameters it trains."""
        return [list(group) for group in self.zero.bit16_groups]

    def client_restore(self) -> list[list[torch.Tensor]]:
        """Per parameter group, what DeepSpeed's optimizer steps (its fp32 partition)."""
        return [[p] for p in self.zero.single_partition_of_fp32_groups]

    @torch.no_grad()
    def padded_gradient(self, index: int, used: Sequence[bool]) -> torch.Tensor:
        """Group ``index``'s unsharded gradient, padded: the used members' gradients at
        their offsets (zeros for one this rank's backward did not reach); the others'
        places hold whatever they held (the reduction leaves them out)."""
        flat = self.flats[index]
        buffer = self._buffers[index]
        if buffer is None:
            buffer = torch.zeros(
                flat.layout.numel, dtype=self.grad_dtype, device=flat.holder.device
            )
            self._buffers[index] = buffer
        for segment, param, flag in zip(flat.layout.segments, flat.members, used, strict=True):
            if not flag:
                continue
            target = buffer[segment.offset : segment.end]
            if param.grad is None:
                target.zero_()
            else:
                target.copy_(param.grad.reshape(-1))
        return buffer

    def compute_params(self) -> Iterator[tuple[nn.Parameter, tuple[Owner, ...]]]:
        for flat in self.flats:
            yield from zip(flat.members, flat.owners, strict=True)

    def masters(self) -> list[torch.Tensor]:
        """DeepSpeed's own fp32 partitions (what its optimizer steps without flatview)."""
        return list(self.zero.single_partition_of_fp32_groups)

    def prepare_step(self) -> None:
        """Nothing to do before ZeRO 1/2's optimizer step."""

    def release(self) -> None:
        """Nothing is kept gathered between ZeRO 1/2's steps: publishing gathers all."""

    def publish(self) -> None:
        """The stepped fp32 partitions into the flat buffers every rank computes on."""
        self.zero.update_lp_params()
        for i in range(len(self.flats)):
            self.zero._update_model_bit16_weights(i)


def _partition_of(param: Any) -> torch.Tensor:
    """A ZeRO 3 parameter's partition on this rank."""
    partition: torch.Tensor = param.ds_tensor
    return partition.detach()


class ShardedParams:
    """ZeRO 3: one flat parameter of one segment per parameter (see the module
    docstring)."""

    def __init__(
        self,
        zero: Any,
        places: Registrations,
        world_size: int,
        module: nn.Module,
        grad_dtype: torch.dtype,
    ) -> None:
        self.zero = zero
        self.grad_dtype = grad_dtype
        """As :attr:`FlatGroups.grad_dtype` (a frozen parameter's partition is too)."""
        self.world_size = world_size
        flats = []
        trained: set[int] = set()
        for group_index, params in enumerate(zero.fp16_groups):
            offset = 0
            for p in params:
                numel = p.partition_numel()
                flats.append(self._flat(p, places, self._master(group_index, offset, numel)))
                trained.add(id(p))
                offset += numel
            master = zero.fp32_partitioned_groups_flat[group_index]
            if master.numel() != offset or master.dtype != torch.float32:
                raise WrapError(
                    f"DeepSpeed's ZeRO 3 sub-group {group_index}: an fp32 master of "
                    f"{master.numel()} {master.dtype} elements for partitions of {offset}; "
                    "flatview supports fp32 training without offload"
                )
        for p in module.parameters():
            if id(p) not in trained:
                # Frozen before the engine was built: no master copy, only the partition.
                flats.append(self._flat(p, places, functools.partial(_partition_of, p)))
        self.flats: tuple[Flat, ...] = tuple(flats)

    def _master(self, group: int, offset: int, numel: int) -> Callable[[], torch.Tensor]:
        def local_shard() -> torch.Tensor:
            return self.zero.fp32_partitioned_groups_flat[group].detach().narrow(0, offset, numel)

        return local_shard

    def _flat(
        self, param: Any, places: Registrations, local_shard: Callable[[], torch.Tensor]
    ) -> Flat:
        shape = tuple(int(d) for d in param.ds_shape)
        layout = FlatLayout.packed([shape], self.world_size)
        shard = local_shard()
        if shard.numel() != layout.shard_numel or shard.dtype not in (
            torch.float32,
            self.grad_dtype,
        ):
            raise WrapError(
                f"a ZeRO 3 partition of {shard.numel()} {shard.dtype} elements for a parameter "
                f"of shape {shape} over {self.world_size} ranks; flatview expects fp32 chunks "
                f"of {layout.shard_numel}"
            )
        owners, names = _owners_and_names(param, places)
        holder = _holder(shard, param.requires_grad)
        return Flat(holder, layout, (param,), (owners,), (names,), local_shard)

    def client_params(self) -> list[list[nn.Parameter]]:
        groups: list[list[nn.Parameter]] = [[] for _ in self.zero.optimizer.param_groups]
        for sub_group, params in enumerate(self.zero.fp16_groups):
            groups[self.zero.sub_group_to_group_id[sub_group]].extend(params)
        return groups

    def client_restore(self) -> list[list[torch.Tensor]]:
        # DeepSpeed fills each group's params for the step of one sub-group at a time.
        return [[] for _ in self.zero.optimizer.param_groups]

    @torch.no_grad()
    def padded_gradient(self, index: int, used: Sequence[bool]) -> torch.Tensor:
        flat = self.flats[index]
        (param,) = flat.members
        padded = torch.zeros(
            flat.layout.padded_numel, dtype=self.grad_dtype, device=flat.holder.device
        )
        if param.grad is not None:
            padded[: flat.layout.numel].copy_(param.grad.reshape(-1))
        return padded

    def compute_params(self) -> Iterator[tuple[nn.Parameter, tuple[Owner, ...]]]:
        for flat in self.flats:
            yield flat.members[0], flat.owners[0]

    def masters(self) -> list[torch.Tensor]:
        return list(self.zero.fp32_partitioned_groups_flat)

    def prepare_step(self) -> None:
        """What DeepSpeed's ZeRO 3 step does first: reset its per-step bookkeeping and
        free any parameter still gathered."""
        self.zero._pre_step()
        self.zero._partition_all_parameters()

    def release(self) -> None:
        """Free every gathered parameter, the persistent ones too (ZeRO 3 keeps small
        parameters gathered between steps, and :meth:`publish` gathers only what is
        not): before publishing masters written outside a step."""
        self.zero._partition_all_parameters()

    def publish(self) -> None:
        """The stepped fp32 masters into the partitions the next forward gathers from,
        and the persistent (never freed) parameters gathered again."""
        for sub_group in range(len(self.zero.fp16_groups)):
            self.zero._reassign_or_swap_out_partitioned_parameters(sub_group)
        self.zero._post_step(set())


ZeroLayout = FlatGroups | ShardedParams


class ModuleOrder:
    """Registers DeepSpeed's own parameters back on their submodules (the views stepped
    aside), each module's entries in its own registration order: the views are then
    shown in their places, so the order users see (``named_parameters``, state dict
    keys) stays the model's whatever order the flat buffers lay parameters in."""

    def __init__(self, layout: ZeroLayout) -> None:
        shown: dict[int, tuple[nn.Module, dict[str, nn.Parameter]]] = {}
        for param, owners in layout.compute_params():
            for owner in owners:
                shown.setdefault(id(owner.module), (owner.module, {}))[1][owner.attr] = param
        # Per module: every name it registers, in order, and DeepSpeed's parameters in
        # that order (a dict keeps insertion order).
        self._modules = [
            (module, tuple(module._parameters), {a: e[a] for a in module._parameters if a in e})
            for module, e in shown.values()
        ]

    def register(self) -> None:
        for module, order, entries in self._modules:
            params = module._parameters
            if not params:
                for attr, param in entries.items():
                    params[attr] = param
                continue
            # Entries left in place (frozen parameters under ZeRO 1/2, ``None`` ones) sit
            # among them: the module's order is rebuilt.
            current = dict(params)
            current.update(entries)
            params.clear()
            for attr in order:
                if attr in current:
                    params[attr] = current.pop(attr)
            params.update(current)


def plain_specs(
    module: nn.Module, layout: ZeroLayout, places: Registrations
) -> tuple[PlainSpec, ...]:
    """ZeRO 1/2: the module parameters outside every group (frozen before the engine was
    built), left as they are: every rank holds them whole."""
    if isinstance(layout, ShardedParams):
        return ()
    members = {id(p) for flat in layout.flats for p in flat.members}
    specs = []
    for p in module.parameters():
        if id(p) in members:
            continue
        names = [name for name, _ in places[id(p)]]
        specs.append(PlainSpec(names[0], p, tuple(p.shape), aliases=tuple(names[1:]), ignored=True))
    return tuple(specs)


def padded_numel(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``world_size``."""
    return math.ceil(numel / world_size) * world_size
