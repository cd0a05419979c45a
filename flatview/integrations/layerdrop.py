"""LayerDrop of Hugging Face ``transformers`` models, drawn alike on every rank and declared.

About 250 ``transformers`` models implement LayerDrop (Fan et al., 2019: each layer of a
stack dropped with probability ``p`` in training) the same way: inside the stack's
forward, for each layer in order, ``torch.rand([])`` is drawn and compared with
``self.layerdrop`` (BART, Whisper, M2M100, ...) or ``self.config.layerdrop``
(wav2vec2, HuBERT, ...); the layer is skipped when the draw falls under it.

Under data parallelism that decision is each rank's own (its own global generator), it is
taken inside the forward, and with flatview a step declares before its forward which
parameters it skips: a model with ``layerdrop > 0`` trains with flatview only through
:class:`LayerDrop`. It draws the decisions itself, before the forward, from a generator
seeded alike on every rank; declares the dropped layers as the step's skip set (so they
are neither gathered nor reduced, and their gradients stay ``None``); and makes the
model's own comparison give that decision. For the last part the stack's ``layerdrop``
value (on the stack, or on its config) is replaced by a float of the same value
(:class:`Decided`) whose comparison with the drawn tensor answers from the decisions. The
model's code runs unchanged: its ``torch.rand([])`` still draws, so the global generator
moves exactly as it would without flatview. The value still equals the float it replaced,
prints and serialises as that float (``save_pretrained``), and pickles as a plain float.

Checked on every forward of a stack, on every rank alike (the same decisions, the same
code): as many decisions as the stack has layers. That each layer runs exactly when it
was kept is flatview's own check of every skip set (a dropped unit called, a dropped
parameter given a gradient, a kept one left without), so nothing here hooks the layers. A
model whose layer drop flatview does not recognise is refused when the
:class:`LayerDrop` is made, naming the stack.

wav2vec2-like stacks run a dropped layer anyway under torch FSDP (``synced_gpus`` in
their forward: "under fsdp or deepspeed zero3 all gpus must run in sync"), which turns
their layer drop off there. flatview keeps every rank in step itself, so while such a
stack's forward runs it reads as not FSDP-managed, and its dropped layers are dropped.
Under DeepSpeed ZeRO-3 (a process-wide switch in ``transformers``) such a stack is
refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flatview.errors import StateError, WrapError
from flatview.handle import FlatView
from flatview.skip import SkipItem, SkipSet

_ITERATED = re.compile(r"for\s+[\w\s,()]+?\s+in\s+(?:enumerate\()?self\.(\w+)")
"""The module list a stack's forward iterates (``for layer in self.layers``)."""
_SYNCED = "synced_gpus"
"""What a stack that runs dropped layers anyway under FSDP or ZeRO-3 names its flag."""
_FSDP_MANAGED = "_is_fsdp_managed_module"
"""torch FSDP's mark on the modules it manages, which ``transformers`` reads for it."""
_KEEP_WHEN_TRUE = frozenset({"__gt__", "gt", "__ge__", "ge"})
_DROP_WHEN_TRUE = frozenset({"__lt__", "lt", "__le__", "le"})
_COMPARISONS = _KEEP_WHEN_TRUE | _DROP_WHEN_TRUE
_ANSWERS = {False: torch.tensor(False), True: torch.tensor(True)}
"""What a comparison answers (made once: a tensor made per layer costs 7 us)."""


@dataclass
class _Stack:
    """One module whose forward drops layers: where its probability lives and its layers."""

    name: str
    module: nn.Module
    layers: nn.ModuleList
    layer_names: tuple[str, ...]
    owner: Any
    """The object whose ``layerdrop`` the forward reads: the module or its config."""
    probability: float
    synced: bool
    feeds_on: _Stack | None = None
    """The encoder whose output this decoder's layers alone read (an encoder-decoder
    model's ``encoder`` beside it): unused in a step that drops all of them."""
    unread: tuple[str, ...] = ()
    """The names of ``feeds_on``'s own parameters (not those held outside it too, as a
    tied embedding is), skipped in such a step."""
    drops: tuple[bool, ...] = ()
    """This step's decisions, one per layer (True: dropped); empty outside a step."""


@dataclass
class _Frame:
    """A stack's forward in flight: how many of its decisions the model has asked for."""

    stack: _Stack
    asked: int = 0
    hid_mark: bool = False
    """Whether this forward hid torch FSDP's mark from ``transformers`` (put back after)."""

    def forced(self) -> bool:
        """Whether this step drops layers of a stack whose probability is 0 (its gate
        before the draws must open)."""
        return bool(self.stack.drops) and self.stack.probability <= 0.0

    def decide(self) -> bool:
        """The next layer's decision (True: dropped)."""
        stack = self.stack
        if not stack.drops:
            raise StateError(
                f"{stack.name!r} drew a layer-drop decision outside LayerDrop.step(): every "
                "training forward of a model with layer drop must run inside "
                "LayerDrop.step() (it declares the dropped layers); LayerDrop.remove() "
                "gives the model its own draws back"
            )
        if self.asked >= len(stack.layers):
            raise StateError(
                f"{stack.name!r} drew more layer-drop decisions than it has layers "
                f"({len(stack.layers)}): not the layer drop flatview knows"
            )
        self.asked += 1
        return stack.drops[self.asked - 1]


_FRAMES: list[_Frame] = []
"""The stacks whose forward is running, innermost last (process-wide: comparisons reach
:class:`Decided` through torch, with no handle on the :class:`LayerDrop`)."""


def _deciding(value: object) -> _Frame | None:
    """The forward in flight whose stack reads ``value`` as its probability, if any: a
    comparison of anything else is a plain float's."""
    if _FRAMES and value is getattr(_FRAMES[-1].stack.owner, "layerdrop", None):
        return _FRAMES[-1]
    return None


class Decided(float):
    """A stack's layer-drop probability whose comparison with a drawn tensor answers from
    the decisions :class:`LayerDrop` drew for the step (a plain float otherwise)."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, ...]:
        return (float, (float(self),))

    def __gt__(self, other: Any) -> bool:
        # ``self.layerdrop > 0.0``, the gate before the draws: open for a stack whose
        # layers this step drops although its own probability is 0 (an encoder whose
        # output nothing reads).
        if float(self) <= 0.0 and other == 0 and isinstance(other, (int, float)):
            frame = _deciding(self)
            return frame is not None and frame.forced()
        return float(self) > other

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if (
            name in _COMPARISONS
            and len(args) == 2
            and isinstance(args[0], torch.Tensor)
            and args[0].numel() == 1
            and (frame := _deciding(args[1])) is not None
        ):
            drop = frame.decide()
            return _ANSWERS[drop if name in _DROP_WHEN_TRUE else not drop]
        plain = [float(a) if isinstance(a, Decided) else a for a in args]
        return func(*plain, **(kwargs or {}))


def _forward_source(module: nn.Module, cache: dict[type, str]) -> str:
    kind = type(module)
    if kind not in cache:
        try:
            cache[kind] = inspect.getsource(kind.forward)
        except (OSError, TypeError):
            cache[kind] = ""
    return cache[kind]


def _find_stacks(model: nn.Module, clean: Any) -> list[_Stack]:
    sources: dict[type, str] = {}
    stacks = []
    for path, module in model.named_modules():
        source = _forward_source(module, sources)
        if "layerdrop" not in source:
            continue
        prefix = clean(path)
        name = prefix or type(module).__name__
        if "self.config.layerdrop" in source:
            owner = module.config
        elif "self.layerdrop" in source:
            owner = module
        else:
            raise WrapError(
                f"{name!r} ({type(module).__name__}) drops layers, but not by "
                "self.layerdrop or self.config.layerdrop: not the layer drop flatview knows"
            )
        iterated = _ITERATED.search(source)
        attribute = iterated.group(1) if iterated else ""
        layers = getattr(module, attribute, None)
        if not isinstance(layers, nn.ModuleList):
            raise WrapError(
                f"{name!r} ({type(module).__name__}) drops layers, but flatview found no "
                "module list its forward iterates: not the layer drop flatview knows"
            )
        path_of = f"{prefix}.{attribute}" if prefix else attribute
        names = tuple(f"{path_of}.{i}" for i in range(len(layers)))
        stacks.append(
            _Stack(name, module, layers, names, owner, float(owner.layerdrop), _SYNCED in source)
        )
    by_module = {id(stack.module): stack for stack in stacks}
    for module in model.modules():
        encoder = by_module.get(id(getattr(module, "encoder", None)))
        decoder = by_module.get(id(getattr(module, "decoder", None)))
        if encoder is not None and decoder is not None:
            decoder.feeds_on = encoder
    return stacks


def _own_parameters(fv: FlatView, module: nn.Module) -> tuple[str, ...]:
    """The original names of the parameters under ``module`` that nothing outside it
    holds (a tied embedding is held outside too)."""
    names = {id(param): name for name, param in fv.named_parameters()}
    under = {id(m) for m in module.modules()}
    inside: set[int] = set()
    outside: set[int] = set()
    for m in fv.model.modules():
        held = inside if id(m) in under else outside
        held.update(id(param) for param in m.parameters(recurse=False))
    return tuple(sorted(names[i] for i in inside - outside if i in names))


class LayerDrop:
    """The layer drop of a ``transformers`` model, the same on every rank, declared to
    flatview.

    >>> layerdrop = LayerDrop(fv, seed=0)                     # doctest: +SKIP
    >>> for batch in loader:                                  # doctest: +SKIP
    ...     with layerdrop.step():
    ...         model(**batch).loss.backward()
    ...     opt.step(); opt.zero_grad()

    Each :meth:`step` draws, for every stack in training mode with ``layerdrop > 0``,
    which of its layers to drop (each with the stack's probability, from a generator
    seeded with ``seed``: give every rank the same), and enters ``fv.step`` with those
    layers as the skip set. Every forward inside the step drops the same layers. Forwards
    in training mode outside any :meth:`step` raise :class:`~flatview.errors.StateError`;
    evaluation (``model.eval()``) draws nothing, as in ``transformers``.

    Args:
        fv: the handle of the wrapped model (``flatview.wrap``).
        seed: seeds the decisions; the same on every rank (the skip-set check of
            ``fv.step`` catches ranks that differ).

    Raises:
        WrapError: the model has no stack with layer drop, or one flatview does not
            recognise, or a stack that runs dropped layers anyway under DeepSpeed
            ZeRO-3, or one another ``LayerDrop`` already draws for (``remove()`` it
            first); the message names it.
    """

    def __init__(self, fv: FlatView, *, seed: int = 0) -> None:
        self._fv = fv
        self._stacks = _find_stacks(fv.model, fv.adapter.clean_name)
        if not self._stacks:
            raise WrapError(
                f"LayerDrop: {type(fv.model).__name__} has no module that drops layers "
                "(a transformers stack reading self.layerdrop or self.config.layerdrop)"
            )
        taken = [stack.name for stack in self._stacks if isinstance(stack.owner.layerdrop, Decided)]
        if taken:
            raise WrapError(
                f"LayerDrop: {taken} already draw(s) through another LayerDrop; remove() "
                "that one first (two would each declare their own decisions)"
            )
        _refuse_zero3(self._stacks)
        for stack in self._stacks:
            if stack.feeds_on is not None:
                stack.unread = _own_parameters(fv, stack.feeds_on.module)
        self._seed = seed
        self._generator = torch.Generator().manual_seed(seed)
        self._place = (-1, 0)
        """(optimizer step, micro-batches of it begun) of :meth:`step_at`."""
        self._handles: list[Any] = []
        self.dropped: list[str] = []
        """The original paths of the layers the latest :meth:`draw` dropped, model order."""
        for stack in self._stacks:
            stack.owner.layerdrop = Decided(stack.probability)
            self._hook(stack)

    @property
    def stacks(self) -> dict[str, float]:
        """Every stack that drops layers, by original module path: its probability."""
        return {stack.name: stack.probability for stack in self._stacks}

    def draw(self) -> list[nn.Module | str]:
        """The next step's skip set (advances the generator); :meth:`step` calls it."""
        for stack in self._stacks:
            if stack.probability <= 0.0 or not stack.module.training:
                stack.drops = ()
                continue
            draws = torch.rand(len(stack.layers), generator=self._generator)
            stack.drops = tuple(bool(d) for d in (draws < stack.probability).tolist())
        skip: list[nn.Module | str] = []
        for stack in self._stacks:
            encoder = stack.feeds_on
            if encoder is not None and stack.drops and all(stack.drops) and encoder.module.training:
                # Nothing reads the encoder's output: its layers change nothing, and its
                # own parameters (not the embedding tied to the decoder's) get no gradient.
                encoder.drops = (True,) * len(encoder.layers)
                skip += stack.unread
        self.dropped = []
        for stack in (stack for stack in self._stacks if stack.drops):
            for layer, name, drop in zip(stack.layers, stack.layer_names, stack.drops, strict=True):
                if drop:
                    skip.append(layer)
                    self.dropped.append(name)
        return skip

    @contextlib.contextmanager
    def step(self, *, skip: SkipSet = None, check: bool | None = None) -> Iterator[FlatView]:
        """One iteration's forward and backward with this step's layers dropped: ``fv.step``
        with them as the skip set, and ``skip`` (names, modules or tensors, as
        ``fv.step`` takes them) skipped as well; ``check`` as there."""
        try:
            drawn: list[SkipItem] = list(self.draw())
            if isinstance(skip, (str, nn.Module, torch.Tensor)):
                drawn.append(skip)
            elif skip is not None:
                drawn += list(skip)
            with self._fv.step(skip=drawn, check=check) as fv:
                yield fv
        finally:
            for stack in self._stacks:
                stack.drops = ()

    def step_at(
        self, step: int, *, skip: SkipSet = None, check: bool | None = None
    ) -> contextlib.AbstractContextManager[FlatView]:
        """:meth:`step` for the next micro-batch of optimizer step ``step``, its draws
        seeded from ``seed``, ``step`` and the micro-batch's place in the step: a run
        resumed at a step boundary draws what the uninterrupted run drew, with no state
        saved (the framework integrations use it, with the framework's step count)."""
        last, begun = self._place
        begun = begun + 1 if step == last else 1
        self._place = (step, begun)
        self._generator.manual_seed(_seed_at(self._seed, step, begun))
        return self.step(skip=skip, check=check)

    def state_dict(self) -> dict[str, Any]:
        """The generator's state: a resumed run draws what the uninterrupted one would."""
        return {"generator": self._generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the draws from :meth:`state_dict`."""
        self._generator.set_state(state["generator"])

    def remove(self) -> None:
        """Put the plain probabilities back and take the hooks off."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for stack in self._stacks:
            stack.owner.layerdrop = stack.probability

    def _hook(self, stack: _Stack) -> None:
        def enter(module: nn.Module, args: Any) -> None:
            frame = _Frame(stack)
            if stack.synced and getattr(module, _FSDP_MANAGED, False):
                frame.hid_mark = True
                setattr(module, _FSDP_MANAGED, False)
            _FRAMES.append(frame)

        def finished(module: nn.Module, args: Any, output: Any) -> None:
            frame = _FRAMES[-1]
            if stack.drops and frame.asked != len(stack.layers):
                raise StateError(
                    f"{stack.name!r} drew {frame.asked} layer-drop decisions for "
                    f"{len(stack.layers)} layers: not the layer drop flatview knows"
                )

        def leave(module: nn.Module, args: Any, output: Any) -> None:
            frame = _FRAMES.pop()
            if frame.hid_mark:
                setattr(module, _FSDP_MANAGED, True)

        module = stack.module
        self._handles.append(module.register_forward_pre_hook(enter))
        self._handles.append(module.register_forward_hook(finished))
        self._handles.append(module.register_forward_hook(leave, always_call=True))


def _seed_at(seed: int, step: int, micro: int) -> int:
    """The draws' seed for micro-batch ``micro`` (from 1) of optimizer step ``step``: a
    digest, the same in every process and Python version."""
    digest = hashlib.blake2b(f"{seed}:{step}:{micro}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _refuse_zero3(stacks: list[_Stack]) -> None:
    synced = [stack.name for stack in stacks if stack.synced]
    if not synced:
        return
    try:
        integrations = importlib.import_module("transformers.integrations")
    except ImportError:
        return
    if integrations.is_deepspeed_zero3_enabled():
        raise WrapError(
            f"LayerDrop: {synced} run(s) dropped layers anyway under DeepSpeed ZeRO-3 "
            "(transformers' synced_gpus): their layer drop cannot be declared"
        )
