"""Norms of whole original parameters, computed from the pieces each rank holds.

A partial view holds only this rank's elements of a parameter, so ``view.norm()`` is the
norm of a piece. The p-norm of the whole parameter is ``(sum over ranks of
sum |x|**p)**(1/p)`` and its infinity norm the largest ``|x|`` over ranks: each rank
computes its share from its piece, and one all-reduce combines the shares of every
requested parameter at once (:mod:`flatview.comm.norms`). This is what LARC, LAMB and
per-parameter gradient clipping need (see the recipes); clipping by their total is
:mod:`flatview.clipping`'s.

Where the elements are
----------------------
Each original parameter has a :class:`~flatview.layout.Placement`:

* a view of a sharded flat parameter (flatview's own views, and torch's views with
  ``use_orig_params=True``): this rank holds one piece, possibly empty;
* a parameter fairscale does not flatten (``flatten_parameters=False``), which
  fairscale shards on its own: this rank holds its padded shard, of which the part
  before the padding is the piece;
* replicated (torch ``NO_SHARD``, one rank, parameters FSDP does not manage): this rank
  holds all of it and its norm needs no reduction. It still takes part in the one
  collective, so every call has the same shape.

Agreement
---------
Every call is a collective. Errors that the arguments alone decide (a name or tensor
that is not an original parameter of the model, an unsupported norm type, a call while
the model computes) are found before any norm is taken; the rank that finds one still
joins the call's one collective, flagged as failed, so that a bad argument on one rank
only raises on every rank instead of hanging the others: that rank raises its own
error, the others a :class:`NormError` naming it and its message (gathered with
``all_gather_object``, only then). The collective itself checks that all ranks asked
for the same parameters and the same norm: a disagreement raises :class:`NormError` on
every rank, naming the parameters, instead of hanging or returning norms of different
things.
"""

from __future__ import annotations

import contextlib
import difflib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, NoReturn, TypeAlias

import torch
from torch import nn

from flatview.comm.collectives import gather_objects
from flatview.comm.norms import COLUMNS, NormExchange, reduce_within, request_code
from flatview.errors import FlatViewError, NormError, StateError, listing
from flatview.layout import Placement
from flatview.local_tensors import local_tensor
from flatview.phase import Phase

if TYPE_CHECKING:
    from flatview.runtime import Runtime
    from flatview.table import ParamTable

ParamSelection: TypeAlias = torch.Tensor | str | Iterable[torch.Tensor | str] | None
"""Original parameters: views or parameters of the model, or their names (e.g. an
optimizer's ``group["params"]``); ``None`` for all of them."""

TensorsByParam: TypeAlias = Mapping[torch.Tensor | str, torch.Tensor | None]
"""Per original parameter (a view, parameter or name), a tensor laid out like its view."""

Column: TypeAlias = Callable[[nn.Parameter], torch.Tensor | None]
"""Which tensor of a parameter a norm is taken of, given the view (or parameter)."""


# ----------------------------------------------------------------------- placements


def local_elements(placement: Placement, tensor: torch.Tensor) -> torch.Tensor | None:
    """This rank's elements of the parameter in ``tensor`` (laid out like its local
    tensor, or, on a sharded parameter, like the whole parameter), 1-D; ``None`` if
    ``tensor`` has neither size."""
    flat = local_tensor(tensor).detach().reshape(-1)
    if flat.numel() == placement.local_numel:
        start, end = placement.local_interval
    elif placement.sharded and flat.numel() == placement.numel:
        # torch's own views can show the unsharded parameter for a while.
        start, end = placement.param_interval
    else:
        return None
    return flat[start:end]


# ----------------------------------------------------------------------- arguments


def check_norm_type(norm_type: object) -> float:
    """``norm_type`` as a float: a positive finite number or ``inf``."""
    try:
        p = float(norm_type)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise NormError(f"norm_type must be a positive number or inf, got {norm_type!r}") from None
    if math.isnan(p) or p <= 0:
        raise NormError(f"norm_type must be a positive number or inf, got {norm_type!r}")
    return p


def select(table: ParamTable, params: ParamSelection) -> list[int]:
    """Indices of the original parameters ``params`` stands for, in model order (each
    once); raises :class:`NormError` naming anything that is not one of them."""
    if params is None:
        return list(table.order)
    items: Iterable[object]
    items = (params,) if isinstance(params, (torch.Tensor, str)) else params
    if isinstance(items, Mapping):
        raise NormError(
            "params must be parameters or names, not a mapping; pass an optimizer's "
            "param group as group['params']"
        )
    if isinstance(items, nn.Module):
        raise NormError(
            f"params must be parameters or names, not a module ({type(items).__name__}); "
            "pass module.parameters()"
        )
    chosen = set(indices_of(table, items))
    return [i for i in table.order if i in chosen]


def indices_of(table: ParamTable, items: Iterable[object], argument: str = "params") -> list[int]:
    """The original-parameter index of each item (a view, parameter or name), in order;
    raises :class:`NormError` naming the first that is none of them."""
    found = []
    for item in items:
        if isinstance(item, str):
            named = table.index_of_name(item)
            if named is None:
                close = difflib.get_close_matches(item, table.names(), n=3)
                hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
                raise NormError(
                    f"{argument} names {item!r}, which is not an original parameter name of the "
                    f"wrapped model (see FlatView.named_parameters()){hint}"
                )
            found.append(named)
        elif isinstance(item, torch.Tensor):
            index = table.index_of(item)
            if index is None:
                raise NormError(_unknown_tensor(item, table, argument))
            found.append(index)
        else:
            raise NormError(
                f"{argument} must hold parameters (views) or names, got "
                f"{type(item).__name__}: {item!r}"
            )
    return found


def _unknown_tensor(tensor: torch.Tensor, table: ParamTable, argument: str) -> str:
    what = f"{type(tensor).__name__} of shape {tuple(tensor.shape)}"
    if table.flat_parameter(tensor) is not None:
        return (
            f"{argument} holds a flat parameter ({what}), whose elements differ from rank to "
            "rank; pass its views (the submodules' parameters) or their names"
        )
    grads = {id(p.tensor.grad): p.name for p in table.params if p.tensor.grad is not None}
    if id(tensor) in grads:
        return (
            f"{argument} holds the gradient of {grads[id(tensor)]!r}, not a parameter; pass the "
            "parameter (grad_norms takes its gradient)"
        )
    return (
        f"{argument} holds a tensor that is not an original parameter (view) of the wrapped "
        f"model: {what}"
    )


def check_phase(rt: Runtime, method: str, *, grads: bool) -> None:
    """Refuse a norm call outside ``IDLE`` (and, for gradients, inside ``no_sync()``)."""
    if rt.phase is not Phase.IDLE:
        hint = {
            Phase.COMPUTING: (
                "a forward pass is in flight, or a forward ran with autograd on and no "
                "backward followed; call it between iterations (after the backward, before "
                "the next forward; run evaluation passes under torch.no_grad())"
            ),
            Phase.LENT: "a wrapper operation (state_dict, summon_full_params, ...) runs",
            Phase.DETACHED: "flatview was unwrapped",
        }[rt.phase]
        raise StateError(
            f"FlatView.{method}() needs phase IDLE, the model is {rt.phase.name}: {hint}"
        )
    if grads and rt.accumulating:
        raise StateError(
            f"FlatView.{method}() inside an accumulation window (no_sync(), or a DeepSpeed "
            "engine before its boundary): the views do not hold the window's gradients yet; "
            "call it after the synchronising backward"
        )


# ---------------------------------------------------------------------------- math


def whole_norms(
    rt: Runtime,
    indices: Sequence[int],
    columns: Sequence[tuple[str, Column]],
    norm_type: float,
) -> list[list[torch.Tensor | None]]:
    """The ``norm_type``-norm of whole tensors, per parameter in ``indices`` and per
    column, from this rank's pieces, with one all-reduce.

    Each column is ``(kind, tensor_of)``: ``tensor_of(view)`` gives the tensor laid out
    like the view whose norm is wanted (the view itself, its gradient, ...), or ``None``
    (that entry is then ``None`` unless another rank has the tensor: elements a rank has
    no tensor for count as zeros). ``kind`` names the column in the agreement check.
    Results are 0-dim tensors on the collective's device, in float32 (float64 if any of
    the parameters is float64).
    """
    if not 1 <= len(columns) <= COLUMNS:
        raise ValueError(f"1 to {COLUMNS} columns, got {len(columns)}")
    p = norm_type
    maximum = math.isinf(p)
    device = rt.adapter.device
    params = rt.table.params
    table = [param.placement for param in params]
    exchange = NormExchange(
        len(params), request_code(f"{p!r}:{','.join(k for k, _ in columns)}"), maximum
    )
    dtype = torch.float32
    # Per dtype and device, the entries (parameter, column) with elements here: their
    # positions and the norms of this rank's pieces; and the entries this rank has a
    # tensor for.
    pieces: dict[tuple[torch.dtype, torch.device], tuple[list[int], list[torch.Tensor]]] = {}
    here: set[tuple[int, int]] = set()
    for index in indices:
        exchange.request(index)
        placement = table[index]
        tensor = params[index].tensor
        if tensor.dtype == torch.float64:
            dtype = torch.float64
        for column, (_, tensor_of) in enumerate(columns):
            value = tensor_of(tensor)
            if value is None:
                continue
            elements = local_elements(placement, value)
            if elements is None:
                exchange.mark_bad(index)
                continue
            exchange.mark_present(index, column)
            here.add((index, column))
            if elements.numel():
                acc = torch.promote_types(elements.dtype, torch.float32)
                positions, found = pieces.setdefault((acc, elements.device), ([], []))
                positions.append(index * COLUMNS + column)
                found.append(torch.linalg.vector_norm(elements, p, dtype=acc))

    # Every entry's norm here, then its share of the sum (or maximum): replicated
    # parameters send nothing, their norm is this rank's own.
    local = torch.zeros(len(table) * COLUMNS, dtype=torch.float64, device=device)
    for positions, found in pieces.values():
        where = torch.tensor(positions, dtype=torch.long, device=device)
        local[where] = torch.stack(found).to(device, torch.float64)
    sharded = torch.tensor([pl.sharded for pl in table for _ in range(COLUMNS)], device=device)
    share = local if maximum else local.pow(p)
    share = torch.where(sharded, share, torch.zeros_like(share))
    reduced = _reduce(rt, exchange, share).reshape(-1)
    reduced = _reduce_own_groups(rt, share, reduced, maximum)

    _raise_failures(rt, exchange, None)
    _raise_on_disagreement(exchange, table, columns, p)
    whole = reduced if maximum else reduced.pow(1.0 / p)
    norms = torch.where(sharded, whole, local).to(dtype).unbind()
    have = exchange.present()
    for index in indices:
        if not table[index].sharded:
            have[index] = [(index, column) in here for column in range(COLUMNS)]
    return [
        [norms[i * COLUMNS + c] if have[i][c] else None for c in range(len(columns))]
        for i in indices
    ]


@contextlib.contextmanager
def checked_everywhere(rt: Runtime) -> Iterator[None]:
    """Argument checks of a norm call: one that fails on this rank fails on every rank
    (:func:`refuse_everywhere`)."""
    try:
        yield
    except (NormError, StateError) as err:
        refuse_everywhere(rt, err)


def refuse_everywhere(rt: Runtime, error: FlatViewError) -> NoReturn:
    """This rank refused its own arguments: join the call's collective flagged as
    failed (the other ranks may be in it already), then raise ``error``."""
    exchange = NormExchange(len(rt.table), 0, maximum=False)
    exchange.failed = True
    device = rt.adapter.device
    values = torch.zeros(len(rt.table) * COLUMNS, dtype=torch.float64, device=device)
    _reduce(rt, exchange, values)
    _raise_failures(rt, exchange, error)
    raise error


def _reduce(rt: Runtime, exchange: NormExchange, values: torch.Tensor) -> torch.Tensor:
    """The norm call's one all-reduce; under hybrid sharding its refusal flags travel over
    every rank (the agreement group), its values within the shard group."""
    adapter = rt.adapter
    return exchange.all_reduce(
        values,
        adapter.group,
        adapter.device,
        rt.ledger,
        adapter.agreement_group,
    )


def _reduce_own_groups(
    rt: Runtime, share: torch.Tensor, reduced: torch.Tensor, maximum: bool
) -> torch.Tensor:
    """The shares of parameters of units on process groups of their own (experts) sharded
    there, reduced within those groups instead of over the agreement group (whose other
    ranks hold other experts under the same names)."""
    table = rt.table
    own = sorted(table.own_group_params)
    group = table.expert_group
    if group is None or group.world_size == 1:
        return reduced  # one rank per group: its experts are whole here, their norms local
    positions = torch.tensor(
        [i * COLUMNS + c for i in own for c in range(COLUMNS)], device=share.device
    )
    values = reduce_within(share[positions], group.group, maximum, rt.ledger)
    return reduced.index_put((positions,), values)


def _raise_failures(rt: Runtime, exchange: NormExchange, error: FlatViewError | None) -> None:
    """Raise on every rank if some rank refused its arguments: ``error`` where it is
    this rank's, else a :class:`NormError` naming the ranks that refused and why."""
    if not exchange.some_failed:
        return
    reports: list[tuple[str, str] | None] = []
    if exchange.some_ok:
        # Some ranks do not know what went wrong: tell them (the only case that pays).
        # The flags were reduced over the agreement group (the world under hybrid
        # sharding): so are the reports.
        group = rt.adapter.agreement_group
        mine = None if error is None else (type(error).__name__, str(error))
        reports = gather_objects(mine, group)
    if error is not None:
        raise error
    told = "; ".join(
        f"rank {r}: {report[0]}: {report[1]}" for r, report in enumerate(reports) if report
    )
    raise NormError(
        "another rank refused its arguments to this norm call, so every rank raises "
        f"(none would wait for it): {told}"
    )


def _raise_on_disagreement(
    exchange: NormExchange,
    table: Sequence[Placement],
    columns: Sequence[tuple[str, Column]],
    p: float,
) -> None:
    report = exchange.argument_report()
    what = "/".join(kind for kind, _ in columns)
    if not report.same_request:
        raise NormError(
            f"ranks asked for different norms in the same call (this rank: {what} norms "
            f"with norm_type={p}); every rank must make the same call with the same "
            "arguments"
        )
    if report.disputed:
        names = [table[i].name for i in report.disputed]
        raise NormError(
            f"ranks asked for the norms of different parameters: {listing(names)} were "
            "asked for on some ranks and not on others; every rank must pass the same "
            "params (e.g. all of an optimizer's group['params'], not only those with "
            "elements or a gradient on this rank)"
        )
    if report.bad:
        names = [table[i].name for i in report.bad]
        raise NormError(
            f"on some rank the tensor given for {listing(names)} is laid out like neither "
            "the view nor the whole parameter (its number of elements is neither)"
        )


# ------------------------------------------------------------------ public helpers


def param_column(view: nn.Parameter) -> torch.Tensor:
    """The :data:`Column` of parameter norms: the view itself."""
    return view


def grad_column(view: nn.Parameter) -> torch.Tensor | None:
    """The :data:`Column` of gradient norms: the view's gradient, if any."""
    return view.grad


def param_norms(rt: Runtime, params: ParamSelection, norm_type: object) -> dict[str, torch.Tensor]:
    """See :meth:`flatview.FlatView.param_norms`."""
    with checked_everywhere(rt):
        p = check_norm_type(norm_type)
        indices = select(rt.table, params)
        check_phase(rt, "param_norms", grads=False)
    rows = whole_norms(rt, indices, [("param", param_column)], p)
    out = {}
    for index, (norm,) in zip(indices, rows, strict=True):
        assert norm is not None
        out[rt.table.name(index)] = norm
    return out


def grad_norms(
    rt: Runtime, params: ParamSelection, norm_type: object
) -> dict[str, torch.Tensor | None]:
    """See :meth:`flatview.FlatView.grad_norms`."""
    with checked_everywhere(rt):
        p = check_norm_type(norm_type)
        indices = select(rt.table, params)
        check_phase(rt, "grad_norms", grads=True)
    rows = whole_norms(rt, indices, [("grad", grad_column)], p)
    return {rt.table.name(i): norm for i, (norm,) in zip(indices, rows, strict=True)}


def tensor_norms(
    rt: Runtime,
    tensors: TensorsByParam,
    norm_type: object,
) -> dict[str, torch.Tensor | None]:
    """See :meth:`flatview.FlatView.tensor_norms`."""
    table = rt.table
    with checked_everywhere(rt):
        p = check_norm_type(norm_type)
        given = _given_tensors(table, tensors)
        check_phase(rt, "tensor_norms", grads=False)
    indices = [i for i in table.order if i in given]
    by_view = {id(table.tensor(i)): given[i] for i in indices}
    rows = whole_norms(rt, indices, [("tensor", lambda view: by_view[id(view)])], p)
    return {table.name(i): norm for i, (norm,) in zip(indices, rows, strict=True)}


def _given_tensors(table: ParamTable, tensors: TensorsByParam) -> dict[int, torch.Tensor | None]:
    if not isinstance(tensors, Mapping):
        raise NormError(
            "tensors must map parameters (or names) to tensors laid out like their views, "
            f"got {type(tensors).__name__}"
        )
    given: dict[int, torch.Tensor | None] = {}
    for index, value in zip(indices_of(table, tensors, "tensors"), tensors.values(), strict=True):
        if value is not None and not isinstance(value, torch.Tensor):
            raise NormError(
                f"tensors[{table.name(index)!r}] must be a tensor or None, got "
                f"{type(value).__name__}"
            )
        given[index] = value
    return given
