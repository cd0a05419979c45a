"""The framework-free parts of :mod:`flatview.integrations`, in one process: finding the
wrapper inside framework objects (stand-ins named as Lightning names its classes), the
name scopes of skip sets, instance patches, and that ``import flatview`` imports no
framework. The frameworks themselves are in ``test_integrations``."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import flatview
from flatview.errors import SkipSetError, WrapError
from flatview.integrations import find_wrapper
from flatview.integrations.batch_steps import Scope, scope_of
from flatview.integrations.patching import InstancePatches
from flatview.integrations.trainer_patches import forward_through


class _FabricModule(nn.Module):
    """Named as Fabric's module wrapper: the wrapper in ``_forward_module``."""

    def __init__(self, forward: nn.Module, original: nn.Module, strategy: object) -> None:
        super().__init__()
        self._forward_module = forward
        self._original_module = original
        self._strategy = strategy


class SingleDeviceStrategy:
    pass


class Trainer:
    def __init__(self, strategy: object) -> None:
        self.strategy = strategy


class _Strategy:
    def __init__(self, model: nn.Module | None, module: nn.Module | None) -> None:
        self.model = model
        self.lightning_module = module


class LightningModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)
        self._trainer: Trainer | None = None


class _Wrapper(nn.Module):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def test_plain_objects_come_back_unchanged() -> None:
    model = nn.Linear(2, 2)
    assert find_wrapper(model) is model
    assert find_wrapper(wrapper := _Wrapper(model)) is wrapper
    assert find_wrapper("not a model") == "not a model"


def test_fabric_module_gives_its_wrapper() -> None:
    model = nn.Linear(2, 2)
    wrapper = _Wrapper(model)
    assert find_wrapper(_FabricModule(wrapper, model, object())) is wrapper


def test_fabric_module_left_undistributed_is_refused() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(WrapError, match=r"Fabric's _FabricModule.*SingleDeviceStrategy did not"):
        find_wrapper(_FabricModule(model, model, SingleDeviceStrategy()))
    # flatview.wrap calls it first: the framework object is named, not the model.
    with pytest.raises(WrapError, match="_FabricModule"):
        flatview.wrap(_FabricModule(model, model, SingleDeviceStrategy()))


def test_trainer_and_attached_lightning_module_give_the_strategy_model() -> None:
    module = LightningModule()
    wrapper = _Wrapper(module)
    trainer = Trainer(_Strategy(wrapper, module))
    module._trainer = trainer
    assert find_wrapper(trainer) is wrapper
    assert find_wrapper(module) is wrapper


class Strategy:
    """Named and placed as Lightning's base strategy."""

    __module__ = "lightning.pytorch.strategies.strategy"

    def __init__(self, model: nn.Module, module: nn.Module) -> None:
        self.model = model
        self.lightning_module = module


class MyDDPStrategy(Strategy):
    """A user's subclass, defined outside Lightning."""

    __module__ = "tests.test_integrations_api"


def test_a_strategy_of_any_subclass_gives_its_model() -> None:
    module = LightningModule()
    wrapper = _Wrapper(module)
    assert find_wrapper(MyDDPStrategy(wrapper, module)) is wrapper
    # An object with the same attributes that is no Lightning strategy is not taken.
    impostor = _Strategy(wrapper, module)
    assert find_wrapper(impostor) is impostor


def test_trainer_before_setup_and_unattached_module_are_refused() -> None:
    module = LightningModule()
    with pytest.raises(WrapError, match="has not set the model up yet"):
        find_wrapper(Trainer(_Strategy(None, module)))
    with pytest.raises(WrapError, match="LightningModule LightningModule, which is not attached"):
        flatview.wrap(module)
    module._trainer = Trainer(_Strategy(module, module))
    with pytest.raises(WrapError, match="did not wrap the model LightningModule"):
        find_wrapper(module)


def test_scope_maps_names_relative_to_the_users_module() -> None:
    layer = nn.Linear(2, 2)
    inside = Scope(inside="module")
    assert inside.skip(["body.1", layer]) == ["module.body.1", layer]
    assert inside.skip("aux") == "module.aux"
    around = Scope(around="net")
    assert around.skip(("net.body.1", "net.aux.weight")) == ["body.1", "aux.weight"]
    assert around.skip(layer) is layer and around.skip(None) is None
    with pytest.raises(SkipSetError, match=r"'head\.weight', which is not inside 'net'"):
        around.skip(["head.weight"])
    assert Scope().skip(["x"]) == ["x"]


def test_scope_of_finds_the_users_module_either_way() -> None:
    # Older Lightning kept the LightningModule in a wrapper's `_forward_module` inside
    # DDP: names relative to the LightningModule get that path (DDP's own `module.` is
    # the adapter's to drop). FSDP2 sharding `self.net` of a LightningModule: the
    # wrapped model is inside the user's module, and names lose its path.
    class Base(nn.Module):
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self._forward_module = module

    user = LightningModule()
    ddp = _Wrapper(Base(user))
    adapter = SimpleNamespace(clean_name=lambda name: name.removeprefix("module."))
    assert scope_of(SimpleNamespace(model=ddp, adapter=adapter), user) == Scope(
        inside="_forward_module"
    )
    assert scope_of(SimpleNamespace(model=user.layer, adapter=adapter), user) == Scope(
        around="layer"
    )


def test_instance_patches_restore_what_was_there() -> None:
    class Owner:
        def method(self) -> str:
            return "class"

    owner = Owner()
    patches = InstancePatches()
    patches.set(owner, "method", lambda: "first")
    patches.set(owner, "method", lambda: "second")
    assert owner.method() == "second"
    patches.remove()
    assert owner.method() == "class" and "method" not in vars(owner)
    patches.remove()  # idempotent


def test_forward_through_runs_the_module_inside_its_wrapper() -> None:
    seen = []

    class Wrapper(nn.Module):
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append("wrapper")
            out: torch.Tensor = self.module(x) + 1
            return out

    module = nn.Identity()
    wrapper = Wrapper(module)
    x = torch.zeros(1)
    with forward_through(wrapper, module):
        assert module(x).item() == 1 and module(x).item() == 1
    assert seen == ["wrapper", "wrapper"]
    assert module(x).item() == 0 and "forward" not in vars(module)


def test_import_flatview_imports_no_framework() -> None:
    code = (
        "import sys, flatview, flatview.integrations; "
        "print(sorted(m for m in ('lightning', 'pytorch_lightning', 'lightning_fabric', "
        "'accelerate') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out


def test_accelerate_fsdp2_refuses_a_factory_that_needs_the_flatview(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under accelerate's FSDP2 plugin the optimizers are built before the wrap: a
    factory of ``(model, fv)`` is refused before anything is prepared (the stand-in's
    ``prepare`` would fail the test if it were reached)."""
    from flatview.integrations.accelerate import prepare

    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)

    def unreachable(*args: object) -> None:
        raise AssertionError("prepared")

    accelerator = SimpleNamespace(distributed_type="FSDP", is_fsdp2=True, prepare=unreachable)
    with pytest.raises(WrapError, match=r"FSDP2 plugin.*factory of \(model, fv\)"):
        prepare(accelerator, nn.Linear(2, 2), lambda m, fv: torch.optim.SGD(m.parameters()))
