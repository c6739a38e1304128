"""Layer-skip self-speculation on tiny random models: losslessness, the shared cache, the automatic mode,
errors. (The skipping forward and the skip-set search are tested in ``tests/test_layer_search.py``.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specdecode import layer_search
from specdecode.engine import EngineConfig, SpeculativeEngine
from specdecode.kv import make_runner
from specdecode.layer_search import load_cached
from specdecode.policy import build_policy
from specdecode.proposers import LayerSkipConfig, LayerSkipProposer, build_proposer
from specdecode.proposers.layer_skip import (
    MIN_CALIBRATION_TOKENS,
    LayerSkipError,
    parse_skip_layers,
    provisional_skip_layers,
)
from specdecode.types import SamplingParams
from tiny import assert_cache_is_fresh_prefill, chi2_pvalue, exact_joint3, step_of, tiny_llama, tiny_qwen2

PROMPTS = [[1], [5, 9, 2], [3, 4, 5, 3, 4, 5, 3, 4], list(range(10, 30))]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=64, seed=0, layers=4, scale=3.0)


def _skip(model, layers, min_confidence=0.0):
    return LayerSkipProposer(model, LayerSkipConfig(skip_layers=layers, min_confidence=min_confidence))


# --------------------------------------------------------------------------- losslessness


@pytest.mark.parametrize("gamma", [1, 3, 6])
@pytest.mark.parametrize("layers", [(1,), (1, 2), (0, 3), (0, 1, 2)])
def test_greedy_equals_plain_decoding(target, layers, gamma):
    plain = SpeculativeEngine(target, None, EngineConfig(forward="hf"))  # the Hugging Face forward as reference
    spec = SpeculativeEngine(target, _skip(target, layers), EngineConfig(num_speculative_tokens=gamma))
    for prompt in PROMPTS:
        params = SamplingParams(max_new_tokens=40)
        out = spec.generate(prompt, params)
        assert out.token_ids == plain.generate(prompt, params).token_ids, (layers, gamma, prompt)
        assert out.metrics.num_generated_tokens == 40


def test_greedy_equals_plain_decoding_on_qwen2():
    model = tiny_qwen2()
    plain = SpeculativeEngine(model, None, EngineConfig(forward="hf"))
    spec = SpeculativeEngine(model, _skip(model, (1, 2), min_confidence=0.3), EngineConfig(num_speculative_tokens=4))
    for prompt in PROMPTS:
        params = SamplingParams(max_new_tokens=30)
        assert spec.generate(prompt, params).token_ids == plain.generate(prompt, params).token_ids


def test_nothing_skipped_accepts_everything(target):
    config = EngineConfig(num_speculative_tokens=4)
    out = SpeculativeEngine(target, _skip(target, ()), config).generate([3, 1, 4], SamplingParams(max_new_tokens=41))
    assert out.metrics.acceptance_rate == 1.0 and out.metrics.num_target_forwards == 1 + 8
    sampled = SpeculativeEngine(target, _skip(target, ()), config).generate(
        [3, 1, 4], SamplingParams(temperature=1.0, max_new_tokens=41, seed=0))
    assert sampled.metrics.acceptance_rate > 0.97


@pytest.mark.slow  # layer-skip sampling is in the fast lane in test_sampling_surface.py
@pytest.mark.parametrize("coupled", [False, True])
def test_sampled_output_follows_target_distribution(coupled):
    """First three sampled tokens through the engine (layer-skip, gamma 2, batches of 8) vs the target's
    exact joint, in the standard (rejection sampling) and the coupled mode."""
    vocab = 5
    tgt = tiny_llama(vocab_size=vocab, seed=3, layers=3, hidden=32, scale=4.0)
    with torch.no_grad():  # make the layers matter, so skipping two of them changes the draft
        for layer in tgt.model.layers:
            layer.mlp.down_proj.weight.mul_(6.0)
            layer.self_attn.o_proj.weight.mul_(6.0)
    prompt = [1, 2]
    exact = exact_joint3(tgt, prompt)
    engine = SpeculativeEngine(tgt, _skip(tgt, (0, 1)), EngineConfig(num_speculative_tokens=2, max_batch_size=8))
    counts = np.zeros(vocab**3)
    rejected = 0
    samples = 2000
    outs = engine.generate_batch([prompt] * samples, [SamplingParams(temperature=1.0, max_new_tokens=3, seed=s,
                                                                     coupled=coupled)
                                                      for s in range(samples)])
    for out in outs:
        counts[np.ravel_multi_index(out.token_ids, (vocab,) * 3)] += 1
        rejected += out.metrics.num_accepted_tokens < out.metrics.num_drafted_tokens
    assert rejected > samples // 12  # the draft really differs from the target (about 16% of runs reject)
    assert chi2_pvalue(counts, exact) > 1e-3


# --------------------------------------------------------------------------- the shared cache


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_target_cache_equals_fresh_prefill_after_skipped_layer_drafts(target, temperature):
    proposer = _skip(target, (1, 2))
    engine = SpeculativeEngine(target, proposer, EngineConfig(num_speculative_tokens=4, max_batch_size=2))
    other, _ = engine.add([9, 9, 8], SamplingParams(temperature=temperature, max_new_tokens=80, seed=2))
    req, _ = engine.add([5, 6, 7], SamplingParams(temperature=temperature, max_new_tokens=60, seed=1))
    rejections = 0
    while req.finish_reason is None:
        # a draft alone leaves every row's cache exactly as it was
        before = [[(k.clone(), v.clone()) for k, v in engine.target.layer_tensors(s)] for s in range(2)]
        proposer.propose([r.ctx for r in engine.rows], [4, 4])
        for s in range(2):
            for (k0, v0), (k1, v1) in zip(before[s], engine.target.layer_tensors(s)):
                assert torch.equal(k0, k1) and torch.equal(v0, v1)
        step = step_of(engine, req)
        rejections += step.num_accepted < step.num_drafted
        for slot, row in enumerate(engine.rows):
            assert engine.target.ids[slot] == row.ctx.token_ids[:-1]
            assert_cache_is_fresh_prefill(engine.target, slot)
    assert rejections > 3


def test_the_hugging_face_forward_is_refused_with_a_clear_error(target):
    with pytest.raises(LayerSkipError, match="Hugging Face forward"):
        SpeculativeEngine(target, _skip(target, (1,)), EngineConfig(forward="hf"))


# --------------------------------------------------------------------------- confidence and policies


def test_low_confidence_ends_the_chain(target):
    params = SamplingParams(max_new_tokens=40)
    always = SpeculativeEngine(target, _skip(target, (1,), min_confidence=1.0), EngineConfig(num_speculative_tokens=5))
    never = SpeculativeEngine(target, _skip(target, (1,), min_confidence=0.0), EngineConfig(num_speculative_tokens=5))
    a, b = always.generate([1, 2], params), never.generate([1, 2], params)
    assert a.token_ids == b.token_ids
    assert set(a.metrics.draft_lengths) - {0} == {1}
    assert b.metrics.draft_lengths[:3] == [5, 5, 5]


def test_policy_hook_is_consulted(target):
    policy = build_policy("confidence", 3, min_top_prob=1.0, guard=False)
    out = SpeculativeEngine(target, _skip(target, (1,)), policy=policy).generate([4, 2], SamplingParams(
        max_new_tokens=20))
    assert set(out.metrics.draft_lengths) - {0} == {1}


# --------------------------------------------------------------------------- errors and parsing


def test_parse_skip_layers():
    assert parse_skip_layers("3,5, 7") == (3, 5, 7)
    assert parse_skip_layers([7, 3, 3]) == (3, 7)
    assert parse_skip_layers("auto") is None and parse_skip_layers(None) is None
    with pytest.raises(LayerSkipError, match="comma-separated"):
        parse_skip_layers("3;5")
    with pytest.raises(LayerSkipError, match="outside"):
        parse_skip_layers("1,9", num_layers=4)
    with pytest.raises(LayerSkipError, match="cannot skip all"):
        parse_skip_layers("0,1,2,3", num_layers=4)


def test_bad_skip_index_is_rejected(target):
    with pytest.raises(LayerSkipError, match="outside 0..3"):
        _skip(target, (4,))


def test_model_without_decoder_layers_gets_a_clear_error():
    class NotADecoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("Cfg", (), {"model_type": "mystery"})()
            self.proj = torch.nn.Linear(4, 4)

    with pytest.raises(LayerSkipError, match=r"model\.model\.layers"):
        LayerSkipProposer(NotADecoder(), LayerSkipConfig(skip_layers=(1,)))
    with pytest.raises(LayerSkipError, match=r"model\.model\.layers"):
        build_proposer("layer-skip", model=NotADecoder())


def test_drafting_leaves_committed_cache_and_ids_alone(target):
    engine = SpeculativeEngine(target, None, EngineConfig(forward="owned"))
    req, _ = engine.add([5, 6, 7, 8], SamplingParams(max_new_tokens=10))
    before = [(k.clone(), v.clone()) for k, v in engine.target.layer_tensors(0)]
    ids = list(engine.target.ids[0])
    proposer = _skip(target, (1, 2))
    proposer.bind(engine.target, 1)
    proposer.start(req.ctx)
    draft = proposer.propose([req.ctx], [4])[0]
    assert draft.num_tokens == 4 and draft.draft_probs is None  # greedy: a deterministic chain
    assert engine.target.ids[0] == ids
    for (k0, v0), (k1, v1) in zip(before, engine.target.layer_tensors(0)):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_a_proposer_must_be_bound_to_its_own_models_owned_runner(target):
    proposer = _skip(target, (1,))
    req_ctx = SpeculativeEngine(target, None).add([1, 2], SamplingParams(max_new_tokens=5))[0].ctx
    with pytest.raises(LayerSkipError, match="not bound"):
        proposer.propose([req_ctx], [2])
    with pytest.raises(LayerSkipError, match="different model"):
        proposer.bind(make_runner(tiny_llama(vocab_size=64, seed=1, layers=4)), 1)
    with pytest.raises(LayerSkipError, match="Hugging Face forward"):
        proposer.bind(make_runner(target, "hf"), 1)


# --------------------------------------------------------------------------- the automatic mode


def _winning_sets(monkeypatch):
    """Every skip set measures faster than plain decoding (on a tiny model the timing is noise, and a set measured
    slower is neither used nor cached)."""
    real = layer_search._measure
    monkeypatch.setattr(layer_search, "_measure", lambda model, prompts, skip, gamma, new_tokens: 1e9 if skip
                        else real(model, prompts, skip, gamma, new_tokens))


def test_auto_mode_searches_on_the_first_long_enough_prompt(tmp_path, monkeypatch):
    _winning_sets(monkeypatch)
    model = tiny_llama(vocab_size=64, seed=2, layers=5, scale=3.0)
    proposer = LayerSkipProposer(model, LayerSkipConfig(cache_dir=str(tmp_path), search_budget_s=30),
                                 searcher=layer_search)
    engine, plain = SpeculativeEngine(model, proposer), SpeculativeEngine(model, None)
    assert proposer.skip_layers is None
    short = [7, 8, 9, 10]  # too short to calibrate on: a provisional set, nothing stored
    out = engine.generate(short, SamplingParams(max_new_tokens=12))
    assert proposer.skip_layers == provisional_skip_layers(5) and proposer.search_result is None
    assert load_cached(model, tmp_path) is None
    assert out.token_ids == plain.generate(short, SamplingParams(max_new_tokens=12)).token_ids
    long = [(7 * i) % 60 + 2 for i in range(MIN_CALIBRATION_TOKENS)]
    out = engine.generate(long, SamplingParams(max_new_tokens=12))
    assert proposer.search_result is not None and not proposer.search_result.from_cache
    assert load_cached(model, tmp_path).skip_layers == proposer.skip_layers
    assert out.token_ids == plain.generate(long, SamplingParams(max_new_tokens=12)).token_ids


# --------------------------------------------------------------------------- command line


def _cli(capsys, *argv):
    from specdecode import cli

    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("policy", ["fixed", "heuristic", "confidence", "cost-model"])
def test_cli_layer_skip_with_each_policy_matches_plain(capsys, tiny_model_dir, policy):
    code, out, err = _cli(capsys, "generate", "--target", str(tiny_model_dir), "--draft", "layer-skip",
                          "--skip-layers", "1", "--policy", policy, "--prompt", "the cat and the dog",
                          "--max-new-tokens", "30", "--ignore-eos", "-k", "3", "--compare-baseline", "--json")
    assert code == 0, err
    rec = json.loads(out.strip().splitlines()[-1])
    assert rec["matches_baseline"] is True
    assert sum(rec["draft_length_histogram"].values()) == rec["num_target_forwards"] - 1
    assert rec["mean_draft_length"] >= 0
    assert "drafter layer-skip:skip_layers=1, gamma 3, policy " + policy in err


def test_cli_layer_skip_auto_searches_once_then_uses_the_cache(capsys, tiny_model_dir, tmp_path, monkeypatch):
    _winning_sets(monkeypatch)
    argv = ["generate", "--target", str(tiny_model_dir), "--draft", "layer-skip", "--cache-dir", str(tmp_path),
            "--prompt", "the quick brown fox jumps over the lazy dog, then the dog sleeps in the sun",
            "--max-new-tokens", "12", "--ignore-eos"]
    code, out, err = _cli(capsys, *argv)
    assert code == 0, err
    assert "searched in" in err and "layer-skip: skipping layers" in err
    assert "draft length per step (gamma): mean" in out
    assert (tmp_path / "layer_skip.json").is_file()
    code, out, err = _cli(capsys, *argv)
    assert code == 0 and "(cached;" in err


@pytest.mark.parametrize("argv, needle", [
    (["--skip-layers", "1;2"], "comma-separated"),
    (["--skip-layers", "7"], "outside 0..1"),
    (["--policy", "always"], "invalid choice"),
])
def test_cli_layer_skip_errors(capsys, tiny_model_dir, argv, needle):
    code, out, err = _cli(capsys, "generate", "--target", str(tiny_model_dir), "--draft", "layer-skip",
                          "--prompt", "hi", *argv)
    assert code == 2 and needle in err and err.count("error:") == 1
