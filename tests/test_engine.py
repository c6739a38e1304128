"""The loop end to end on tiny random models: losslessness, stopping, rollback, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdecode.cache import CachedModel
from specdecode.engine import EngineConfig, SpeculativeEngine, apply_stopping_rules
from specdecode.proposers import DraftModelConfig, DraftModelProposer, NgramProposer
from specdecode.proposers.ngram import NgramConfig, find_continuation
from specdecode.types import (
    Draft,
    EmptyPromptError,
    InvalidSamplingParams,
    PromptTooLongError,
    SamplingParams,
    SpecDecodeError,
)
from tiny import assert_cache_is_fresh_prefill, chi2_pvalue, exact_joint3, tiny_llama

PROMPTS = [[1], [5, 9, 2], [3, 4, 5, 3, 4, 5, 3, 4], list(range(10, 30)), [7, 7, 7, 7], [40, 2, 40, 2, 40]]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=64, seed=0, scale=3.0)


@pytest.fixture(scope="module")
def draft():
    return tiny_llama(vocab_size=64, seed=1, layers=1, hidden=32, scale=3.0)


def _engine(target, proposer, gamma=4, **kw):
    return SpeculativeEngine(target, proposer, EngineConfig(num_speculative_tokens=gamma), **kw)


def _greedy(n=40, **kw):
    return SamplingParams(max_new_tokens=n, **kw)


@pytest.mark.parametrize("gamma", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", ["ngram", "draft-model", "self-draft"])
def test_greedy_equals_plain_decoding(target, draft, gamma, kind):
    proposer = {
        "ngram": lambda: NgramProposer(NgramConfig(1, 3)),
        "draft-model": lambda: DraftModelProposer(draft),
        "self-draft": lambda: DraftModelProposer(target),
    }[kind]()
    plain = _engine(target, None)
    spec = _engine(target, proposer, gamma)
    for prompt in PROMPTS:
        expected = plain.generate(prompt, _greedy()).token_ids
        out = spec.generate(prompt, _greedy())
        assert out.token_ids == expected, (kind, gamma, prompt)
        assert out.metrics.num_generated_tokens == 40


def test_plain_decoding_counts(target):
    out = _engine(target, None).generate([1, 2], _greedy(10))
    m = out.metrics
    assert m.num_target_forwards == 10 and m.num_drafted_tokens == 0 and m.mean_accepted_length == 1.0


def test_draft_equal_to_target_accepts_everything(target):
    greedy = _engine(target, DraftModelProposer(target), 4).generate([3, 1, 4], _greedy(41))
    assert greedy.metrics.acceptance_rate == 1.0
    assert greedy.metrics.mean_accepted_length == 5.0
    assert greedy.metrics.num_target_forwards == 1 + 8
    sampled = _engine(target, DraftModelProposer(target), 4).generate(
        [3, 1, 4], SamplingParams(temperature=1.0, max_new_tokens=41, seed=0)
    )
    assert sampled.metrics.acceptance_rate > 0.97  # p == q up to batched-vs-single rounding


def test_max_new_tokens_inside_a_block_is_never_exceeded(target):
    for n in range(1, 12):
        out = _engine(target, DraftModelProposer(target), 8).generate([3, 1, 4], _greedy(n))
        assert len(out.token_ids) == n and out.finish_reason == "length"


def test_eos_inside_an_accepted_block_ends_generation(target):
    expected = _engine(target, None).generate([3, 1, 4], _greedy(20)).token_ids
    eos = expected[6]
    first = expected.index(eos)
    out = _engine(target, DraftModelProposer(target), 8).generate([3, 1, 4], _greedy(20, eos_token_ids=(eos,)))
    assert out.token_ids == expected[: first + 1]
    assert out.finish_reason == "stop"
    assert out.metrics.num_generated_tokens == first + 1
    ignored = _engine(target, DraftModelProposer(target), 8).generate(
        [3, 1, 4], _greedy(20, eos_token_ids=(eos,), ignore_eos=True)
    )
    assert ignored.token_ids == expected


class _AlwaysWrong:
    """Proposes tokens the target never picks greedily: every draft is rejected."""

    def __init__(self, target):
        self.oracle = CachedModel(target)

    def start(self, ctx):
        pass

    def propose(self, ctx, max_tokens):
        self.oracle.reset()
        best = int(self.oracle.forward(ctx.token_ids, last_only=True)[-1].argmax())
        return Draft.chain(torch.full((1, max_tokens), (best + 1) % ctx.vocab_size, dtype=torch.int64))

    def observe(self, ctx, result):
        pass


def test_every_draft_rejected_still_equals_plain(target):
    expected = _engine(target, None).generate([9, 8], _greedy(15)).token_ids
    out = _engine(target, _AlwaysWrong(target), 3).generate([9, 8], _greedy(15))
    assert out.token_ids == expected
    assert out.metrics.num_accepted_tokens == 0 and out.metrics.mean_accepted_length == 1.0
    assert out.metrics.num_drafted_tokens > 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_caches_equal_fresh_prefill_after_many_steps(target, draft, temperature):
    proposer = DraftModelProposer(draft)
    engine = _engine(target, proposer, 3)
    params = SamplingParams(temperature=temperature, max_new_tokens=60, seed=1)
    state = engine.start([5, 6, 7], params)
    rejections = 0
    while state.finish_reason is None:
        step = engine.step(state)
        rejections += step.num_accepted < step.num_drafted
        assert engine.target.cached_ids == state.ctx.token_ids[:-1]
        assert_cache_is_fresh_prefill(engine.target)
        assert_cache_is_fresh_prefill(proposer.runner)
        assert proposer.runner.cached_ids == state.ctx.token_ids[: proposer.runner.num_cached]
    assert rejections > 3


def test_seed_makes_sampling_reproducible(target, draft):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=30, seed=123)
    a = _engine(target, DraftModelProposer(draft)).generate([1, 2, 3], params).token_ids
    b = _engine(target, DraftModelProposer(draft)).generate([1, 2, 3], params).token_ids
    assert a == b


def test_sampled_output_follows_target_distribution_through_the_engine():
    """First three sampled tokens, speculative (draft-model, gamma 2) vs the target's exact joint."""
    vocab = 5
    tgt = tiny_llama(vocab_size=vocab, seed=3, layers=1, hidden=32, scale=4.0)
    drf = tiny_llama(vocab_size=vocab, seed=4, layers=1, hidden=32, scale=4.0)
    prompt = [1, 2]
    exact = exact_joint3(tgt, prompt)
    engine = _engine(tgt, DraftModelProposer(drf), 2)
    counts = np.zeros(vocab**3)
    for s in range(3000):
        out = engine.generate(prompt, SamplingParams(temperature=1.0, max_new_tokens=3, seed=s))
        counts[np.ravel_multi_index(out.token_ids, (vocab,) * 3)] += 1
    assert chi2_pvalue(counts, exact) > 1e-3


def test_one_token_prompt_and_gamma_one(target):
    expected = _engine(target, None).generate([4], _greedy(12)).token_ids
    assert _engine(target, NgramProposer(), 1).generate([4], _greedy(12)).token_ids == expected


def test_bad_prompts_raise_clear_errors(target):
    engine = _engine(target, NgramProposer())
    with pytest.raises(EmptyPromptError, match="empty"):
        engine.generate([], _greedy())
    with pytest.raises(PromptTooLongError, match="context of 256"):
        engine.generate([1] * 250, _greedy(10))
    with pytest.raises(SpecDecodeError, match="token ids must be in"):
        engine.generate([1, 999], _greedy())


@pytest.mark.parametrize(
    "kwargs",
    [dict(temperature=-1), dict(temperature=float("nan")), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2),
     dict(max_new_tokens=0), dict(max_new_tokens=10**9), dict(seed=-3)],
)
def test_sampling_params_are_validated(kwargs):
    with pytest.raises(InvalidSamplingParams):
        SamplingParams(**kwargs)


def test_gamma_is_validated():
    with pytest.raises(SpecDecodeError):
        EngineConfig(num_speculative_tokens=0)


def test_ngram_lookup_finds_most_recent_continuation():
    toks = np.array([1, 2, 3, 9, 1, 2, 4, 5, 1, 2])
    assert find_continuation(toks, 2, 3).tolist() == [4, 5, 1]
    assert find_continuation(toks, 3, 3).tolist() == []
    assert find_continuation(np.array([7]), 1, 3).tolist() == []


def test_metrics_by_position(target):
    out = _engine(target, DraftModelProposer(target), 3).generate([1, 2], _greedy(13))
    m = out.metrics
    assert m.drafted_by_position == [3, 3, 3] and m.accepted_by_position == [3, 3, 3]  # 1 + 3 steps x 4
    assert m.acceptance_by_position == [1.0, 1.0, 1.0]
    d = m.to_dict()
    for key in ("acceptance_rate", "mean_accepted_length", "tokens_per_s", "other_time_s"):
        assert key in d


@pytest.mark.parametrize("forward", ["auto", "hf"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_with_a_shorter_context_stops_drafting_where_it_ends(target, forward, temperature):
    """A 16-position draft under a 256-position target: chains shrink to what the draft can hold, then
    plain decoding steps (no draft tokens in the metrics); greedy output equals plain decoding."""
    short = tiny_llama(vocab_size=64, seed=0, scale=3.0, max_positions=16)  # the target's weights
    engine = SpeculativeEngine(target, DraftModelProposer(short, DraftModelConfig(forward=forward)),
                               EngineConfig(num_speculative_tokens=4, forward=forward))
    params = _greedy(40, temperature=temperature, seed=5)
    state = engine.start([1, 2, 3], params)
    while state.finish_reason is None:
        room = 16 - len(state.ctx.token_ids) + 1  # the draft feeds the context and every draft token but the last
        step = engine.step(state)
        assert step.num_drafted <= max(0, room)
    out = engine.output(state)
    assert out.finish_reason == "length" and len(out.token_ids) == 40
    drafts = out.metrics.draft_lengths
    assert sum(drafts) > 0 and drafts[-10:] == [0] * 10
    if temperature == 0.0:
        assert out.token_ids == _engine(target, None).generate([1, 2, 3], params).token_ids


def test_stopping_rules():
    eos = SamplingParams(max_new_tokens=5, eos_token_ids=(9,))
    assert apply_stopping_rules([1, 2], eos, 0) == ([1, 2], None)
    assert apply_stopping_rules([1, 2, 3], eos, 2) == ([1, 2, 3], "length")
    assert apply_stopping_rules([1, 2, 3, 4], eos, 2) == ([1, 2, 3], "length")
    assert apply_stopping_rules([1, 9, 3], eos, 0) == ([1, 9], "stop")
    assert apply_stopping_rules([1, 2, 9], eos, 2) == ([1, 2, 9], "stop")  # EOS as the last allowed token
    ignored = SamplingParams(max_new_tokens=5, eos_token_ids=(9,), ignore_eos=True)
    assert apply_stopping_rules([1, 9, 3], ignored, 0) == ([1, 9, 3], None)
