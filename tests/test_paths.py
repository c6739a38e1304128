"""Output paths are probed before the work (``specdecode.paths``), by every command and library entry that
writes: one line, exit status 2, nothing left behind, nothing slow run first.

Unwritable places that stay unwritable for root too (CI may run as root, where permission bits do not
stop a write): a path under a regular file, ``/proc`` (no new entries), a name longer than NAME_MAX.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from specdecode.paths import OutputPathError, check_output_dir, check_output_file

LONG = "x" * 300  # longer than any file system's NAME_MAX (255)


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_a_writable_folder_passes_and_nothing_is_left_behind(tmp_path):
    assert check_output_dir(tmp_path / "new", "--output") == tmp_path / "new"
    assert check_output_dir(tmp_path, "--output") == tmp_path
    assert check_output_file(tmp_path / "t.toml", "--output") == tmp_path / "t.toml"
    assert _listing(tmp_path) == []  # the probes made and removed "new", a probe file and t.toml


def test_an_existing_file_is_left_as_it_was(tmp_path):
    file = tmp_path / "t.toml"
    file.write_text("keep me")
    before = file.stat().st_mtime_ns
    check_output_file(file, "--output")
    assert file.read_text() == "keep me" and file.stat().st_mtime_ns == before


@pytest.mark.parametrize("make, flag, needle", [
    (lambda t: t / "file" / "out", "--output", "is a file, not a folder"),
    (lambda t: t / "missing" / "out", "--output", "does not exist; create it first"),
    (lambda t: t / LONG, "--output", "cannot write there"),
    (lambda t: Path("/proc/specdecode-no-such-dir"), "--work-dir", "cannot write there"),
    (lambda t: t / "file", "--out", "is a file, not a folder"),
])
def test_an_unwritable_folder_is_refused_in_one_line(tmp_path, make, flag, needle):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputPathError, match=needle) as info:
        check_output_dir(make(tmp_path), flag)
    assert str(info.value).startswith(f"{flag} ") and "\n" not in str(info.value)
    assert _listing(tmp_path) == ["file"]


@pytest.mark.parametrize("make, needle", [
    (lambda t: t, "is a folder; give a file name"),
    (lambda t: t / "file" / "t.toml", "is a file, not a folder"),
    (lambda t: t / "missing" / "t.toml", "does not exist"),
    (lambda t: t / (LONG + ".toml"), "cannot write it"),
    (lambda t: Path("/proc/specdecode-tune.toml"), "cannot write it"),
])
def test_an_unwritable_file_is_refused_in_one_line(tmp_path, make, needle):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputPathError, match=needle):
        check_output_file(make(tmp_path), "--output")
    assert _listing(tmp_path) == ["file"]


def test_an_empty_path_is_refused():
    for check in (check_output_dir, check_output_file):
        with pytest.raises(OutputPathError, match="--output is empty"):
            check("", "--output")
        with pytest.raises(OutputPathError, match="--output is empty"):
            check("  ", "--output")


def test_a_default_path_may_make_its_parents_a_named_one_may_not(tmp_path):
    deep = tmp_path / "a" / "b" / "c"
    with pytest.raises(OutputPathError, match="does not exist"):
        check_output_dir(deep, "--output")
    check_output_dir(deep, "--output", default=True)
    check_output_file(deep / "t.toml", "--output", default=True)
    assert _listing(tmp_path) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permission bits")
def test_a_read_only_folder_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(OutputPathError, match="cannot write"):
        check_output_dir(ro / "out", "--output")
    with pytest.raises(OutputPathError, match="cannot write"):
        check_output_file(ro / "t.toml", "--output")


# --------------------------------------------------------------------------- every command, before the work


def _refused(capsys, argv: list[str], needle: str) -> None:
    from specdecode.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


@pytest.fixture
def nothing_slow(monkeypatch):
    """Every slow entry (loading a model, running the audit / bench / tune / training) fails the test."""
    import specdecode.audit.runner as audit_runner
    import specdecode.bench.runner as bench_runner
    import specdecode.eagle.train as train
    import specdecode.models as models
    import specdecode.tune as tune

    def slow(*args, **kwargs):
        raise AssertionError("slow work started before the output path was checked")

    for module, name in ((models, "load_model"), (train, "run"), (bench_runner, "run_bench"),
                         (tune, "select_tune_prompts"), (audit_runner, "_load")):
        monkeypatch.setattr(module, name, slow)


@pytest.mark.parametrize("argv, needle", [
    (["audit", "--local", "--prompt", "hi", "--output", "/proc/specdecode-no/report"], "--output /proc"),
    (["bench", "--smoke", "--output", "/proc/specdecode-no"], "--output /proc"),
    (["bench", "--smoke", "--report-only", "--output", "/proc/specdecode-no"], "holds no benchmark run"),
    (["bench", "--verify-table", "--output", "/proc/specdecode-no"], "--output /proc"),
    (["tune", "--dataset", "humaneval:1", "--output", "/proc/specdecode-tune.toml"], "--output /proc"),
    (["tune", "--dataset", "humaneval:1", "--output", "/sys/specdecode-tune.toml"], "--output /sys"),
    (["train-drafter", "--out", "/proc/specdecode-no"], "--out /proc"),
    (["train-drafter", "--work-dir", "/proc/specdecode-no"], "--work-dir /proc"),
])
def test_every_command_refuses_an_unwritable_output_before_the_work(capsys, nothing_slow, argv, needle):
    _refused(capsys, argv, needle)


def test_a_missing_parent_is_refused_and_not_created(capsys, nothing_slow, tmp_path):
    for argv, flag in ((["audit", "--local", "--prompt", "hi", "--output"], "--output"),
                       (["bench", "--smoke", "--output"], "--output"),
                       (["tune", "--dataset", "humaneval:1", "--output"], "--output"),
                       (["train-drafter", "--work-dir"], "--work-dir")):
        _refused(capsys, [*argv, str(tmp_path / "typo" / "out")], f"{flag} {tmp_path / 'typo' / 'out'}")
    assert _listing(tmp_path) == []


def test_the_library_entries_check_before_loading(monkeypatch, tmp_path):
    """The same check where the library writes: bench's run_bench, train-drafter's run, run_audit."""
    import specdecode.audit.runner as audit_runner
    import specdecode.bench.runner as bench_runner
    import specdecode.models as models
    from specdecode.audit.config import AuditConfig, AuditSetup
    from specdecode.eagle.train import TrainConfig, run

    def slow(*args, **kwargs):
        raise AssertionError("slow work started before the output path was checked")

    for module, name in ((models, "load_model"), (bench_runner, "select_prompts"), (audit_runner, "_load")):
        monkeypatch.setattr(module, name, slow)
    with pytest.raises(OutputPathError, match="--work-dir"):
        run("smollm2-135m", TrainConfig(), work_dir="/proc/specdecode-no")
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputPathError, match="--out"):
        run("smollm2-135m", TrainConfig(), work_dir=tmp_path / "work", out=tmp_path / "file" / "x")
    with pytest.raises(OutputPathError, match="--output"):
        bench_runner.run_bench(bench_runner.smoke_config(output="/proc/specdecode-no"), progress=False)
    setup = AuditSetup(target="smollm2-135m", prompts=(("p", "hi", False),), sampling={"temperature": 1.0},
                       config=AuditConfig(), output="/proc/specdecode-no")
    with pytest.raises(OutputPathError, match="--output"):
        audit_runner.run_audit(setup, say=lambda _: None)
    assert _listing(tmp_path) == ["file"]


@pytest.mark.parametrize("argv, flag", [
    (["audit", "--local", "--prompt", "hi", "--output", ""], "--output"),
    (["bench", "--smoke", "--output", ""], "--output"),
    (["tune", "--dataset", "humaneval:1", "--output", ""], "--output"),
    (["train-drafter", "--out", ""], "--out"),
    (["train-drafter", "--work-dir", " "], "--work-dir"),
])
def test_an_empty_output_path_is_refused_not_taken_for_the_current_folder(capsys, nothing_slow, argv, flag):
    """``--output ''`` once wrote bench records into the current folder (Path('') is '.')."""
    _refused(capsys, argv, f"{flag} is empty")


def test_a_refused_bench_leaves_no_output_folder(capsys, tmp_path):
    """An unknown method is refused after the output was checked: the folder is not made for nothing."""
    from specdecode.cli import main

    out = tmp_path / "run"
    assert main(["bench", "--smoke", "--methods", "nosuch:k=3", "--output", str(out)]) == 2
    assert "unknown method 'nosuch'" in capsys.readouterr().err and not out.exists()


def test_a_failed_command_removes_the_output_folders_it_made_and_left_empty(tmp_path):
    from specdecode.paths import removed_if_left_empty

    out = tmp_path / "a" / "b"
    with pytest.raises(RuntimeError), removed_if_left_empty(out):
        out.mkdir(parents=True)
        raise RuntimeError("the run failed")
    assert not (tmp_path / "a").exists()
    with pytest.raises(RuntimeError), removed_if_left_empty(out):  # a record written: kept, with the record
        out.mkdir(parents=True)
        (out / "records.jsonl").write_text("{}\n")
        raise RuntimeError("the run failed later")
    assert (out / "records.jsonl").is_file()
    with removed_if_left_empty(tmp_path / "c"):  # success: whatever was made stays
        (tmp_path / "c").mkdir()
    assert (tmp_path / "c").is_dir()


def test_a_verify_table_that_fails_leaves_no_output_folder(capsys, tmp_path, monkeypatch):
    """llama-bench missing: the table stops before any load, and the folder it named is not left behind."""
    from specdecode.bench import llamaserver
    from specdecode.cli import main

    monkeypatch.setattr(llamaserver, "binary", lambda name="llama-server": tmp_path / "no" / name)
    out = tmp_path / "vt"
    assert main(["bench", "--verify-table", "--target", "smollm2-135m", "--output", str(out)]) == 2
    assert "llama-bench" in capsys.readouterr().err and not out.exists()
