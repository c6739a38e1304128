"""Layer-skip self-speculation on tiny random models: losslessness, the shared cache, the search, errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from specdecode import layer_search
from specdecode.cache import CachedModel
from specdecode.engine import EngineConfig, SpeculativeEngine
from specdecode.layer_search import SearchConfig, choose_skip_layers, load_cached
from specdecode.policy import build_policy
from specdecode.proposers import LayerSkipConfig, LayerSkipProposer, build_proposer
from specdecode.proposers.base import ProposeContext
from specdecode.proposers.layer_skip import (
    MIN_CALIBRATION_TOKENS,
    LayerSkipError,
    SkipForward,
    parse_skip_layers,
    provisional_skip_layers,
)
from specdecode.types import SamplingParams
from tiny import assert_cache_is_fresh_prefill, chi2_pvalue, exact_joint3, tiny_llama

PROMPTS = [[1], [5, 9, 2], [3, 4, 5, 3, 4, 5, 3, 4], list(range(10, 30))]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=64, seed=0, layers=4, scale=3.0)


def tiny_qwen2(vocab_size: int = 64, seed: int = 0, layers: int = 4) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=256,
                      tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg).eval().to(torch.float64)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    return model


def _skip(model, layers, min_confidence=0.0):
    return LayerSkipProposer(model, LayerSkipConfig(skip_layers=layers, min_confidence=min_confidence))


# --------------------------------------------------------------------------- the forward


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_forward_with_nothing_skipped_matches_the_model(target, family):
    model = target if family == "llama" else tiny_qwen2()
    skip = SkipForward(model)
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    with torch.inference_mode():
        expected = model(input_ids=ids.reshape(1, -1)).logits[0]
        torch.testing.assert_close(skip.forward(ids, 0, range(skip.num_layers)), expected.float())
        runner = CachedModel(model)  # incremental, on a cache: prefill 5 then one token at a time
        runner.reset()
        runner.forward(ids[:5])
        for j in range(5, 8):
            out = skip.forward(ids[j : j + 1], j, range(skip.num_layers), runner.cache)
            runner.cached_ids.append(int(ids[j]))
            torch.testing.assert_close(out[0], expected[j].float())


# --------------------------------------------------------------------------- losslessness


@pytest.mark.parametrize("forward", ["hf", "owned"])
@pytest.mark.parametrize("gamma", [1, 3, 6])
@pytest.mark.parametrize("layers", [(1,), (1, 2), (0, 3), (0, 1, 2)])
def test_greedy_equals_plain_decoding(target, layers, gamma, forward):
    plain = SpeculativeEngine(target, None, EngineConfig(forward=forward))
    spec = SpeculativeEngine(target, _skip(target, layers), EngineConfig(num_speculative_tokens=gamma, forward=forward))
    assert type(spec.target) is type(plain.target)
    for prompt in PROMPTS:
        params = SamplingParams(max_new_tokens=40)
        out = spec.generate(prompt, params)
        assert out.token_ids == plain.generate(prompt, params).token_ids, (layers, gamma, prompt)
        assert out.metrics.num_generated_tokens == 40


@pytest.mark.parametrize("forward", ["hf", "owned"])
def test_greedy_equals_plain_decoding_on_qwen2(forward):
    model = tiny_qwen2()
    plain = SpeculativeEngine(model, None, EngineConfig(forward=forward))
    spec = SpeculativeEngine(model, _skip(model, (1, 2), min_confidence=0.3),
                             EngineConfig(num_speculative_tokens=4, forward=forward))
    for prompt in PROMPTS:
        params = SamplingParams(max_new_tokens=30)
        assert spec.generate(prompt, params).token_ids == plain.generate(prompt, params).token_ids


@pytest.mark.parametrize("forward", ["hf", "owned"])
def test_nothing_skipped_accepts_everything(target, forward):
    config = EngineConfig(num_speculative_tokens=4, forward=forward)
    out = SpeculativeEngine(target, _skip(target, ()), config).generate([3, 1, 4], SamplingParams(max_new_tokens=41))
    assert out.metrics.acceptance_rate == 1.0 and out.metrics.num_target_forwards == 1 + 8
    sampled = SpeculativeEngine(target, _skip(target, ()), config).generate(
        [3, 1, 4], SamplingParams(temperature=1.0, max_new_tokens=41, seed=0))
    assert sampled.metrics.acceptance_rate > 0.97


@pytest.mark.parametrize("forward", ["hf", "owned"])
def test_sampled_output_follows_target_distribution(forward):
    """First three sampled tokens through the engine (layer-skip, gamma 2) vs the target's exact joint."""
    vocab = 5
    tgt = tiny_llama(vocab_size=vocab, seed=3, layers=3, hidden=32, scale=4.0)
    with torch.no_grad():  # make the layers matter, so skipping two of them changes the draft
        for layer in tgt.model.layers:
            layer.mlp.down_proj.weight.mul_(6.0)
            layer.self_attn.o_proj.weight.mul_(6.0)
    prompt = [1, 2]
    exact = exact_joint3(tgt, prompt)
    engine = SpeculativeEngine(tgt, _skip(tgt, (0, 1)), EngineConfig(num_speculative_tokens=2, forward=forward))
    counts = np.zeros(vocab**3)
    rejected = 0
    for s in range(3000):
        out = engine.generate(prompt, SamplingParams(temperature=1.0, max_new_tokens=3, seed=s))
        counts[np.ravel_multi_index(out.token_ids, (vocab,) * 3)] += 1
        rejected += out.metrics.num_accepted_tokens < out.metrics.num_drafted_tokens
    assert rejected > 250  # the draft really differs from the target (about 16% of runs reject)
    assert chi2_pvalue(counts, exact) > 1e-3


# --------------------------------------------------------------------------- the shared cache


@pytest.mark.parametrize("forward", ["hf", "owned"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_target_cache_equals_fresh_prefill_after_skipped_layer_drafts(target, temperature, forward):
    proposer = _skip(target, (1, 2))
    engine = SpeculativeEngine(target, proposer, EngineConfig(num_speculative_tokens=4, forward=forward))
    state = engine.start([5, 6, 7], SamplingParams(temperature=temperature, max_new_tokens=60, seed=1))
    rejections = 0
    while state.finish_reason is None:
        # a draft alone leaves the cache exactly as it was
        before = [(k.clone(), v.clone()) for k, v in engine.target.layer_tensors()]
        proposer.propose(state.ctx, 4)
        for (k0, v0), (k1, v1) in zip(before, engine.target.layer_tensors()):
            assert torch.equal(k0, k1) and torch.equal(v0, v1)
        step = engine.step(state)
        rejections += step.num_accepted < step.num_drafted
        assert engine.target.cached_ids == state.ctx.token_ids[:-1]
        assert_cache_is_fresh_prefill(engine.target)
    assert rejections > 3


def test_hf_cache_is_restored_when_drafting_fails(target, monkeypatch):
    proposer = _skip(target, (1,))
    engine = SpeculativeEngine(target, proposer, EngineConfig(forward="hf"))
    state = engine.start([1, 2, 3], SamplingParams(max_new_tokens=10))
    real, calls = proposer.skip.forward, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("interrupted")
        return real(*args, **kwargs)

    monkeypatch.setattr(proposer.skip, "forward", flaky)
    with pytest.raises(RuntimeError, match="interrupted"):
        proposer.propose(state.ctx, 5)
    assert [k.shape[2] for k, _ in engine.target.layer_tensors()] == [3] * 4
    assert_cache_is_fresh_prefill(engine.target)


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


def test_owned_draft_leaves_committed_cache_and_ids_alone(target):
    engine = SpeculativeEngine(target, None, EngineConfig(forward="owned"))
    state = engine.start([5, 6, 7, 8], SamplingParams(max_new_tokens=10))
    before = [(k.clone(), v.clone()) for k, v in engine.target.layer_tensors()]
    ids = list(engine.target.cached_ids)
    proposer = _skip(target, (1, 2))
    proposer.start(state.ctx)
    proposer.propose(state.ctx, 4)
    assert engine.target.cached_ids == ids
    for (k0, v0), (k1, v1) in zip(before, engine.target.layer_tensors()):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_engine_without_a_target_runner_is_refused(target):
    proposer = _skip(target, (1,))
    ctx = ProposeContext([1, 2], 2, SamplingParams(), torch.Generator(), 64)
    with pytest.raises(LayerSkipError, match="own KV cache"):
        proposer.start(ctx)
    with pytest.raises(LayerSkipError, match="call start"):
        proposer.propose(ctx, 2)


@pytest.mark.parametrize("forward", ["hf", "owned"])
def test_runner_is_checked_once_per_request_not_per_draft(target, forward, monkeypatch):
    """The draft step is bound in start(): propose does no per-call runner introspection."""
    import specdecode.proposers.layer_skip as layer_skip

    calls = []
    real = layer_skip.draft_step
    monkeypatch.setattr(layer_skip, "draft_step", lambda *a: (calls.append(1), real(*a))[1])
    proposer = _skip(target, (1,))
    engine = SpeculativeEngine(target, proposer, EngineConfig(num_speculative_tokens=3, forward=forward))
    out = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=20))
    assert out.metrics.num_drafted_tokens > 3  # several draft steps
    assert calls == [1]
    proposer.set_skip_layers((2,))  # a new skip set rebinds the step for the running request
    assert calls == [1, 1] and proposer.kept == (0, 1, 3)


# --------------------------------------------------------------------------- search and its cache


def test_search_proxy_scores_the_first_draft_token_exactly(target):
    """The one-pass proxy equals drafting one token from each position on a cache of the tokens before it."""
    context = [(5 * i + 3) % 64 for i in range(40)]
    skip = SkipForward(target)
    scorer = layer_search._ProxyScorer(skip, [context], [20], max_gamma=4)
    kept = [0, 3]
    with torch.inference_mode():
        runner = CachedModel(target)
        hits = 0
        rows = range(1, len(context) - 1)  # prompt of 20 tokens: scoring starts at max(1, 20 - 32)
        for j in rows:
            runner.reset()
            full = runner.forward(context[: j + 1])[-1].argmax()
            runner.rollback(j)
            draft = skip.forward(torch.tensor([context[j]]), j, kept, runner.cache)[-1].argmax()
            hits += int(draft == full)
    assert scorer.acceptance(kept) == pytest.approx(hits / len(rows))
    assert scorer.acceptance(list(range(4))) == 1.0  # nothing skipped: the draft is the target
    assert [k.shape[2] for k, _ in scorer.items[0][0].layer_tensors()] == [40] * 4  # scoring left no entries


def test_search_finds_a_valid_set_and_caches_it(tmp_path, monkeypatch):
    model = tiny_llama(vocab_size=64, seed=0, layers=6, scale=3.0)
    config = SearchConfig(new_tokens=8, proxy_evaluations=10, measured_candidates=2, time_budget_s=60)
    result = choose_skip_layers(model, [[1, 2, 3, 4, 5, 6]], config, cache_dir=tmp_path)
    assert result.skip_layers and all(1 <= i <= 4 for i in result.skip_layers)  # ends protected
    assert result.tokens_per_s > 0 and result.plain_tokens_per_s > 0 and not result.from_cache
    assert sum(c["tokens_per_s"] is not None for c in result.candidates) >= 1
    data = json.loads((tmp_path / "layer_skip.json").read_text())
    assert data["models"][result.key]["skip_layers"] == list(result.skip_layers)

    def no_search(*a, **k):
        raise AssertionError("searched again")

    monkeypatch.setattr(layer_search, "search_skip_layers", no_search)
    again = choose_skip_layers(model, [[9, 9]], config, cache_dir=tmp_path)
    assert again.from_cache and again.skip_layers == result.skip_layers
    # the auto mode of the proposer uses the cached set, and stays lossless
    auto = LayerSkipProposer(model, LayerSkipConfig(cache_dir=str(tmp_path)))
    out = SpeculativeEngine(model, auto).generate([1, 2, 3], SamplingParams(max_new_tokens=20))
    assert auto.skip_layers == result.skip_layers
    assert out.token_ids == SpeculativeEngine(model, None).generate([1, 2, 3], SamplingParams(
        max_new_tokens=20)).token_ids
    # another model has its own entry
    assert load_cached(tiny_llama(vocab_size=64, seed=5, layers=6), tmp_path) is None


def test_auto_mode_searches_on_the_first_long_enough_prompt(tmp_path):
    model = tiny_llama(vocab_size=64, seed=2, layers=5, scale=3.0)
    proposer = LayerSkipProposer(model, LayerSkipConfig(cache_dir=str(tmp_path), search_budget_s=30))
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
    assert "layer-skip self-speculation (skip 1), policy " + policy in err


def test_cli_layer_skip_auto_searches_once_then_uses_the_cache(capsys, tiny_model_dir, tmp_path):
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
