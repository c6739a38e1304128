"""The sampling surface is lossless: speculative samples follow the exact law of plain decoding with the
request's processing (penalties, logit_bias, min_p, top-k, top-p, allowed / banned ids, min_tokens, stop ids).

The law comes from ``tests/sampling_oracle.py``, an independent float64 re-implementation of the rules
applied step by step along every prefix (penalties depend on the prefix). Samples go through the batched
``SpeculativeEngine`` (rows of 64, seeds 0..n-1) and a chi-square test (p > 1e-3) compares the first N
tokens with that law. A request runs gamma + 2 tokens (its first block drafts a full gamma) and is cut once
it holds N tokens; N = 3 (V = 5) sees draft positions 0 and 1 of the first block, N = 4 also depth-2 tree
nodes, and a vocabulary-3 test sees all nine tokens of a gamma-8 request.

Modes: the standard mode (``coupled=False``: token-level rejection sampling for deterministic drafters,
block verification for sampling drafters by default, ``:token`` forcing token level, multi-candidate
verification for trees) across drafters and gammas; the coupled mode (``coupled=True``) is tested once
here with the chi-square and an exact match with coupled plain decoding (it is draft-independent token
for token for every drafter and gamma: ``test_sampling_surface_exact.py``).

Negative controls fail (p < 1e-3): every position processed with the committed-only penalty state (the
draft path ignored; both modes), tree nodes processed with a wrong path, coupled noise keyed by the block
instead of the position. A draft q computed *without* the penalties is no such control: the verifier
sees the law the draft token was drawn from, so it stays lossless and only acceptance drops (tested).
"""

from __future__ import annotations

import dataclasses
import itertools
import types

import numpy as np
import pytest
import torch

from specdecode.coupled import CoupledNoise
from specdecode import engine as engine_module
from specdecode.engine import EngineConfig, SpeculativeEngine
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
from specdecode.proposers.base import ProposeContext
from specdecode.proposers.ngram import NgramConfig
from specdecode.sampling import RequestSampler, logits_to_probs
from specdecode.types import SamplingParams
from sampling_oracle import outcome_index, process, processed_joint, processed_law
from tiny import chi2_pvalue, exact_joint, tiny_llama

VOCAB = 5
N = 3  # observed tokens: the prefill's, then draft positions 0 and 1 of the first block (paths [] and [x1])
PROMPT = [1, 2, 0, 1, 2, 0, 1, 2]  # repeats: the n-gram and suffix drafters find continuations
BATCH = 64


@pytest.fixture(scope="module")
def models():
    """Vocabulary-5 models: a 1-layer target and draft, and a 4-layer target whose layers matter (skipping
    two changes the draft) for the layer-skip drafter."""
    deep = tiny_llama(vocab_size=VOCAB, seed=3, layers=4, hidden=32, scale=4.0)
    with torch.no_grad():
        for layer in deep.model.layers:
            layer.mlp.down_proj.weight.mul_(4.0)
            layer.self_attn.o_proj.weight.mul_(4.0)
    return {"target": tiny_llama(vocab_size=VOCAB, seed=3, layers=1, hidden=32, scale=4.0),
            "draft": tiny_llama(vocab_size=VOCAB, seed=4, layers=1, hidden=32, scale=4.0), "deep": deep}


DRAFTERS = {
    "ngram": lambda t, d: NgramProposer(NgramConfig(1, 3)),
    "suffix": lambda t, d: SuffixProposer(SuffixConfig(min_token_prob=0.0)),  # its global tree learns across samples
    "draft-model": lambda t, d: DraftModelProposer(d),
    "layer-skip": lambda t, d: LayerSkipProposer(t, LayerSkipConfig(skip_layers=(1, 2), min_confidence=0.0)),
    "tree-static": lambda t, d: TreeDraftProposer(d, TreeDraftConfig(kind="static", num_nodes=8)),
    "tree-dynamic": lambda t, d: TreeDraftProposer(d, TreeDraftConfig(kind="dynamic", num_nodes=8, top_k=3)),
}

#: Every parameter alone (temperature 1 unless it is the parameter).
ALONE = {
    "temperature": dict(temperature=0.6),
    "top_k": dict(top_k=2),
    "top_p": dict(top_p=0.7),
    "min_p": dict(min_p=0.15),
    "repetition": dict(repetition_penalty=2.5),
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=1.2),
    "logit_bias": dict(logit_bias={0: 2.0, 3: -100.0, 4: -1.0}),
    "allowed": dict(allowed_token_ids=(0, 2, 3)),
    "banned": dict(banned_token_ids=(1,)),
    "min_tokens": dict(min_tokens=2, eos_token_ids=(3,)),
    "stop_ids": dict(stop_token_ids=(4,)),
    "temperature_100": dict(temperature=100.0),  # extreme values (the others are exact: test_sampling_surface_exact)
    "repetition_100": dict(repetition_penalty=100.0),
}

#: The combination: penalties + top-p + min_p + logit_bias (a ban included) + min_tokens with a stop id.
COMBO = dict(temperature=0.9, top_p=0.9, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.3,
             frequency_penalty=0.8, logit_bias={0: 1.0, 4: -100.0}, min_tokens=1, stop_token_ids=(3,))


def _params(gamma: int, coupled: bool, **kw) -> SamplingParams:
    """A sampled request long enough for a full first block of ``gamma`` drafts."""
    return SamplingParams(max_new_tokens=gamma + 2, coupled=coupled, **{"temperature": 1.0, **kw})


def _engine(target, kind: str | None, gamma: int, draft=None) -> SpeculativeEngine:
    """An engine of 64 rows; ``kind`` names a drafter, with ``:token`` for token-level verification of a
    sampling drafter's chains (the engine's "auto" verifies them with block verification)."""
    kind, _, verification = (kind or "").partition(":")
    proposer = DRAFTERS[kind](target, draft) if kind else None
    return SpeculativeEngine(target, proposer, EngineConfig(num_speculative_tokens=gamma, max_batch_size=BATCH,
                                                            verification=verification or "auto"))


def _run(engine: SpeculativeEngine, prompt, params: SamplingParams, samples: int, n: int = N, seeded: bool = True):
    """The first ``n`` tokens (cut after a stop token) of seeded requests, seeds 0..samples-1 (``seeded``
    False: unseeded, each drawing a fresh seed), decoded in batches of up to 64 rows; and (tokens drafted, acceptance rate). A request is aborted once it holds
    ``n`` tokens: when to stop looking depends on nothing but the count, so the first ``n`` keep their law."""
    waiting, reqs = list(range(samples))[::-1], {}
    while waiting or engine.rows:
        while waiting and len(engine.rows) < engine.max_batch_size:
            seed = waiting.pop()
            reqs[seed] = engine.add(prompt, dataclasses.replace(params, seed=seed) if seeded else params)[0]
        engine.step()
        for row in [r for r in engine.rows if len(r.generated) >= n]:
            engine.abort(row)
    stops = set(params.stop_ids)
    seqs = []
    for seed in range(samples):
        seq = []
        for tok in reqs[seed].generated[:n]:
            seq.append(tok)
            if tok in stops:
                break
        seqs.append(tuple(seq))
    drafted = sum(r.metrics.num_drafted_tokens for r in reqs.values())
    accepted = sum(r.metrics.num_accepted_tokens for r in reqs.values())
    return seqs, drafted, accepted / max(drafted, 1)


def _pvalue(seqs, target, prompt, params, n: int = N) -> float:
    counts = np.bincount([outcome_index(s, n, VOCAB) for s in seqs], minlength=(VOCAB + 1) ** n)
    return chi2_pvalue(counts, processed_joint(target, prompt, params, n))


def _check(models, kind: str, gamma: int, params: SamplingParams, samples: int, prompt=PROMPT, n: int = N,
           seeded: bool = True):
    """Chi-square p-value of speculative samples against the exact law, and the acceptance rate."""
    target = models["deep" if kind == "layer-skip" else "target"]
    seqs, drafted, rate = _run(_engine(target, kind, gamma, models["draft"]), prompt, params, samples, n, seeded)
    assert drafted > samples // 2, (kind, drafted)  # the drafts really ran
    return _pvalue(seqs, target, prompt, params, n), rate


# --------------------------------------------------------------------------- the oracle itself


def test_the_oracle_and_the_request_sampler_agree_on_random_contexts(models):
    """The float64 oracle and ``RequestSampler.probs`` give the same distribution on random logits, prompts,
    committed tokens and draft paths, for every parameter alone and combined (an exact check before the
    statistical ones); with no processing the oracle is the target's plain joint."""
    rng = np.random.default_rng(0)
    v = 7
    cases = [*ALONE.values(), COMBO, dict(top_k=3, top_p=0.8, min_p=0.1, frequency_penalty=-0.5,
                                          presence_penalty=-1.0, repetition_penalty=0.7),
             # min_tokens yields where the other masks leave only stop tokens
             dict(allowed_token_ids=(2, 4), stop_token_ids=(2,), eos_token_ids=(4,), min_tokens=3),
             dict(logit_bias={t: -100.0 for t in range(6)}, stop_token_ids=(6,), min_tokens=3),
             dict(allowed_token_ids=(1, 3), eos_token_ids=(3,), min_tokens=2, frequency_penalty=0.5)]
    for kw in cases:
        params = SamplingParams(**{"temperature": 1.0, **kw})
        for trial in range(6):
            prompt = rng.integers(0, v, 5).tolist()
            committed = rng.integers(0, v, trial % 3).tolist()
            path = rng.integers(0, v, trial % 4).tolist()
            sampler = RequestSampler(params, prompt, v)
            sampler.commit(committed)
            raw = torch.tensor(rng.normal(0, 2.0, (1, v)))
            got = sampler.probs(raw, [path])[0].double().numpy()
            want = process(raw[0].numpy(), prompt, committed + path, params)
            np.testing.assert_allclose(got, want, atol=1e-6, err_msg=str((kw, prompt, committed, path)))
    plain = processed_joint(models["target"], PROMPT, SamplingParams(temperature=1.0), N)
    plain = plain.reshape((VOCAB + 1,) * N)[(slice(0, VOCAB),) * N].reshape(-1)
    np.testing.assert_allclose(plain, exact_joint(models["target"], PROMPT, N), atol=1e-6)


# --------------------------------------------------------------------------- every parameter alone


@pytest.mark.parametrize("name", list(ALONE))
def test_each_parameter_alone_is_lossless(models, name):
    """Draft model, gamma 2, standard rejection sampling: every parameter alone follows the exact law."""
    n = 2 if name == "temperature_100" else N  # nearly uniform: 25 outcomes, so each is expected 5 times or more
    p, _ = _check(models, "draft-model", 2, _params(2, False, **ALONE[name]), 350, n=n)
    assert p > 1e-3, (name, p)


# --------------------------------------------------------------------------- the combination


@pytest.mark.parametrize("kind", [*(k if k in ("ngram", "suffix", "draft-model", "layer-skip") else
                                    pytest.param(k, marks=pytest.mark.slow) for k in DRAFTERS),
                                  pytest.param("draft-model:token", marks=pytest.mark.slow)])
def test_the_combination_is_lossless_for_every_drafter(models, kind, monkeypatch):
    """Penalties + top-p + min_p + logit_bias + min_tokens + a stop id, gamma 3, standard mode: token-level
    verification (n-gram, suffix, ``:token``), block verification (the sampling drafters' auto), token trees
    (4 tokens observed, so depth-2 nodes' own paths count). The coupled mode is draft-independent token for
    token (``test_sampling_surface_exact.py``), so one drafter stands for all below. Suffix decoding's
    requests are unseeded (their fresh seeds drawn from a fixed sequence here): a seeded standard-mode
    request does not draft from the global tree, and its drafts must be covered too."""
    tree = kind.startswith("tree")
    seeded = kind != "suffix"
    if not seeded:
        draws = itertools.count(1)
        monkeypatch.setattr(engine_module, "secrets", types.SimpleNamespace(randbits=lambda bits: next(draws)))
    p, _ = _check(models, kind, 3, _params(3, False, **COMBO), 450 if tree else 500, n=4 if tree else N,
                  seeded=seeded)
    assert p > 1e-3, (kind, p)


@pytest.mark.slow
def test_the_combination_is_lossless_in_the_coupled_mode(models):
    """Coupled mode, draft model, gamma 3: the samples follow the exact law, and each is the coupled plain
    decoding of its seed token for token (so every drafter gives these very counts)."""
    params = _params(3, True, **COMBO)
    spec, drafted, _ = _run(_engine(models["target"], "draft-model", 3, models["draft"]), PROMPT, params, 600)
    plain, _, _ = _run(_engine(models["target"], None, 3), PROMPT, params, 600)
    assert drafted > 600 and spec == plain
    p = _pvalue(spec, models["target"], PROMPT, params)
    assert p > 1e-3, p


@pytest.mark.parametrize("kind", ["ngram", "draft-model", "draft-model:token"])
def test_the_combination_is_lossless_at_gamma_one(models, kind):
    """Gamma 1 (3 above, 8 below) on a deterministic and a sampling drafter."""
    p, _ = _check(models, kind, 1, _params(1, False, **COMBO), 500)
    assert p > 1e-3, (kind, p)


# --------------------------------------------------------------------------- a whole block of eight

#: Vocabulary 3: the law of 9 tokens is enumerable, so a whole first block of 8 drafts is observed.
DEEP = dict(temperature=0.9, top_p=0.95, repetition_penalty=1.3, presence_penalty=0.2, frequency_penalty=0.5,
            logit_bias={0: 0.5})


@pytest.fixture(scope="module")
def deep_pair():
    """A vocabulary-3 target and a draft close to it (its LM head perturbed), so blocks of 8 are often kept deep."""
    tgt = tiny_llama(vocab_size=3, seed=5, layers=1, hidden=32, scale=3.0)
    drf = tiny_llama(vocab_size=3, seed=5, layers=1, hidden=32, scale=3.0)
    with torch.no_grad():
        drf.lm_head.weight.add_(0.3 * torch.randn(drf.lm_head.weight.shape, generator=torch.Generator().manual_seed(1),
                                                  dtype=drf.lm_head.weight.dtype))
    return tgt, drf


@pytest.mark.parametrize("kind", ["ngram", pytest.param("draft-model", marks=pytest.mark.slow)])
def test_a_block_of_eight_is_lossless_to_its_last_token(deep_pair, kind):
    """Gamma 8, 9 tokens per request: the law of the last three (x7, x8 verified with paths of 6 and 7 draft
    tokens, x9 the bonus when all are kept) under penalties, bias and top-p; standard rejection sampling (the
    coupled mode equals plain decoding token for token at gamma 8: ``test_sampling_surface_exact.py``)."""
    tgt, drf = deep_pair
    params = SamplingParams(max_new_tokens=9, coupled=False, **DEEP)
    prompt = [0, 1, 2, 0, 1, 2, 0, 1]
    seqs, drafted, rate = _run(_engine(tgt, kind, 8, drf), prompt, params, 400, n=9)
    assert drafted > 1200, drafted
    counts = np.bincount([int(np.ravel_multi_index(s[6:], (3,) * 3)) for s in seqs], minlength=27)
    law = processed_law(tgt, prompt, params, 9, key=lambda s: int(np.ravel_multi_index(s[6:], (3,) * 3)))
    p = chi2_pvalue(counts, [law.get(i, 0.0) for i in range(27)])
    assert p > 1e-3, (p, rate)


# --------------------------------------------------------------------------- negative and positive controls

#: A repetitive prompt and a strong frequency penalty on the token the n-gram drafter repeats inside a block.
REPEAT_PROMPT = [2, 2, 2, 2, 2, 2]
REPEAT = dict(frequency_penalty=2.0, logit_bias={2: 5.0})


def _committed_only(monkeypatch) -> None:
    """The bug: every verified position processed with the committed tokens' penalty state (paths ignored)."""
    original = RequestSampler.process
    monkeypatch.setattr(RequestSampler, "process",
                        lambda self, logits, paths: original(self, logits, [[]] * len(paths)))


@pytest.mark.parametrize("coupled", [False, True])
@pytest.mark.parametrize("broken", [False, True])
def test_a_penalty_repeated_inside_a_block_and_its_negative_control(models, monkeypatch, coupled, broken):
    """N-gram drafts of ``2 2 2`` under a strong frequency penalty: lossless when each position counts the draft
    tokens before it; the committed-only penalty state is caught (p < 1e-3) in both modes."""
    if broken:
        _committed_only(monkeypatch)
    p, rate = _check(models, "ngram", 3, _params(3, coupled, **REPEAT), 300 if broken else 600, REPEAT_PROMPT)
    assert (p < 1e-3) if broken else (p > 1e-3), (p, rate)


@pytest.mark.parametrize("broken", [False, True])
@pytest.mark.parametrize("kind", ["tree-static", pytest.param("tree-dynamic", marks=pytest.mark.slow)])
def test_tree_nodes_processed_with_their_own_paths_and_the_negative_control(models, monkeypatch, kind, broken):
    """Token trees under the repeated-token penalty, 4 tokens observed: lossless with each node processed
    with its own root path; a node at depth 2 given its parent's path without the parent's token (a
    ``paths[p]`` for ``paths[p + 1]``) is caught."""
    if broken:
        def tree_paths(tokens, parents):
            paths = [[]]
            for t, p in zip(tokens, parents):
                paths.append(paths[max(int(p), 0)] + [int(t)])
            return paths

        monkeypatch.setattr(engine_module, "tree_paths", tree_paths)
    p, _ = _check(models, kind, 3, _params(3, False, **REPEAT), 400, REPEAT_PROMPT, n=4)
    assert (p < 1e-3) if broken else (p > 1e-3), p


def test_coupled_noise_keyed_by_the_block_is_caught(models, monkeypatch):
    """Negative control of the coupled mode: the target's noise for every position of a block taken from the
    block's first position (a lost ``+ j``) makes a block's tokens repeat: p < 1e-3."""
    original = CoupledNoise.choose
    monkeypatch.setattr(CoupledNoise, "choose",
                        lambda self, probs, positions: original(self, probs, [positions[0]] * len(positions)))
    p, _ = _check(models, "draft-model", 3, _params(3, True, temperature=2.0), 500)
    assert p < 1e-3, p


def test_a_draft_q_without_the_penalties_is_still_lossless(models, monkeypatch):
    """Positive control: a drafter that ignores penalties and biases draws from another q and reports that q:
    verification stays lossless, only acceptance drops. (So it is no negative control.)"""
    params = _params(3, False, **REPEAT)
    _, rate_processed = _check(models, "draft-model", 3, params, 200, REPEAT_PROMPT)
    monkeypatch.setattr(ProposeContext, "draft_dist",
                        lambda self, logits, path=(): logits_to_probs(logits, self.params))
    p, rate_raw = _check(models, "draft-model", 3, params, 600, REPEAT_PROMPT)
    assert p > 1e-3, p
    assert rate_raw < rate_processed - 0.1, (rate_raw, rate_processed)
