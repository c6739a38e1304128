"""The cost model of speculative decoding (costmodel.py) against brute-force enumeration.

Every closed form is checked against an exact expectation over all 2^gamma accept / reject
patterns of a step: with conditional acceptance r_i at position i, the step keeps the draft
up to the first rejection and always adds one token (recovered or bonus).
"""

from __future__ import annotations

import itertools
import math

import pytest

from specdecode import costmodel as theory

ALPHAS = [0.0, 0.1, 0.35, 0.5, 0.8, 0.95, 1.0]
GAMMAS = [0, 1, 2, 3, 5, 8]


def enumerate_step(rates: list[float]) -> list[tuple[float, int]]:
    """All outcomes of one step as (probability, tokens committed), by enumerating accept bits."""
    out = []
    for bits in itertools.product((0, 1), repeat=len(rates)):
        prob = math.prod(r if b else 1 - r for r, b in zip(rates, bits))
        accepted = next((i for i, b in enumerate(bits) if not b), len(bits))
        out.append((prob, accepted + 1))
    return out


def brute_expected_tokens(rates: list[float]) -> float:
    return sum(p * t for p, t in enumerate_step(rates))


def brute_tokens_per_second(rates: list[float], costs: theory.StepCosts) -> float:
    gamma = len(rates)
    if gamma == 0:
        return 1.0 / costs.t_plain
    # every step drafts gamma tokens and takes the same time: E[tokens] / step time
    return sum(p * t / costs.step_time(gamma) for p, t in enumerate_step(rates))


def costs(t_draft=0.2, ratios=(1.0, 1.1, 1.25, 1.4, 1.6, 1.8, 2.1, 2.4, 2.8, 3.1), overhead=0.05, t_plain=1.08):
    return theory.StepCosts(t_plain=t_plain, t_draft=t_draft, verify_ratio=lambda k: ratios[min(k, len(ratios) - 1)],
                            t_decode=1.0, t_overhead=overhead)


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("gamma", GAMMAS)
def test_iid_closed_form_matches_enumeration(alpha, gamma):
    brute = brute_expected_tokens([alpha] * gamma)
    assert theory.expected_tokens_iid(alpha, gamma) == pytest.approx(brute, abs=1e-12)
    assert theory.expected_tokens(theory.survival_iid(alpha, gamma), gamma) == pytest.approx(brute, abs=1e-12)


@pytest.mark.parametrize("rates", [[0.9, 0.7, 0.5, 0.3], [0.2, 0.9, 0.9, 0.9, 0.9], [1.0, 0.0, 1.0], [0.6],
                                   [0.99, 0.98, 0.5, 0.97, 0.1, 0.8]])
def test_per_position_closed_form_matches_enumeration(rates):
    survival = theory.survival_from_rates(rates)
    for gamma in range(len(rates) + 1):
        brute = brute_expected_tokens(rates[:gamma])
        assert theory.expected_tokens(survival, gamma) == pytest.approx(brute, abs=1e-12)
        assert theory.expected_accepted(survival, gamma) == pytest.approx(brute - 1, abs=1e-12)


def test_mixture_of_draft_lengths_matches_enumeration():
    rates = [0.8, 0.6, 0.9, 0.4]
    survival = theory.survival_from_rates(rates)
    lengths = [0, 1, 1, 2, 4, 4, 4, 3]
    brute = sum(brute_expected_tokens(rates[:k]) for k in lengths) / len(lengths)
    assert theory.expected_tokens_mixture(survival, lengths) == pytest.approx(brute, abs=1e-12)
    c = costs()
    brute_time = sum(c.step_time(k) for k in lengths) / len(lengths)
    want = brute * c.t_plain / brute_time
    assert theory.overhead_aware_speedup_mixture(survival, lengths, c) == pytest.approx(want, rel=1e-12)


def test_leviathan_theorem_form_for_iid():
    for alpha, gamma, c in [(0.8, 4, 0.05), (0.6, 3, 0.2), (0.95, 8, 0.01), (0.3, 1, 0.5)]:
        paper = (1 - alpha ** (gamma + 1)) / ((1 - alpha) * (gamma * c + 1))  # Theorem 3.8
        assert theory.leviathan_speedup(theory.survival_iid(alpha, gamma), gamma, c) == pytest.approx(paper)


def test_overhead_aware_reduces_to_leviathan_when_verification_is_one_step():
    alpha, gamma, c = 0.7, 5, 0.1
    flat = theory.StepCosts(t_plain=1.0, t_draft=c, verify_ratio=lambda k: 1.0, t_decode=1.0, t_overhead=0.0)
    s = theory.survival_iid(alpha, gamma)
    assert theory.overhead_aware_speedup(s, gamma, flat) == pytest.approx(theory.leviathan_speedup(s, gamma, c))
    assert theory.ideal_speedup(s, gamma) == pytest.approx(theory.expected_tokens_iid(alpha, gamma))


@pytest.mark.parametrize("rates", [[0.9] * 10, [0.95, 0.9, 0.85, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2],
                                   [0.3] * 10, [0.99] * 10])
@pytest.mark.parametrize("t_draft", [0.0, 0.05, 0.3])
def test_best_gamma_matches_brute_force(rates, t_draft):
    c = costs(t_draft=t_draft)
    survival = theory.survival_from_rates(rates)
    per_gamma = {g: brute_tokens_per_second(rates[:g], c) for g in range(len(rates) + 1)}
    want = max(per_gamma, key=lambda g: (per_gamma[g], -g))
    assert theory.best_gamma(survival, c, len(rates)) == want
    for g in range(1, len(rates) + 1):
        assert theory.tokens_per_second(survival, g, c) == pytest.approx(per_gamma[g])
        assert theory.overhead_aware_speedup(survival, g, c) == pytest.approx(per_gamma[g] * c.t_plain)


def test_best_gamma_zero_when_speculation_cannot_pay():
    c = costs(t_draft=2.0)  # a draft slower than the target
    assert theory.best_gamma(theory.survival_iid(0.5, 8), c, 8) == 0
    assert theory.best_gamma(theory.survival_iid(0.5, 8), c, 8, allow_zero=False) == 1


def test_best_gamma_iid_matches_brute_force():
    for alpha in (0.5, 0.7, 0.8, 0.9, 0.95):
        for c in (0.01, 0.05, 0.1, 0.3):
            brute = max(range(1, 65), key=lambda g: (brute_expected_tokens_iid(alpha, g) / (g * c + 1), -g))
            assert theory.best_gamma_iid(alpha, c) == brute
    # more acceptance or a cheaper draft never asks for a shorter draft
    assert theory.best_gamma_iid(0.9, 0.05) >= theory.best_gamma_iid(0.7, 0.05)
    assert theory.best_gamma_iid(0.8, 0.01) >= theory.best_gamma_iid(0.8, 0.2)


def brute_expected_tokens_iid(alpha: float, gamma: int) -> float:
    # i.i.d.: P(exactly j accepted) = alpha^j (1 - alpha) for j < gamma, alpha^gamma for j = gamma
    return sum((j + 1) * alpha**j * (1 - alpha) for j in range(gamma)) + (gamma + 1) * alpha**gamma


def test_survival_rates_round_trip_and_extension():
    rates = [0.9, 0.8, 0.7]
    s = theory.survival_from_rates(rates)
    assert theory.rates_from_survival(s) == pytest.approx(rates)
    ext = theory.extend_survival(s, 6)
    assert ext[:3] == pytest.approx(s)
    assert theory.rates_from_survival(ext)[3:] == pytest.approx([0.7, 0.7, 0.7])
    assert theory.extend_survival(s, 2) == pytest.approx(s[:2])
    assert theory.rates_from_survival([0.5, 0.0, 0.0]) == [0.5, 0.0, 0.0]


def test_verify_ratio_interpolates_and_extrapolates():
    ratio = theory.verify_ratio_from_samples({0: 0.010, 2: 0.014, 4: 0.020})
    assert ratio(0) == 1.0
    assert ratio(1) == pytest.approx(1.2)
    assert ratio(3) == pytest.approx(1.7)
    assert ratio(6) == pytest.approx(2.6)  # slope of the last segment
    with pytest.raises(ValueError):
        theory.verify_ratio_from_samples({1: 0.01})


def test_errors_name_the_bad_value():
    with pytest.raises(ValueError, match="acceptance rate"):
        theory.expected_tokens_iid(1.5, 3)
    with pytest.raises(ValueError, match="gamma"):
        theory.survival_iid(0.5, -1)
    with pytest.raises(ValueError, match="survival"):
        theory.expected_tokens([0.5], 3)
    with pytest.raises(ValueError):
        theory.leviathan_speedup([0.5], 1, -0.1)


# --------------------------------------------------------------------------- scaling out


def test_pipelined_step_overlaps_when_every_draft_is_kept_and_pays_a_redraft_otherwise():
    from specdecode.costmodel import pipelined_speedup, pipelined_step_time, survival_iid

    # all kept: the step is the longer of the two workers
    assert pipelined_step_time([1.0] * 4, 4, t_draft=0.01, t_verify=0.05) == pytest.approx(0.05)
    assert pipelined_step_time([1.0] * 4, 4, t_draft=0.02, t_verify=0.05) == pytest.approx(0.08)
    # never all kept: every step redrafts after the overlapped part
    assert pipelined_step_time([0.0] * 4, 4, t_draft=0.01, t_verify=0.05) == pytest.approx(0.05 + 0.04)
    s = survival_iid(0.8, 3)
    expected = max(0.05, 0.03) + (1 - 0.8 ** 3) * 0.03
    assert pipelined_step_time(s, 3, 0.01, 0.05) == pytest.approx(expected)
    assert pipelined_speedup(s, 3, 0.01, 0.05, t_plain=0.05) == pytest.approx(
        (1 + 0.8 + 0.64 + 0.512) * 0.05 / expected)


def test_allreduce_and_tensor_parallel_forward():
    from specdecode.costmodel import allreduce_seconds, replicate_draft, tensor_parallel_forward_seconds

    assert allreduce_seconds(1e6, 1, 1e-5, 1e9) == 0.0
    assert allreduce_seconds(1e6, 2, 1e-5, 1e9) == pytest.approx(1e-5 + 1e-3)
    assert allreduce_seconds(1e6, 4, 0.0, 1e9) == pytest.approx(1.5e-3)
    one = tensor_parallel_forward_seconds(1e9, 1e12, 1, 28, 6, 1536, 2, 1e-5, 1e11)
    assert one == pytest.approx(1e-3)  # no communication on one device
    two = tensor_parallel_forward_seconds(1e9, 1e12, 2, 28, 6, 1536, 2, 1e-5, 1e11)
    assert two == pytest.approx(0.5e-3 + 56 * (1e-5 + 6 * 1536 * 2 / 1e11))
    # a small draft with many layers: communication latency outweighs the halved weight reads
    keep, replicated, sharded = replicate_draft(1e9, 4e12, 2, 24, 896, 2, 8e-6, 1e11)
    assert keep and replicated < sharded
    # a big one on slow memory: sharding wins
    keep, replicated, sharded = replicate_draft(1e10, 1e11, 2, 24, 896, 2, 8e-6, 1e11)
    assert not keep and sharded < replicated


def test_replicas_vs_batch_splits_the_requests():
    from specdecode.costmodel import replicas_vs_batch

    one, two = replicas_vs_batch(lambda b: 10.0 * b ** 0.5, lambda b: 6.0 * b ** 0.5, concurrency=8, replicas=2)
    assert one == pytest.approx(10 * 8 ** 0.5) and two == pytest.approx(2 * 6 * 2.0)
    # one request: only one replica works; three on two: 2 + 1
    assert replicas_vs_batch(lambda b: 1.0, lambda b: float(b), 1, 2) == (1.0, 1.0)
    assert replicas_vs_batch(lambda b: 1.0, lambda b: float(b), 3, 2) == (1.0, 3.0)
    with pytest.raises(ValueError):
        replicas_vs_batch(lambda b: 1.0, lambda b: 1.0, 0, 2)


def test_time_table_line_goes_through_the_plain_step_with_the_least_squares_slope():
    TimeTable = theory.TimeTable
    t = TimeTable(smoothing=1.0)
    assert t.line(1) is None
    t.add(1, 3, 0.005)
    assert t.line(1) is None  # no plain step (g = 0) measured yet: no intercept to hold
    t.add(1, 0, 0.002)
    for g, s in ((1, 0.0031), (2, 0.0039), (4, 0.0060)):  # noisy around 2 ms + 1 ms per token
        t.add(1, g, s)
    a, b = t.line(1)
    assert a == pytest.approx(0.002) and b == pytest.approx(0.001, rel=0.05)
    a4, b4 = t.line(4)  # a batch size never measured: the nearest one's line, scaled by rows
    assert a4 == pytest.approx(4 * a) and b4 == pytest.approx(4 * b)
    flat = TimeTable(smoothing=1.0)
    flat.add(1, 0, 0.003)
    flat.add(1, 2, 0.002)  # faster with drafts than without (noise): the slope is held at 0, never negative
    assert flat.line(1) == (pytest.approx(0.003), 0.0)
    drafting = TimeTable(smoothing=1.0, proportional=True)
    drafting.add(1, 2, 0.0002)
    drafting.add(1, 4, 0.0004)
    assert drafting.line(1) == (0.0, pytest.approx(0.0001))


def test_acceptance_prior_counts_as_observations_that_decay():
    AcceptanceEstimate = theory.AcceptanceEstimate
    est = AcceptanceEstimate(4, decay=0.5, prior=(0.8, 2.0))
    assert est.rates()[0] == pytest.approx(0.8, abs=0.05)  # (shrunk a little towards the pooled rate)
    for _ in range(6):
        est.observe(1, 0)  # position 0 rejected every time: the prior fades
    assert est.rates()[0] < 0.35  # (still shrunk towards the pooled rate, which the untried positions hold up)
