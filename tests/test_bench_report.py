"""The report builder (``specdecode.bench.report``) on hand-made records: the Markdown leaderboard, and
report.md / report.json / PNG plots written and rebuilt from a directory."""

from __future__ import annotations

import json

import pytest

from bench_data import PROBES, PROMPTS, VARIANTS, fake_env, fake_models, make_records, probes_with
from specdecode.bench import report, summary
from specdecode.bench.runner import BenchConfig


@pytest.fixture()
def summ():
    return summary.summarize(make_records(), VARIANTS, PROMPTS, PROBES, "tiny", main_gammas={"ngram": 4})


def test_markdown_is_laid_out_like_the_spec_bench_leaderboard(summ, tmp_path):
    config = BenchConfig(target="tiny", methods=("ngram",), gammas=(2,), datasets=("smoke",), output=str(tmp_path))
    meta = report.build_meta(config=config, env=fake_env(), models=fake_models(), variants=VARIANTS, prompts=PROMPTS)
    text = report.markdown(summ, meta)
    assert "| Method | cat-a | cat-b | τ | Overall |" in text
    row = next(line for line in text.splitlines() if line.startswith("| ngram γ=4 |"))
    assert row.split("|")[-2].strip() == "1.62×"  # overall median speedup
    assert row.split("|")[-3].strip() == "3.80"  # tau
    assert "| HF prompt-lookup γ=4 |" in text
    assert "first diff" in text and "b/2" in text
    for section in ("Theory vs measurement", "Against the peers", "Environment", "Acceptance by draft position"):
        assert section in text
    assert "| low-bit kernel variant | not recorded |" in text
    meta = report.build_meta(config=config, env={**fake_env(), "lowbit_kernel": "avxvnni kernel (forced by "
                             "SPECDECODE_KERNEL_ISA)"}, models=fake_models(), variants=VARIANTS, prompts=PROMPTS)
    assert "| low-bit kernel variant | avxvnni kernel (forced by SPECDECODE_KERNEL_ISA) |" in report.markdown(summ, meta)
    meta["environment"]["lowbit_kernel"] = "not loaded yet"  # float weights: the kernels never loaded
    assert "| low-bit kernel variant | not used (no low-bit weights) |" in report.markdown(summ, meta)


@pytest.mark.parametrize("policy", ["fixed", "auto"])
def test_the_theory_sections_say_when_the_draft_length_was_not_fixed(summ, tmp_path, policy):
    config = BenchConfig(target="tiny", methods=("ngram",), gammas=(2,), datasets=("smoke",), output=str(tmp_path),
                         policy=policy)
    meta = report.build_meta(config=config, env=fake_env(), models=fake_models(), variants=VARIANTS, prompts=PROMPTS)
    text = report.markdown(summ, meta)
    assert (text.count("draft-length policy: a method's γ is its most per step") == 2) == (policy != "fixed")
    assert f"draft-length policy {policy}" in text  # the environment table's γ row


def test_write_and_rebuild_reports(tmp_path):
    config = BenchConfig(target="tiny", methods=("ngram",), gammas=(2,), datasets=("smoke",), output=str(tmp_path))
    recs = [{"settings_id": config.settings_id(), **r} for r in make_records()]
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs + probes_with(config)))
    result = report.write_reports(tmp_path, config=config, env=fake_env(), models=fake_models(), variants=VARIANTS,
                                  prompts=PROMPTS, records=recs, probes=PROBES)
    for name in (report.REPORT_MD, report.REPORT_JSON, report.META_JSON, *report.PLOTS):
        assert (tmp_path / name).is_file(), name
    for name in report.PLOTS:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((tmp_path / report.REPORT_JSON).read_text())
    assert data["environment"]["cpu_model"] == "test cpu"
    assert data["config"]["batch_size"] == 1 and len(data["records"]) == len(recs)
    assert data["summary"]["leaderboard"] == result["summary"]["leaderboard"]
    (tmp_path / report.REPORT_MD).unlink()
    rebuilt = report.rebuild(tmp_path)
    assert (tmp_path / report.REPORT_MD).is_file()
    assert rebuilt["summary"]["cells"]["specdecode/ngram:k=4"]["overall"]["speedup"]["median"] == pytest.approx(1.625)
