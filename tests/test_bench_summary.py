"""From raw run records to the report figures (``specdecode.bench.summary``), on hand-made records:
speedups, pooled counters, agreement, the theory and the gamma sweep."""

from __future__ import annotations

import math
import statistics

import pytest

from bench_data import PROBES, PROMPTS, VARIANTS, make_records, metrics, record
from specdecode import costmodel
from specdecode.bench import summary


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


def test_fastest_of_repeated_runs_is_used():
    a = {"variant": "v", "prompt": "p", "wall_s": 2.0, "rep": 0}
    b = {"variant": "v", "prompt": "p", "wall_s": 1.5, "rep": 1}
    c = {"variant": "w", "prompt": "p", "wall_s": 9.0, "rep": 0}
    assert summary.fastest_runs([a, b, c]) == {("v", "p"): b, ("w", "p"): c}


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


def test_spread_of_positive_values():
    s = summary.spread([4, 1, 2, 3])
    assert (s["n"], s["median"], s["q1"], s["q3"], s["min"], s["max"]) == (4, 2.5, 1.75, 3.25, 1.0, 4.0)
    assert s["mean"] == 2.5 and s["geomean"] == pytest.approx(24 ** 0.25)
    one = summary.spread([2.0])
    assert one["median"] == one["q1"] == one["q3"] == one["geomean"] == 2.0
    assert summary.spread([]) is None


def test_speedup_is_wall_clock_and_decode_speedup_takes_the_prefill_out():
    """11 tokens each: ours 1.5 s (0.5 s prefill), plain 2.5 s (0.5 s prefill); an HF record has no split."""
    ours = {"new_tokens": 11, "wall_s": 1.5, "metrics": metrics([(4, 4)] * 2, verify_s=1.0, prefill_s=0.5)}
    base = {"new_tokens": 11, "wall_s": 2.5, "metrics": metrics([(0, 0)] * 10, verify_s=2.0, prefill_s=0.5)}
    assert ours["metrics"]["num_generated_tokens"] == base["metrics"]["num_generated_tokens"] == 11
    c = summary.cell({"engine": "specdecode"}, {"p": ours}, {"p": base})
    assert c["speedup"]["median"] == pytest.approx(2.5 / 1.5)
    assert c["throughput_ratio"] == pytest.approx(2.5 / 1.5)
    assert c["decode_speedup"] == pytest.approx((10 / 1.0) / (10 / 2.0))  # tokens after the first, prefill out
    assert c["n"] == c["n_paired"] == 1 and c["tokens_per_s"] == pytest.approx(11 / 1.5)
    assert c["metrics"]["tau"] == 5.0 and c["metrics"]["acceptance_rate"] == 1.0
    hf = summary.cell({"engine": "hf"}, {"p": {"new_tokens": 11, "wall_s": 1.0, "metrics": None}},
                      {"p": {"new_tokens": 11, "wall_s": 2.0, "metrics": None}})
    assert hf["decode_speedup"] == pytest.approx(2.0) and "metrics" not in hf
    unpaired = summary.cell({"engine": "specdecode"}, {"q": ours}, {"p": base})
    assert unpaired["n_paired"] == 0 and unpaired["speedup"] is None and unpaired["decode_speedup"] is None


def test_iid_equivalent_alpha_inverts_the_expected_tokens():
    for gamma in (1, 4, 8):
        for alpha in (0.05, 0.5, 0.9):
            e = costmodel.expected_tokens_iid(alpha, gamma)
            assert summary.iid_equivalent_alpha(e, gamma) == pytest.approx(alpha, abs=1e-9)
    assert summary.iid_equivalent_alpha(3.0, 0) == 0.0


def test_pooled_tree_runs_are_marked_and_left_out_of_the_chain_theory():
    tree_m = metrics([(4, 2)] * 5 + [(4, 1)] * 4, verify_s=1.5, draft_s=0.1)
    tree_m.update(num_tree_steps=9, num_tree_nodes=36, tree_depth_sum=27)
    recs = [r for r in make_records() if r["variant"] == "specdecode/plain"]
    recs += [{**record("specdecode/ngram:k=4", p["key"], 1.0, tree_m), "token_ids": list(range(100, 120))}
             for p in PROMPTS]
    pooled = summary.pool_metrics([r for r in recs if r["variant"] == "specdecode/ngram:k=4"])
    assert pooled["is_tree"] and pooled["mean_tree_nodes"] == 4.0 and pooled["mean_tree_depth"] == 3.0
    assert pooled["tau"] == pytest.approx((5 * 3 + 4 * 2) / 9)
    variants = [v for v in VARIANTS if v["key"] in ("specdecode/plain", "specdecode/ngram:k=4")]
    summ = summary.summarize(recs, variants, PROMPTS, PROBES, "tiny", greedy=False)
    assert summ["predictions"] == {} and summ["sweeps"] == {}  # the chain cost model does not describe trees
    assert summ["agreement"] is None  # sampled runs are not compared token by token
    assert summary.pool_metrics([{"metrics": None, "wall_s": 1.0}]) is None


def test_verify_ratio_comes_from_the_targets_probe():
    ratio, samples = summary.verify_ratio_of(PROBES, "tiny")
    assert samples[0] == 0.1 and ratio(4) == pytest.approx(1.4) and ratio(0) == pytest.approx(1.0)
    assert summary.verify_ratio_of(PROBES, "other") == (None, None)
    assert summary.baseline_of({"engine": "hf"}) == "hf/plain" and math.isclose(ratio(8), 2.0)
    assert statistics.median([ratio(k) for k in (1, 2)]) == pytest.approx(1.15)
