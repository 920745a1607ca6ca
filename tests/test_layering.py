"""The tree's floors, read from the source: `common` (shared by both processes) imports neither
side, the gateway and the engine never import each other, nothing below `pagedserve` imports it,
the kernels import no engine code, and no module takes part in an import cycle (imports inside
functions and under TYPE_CHECKING count too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "engine", "gateway", "ops", "pagedserve")
# package -> the other top-level packages it may import
ALLOWED = {
    "common": set(),
    "ops": set(),
    "gateway": {"common"},
    "engine": {"common", "ops"},
    "pagedserve": {"common", "engine", "gateway"},
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}


def _imported_names(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (a name that is not a module counts as its package)."""
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = {resolve(imported) for imported in _imported_names(ast.parse(path.read_text()))}
        graph[name] = {t for t in targets if t is not None and t != name and not name.startswith(t + ".")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _collapse(graph: dict[str, set[str]], depth: int) -> dict[str, set[str]]:
    """The graph between packages `depth` names deep (engine.sched, engine.sample, ...)."""
    out: dict[str, set[str]] = {}
    for node, targets in graph.items():
        src = ".".join(node.split(".")[:depth])
        for target in targets:
            dst = ".".join(target.split(".")[:depth])
            if dst != src:
                out.setdefault(src, set()).add(dst)
    return out


def _wrong_floors(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        for target in targets
        if (src := module.split(".")[0]) != (dst := target.split(".")[0]) and dst not in ALLOWED[src]
    )


def test_each_floor_imports_only_the_floors_below_it() -> None:
    wrong = _wrong_floors(import_graph())
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("depth", [1, 2, 99])
def test_no_import_cycles(depth: int) -> None:
    graph = import_graph() if depth == 99 else _collapse(import_graph(), depth)
    assert _cycles(graph) == []


def test_the_checks_see_a_cycle_and_a_wrong_floor() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _wrong_floors({"gateway.x": {"engine.y", "common.z"}, "common.z": set()}) == ["gateway.x imports engine.y"]
    graph = import_graph()
    assert "common.protocol" in graph["gateway.broker.broker"]  # imports inside functions are seen too
    assert "engine.worker.cli" in graph["pagedserve.cli"]
