"""The documentation site builds, and no link in it or in the README points nowhere.

``mkdocs build --strict`` with the validation of ``mkdocs.yml`` fails on a link to a missing file, a missing
anchor, a link that leaves ``docs/`` and a page missing from the navigation (the reports under
``docs/results/`` excepted); this test runs it, so CI
(``pytest -q``) fails on a broken link. The README is read on GitHub, outside the site: its relative links
are checked here against the repository's files.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed: pip install -e '.[docs]' (the test extra has it)")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    problems = [line for line in run.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert run.returncode == 0, "mkdocs build --strict failed:\n" + "\n".join(problems or [run.stderr[-3000:]])
    site = tmp_path / "site"
    assert (site / "index.html").is_file() and (site / "benchmarks" / "index.html").is_file()
    # reports that pages link to are copied as they are (text, JSON, plots)
    assert (site / "results" / "kernels" / "e2e_qwen_group32" / "report.json").is_file()


def _links(markdown: str) -> list[str]:
    """Targets of the inline links and images outside fenced code blocks."""
    text = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_readme_links_resolve():
    """Every relative link of the README names a file or folder of the repository (a heading anchor is not
    checked: GitHub makes those)."""
    readme = ROOT / "README.md"
    missing = []
    for target in _links(readme.read_text(encoding="utf-8")):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        if not (ROOT / target.split("#")[0]).exists():
            missing.append(target)
    assert not missing, f"README.md links to paths that do not exist: {missing}"
    assert any(t.startswith("docs/") for t in _links(readme.read_text(encoding="utf-8")))


def _slug(heading: str) -> str:
    """A Markdown heading's anchor as GitHub (and mkdocs' toc) make it: lower case, punctuation dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_anchors_into_the_docs_name_headings_that_exist():
    """A link like docs/benchmarks.md#some-heading goes stale when the heading is renamed (a "Latest: ..." section
    that a later one replaces): every README anchor into a Markdown file names one of its headings."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    stale = []
    for target in _links(readme):
        if "#" not in target or re.match(r"^[a-z]+:", target):
            continue
        path, anchor = target.split("#", 1)
        page = ROOT / path if path else ROOT / "README.md"
        if page.suffix != ".md" or not page.is_file():
            continue
        text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
        if anchor not in {_slug(h) for h in re.findall(r"^#+\s+(.*)$", text, flags=re.M)}:
            stale.append(target)
    assert not stale, f"README.md links to headings that do not exist: {stale}"


def test_the_plot_stays_out_of_the_wheel():
    """The package ships what loading a head reads; training plots and reports live under docs/."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    package_data = text.split("[tool.setuptools.package-data]", 1)[1].split("\n[", 1)[0]
    assert ".png" not in package_data
    assert not list((ROOT / "src").rglob("*.png"))


def test_mkdocs_is_in_the_test_extra():
    """CI installs the test extra, so the strict build above runs there rather than being skipped."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    test_extra = re.search(r"^test = \[(.*?)\]", text, flags=re.M | re.S)
    assert test_extra and "mkdocs" in test_extra.group(1)
