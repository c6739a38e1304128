"""The fast lane (``pytest -m "not slow"``) keeps a test of every module whose test file mirrors it.

A test file mirrors a module when its name is the module's path with ``/`` as ``_``
(``test_proposers_ngram.py`` for ``proposers/ngram.py``). Checked on the tests this run collected, so it
speaks in the full run (CI); in the fast lane itself every collected test is fast and it passes.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "specdecode"


def mirrored_modules() -> set[str]:
    """``proposers_ngram`` for proposers/ngram.py, ``kv`` for kv/__init__.py."""
    names = set()
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            names.add("_".join(parts))
    return names


def test_every_mirrored_module_keeps_a_fast_test(request):
    modules = mirrored_modules()
    fast = defaultdict(int)
    for item in request.session.items:
        stem = Path(str(item.fspath)).stem
        if stem.startswith("test_") and stem[len("test_"):] in modules:
            fast[stem] += item.get_closest_marker("slow") is None
    all_slow = sorted(stem for stem, n in fast.items() if n == 0)
    assert not all_slow, f"these test files have no test outside the slow lane: {all_slow}"


def test_the_mirror_rule_sees_the_layout():
    modules = mirrored_modules()
    assert {"engine", "verify", "kv", "kv_owned", "proposers_ngram", "server_app"} <= modules
