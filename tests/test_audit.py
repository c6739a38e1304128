"""``specdecode audit``: the exact law, the statistics, the sources, the verdicts, the command line.

The law is checked against ``tests/sampling_oracle.py`` (an independent float64 re-implementation of the
processing). The in-process audit PASSES the engine for every drafter (temperature 1, top-p 0.9) and FAILS two
deliberately wrong samplers injected through the same source interface: temperature off by 15% and a residual
that is not renormalised. Models: a vocabulary-16 Llama with a sharp LM head (x10) and four layers whose
outputs matter (layer skipping changes the draft), float64, so 2,000 samples per audit decide in seconds and
the fixed seeds make every verdict deterministic. Against a running server: the app on loopback over the tiny
character-level model (conftest), and, marked integration, ``specdecode serve`` on SmolLM2-135M.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
import torch

from specdecode import verify
from specdecode.audit import stats
from specdecode.audit.config import AuditConfig, AuditError
from specdecode.audit.law import BOUNDARY, IMPOSSIBLE, OTHER, STOP, UNMAPPED, PrefixScorer, exact_law
from specdecode.audit.runner import audit_greedy, audit_sampled
from specdecode.audit.sources import AuditPrompt, EndpointSource, EngineSource, Outcome
from specdecode.cli import main
from specdecode.engine import EngineConfig, SpeculativeEngine
from specdecode.proposers import (
    DraftModelProposer,
    EagleDraftConfig,
    EagleProposer,
    LayerSkipConfig,
    LayerSkipProposer,
    NgramProposer,
    SuffixConfig,
    SuffixProposer,
    TreeDraftConfig,
    TreeDraftProposer,
)
from specdecode.proposers.ngram import NgramConfig
from specdecode.types import SamplingParams
from sampling_oracle import processed_law
from tiny import load_float64, tiny_llama

VOCAB = 16
PROMPT = (1, 2, 0, 1, 2, 0, 1, 2)  # repeats: the n-gram and suffix drafters find continuations
N = 2000
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9)


@pytest.fixture(scope="module")
def models():
    """A 4-layer target whose layers matter (skipping two changes the draft) and a 1-layer draft, V = 16."""
    target = tiny_llama(vocab_size=VOCAB, seed=3, layers=4, hidden=32, scale=10.0)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.mlp.down_proj.weight.mul_(4.0)
            layer.self_attn.o_proj.weight.mul_(4.0)
    return {"target": target, "draft": tiny_llama(vocab_size=VOCAB, seed=4, layers=1, hidden=32, scale=10.0)}


def _eagle(target):
    from test_eagle import random_head

    return EagleProposer(random_head(target), EagleDraftConfig())


DRAFTERS = {
    "ngram": lambda m: NgramProposer(NgramConfig(1, 3)),
    "suffix": lambda m: SuffixProposer(SuffixConfig(min_token_prob=0.0)),
    "draft-model": lambda m: DraftModelProposer(m["draft"]),
    "layer-skip": lambda m: LayerSkipProposer(m["target"], LayerSkipConfig(skip_layers=(1, 2), min_confidence=0.0)),
    "tree-dynamic": lambda m: TreeDraftProposer(m["draft"], TreeDraftConfig(kind="dynamic", num_nodes=8, top_k=3)),
    "eagle": lambda m: _eagle(m["target"]),
}


def _source(models, kind: str | None, gamma: int = 3, verification: str = "auto", cls=EngineSource, **kw):
    proposer = DRAFTERS[kind](models) if kind else None
    engine = SpeculativeEngine(models["target"], proposer, EngineConfig(num_speculative_tokens=gamma, max_batch_size=64,
                                                                        verification=verification))
    return cls(engine, **kw)


def _audit(models, source, params=SAMPLED, **cfg):
    cfg = AuditConfig(**{"num_samples": N, "num_tokens": 3, **cfg})
    return audit_sampled(models["target"], [AuditPrompt("p", PROMPT)], params, source, cfg)


# --------------------------------------------------------------------------- the exact law


LAWS = {
    "temperature": dict(temperature=0.7),
    "top_p": dict(temperature=1.0, top_p=0.8),
    "top_k_min_p": dict(temperature=1.3, top_k=4, min_p=0.05),
    "penalties": dict(temperature=1.0, repetition_penalty=1.5, presence_penalty=0.4, frequency_penalty=0.8),
    "bias_stops": dict(temperature=1.0, logit_bias={0: 2.0, 5: -100.0}, eos_token_ids=(3,), stop_token_ids=(4,),
                       min_tokens=1),
}


@pytest.mark.parametrize("name", list(LAWS))
def test_the_law_equals_the_oracle(models, name):
    """Enumerated to the last outcome (no "other" cell), the law is the float64 oracle's, stops merged."""
    params = SamplingParams(**LAWS[name])
    law = exact_law(models["target"], PROMPT, params, 3, 1e-12)
    want = processed_law(models["target"], PROMPT, params, 3)
    stops = set(params.stop_ids)
    got: dict = {}
    for key, p in zip(law.cells, law.probs):
        assert key[-1] != OTHER
        got[key[:-1] + ("stop",) if key[-1] == STOP else key] = got.get(key, 0.0) + p
    merged: dict = {}
    for seq, p in want.items():
        key = seq[:-1] + ("stop",) if seq and seq[-1] in stops else seq
        merged[key] = merged.get(key, 0.0) + p
    assert set(got) == {k for k, v in merged.items() if v > 0}
    assert max(abs(got[k] - merged[k]) for k in got) < 1e-6
    assert abs(law.probs.sum() - 1) < 1e-12


def test_a_coarse_law_is_the_fine_one_merged(models):
    """With a threshold, each prefix's unenumerated rest is one "other" cell of exactly the rest's mass."""
    fine = exact_law(models["target"], PROMPT, SAMPLED, 3, 1e-12)
    coarse = exact_law(models["target"], PROMPT, SAMPLED, 3, 2e-2)
    assert len(coarse.cells) < len(fine.cells) / 2 and any(k[-1] == OTHER for k in coarse.cells)
    mass = np.zeros(len(coarse.cells))
    for key, p in zip(fine.cells, fine.probs):
        mass[coarse.classify(key)] += p  # every fine outcome lands in one coarse cell
    np.testing.assert_allclose(mass, coarse.probs, atol=1e-6)


def test_tree_scoring_equals_one_prefix_at_a_time(models):
    paths = [(a,) for a in range(VOCAB)] + [(a, b) for a in range(0, VOCAB, 3) for b in range(VOCAB)]
    trees, single = PrefixScorer(models["target"], PROMPT), PrefixScorer(models["target"], PROMPT)
    single.trees = False
    got, want = {}, {}
    for scorer, out in ((trees, got), (single, want)):
        for idx, logits in scorer.score(paths):
            out.update({i: row for i, row in zip(idx, logits)})
    for i in range(len(paths)):
        torch.testing.assert_close(got[i], want[i], atol=1e-5, rtol=1e-5)


def test_classify_impossible_boundary_stop_and_unmapped(models):
    params = SamplingParams(temperature=1.0, top_k=3, eos_token_ids=(3,))
    law = exact_law(models["target"], PROMPT, params, 2, 1e-9)
    root = law.nodes[()]
    kept, banned = sorted(root.kept), [t for t in range(VOCAB) if not root.allows(t) and t != 3]
    assert sum(root.allows(t) for t in range(VOCAB)) == 3 and kept and banned  # top-3 (EOS may be one)
    assert law.classify([kept[0], sorted(law.nodes[(kept[0],)].kept)[0]]) >= 0
    assert law.classify([banned[0], 0]) == IMPOSSIBLE
    assert law.classify([kept[0]]) == UNMAPPED  # one token, no stop: not a completion of 2
    assert law.classify([VOCAB + 5, 0]) == UNMAPPED
    if 3 in root.kept or root.stop_cell is not None:
        assert law.classify([3]) == law.classify([], stopped=True) >= 0  # EOS in the ids or left out of them
    loose = exact_law(models["target"], PROMPT, SamplingParams(temperature=1.0, top_p=0.6), 1, 1e-9)
    node = loose.nodes[()]
    edge = [t for t in range(VOCAB) if not node.allows(t) and node.allows(t, relaxed=True)]
    for t in edge:
        assert loose.classify([t]) == BOUNDARY


# --------------------------------------------------------------------------- statistics


def test_pooled_bins_are_expected_five_times_and_holm():
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.full(300, 0.2))
    for n in (500, 5000):
        bins, num = stats.pool_bins(probs, n)
        expected = np.bincount(bins, probs * n, minlength=num)
        assert num >= 2 and expected.min() >= 5 - 1e-9
    assert stats.chi_square(rng.multinomial(20, probs), probs).pvalue == 1.0  # every cell pooled: nothing testable
    assert stats.holm([0.01, 0.04, 0.03, 0.5]) == pytest.approx([0.04, 0.09, 0.09, 0.5])


def test_the_stated_power_holds_and_shrinks_with_n():
    """A law at the stated detectable TV (along the tempering family) is rejected about ``power`` of the time;
    more samples detect smaller errors."""
    rng = np.random.default_rng(1)
    probs = np.sort(rng.dirichlet(np.full(40, 0.5)))[::-1]
    found = []
    for n in (500, 4000):
        test = stats.chi_square(rng.multinomial(n, probs), probs)
        found.append(stats.detectable_tv(probs, n, 0.01, 0.8, test, rng))
    assert found[1] < found[0] / 1.8
    null = stats.null_tv(probs, 4000, 2000, rng)
    assert np.quantile(null, 0.99) < found[1] * 2


# --------------------------------------------------------------------------- in-process: our engine passes


#: Samples of the slower drafters (a tree or a head forward per row): fewer, with a power bound to match.
SAMPLES_OF = {"tree-dynamic": 1000, "eagle": 1000}


@pytest.mark.parametrize("kind", [k if k == "ngram" else pytest.param(k, marks=pytest.mark.slow) for k in DRAFTERS])
def test_audit_passes_our_engine_for_every_drafter(models, kind):
    """Temperature 1, top-p 0.9, 2,000 samples of 3 tokens: PASS, no impossible output, drafts really ran."""
    n = SAMPLES_OF.get(kind, N)
    source = _source(models, kind)
    report = _audit(models, source, num_samples=n)
    p = report.prompts[0]
    assert report.passed, report.reasons
    assert p.num_impossible == 0 and p.num_tested == n
    assert p.tv < p.tv_null_99
    assert source.drafted > n // 2 and source.accepted > 0, (source.drafted, source.accepted)
    assert p.detectable_tv is not None and p.detectable_tv < 0.12 * (N / n) ** 0.5  # the test has teeth


@pytest.mark.slow
def test_audit_passes_block_verification_and_the_coupled_mode(models):
    for kw in (dict(verification="block"), dict(coupled=True)):
        assert _audit(models, _source(models, "draft-model", **kw), num_tokens=2, num_samples=1500).passed, kw


# --------------------------------------------------------------------------- in-process: wrong samplers fail


class HotSource(EngineSource):
    """A wrong sampler: every row samples at 1.15 x the requested temperature (target and draft alike)."""

    def request_params(self, params):
        return dataclasses.replace(params, temperature=params.temperature * 1.15)


def unnormalised_verify_chains(draft_ids, num_drafted, draft_probs, target_probs, greedy, uniforms):
    """A wrong verifier: the recovered token is drawn by inverse CDF over max(0, p - q) *without* dividing by its
    mass (so a uniform past that mass falls on the last token). Acceptance is ``verify.verify_chains``'."""
    res = verify.verify_chains(draft_ids, num_drafted, draft_probs, target_probs, greedy, uniforms)
    v = target_probs.shape[-1]
    for i in range(draft_ids.shape[0]):
        n, k = int(res.num_accepted[i]), int(num_drafted[i])
        if bool(greedy[i]) or n >= k:
            continue
        p = target_probs[i, n].double()
        has_q = draft_probs is not None and float(draft_probs[i, n].sum()) > 0
        q = draft_probs[i, n].double() if has_q else torch.nn.functional.one_hot(draft_ids[i, n], v).double()
        cdf = (p - q).clamp_min(0).cumsum(0)
        res.new_token_ids[i, n] = torch.searchsorted(cdf, uniforms[i, k : k + 1], right=True).clamp(max=v - 1)[0]
    return res


@pytest.mark.slow
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_audit_fails_a_temperature_off_by_15_percent(models, top_p):
    """Without top-p the chi-square sees it; with top-p 0.9 the hotter law also leaves the support (impossible
    outputs, an immediate fail)."""
    report = _audit(models, _source(models, "ngram", cls=HotSource), SamplingParams(temperature=1.0, top_p=top_p),
                    num_tokens=2)
    p = report.prompts[0]
    assert not report.passed
    if top_p < 1:
        assert p.num_impossible > 0
    else:
        assert p.adjusted_p < 0.01 and p.tv > p.tv_null_99


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ngram", "draft-model"])
def test_audit_fails_a_residual_that_is_not_renormalised(models, kind, monkeypatch):
    import specdecode.engine as engine_module

    monkeypatch.setattr(engine_module, "verify_chains", unnormalised_verify_chains)
    report = _audit(models, _source(models, kind, verification="token"))
    p = report.prompts[0]
    assert not report.passed and p.adjusted_p < 1e-3, report.reasons
    assert any("chi-square" in r for r in report.reasons)


# --------------------------------------------------------------------------- greedy mode


class FlipSource(EngineSource):
    """A wrong greedy source: its output has token ``at`` replaced by the target's second choice."""

    at = 5

    def greedy(self, prompt, params, max_new_tokens):
        out = super().greedy(prompt, params, max_new_tokens)
        ids = list(out.token_ids)
        with torch.inference_mode():
            logits = self.engine.runner.model(input_ids=torch.tensor([list(prompt.token_ids) + ids[: self.at]])).logits
        ids[self.at] = int(logits[0, -1].topk(2).indices[1])
        return Outcome(tuple(ids[: self.at + 1]), None, "length")


@pytest.mark.parametrize("kind", ["ngram", "suffix", "draft-model", "layer-skip"])
def test_greedy_mode_passes_our_engine(models, kind):
    source = _source(models, kind, gamma=4)
    prompts = [AuditPrompt("a", PROMPT), AuditPrompt("b", (5, 6, 7, 5, 6, 7))]
    report = audit_greedy(models["target"], prompts, SamplingParams(), source, AuditConfig(max_new_tokens=40))
    assert report.passed and all(r.status == "equal" for r in report.prompts), report.reasons
    assert source.drafted > 0


def test_greedy_mode_reports_a_divergence_with_its_margin(models):
    source = _source(models, "ngram", cls=FlipSource)
    report = audit_greedy(models["target"], [AuditPrompt("a", PROMPT)], SamplingParams(), source,
                          AuditConfig(max_new_tokens=20))
    r = report.prompts[0]
    assert not report.passed and r.status == "DIVERGES" and r.position == FlipSource.at
    assert r.margin > 0.05 and r.gap == pytest.approx(r.margin, rel=1e-4)  # the second choice: gap = top-2 margin
    assert "not a near-tie" in report.reasons[0]
    lenient = audit_greedy(models["target"], [AuditPrompt("a", PROMPT)], SamplingParams(), source,
                           AuditConfig(max_new_tokens=20, tie_margin=1e9))
    assert lenient.passed and lenient.prompts[0].status == "near-tie"


# --------------------------------------------------------------------------- against a running server


@pytest.fixture(scope="module")
def tiny64(tiny_model_dir):
    return load_float64(tiny_model_dir)


@pytest.fixture(scope="module")
def live(tiny64):
    from test_server_app import serving

    with serving(tiny64, max_batch_size=8, max_queue=256, num_speculative_tokens=3) as server:
        yield server


def _endpoint_prompt(tiny64):
    ids = tiny64.tokenizer("the cat and the dog and the cat and the")["input_ids"]
    return AuditPrompt("cat", tuple(ids), "the cat and the dog and the cat and the")


@pytest.mark.slow
@pytest.mark.parametrize("text_only", [False, True])
def test_audit_passes_our_server(live, tiny64, text_only, monkeypatch):
    """Our server (ngram drafter, gamma 3) over HTTP, 8 requests in flight: PASS; also when the ids are dropped
    from the answers and the samples are mapped back by their text."""
    if text_only:
        original = EndpointSource.complete
        monkeypatch.setattr(EndpointSource, "complete", lambda self, body: dataclasses.replace(
            original(self, body), token_ids=None))
    source = EndpointSource(live.url, "tiny", concurrency=8)
    source.check()
    assert source.is_specdecode
    source.extra["speculative"] = {"sampling_mode": "standard"}
    params = SamplingParams(temperature=1.0, top_p=0.9, eos_token_ids=tiny64.eos_token_ids)
    report = audit_sampled(tiny64.model, [_endpoint_prompt(tiny64)], params, source,
                           AuditConfig(num_samples=600, num_tokens=2), tokenizer=tiny64.tokenizer)
    p = report.prompts[0]
    assert report.passed, report.reasons
    assert p.num_impossible == 0 and p.num_unmapped == 0 and p.num_tested == 600
    if text_only:
        assert p.labels[-1].startswith("<rest") or any(lab.startswith("<rest") for lab in p.labels)


def test_greedy_mode_passes_our_server(live, tiny64):
    source = EndpointSource(live.url, "tiny")
    report = audit_greedy(tiny64.model, [_endpoint_prompt(tiny64)],
                          SamplingParams(eos_token_ids=tiny64.eos_token_ids), source,
                          AuditConfig(max_new_tokens=24), tokenizer=tiny64.tokenizer)
    assert report.passed and report.prompts[0].status == "equal", report.prompts[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_endpoint_errors_say_what_to_do(live):
    with pytest.raises(AuditError, match="cannot reach .* start the server"):
        EndpointSource(f"http://127.0.0.1:{_free_port()}", "tiny").check()
    with pytest.raises(AuditError, match="does not serve model 'gpt-9'.*'tiny'.*--model tiny"):
        EndpointSource(live.url + "/v1/", "gpt-9").check()
    with pytest.raises(AuditError, match="not an http"):
        EndpointSource("127.0.0.1:8000", "tiny")
    with pytest.raises(AuditError, match="not a valid URL"):
        EndpointSource("http://[::1", "tiny")
    with pytest.raises(AuditError, match="names no host"):
        EndpointSource("http://:8000", "tiny")
    source = EndpointSource(live.url, "tiny")
    body = source.body(AuditPrompt("x", (5, 6)), SamplingParams(temperature=1.0), 2, 0)
    body["top_p"] = 7.0
    with pytest.raises(AuditError, match="refused a completion request .*top_p"):
        source.complete(body)


# --------------------------------------------------------------------------- the command line


def test_cli_audit_local_passes_and_writes_the_report(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "report"
    rc = main(["audit", "--local", "--target", str(tiny_model_dir), "--weights", "fp32", "--prompt",
               "the cat and the dog and the cat and the", "-N", "300", "--tokens", "2", "--threads", "1",
               "--null-simulations", "200", "--output", str(out)])
    assert rc == 0
    data = json.loads((out / "report.json").read_text())
    assert data["verdict"] == "PASS" and data["prompts"][0]["num_samples"] == 300
    assert (out / "worst_prompt.png").stat().st_size > 1000 and "# specdecode audit: PASS" in (out / "report.md").read_text()
    assert "verdict: PASS" in capsys.readouterr().out


def test_cli_audit_greedy_endpoint(live, tiny_model_dir, capsys):
    rc = main(["audit", "--endpoint", live.url, "--model", "tiny", "--target", str(tiny_model_dir), "--weights",
               "fp32", "--temperature", "0", "--max-new-tokens", "16", "--prompt", "the cat and the", "--threads", "1"])
    out = capsys.readouterr().out
    # float32 here, float64 in the server: equal, or a near-tie at most
    assert rc == 0 and "verdict: PASS (greedy mode" in out


@pytest.mark.parametrize("argv, needle", [
    (["--local", "-N", "5"], "-N/--num-samples: num_samples must be an integer in [50"),
    (["--local", "--temperature", "5"], "--temperature: temperature must be 0"),
    (["--local", "--tokens", "4"], "--tokens: num_tokens must be 1..3"),
    (["--local", "--alpha", "0"], "--alpha: alpha must be in (0, 0.5]"),
    (["--endpoint", "http://127.0.0.1:1"], "--endpoint needs --model"),
    (["--local", "--model", "x"], "with --local give the model with --target"),
    ([], "one of the arguments --endpoint --local is required"),
    (["--local", "--concurrency", "0"], "--concurrency: concurrency must be an integer in [1, 256]"),
])
def test_cli_audit_refuses_bad_usage_in_one_line(argv, needle, capsys):
    assert main(["audit", *argv, "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


def test_cli_audit_unreachable_endpoint_and_unknown_model(live, capsys):
    assert main(["audit", "--endpoint", f"http://127.0.0.1:{_free_port()}", "--model", "tiny", "--prompt", "hi"]) == 2
    assert "cannot reach" in capsys.readouterr().err
    assert main(["audit", "--endpoint", live.url, "--model", "nope", "--prompt", "hi"]) == 2
    assert "--model tiny" in capsys.readouterr().err


# --------------------------------------------------------------------------- integration: specdecode serve on SmolLM2


@pytest.mark.integration
def test_audit_passes_specdecode_serve_on_smollm2(tmp_path):
    """``specdecode serve --target smollm2-135m`` (ngram drafter, bf16) in its own process, then ``specdecode
    audit`` against it: 400 samples of 2 tokens at temperature 0.8 on one prompt, PASS."""
    port = _free_port()
    serve = [sys.executable, "-m", "specdecode.cli", "serve", "--target", "smollm2-135m", "--weights", "bf16",
             "--port", str(port), "--draft", "ngram", "--max-batch-size", "8", "--log-level", "warning"]
    proc = subprocess.Popen(serve, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read()
            assert time.time() < deadline, "server did not start"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.5)
        rc = main(["audit", "--endpoint", f"http://127.0.0.1:{port}", "--model", "smollm2-135m", "--weights", "bf16",
                   "--prompt", "The capital of France is", "--temperature", "0.8", "-N", "400", "--tokens", "2",
                   "--output", str(tmp_path)])
        data = json.loads((tmp_path / "report.json").read_text())
        assert rc == 0 and data["verdict"] == "PASS", data["reasons"]
        assert data["prompts"][0]["num_impossible"] == 0 and data["prompts"][0]["num_unmapped"] == 0
    finally:
        proc.terminate()
        proc.wait(30)
