"""The sampling surface token for token: speculative decoding equals plain decoding (no proposer) under every
processor, greedily for every drafter and gamma, and in the coupled mode for seeded sampling; seeds that
mean the same text across engine state, drafters, policies and batches; acceptance near 100% when the draft
is the target; drafts that are always rejected; stops and caps inside an accepted block; extreme values.

Float64 tiny models (vocabulary 64) keep greedy near-ties out of reach of summation-order differences, so
"equal" is token for token. The standard mode (``coupled=False``) cannot give draft-independent text (its
random draws depend on the draft); it is held only to "the same request on the same engine state gives
the same text" (its output *law* is tested in ``test_sampling_surface.py``).

Negative controls: a sampler ignoring the draft path breaks greedy equality under a frequency penalty;
coupled noise keyed by the block breaks coupled equality; a draft q without the penalties loses acceptance.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specdecode.coupled import CoupledNoise
from specdecode.engine import EngineConfig, SpeculativeEngine
from specdecode.options import POLICY_NAMES
from specdecode.policy import build_policy
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
from specdecode.proposers.base import Proposer, ProposeContext, RowProposer
from specdecode.proposers.ngram import NgramConfig
from specdecode.sampling import RequestSampler, logits_to_probs
from specdecode.types import Draft, SamplingParams
from tiny import tiny_llama

PROMPTS = [[3, 4, 5, 3, 4, 5, 3, 4], [40, 2, 40, 2, 40], list(range(10, 22))]
LENGTH = 24


@pytest.fixture(scope="module")
def target4():
    """A 4-layer V = 64 target (layer-skip drafts with layers 1 and 2 skipped)."""
    return tiny_llama(vocab_size=64, seed=0, layers=4, scale=3.0)


DRAFTERS = {
    "ngram": lambda t, d: NgramProposer(NgramConfig(1, 3)),
    "suffix": lambda t, d: SuffixProposer(SuffixConfig()),
    "draft-model": lambda t, d: DraftModelProposer(d),
    "layer-skip": lambda t, d: LayerSkipProposer(t, LayerSkipConfig(skip_layers=(1, 2), min_confidence=0.0)),
    "tree-static": lambda t, d: TreeDraftProposer(d, TreeDraftConfig(kind="static", num_nodes=8)),
    "tree-dynamic": lambda t, d: TreeDraftProposer(d, TreeDraftConfig(kind="dynamic", num_nodes=8, top_k=3)),
}


def _engine(target, proposer=None, gamma: int = 3, batch: int = 8, policy=None) -> SpeculativeEngine:
    return SpeculativeEngine(target, proposer, EngineConfig(num_speculative_tokens=gamma, max_batch_size=batch),
                             policy=policy)


def _texts(engine: SpeculativeEngine, requests) -> list[list[int]]:
    return [o.token_ids for o in engine.generate_batch([p for p, _ in requests], [s for _, s in requests])]


@pytest.fixture(scope="module")
def processors(target4):
    """Greedy processing settings whose tokens are picked from the target's plain greedy outputs, so each
    changes the text: penalties, logit_bias, min_tokens (an EOS the plain text emits early), banned ids
    (its most frequent tokens), allowed ids, and a stop id it emits mid-way."""
    plain = _texts(_engine(target4), [(p, SamplingParams(max_new_tokens=LENGTH)) for p in PROMPTS])
    freq = sorted(range(64), key=lambda t: -sum(o.count(t) for o in plain))
    return {
        "penalties": dict(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.7),
        "logit_bias": dict(logit_bias={freq[0]: -100.0, freq[1]: -3.0, freq[5]: 2.5}),
        "min_tokens": dict(min_tokens=10, eos_token_ids=(plain[0][3],)),
        "banned": dict(banned_token_ids=(freq[0], freq[1])),
        "allowed": dict(allowed_token_ids=tuple(sorted({*range(0, 64, 3), freq[2]}))),
        "stop_ids": dict(stop_token_ids=(plain[1][6],)),
    }


def _requests(settings: dict, **extra) -> list[tuple[list[int], SamplingParams]]:
    return [(p, SamplingParams(max_new_tokens=LENGTH, **kw, **extra)) for kw in settings.values() for p in PROMPTS]


@pytest.fixture(scope="module")
def plain_greedy(target4, processors):
    requests = _requests(processors)
    return requests, _texts(_engine(target4), requests)


#: Seeded sampling settings of the coupled mode (greedy included: it draws nothing).
COUPLED = {
    "greedy-penalties": dict(temperature=0.0, frequency_penalty=0.6, logit_bias={7: 1.5}),
    "top_p-min_p": dict(temperature=1.0, top_p=0.9, min_p=0.05),
    "penalties": dict(temperature=0.8, repetition_penalty=1.4, presence_penalty=0.4, frequency_penalty=0.6),
    "everything": dict(temperature=1.2, top_k=12, top_p=0.95, min_p=0.02, frequency_penalty=0.5,
                       logit_bias={5: -100.0, 9: 1.0}, min_tokens=4, stop_token_ids=(11,)),
}


def _coupled_requests(seed0: int = 0) -> list[tuple[list[int], SamplingParams]]:
    return [(p, SamplingParams(max_new_tokens=LENGTH, seed=seed0 + i, coupled=True, **kw))
            for i, (kw, p) in enumerate((kw, p) for kw in COUPLED.values() for p in PROMPTS[:2])]


@pytest.fixture(scope="module")
def plain_coupled(target4):
    requests = _coupled_requests()
    return requests, _texts(_engine(target4), requests)


# --------------------------------------------------------------------------- 2. greedy equality


@pytest.mark.parametrize("gamma", [1, 3, 8])
@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_greedy_under_every_processor_equals_plain_decoding(target4, draft, plain_greedy, kind, gamma):
    """Penalties, logit_bias, min_tokens, banned / allowed ids, stop ids: speculative greedy == plain greedy."""
    requests, expected = plain_greedy
    engine = _engine(target4, DRAFTERS[kind](target4, draft), gamma)
    outs = engine.generate_batch([p for p, _ in requests], [s for _, s in requests])
    assert [o.token_ids for o in outs] == expected
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0  # drafts were kept: the test has teeth


def test_greedy_negative_control_a_sampler_ignoring_the_draft_path(target4, monkeypatch):
    """The target drafting for itself under a frequency penalty: with every position processed with the
    committed-only state, the accepted drafts are not what plain greedy decoding picks."""
    params = SamplingParams(max_new_tokens=LENGTH, frequency_penalty=1.5)
    expected = _texts(_engine(target4), [(p, params) for p in PROMPTS])
    original = RequestSampler.process
    monkeypatch.setattr(RequestSampler, "process",
                        lambda self, logits, paths: original(self, logits, [[]] * len(paths)))
    assert _texts(_engine(target4, DraftModelProposer(target4), 8), [(p, params) for p in PROMPTS]) != expected


#: The target emits 7 seventeen times after this prompt, then leaves it: a bias for 7 against its growing count.
REPEAT_PROMPT, REPEAT = [7] * 6, dict(frequency_penalty=0.5, logit_bias={7: 8.0})


def _count_once(monkeypatch) -> None:
    """The bug: a token repeated inside a draft path counted once (a ``set`` of the path's tokens)."""
    original = RequestSampler._penalise
    monkeypatch.setattr(RequestSampler, "_penalise",
                        lambda self, out, raw, paths: original(self, out, raw, [sorted(set(p)) for p in paths]))


@pytest.mark.parametrize("kind, broken", [("suffix", False), ("tree-dynamic", False), ("self-draft", False),
                                          ("self-draft", True)])
def test_greedy_with_a_token_repeated_inside_a_block(target4, draft, monkeypatch, kind, broken):
    """Drafts of ``7 7 7 ...`` (gamma 8) verified with the count of 7 growing along the block: plain greedy's
    text; the path's repeats counted once is caught (the target drafting for itself, whose block spans the
    seventeenth 7)."""
    params = SamplingParams(max_new_tokens=LENGTH, **REPEAT)
    expected = _texts(_engine(target4), [(REPEAT_PROMPT, params)])[0]
    assert expected[:17] == [7] * 17 and expected[17] != 7
    if broken:
        _count_once(monkeypatch)
    proposer = DraftModelProposer(target4) if kind == "self-draft" else DRAFTERS[kind](target4, draft)
    out = _engine(target4, proposer, 8, batch=1).generate(REPEAT_PROMPT, params)
    if broken:
        assert out.token_ids != expected
    else:
        assert out.token_ids == expected and out.metrics.num_accepted_tokens >= 8


# --------------------------------------------------------------------------- 3. seeds


@pytest.mark.parametrize("gamma", [1, 3, 8])
@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_coupled_speculative_equals_seeded_plain_decoding(target4, draft, plain_coupled, kind, gamma):
    """Coupled mode: seeded speculative == seeded plain decoding token for token, for every drafter and gamma,
    greedy and with top-p / min_p / penalties / biases / stops."""
    requests, expected = plain_coupled
    engine = _engine(target4, DRAFTERS[kind](target4, draft), gamma)
    outs = engine.generate_batch([p for p, _ in requests], [s for _, s in requests])
    assert [o.token_ids for o in outs] == expected
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0


def test_coupled_negative_control_noise_keyed_by_the_block(target4, draft, plain_coupled, monkeypatch):
    """A lost ``+ j`` in the target's noise positions: speculative text leaves plain decoding's."""
    requests, expected = plain_coupled
    original = CoupledNoise.choose
    monkeypatch.setattr(CoupledNoise, "choose",
                        lambda self, probs, positions: original(self, probs, [positions[0]] * len(positions)))
    assert _texts(_engine(target4, DraftModelProposer(draft), 3), requests) != expected


def test_standard_mode_is_not_draft_independent(target4, draft):
    """Why the coupled mode exists: in the standard mode the same seed gives another text with a drafter
    than without (the draws depend on the draft), while the coupled mode gives the same."""
    params = SamplingParams(temperature=1.0, max_new_tokens=LENGTH, seed=3, coupled=False)
    requests = [(p, params) for p in PROMPTS]
    assert _texts(_engine(target4, DraftModelProposer(draft)), requests) != _texts(_engine(target4), requests)


@pytest.mark.parametrize("coupled", [False, True])
def test_the_same_seeded_request_twice_with_others_in_between(target4, draft, coupled):
    """Same request, same engine: the same text, whatever ran between (other prompts, other seeds)."""
    engine = _engine(target4, DraftModelProposer(draft), 3, batch=4)
    params = SamplingParams(temperature=1.0, top_p=0.9, frequency_penalty=0.5, max_new_tokens=LENGTH, seed=11,
                            coupled=coupled)
    first = engine.generate(PROMPTS[0], params).token_ids
    _texts(engine, [(p, dataclasses.replace(params, seed=s)) for s, p in enumerate(PROMPTS * 2)])
    assert engine.generate(PROMPTS[0], params).token_ids == first


def test_coupled_text_survives_a_suffix_tree_that_learned_from_the_first_run(target4):
    """The suffix proposer's global tree learns a request's output when it leaves: the second run of the same
    seeded request drafts differently (from its own first output) and still gives the same text."""
    proposer = SuffixProposer(SuffixConfig())
    engine = _engine(target4, proposer, 8, batch=1)
    params = SamplingParams(temperature=1.0, min_p=0.05, presence_penalty=0.3, max_new_tokens=40, seed=5,
                            coupled=True)
    prompt = [50, 51, 52, 53]  # no repeats: the request's own trie has nothing to offer at first
    first = engine.generate(prompt, params)
    assert proposer.global_tree.num_documents == 1
    second = engine.generate(prompt, params)
    assert second.token_ids == first.token_ids == _texts(_engine(target4), [(prompt, params)])[0]
    assert second.metrics.num_accepted_tokens > first.metrics.num_accepted_tokens  # it learned


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_coupled_text_is_the_same_under_every_draft_length_policy(target4, draft, policy):
    """Adaptive policies change gamma from step to step (from the whole batch's history): the coupled text of
    a seeded request is still seeded plain decoding's, before and after other requests trained the policy."""
    proposer = DraftModelProposer(draft)
    engine = _engine(target4, proposer, 4, batch=4, policy=build_policy(policy, 4, proposer=proposer))
    params = SamplingParams(temperature=0.9, top_p=0.95, repetition_penalty=1.2, max_new_tokens=LENGTH, seed=21,
                            coupled=True)
    expected = _texts(_engine(target4), [(PROMPTS[1], params)])[0]
    assert engine.generate(PROMPTS[1], params).token_ids == expected
    _texts(engine, [(p, dataclasses.replace(params, seed=s)) for s, p in enumerate(PROMPTS * 2)])
    assert engine.generate(PROMPTS[1], params).token_ids == expected


@pytest.mark.parametrize("coupled", [False, True])
def test_a_seeded_request_alone_and_among_seven_other_rows(target4, draft, coupled):
    """Batch size 1 and 8: the same text (the coupled mode under the heuristic policy too, whose gamma follows
    the whole batch; the standard mode with the fixed policy, whose draws per row do not depend on it)."""
    params = SamplingParams(temperature=1.0, min_p=0.05, frequency_penalty=0.4, max_new_tokens=LENGTH, seed=8,
                            coupled=coupled)
    others = [(p, SamplingParams(max_new_tokens=LENGTH - 3 * i, temperature=0.7 * (i % 2), seed=100 + i))
              for i, p in enumerate((PROMPTS * 3)[:7])]
    policies = [None, "heuristic"] if coupled else [None]
    for name in policies:
        make = (lambda: build_policy(name, 3)) if name else (lambda: None)
        alone = _engine(target4, DraftModelProposer(draft), 3, batch=1, policy=make()).generate(PROMPTS[2], params)
        batch = _engine(target4, DraftModelProposer(draft), 3, batch=8, policy=make())
        outs = batch.generate_batch([PROMPTS[2]] + [p for p, _ in others], [params] + [s for _, s in others])
        assert outs[0].token_ids == alone.token_ids, name


# --------------------------------------------------------------------------- 4. acceptance


def _acceptance(outs) -> float:
    drafted = sum(o.metrics.num_drafted_tokens for o in outs)
    return sum(o.metrics.num_accepted_tokens for o in outs) / drafted


@pytest.mark.parametrize("coupled", [False, True])
def test_the_target_drafting_for_itself_is_accepted_at_temperature_one_with_penalties(target4, coupled):
    """q == p: every draft token is kept (standard: min(1, p/q) = 1; coupled: both pick with the same noise),
    with penalties, a bias and top-p on; a q computed without the penalties is kept far less often."""
    params = SamplingParams(temperature=1.0, top_p=0.95, repetition_penalty=1.3, frequency_penalty=0.8,
                            presence_penalty=0.3, logit_bias={4: 2.0}, max_new_tokens=LENGTH, coupled=coupled)
    requests = [(p, dataclasses.replace(params, seed=s)) for s, p in enumerate(PROMPTS * 2)]
    outs = _engine(target4, DraftModelProposer(target4), 4).generate_batch([p for p, _ in requests],
                                                                         [s for _, s in requests])
    assert _acceptance(outs) > 0.99
    with pytest.MonkeyPatch.context() as mp:  # negative control: the draft's q without the penalties
        mp.setattr(ProposeContext, "draft_dist", lambda self, logits, path=(): logits_to_probs(logits, self.params))
        raw = _engine(target4, DraftModelProposer(target4), 4).generate_batch([p for p, _ in requests],
                                                                              [s for _, s in requests])
    assert _acceptance(raw) < 0.9


class _Wrong(RowProposer):
    """Chains of one token every step: ``token`` when given, else a token the target never picks greedily."""

    name = "wrong"

    def __init__(self, target, token: int | None = None):
        self.target, self.token = target, token

    @torch.inference_mode()
    def propose_row(self, ctx, max_tokens):
        if self.token is not None:
            tok = self.token
        else:
            logits = self.target(input_ids=torch.tensor([ctx.token_ids])).logits[0, -1]
            processed = ctx.sampler.process(logits.unsqueeze(0), [[]])[0]
            tok = int(processed.argsort()[0])  # the least likely: never the argmax
        return Draft.chain(torch.full((1, max_tokens), tok, dtype=torch.int64))


class _BannedTree(Proposer):
    """Token trees whose every node is a banned token (trees are not cut: verification must reject them)."""

    name = "banned-tree"
    produces_trees = True

    def __init__(self, tokens):
        self.tokens = tokens

    def propose(self, batch, max_tokens):
        out = []
        for k in max_tokens:
            toks, parents = [], []
            for depth in range(k):
                for j, t in enumerate(self.tokens):
                    toks.append(t)
                    parents.append(-1 if depth == 0 else (depth - 1) * len(self.tokens))
            out.append(Draft(torch.tensor([toks], dtype=torch.int64), torch.tensor([parents], dtype=torch.int64))
                       if k else Draft.empty())
        return out


@pytest.mark.parametrize("coupled", [False, True])
def test_drafts_that_are_always_rejected_still_give_plain_decodings_text(target4, processors, coupled):
    """A chain of the least likely token under top_k = 1 (target probability 0; the text is then the greedy
    text), a chain of a banned token (cut before verification: nothing drafted), and token trees of banned
    tokens (verified and rejected): the text is plain decoding's, with no token accepted."""
    banned = processors["banned"]["banned_token_ids"]
    cases = [
        (_Wrong(target4), dict(top_k=1, frequency_penalty=0.5), True),
        (_Wrong(target4, banned[0]), dict(top_p=0.9, banned_token_ids=banned), False),
        (_BannedTree(banned), dict(top_p=0.9, banned_token_ids=banned), True),
    ]
    for proposer, kw, verified in cases:
        params = SamplingParams(temperature=1.0, max_new_tokens=16, coupled=coupled, **kw)
        requests = [(p, dataclasses.replace(params, seed=s)) for s, p in enumerate(PROMPTS)]
        outs = _engine(target4, proposer, 3).generate_batch([p for p, _ in requests], [s for _, s in requests])
        if kw.get("top_k") == 1:  # deterministic: the greedy text with the same processing
            greedy = [(p, dataclasses.replace(s, temperature=0.0)) for p, s in requests]
            expected = _texts(_engine(target4), greedy)
        elif coupled or not verified:  # (cut drafts leave plain decoding steps, draws included)
            expected = _texts(_engine(target4), requests)
        else:
            expected = None  # standard mode, verified trees: the draws depend on the draft
        if expected is not None:
            assert [o.token_ids for o in outs] == expected, type(proposer).__name__
        assert all(not set(o.token_ids) & set(banned) for o in outs) or kw.get("top_k") == 1
        assert sum(o.metrics.num_accepted_tokens for o in outs) == 0
        drafted = sum(o.metrics.num_drafted_tokens for o in outs)
        assert (drafted > 0) if verified else (drafted == 0), type(proposer).__name__


@pytest.mark.parametrize("gamma", [1, 8])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_caps_and_stops_inside_an_accepted_block(target4, gamma, temperature):
    """The target drafting for itself (every block kept): max_new_tokens, an EOS, a stop id, and an EOS masked
    by min_tokens inside a block cut the text exactly where plain decoding does (coupled mode when sampled)."""
    base = SamplingParams(temperature=temperature, frequency_penalty=0.3, max_new_tokens=LENGTH, seed=4,
                          coupled=True)
    prompt = PROMPTS[0]
    full = _texts(_engine(target4), [(prompt, base)])[0]
    f = next(i for i in range(2, 10) if full[i] not in full[:i])  # a token first emitted at position f
    variants = {
        "length": dict(max_new_tokens=f + 1),
        "eos": dict(eos_token_ids=(full[f],)),
        "stop_id": dict(stop_token_ids=(full[f],)),
        "min_tokens": dict(eos_token_ids=(full[f],), min_tokens=f + 3),
    }
    spec = _engine(target4, DraftModelProposer(target4), gamma, batch=1)
    for name, kw in variants.items():
        params = dataclasses.replace(base, **kw)
        expected = _texts(_engine(target4), [(prompt, params)])[0]
        out = spec.generate(prompt, params)
        assert out.token_ids == expected, name
        if name != "min_tokens":
            assert expected == full[: f + 1] and out.finish_reason == ("length" if name == "length" else "stop")
            assert out.metrics.num_accepted_tokens <= f
        else:
            assert full[f] not in expected[: f + 3]


@pytest.mark.parametrize("kind", [None, "ngram", "draft-model"])
def test_min_tokens_yields_when_only_stop_tokens_are_allowed(target4, draft, kind):
    """allowed_token_ids = the stop tokens, with min_tokens: the request stops at once rather than generate a
    token it does not allow (the sampler used to fall back to the raw logits there: any token), plainly and
    speculatively, greedy and sampled in both modes; with one other token allowed it waits for min_tokens."""
    proposer = None if kind is None else DRAFTERS[kind](target4, draft)
    engine = _engine(target4, proposer, 3)
    for mode in (dict(), dict(temperature=1.0, seed=1, coupled=False), dict(temperature=1.0, seed=1, coupled=True)):
        only_stop = SamplingParams(max_new_tokens=8, allowed_token_ids=(5,), eos_token_ids=(5,), min_tokens=3, **mode)
        waits = SamplingParams(max_new_tokens=8, allowed_token_ids=(5, 6), stop_token_ids=(5,), min_tokens=4,
                               logit_bias={5: 100.0}, **mode)
        outs = _texts(engine, [(p, only_stop) for p in PROMPTS] + [(p, waits) for p in PROMPTS])
        assert outs == [[5]] * 3 + [[6, 6, 6, 6, 5]] * 3, mode


# --------------------------------------------------------------------------- 6. extreme values


@pytest.mark.parametrize("coupled", [False, True])
@pytest.mark.parametrize("kind", ["ngram", "draft-model"])
def test_extreme_values(target4, draft, kind, coupled):
    """temperature 1e-40, min_p 1.0 and top_k 1 are greedy (no NaN); logit_bias of -100 on all tokens but one
    gives that token only; repetition_penalty 100 equals plain decoding (coupled) or stays finite (standard)."""
    greedy_kw = dict(frequency_penalty=0.5)
    as_greedy = [dict(temperature=1e-40), dict(temperature=1.0, min_p=1.0), dict(temperature=0.7, top_k=1)]
    greedy = _texts(_engine(target4), [(p, SamplingParams(max_new_tokens=LENGTH, **greedy_kw)) for p in PROMPTS])
    for kw in as_greedy:
        params = SamplingParams(max_new_tokens=LENGTH, seed=1, coupled=coupled, **greedy_kw, **kw)
        assert _texts(_engine(target4, DRAFTERS[kind](target4, draft)), [(p, params) for p in PROMPTS]) == greedy, kw
    only = SamplingParams(temperature=1.0, max_new_tokens=12, seed=2, coupled=coupled,
                          logit_bias={t: -100.0 for t in range(64) if t != 17})
    assert _texts(_engine(target4, DRAFTERS[kind](target4, draft)), [(p, only) for p in PROMPTS]) == [[17] * 12] * 3
    harsh = [(p, SamplingParams(temperature=t, repetition_penalty=100.0, max_new_tokens=LENGTH, seed=3,
                                coupled=coupled)) for p in PROMPTS for t in (0.0, 1.0)]
    got = _texts(_engine(target4, DRAFTERS[kind](target4, draft)), harsh)
    assert all(len(g) == LENGTH and all(0 <= t < 64 for t in g) for g in got)
    plain = _texts(_engine(target4), harsh)
    assert [g for g, (_, s) in zip(got, harsh) if s.greedy or coupled] == \
        [g for g, (_, s) in zip(plain, harsh) if s.greedy or coupled]


def test_extreme_temperatures_give_finite_distributions():
    """1e-40 is the one-hot of the argmax (ties share it), 100 is nearly uniform; never NaN."""
    logits = torch.tensor([[3.0, 1.0, -2.0, 3.0 - 1e-3], [0.0, 0.0, -80.0, 10.0]])
    cold = logits_to_probs(logits, SamplingParams(temperature=1e-40))
    assert torch.isfinite(cold).all() and cold.tolist() == [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]
    hot = logits_to_probs(logits, SamplingParams(temperature=100.0, min_p=0.5))
    assert torch.isfinite(hot).all() and hot[0].min() > 0.2 and hot[1, 2] == 0.0
    sampler = RequestSampler(SamplingParams(temperature=1e-40, repetition_penalty=100.0), [0, 3], 4)
    assert sampler.probs(logits, [[], [1]]).argmax(-1).tolist() == [1, 3]  # 3: 10 / 100 beats 0 * 100
