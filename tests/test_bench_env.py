"""Machine facts for the reports (``specdecode.bench.env``): every field present, JSON-ready, and read from
/proc where it exists; the one-line description."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from specdecode.bench import env

FIELDS = {"date", "cpu_model", "cpu_flags", "cpu_count", "usable_cores", "memory_gib", "torch_threads",
          "torch_interop_threads", "platform", "python", "torch", "transformers", "specdecode", "git_commit",
          "lowbit_kernel"}


def test_environment_has_every_field_and_is_json():
    import torch

    facts = env.environment()
    assert set(facts) == FIELDS
    assert json.loads(json.dumps(facts)) == facts
    assert facts["torch_threads"] == torch.get_num_threads() and facts["torch"] == torch.__version__
    assert facts["date"].endswith("+00:00") and "T" in facts["date"]  # ISO 8601, UTC
    assert 1 <= facts["usable_cores"] <= (os.cpu_count() or 1)
    assert isinstance(facts["cpu_flags"], list) and facts["cpu_model"]


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="needs /proc")
def test_facts_match_proc():
    info = Path("/proc/cpuinfo").read_text()
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.lower().startswith("model name")), None)
    if model:
        assert env.cpu_model() == model
    flags = next(ln for ln in info.splitlines() if ln.startswith("flags")).split(":", 1)[1].split()
    assert set(env.cpu_flags()) <= set(flags)
    assert ("avx2" in env.cpu_flags()) == ("avx2" in flags)
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    kib = int(next(ln for ln in meminfo if ln.startswith("MemTotal:")).split()[1])
    assert env.memory_gib() == round(kib / 2**20, 1)
    assert env.usable_cores() == len(os.sched_getaffinity(0))


def test_unreadable_proc_gives_fallbacks(monkeypatch):
    real = Path.read_text

    def no_proc(self, *a, **k):
        if str(self).startswith("/proc/"):
            raise OSError("no /proc here")
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", no_proc)
    monkeypatch.setattr(env.platform, "processor", lambda: "")
    assert env.cpu_model() == "unknown" and env.cpu_flags() == [] and env.memory_gib() is None


def test_git_commit_inside_and_outside_a_checkout(tmp_path):
    assert env.git_commit(tmp_path) is None  # not a repository
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "f.txt").write_text("a")
    subprocess.run([*git, "-C", str(repo), "add", "f.txt"], check=True)
    subprocess.run([*git, "-C", str(repo), "commit", "-qm", "one"], check=True)
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert env.git_commit(repo) == head
    (repo / "f.txt").write_text("b")  # a tracked change
    assert env.git_commit(repo) == head + "+dirty"


def test_describe_states_machine_and_software():
    facts = {"cpu_model": "Test CPU", "usable_cores": 2, "torch_threads": 1, "memory_gib": 7.5, "torch": "2.x",
             "transformers": "5.x", "python": "3.11"}
    line = env.describe(facts)
    assert line == "Test CPU, 2 cores (1 torch threads), 7.5 GiB; torch 2.x, transformers 5.x, Python 3.11"
    assert "GiB" not in env.describe({**facts, "memory_gib": None})
