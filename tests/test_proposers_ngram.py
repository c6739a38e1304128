"""Prompt lookup (``specdecode.proposers.ngram``): the match, the most recent occurrence, the cut at
max_tokens, the longest n-gram first, the per-request index, and losslessness through the engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdecode.engine import EngineConfig, SpeculativeEngine
from specdecode.proposers.base import ProposeContext
from specdecode.proposers.ngram import NgramConfig, NgramIndex, NgramProposer, find_continuation
from specdecode.types import SamplingParams, SpecDecodeError
from tiny import check_index_rebuild, tiny_llama


def _ctx(tokens):
    return ProposeContext(list(tokens), len(tokens), SamplingParams(), torch.Generator().manual_seed(0), 64)


def _propose(proposer, ctx, k):
    return proposer.propose([ctx], [k])[0].token_ids[0].tolist()


# --------------------------------------------------------------------------- find_continuation


def test_ngram_lookup_finds_most_recent_continuation():
    toks = np.array([1, 2, 3, 9, 1, 2, 4, 5, 1, 2])
    assert find_continuation(toks, 2, 3).tolist() == [4, 5, 1]
    assert find_continuation(toks, 3, 3).tolist() == []
    assert find_continuation(np.array([7]), 1, 3).tolist() == []


def test_continuation_is_cut_at_max_tokens_and_at_the_end_of_the_context():
    toks = np.array([4, 5, 6, 7, 8, 4, 5])
    assert find_continuation(toks, 2, 1).tolist() == [6]
    assert find_continuation(toks, 2, 2).tolist() == [6, 7]
    assert find_continuation(toks, 2, 10).tolist() == [6, 7, 8, 4, 5]  # up to the context's end
    assert find_continuation(toks, 2, 0).tolist() == []
    # a match right before the suffix continues into the suffix itself (overlap): 3 3 3 -> 3 3
    assert find_continuation(np.array([3, 3, 3]), 1, 5).tolist() == [3]
    assert find_continuation(np.array([3, 3, 3, 3]), 2, 5).tolist() == [3]


def test_the_suffix_itself_is_never_its_own_match():
    toks = np.array([1, 2, 3, 4])
    for n in (1, 2, 3):
        assert find_continuation(toks, n, 4).tolist() == []
    assert find_continuation(np.array([1, 2]), 2, 3).tolist() == []  # len <= n: nothing before it
    cont = find_continuation(np.array([9, 1, 2, 9]), 1, 2)
    assert cont.tolist() == [1, 2] and cont.dtype == np.int64


# --------------------------------------------------------------------------- the proposer


def test_longest_ngram_wins_over_a_more_recent_shorter_match():
    # the 2-gram (5, 6) last occurred before 7; the 1-gram (6) last occurred before 9
    proposer = NgramProposer(NgramConfig(1, 2))
    ctx = _ctx([5, 6, 7, 1, 6, 9, 5, 6])
    proposer.start(ctx)
    assert _propose(proposer, ctx, 2) == [7, 1]
    unigram = NgramProposer(NgramConfig(1, 1))
    unigram.start(ctx)
    assert _propose(unigram, ctx, 2) == [9, 5]


def test_min_ngram_is_respected_and_no_match_gives_an_empty_chain():
    proposer = NgramProposer(NgramConfig(2, 3))
    ctx = _ctx([1, 2, 3, 9, 3])  # only a 1-gram (3) matches
    proposer.start(ctx)
    draft = proposer.propose([ctx], [4])[0]
    assert draft.num_tokens == 0 and draft.token_ids.shape == (1, 0)
    assert proposer.propose([ctx], [0])[0].num_tokens == 0  # max_tokens 0: nothing asked


def test_drafts_are_deterministic_chains():
    proposer = NgramProposer()
    ctx = _ctx([1, 2, 3, 4, 1, 2])
    proposer.start(ctx)
    draft = proposer.propose([ctx], [3])[0]
    assert draft.token_ids.tolist() == [[3, 4, 1]] and draft.token_ids.dtype == torch.int64
    assert draft.parents.tolist() == [[-1, 0, 1]] and draft.draft_probs is None  # q is one-hot


@pytest.mark.parametrize("bad", [(0, 3), (3, 2), (-1, 1)])
def test_ngram_sizes_are_validated(bad):
    with pytest.raises(SpecDecodeError, match="min_ngram <= max_ngram"):
        NgramConfig(*bad)


def test_lookup_indexes_are_rebuilt_when_the_context_is_replaced_or_cut():
    proposer = NgramProposer(NgramConfig(1, 3))
    ctx = _ctx([10, 11, 12, 13, 10, 11])
    check_index_rebuild(proposer, ctx)


def test_index_follows_a_same_length_rewrite_and_appends_incrementally():
    proposer = NgramProposer(NgramConfig(1, 1))
    ctx = _ctx([1, 2, 3, 1])
    proposer.start(ctx)
    assert _propose(proposer, ctx, 2) == [2, 3]
    ctx.token_ids[-1] = 2  # the last token changed in place, same length: [1, 2, 3, 2]
    assert _propose(proposer, ctx, 2) == [3, 2]
    ctx.token_ids += [7, 3]  # appended in place: [1, 2, 3, 2, 7, 3]
    assert _propose(proposer, ctx, 2) == [2, 7]
    index = ctx.state["ngram"]
    assert index.tokens == ctx.token_ids  # the index mirrors the context


def test_rows_of_a_batch_use_their_own_contexts():
    proposer = NgramProposer(NgramConfig(1, 2))
    a, b = _ctx([1, 2, 3, 1, 2]), _ctx([7, 8, 9, 7])
    for c in (a, b):
        proposer.start(c)
    drafts = proposer.propose([a, b], [3, 1])
    assert [d.token_ids[0].tolist() for d in drafts] == [[3, 1, 2], [8]]


def test_greedy_through_the_engine_equals_plain_decoding():
    target = tiny_llama(vocab_size=64, seed=0, scale=3.0)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    params = SamplingParams(max_new_tokens=30)
    plain = SpeculativeEngine(target, None).generate(prompt, params)
    spec = SpeculativeEngine(target, NgramProposer(NgramConfig(1, 3)), EngineConfig(num_speculative_tokens=3))
    out = spec.generate(prompt, params)
    assert out.token_ids == plain.token_ids
    assert out.metrics.num_drafted_tokens > 0  # the repeated prompt gives matches


# --------------------------------------------------------------------------- the incremental index


def _scan(tokens, min_n, max_n, k):
    """find_continuation's answer, longest n first: (tokens, n)."""
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(max_n, min_n - 1, -1):
        cont = find_continuation(arr, n, k)
        if cont.size:
            return cont.tolist(), n
    return [], 0


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=1, max_size=60),
       cuts=st.lists(st.integers(1, 7), min_size=1, max_size=12),
       sizes=st.tuples(st.integers(1, 3), st.integers(0, 3)), k=st.integers(1, 6))
def test_the_index_answers_as_a_scan_of_the_whole_context_while_it_grows(tokens, cuts, sizes, k):
    min_n, max_n = sizes[0], sizes[0] + sizes[1]
    index = NgramIndex(tokens[:cuts[0]], min_n, max_n)
    at = cuts[0]
    for c in [*cuts[1:], len(tokens)]:  # grown by pieces of any size, as committed tokens arrive
        assert index.continuation(k) == _scan(tokens[:at], min_n, max_n, k)
        index.extend(tokens[at : at + c])
        at = min(len(tokens), at + c)
    assert index.continuation(k) == _scan(tokens, min_n, max_n, k)


def test_drafts_carry_the_length_of_the_match_that_found_them():
    proposer = NgramProposer(NgramConfig(1, 3))
    ctx = _ctx([5, 6, 7, 8, 9, 6, 7])  # "6 7" matched (n = 2): copies 8 9
    proposer.start(ctx)
    d = proposer.propose([ctx], [2])[0]
    assert d.token_ids[0].tolist() == [8, 9] and d.match_length == 2
    ctx.token_ids += [8]  # "6 7 8" now matched (n = 3)
    assert proposer.propose([ctx], [1])[0].match_length == 3
