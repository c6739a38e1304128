"""The smoke models (``specdecode.bench.smoke``), and ``specdecode bench --smoke`` end to end on them: reports,
output agreement with HF, resume."""

from __future__ import annotations

import json

import pytest
import torch

from specdecode.bench import report
from specdecode.bench.runner import RECORDS_FILE, run_bench, smoke_config
from specdecode.bench.smoke import SMOKE_DRAFT, SMOKE_TARGET, load_smoke_model, make_tokenizer, state_sha256
from specdecode.types import SpecDecodeError


def test_smoke_tokenizer_ids_and_round_trip():
    tok = make_tokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    ids = tok("def f(x):\n    return x + 1")["input_ids"]
    assert 3 not in ids and tok.decode(ids, skip_special_tokens=True) == "def f(x):\n    return x + 1"
    assert tok.decode(tok("AbC")["input_ids"], skip_special_tokens=True) == "abc"  # lowercased
    assert tok.chat_template


def test_smoke_models_are_seeded_and_the_draft_is_a_close_copy():
    target, again, draft = load_smoke_model(SMOKE_TARGET), load_smoke_model(SMOKE_TARGET), load_smoke_model(SMOKE_DRAFT)
    assert target.sha256 == again.sha256 == state_sha256(again.model) != draft.sha256
    assert target.model.dtype == torch.float64 and target.eos_token_ids == (2,)
    for m in (target.model, draft.model):
        assert not m.lm_head.weight[2].any()  # EOS never likely: random text runs to its length
    ids = torch.randint(4, 50, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        agree = (target.model(ids).logits.argmax(-1) == draft.model(ids).logits.argmax(-1)).double().mean()
    assert 0.5 < agree < 1.0  # accepted often, not always
    with pytest.raises(SpecDecodeError, match="unknown smoke model"):
        load_smoke_model("smoke:other")


def _runs(path) -> list[dict]:
    lines = (path / RECORDS_FILE).read_text().splitlines()
    return [json.loads(x) for x in lines if x.strip() and json.loads(x)["kind"] == "run"]


@pytest.fixture(scope="module", autouse=True)
def _own_cache(tmp_path_factory):
    """The runs' caches (the roofline's read bandwidth) in a temporary directory, not the user's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDECODE_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def smoke_dir(_own_cache, tmp_path_factory):
    """A whole benchmark run (about ten seconds on 2 cores): the tests that read it are in the slow lane."""
    out = tmp_path_factory.mktemp("bench") / "smoke"
    run_bench(smoke_config(output=str(out), limit=1), progress=False, log=lambda msg: None)
    return out


@pytest.mark.slow
def test_smoke_run_writes_every_report(smoke_dir):
    for name in (report.REPORT_MD, report.REPORT_JSON, report.META_JSON, *report.PLOTS):
        assert (smoke_dir / name).is_file(), name
    data = json.loads((smoke_dir / report.REPORT_JSON).read_text())
    env = data["environment"]
    for key in ("cpu_model", "usable_cores", "torch", "transformers", "torch_threads", "date"):
        assert env[key], key
    assert data["models"]["target"]["sha256"] and data["models"]["drafts"]["smoke:draft"]["sha256"]
    variants = {v["key"] for v in data["variants"]}
    assert {"specdecode/plain", "specdecode/ngram:k=4", "specdecode/ngram:k=2", "specdecode/draft-model:k=4,model=smoke:draft",
            "hf/plain", "hf/assisted:k=4,model=smoke:draft", "hf/prompt-lookup:k=4,max_ngram=3"} <= variants
    assert len(_runs(smoke_dir)) == 3 * len(variants)  # 3 categories x 1 prompt, every variant
    md = (smoke_dir / report.REPORT_MD).read_text()
    assert "| Method | summarization | qa | coding | τ | Overall |" in md
    assert "## Roofline" in md and data["roofline"]["bandwidth"]["bytes_per_s"] > 0
    target, draft = data["summary"]["roofline"]["rows"]
    assert (target["model"], target["precision"], draft["model"]) == (SMOKE_TARGET, "fp64", SMOKE_DRAFT)
    assert target["plain"]["fraction"] > 0 and target["verification"]["fraction"] > 0
    assert draft["drafting"]["fraction"] > 0 and target["kv_bytes_per_token"] > 0


@pytest.mark.slow
def test_greedy_outputs_agree_with_plain_and_hugging_face(smoke_dir):
    summ = json.loads((smoke_dir / report.REPORT_JSON).read_text())["summary"]
    assert summ["agreement"]["mismatches"] == []
    assert summ["agreement"]["checked"]["hf/assisted:k=4,model=smoke:draft"] == 3
    pred = summ["predictions"]["specdecode/draft-model:k=4,model=smoke:draft"]
    assert pred["expected_tokens"] == pytest.approx(pred["measured_tau"], rel=0.15)
    assert summ["sweeps"]["draft-model:model=smoke:draft"]["gammas"] == [2, 4]


@pytest.mark.slow
def test_rerun_resumes_and_skips_done_work(smoke_dir):
    before = _runs(smoke_dir)
    # lose the last three runs, and leave a half-written line as a killed run would
    lines = (smoke_dir / RECORDS_FILE).read_text().splitlines()
    run_lines = [i for i, x in enumerate(lines) if json.loads(x)["kind"] == "run"]
    keep = [x for i, x in enumerate(lines) if i not in run_lines[-3:]]
    (smoke_dir / RECORDS_FILE).write_text("\n".join(keep) + '\n{"kind": "run", "vari')
    run_bench(smoke_config(output=str(smoke_dir), limit=1), progress=False, log=lambda msg: None)
    after = _runs(smoke_dir)
    assert len(after) == len(before)
    redone = {(r["variant"], r["prompt"]) for r in after[-3:]}
    assert redone == {(r["variant"], r["prompt"]) for r in before[-3:]}
    assert [r["time"] for r in after[:-3]] == [r["time"] for r in before[:-3]]  # nothing else ran again


@pytest.mark.slow
def test_a_rerun_at_another_thread_count_does_not_resume(smoke_dir, tmp_path):
    """Records are keyed by the thread count they ran at: a rerun at another count runs everything again (and the
    report counts the new runs only), where it used to resume the old ones under the new count's label."""
    import shutil

    from specdecode.validate import usable_cores

    if usable_cores() < 2:
        pytest.skip("needs 2 cores for a second thread count")
    out = tmp_path / "copy"
    shutil.copytree(smoke_dir, out)
    before = _runs(out)
    assert {r["settings_id"] for r in before} == {json.loads((out / report.META_JSON).read_text())["config"]["settings_id"]}
    run_bench(smoke_config(output=str(out), limit=1, threads=2), progress=False, log=lambda msg: None)
    after = _runs(out)
    assert len(after) == 2 * len(before) and len({r["settings_id"] for r in after}) == 2
    assert json.loads((out / report.META_JSON).read_text())["config"]["threads"] == 2


@pytest.mark.slow
def test_cli_report_only_rebuilds_without_running(smoke_dir, capsys):
    from specdecode.cli import main

    (smoke_dir / report.REPORT_MD).unlink()
    n = len(_runs(smoke_dir))
    assert main(["bench", "--smoke", "--report-only", "--output", str(smoke_dir)]) == 0
    assert "# specdecode bench" in capsys.readouterr().out
    assert (smoke_dir / report.REPORT_MD).is_file() and len(_runs(smoke_dir)) == n


@pytest.mark.slow
def test_more_repeats_add_runs_and_the_fastest_counts(smoke_dir):
    before = _runs(smoke_dir)
    run_bench(smoke_config(output=str(smoke_dir), limit=1, repeats=2), progress=False, log=lambda msg: None)
    after = _runs(smoke_dir)
    assert len(after) == 2 * len(before) and {r["rep"] for r in after} == {0, 1}
    data = json.loads((smoke_dir / report.REPORT_JSON).read_text())
    for key, cells in data["summary"]["cells"].items():
        walls = {r["prompt"]: min(x["wall_s"] for x in after if x["variant"] == key and x["prompt"] == r["prompt"])
                 for r in after if r["variant"] == key}
        assert cells["overall"]["wall_s"] == pytest.approx(sum(walls.values()))


@pytest.mark.slow
def test_bench_takes_weights_auto_and_records_the_precision_that_ran(tmp_path, monkeypatch):
    """--weights auto in the benchmark too (the one precision choice of generate / serve); records and the
    report carry what ran, never "auto"; a target that is not float32 has nothing to choose from."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    lines = []
    out = tmp_path / "auto"
    run_bench(smoke_config(output=str(out), limit=1, dtype="float32", weights="auto", methods=("ngram",),
                           gammas=(), probe=False, peer=False), progress=False, log=lines.append)
    chosen = [line for line in lines if line.startswith("weights ")]
    assert len(chosen) == 1
    precision = chosen[0].split()[1].rstrip(":")
    assert precision in ("fp32", "bf16", "int8")
    settings = json.loads((out / report.REPORT_JSON).read_text())["config"]
    assert settings["weights"] == precision
    with pytest.raises(SpecDecodeError, match="--weights auto"):
        run_bench(smoke_config(output=str(tmp_path / "f64"), limit=1, weights="auto", methods=("ngram",),
                               gammas=(), probe=False, peer=False), progress=False, log=lambda msg: None)
