"""The package itself (``specdecode/__init__.py``): its exports, its version, and the quick start its
docstring shows actually imports."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import specdecode


def test_exports_and_version():
    for name in specdecode.__all__:
        assert hasattr(specdecode, name), name
    from specdecode.types import SamplingParams, SpecDecodeError

    assert specdecode.SamplingParams is SamplingParams and specdecode.SpecDecodeError is SpecDecodeError
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert specdecode.__version__ == pyproject["project"]["version"]


def test_the_docstrings_quick_start_imports():
    block = specdecode.__doc__.split("Quick start::", 1)[1]
    lines = [ln.strip() for ln in block.splitlines() if re.match(r"\s+(from|import) specdecode", ln)]
    assert lines, "the quick start shows no import"
    for line in lines:
        exec(line, {})  # noqa: S102 - the documented line must run as written
