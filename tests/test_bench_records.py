"""``records.jsonl`` (``specdecode.bench.records.RecordStore``): appended as runs end, resumed by settings,
a partial last line (a killed run) dropped, corrupt lines skipped."""

from __future__ import annotations

import json

from specdecode.bench.records import RECORDS_FILE, RecordStore


def _run(variant, prompt, rep=0, **kw):
    return {"kind": "run", "variant": variant, "prompt": prompt, "rep": rep, **kw}


def test_records_are_appended_at_once_and_resumed_by_settings(tmp_path):
    store = RecordStore(tmp_path, "abc")
    assert store.records == [] and not store.path.exists()
    store.add(_run("v", "p", wall_s=1.0))
    store.add({"kind": "probe", "model": "m", "forward_s": {"0": 0.1}})
    lines = (tmp_path / RECORDS_FILE).read_text().splitlines()  # on disk before the store is closed
    assert [json.loads(x)["settings_id"] for x in lines] == ["abc", "abc"]
    again = RecordStore(tmp_path, "abc")
    assert again.records == store.records and again.ignored == 0
    assert again.has("run", "v", "p") and not again.has("run", "v", "p", rep=1) and not again.has("run", "w", "p")
    assert again.has("probe", model="m") and not again.has("probe", model="other")
    assert [r["variant"] for r in again.of_kind("run")] == ["v"] and len(again.of_kind("probe")) == 1
    other = RecordStore(tmp_path, "xyz")  # other settings: nothing to resume, the old lines stay
    assert other.records == [] and other.ignored == 2 and not other.has("run", "v", "p")
    other.add(_run("v", "p"))
    assert len((tmp_path / RECORDS_FILE).read_text().splitlines()) == 3
    assert len(RecordStore(tmp_path, "abc").records) == 2


def test_a_partial_last_line_is_dropped_and_its_run_redone(tmp_path):
    store = RecordStore(tmp_path, "s")
    store.add(_run("v", "p1"))
    store.add(_run("v", "p2"))
    path = tmp_path / RECORDS_FILE
    path.write_text(path.read_text() + '{"settings_id": "s", "kind": "run", "vari')  # killed mid-write
    resumed = RecordStore(tmp_path, "s")
    assert [r["prompt"] for r in resumed.records] == ["p1", "p2"]
    assert path.read_text().endswith("}\n")  # the fragment is cut from the file
    resumed.add(_run("v", "p3"))  # and the next record starts on a line of its own
    assert [json.loads(x)["prompt"] for x in path.read_text().splitlines()] == ["p1", "p2", "p3"]


def test_a_file_holding_only_a_fragment_or_corrupt_lines(tmp_path):
    path = tmp_path / RECORDS_FILE
    path.write_text('{"kind": "ru')
    assert RecordStore(tmp_path, "s").records == [] and path.read_text() == ""
    path.write_text('{"settings_id": "s", "kind": "run", "variant": "v", "prompt": "a"}\nnot json\n\n'
                    '{"settings_id": "s", "kind": "run", "variant": "v", "prompt": "b", "rep": 1}\n')
    store = RecordStore(tmp_path, "s")
    assert [r["prompt"] for r in store.records] == ["a", "b"]  # the corrupt line is skipped (its run redone)
    assert store.has("run", "v", "a") and store.has("run", "v", "b", rep=1) and not store.has("run", "v", "b")


def test_records_keep_unicode_and_the_token_ids(tmp_path):
    store = RecordStore(tmp_path, "s")
    store.add(_run("v", "p", text="naïve — 東京", token_ids=[5, 0, 70000]))
    raw = (tmp_path / RECORDS_FILE).read_text(encoding="utf-8")
    assert "東京" in raw  # written as UTF-8, not escaped
    (back,) = RecordStore(tmp_path, "s").records
    assert back["text"] == "naïve — 東京" and back["token_ids"] == [5, 0, 70000] and back["settings_id"] == "s"
