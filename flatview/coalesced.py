"""An optimizer over views that steps neighbouring views as one tensor: :class:`Coalesced`.

A torch optimizer runs Python per parameter tensor (``_init_group``, for foreach and
fused alike), so one over N views costs N times one over the wrapper's few flat
parameters, for the same arithmetic. :class:`Coalesced` keeps the views as its
parameters, with their state per view, and steps *runs* of views that lie end to end in
one storage, gradients and state laid out alike, as one tensor through an unmodified
inner instance of the optimizer class (user guide: ``docs/recipes.md``).

Why the numbers are the same: SGD, Adam and AdamW are elementwise, so a run computes
what its views compute when they share the hyperparameters (one group), the kind of
state and, for Adam, the step count (bias corrections). Not elementwise in the bits:
torch's fused CPU kernels round a tensor's last partial vector differently (under
``fused`` a view ends its run unless it fills whole 64-byte units: ``coalesced_plan``),
and a subclass may compute per-parameter quantities (LARS, LAMB), so only the three
classes themselves are taken. Before runs form on a device, canaries check that grouping
changes no bit there (``coalesced_check``).

State: per-element state lives in buffers this optimizer owns (``coalesced_plan``);
each view's ``state[view][key]`` is its slice, shaped like the view. State the inner
optimizer creates (first steps) or that comes from outside (``load_state_dict``) is
copied into the buffers at the next check; what was handed out is checked by identity
at every step. Adam's ``step`` is one 0-dim tensor per run, which belongs to exactly the
run's views when it steps (a view left out keeps a copy); neighbours whose counts are
equal (read on the CPU only) share one again. Every step also checks each view's
pointer (``RunPlan.moved``), size and contiguity and each gradient's pointer and
contiguity: a view failing a check is stepped on its own, as the plain optimizer would.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Iterable
from itertools import compress, repeat
from typing import Any

import torch
from torch import Tensor

from flatview.coalesced_check import unhooked_step, unlink_inexact
from flatview.coalesced_plan import (
    SOLO,
    RunPlan,
    covers,
    plan_groups,
    plans_hold,
    shortest_run,
    step_spans,
)

__all__ = ["Coalesced"]

ELEMENTWISE: dict[type, tuple[str, ...]] = {
    torch.optim.SGD: ("momentum_buffer",),
    torch.optim.Adam: ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    torch.optim.AdamW: ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
}
"""The supported classes and their state shaped like the parameter."""
SCALARS: dict[type, tuple[str, ...]] = {
    torch.optim.SGD: (),
    torch.optim.Adam: ("step",),
    torch.optim.AdamW: ("step",),
}
"""Their 0-dim state, one value per run."""

_GRAD = operator.attrgetter("grad")
_PTR = Tensor.data_ptr
_EMPTY: dict[str, Any] = {}
"""The state of a view that has none (never written)."""


class Coalesced(torch.optim.Optimizer):
    """``optimizer_class(params, **defaults)``, stepping neighbouring views as one tensor.

    Gives exactly (bit for bit) the parameters and state that ``optimizer_class(params,
    **defaults)`` gives, at the cost of an optimizer over a few tensors where views of
    one flat parameter lie end to end (see the module docstring for how and when). Its
    ``param_groups`` hold ``params`` and its ``state`` is keyed by them as torch keeps
    it: learning-rate schedulers, ``zero_grad``, ``state_dict()`` and
    ``load_state_dict()``, :meth:`flatview.FlatView.optim_state_dict` and
    :mod:`flatview.checkpoint` work as with the plain optimizer.

    What differs, visibly: per-element state tensors are slices of buffers this optimizer
    owns (views of one storage share a buffer covering them); Adam's
    ``state[view]["step"]`` may be one tensor shared by neighbouring views (each stepped
    view's count is right; ``state_dict()`` copies them apart). State tensors replaced
    from outside are copied into the buffers at the next step.

    Args:
        optimizer_class: exactly ``torch.optim.SGD``, ``torch.optim.Adam`` or
            ``torch.optim.AdamW`` (not a subclass: it may compute per-parameter
            quantities, which a run would mix).
        params: the parameters (views) or parameter groups, as for ``optimizer_class``.
        **defaults: its hyperparameters; ``foreach`` and ``fused`` as for it.
            ``differentiable=True`` is refused.

    Raises:
        TypeError: another class.
        ValueError: ``differentiable=True``.
    """

    def __init__(self, optimizer_class: type, params: Iterable[Any], **defaults: Any) -> None:
        if optimizer_class not in ELEMENTWISE or not isinstance(optimizer_class, type):
            base = [
                c.__name__
                for c in ELEMENTWISE
                if isinstance(optimizer_class, type) and issubclass(optimizer_class, c)
            ]
            why = (
                f" (a subclass of {base[0]}: it may compute per-parameter quantities, such as "
                "norms, that stepping neighbouring views as one tensor would mix)"
                if base
                else ""
            )
            raise TypeError(
                f"flatview.optim.Coalesced steps exactly torch.optim.SGD, Adam or AdamW, "
                f"not {getattr(optimizer_class, '__qualname__', optimizer_class)!r}{why}; "
                "use the class itself over the views instead"
            )
        _refuse_differentiable(defaults)
        self._defaults = dict(defaults)
        self._plans: list[RunPlan] | None = None
        """Per group, its plan; ``None`` until the next step makes them."""
        self._holders: dict[int, int] = {}
        # The inner optimizer checks the hyperparameters as the plain one would.
        self._inner: torch.optim.Optimizer = optimizer_class(
            [torch.zeros(0, requires_grad=True)], **defaults
        )
        self._inner_step = unhooked_step(optimizer_class)
        self._elementwise = ELEMENTWISE[optimizer_class]
        self._scalars = SCALARS[optimizer_class]
        self._keys = (*self._elementwise, *self._scalars)
        self._sig_keys: dict[int, tuple[tuple[str, bool], ...]] = {}
        self.stepped_tensors = 0
        """How many tensors the last :meth:`step` handed to the inner optimizer (runs
        and views stepped alone): what its per-tensor work was proportional to."""
        self._class = optimizer_class
        super().__init__(params, dict(self._inner.defaults))
        if getattr(self._inner, "_step_supports_amp_scaling", False):
            self._step_supports_amp_scaling = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's; the runs are worked out again at the next step."""
        _refuse_differentiable(param_group)
        super().add_param_group(param_group)
        self._drop_plans()

    def __repr__(self) -> str:
        return f"Coalesced({self._class.__name__}, {super().__repr__()})"

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # torch's Adam turns a step saved as a number into a tensor when it loads it.
        for group in self.param_groups:
            for key, value in self._inner.defaults.items():
                group.setdefault(key, value)
            for p in group["params"]:
                entry: dict[str, Any] = self.state.get(p) or {}
                for key in self._scalars:
                    if key in entry and not torch.is_tensor(entry[key]):
                        on_device = group.get("fused") or group.get("capturable")
                        entry[key] = torch.tensor(
                            float(entry[key]),
                            dtype=torch.float32 if on_device else torch.get_default_dtype(),
                            device=p.device if on_device else None,
                        )

    def state_dict(self) -> dict[str, Any]:
        """torch's ``state_dict()``, with a step tensor of its own for every parameter
        (neighbours share one here; a plain optimizer loading a shared one would count
        every step once per parameter sharing it)."""
        saved = super().state_dict()
        seen: set[int] = set()
        unshared = {}
        for position, entry in saved["state"].items():
            entry = dict(entry)  # torch's entries are the live state dicts
            for key in self._scalars:
                value = entry.get(key)
                if isinstance(value, Tensor):
                    if id(value) in seen:
                        entry[key] = value.clone()
                    else:
                        seen.add(id(value))
            unshared[position] = entry
        saved["state"] = unshared
        return saved

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Step every view with a gradient, runs of neighbours as one tensor.
        ``closure``, as torch's optimizers take it (Lightning's automatic optimization
        passes one): called first, with gradients on; its loss is returned."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            _refuse_differentiable(group)
        plans = self._plans
        if plans is None or not plans_hold(plans, self.param_groups):
            self._drop_plans()
            plans = self._plans = plan_groups(self.param_groups, self._elementwise, self._scalars)
            unlink_inexact(plans, self.param_groups, self._class, self._defaults)
        inner = self._inner
        inner_groups = []
        inner_state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
        posts: list[tuple[RunPlan, int, int, Tensor, dict[str, Any] | None]] = []
        fresh: list[Tensor] = []
        for group, plan in zip(self.param_groups, plans, strict=True):
            tensors = self._runs(group, plan, inner_state, posts, fresh)
            hyper = {k: v for k, v in group.items() if k != "params"}
            hyper["params"] = tensors
            inner_groups.append(hyper)
        for name in ("grad_scale", "found_inf"):
            if hasattr(self, name):
                setattr(inner, name, getattr(self, name))
        inner.param_groups = inner_groups
        inner.state = inner_state
        self.stepped_tensors = sum(len(g["params"]) for g in inner_groups)
        try:
            self._inner_step(inner)
            for p in fresh:
                if p in inner_state:
                    self.state[p] = inner_state[p]
            for plan, a, b, run, passed in posts:
                after = inner_state.get(run)
                # The inner optimizer updates the state it was given in place; what it
                # made itself (first steps) goes into the buffers.
                if passed is None or not (
                    after is not None
                    and len(after) == len(passed)
                    and all(map(operator.is_, after.values(), passed.values()))
                ):
                    self._take_state(plan, a, b, after)
        finally:
            for _, _, _, run, _ in posts:
                run.grad = None  # the gradients' memory is not held between steps
            inner.param_groups = []
            inner.state = defaultdict(dict)
            for name in ("grad_scale", "found_inf"):
                if hasattr(inner, name):
                    delattr(inner, name)
        return loss

    # ------------------------------------------------------------------ plans

    def _drop_plans(self) -> None:
        """Forget the plans: the next step plans every group again, and each view's state
        is taken in again (copied from the old buffers into new ones) at its check."""
        for plan in self._plans or ():
            for key in self._scalars:
                for value in plan.handed[key]:
                    if value is not None:
                        self._release(value)
        self._plans = None

    # ------------------------------------------------------------------ state

    def _hand(self, plan: RunPlan, key: str, i: int, value: Any) -> None:
        """Record ``value`` as view ``i``'s state ``key``, counting step holders."""
        old = plan.handed[key][i]
        if old is value:
            return
        if key in self._scalars:
            if old is not None:
                self._release(old)
            if value is not None:
                self._holders[id(value)] = self._holders.get(id(value), 0) + 1
        plan.handed[key][i] = value

    def _release(self, value: Any) -> None:
        count = self._holders[id(value)] - 1
        if count:
            self._holders[id(value)] = count
        else:
            del self._holders[id(value)]

    def _check_state(self, plan: RunPlan) -> None:
        """Take in state that is not what was handed out (the inner optimizer's first
        state of a view stepped alone, ``load_state_dict``, a user's assignment, also
        through ``.data``)."""
        states = list(map(self.state.get, plan.order, repeat(_EMPTY)))
        changed = {i for key in self._elementwise for i in plan.moved_slices(key)}
        for key, handed in plan.handed.items():
            if not all(map(operator.is_, map(dict.get, states, repeat(key)), handed)):
                values = map(dict.get, states, repeat(key))
                changed.update(
                    i for i, (v, h) in enumerate(zip(values, handed, strict=True)) if v is not h
                )
        for i in sorted(changed):
            self._take_view(plan, i, states[i])

    def _take_view(self, plan: RunPlan, i: int, state: dict[str, Any] | None) -> None:
        """View ``i``'s state into the buffers (copied), or the view marked to step alone."""
        p = plan.order[i]
        sig = 0
        for bit, key in enumerate((*self._elementwise, *self._scalars)):
            value = state.get(key) if state else None
            if value is None:
                self._hand(plan, key, i, None)
                continue
            sig |= 1 << bit
            if key in self._scalars:
                if not (isinstance(value, Tensor) and value.dim() == 0):
                    sig = SOLO
                self._hand(plan, key, i, value)
                continue
            if not (
                isinstance(value, Tensor)
                and value.shape == p.shape
                and value.dtype == p.dtype
                and value.device == p.device
                and value.layout == torch.strided
                # Another layout stays as it is: torch's fused kernels read state in
                # memory order (a momentum buffer made like a transposed gradient).
                and value.is_contiguous()
            ):
                sig = SOLO
                self._hand(plan, key, i, value)
                continue
            piece = plan.slice_of(key, i)
            if value is not piece:
                piece.copy_(value)
                assert state is not None
                state[key] = piece
            self._hand(plan, key, i, piece)
        if state:
            extra = set(state) - set(self._elementwise) - set(self._scalars)
            if extra:
                sig = SOLO  # unknown state: only the inner optimizer's own handling
        plan.set_sig(i, sig if sig >= 0 else SOLO)

    def _take_state(self, plan: RunPlan, a: int, b: int, state: dict[str, Any] | None) -> None:
        """After a run ``a:b`` stepped: state the inner optimizer created for it goes
        into the buffers and into each view's state."""
        if not state:
            return
        sig = 0
        order = plan.order
        keys = (*self._elementwise, *self._scalars)
        for key, value in state.items():
            sig |= 1 << keys.index(key)
            if key in self._scalars:
                for i in range(a, b):
                    self.state[order[i]][key] = value
                    self._hand(plan, key, i, value)
                continue
            span = plan.span(key, a, value.numel())
            if value is not span:
                span.copy_(value)
            for i in range(a, b):
                piece = plan.slice_of(key, i)
                self.state[order[i]][key] = piece
                self._hand(plan, key, i, piece)
        for i in range(a, b):
            plan.set_sig(i, sig)

    # ------------------------------------------------------------------ runs

    def _runs(
        self,
        group: dict[str, Any],
        plan: RunPlan,
        inner_state: defaultdict[Tensor, dict[str, Any]],
        posts: list[tuple[RunPlan, int, int, Tensor, dict[str, Any] | None]],
        fresh: list[Tensor],
    ) -> list[Tensor]:
        """The tensors the inner optimizer steps for ``group``: each run's alias, each
        view stepped alone; their inner state set up."""
        order = plan.order
        out: list[Tensor] = []
        alone = list(
            compress(plan.alone, map(operator.is_not, map(_GRAD, plan.alone), repeat(None)))
        )
        if order:
            ptrs = tuple(map(_PTR, order))
            if ptrs != plan.ptrs:
                plan.moved(ptrs)
            self._check_state(plan)
            grads = list(map(_GRAD, order))
            fused = bool(group.get("fused"))
            shortest = shortest_run(fused)
            spans, singles = step_spans(plan, grads, ptrs, fused)
            for i in singles:
                self._own_step(plan, i)
                alone.append(order[i])
            for a, b in spans:
                for sa, sb, step in self._step_runs(plan, a, b, shortest):
                    if sb - sa < shortest or not covers(grads[sa], plan.numels[sa:sb]):
                        for i in range(sa, sb):
                            self._own_step(plan, i)
                            alone.append(order[i])
                    else:
                        out.append(self._run(plan, sa, sb, step, grads[sa], inner_state, posts))
        state = self.state
        for p in alone:
            out.append(p)
            if p in state:
                inner_state[p] = state[p]
            else:
                fresh.append(p)
        return out

    def _own_step(self, plan: RunPlan, i: int) -> None:
        """View ``i`` steps alone: a step tensor shared with others becomes its own."""
        for key in self._scalars:
            value = plan.handed[key][i]
            if value is not None and self._holders[id(value)] > 1:
                mine = value.clone()
                self.state[plan.order[i]][key] = mine
                self._hand(plan, key, i, mine)

    def _step_runs(
        self, plan: RunPlan, a: int, b: int, shortest: int
    ) -> list[tuple[int, int, Tensor | None]]:
        """Run ``a:b`` cut where step counts differ, each piece with the step tensor that
        belongs to exactly its views (pieces shorter than ``shortest`` are stepped view
        by view, with their own)."""
        if not self._scalars or not plan.sig[a]:
            return [(a, b, None)]
        key = self._scalars[0]
        handed = plan.handed[key]
        first = handed[a]
        if first is None:
            return [(a, b, None)]
        ids = list(map(id, handed[a:b]))
        if ids.count(ids[0]) == b - a and self._holders[ids[0]] == b - a:
            return [(a, b, first)]
        # Different tensors, or one shared beyond the run: pieces of equal count get a
        # tensor of their own (values read only on the CPU: no device synchronisation).
        pieces: list[tuple[int, int]] = []
        start = a
        for i in range(a + 1, b):
            x, y = handed[i - 1], handed[i]
            if x is y:
                continue
            if x.device.type == "cpu" and y.device.type == "cpu" and x.item() == y.item():
                continue
            pieces.append((start, i))
            start = i
        pieces.append((start, b))
        out: list[tuple[int, int, Tensor | None]] = []
        for sa, sb in pieces:
            step = handed[sa]
            if sb - sa < shortest:
                out.append((sa, sb, None))
                continue
            if not all(h is step for h in handed[sa:sb]) or self._holders[id(step)] != sb - sa:
                step = step.clone()
                for i in range(sa, sb):
                    self.state[plan.order[i]][key] = step
                    self._hand(plan, key, i, step)
            out.append((sa, sb, step))
        return out

    def _keys_of(self, sig: int) -> tuple[tuple[str, bool], ...]:
        """The state keys a signature holds, each with whether it is per-element."""
        found = self._sig_keys.get(sig)
        if found is None:
            found = self._sig_keys[sig] = tuple(
                (key, key in self._elementwise)
                for bit, key in enumerate(self._keys)
                if sig & (1 << bit)
            )
        return found

    def _run(
        self,
        plan: RunPlan,
        a: int,
        b: int,
        step: Tensor | None,
        grad: Tensor,
        inner_state: defaultdict[Tensor, dict[str, Any]],
        posts: list[tuple[RunPlan, int, int, Tensor, dict[str, Any] | None]],
    ) -> Tensor:
        """The alias of views ``a:b`` (one tensor over their memory, its gradient over
        theirs) and its inner state: the views' buffer span. Aliases are kept per run
        until the views move (:meth:`RunPlan.moved`); gradients are aliased every step."""
        run = plan.run_alias(a, b)
        run.grad = torch.as_strided(grad, run.shape, (1,))
        sig = plan.sig[a]
        state: dict[str, Any] | None = None
        if sig:
            total = run.numel()
            state = {
                key: plan.span(key, a, total) if elementwise else step
                for key, elementwise in self._keys_of(sig)
            }
            inner_state[run] = dict(state)
        posts.append((plan, a, b, run, state))
        return run


def _refuse_differentiable(options: dict[str, Any]) -> None:
    if options.get("differentiable"):
        raise ValueError(
            "flatview.optim.Coalesced refuses differentiable=True: its step writes the "
            "runs' memory in place, outside autograd; use the optimizer class itself"
        )
