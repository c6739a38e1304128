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


#: Runs in a fresh interpreter: imports the top-level torch, numpy and transformers packages (third-party only:
#: no ``specdecode`` module is loaded, and a module binds a name only by importing it itself, which imports the
#: same top-level package first anyway), then imports each module in its own forked child: no other
#: ``specdecode`` module is imported first to hide a missing import, and the 2-3 s start of torch and
#: transformers is paid once instead of once per module.
_IMPORT_EACH = r"""
import importlib, json, os, sys, traceback
import numpy, torch, transformers  # noqa: E401, F401
assert not [m for m in sys.modules if m.split(".")[0] == "specdecode"]
names, batch, failed = json.loads(sys.argv[1]), int(sys.argv[2]), {}


def child(name, w):
    code = 0
    try:
        importlib.import_module(name)
    except SystemExit as e:
        code = 0 if e.code in (0, None) else 1
        os.write(w, f"SystemExit({e.code!r})".encode())
    except BaseException as e:
        code = 1
        os.write(w, traceback.format_exception_only(type(e), e)[-1].strip().encode())
    os._exit(code)


for i in range(0, len(names), batch):
    running = []
    for name in names[i : i + batch]:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            child(name, w)
        os.close(w)
        running.append((name, pid, r))
    for name, pid, r in running:
        with os.fdopen(r) as f:
            msg = f.read()
        _, status = os.waitpid(pid, 0)
        if status:
            failed[name] = msg or f"exit status {status}"
print(json.dumps(failed))
"""


@pytest.mark.slow
def test_every_module_imports_on_its_own():
    """Each module in a fresh process (no other module imported first to hide a missing import)."""
    import json

    names = [n for n in modules() if not n.endswith("__main__")]
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    run = subprocess.run([sys.executable, "-c", _IMPORT_EACH, json.dumps(names), "4"], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    failed = json.loads(run.stdout.strip().splitlines()[-1])
    assert not failed, failed


@pytest.mark.slow
def test_the_import_check_reports_a_module_that_fails_alone(tmp_path):
    """The negative control: a module that fails on import (a missing name) is reported, one that imports is not."""
    import json

    (tmp_path / "broken_mod.py").write_text("x = undefined_name\n")
    (tmp_path / "fine_mod.py").write_text("import json\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{SRC}"}
    run = subprocess.run([sys.executable, "-c", _IMPORT_EACH, json.dumps(["broken_mod", "fine_mod"]), "2"], env=env,
                         capture_output=True, text=True, timeout=120)
    failed = json.loads(run.stdout.strip().splitlines()[-1])
    assert list(failed) == ["broken_mod"] and "undefined_name" in failed["broken_mod"], failed
