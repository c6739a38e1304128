"""scripts/ stays sorted and documented: every program sits in a folder whose README.md gives it a line, and every
``scripts/...py`` path the docs, the package, the tests or the programs themselves mention exists.

A script moved or deleted without its docs, or added without a README line, fails here (reading files only: no
program is run).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
FOLDERS = ("bench", "research")
#: ``scripts/bench/load_test.py``, ``scripts/research/eagle_diagnose.py``: a path as prose and commands cite it.
SCRIPT_PATH = re.compile(r"scripts/[\w./-]*?\.py\b")


def _listed(readme: Path) -> list[str]:
    """The programs a folder's README.md lists: one ``- `name.py`: ...`` line each."""
    return re.findall(r"^- `([^`/]+)`", readme.read_text(encoding="utf-8"), flags=re.M)


def _citing_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "mkdocs.yml"]
    files += sorted((ROOT / "docs").rglob("*.md"))
    for folder, pattern in (("scripts", "*"), ("src", "*.py"), ("tests", "*.py")):
        files += sorted(p for p in (ROOT / folder).rglob(pattern) if p.is_file() and p.suffix in (".py", ".md"))
    return [f for f in files if f != Path(__file__).resolve()]  # this file cites a missing path on purpose


def test_scripts_live_in_the_known_folders():
    loose = [p.name for p in SCRIPTS.iterdir() if p.is_file()]
    assert not loose, f"scripts/ holds files outside bench/ and research/: {loose}"
    folders = sorted(p.name for p in SCRIPTS.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert folders == sorted(FOLDERS), f"scripts/ folders {folders}: expected {sorted(FOLDERS)}"


def test_every_program_has_its_readme_line_and_every_line_a_program():
    for folder in FOLDERS:
        readme = SCRIPTS / folder / "README.md"
        assert readme.is_file(), f"{readme.relative_to(ROOT)} is missing"
        files = sorted(p.name for p in (SCRIPTS / folder).iterdir() if p.is_file() and p.name != "README.md")
        listed = _listed(readme)
        assert len(listed) == len(set(listed)), f"{readme.relative_to(ROOT)} lists a program twice: {listed}"
        assert sorted(listed) == files, (
            f"{readme.relative_to(ROOT)}: not listed {sorted(set(files) - set(listed))}, "
            f"listed but missing {sorted(set(listed) - set(files))}")


def test_every_cited_script_path_exists():
    missing = []
    for path in _citing_files():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for cited in SCRIPT_PATH.findall(line):
                if not (ROOT / cited).is_file():
                    missing.append(f"{path.relative_to(ROOT)}:{n}: {cited}")
    assert not missing, "paths to scripts that do not exist:\n" + "\n".join(missing)


def test_the_readmes_links_resolve():
    """The folder READMEs are read on GitHub, outside the docs site: their relative links name real files."""
    broken = []
    for folder in FOLDERS:
        readme = SCRIPTS / folder / "README.md"
        for target in re.findall(r"\]\(([^)\s]+)\)", readme.read_text(encoding="utf-8")):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            if not (readme.parent / target.split("#")[0]).exists():
                broken.append(f"{readme.relative_to(ROOT)}: {target}")
    assert not broken, f"links to paths that do not exist: {broken}"


def test_the_checks_see_a_moved_script():
    """Control: the path pattern finds a cited script that is not there, and the listing reads a README line."""
    assert SCRIPT_PATH.findall("run `python scripts/verify_cost.py --threads 1`") == ["scripts/verify_cost.py"]
    assert not (ROOT / "scripts/verify_cost.py").exists()
    assert "load_test.py" in _listed(SCRIPTS / "bench" / "README.md")
