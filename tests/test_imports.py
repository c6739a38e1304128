"""Imports run one way: the package's import graph has no cycle, and every module imports on its own.

The graph counts every ``import`` of a ``specdecode`` module, at module level and inside functions alike (a
function-local import that closes a cycle only hides it until the function runs); imports under
``if TYPE_CHECKING:`` are annotations, not dependencies, and importing a parent package (its ``__init__``) is
not an edge.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = SRC / "specdecode"


def modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the package (a package is its ``__init__``)."""
    out = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        parts = f.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def imported(name: str, file: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules ``name`` imports (anywhere in the file but under ``if TYPE_CHECKING:``)."""
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def target(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.update(t for a in child.names if (t := target(a.name)))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                for a in child.names:
                    t = target(f"{base}.{a.name}") or target(base)
                    if t:
                        found.add(t)
            visit(child)

    visit(ast.parse(file.read_text()))
    return {m for m in found if m.startswith("specdecode") and m != name and not name.startswith(m + ".")}


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(name, file, known) for name, file in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            connect(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    """The negative control: a planted two-module and three-module cycle are found, a chain is not."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"g"}, "g": set()}
    assert sorted(cycles(graph)) == [["a", "b"], ["c", "d", "e"]]


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 50 and "specdecode.engine" in graph["specdecode.generator"]  # the parser sees imports
    assert cycles(graph) == []


@pytest.mark.slow
def test_every_module_imports_on_its_own():
    """Each module in a fresh interpreter (no other module imported first to hide a missing import)."""
    names = [n for n in modules() if not n.endswith("__main__")]
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    failed = {}
    batch = 4
    for i in range(0, len(names), batch):
        procs = [(n, subprocess.Popen([sys.executable, "-c", f"import {n}"], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)) for n in names[i : i + batch]]
        for n, p in procs:
            _, err = p.communicate(timeout=300)
            if p.returncode:
                failed[n] = err.strip().splitlines()[-1] if err.strip() else f"exit {p.returncode}"
    assert not failed, failed
