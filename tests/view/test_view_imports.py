"""The view's modules import one way: no module of cockpit.view imports (even inside a
function) a module that imports it back."""

from __future__ import annotations

import ast
from pathlib import Path

VIEW = Path(__file__).resolve().parents[2] / "src" / "cockpit" / "view"


def view_imports() -> dict[str, set[str]]:
    """Module → the cockpit.view modules it imports anywhere in its source (a module of a
    subpackage by its dotted name below cockpit.view, e.g. ``live.renderer``; the
    subpackage's ``__init__`` by the subpackage's name)."""
    found = {}
    for path in VIEW.rglob("*.py"):
        parts = path.relative_to(VIEW).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cockpit.view"):
                below = ".".join(node.module.split(".")[2:])
                deps |= {below} if below else {a.name for a in node.names}
        found[name] = deps - {name}
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found = []

    def visit(node: str, path: list[str]) -> None:
        for dep in sorted(graph.get(node, ())):
            if dep in path:
                found.append([*path[path.index(dep):], dep])
            else:
                visit(dep, [*path, dep])

    for node in graph:
        visit(node, [node])
    return found


def test_view_modules_have_no_import_cycle() -> None:
    graph = view_imports()
    assert "cockpit_view" in graph["__init__"] and "layers" in graph["cockpit_view"]
    assert "live.page" in graph["live.renderer"] and "live.renderer" in graph["live"]
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"], ["b", "a", "b"]]
