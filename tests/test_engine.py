"""The loop end to end on tiny float64 models: losslessness, the batch, stopping, rollback, errors.

Float64 weights keep greedy near-ties out of reach of summation-order differences between batch
shapes, so "equal" below means token for token.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from specdecode.engine import EngineConfig, SpeculativeEngine, apply_stopping_rules
from specdecode.proposers import (
    DraftModelProposer,
    LayerSkipConfig,
    LayerSkipProposer,
    NgramProposer,
    SuffixConfig,
    SuffixProposer,
    TreeDraftConfig,
    TreeDraftProposer,
)
from specdecode.proposers.base import RowProposer
from specdecode.proposers.ngram import NgramConfig
from specdecode.types import (
    Draft,
    EmptyPromptError,
    EngineFullError,
    PromptTooLongError,
    SamplingParams,
    SpecDecodeError,
)
from tiny import assert_cache_is_fresh_prefill, chi2_pvalue, exact_joint, exact_joint3, tiny_llama

PROMPTS = [[1], [5, 9, 2], [3, 4, 5, 3, 4, 5, 3, 4], list(range(10, 30)), [7, 7, 7, 7], [40, 2, 40, 2, 40]]


def _engine(target, proposer, gamma=4, **kw):
    return SpeculativeEngine(target, proposer, EngineConfig(num_speculative_tokens=gamma), **kw)


def _greedy(n=40, **kw):
    return SamplingParams(max_new_tokens=n, **kw)


# --------------------------------------------------------------------------- one request


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


def test_max_new_tokens_inside_a_block_is_never_exceeded(target):
    for n in range(1, 12):
        out = _engine(target, DraftModelProposer(target), 8).generate([3, 1, 4], _greedy(n))
        assert len(out.token_ids) == n and out.finish_reason == "length"
        assert out.metrics.num_drafted_tokens <= n - 1  # drafts are capped at what can still be committed


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


class _AlwaysWrong(RowProposer):
    """Proposes tokens the target never picks greedily: every draft is rejected."""

    name = "always-wrong"

    def __init__(self, target):
        self.target = target

    @torch.inference_mode()
    def propose_row(self, ctx, max_tokens):
        best = int(self.target(input_ids=torch.tensor([ctx.token_ids])).logits[0, -1].argmax())
        return Draft.chain(torch.full((1, max_tokens), (best + 1) % ctx.vocab_size, dtype=torch.int64))


def test_every_draft_rejected_still_equals_plain(target):
    expected = _engine(target, None).generate([9, 8], _greedy(15)).token_ids
    out = _engine(target, _AlwaysWrong(target), 3).generate([9, 8], _greedy(15))
    assert out.token_ids == expected
    assert out.metrics.num_accepted_tokens == 0 and out.metrics.mean_accepted_length == 1.0
    assert out.metrics.num_drafted_tokens > 0


def test_seed_makes_sampling_reproducible(target, draft):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=30, seed=123)
    a = _engine(target, DraftModelProposer(draft)).generate([1, 2, 3], params).token_ids
    b = _engine(target, DraftModelProposer(draft)).generate([1, 2, 3], params).token_ids
    assert a == b


def test_a_runner_with_bfloat16_logits_is_sampled_as_their_float32_values(target, draft, monkeypatch):
    """A custom runner may return bf16 logits: the sampled rows' probabilities are written into a float32 copy (a
    bf16 one rounded them to 8 bits of mantissa: a biased acceptance test), the same probabilities verification gets
    from the same logits as float32."""
    import specdecode.engine as E

    params = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=12, seed=5)
    seen = []
    verify = E.verify_chains

    def record(ids, counts, q, target_probs, *rest):
        seen[-1].append(target_probs.clone())
        return verify(ids, counts, q, target_probs, *rest)

    monkeypatch.setattr(E, "verify_chains", record)
    outs = []
    for upcast in (False, True):
        engine = _engine(target, DraftModelProposer(draft), 3)
        forward = engine.runner.forward

        def low(*a, upcast=upcast, forward=forward, **kw):
            logits = forward(*a, **kw).to(torch.bfloat16)
            return logits.float() if upcast else logits

        engine.runner.forward = low
        seen.append([])
        outs.append(engine.generate([1, 2, 3], params).token_ids)
    assert outs[0] == outs[1] and len(seen[0]) == len(seen[1]) > 1
    for a, b in zip(*seen):
        assert a.dtype == torch.float32 and torch.equal(a, b)


@pytest.mark.parametrize("coupled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_sampled_output_follows_target_distribution_through_the_engine(coupled):
    """First three sampled tokens, speculative (draft-model, gamma 2) vs the target's exact joint, in the
    standard (rejection sampling) and the coupled mode."""
    vocab = 5
    tgt = tiny_llama(vocab_size=vocab, seed=3, layers=1, hidden=32, scale=4.0)
    drf = tiny_llama(vocab_size=vocab, seed=4, layers=1, hidden=32, scale=4.0)
    prompt = [1, 2]
    exact = exact_joint3(tgt, prompt)
    # 2,000 seeded requests decoded 64 at a time (a request's tokens do not depend on the rest of the batch)
    engine = SpeculativeEngine(tgt, DraftModelProposer(drf), EngineConfig(num_speculative_tokens=2, max_batch_size=64))
    counts = np.zeros(vocab**3)
    params = [SamplingParams(temperature=1.0, max_new_tokens=3, seed=s, coupled=coupled) for s in range(2000)]
    for out in engine.generate_batch([prompt] * 2000, params):
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
    assert not engine.rows  # nothing was admitted


@pytest.mark.parametrize("kwargs", [dict(num_speculative_tokens=0), dict(num_speculative_tokens=65),
                                    dict(max_batch_size=0), dict(max_batch_size=257), dict(forward="fast")])
def test_engine_config_is_validated(kwargs):
    with pytest.raises(SpecDecodeError):
        EngineConfig(**kwargs)


def test_stopping_rules():
    eos = SamplingParams(max_new_tokens=5, eos_token_ids=(9,))
    assert apply_stopping_rules([1, 2], eos, 0) == ([1, 2], None)
    assert apply_stopping_rules([1, 2, 3], eos, 2) == ([1, 2, 3], "length")
    assert apply_stopping_rules([1, 2, 3, 4], eos, 2) == ([1, 2, 3], "length")
    assert apply_stopping_rules([1, 9, 3], eos, 0) == ([1, 9], "stop")
    assert apply_stopping_rules([1, 2, 9], eos, 2) == ([1, 2, 9], "stop")  # EOS as the last allowed token
    ignored = SamplingParams(max_new_tokens=5, eos_token_ids=(9,), ignore_eos=True)
    assert apply_stopping_rules([1, 9, 3], ignored, 0) == ([1, 9, 3], None)


# --------------------------------------------------------------------------- the batch
#
# A 4-layer target serves every drafter (layer-skip drafts with layers 1 and 2 skipped).


@pytest.fixture(scope="module")
def target4():
    return tiny_llama(vocab_size=64, seed=0, layers=4, scale=3.0)


DRAFTERS = {
    "ngram": lambda t, d: NgramProposer(NgramConfig(1, 3)),
    "suffix": lambda t, d: SuffixProposer(SuffixConfig(use_global=False)),  # per-request tries only
    "draft-model": lambda t, d: DraftModelProposer(d),
    "layer-skip": lambda t, d: LayerSkipProposer(t, LayerSkipConfig(skip_layers=(1, 2), min_confidence=0.0)),
    "tree-static": lambda t, d: TreeDraftProposer(d, TreeDraftConfig(kind="static", num_nodes=8)),
    "tree-dynamic": lambda t, d: TreeDraftProposer(d, TreeDraftConfig(kind="dynamic", num_nodes=8, top_k=3)),
}


def _batch_requests(vocab: int = 64) -> list[tuple[list[int], SamplingParams]]:
    """Greedy and sampled requests of many lengths: eight long ones first (the batch grows 1..8), then
    short ones that join as rows leave, one finishing in its prefill."""
    out = []
    for i in range(14):
        prompt = PROMPTS[i % len(PROMPTS)] + [(3 * i + 1) % vocab] * (i % 3)
        n = 33 - i if i < 8 else [1, 3, 5, 8, 12, 2][i - 8]
        if i % 3 == 0:
            params = SamplingParams(max_new_tokens=n)
        elif i % 3 == 1:
            params = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=n, seed=100 + i)
        else:
            params = SamplingParams(temperature=1.2, top_k=12, max_new_tokens=n, seed=200 + i)
        out.append((prompt, params))
    return out


def run_batched(engine, requests, per_step: int = 1):
    """Admit ``per_step`` requests per step while slots are free; step until every request is done.

    Returns:
        (requests in order, their StepOutputs in order, batch sizes seen by the steps).
    """
    waiting = list(range(len(requests)))
    reqs, outs, sizes = [None] * len(requests), [[] for _ in requests], []
    index = {}
    while waiting or engine.rows:
        for _ in range(per_step):
            if waiting and len(engine.rows) < engine.max_batch_size:
                i = waiting.pop(0)
                reqs[i], first = engine.add(*requests[i])
                index[id(reqs[i])] = i
                outs[i].append(first)
        if engine.rows:
            sizes.append(len(engine.rows))
            for req, out in engine.step():
                outs[index[id(req)]].append(out)
    return reqs, outs, sizes


def _check_streams(reqs, outs) -> None:
    """Each request's stream: tokens concatenate to its output, nothing after the finishing event."""
    for req, stream in zip(reqs, outs):
        assert [t for o in stream for t in o.token_ids] == req.generated
        assert [o.finished for o in stream] == [False] * (len(stream) - 1) + [True]
        assert stream[-1].finish_reason == req.finish_reason in ("length", "stop")
        assert len(req.generated) <= req.params.max_new_tokens


@pytest.mark.parametrize("forward, kind", [*(("auto", k) for k in DRAFTERS),
                                           ("hf", "ngram"), ("hf", "draft-model"), ("hf", "tree-static")])
def test_a_request_does_not_depend_on_the_rest_of_the_batch(target4, draft, forward, kind):
    """Greedy and seeded sampled requests joining and leaving a batch of up to 8 give exactly what each
    gives alone (batch size 1), drafts and acceptance included."""
    requests = _batch_requests()
    config = EngineConfig(num_speculative_tokens=3, max_batch_size=8, forward=forward)
    engine = SpeculativeEngine(target4, DRAFTERS[kind](target4, draft), config)
    reqs, outs, sizes = run_batched(engine, requests)
    assert set(range(1, 9)) <= set(sizes), sizes  # every batch size from 1 to 8 ran
    _check_streams(reqs, outs)
    assert outs[8][0].finished and len(outs[8]) == 1  # max_new_tokens = 1: done in its prefill
    alone = SpeculativeEngine(target4, DRAFTERS[kind](target4, draft), EngineConfig(num_speculative_tokens=3,
                                                                                    forward=forward))
    drafted = 0
    for (prompt, params), req in zip(requests, reqs):
        solo = alone.generate(prompt, params)
        assert req.generated == solo.token_ids, (kind, prompt, params)
        assert req.metrics.num_drafted_tokens == solo.metrics.num_drafted_tokens
        assert req.metrics.num_accepted_tokens == solo.metrics.num_accepted_tokens
        drafted += solo.metrics.num_drafted_tokens
    assert drafted > 0
    assert engine.rows == [] and all(not ids for ids in engine.runner.ids)


VOCAB = 5
DIST_PROMPT = [1, 2, 3, 1, 2]


@pytest.fixture(scope="module")
def small_pair():
    """A vocabulary-5 target (4 layers, layers strengthened so skipping two changes the draft) and draft."""
    tgt = tiny_llama(vocab_size=VOCAB, seed=3, layers=4, hidden=32, scale=4.0)
    with torch.no_grad():
        for layer in tgt.model.layers:
            layer.mlp.down_proj.weight.mul_(4.0)
            layer.self_attn.o_proj.weight.mul_(4.0)
    return tgt, tiny_llama(vocab_size=VOCAB, seed=4, layers=1, hidden=32, scale=4.0)


@pytest.mark.parametrize("kind, coupled", [  # the fast lane keeps n-gram; the slow lane every drafter and the coupled mode
    *(pytest.param(k, False, marks=() if k == "ngram" else pytest.mark.slow) for k in DRAFTERS),
    pytest.param("draft-model", True, marks=pytest.mark.slow), pytest.param("tree-dynamic", True, marks=pytest.mark.slow)])
def test_sampled_distribution_in_a_busy_batch_is_the_targets(small_pair, kind, coupled):
    """3-token samples of one prompt, decoded among other requests (other prompts, greedy and sampled,
    joining and leaving) in batches of up to 8: chi-square against the target's exact joint. Standard
    rejection sampling for every drafter; the coupled mode (draft-independent token for token, so two
    drafters stand for all) among coupled background rows."""
    tgt, drf = small_pair
    engine = SpeculativeEngine(tgt, DRAFTERS[kind](tgt, drf), EngineConfig(num_speculative_tokens=2, max_batch_size=8))
    background = [([4, 3, 2, 1], SamplingParams(max_new_tokens=9)),
                  ([2, 2, 2], SamplingParams(temperature=0.7, max_new_tokens=6, seed=1)),
                  ([0, 1, 0, 1, 0, 1], SamplingParams(temperature=1.5, top_p=0.9, max_new_tokens=11, seed=2))]
    samples = 1000
    measured = [(DIST_PROMPT, SamplingParams(temperature=1.0, max_new_tokens=3, seed=s, coupled=coupled))
                for s in range(samples)]
    requests = []
    for i, m in enumerate(measured):
        requests.append(m)
        if i % 4 == 0:
            requests.append(background[(i // 4) % len(background)])
    reqs, outs, sizes = run_batched(engine, requests, per_step=4)
    assert max(sizes) == 8
    counts = np.zeros(VOCAB**3)
    drafted = 0
    for (prompt, params), req in zip(requests, reqs):
        if prompt is DIST_PROMPT:
            counts[np.ravel_multi_index(req.generated, (VOCAB,) * 3)] += 1
            drafted += req.metrics.num_drafted_tokens
    assert counts.sum() == samples and drafted > samples // 2
    assert chi2_pvalue(counts, exact_joint(tgt, DIST_PROMPT, 3, backend="owned")) > 1e-3


@pytest.mark.parametrize("forward, kind", [pytest.param("hf", "draft-model", marks=pytest.mark.slow),
                                           pytest.param("owned", "draft-model", marks=pytest.mark.slow),
                                           pytest.param("hf", "tree-dynamic", marks=pytest.mark.slow),
                                           ("owned", "tree-dynamic"), ("owned", "layer-skip")])
def test_every_rows_caches_equal_a_fresh_prefill_after_many_steps(target4, draft, forward, kind):
    """Per-row rollback contract: after every step, each row's target cache holds exactly the keys /
    values of a fresh prefill of its committed tokens but the last (a draft model's cache: of its own
    ids; a tree draft's: a prefix of the committed tokens), while rows are rejected, join, leave and
    move. (Layer-skip drafts on the owned forward only.)"""
    proposer = DRAFTERS[kind](target4, draft)
    if kind != "layer-skip":  # the draft's own cache on the same forward
        proposer.config = dataclasses.replace(proposer.config, forward=forward)
    engine = SpeculativeEngine(target4, proposer, EngineConfig(num_speculative_tokens=3, max_batch_size=4,
                                                               forward=forward))
    requests = [(PROMPTS[i % len(PROMPTS)], SamplingParams(temperature=[0.0, 1.0][i % 2], max_new_tokens=6 + 5 * i,
                                                           seed=i)) for i in range(7)]
    waiting, rejections, steps = list(requests), 0, 0
    while waiting or engine.rows:
        if waiting and len(engine.rows) < 4:
            engine.add(*waiting.pop(0))
        for req, out in engine.step():
            rejections += out.num_accepted < out.num_drafted
        steps += 1
        for slot, row in enumerate(engine.rows):
            assert row.ctx.slot == slot
            assert engine.runner.ids[slot] == row.ctx.token_ids[:-1]
            assert_cache_is_fresh_prefill(engine.runner, slot)
            own = getattr(proposer, "runner", None)
            if own is not None:  # a draft model's cache may hold rejected drafts until it syncs
                assert_cache_is_fresh_prefill(own, slot)
            if kind.startswith("tree"):  # the tree draft keeps its accepted path only
                assert own.ids[slot] == row.ctx.token_ids[: len(own.ids[slot])]
    assert rejections > 5 and steps > 15


# --------------------------------------------------------------------------- finishing and failing rows


def test_rows_finishing_in_their_prefill_never_run_a_step(target):
    engine = SpeculativeEngine(target, NgramProposer(), EngineConfig(num_speculative_tokens=3, max_batch_size=3))
    long, _ = engine.add([5, 9, 2], _greedy(20))
    first_token = _engine(target, None).generate([1, 2, 3], _greedy(1)).token_ids[0]
    capped, out = engine.add([1, 2, 3], _greedy(1))
    assert out.finished and out.finish_reason == "length" and out.token_ids == [first_token]
    stopped, out = engine.add([1, 2, 3], _greedy(10, eos_token_ids=(first_token,)))
    assert out.finished and out.finish_reason == "stop" and out.token_ids == [first_token]
    assert engine.rows == [long]
    for req in (capped, stopped):
        assert req.generated == [first_token]
        assert req.metrics.num_verify_steps == 0 and req.metrics.num_drafted_tokens == 0
        assert req.metrics.num_target_forwards == 1
    while long.finish_reason is None:
        assert [r for r, _ in engine.step()] == [long]
    assert long.generated == _engine(target, None).generate([5, 9, 2], _greedy(20)).token_ids


def test_a_row_finishing_inside_an_accepted_block_emits_nothing_after_it(target):
    """Self-drafting (every draft token accepted), gamma 8: an EOS inside the first block ends the row in
    that step; its counters hold only the tokens up to the EOS; the other rows go on unchanged."""
    expected = _engine(target, None).generate([3, 1, 4], _greedy(20)).token_ids
    f = next(i for i in range(2, 8) if expected[i] not in expected[:i])
    eos = expected[f]
    engine = SpeculativeEngine(target, DraftModelProposer(target), EngineConfig(num_speculative_tokens=8,
                                                                                max_batch_size=3))
    a, _ = engine.add([3, 1, 4], _greedy(20, eos_token_ids=(eos,)))
    b, _ = engine.add([3, 1, 4], _greedy(20))
    c, _ = engine.add([3, 1, 4], _greedy(5))  # the token cap inside the block
    outs = dict((id(r), o) for r, o in engine.step())
    out_a, out_c = outs[id(a)], outs[id(c)]
    assert out_a.finished and out_a.finish_reason == "stop" and out_a.token_ids == expected[1 : f + 1]
    assert out_a.num_drafted == out_a.num_accepted == f  # the drafts after the EOS could not commit
    assert a.metrics.num_drafted_tokens == a.metrics.num_accepted_tokens == f
    assert a.metrics.num_step_tokens == f and a.metrics.drafted_by_position == [1] * f
    assert out_c.finished and out_c.finish_reason == "length" and out_c.token_ids == expected[1:5]
    assert out_c.num_drafted == out_c.num_accepted == 3  # drafted only what could be committed
    assert engine.rows == [b]
    while b.finish_reason is None:
        assert [r for r, _ in engine.step()] == [b]
    assert a.generated == expected[: f + 1] and b.generated == expected and c.generated == expected[:5]


class _Broken(RowProposer):
    """N-gram drafts, except for prompts starting with 60 (ids -1), 61 (id V), 62 (q(x) = 0 at its own token)
    or 63 (a tree of too many nodes from a chain proposer): a broken proposer."""

    name = "broken"

    def __init__(self):
        self.inner = NgramProposer()

    def start(self, ctx):
        self.inner.start(ctx)

    def propose_row(self, ctx, max_tokens):
        if ctx.token_ids[0] in (60, 61):
            bad = -1 if ctx.token_ids[0] == 60 else ctx.vocab_size
            return Draft.chain(torch.tensor([[1, bad]]))
        if ctx.token_ids[0] == 62:  # q says the token it drew could not have been drawn
            q = torch.full((1, 1, ctx.vocab_size), 1.0 / (ctx.vocab_size - 1))
            q[0, 0, 1] = 0.0
            return Draft.chain(torch.tensor([[1]]), q)
        if ctx.token_ids[0] == 63:
            return Draft.chain(torch.ones(1, 200, dtype=torch.int64))
        return self.inner.propose_row(ctx, max_tokens)


def test_a_proposer_breaking_its_contract_fails_that_row_only(target):
    engine = SpeculativeEngine(target, _Broken(), EngineConfig(num_speculative_tokens=3, max_batch_size=4))
    good = [engine.add(p, _greedy(25))[0] for p in ([3, 4, 5, 3, 4, 5], [5, 9, 2])]
    bad = [engine.add(p, _greedy(25))[0] for p in ([60, 1, 2], [61, 1, 2])]
    outs = dict((id(r), o) for r, o in engine.step())
    for req, needle in zip(bad, ("got -1", "got 64")):
        _assert_failed_alone(outs[id(req)], req, needle)
    assert engine.rows == good
    while engine.rows:
        engine.step()
    plain = _engine(target, None)
    for req in good:
        assert req.finish_reason == "length"
        assert req.generated == plain.generate(req.ctx.token_ids[: req.ctx.num_prompt_tokens], _greedy(25)).token_ids


def test_zero_draft_probability_and_too_many_nodes_break_the_contract(target):
    """q(x) = 0 at a drafted x would make u * q < p always true (a biased accept): refused at the door, as is
    a draft wider than the slot cache's scratch columns."""
    engine = SpeculativeEngine(target, _Broken(), EngineConfig(num_speculative_tokens=3, max_batch_size=3))
    good = engine.add([3, 4, 5, 3, 4, 5], _greedy(10))[0]
    bad = [engine.add(p, SamplingParams(max_new_tokens=200, temperature=1.0, seed=0))[0]
           for p in ([62, 1, 2], [63, 1, 2])]
    outs = dict((id(r), o) for r, o in engine.step())
    _assert_failed_alone(outs[id(bad[0])], bad[0], "probability 0")
    _assert_failed_alone(outs[id(bad[1])], bad[1], "128")
    assert engine.rows == [good]


#: Broken draft probabilities, each a function of the honest q [1, N, V] the tokens were drawn from (the
#: drafted tokens keep q(x) > 0, so the check of ids and of q(x) = 0 lets them all through), and a word of the
#: refusal: non-finite entries, negative ones, rows that do not sum to 1, a q that is not a float tensor.
BROKEN_Q = {
    "nan": (lambda q: q.index_fill(2, torch.tensor([63]), float("nan")), "finite"),
    "nan-everywhere": (lambda q: torch.full_like(q, float("nan")), "finite"),
    "inf": (lambda q: q.index_fill(2, torch.tensor([63]), float("inf")), "finite"),
    "negative": (lambda q: torch.cat([q[..., :62], q[..., 62:63] + 0.25, q[..., 63:] - 0.25], -1), "negative"),
    "half": (lambda q: q * 0.5, "sum to 1"),
    "double": (lambda q: q * 2.0, "sum to 1"),
    "integer": (lambda q: (q > 0).to(torch.int64), "float"),
}


class _ClaimsQ(DraftModelProposer):
    """A draft model that reports ``claim(q)`` for the q its tokens were drawn from, on rows whose prompt starts
    with 60 (the others report q as it is)."""

    name = "broken"

    def __init__(self, model, claim, trees=False):
        super().__init__(model)
        self.claim = claim
        self.produces_trees = trees  # a chain is a tree: the tree verifier then takes it

    def propose(self, batch, max_tokens):
        drafts = super().propose(batch, max_tokens)
        for ctx, d in zip(batch, drafts):
            if ctx.token_ids[0] == 60 and d.draft_probs is not None:
                d.draft_probs = self.claim(d.draft_probs)
        return drafts


@pytest.mark.parametrize("verification", ["token", "block", "tree"])
@pytest.mark.parametrize("fault", list(BROKEN_Q))
def test_broken_draft_probabilities_fail_that_row_only(target, draft, fault, verification):
    """q is checked at the door as ids are: NaN / inf / negative entries, rows not summing to 1, a q that is not a
    float tensor fail the row that drafted them, with an error naming the proposer, before any verification
    (token-level, block, or a tree's); the other rows, sampled and greedy, go on as if it had never been there."""
    claim, needle = BROKEN_Q[fault]
    trees = verification == "tree"
    engine = SpeculativeEngine(target, _ClaimsQ(draft, claim, trees), EngineConfig(
        num_speculative_tokens=3, max_batch_size=3, verification="auto" if trees else verification))
    sampled = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3, coupled=False)
    honest, _ = engine.add([5, 9, 2], sampled)
    bad, _ = engine.add([60, 1, 2], sampled)
    greedy, _ = engine.add([3, 1, 4], _greedy(12))
    outs = dict((id(r), o) for r, o in engine.step())
    _assert_failed_alone(outs[id(bad)], bad, "draft_probs")
    assert needle in bad.error
    assert engine.rows == [honest, greedy]  # the last row moved into the failed row's slot
    while engine.rows:
        engine.step()
    alone = SpeculativeEngine(target, _ClaimsQ(draft, claim, trees), EngineConfig(
        num_speculative_tokens=3, verification="auto" if trees else verification))
    for req in (honest, greedy):  # each row's output is its own: the failed row changed nothing
        assert req.finish_reason == "length"
        assert req.generated == alone.generate(req.ctx.token_ids[: req.ctx.num_prompt_tokens], req.params).token_ids


def _assert_failed_alone(out, req, needle):
    """A row whose draft broke the contract: finished with an error naming the proposer, nothing committed."""
    assert out.finished and out.finish_reason == "error" and out.token_ids == []
    assert "proposer 'broken'" in out.error and needle in out.error and out.error == req.error
    assert len(req.generated) == 1  # the prefill's token only: nothing after the error


def test_a_full_engine_refuses_another_request(target):
    engine = SpeculativeEngine(target, None, EngineConfig(max_batch_size=2))
    engine.add([1], _greedy(5))
    engine.add([2], _greedy(5))
    with pytest.raises(EngineFullError):
        engine.add([3], _greedy(5))
    engine.abort(engine.rows[0])
    engine.add([3], _greedy(5))  # an aborted row frees its slot at once
    assert len(engine.rows) == 2


def test_abort_and_stream(target, draft):
    engine = SpeculativeEngine(target, DraftModelProposer(draft), EngineConfig(num_speculative_tokens=3,
                                                                               max_batch_size=2))
    other, _ = engine.add([5, 9, 2], _greedy(30))
    pieces, stream = [], engine.stream([3, 1, 4], _greedy(30))
    for i, out in enumerate(stream):
        pieces.extend(out.token_ids)
        if i == 3:
            break  # the caller stops early
    stream.close()
    assert engine.last_output.finish_reason == "stop" and engine.last_output.token_ids == pieces
    assert engine.rows == [other]
    engine.abort(other)
    assert other.finish_reason == "cancelled" and engine.rows == []
    plain = _engine(target, None).generate([3, 1, 4], _greedy(30)).token_ids
    assert pieces == plain[: len(pieces)]


def test_generate_batch_equals_one_at_a_time(target, draft):
    params = [_greedy(12), SamplingParams(temperature=0.8, max_new_tokens=15, seed=3), _greedy(7)]
    prompts = PROMPTS[:3]
    engine = SpeculativeEngine(target, DraftModelProposer(draft), EngineConfig(num_speculative_tokens=3,
                                                                               max_batch_size=2))
    outs = engine.generate_batch(prompts, params)
    alone = _engine(target, DraftModelProposer(draft), 3)
    assert [o.token_ids for o in outs] == [alone.generate(p, s).token_ids for p, s in zip(prompts, params)]
    with pytest.raises(PromptTooLongError):
        engine.generate_batch([[1], [1] * 300], _greedy(5))  # checked before anything runs
    assert engine.rows == []


# --------------------------------------------------------------------------- every way out frees the rows


class _FailOnce(NgramProposer):
    """An n-gram drafter that raises ``error`` once: in ``start`` (admission) or in its second ``propose``."""

    def __init__(self, where: str, error: BaseException) -> None:
        super().__init__(NgramConfig(1, 3))
        self.where, self.error, self.proposals = where, error, 0

    def start(self, ctx) -> None:
        if self.where == "start":
            self.where = None
            raise self.error
        super().start(ctx)

    def propose(self, batch, max_tokens):
        self.proposals += 1
        if self.where == "propose" and self.proposals == 2:
            self.where = None
            raise self.error
        return super().propose(batch, max_tokens)


@pytest.mark.parametrize("where", ["start", "propose"])
@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("drafter bug")])
@pytest.mark.parametrize("entry", ["generate", "stream", "generate_batch", "add-step"])
def test_every_way_out_of_the_engine_frees_every_row(target, where, error, entry):
    """An exception or Ctrl-C in the admission or in a step, under each entry point: no row stays taken,
    a row another caller added leaves too (a step that did not complete leaves every row's cache unknown:
    they end with finish reason "error", or "cancelled" for an interrupt), and the engine then generates
    exactly what plain decoding does."""
    engine = SpeculativeEngine(target, _FailOnce(where, error), EngineConfig(num_speculative_tokens=4,
                                                                             max_batch_size=3))
    other = None
    if where == "propose":
        other, _ = engine.add([40, 2, 40, 2], _greedy(30))
    params = _greedy(20)
    with pytest.raises(type(error)):
        if entry == "generate":
            engine.generate(PROMPTS[2], params)
        elif entry == "stream":
            for _ in engine.stream(PROMPTS[2], params):
                pass
        elif entry == "generate_batch":
            engine.generate_batch(PROMPTS[2:4], params)
        else:
            req, _ = engine.add(PROMPTS[2], params)
            while req.finish_reason is None:
                engine.step()
    assert engine.rows == []
    if other is not None:
        reason = "cancelled" if isinstance(error, KeyboardInterrupt) else "error"
        assert other.finish_reason == reason and type(error).__name__ in other.error
    plain = _engine(target, None)
    assert engine.generate(PROMPTS[2], params).token_ids == plain.generate(PROMPTS[2], params).token_ids
    assert [o.token_ids for o in engine.generate_batch(PROMPTS[3:6], params)] == \
        [plain.generate(p, params).token_ids for p in PROMPTS[3:6]]


class _FinishFails(NgramProposer):
    """An n-gram drafter whose cleanup (``finish``) raises once."""

    def __init__(self) -> None:
        super().__init__(NgramConfig(1, 3))
        self.failed = False

    def finish(self, ctx) -> None:
        super().finish(ctx)
        if not self.failed:
            self.failed = True
            raise RuntimeError("cleanup bug")


@pytest.mark.parametrize("how", ["finished", "abort", "running"])
def test_a_row_leaves_even_when_its_proposer_cleanup_raises(target, how):
    """A proposer whose ``finish`` raises: the error reaches the caller, and the row has left all the same (the
    server's cancel path calls ``abort``; a leaked row would hold its slot for good)."""
    engine = SpeculativeEngine(target, _FinishFails(), EngineConfig(num_speculative_tokens=3, max_batch_size=1))
    with pytest.raises(RuntimeError, match="cleanup bug"):
        if how == "finished":
            req, _ = engine.add(PROMPTS[2], _greedy(6))
            while req.finish_reason is None:
                engine.step()
        elif how == "abort":
            req, _ = engine.add(PROMPTS[2], _greedy(6))
            engine.abort(req)
        else:
            with engine.running(PROMPTS[2], _greedy(6)):
                engine.step()
    assert engine.rows == []
    assert engine.generate(PROMPTS[2], _greedy(6)).token_ids == _engine(target, None).generate(
        PROMPTS[2], _greedy(6)).token_ids


def test_a_stream_closed_early_frees_its_row_and_counts_what_it_committed(target, draft):
    engine = SpeculativeEngine(target, DraftModelProposer(draft), EngineConfig(num_speculative_tokens=3))
    stream = engine.stream(PROMPTS[3], _greedy(30))
    got = [t for _, out in zip(range(3), stream) for t in out.token_ids]
    stream.close()
    m = engine.last_output.metrics
    assert engine.rows == [] and engine.last_output.finish_reason == "stop"
    assert m.num_generated_tokens == len(got) and m.num_step_tokens == len(got) - 1
    assert m.num_target_forwards == m.num_verify_steps + 1 == 3


def test_abort_keeps_the_tokens_the_caller_delivers_and_counts_to_there(target):
    """``abort(keep=n)``: a front end that found a stop string n tokens in ends the request there; its tokens
    and every counter stop at n, running or already finished."""
    engine = SpeculativeEngine(target, DraftModelProposer(target), EngineConfig(num_speculative_tokens=4))
    whole = engine.generate(PROMPTS[2], _greedy(30, ignore_eos=True))
    req, _ = engine.add(PROMPTS[2], _greedy(30))
    engine.step()
    engine.step()  # draft == target: 1 + 5 + 5 tokens
    engine.abort(req, "stop", keep=8)
    assert engine.rows == [] and req.finish_reason == "stop"
    out = engine.output(req)
    m = out.metrics
    assert out.token_ids == whole.token_ids[:8] and m.num_generated_tokens == 8
    assert (m.num_verify_steps, m.num_step_tokens, m.num_drafted_tokens, m.num_accepted_tokens) == (2, 7, 6, 6)
    assert m.accepted_by_position == m.drafted_by_position == [2, 2, 1, 1] and m.num_target_forwards == 3
    done, _ = engine.add(PROMPTS[2], _greedy(9))  # finished by its token cap, then cut by the caller
    while done.finish_reason is None:
        engine.step()
    engine.abort(done, keep=3)
    assert done.finish_reason == "length" and engine.output(done).token_ids == whole.token_ids[:3]
    assert (done.metrics.num_verify_steps, done.metrics.num_accepted_tokens, done.metrics.num_step_tokens) == (1, 2, 2)


@pytest.mark.parametrize("prompt_len,max_new,needle", [(200, 100, "to at most 56"), (300, 10, "prompt to at most 246"),
                                                        (10, 400, "to at most 246"), (300, 300, "lower max_new_tokens below 256")])
def test_a_prompt_too_long_gets_advice_that_can_be_followed(prompt_len, max_new, needle):
    from specdecode.engine import check_prompt

    with pytest.raises(PromptTooLongError, match=needle):
        check_prompt([1] * prompt_len, SamplingParams(max_new_tokens=max_new), vocab_size=64, max_context=256)
