"""The shape of the code, checked: the rooms of ``docs/internals.md`` and the rules of the
adapter wing.

These tests read the sources (``ast``) and the rooms table of ``docs/internals.md``; they
import nothing from flatview. The table is the one statement of the rooms: every module
of the package belongs to exactly one room (the longest path of the table that holds
it), every path it names exists, and each room imports only itself and the rooms above
it in the table (deferred and ``TYPE_CHECKING`` imports count). Beyond the rooms they fail
when a change adds an import cycle, reads another module's underscore names, grows a
module past what one reader holds in mind (unless its docstring says why it must), or
breaks one of the adapter wing's rules:

* an adapter class derives from the ``Adapter`` protocol alone, and no class of the wing
  derives from another class of flatview's (components are composed, not inherited);
* every adapter's ``backend`` has an entry in the backend registry, and every entry an
  adapter;
* a ``torch.distributed`` collective is called in ``flatview/comm/`` only;
* the ``no_sync()`` window is kept by the runtime alone, the flags exchange of unused
  parameters and its error by ``comm/unused.py`` alone, and each fact in ``ONE_HOME``
  is defined once;
* adapter state is an enum with asserted transitions (``flatview.states``), not a
  boolean attribute, and no code compares a state's ``name`` to a string.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "flatview"
INTERNALS = PACKAGE.parent / "docs" / "internals.md"
MAX_LINES = 520
OVER_THE_CAP = "past the line cap"
"""What the docstring of a module longer than ``MAX_LINES`` says (with why: one concept
that splitting would cut)."""

# Where users train (Lightning, accelerate): the room below the handle in docs/internals.md.
# `flatview.wrap` calls INTEGRATIONS_ENTRY (listed in the handle's room) to find the wrapper
# inside a framework object; it imports nothing but the errors, so `import flatview` loads
# no framework.
INTEGRATIONS = ("flatview.integrations",)
INTEGRATIONS_ENTRY = "flatview.integrations.frameworks"
ENTRY_MAY_IMPORT = ("flatview.errors",)
# torch's own privates that flatview's adapters read on torch objects on purpose, and that
# flatview happens to define too: nn.Module's registries, FlatParameter's records.
THIRD_PARTY_PRIVATES = {
    "_modules": "nn.Module's child registry",
    "_parameters": "nn.Module's parameter registry",
    "_buffers": "nn.Module's buffer registry",
    "_apply": "nn.Module's conversion, which every cast and move runs",
}
THIRD_PARTY_READS: dict[tuple[str, str], str] = {}
"""(module prefix, private): a third-party private that modules of that prefix read
although a flatview module defines the same name."""

COLLECTIVES = frozenset(
    {
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_gather_single",
        "all_reduce",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "gather_object",
        "irecv",
        "isend",
        "recv",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "scatter",
        "scatter_object_list",
        "send",
        "_all_gather_base",
        "_reduce_scatter_base",
    }
)
"""``torch.distributed`` functions that communicate."""

ADAPTERS = "flatview.backends"
CONTRACT = "flatview.backends.base"
REGISTRY = "flatview.backends.registry"
WINDOW_HOME = "flatview.runtime"
"""The one module that keeps the ``no_sync()`` window (of every kind of parameter)."""
UNUSED_HOME = "flatview.comm.unused"
"""The one module of the flags exchange of unused parameters, and of its error."""
ONE_HOME = (
    "in_backward",
    "at_end_of_backward",
    "check_no_pending_backward",
    "snapshot",
    "undeclared_unused",
    "skipped_used",
    "Agreement",
    "UsageFlags",
    "Transitions",
    "Patches",
)
"""Names defined once in the package (one fact, one place; once grown twice apiece)."""


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


# ------------------------------------------------------------------------- the rooms


@cache
def _rooms() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The rooms table of ``docs/internals.md``, top to bottom: (room, the paths its
    ``modules`` column names, as ``flatview/...`` paths)."""
    text = INTERNALS.read_text()
    section = text.split("## The rooms", 1)[1].split("\n## ", 1)[0]
    rooms = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or cells[0] in ("room", "") or set(cells[0]) <= {"-", " "}:
            continue
        paths = tuple(f"flatview/{p}" for p in re.findall(r"`([\w/.]+(?:\.py|/))`", cells[1]))
        rooms.append((cells[0], paths))
    return tuple(rooms)


def _path_of(name: str) -> str:
    return str(_modules()[name].relative_to(PACKAGE.parent))


@cache
def _room_of() -> dict[str, int]:
    """Per module, the index of its room: the room whose path holds it most closely."""
    found: dict[str, int] = {}
    for name in _modules():
        path = _path_of(name)
        best: tuple[int, int] | None = None
        for index, (_, paths) in enumerate(_rooms()):
            for room_path in paths:
                holds = path == room_path or (
                    room_path.endswith("/") and path.startswith(room_path)
                )
                if holds and (best is None or len(room_path) > best[0]):
                    best = (len(room_path), index)
        if best is not None:
            found[name] = best[1]
    return found


def test_the_rooms_table_names_what_exists_and_holds_every_module() -> None:
    rooms = _rooms()
    assert len(rooms) >= 10, f"the rooms table of {INTERNALS.name} was not found: {rooms}"
    missing = [
        f"{room}: {path}"
        for room, paths in rooms
        for path in paths
        if not (PACKAGE.parent / path).exists()
    ]
    assert not missing, f"{INTERNALS.name} names modules that do not exist: {missing}"
    homeless = sorted(set(_modules()) - set(_room_of()))
    assert not homeless, f"modules in no room of {INTERNALS.name}: {homeless}"


def test_rooms_import_only_rooms_above_them() -> None:
    rooms, room_of = _rooms(), _room_of()
    wrong = []
    for name in _modules():
        for target, line in _imports(name):
            if target == "flatview" or target == name:
                continue
            if room_of[target] > room_of[name]:
                wrong.append(
                    f"{name}:{line} ({rooms[room_of[name]][0]}) imports {target} "
                    f"({rooms[room_of[target]][0]}, a room below it in the table)"
                )
    assert not wrong, "\n".join(wrong)


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


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


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
    docstring = ast.get_docstring(_tree(name)) or ""
    if lines > 5:
        assert docstring, f"{name} opens with no docstring"
    assert lines <= MAX_LINES or OVER_THE_CAP in docstring, (
        f"{path.relative_to(PACKAGE.parent)} has {lines} lines: split it by concept, or say "
        f"in its docstring why it is one concept {OVER_THE_CAP}"
    )


# ---------------------------------------------------------------- the adapter wing


def _in_adapters(name: str) -> bool:
    return name.startswith(ADAPTERS + ".") and name != CONTRACT


@cache
def _flatview_classes() -> frozenset[str]:
    """Every class name the package defines."""
    return frozenset(
        node.name
        for name in _modules()
        for node in ast.walk(_tree(name))
        if isinstance(node, ast.ClassDef)
    )


def _base_names(node: ast.ClassDef) -> list[str]:
    names = []
    for base in node.bases:
        target = base.value if isinstance(base, ast.Subscript) else base
        if isinstance(target, ast.Name):
            names.append(target.id)
        elif isinstance(target, ast.Attribute):
            names.append(target.attr)
    return names


def _backend_of(node: ast.ClassDef) -> str | None:
    """The ``backend = "..."`` a class says it is an adapter of, if any."""
    for statement in node.body:
        if (
            isinstance(statement, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "backend" for t in statement.targets)
            and isinstance(statement.value, ast.Constant)
            and isinstance(statement.value.value, str)
        ):
            return statement.value.value
    return None


@cache
def _adapter_classes() -> dict[str, tuple[str, ast.ClassDef]]:
    """Per adapter class (one that names its ``backend``, or derives from ``Adapter``):
    its module and definition."""
    found = {}
    for name in _modules():
        if not _in_adapters(name):
            continue
        for node in ast.walk(_tree(name)):
            if isinstance(node, ast.ClassDef) and (
                _backend_of(node) is not None or "Adapter" in _base_names(node)
            ):
                found[node.name] = (name, node)
    return found


def test_adapters_derive_from_the_protocol_alone_and_the_wing_composes() -> None:
    adapters = _adapter_classes()
    assert len(adapters) >= 5, sorted(adapters)
    wrong = [
        f"{module}: {cls} derives from {_base_names(node)}, not from Adapter alone"
        for cls, (module, node) in adapters.items()
        if _base_names(node) != ["Adapter"] or _backend_of(node) is None
    ]
    ours = _flatview_classes()
    for name in _modules():
        if not _in_adapters(name):
            continue
        for node in ast.walk(_tree(name)):
            if not isinstance(node, ast.ClassDef) or node.name in adapters:
                continue
            inherited = [b for b in _base_names(node) if b in ours]
            if inherited:
                wrong.append(
                    f"{name}: {node.name} derives from flatview's {inherited}: compose the "
                    "component instead"
                )
    assert not wrong, "\n".join(wrong)


def _registry_names() -> list[str]:
    """The names of the entries of ``BACKENDS`` in the registry."""
    names = []
    for node in ast.walk(_tree(REGISTRY)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "Backend"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            names.append(node.args[0].value)
    return names


def test_every_backend_is_in_the_registry() -> None:
    registered = _registry_names()
    assert len(registered) == len(set(registered)), f"entries named twice: {registered}"
    backends = {_backend_of(node): cls for cls, (_, node) in _adapter_classes().items()}
    unregistered = sorted(f"{cls} ({b!r})" for b, cls in backends.items() if b not in registered)
    assert not unregistered, f"adapters without a registry entry: {unregistered}"
    empty = sorted(set(registered) - set(backends))
    assert not empty, f"registry entries without an adapter: {empty}"


def _calls(name: str) -> Iterator[tuple[str, str, int]]:
    """(object, attribute, line) of every ``object.attribute(...)`` call in ``name``."""
    for node in ast.walk(_tree(name)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            text = ast.unparse(owner)
            yield text, node.func.attr, node.lineno


def test_collectives_are_called_in_comm_only() -> None:
    wrong = []
    for name in _modules():
        if name == "flatview.comm" or name.startswith("flatview.comm."):
            continue
        aliases = {"torch.distributed"}
        for node in ast.walk(_tree(name)):
            if isinstance(node, ast.Import):
                aliases |= {a.asname or a.name for a in node.names if a.name == "torch.distributed"}
            elif isinstance(node, ast.ImportFrom) and node.module == "torch":
                aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
            elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
                wrong += [
                    f"{name}:{node.lineno} imports the collective {a.name}"
                    for a in node.names
                    if a.name in COLLECTIVES
                ]
        for owner, attr, line in _calls(name):
            if owner in aliases and attr in COLLECTIVES:
                wrong.append(f"{name}:{line} calls {owner}.{attr} (a collective: in comm/)")
    assert not wrong, "\n".join(wrong)


def _stored_names(name: str) -> Iterator[tuple[str, int]]:
    """Every name and attribute ``name`` assigns, with the line."""
    for node in ast.walk(_tree(name)):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            yield node.id, node.lineno
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            yield node.attr, node.lineno


def test_the_window_and_the_flags_exchange_have_one_home() -> None:
    wrong = []
    for name in _modules():
        if name != WINDOW_HOME:
            wrong += [
                f"{name}:{line} keeps {stored} (the no_sync() window is the runtime's)"
                for stored, line in _stored_names(name)
                if "window" in stored.lower() or stored.lstrip("_") == "accumulating"
            ]
        if name == UNUSED_HOME:
            continue
        for node in ast.walk(_tree(name)):
            if isinstance(node, ast.ClassDef) and "flag" in node.name.lower():
                wrong.append(f"{name}:{node.lineno} defines {node.name} (flags: comm/unused.py)")
        for node in ast.walk(_tree(name)):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "UndeclaredUnusedError"
            ):
                wrong.append(
                    f"{name}:{node.lineno} builds UndeclaredUnusedError (its one text: "
                    "comm.unused.undeclared_unused)"
                )
    assert not wrong, "\n".join(wrong)


def test_one_home_per_fact() -> None:
    homes: dict[str, list[str]] = {fact: [] for fact in ONE_HOME}
    for name in _modules():
        for node in _tree(name).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                fact = node.name.lstrip("_")
                if fact in homes:
                    homes[fact].append(f"{name}:{node.lineno}")
    wrong = {fact: places for fact, places in homes.items() if len(places) != 1}
    assert not wrong, f"defined other than once: {wrong}"


def test_adapter_state_is_an_enum_not_a_flag() -> None:
    """Instance attributes of the adapter wing are never set to ``True`` / ``False`` (a
    state is an enum moved through ``flatview.states.Transitions``), and no code compares
    a ``name`` to a string (``phase.name == "COMPUTING"``)."""
    wrong = []
    for name in _modules():
        for node in ast.walk(_tree(name)):
            if (
                _in_adapters(name)
                and isinstance(node, (ast.Assign, ast.AnnAssign))
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, bool)
            ):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if (
                        isinstance(target, ast.Attribute)
                        and isinstance(target.value, ast.Name)
                        and target.value.id == "self"
                    ):
                        wrong.append(f"{name}:{node.lineno} sets self.{target.attr} to a bool")
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(isinstance(s, ast.Attribute) and s.attr == "name" for s in sides) and any(
                    isinstance(s, ast.Constant) and isinstance(s.value, str) for s in sides
                ):
                    wrong.append(f"{name}:{node.lineno} compares a name to a string")
    assert not wrong, "\n".join(wrong)
