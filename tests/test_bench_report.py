"""The report builder (bench/summary.py, bench/report.py) on hand-made records, and method specs."""

from __future__ import annotations

import dataclasses
import json
import statistics

import pytest

from specdecode.bench import report, summary
from specdecode.bench.runner import (
    BenchConfig,
    BuildContext,
    MethodSpec,
    build_proposer_for,
    expand_methods,
    main_gamma_of,
    select_prompts,
)
from specdecode.metrics import RunMetrics
from specdecode.proposers import PROPOSERS, NgramProposer
from specdecode.types import SpecDecodeError

PROMPTS = [
    {"key": "a/1", "dataset": "a", "category": "cat-a", "prompt_tokens": 10, "chat_template": True},
    {"key": "b/1", "dataset": "b", "category": "cat-b", "prompt_tokens": 10, "chat_template": True},
    {"key": "a/2", "dataset": "a", "category": "cat-a", "prompt_tokens": 10, "chat_template": True},
    {"key": "b/2", "dataset": "b", "category": "cat-b", "prompt_tokens": 10, "chat_template": True},
]
VARIANTS = [
    {"key": "specdecode/plain", "engine": "specdecode", "method": "plain", "gamma": 0, "family": "plain",
     "peer_of": None, "draft": None},
    {"key": "specdecode/ngram:k=4", "engine": "specdecode", "method": "ngram", "gamma": 4, "family": "ngram",
     "peer_of": None, "draft": None},
    {"key": "specdecode/ngram:k=2", "engine": "specdecode", "method": "ngram", "gamma": 2, "family": "ngram",
     "peer_of": None, "draft": None},
    {"key": "hf/plain", "engine": "hf", "method": "plain", "gamma": 0, "family": "hf/plain", "peer_of": None,
     "draft": None},
    {"key": "hf/prompt-lookup:k=4,max_ngram=3", "engine": "hf", "method": "prompt-lookup", "gamma": 4,
     "family": "hf/prompt-lookup", "peer_of": "specdecode/ngram:k=4", "draft": None},
]
TOKENS = list(range(100, 120))  # 20 generated tokens, the same for every variant


def metrics(steps: list[tuple[int, int]], verify_s: float, draft_s: float = 0.0, prefill_s: float = 0.1) -> dict:
    """RunMetrics of a run whose steps drafted / accepted as given (each step commits accepted + 1)."""
    m = RunMetrics(num_prompt_tokens=10)
    for drafted, accepted in steps:
        m.record_step(drafted, accepted, accepted + 1)
    m.num_generated_tokens = 1 + sum(a + 1 for _, a in steps)
    m.prefill_time_s, m.verify_time_s, m.draft_time_s = prefill_s, verify_s, draft_s
    m.wall_time_s = prefill_s + verify_s + draft_s
    return m.to_dict()


def record(variant: str, prompt: str, wall: float, met: dict | None, tokens=TOKENS) -> dict:
    info = next(v for v in VARIANTS if v["key"] == variant)
    cat = next(p["category"] for p in PROMPTS if p["key"] == prompt)
    return {"kind": "run", "variant": variant, "prompt": prompt, **info, "category": cat, "token_ids": list(tokens),
            "new_tokens": len(tokens), "wall_s": wall, "finish_reason": "length", "metrics": met}


def make_records() -> list[dict]:
    recs = []
    plain_steps = [(0, 0)] * 19
    # ngram k=4: 5 steps of 4 drafted / 3 accepted = 20 tokens with the prefill's first
    ng4 = [(4, 3)] * 4 + [(2, 2)]
    ng2 = [(2, 2)] * 6 + [(1, 0)]
    walls = {"a/1": (2.0, 1.0, 1.6, 2.2, 1.1), "a/2": (2.0, 0.8, 1.5, 2.2, 1.0),
             "b/1": (2.0, 1.6, 1.8, 2.2, 2.0), "b/2": (2.0, 2.0, 1.9, 2.2, 2.4)}
    for p, (w_plain, w4, w2, w_hf, w_hf4) in walls.items():
        recs.append(record("specdecode/plain", p, w_plain, metrics(plain_steps, w_plain - 0.15)))
        recs.append(record("specdecode/ngram:k=4", p, w4, metrics(ng4, w4 - 0.2, 0.01)))
        recs.append(record("specdecode/ngram:k=2", p, w2, metrics(ng2, w2 - 0.2, 0.01)))
        recs.append(record("hf/plain", p, w_hf, None))
        tokens = TOKENS if p != "b/2" else TOKENS[:3] + [7] + TOKENS[4:]
        recs.append(record("hf/prompt-lookup:k=4,max_ngram=3", p, w_hf4, None, tokens))
    return recs


PROBES = [{"kind": "probe", "model": "tiny", "role": "target", "context_tokens": 50,
           "forward_s": {"0": 0.1, "1": 0.11, "2": 0.12, "4": 0.14, "8": 0.2}}]


@pytest.fixture()
def summ():
    return summary.summarize(make_records(), VARIANTS, PROMPTS, PROBES, "tiny", main_gammas={"ngram": 4})


def test_speedups_are_medians_of_per_prompt_ratios(summ):
    cells = summ["cells"]["specdecode/ngram:k=4"]
    assert cells["cat-a"]["speedup"]["median"] == pytest.approx(statistics.median([2.0 / 1.0, 2.0 / 0.8]))
    assert cells["cat-b"]["speedup"]["median"] == pytest.approx(statistics.median([2.0 / 1.6, 2.0 / 2.0]))
    overall = [2.0, 2.5, 1.25, 1.0]
    assert cells["overall"]["speedup"]["median"] == pytest.approx(statistics.median(overall))
    assert cells["overall"]["speedup"]["min"] == pytest.approx(1.0)
    assert cells["overall"]["throughput_ratio"] == pytest.approx(8.0 / 5.4)
    hf = summ["cells"]["hf/prompt-lookup:k=4,max_ngram=3"]["cat-a"]["speedup"]["median"]
    assert hf == pytest.approx(statistics.median([2.2 / 1.1, 2.2 / 1.0]))  # HF over HF plain


def test_tau_acceptance_and_survival_are_pooled(summ):
    m = summ["cells"]["specdecode/ngram:k=4"]["overall"]["metrics"]
    assert m["tau"] == pytest.approx(19 / 5)
    assert m["acceptance_rate"] == pytest.approx(14 / 18)
    # positions 0, 1 reached by all 5 steps, 2 and 3 by the four 4-token drafts: all kept but position 3
    assert m["survival"] == pytest.approx([1.0, 1.0, 1.0, 0.0])
    assert m["drafted_by_position"] == [20, 20, 16, 16] and m["accepted_by_position"] == [20, 20, 16, 0]  # 4 prompts
    assert m["time_split"]["draft"] > 0 and sum(m["time_split"].values()) == pytest.approx(1.0)


def test_agreement_reports_first_differing_position(summ):
    mm = summ["agreement"]["mismatches"]
    assert {(m["variant"], m["prompt"], m["reference"], m["first_diff"]) for m in mm} == {
        ("hf/prompt-lookup:k=4,max_ngram=3", "b/2", "specdecode/plain", 3),
        ("hf/prompt-lookup:k=4,max_ngram=3", "b/2", "hf/plain", 3),
    }
    assert summ["agreement"]["checked"]["specdecode/ngram:k=4"] == 4
    assert summary.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert summary.first_difference([1, 2, 3], [1, 2]) == 2
    assert summary.first_difference([1, 9], [1, 2]) == 1


def test_theory_and_sweep_figures(summ):
    pred = summ["predictions"]["specdecode/ngram:k=4"]
    # draft lengths 4, 4, 4, 4, 2 over survival 1, 1, 1, 0: the prediction reproduces tau
    assert pred["expected_tokens"] == pytest.approx(1 + (4 * 3 + 2) / 5) == pytest.approx(pred["measured_tau"])
    assert pred["ideal_speedup"] >= pred["overhead_aware_speedup"]
    assert pred["verify_ratio_probe"] == pytest.approx(1.4)
    assert 0 < pred["efficiency"]
    sw = summ["sweeps"]["ngram"]
    assert sw["gammas"] == [2, 4]
    assert len(sw["predicted_speedup"]) == len(sw["curve_gammas"]) == 8
    assert sw["best_gamma_measured"] in (2, 4)
    assert summ["leaderboard"] == ["specdecode/ngram:k=4", "hf/prompt-lookup:k=4,max_ngram=3"]
    peer = summ["peers"][0]["categories"]["overall"]
    assert peer["ratio"] == pytest.approx(peer["ours_speedup"] / peer["hf_speedup"])


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


def test_write_and_rebuild_reports(tmp_path):
    config = BenchConfig(target="tiny", methods=("ngram",), gammas=(2,), datasets=("smoke",), output=str(tmp_path))
    recs = [{"settings_id": config.settings_id(), **r} for r in make_records()]
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs + PROBES_WITH(config)))
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


def PROBES_WITH(config):  # noqa: N802 - reads like the constant it extends
    return [{"settings_id": config.settings_id(), **p} for p in PROBES]


def fake_env() -> dict:
    return {"date": "2026-01-01T00:00:00+00:00", "cpu_model": "test cpu", "cpu_flags": ["avx2"], "cpu_count": 2,
            "usable_cores": 2, "memory_gib": 8.0, "torch_threads": 2, "torch_interop_threads": 2,
            "platform": "linux", "python": "3.11", "torch": "2", "transformers": "5", "specdecode": "0.1",
            "git_commit": None}


def fake_models() -> dict:
    t = {"name": "tiny", "source": "test", "sha256": "0" * 64, "parameters": 1000, "architecture": "Llama",
         "layers": 2, "vocab_size": 64, "dtype": "torch.float32", "load_seconds": 0.0}
    return {"target": t, "drafts": {}}


# --------------------------------------------------------------------------- method specs


def test_method_spec_parsing_and_canonical_form():
    s = MethodSpec.parse(" ngram : k=5, max_ngram=4 ,min-ngram=2")
    assert (s.name, s.gamma, dict(s.options)) == ("ngram", 5, {"max_ngram": "4", "min_ngram": "2"})
    assert s.canonical == "ngram:k=5,max_ngram=4,min_ngram=2"
    assert s.family == "ngram:max_ngram=4,min_ngram=2"
    assert MethodSpec.parse("draft-model").canonical == "draft-model"
    for bad in ("", ":k=3", "ngram:k=0", "ngram:k=x", "ngram:oops"):
        with pytest.raises(SpecDecodeError):
            MethodSpec.parse(bad)


def test_methods_default_to_the_registry_and_expand_over_gammas():
    cfg = BenchConfig(methods=(), gammas=(1, 8), datasets=("smoke",))
    specs = expand_methods(cfg)
    names = {s.name for s in specs}
    assert "ngram" in names and "draft-model" not in names  # no --draft: model-based methods are skipped
    assert sorted(s.gamma for s in specs if s.name == "ngram") == [1, 4, 8]
    with_draft = expand_methods(dataclasses.replace(cfg, draft="some-draft", methods=("draft-model:k=3",)))
    assert [s.canonical for s in with_draft] == ["draft-model:k=3,model=some-draft", "draft-model:k=1,model=some-draft",
                                                 "draft-model:k=8,model=some-draft"]
    assert main_gamma_of(with_draft) == {"draft-model:model=some-draft": 3}
    with pytest.raises(SpecDecodeError, match="registered"):
        expand_methods(dataclasses.replace(cfg, methods=("no-such-method",)))


def test_generic_builder_fills_config_fields_with_their_types():
    ctx = BuildContext(target=None, load_draft=lambda spec: pytest.fail("no draft needed"), default_draft=None)
    prop = build_proposer_for(MethodSpec.parse("ngram:k=5,max_ngram=4,min_ngram=2"), ctx)
    assert isinstance(prop, NgramProposer) and (prop.config.min_ngram, prop.config.max_ngram) == (2, 4)
    with pytest.raises(SpecDecodeError, match="no option"):
        build_proposer_for(MethodSpec.parse("ngram:depth=3"), ctx)
    with pytest.raises(SpecDecodeError, match="must be int"):
        build_proposer_for(MethodSpec.parse("ngram:max_ngram=many"), ctx)
    with pytest.raises(SpecDecodeError, match="needs a draft model"):
        build_proposer_for(MethodSpec.parse("draft-model:k=2"), ctx)


@dataclasses.dataclass(frozen=True)
class EchoConfig:
    width: int = 1
    scale: float = 1.0
    loud: bool = False
    shape: tuple[int, ...] = (1,)


class Echo:
    """A stand-in proposer factory with the registry's usual shape: a draft ``model`` and a config dataclass."""

    def __init__(self, model, config: EchoConfig | None = None):
        self.model, self.config = model, config


def test_a_newly_registered_proposer_plugs_in_without_harness_changes():
    PROPOSERS["echo-test"] = Echo
    try:
        loaded = []
        ctx = BuildContext(target=None, default_draft="d0",
                           load_draft=lambda spec: loaded.append(spec) or type("M", (), {"model": spec})())
        prop = build_proposer_for(MethodSpec.parse("echo-test:k=3,width=7,scale=0.5,loud=yes,shape=4/2/1,model=d1"),
                                  ctx)
        assert prop.config == EchoConfig(width=7, scale=0.5, loud=True, shape=(4, 2, 1)) and prop.model == "d1"
        assert loaded == ["d1"]
    finally:
        del PROPOSERS["echo-test"]


def test_prompt_selection_caps_per_category_round_robin():
    prompts = select_prompts(["smoke"], limit=1)
    assert [p.category for p in prompts] == ["summarization", "qa", "coding"]
    assert prompts[2].is_completion and not prompts[0].is_completion
    all_smoke = select_prompts(["smoke"], limit=None)
    assert [p.category for p in all_smoke[:3]] == ["summarization", "qa", "coding"] and len(all_smoke) == 6


def test_fastest_of_repeated_runs_is_used():
    a = {"variant": "v", "prompt": "p", "wall_s": 2.0, "rep": 0}
    b = {"variant": "v", "prompt": "p", "wall_s": 1.5, "rep": 1}
    c = {"variant": "w", "prompt": "p", "wall_s": 9.0, "rep": 0}
    assert summary.fastest_runs([a, b, c]) == {("v", "p"): b, ("w", "p"): c}


def test_settings_added_later_keep_old_output_dirs_resumable():
    base = BenchConfig(datasets=("smoke",))
    assert set(base.settings()) == {"target", "max_new_tokens", "temperature", "seed", "dtype", "chat", "batch_size",
                                    "kernel"}
    assert dataclasses.replace(base, draft_weights="int8").settings_id() != base.settings_id()
    assert dataclasses.replace(base, gammas=(1, 2), limit=9, repeats=3).settings_id() == base.settings_id()


def test_llama_cpp_variants_have_their_own_baseline_and_agreement():
    """llama.cpp runs the 4-bit GGUF: its speedups are over its own plain decoding, and its outputs
    are checked against its own plain only (never against ours)."""
    from specdecode.bench import summary as S

    variants = [
        {"key": "specdecode/plain", "engine": "specdecode"},
        {"key": "llama.cpp/plain", "engine": "llama.cpp"},
        {"key": "llama.cpp/prompt-lookup:k=6,max_ngram=3", "engine": "llama.cpp"},
    ]
    assert [S.baseline_of(v) for v in variants] == ["specdecode/plain", "llama.cpp/plain", "llama.cpp/plain"]
    runs = {("specdecode/plain", "p"): {"token_ids": [1, 2, 3]},
            ("llama.cpp/plain", "p"): {"token_ids": [1, 9, 9]},
            ("llama.cpp/prompt-lookup:k=6,max_ngram=3", "p"): {"token_ids": [1, 9, 8]}}
    res = S.agreement(runs, variants, ["p"])
    assert [(m["variant"], m["first_diff"]) for m in res["mismatches"]] == [
        ("llama.cpp/prompt-lookup:k=6,max_ngram=3", 2)]
