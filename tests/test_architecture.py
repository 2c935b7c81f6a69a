"""The package's shape, checked from the source.

The core is a house of floors (``docs/architecture.md``), each importing only from the floors below it:

    errors < contracts < builtin < registry < config < services < rollout | trainer < driver < cli, testing

``rollout`` and ``trainer`` share a floor and never import each other: what both need (the fragment's
checksum, the sampling errors) lives below them. No import runs up a floor, whether at module level, in a
function or under ``TYPE_CHECKING``; no import cycle joins core modules, at any level; the core never
imports a plugin; a
plugin's own modules import only what ``mineonline_core``, ``mineonline_core.errors`` and
``mineonline_core.contracts`` export."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "mineonline_core"
PLUGIN_MODULES = sorted(
    {p.stem for p in (ROOT / "plugins").glob("*/mineonline_*.py")}
    | {p.name for p in (ROOT / "plugins").glob("*/mineonline_*") if p.is_dir()}
    | {p.stem for p in (ROOT / "examples").glob("*/mineonline_*.py")}
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def core_modules() -> dict[str, Path]:
    return {module_name(p): p for p in CORE.rglob("*.py")}


MODULES = {module_name(p) for p in CORE.rglob("*.py")}

#: Bottom to top; the package ``mineonline_core`` itself (its public API) is on the top floor.
FLOORS = (
    ("errors",),
    ("contracts",),
    ("builtin",),
    ("registry",),
    ("config",),
    ("services",),
    ("rollout", "trainer"),
    ("driver",),
    ("cli", "testing", ""),
)
PLUGIN_API = ("mineonline_core", "mineonline_core.errors", "mineonline_core.contracts")


def imports(path: Path) -> Iterator[str]:
    """Absolute module names imported anywhere in ``path`` (module level, functions, ``TYPE_CHECKING``
    blocks); ``from a import b`` is ``a.b`` if that is a module, else ``a``."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from package import submodule`` needs the submodule, not the rest of the package.
            for alias in node.names:
                yield f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES else node.module


def room(module: str) -> str:
    """``mineonline_core.rollout.worker`` -> ``rollout``; the package itself -> ``""``."""
    return module.split(".")[1] if "." in module else ""


def floor(module: str) -> int:
    return next(i for i, rooms in enumerate(FLOORS) if room(module) in rooms)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``a imports b`` for each import of ``graph`` from a floor to a higher one, or between two rooms of
    one floor."""
    return [
        f"{name} imports {imported}"
        for name, imported_set in sorted(graph.items())
        for imported in sorted(imported_set)
        if floor(imported) > floor(name) or (floor(imported) == floor(name) and room(imported) != room(name))
    ]


def core_graph() -> dict[str, set[str]]:
    """Core module -> the core modules it imports."""
    modules = core_modules()
    return {
        name: {imported for imported in imports(path) if imported in modules and imported != name}
        for name, path in modules.items()
    }


def test_every_core_package_has_a_floor():
    rooms = {room(name) for name in MODULES}
    assert rooms <= {r for rooms in FLOORS for r in rooms}, rooms - {r for rooms in FLOORS for r in rooms}


def test_no_import_runs_up_a_floor():
    assert upward_imports(core_graph()) == []


@pytest.mark.parametrize(
    "graph, found",
    [
        ({"mineonline_core.rollout.worker": {"mineonline_core.driver.api"}}, True),  # up a floor
        ({"mineonline_core.trainer.fetch": {"mineonline_core.rollout.buffer"}}, True),  # across a floor
        ({"mineonline_core.services.runlog": {"mineonline_core.cli"}}, True),  # to the top
        ({"mineonline_core.driver.api": {"mineonline_core.rollout.manager", "mineonline_core.errors"}}, False),
        ({"mineonline_core.rollout.worker": {"mineonline_core.rollout.fragbuild"}}, False),  # one room
    ],
)
def test_the_floor_check_finds_upward_imports(graph, found):
    assert bool(upward_imports(graph)) == found


def plugin_sources() -> list[Path]:
    """The plugins' and examples' own modules, without their tests."""
    paths = [
        *(ROOT / "plugins").glob("*/mineonline_*.py"),
        *(ROOT / "plugins").glob("*/mineonline_*/*.py"),
        *(ROOT / "examples").glob("*/mineonline_*.py"),
    ]
    return sorted(p for p in paths if "tests" not in p.parts)


def test_plugins_import_only_the_public_api():
    offenders = [
        f"{path.relative_to(ROOT)} imports {imported}"
        for path in plugin_sources()
        for imported in imports(path)
        if imported.split(".")[0] == "mineonline_core"
        and not any(imported == api or imported.startswith(api + ".") for api in PLUGIN_API[1:])
        and imported != PLUGIN_API[0]
    ]
    assert plugin_sources() and offenders == []


def test_plugin_modules_are_found():
    assert {"mineonline_ppo", "mineonline_lmdb", "mineonline_wandb", "mineonline_vpt"} <= set(PLUGIN_MODULES)


def test_the_core_never_imports_a_plugin():
    offenders = [
        f"{name} imports {imported}"
        for name, path in core_modules().items()
        for imported in imports(path)
        if imported.split(".")[0] in PLUGIN_MODULES
    ]
    assert offenders == []


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles_in_the_core():
    """Not at module level (an import-order bug waiting for the first refactoring) and not in functions
    either (two modules that need each other are one module, or a third is missing)."""
    graph = core_graph()
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


@pytest.mark.parametrize(
    "graph, cyclic",
    [({"a": {"b"}, "b": {"a"}}, True), ({"a": {"b"}, "b": {"c"}}, False), ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True)],
)
def test_the_cycle_finder_finds_cycles(graph, cyclic):
    assert (find_cycle(graph) is not None) == cyclic


def test_the_tree_is_formatted():
    """``ruff format`` (the version ``pyproject.toml`` pins) leaves every file as it is: one line length,
    one style, no diff noise from the next person's editor."""
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is not installed: pip install -e '.[test]'"
    result = subprocess.run([ruff, "format", "--check", "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_file_over_450_lines():
    paths = [
        p
        for folder in ("mineonline_core", "plugins", "tests", "benchmarks", "examples")
        for p in (ROOT / folder).rglob("*.py")
    ]
    long = {str(p.relative_to(ROOT)): n for p in paths if (n := len(p.read_text().splitlines())) > 450}
    assert long == {}
