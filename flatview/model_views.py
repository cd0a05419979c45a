"""Every flat parameter's views of one wrapped model, moved together: :class:`ModelViews`.

:mod:`flatview.views` handles the views of one flat parameter. The runtime moves all of
them at once at each lifecycle point: show or hide them, rebind them to the current
shards, move gradients between views and flat parameters, carry what was written
through views back into the shards, and refuse a parametrization registered on a view
after wrapping. Which of these a phase calls for is the runtime's decision.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch import nn

from flatview.errors import WrapError
from flatview.table import ParamTable
from flatview.view_hooks import arm


class ModelViews:
    """The views of every flat parameter of one model (see the module docstring)."""

    def __init__(
        self,
        table: ParamTable,
        model: nn.Module,
        clean_name: Callable[[str], str],
        extra_owners: Iterable[Any],
        armed: bool,
    ) -> None:
        self.table = table
        self.model = model
        self._clean_name = clean_name
        self._armed = armed
        """Whether autograd never reaches the views (hooks on them refused: ``arm``)."""
        self._owners = _owners_by_module(
            [o for flat in table.flats for owners in flat.spec.owners for o in owners]
            + list(extra_owners)
        )

    def show_initial(self) -> None:
        """Show the views for the first time, with the gradients the flat parameters hold."""
        for flat in self.table.flats:
            flat.views.show()
            flat.views.pull_grads(used=None)
        self._arm(range(len(self.table.params)))

    def _arm(self, indices: Iterable[int]) -> None:
        if self._armed:
            for index in indices:
                if self.table.own_view(index):
                    arm(self.table.tensor(index), self.table.name(index))

    def hide(self) -> None:
        for flat in self.table.flats:
            flat.views.hide()

    def show(self) -> None:
        """Show the views again, over the shards where they are now."""
        for flat in self.table.flats:
            flat.views.rebind(flat.spec.local_shard())
            flat.views.show()

    def detach_grads(self) -> None:
        for flat in self.table.flats:
            flat.views.detach_grads()

    def push_grads(self) -> None:
        """Make the flat gradients say what the view gradients say."""
        for flat in self.table.flats:
            flat.views.push_grads()

    def combine_grads(self, used: Sequence[tuple[bool, ...]]) -> None:
        """After a synchronising backward: add the reduced gradients of the used
        segments to the views' (per flat parameter, its used flags)."""
        for flat, flags in zip(self.table.flats, used, strict=True):
            flat.views.combine_grads(used=flags)

    def reattach_grads(self) -> None:
        for flat in self.table.flats:
            flat.views.reattach_grads()

    def write_back(self) -> bool:
        """Carry values written through views (``view.data = t``, a new parameter set in
        a view's place) into the shards before the wrapper reads them; a replacing
        parameter becomes the view. Returns whether one did."""
        table = self.table
        replaced = False
        for flat, names in zip(table.flats, table.flat_names, strict=True):
            for segment, param in flat.views.write_back(names):
                table.replace_view(flat.params[segment], param)
                self._arm([flat.params[segment]])
                replaced = True
        return replaced

    def check_parametrizations(self) -> None:
        """Refuse a parametrization (``torch.nn.utils.parametrize``, ``weight_norm``,
        ``spectral_norm``, ...) registered on a view after wrapping: it would compute on
        this rank's piece (a per-piece norm, or a failure on an empty view) and train a
        copy the shard never sees."""
        for module, attrs in self._owners:
            found = module._modules.get("parametrizations")
            if found is None:
                continue
            hit = [a for a in attrs if a in found._modules]
            if hit:
                where = next(
                    self._clean_name(n) for n, m in self.model.named_modules() if m is module
                )
                raise WrapError(
                    f"a parametrization was registered on {', '.join(hit)} of "
                    f"{where or '<root>'!r} ({type(module).__name__}) after flatview.wrap: "
                    "there it acts on this rank's piece of the parameter (a view), not on "
                    "the parameter, and trains a copy the wrapper never sees. Register it "
                    "on the unwrapped model, before FSDP wraps it (torch.nn.utils."
                    "parametrize / parametrizations.weight_norm first, then FSDP, then "
                    "flatview.wrap)."
                )


def _owners_by_module(owners: Iterable[Any]) -> tuple[tuple[nn.Module, tuple[str, ...]], ...]:
    attrs: dict[int, tuple[nn.Module, list[str]]] = {}
    for owner in owners:
        attrs.setdefault(id(owner.module), (owner.module, []))[1].append(owner.attr)
    return tuple((module, tuple(names)) for module, names in attrs.values())
