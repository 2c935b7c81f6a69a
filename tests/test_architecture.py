"""The package's shape, checked from the source: the core never imports a plugin, the contracts a plugin
author implements do not depend on the runtime, and no two core modules import each other at module
level (an import cycle is an import-order bug waiting for the first refactoring)."""

from __future__ import annotations

import ast
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


def imports(path: Path, *, top_level_only: bool) -> Iterator[str]:
    """Absolute module names imported by ``path`` (``from a import b``: ``a.b`` if it is a module, else ``a``).
    ``top_level_only`` skips imports inside functions and ``if TYPE_CHECKING:`` blocks, which run late
    or never and so cannot form an import-time cycle."""
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes: list[ast.AST] = list(tree.body) if top_level_only else list(ast.walk(tree))
    while nodes:
        node = nodes.pop()
        if top_level_only and isinstance(node, (ast.If, ast.Try)):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            nodes.extend(node.body + getattr(node, "orelse", []) + [h for h in getattr(node, "handlers", [])])
            continue
        if top_level_only and isinstance(node, ast.ExceptHandler):
            nodes.extend(node.body)
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from package import submodule`` needs the submodule, not the rest of the package.
            for alias in node.names:
                yield f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES else node.module


def test_plugin_modules_are_found():
    assert {"mineonline_ppo", "mineonline_lmdb", "mineonline_wandb", "mineonline_vpt"} <= set(PLUGIN_MODULES)


def test_the_core_never_imports_a_plugin():
    offenders = [
        f"{name} imports {imported}"
        for name, path in core_modules().items()
        for imported in imports(path, top_level_only=False)
        if imported.split(".")[0] in PLUGIN_MODULES
    ]
    assert offenders == []


def test_contracts_do_not_depend_on_the_runtime():
    """What a plugin author reads (``contracts``) stands on its own: no runtime, rollout or trainer."""
    runtime = ("mineonline_core.runtime", "mineonline_core.rollout", "mineonline_core.trainer", "mineonline_core.builtin")
    offenders = [
        f"{name} imports {imported}"
        for name, path in core_modules().items()
        if name.startswith("mineonline_core.contracts")
        for imported in imports(path, top_level_only=False)
        if imported.startswith(runtime)
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
    modules = core_modules()
    graph = {
        name: {imported for imported in imports(path, top_level_only=True) if imported in modules and imported != name}
        for name, path in modules.items()
    }
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


@pytest.mark.parametrize("graph, cyclic", [({"a": {"b"}, "b": {"a"}}, True), ({"a": {"b"}, "b": {"c"}}, False),
                                          ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True)])  # fmt: skip
def test_the_cycle_finder_finds_cycles(graph, cyclic):
    assert (find_cycle(graph) is not None) == cyclic
