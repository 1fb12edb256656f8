"""The package's modules import one way: no import cycle through the orchestrator
(cockpit/cockpit.py), the step pipeline or the diagnosis, so each can be imported, read and
tested on its own."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import cockpit

SRC = Path(cockpit.__file__).resolve().parent.parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / "cockpit").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _import_graph() -> dict[str, set[str]]:
    """module → the package's modules it imports (at any level of its code). ``from a
    import b`` is an edge to the module ``a.b`` where that is one, else to ``a``."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    edges.add(sub if sub in modules else node.module)
            elif isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def _cycle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A chain of imports from ``start`` back to it, if there is one."""
    parent: dict[str, str | None] = {start: None}
    todo = [start]
    while todo:
        current = todo.pop()
        for nxt in sorted(graph[current]):
            if nxt == start:
                chain = [current]
                while parent[chain[-1]] is not None:
                    chain.append(parent[chain[-1]])  # type: ignore[arg-type]
                return [*reversed(chain), start]
            if nxt not in parent:
                parent[nxt] = current
                todo.append(nxt)
    return None


def test_no_import_cycle_through_the_orchestrator_the_steps_or_the_diagnosis():
    graph = _import_graph()
    watched = ["cockpit.cockpit", "cockpit.diagnose.diagnoser", "cockpit.diagnose.live",
               *sorted(name for name in graph if name.startswith("cockpit.step."))]
    assert "cockpit.step.tracked_step" in watched
    cycles = {name: _cycle_through(graph, name) for name in watched}
    assert {name: chain for name, chain in cycles.items() if chain} == {}


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle_through(graph, "a") == ["a", "b", "c", "a"]
    assert _cycle_through(graph, "d") is None


def test_importing_cockpit_leaves_the_compiler_and_distributed_tensors_unimported():
    """``import cockpit`` (and its CLI and integrations) imports neither torch's compiler nor
    its distributed tensors, which alone took longer than all the rest (~0.7 s and ~0.6 s):
    a compiled model or a sharded parameter brings them with it, and Cockpit looks their
    classes up there."""
    code = ("import sys, torch; import cockpit, cockpit.cli, cockpit.integrations; "
            "print(sorted(m for m in ('torch._dynamo', 'torch.distributed.tensor') "
            "if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, cwd=SRC.parent)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


def test_compiled_models_are_recognized_once_the_compiler_is_imported():
    """The look-up sees the wrapper's class as soon as torch.compile has imported it (the
    sharded tensors' look-up is exercised by every fully_shard test)."""
    import torch
    from torch import nn

    from cockpit.engine.capture.compiled import is_compiled

    layer = nn.Linear(2, 2)
    assert not is_compiled(layer)
    assert is_compiled(torch.compile(layer))  # (imports the compiler; compiles nothing yet)
