"""The roofline (``specdecode.bench.roofline``): weight bytes per step of tiny Llamas in every precision, the
read bandwidth measured once and cached, and the fractions of the byte limit in the report."""

from __future__ import annotations

import json

import pytest
import torch

from bench_data import PROBES, PROMPTS, VARIANTS, fake_env, fake_models, make_records, probes_with
from conftest import make_tiny_model
from specdecode.bench import report, roofline, summary
from specdecode.bench.runner import BenchConfig
from specdecode.lowbit import set_weight_precision

VOCAB, HIDDEN = 60, 64


def _tiny(tied: bool = False):
    model = make_tiny_model(VOCAB)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def test_float32_and_bf16_count_every_weight_and_one_embedding_row():
    model = _tiny()
    every = sum(p.numel() for p in model.parameters())
    fp32 = roofline.weight_bytes_by_kind(model)
    assert fp32 == {"fp32": 4 * (every - VOCAB * HIDDEN + HIDDEN)}  # the LM head in full, one embedding row
    set_weight_precision(model, "bf16")
    assert roofline.weight_bytes_by_kind(model) == {"bf16": fp32["fp32"] // 2}
    assert roofline.model_facts("tiny", "target", model)["precision"] == "bf16"


def test_int8_counts_packed_weights_with_their_scales():
    model = set_weight_precision(_tiny(), "int8")
    linears = [(m.out_features, m.in_features) for m in make_tiny_model(VOCAB).modules()
               if type(m) is torch.nn.Linear]  # the LM head included
    norms = 2 * 2 + 1  # two per layer and the final one
    kinds = roofline.weight_bytes_by_kind(model)
    # Q8_0 blocks: int8 values, one float16 scale per 32 weights, no biases (the tiny Llama has none)
    assert kinds == {"int8": sum(o * i + 2 * o * i // 32 for o, i in linears), "fp32": 4 * (norms * HIDDEN + HIDDEN)}
    facts = roofline.model_facts("tiny", "target", model, torch.float64)
    assert facts["precision"] == "int8" and facts["weight_bytes"] == sum(kinds.values())
    assert facts["weight_bytes"] < roofline.weight_bytes_per_step(_tiny()) / 3


def test_tied_embeddings_are_read_in_full_once():
    model = _tiny(tied=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    unique = sum(p.numel() for p in model.parameters())  # the shared table once
    assert roofline.weight_bytes_per_step(model) == 4 * unique
    assert roofline.weight_bytes_per_step(model) == roofline.weight_bytes_per_step(_tiny()) - 4 * HIDDEN


def test_a_module_reporting_its_own_bytes_is_not_descended_into():
    class Packed(torch.nn.Module):
        weight_precision = "int4"

        def __init__(self):
            super().__init__()
            self.unpacked = torch.nn.Linear(HIDDEN, HIDDEN)  # not what a step reads

        def weight_nbytes(self) -> int:
            return 1234

    model = _tiny()
    model.lm_head = Packed()
    kinds = roofline.weight_bytes_by_kind(model)
    assert kinds["int4"] == 1234
    assert kinds["fp32"] == 4 * (sum(p.numel() for p in _tiny().model.parameters()) - VOCAB * HIDDEN + HIDDEN)


def test_kv_bytes_per_token_follow_the_cache_dtype():
    model = _tiny()  # 2 layers, 2 KV heads of 16
    assert roofline.kv_bytes_per_token(model, torch.float64) == 2 * 2 * 2 * 16 * 8
    assert roofline.kv_bytes_per_token(model, torch.bfloat16) == 2 * 2 * 2 * 16 * 2
    with pytest.raises(ValueError, match="attention shape"):
        roofline.kv_bytes_per_token(torch.nn.Linear(2, 2), torch.float32)
    assert roofline.model_facts("x", "draft", torch.nn.Linear(2, 2))["kv_bytes_per_token"] is None


def test_bandwidth_is_measured_once_cached_and_remeasured_on_request(tmp_path):
    lines: list[str] = []
    threads = torch.get_num_threads()
    first = roofline.measure_read_bandwidth(tmp_path, size_bytes=1 << 20, repeats=2, threads=1, status=lines.append)
    assert first > 0 and len(lines) == 1 and torch.get_num_threads() == threads
    path = roofline.bandwidth_cache_file(tmp_path)
    assert path.parent == tmp_path / "machine" and path.is_file()
    again = roofline.measure_read_bandwidth(tmp_path, size_bytes=1 << 20, repeats=2, threads=1, status=lines.append)
    assert again == first and len(lines) == 1  # read back, not measured
    roofline.measure_read_bandwidth(tmp_path, size_bytes=1 << 20, repeats=2, threads=1, remeasure=True,
                                    status=lines.append)
    assert len(lines) == 2
    # another size or thread count is another entry; a corrupt file is measured again
    roofline.measure_read_bandwidth(tmp_path, size_bytes=1 << 19, repeats=1, threads=1, status=lines.append)
    assert len(lines) == 3 and len(json.loads(path.read_text())[roofline.CACHE_SECTION]) == 2
    path.write_text("{not json")
    assert roofline.measure_read_bandwidth(tmp_path, size_bytes=1 << 19, repeats=1, threads=1) > 0
    with pytest.raises(ValueError):
        roofline.measure_read_bandwidth(tmp_path, size_bytes=2)


FACTS = {"bandwidth": {"bytes_per_s": 1e8, "tensor_bytes": 512 << 20, "repeats": 5, "threads": 2},
         "models": [{"model": "tiny", "role": "target", "precision": "fp32", "weight_bytes": 2_000_000,
                     "weight_bytes_by_kind": {"fp32": 2_000_000}, "kv_bytes_per_token": 1024, "kv_dtype": "float64"},
                    {"model": "tiny-draft", "role": "draft", "precision": "int8", "weight_bytes": 1_000_000,
                     "weight_bytes_by_kind": {"int8": 1_000_000}, "kv_bytes_per_token": 512, "kv_dtype": "float32"}]}
DRAFT_PROBE = {"kind": "probe", "model": "tiny-draft", "role": "draft", "context_tokens": 50,
               "forward_s": {"0": 0.05}}


def test_fractions_of_the_byte_limit():
    summ = summary.summarize(make_records(), VARIANTS, PROMPTS, [*PROBES, DRAFT_PROBE], "tiny")
    target, draft = roofline.roofline(FACTS, summ, VARIANTS, 4)["rows"]
    assert target["byte_limit_s"] == pytest.approx(0.02) and target["byte_limit_tokens_per_s"] == pytest.approx(50)
    # plain: (8 s of wall - 0.4 s of prefill) / 76 steps = 0.1 s a step; verification: the probe's 0.14 s at k = 4
    assert target["plain"]["step_s"] == pytest.approx(0.1) and target["plain"]["fraction"] == pytest.approx(0.2)
    assert target["verification"]["fraction"] == pytest.approx(0.02 / 0.14)
    assert target["drafting"] is None and draft["plain"] is None and draft["verification"] is None
    assert draft["drafting"]["fraction"] == pytest.approx(0.01 / 0.05) and "probe" in draft["drafting"]["source"]
    # without a probe, verification per step of the runs at gamma
    no_probe = summary.summarize(make_records(), VARIANTS, PROMPTS, [], "tiny")
    pooled = no_probe["pooled"]["specdecode/ngram:k=4"]
    t = roofline.roofline(FACTS, no_probe, VARIANTS, 4)["rows"][0]["verification"]
    assert t["step_s"] == pytest.approx(pooled["verify_time_s"] / pooled["num_verify_steps"])
    assert roofline.roofline(None, summ, VARIANTS, 4) is None


def test_drafting_time_comes_from_the_runs_drafting_with_the_model():
    variants = [{"key": "specdecode/draft-model:k=4", "engine": "specdecode", "gamma": 4, "draft": "d"}]
    pooled = {"specdecode/draft-model:k=4": {"is_tree": False, "draft_time_s": 1.0, "num_drafted_tokens": 40,
                                              "verify_time_s": 2.0, "num_verify_steps": 10}}
    times = roofline.step_times({"pooled": pooled, "probe": {"draft_forward_s": {"d": 9.0}}}, variants, 4)
    assert times["drafting"]["d"][0] == pytest.approx(0.025)
    assert times["verification"][0] == pytest.approx(0.2) and times["plain"] == (None, None)


def test_the_report_has_the_roofline_table(tmp_path):
    config = BenchConfig(target="tiny", methods=("ngram",), gammas=(2,), datasets=("smoke",), output=str(tmp_path))
    recs = [{"settings_id": config.settings_id(), **r} for r in make_records()]
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs + probes_with(config)))
    result = report.write_reports(tmp_path, config=config, env=fake_env(), models=fake_models(), variants=VARIANTS,
                                  prompts=PROMPTS, records=recs, probes=PROBES, roofline=FACTS)
    md = (tmp_path / report.REPORT_MD).read_text()
    assert "## Roofline" in md and "| Model | role | precision | weights MB / step |" in md
    row = next(line for line in md.splitlines() if line.startswith("| `tiny` |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[2:8] == ["fp32", "2.0", "1.0 (float64)", "0.1", "50.0 (20.00 ms)", "20% (100.0 ms)"]
    assert "test cpu (avx2)" in md
    data = json.loads((tmp_path / report.REPORT_JSON).read_text())
    assert data["roofline"] == FACTS
    assert data["summary"]["roofline"]["rows"][0]["plain"]["fraction"] == pytest.approx(0.2)
    assert result["summary"]["roofline"]["gamma"] == 4
    (tmp_path / report.REPORT_MD).unlink()
    report.rebuild(tmp_path)  # run.json keeps the roofline's inputs
    assert "20% (100.0 ms)" in (tmp_path / report.REPORT_MD).read_text()
    meta = report.build_meta(config=config, env=fake_env(), models=fake_models(), variants=VARIANTS, prompts=PROMPTS)
    summ = summary.summarize(make_records(), VARIANTS, PROMPTS, PROBES, "tiny")
    assert "_Not measured" in report.markdown(summ, meta).split("## Roofline")[1]
