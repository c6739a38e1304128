"""The draft-model proposer (``specdecode.proposers.draft_model``): draft == target accepts everything, q is
the draft's distribution after the request's own processing, drafts stay in the target's vocabulary, a
shorter draft context, the catch-up cost, the policy hook, and the binding."""

from __future__ import annotations

import pytest
import torch

from specdecode.engine import EngineConfig, SpeculativeEngine
from specdecode.proposers import DraftModelConfig, DraftModelProposer
from specdecode.sampling import logits_to_probs
from specdecode.types import SamplingParams, SpecDecodeError
from tiny import engine_of as _engine, step_of, tiny_llama


def _greedy(n=40, **kw):
    return SamplingParams(max_new_tokens=n, **kw)


def _bound(draft, target, prompt, params):
    """A proposer bound to an engine holding one request (prefilled): (proposer, the request's context)."""
    proposer = DraftModelProposer(draft)
    engine = _engine(target, proposer)
    req, _ = engine.add(prompt, params)
    return proposer, req.ctx


def test_draft_equal_to_target_accepts_everything(target):
    greedy = _engine(target, DraftModelProposer(target), 4).generate([3, 1, 4], _greedy(41))
    assert greedy.metrics.acceptance_rate == 1.0
    assert greedy.metrics.mean_accepted_length == 5.0
    assert greedy.metrics.num_target_forwards == 1 + 8
    sampled = _engine(target, DraftModelProposer(target), 4).generate(
        [3, 1, 4], SamplingParams(temperature=1.0, max_new_tokens=41, seed=0)
    )
    assert sampled.metrics.acceptance_rate > 0.97  # p == q up to batched-vs-single rounding


@pytest.mark.parametrize("forward", ["auto", "hf"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_with_a_shorter_context_stops_drafting_where_it_ends(target, forward, temperature):
    """A 16-position draft under a 256-position target: chains shrink to what the draft can hold, then
    plain decoding steps (no draft tokens in the metrics); greedy output equals plain decoding."""
    short = tiny_llama(vocab_size=64, seed=0, scale=3.0, max_positions=16)  # the target's weights
    engine = SpeculativeEngine(target, DraftModelProposer(short, DraftModelConfig(forward=forward)),
                               EngineConfig(num_speculative_tokens=4, forward=forward))
    params = _greedy(40, temperature=temperature, seed=5)
    req, _ = engine.add([1, 2, 3], params)
    while req.finish_reason is None:
        room = 16 - len(req.ctx.token_ids) + 1  # the draft feeds the context and every draft token but the last
        step = step_of(engine, req)
        assert step.num_drafted <= max(0, room)
    out = engine.output(req)
    assert out.finish_reason == "length" and len(out.token_ids) == 40
    drafts = out.metrics.draft_lengths
    assert sum(drafts) > 0 and drafts[-10:] == [0] * 10
    if temperature == 0.0:
        assert out.token_ids == _engine(target, None).generate([1, 2, 3], params).token_ids


@torch.inference_mode()
def test_greedy_drafts_are_the_draft_models_own_greedy_continuation(target, draft):
    prompt = [5, 9, 2, 7]
    proposer, ctx = _bound(draft, target, prompt, _greedy())
    tokens = proposer.propose([ctx], [5])[0].token_ids[0].tolist()
    ids = list(ctx.token_ids)
    for _ in range(5):
        ids.append(int(draft(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    assert tokens == ids[len(ctx.token_ids):]


@torch.inference_mode()
def test_sampled_q_rows_are_the_draft_distribution_after_the_requests_processing(target, draft):
    """Each q row is ``logits_to_probs`` of the draft's logits at its prefix, with the request's temperature,
    top-k and top-p: the processing the target's p gets (lossless only if both match)."""
    params = SamplingParams(temperature=0.8, top_k=12, top_p=0.9, max_new_tokens=40, seed=3)
    proposer, ctx = _bound(draft, target, [5, 9, 2, 7], params)
    d = proposer.propose([ctx], [4])[0]
    assert d.draft_probs is not None and d.draft_probs.shape == (1, d.num_tokens, 64)
    assert d.draft_probs.dtype == torch.float32
    ids = list(ctx.token_ids)
    for j, tok in enumerate(d.token_ids[0].tolist()):
        want = logits_to_probs(draft(input_ids=torch.tensor([ids])).logits[0, -1], params)
        torch.testing.assert_close(d.draft_probs[0, j], want, atol=1e-5, rtol=1e-4)
        assert want[tok] > 0  # the token was drawn from q
        assert int((d.draft_probs[0, j] > 0).sum()) <= 12
        ids.append(tok)


def test_a_draft_with_a_larger_vocabulary_drafts_only_target_ids(target):
    """A draft whose head is padded past the target's vocabulary (ids 64..71 made most likely): its drafts and
    q stay in [0, 64), and greedy output still equals plain decoding."""
    wide = tiny_llama(vocab_size=72, seed=1, layers=1, hidden=32, scale=3.0)
    with torch.no_grad():
        wide.lm_head.weight[64:] = wide.lm_head.weight[:8] * 5.0
    for temperature in (0.0, 1.0):
        params = _greedy(30, temperature=temperature, seed=1)
        proposer, ctx = _bound(wide, target, [1, 2, 3], params)
        d = proposer.propose([ctx], [4])[0]
        assert d.num_tokens == 4 and int(d.token_ids.max()) < 64
        if d.draft_probs is not None:
            assert d.draft_probs.shape[-1] == 64
    out = _engine(target, DraftModelProposer(wide)).generate([1, 2, 3], _greedy(30))
    assert out.token_ids == _engine(target, None).generate([1, 2, 3], _greedy(30)).token_ids


def test_a_long_prompt_is_caught_up_once_and_timed_apart(target, draft):
    prompt = list(range(10, 60)) * 2  # longer than SOLO_FEED: fed alone on the first proposal
    assert len(prompt) > DraftModelProposer.SOLO_FEED
    proposer = DraftModelProposer(draft)
    engine = _engine(target, proposer)
    req, _ = engine.add(prompt, _greedy())
    first = proposer.propose([req.ctx], [3])[0]
    assert first.catch_up_s > 0 and proposer.runner.length(0) >= len(prompt)
    step_of(engine, req)
    again = proposer.propose([req.ctx], [3])[0]
    assert again.catch_up_s == 0.0  # only one or two tokens were missing


def test_the_policy_hook_ends_the_chain(target, draft):
    seen = []
    proposer, ctx = _bound(draft, target, [4, 2, 6], _greedy())
    ctx.should_continue = lambda probs: seen.append(probs) or len(seen) < 2
    d = proposer.propose([ctx], [6])[0]
    assert d.num_tokens == 2 and len(seen) == 2
    assert seen[0].shape == (64,) and float(seen[0].sum()) == pytest.approx(1.0, abs=1e-5)  # greedy: softmax


def test_an_unbound_proposer_and_rows_without_room_are_handled(target, draft):
    proposer = DraftModelProposer(draft)
    ctx = SpeculativeEngine(target, None).add([1, 2], _greedy(5))[0].ctx
    with pytest.raises(SpecDecodeError, match="not bound"):
        proposer.propose([ctx], [2])
    assert proposer.nbytes == 0
    bound, ctx = _bound(draft, target, [1, 2], _greedy())
    assert [d.num_tokens for d in bound.propose([ctx], [0])] == [0]  # nothing asked: nothing drafted
    assert bound.nbytes == 0  # the draft cache is allocated lazily
    assert bound.propose([ctx], [2])[0].num_tokens == 2 and bound.nbytes > 0


@pytest.mark.parametrize(("vocab", "forward", "limit"), [(None, "owned", 32768), (0, "owned", None),
                                                        (1000, "owned", 1000), (None, "hf", None)])
def test_a_large_draft_vocabulary_is_limited_by_default_where_the_forward_can(vocab, forward, limit):
    """``vocab`` unset: a draft whose vocabulary holds more than 2 x 32,768 ids scores the first 32,768 (plus
    each row's context ids) where its forward can limit it (owned), every id elsewhere; 0: every id."""
    from specdecode.lowbit import set_weight_precision

    big = set_weight_precision(tiny_llama(vocab_size=70_000, seed=0, layers=1, hidden=32, dtype=torch.float32),
                               "int8")
    proposer = DraftModelProposer(big, DraftModelConfig(forward=forward, vocab=vocab))
    out = _engine(big, proposer, 3).generate([3, 1, 40_000, 4], _greedy(6))
    assert out.token_ids == SpeculativeEngine(big, None).generate([3, 1, 40_000, 4], _greedy(6)).token_ids
    assert getattr(proposer.runner, "_vocab_rows", None) == limit


def test_a_negative_draft_vocabulary_is_refused():
    with pytest.raises(SpecDecodeError, match="vocab must be a token count"):
        DraftModelConfig(vocab=-1)
