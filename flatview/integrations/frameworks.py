"""The distributed wrapper inside what a training framework hands its users.

Lightning and accelerate keep the DDP or FSDP module they build inside objects of their
own: Fabric's ``fabric.setup`` returns a ``_FabricModule`` whose ``_forward_module`` is
the wrapper; the Trainer keeps it as ``trainer.strategy.model`` (the LightningModule
itself under FSDP2, which shards in place); accelerate's ``prepare`` returns the wrapper
itself. :func:`find_wrapper` takes any of these (or the Trainer, its strategy, or an
attached LightningModule) and returns the wrapper, so that ``flatview.wrap`` accepts
them directly; anything else comes back unchanged, for ``flatview.wrap`` to judge.

Nothing here imports a framework: objects are recognised by what they hold (duck
typing, with the class names checked so that an unrelated object with an attribute of
the same name is not taken for one), so ``import flatview`` works without them, and
``lightning.*`` and ``pytorch_lightning.*`` objects are handled alike.
"""

from __future__ import annotations

from typing import overload

from torch import nn

from flatview.errors import WrapError

_FABRIC_MODULE = "_FabricModule"
"""Fabric's module wrapper (``lightning.fabric.wrappers``); the wrapper is its
``_forward_module``, the user's model its ``_original_module``."""
_TRAINER = "Trainer"
_LIGHTNING_MODULE = "LightningModule"
_LIGHTNING_PACKAGES = ("lightning", "pytorch_lightning")


@overload
def find_wrapper(obj: nn.Module) -> nn.Module: ...
@overload
def find_wrapper(obj: object) -> object: ...
def find_wrapper(obj: object) -> object:
    """The DDP or FSDP module inside a framework object, or ``obj`` itself.

    Recognised: Fabric's module wrapper (what ``fabric.setup`` returns), a Lightning
    ``Trainer``, its ``strategy``, and a ``LightningModule`` attached to a Trainer (the
    model the strategy built: DDP or FSDP1 around the LightningModule, or the
    LightningModule itself sharded with FSDP2). accelerate's prepared model is the
    wrapper already and comes back unchanged, as does any other object.

    Raises:
        WrapError: ``obj`` is a framework object whose model the framework did not wrap
            in anything distributed (a single-device strategy, or a Trainer before it
            set the model up); the message names the object and the strategy.
    """
    inner = getattr(obj, "_forward_module", None)
    if _named(obj, _FABRIC_MODULE) and isinstance(inner, nn.Module):
        original = getattr(obj, "_original_module", None)
        strategy = getattr(obj, "_strategy", None)
        return _distributed(inner, original, f"Fabric's {type(obj).__name__}", strategy)
    strategy = getattr(obj, "strategy", None)
    if _named(obj, _TRAINER) and strategy is not None:
        return _from_strategy(strategy, f"the {type(obj).__name__}")
    if _is_strategy(obj):
        return _from_strategy(obj, f"the {type(obj).__name__}")
    if isinstance(obj, nn.Module) and _named(obj, _LIGHTNING_MODULE):
        trainer = getattr(obj, "_trainer", None)
        if trainer is None or not hasattr(trainer, "strategy"):
            raise WrapError(
                f"flatview.wrap got the LightningModule {type(obj).__name__}, which is not "
                "attached to a Trainer: wrap it from a hook that runs once the Trainer set it "
                "up (on_fit_start or later), or use "
                "flatview.integrations.lightning.FlatViewCallback"
            )
        return _from_strategy(trainer.strategy, f"the LightningModule {type(obj).__name__}")
    return obj


def _named(obj: object, name: str) -> bool:
    """Whether ``obj``'s class, or one it derives from, is called ``name``."""
    return any(cls.__name__ == name for cls in type(obj).__mro__)


def _is_strategy(obj: object) -> bool:
    """A Lightning Trainer strategy (or a subclass of one, defined anywhere): it holds
    the wrapped model and the LightningModule."""
    return hasattr(obj, "lightning_module") and any(
        cls.__name__ == "Strategy" and cls.__module__.split(".")[0] in _LIGHTNING_PACKAGES
        for cls in type(obj).__mro__
    )


def _from_strategy(strategy: object, given: str) -> object:
    model = getattr(strategy, "model", None)
    if model is None:
        raise WrapError(
            f"flatview.wrap got {given}, whose {type(strategy).__name__} has not set the model "
            "up yet: wrap it once training started (on_fit_start or later), or use "
            "flatview.integrations.lightning.FlatViewCallback"
        )
    return _distributed(model, getattr(strategy, "lightning_module", None), given, strategy)


def _distributed(inner: nn.Module, original: object, given: str, strategy: object) -> nn.Module:
    """What flatview wraps of the framework's model ``inner``: ``inner`` itself when the
    framework wrapped the user's module in it (DDP, FSDP1), or, when the framework left
    the user's module in place (FSDP2 shards in place), the outermost module
    ``fully_shard`` sharded: the module itself, or the one submodule that holds all
    sharded ones (Lightning's idiom shards ``self.model`` in ``configure_model``)."""
    if inner is not original:
        return inner
    roots = _outermost_sharded(inner)
    if len(roots) == 1:
        return roots[0][1]
    if not roots:
        raise WrapError(
            f"flatview.wrap got {given}, whose strategy {type(strategy).__name__} did not "
            f"wrap the model {type(inner).__name__} in anything distributed: flatview "
            "needs a DDP or FSDP strategy (e.g. strategy='ddp', FSDPStrategy, "
            "ModelParallelStrategy)"
        )
    raise WrapError(
        f"flatview.wrap got {given}, whose model {type(inner).__name__} holds several "
        f"modules sharded with fully_shard side by side ({', '.join(n for n, _ in roots)}): "
        "flatview wraps one root; call fully_shard on the module that holds them all too"
    )


def _outermost_sharded(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules FSDP2's ``fully_shard`` sharded that no sharded module holds, with
    their paths in ``module`` (``[("", module)]`` when it is sharded itself)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return []
    found: list[tuple[str, nn.Module]] = []

    def visit(name: str, current: nn.Module) -> None:
        if isinstance(current, FSDPModule):
            found.append((name, current))
            return
        for child_name, child in current.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", module)
    return found
