"""Logits -> probabilities (``specdecode.sampling``) on known logits: temperature, top-k, top-p, their order,
greedy one-hots, and one processing for the target's p and the draft's q (Leviathan et al. 2023, 2.3)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from specdecode.sampling import logits_to_probs, next_token, sample
from specdecode.types import SamplingParams
from tiny import chi2_pvalue

# probabilities 0.5, 0.3, 0.15, 0.05 at temperature 1
KNOWN = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))


def _probs(logits, **kw):
    return logits_to_probs(logits, SamplingParams(**kw))


def test_temperature_divides_the_logits():
    for t in (0.25, 0.7, 1.0, 3.0):
        got = _probs(KNOWN, temperature=t)
        want = torch.softmax(KNOWN / t, -1)
        torch.testing.assert_close(got, want)
        assert got.dtype == torch.float32 and got.sum().item() == pytest.approx(1.0, abs=1e-6)
    cold, hot = _probs(KNOWN, temperature=0.5), _probs(KNOWN, temperature=2.0)
    assert cold[0] > 0.5 > hot[0]  # below 1 sharpens, above 1 flattens


def test_greedy_is_one_hot_on_the_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [5.0, 4.9, 0.0]], dtype=torch.float64)
    probs = _probs(logits, temperature=0.0)
    assert probs.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]] and probs.dtype == torch.float32
    # greedy ignores top-k / top-p: the argmax is always kept
    assert _probs(logits, temperature=0.0, top_k=1, top_p=0.01).tolist() == probs.tolist()


def test_top_k_keeps_the_k_most_likely_renormalised():
    probs = _probs(KNOWN, temperature=1.0, top_k=2)
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)
    assert _probs(KNOWN, temperature=1.0, top_k=1).tolist() == [1.0, 0.0, 0.0, 0.0]
    for k in (0, 4, 99):  # 0 disables, k >= V keeps everything
        torch.testing.assert_close(_probs(KNOWN, temperature=1.0, top_k=k), torch.softmax(KNOWN, -1))
    tied = torch.tensor([3.0, 1.0, 1.0, 0.0])  # a tie at the k-th value keeps every tied token
    assert (_probs(tied, temperature=1.0, top_k=2) > 0).tolist() == [True, True, True, False]


@pytest.mark.parametrize("top_p, kept", [(0.3, [0]), (0.45, [0]), (0.55, [0, 1]), (0.75, [0, 1]), (0.85, [0, 1, 2]),
                                         (0.9, [0, 1, 2]), (0.97, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3])])
def test_top_p_keeps_the_smallest_set_reaching_the_mass(top_p, kept):
    """A token stays when the mass of strictly more likely tokens is below top_p (the most likely always)."""
    probs = _probs(KNOWN, temperature=1.0, top_p=top_p)
    assert torch.nonzero(probs).flatten().tolist() == kept
    base = torch.tensor([0.5, 0.3, 0.15, 0.05])
    torch.testing.assert_close(probs[kept], base[kept] / base[kept].sum())


def test_order_is_temperature_then_top_k_then_top_p():
    # at temperature 2 the nucleus of mass 0.8 needs three tokens; at temperature 1 two
    hot = torch.softmax(KNOWN / 2, -1)
    assert hot[:2].sum() < 0.8 < hot[:3].sum()
    assert torch.count_nonzero(_probs(KNOWN, temperature=2.0, top_p=0.8)) == 3
    # top-p measures mass after top-k: of the top 2 (0.625, 0.375), 0.6 of the mass needs only the first
    assert torch.nonzero(_probs(KNOWN, temperature=1.0, top_k=2, top_p=0.6)).flatten().tolist() == [0]
    # without top-k first, the same top_p keeps two tokens
    assert torch.count_nonzero(_probs(KNOWN, temperature=1.0, top_p=0.6)) == 2


def test_batched_logits_are_processed_row_by_row_identically():
    """p (target rows) and q (draft rows) go through this one function; a row's result never depends on
    the batch shape or on the input dtype, so equal logits give bit-equal p and q."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 17, generator=g, dtype=torch.float64) * 3
    params = SamplingParams(temperature=0.8, top_k=9, top_p=0.9)
    batched = logits_to_probs(logits, params)  # [3, 5, V]
    assert batched.shape == logits.shape
    for i in range(3):
        for j in range(5):
            assert torch.equal(batched[i, j], logits_to_probs(logits[i, j], params))
    assert torch.equal(logits_to_probs(logits.float(), params), batched)
    torch.testing.assert_close(batched.sum(-1), torch.ones(3, 5))
    assert (batched > 0).sum(-1).max() <= 9


def test_sample_follows_the_probabilities_and_is_reproducible():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    g = torch.Generator().manual_seed(1)
    draws = sample(probs.expand(20000, 5).contiguous(), g)  # [20000]
    assert draws.shape == (20000,) and draws.dtype == torch.int64
    counts = np.bincount(draws.numpy(), minlength=5)
    assert counts[4] == 0  # a zero-probability token is never drawn
    assert chi2_pvalue(counts[:4], probs[:4].numpy()) > 1e-3
    a = sample(probs, torch.Generator().manual_seed(7))
    b = sample(probs, torch.Generator().manual_seed(7))
    assert a.shape == () and a == b


def test_next_token_is_argmax_greedily_and_a_sample_of_the_processed_distribution_otherwise():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    g = torch.Generator().manual_seed(3)
    state = g.get_state()
    assert next_token(logits, SamplingParams(), g).tolist() == [1, 0]
    assert torch.equal(g.get_state(), state)  # greedy draws nothing from the request's generator
    params = SamplingParams(temperature=0.9, top_p=0.6)
    got = next_token(logits, params, torch.Generator().manual_seed(5))
    want = sample(logits_to_probs(logits, params), torch.Generator().manual_seed(5))
    assert torch.equal(got, want)
    # top_p 0.6 at temperature 0.9 leaves only each row's argmax: sampling must return it
    assert math.isclose(float(logits_to_probs(logits, params)[0, 1]), 1.0) and got.tolist() == [1, 0]


def test_temperatures_below_float32s_range_give_the_argmax_never_nan():
    """1e-46 is 0 in float32: dividing there gave 0 / 0 = NaN (and garbage tokens); the division runs in float64."""
    logits = torch.tensor([[1.0, 3.0, 2.5, float("-inf")]])
    for t in (1e-46, 1e-300, 5e-324, 1e-4):
        probs = logits_to_probs(logits, SamplingParams(temperature=t))
        assert not bool(torch.isnan(probs).any()) and probs[0].tolist() == [0.0, 1.0, 0.0, 0.0], t


def test_seeds_beyond_63_bits_are_refused_with_the_field():
    from specdecode.errors import InvalidSamplingParams

    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(seed=2**63)
    assert info.value.field == "seed"


@pytest.mark.parametrize("shape", [(7,), (3, 11), (2, 4, 9), (1, 1, 49152)])
def test_the_numpy_argmax_is_torchs_argmax_ties_nan_and_infinities_included(shape):
    """sampling.argmax (numpy's, for CPU float32) gives torch.argmax's index: the first on ties, the first NaN,
    every value -inf, a strided view; other dtypes go to torch."""
    from specdecode.sampling import argmax

    gen = torch.Generator().manual_seed(0)
    for case in range(8):
        x = torch.randint(-3, 4, shape, generator=gen).float()  # many ties
        if case == 1:
            x.view(-1)[:: max(1, x.numel() // 3)] = float("nan")
        elif case == 2:
            x.fill_(float("-inf"))
        elif case == 3:
            x.view(-1)[-1] = float("inf")
        elif case == 4:
            x = torch.randn(shape, generator=gen)
        got = argmax(x)
        assert got.dtype == torch.int64 and got.shape == x.shape[:-1] and torch.equal(got, x.argmax(-1)), case
    wide = torch.randn(*shape[:-1], 2 * shape[-1], generator=gen)[..., ::2]  # not contiguous
    assert torch.equal(argmax(wide), wide.argmax(-1))
    half = torch.randn(shape, generator=gen).bfloat16()
    assert torch.equal(argmax(half), half.argmax(-1))
