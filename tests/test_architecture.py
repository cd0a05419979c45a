"""The shape of the code, checked: arrows point one way, rooms stay small.

These tests read the sources (``ast``), they import nothing from flatview. They fail
when a change adds an import cycle (deferred and ``TYPE_CHECKING`` imports count: a cycle
through a function-level import is still one concept depending on itself), lets a lower
layer import a higher one, reads another module's underscore names, or grows a module
past what one reader holds in mind.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "flatview"
MAX_LINES = 520

# Each layer may import only layers before it (and itself). A module not listed is
# checked for cycles, size and docstrings, but its layer is not asserted.
LAYERS: tuple[tuple[str, ...], ...] = (
    # Plain data and pure rules: no torch.distributed, nothing of flatview's runtime.
    (
        "flatview.errors",
        "flatview.layout",
        "flatview.phase",
        "flatview.stats",
        "flatview.skip",
        "flatview.views",
    ),
    # Collectives: functions and reduction objects that take what they need.
    ("flatview.comm",),
    # What adapters and the core exchange (specs and the adapter/runtime protocols).
    ("flatview.backends.base",),
)
# Modules that must never import the user's handle or the runtime that drives it.
BELOW_THE_CORE = (
    "flatview.errors",
    "flatview.phase",
    "flatview.layout",
    "flatview.stats",
    "flatview.skip",
    "flatview.views",
    "flatview.comm",
    "flatview.backends",
    "flatview.testing",
)
CORE = ("flatview.core", "flatview.handle", "flatview.runtime")
# Where users train (Lightning, accelerate): above the handle and above the package's
# own `wrap`, which its framework modules call as users' code does. Nothing below imports
# the room, except `flatview.wrap`'s one call to find the wrapper inside a framework
# object (INTEGRATIONS_ENTRY), which imports nothing but the errors.
INTEGRATIONS = ("flatview.integrations",)
INTEGRATIONS_ENTRY = "flatview.integrations.frameworks"
ENTRY_MAY_IMPORT = ("flatview.errors",)
# torch's own privates that flatview's adapters read on torch objects on purpose, and that
# flatview happens to define too: nn.Module's registries, FlatParameter's records.
THIRD_PARTY_PRIVATES = {
    "_modules": "nn.Module's child registry",
    "_parameters": "nn.Module's parameter registry",
    "_buffers": "nn.Module's buffer registry",
}
THIRD_PARTY_READS = {
    # torch FlatParameter._params, read by the torch FSDP1 adapter's modules.
    ("flatview.backends.torch_fsdp", "_params"): "torch_fsdp*",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


@cache
def _tree(name: str) -> ast.Module:
    path = _modules()[name]
    return ast.parse(path.read_text(), filename=str(path))


def _imports(name: str) -> Iterator[tuple[str, int]]:
    """Every flatview module ``name`` imports, anywhere in its body, with the line."""
    modules = _modules()
    is_package = _modules()[name].name == "__init__.py"
    for node in ast.walk(_tree(name)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("flatview"):
                    yield _existing(alias.name), node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name if is_package else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            if not base.startswith("flatview"):
                continue
            for alias in node.names:
                # `from flatview import norms` imports the module flatview.norms, not the
                # package's __init__ (which would make every module depend on all others).
                candidate = f"{base}.{alias.name}"
                yield (candidate if candidate in modules else _existing(base)), node.lineno


def _existing(name: str) -> str:
    modules = _modules()
    while name not in modules and "." in name:
        name = name.rpartition(".")[0]
    return name


def _graph() -> dict[str, set[str]]:
    return {name: {target for target, _ in _imports(name) if target != name} for name in _modules()}


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_no_import_cycle() -> None:
    graph = _graph()
    # The package's __init__ re-exports the public names; modules inside must not
    # import it (they would import everything), so it is a sink here.
    # The integrations' framework modules are the exception: they sit above it.
    offenders = sorted(
        n
        for n, targets in graph.items()
        if "flatview" in targets and not (_within(n, INTEGRATIONS) and n != INTEGRATIONS_ENTRY)
    )
    assert not offenders, f"modules importing the flatview package itself: {offenders}"
    cycles: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_layers_point_one_way() -> None:
    wrong = []
    for name in _modules():
        level = next((i for i, layer in enumerate(LAYERS) if _within(name, layer)), None)
        for target, line in _imports(name):
            if _within(name, BELOW_THE_CORE) and _within(target, CORE):
                wrong.append(f"{name}:{line} imports {target} (the core)")
            if level is None or target == name:
                continue
            target_level = next(
                (i for i, layer in enumerate(LAYERS) if _within(target, layer)), None
            )
            if target_level is None or target_level > level:
                wrong.append(f"{name}:{line} imports {target} (a higher layer)")
    assert not wrong, "\n".join(wrong)


def test_integrations_sit_on_top() -> None:
    wrong = []
    for name in _modules():
        for target, line in _imports(name):
            if not _within(target, INTEGRATIONS) or _within(name, INTEGRATIONS):
                continue
            if name == "flatview" and target == INTEGRATIONS_ENTRY:
                continue  # flatview.wrap's one call
            wrong.append(f"{name}:{line} imports {target} (the integrations)")
    for package in (INTEGRATIONS_ENTRY, *INTEGRATIONS):
        for target, line in _imports(package):
            allowed = (*ENTRY_MAY_IMPORT, INTEGRATIONS_ENTRY, package)
            if not _within(target, allowed):
                wrong.append(f"{package}:{line} imports {target} (import flatview must stay light)")
    assert not wrong, "\n".join(wrong)


def _defined_privates(name: str) -> set[str]:
    """Underscore names a module defines: functions, classes, assigned names and the
    attributes its methods assign on ``self``."""
    names: set[str] = set()
    for node in ast.walk(_tree(name)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            # Only its own objects' attributes: an adapter setting a private on a torch
            # object (``unit._comm_hook = ...``) does not make the name flatview's.
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_no_reads_of_other_modules_privates() -> None:
    """``obj._name`` may read a private only if this module defines that name: a name
    defined only by another flatview module is that module's business. (Privates of
    torch and fairscale are read by the adapters on purpose and are not flatview's.)"""
    defined = {name: _defined_privates(name) for name in _modules()}
    everywhere = set().union(*defined.values())
    wrong = []
    for name in _modules():
        own = defined[name]
        for node in ast.walk(_tree(name)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("flatview"):
                wrong += [
                    f"{name}:{node.lineno} imports {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
            if not isinstance(node, ast.Attribute):
                continue
            attr = node.attr
            if not attr.startswith("_") or attr.startswith("__") or attr in own:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if attr in THIRD_PARTY_PRIVATES or any(
                name.startswith(module) and attr == private for module, private in THIRD_PARTY_READS
            ):
                continue
            if attr in everywhere:
                wrong.append(f"{name}:{node.lineno} reads .{attr}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("name", sorted(_modules()))
def test_module_is_one_room(name: str) -> None:
    path = _modules()[name]
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE.parent)} has {lines} lines"
    if lines > 5:
        assert ast.get_docstring(_tree(name)), f"{name} opens with no docstring"
