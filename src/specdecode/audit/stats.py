"""The audit's statistics: chi-square goodness of fit, total variation and its null spread, power, Holm.

All on a partition of outcomes (``law.ExactLaw.cells``): ``counts`` [C] int observed per cell, ``probs`` [C]
float64 the exact law (positive, summing to 1), N = counts.sum().

- Chi-square (Pearson 1900; ``scipy.stats.chi2``): cells expected fewer than 5 times are pooled, smallest
  first, until the pool is expected 5 times or more (a pool expected 0.01 times that catches one sample
  would otherwise reject on its own).
- Total variation ``TV = 1/2 sum |counts / N - probs|``, and its null spread: TV of M multinomial draws of N
  from ``probs`` (its 95th / 99th percentiles: what a perfect sampler shows with N samples).
- Power: the smallest TV error N samples detect with probability ``power`` at level ``alpha``, along the
  tempering family ``q_beta ∝ probs ** beta`` (beta < 1 spreads the mass, as a too-high temperature or a
  residual that is not renormalised does; beta > 1 sharpens it). For each direction, the beta closest to 1
  whose simulated rejection rate (the same chi-square test, M draws of N from ``q_beta``) reaches ``power``
  is found by bisection on log beta; the stated figure is TV(probs, q_beta) of the harder direction.
- Holm (1979) step-down adjustment of the per-prompt p-values and the pooled one (scipy has no Holm).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as sps

#: Fewest expected counts of a chi-square bin.
MIN_EXPECTED = 5.0
#: Draws of N per simulated point of the power search, and bisection steps on log beta.
POWER_SIMULATIONS, POWER_STEPS = 400, 14


@dataclass(frozen=True)
class ChiSquare:
    """Pearson's chi-square test on pooled bins.

    Attributes:
        statistic, dof, pvalue: the test (dof = bins - 1; pvalue 1.0 when fewer than 2 bins are testable).
        bins: [C] int, the bin of each cell (cells pooled share a bin).
        num_bins: bins.
    """

    statistic: float
    dof: int
    pvalue: float
    bins: np.ndarray
    num_bins: int


def pool_bins(probs: np.ndarray, n: int, min_expected: float = MIN_EXPECTED) -> tuple[np.ndarray, int]:
    """Bins of the cells: each cell expected >= ``min_expected`` times alone, the others pooled smallest first
    (and the pool topped up with the next smallest cells until it is expected ``min_expected`` times).

    Returns:
        ([C] int bin per cell, number of bins).
    """
    expected = np.asarray(probs, dtype=np.float64) * n
    order = np.argsort(expected, kind="stable")
    bins = np.empty(len(expected), dtype=np.int64)
    pooled, i = 0.0, 0
    if expected[order[0]] < min_expected:
        while i < len(order) and (expected[order[i]] < min_expected or pooled < min_expected):
            pooled += expected[order[i]]
            bins[order[i]] = 0
            i += 1
        first = 1
    else:
        first = 0
    bins[order[i:]] = np.arange(first, first + len(order) - i)
    return bins, first + len(order) - i


def chi_square(counts: np.ndarray, probs: np.ndarray, min_expected: float = MIN_EXPECTED) -> ChiSquare:
    """Pearson's chi-square of ``counts`` [C] against ``probs`` [C] on pooled bins (:func:`pool_bins`)."""
    counts = np.asarray(counts, dtype=np.float64)
    n = int(counts.sum())
    bins, num = pool_bins(probs, n, min_expected)
    if num < 2 or n == 0:
        return ChiSquare(0.0, 0, 1.0, bins, num)
    obs = np.bincount(bins, counts, minlength=num)
    exp = np.bincount(bins, np.asarray(probs) * n, minlength=num)
    stat = float(((obs - exp) ** 2 / exp).sum())
    return ChiSquare(stat, num - 1, float(sps.chi2.sf(stat, num - 1)), bins, num)


def total_variation(counts: np.ndarray, probs: np.ndarray) -> float:
    """1/2 sum |counts / N - probs| over the cells (0 when N = 0)."""
    counts = np.asarray(counts, dtype=np.float64)
    n = counts.sum()
    return 0.0 if n == 0 else float(0.5 * np.abs(counts / n - probs).sum())


def _draws(rng: np.random.Generator, n: int, probs: np.ndarray, size: int, chunk: int = 256):
    """Multinomial draws of ``n`` from ``probs`` [C], ``size`` of them, in chunks of [<= chunk, C] int64."""
    done = 0
    while done < size:
        m = min(chunk, size - done)
        yield rng.multinomial(n, probs, size=m)
        done += m


def null_tv(probs: np.ndarray, n: int, simulations: int, rng: np.random.Generator) -> np.ndarray:
    """[simulations] float64 TV of ``n`` samples of a perfect sampler (multinomial draws from ``probs``)."""
    out = [0.5 * np.abs(d / n - probs).sum(1) for d in _draws(rng, n, probs, simulations)]
    return np.concatenate(out)


def rejection_rate(q: np.ndarray, probs: np.ndarray, n: int, alpha: float, test: ChiSquare, simulations: int,
                   rng: np.random.Generator) -> float:
    """How often the chi-square test of ``test``'s bins (expected from ``probs``) rejects at ``alpha`` when the
    ``n`` samples come from ``q`` [C] instead (simulated)."""
    if test.num_bins < 2:
        return 0.0
    exp = np.bincount(test.bins, probs * n, minlength=test.num_bins)
    critical = sps.chi2.isf(alpha, test.num_bins - 1)
    order = np.argsort(test.bins, kind="stable")  # cells grouped by bin: a bin's counts are one reduceat slice
    starts = np.searchsorted(test.bins[order], np.arange(test.num_bins))
    rejected = 0
    for d in _draws(rng, n, q, simulations):
        obs = np.add.reduceat(d[:, order], starts, axis=1)
        rejected += int((((obs - exp) ** 2 / exp).sum(1) > critical).sum())
    return rejected / simulations


def tempered(probs: np.ndarray, beta: float) -> np.ndarray:
    """[C] ``probs ** beta``, renormalised (computed in log space)."""
    logq = beta * np.log(probs)
    q = np.exp(logq - logq.max())
    return q / q.sum()


def detectable_tv(probs: np.ndarray, n: int, alpha: float, power: float, test: ChiSquare,
                  rng: np.random.Generator, simulations: int = POWER_SIMULATIONS) -> float | None:
    """The smallest TV error ``n`` samples detect with probability ``power`` at level ``alpha`` (see the module
    docstring: the harder of the two tempering directions that can reach that power at all; a direction
    whose far end, beta = 0.02 or 50, is detected less often is left out). None when nothing is testable
    (fewer than two bins, or neither direction reaches the power)."""
    if test.num_bins < 2:
        return None
    found = []
    for far in (np.log(0.02), np.log(50.0)):  # spread, sharpen: log beta from 0 towards ``far``
        if rejection_rate(tempered(probs, float(np.exp(far))), probs, n, alpha, test, simulations, rng) < power:
            continue
        lo, hi = 0.0, far  # power(lo) < target <= power(hi)
        for _ in range(POWER_STEPS):
            mid = (lo + hi) / 2
            if rejection_rate(tempered(probs, float(np.exp(mid))), probs, n, alpha, test, simulations, rng) >= power:
                hi = mid
            else:
                lo = mid
        found.append(0.5 * float(np.abs(tempered(probs, float(np.exp(hi))) - probs).sum()))
    return max(found) if found else None


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (same order as given): reject hypothesis i at family-wise level alpha
    iff adjusted[i] < alpha (Holm 1979)."""
    p = np.asarray(pvalues, dtype=np.float64)
    m = len(p)
    order = np.argsort(p, kind="stable")
    adjusted = np.empty(m)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[i]))
        adjusted[i] = running
    return adjusted.tolist()


def pooled_chi_square(tests: Sequence[ChiSquare]) -> tuple[float, int, float]:
    """(statistic, dof, p-value) of the prompts' chi-square tests together (independent samples: the
    statistics and the degrees of freedom add)."""
    stat = float(sum(t.statistic for t in tests))
    dof = int(sum(t.dof for t in tests))
    return stat, dof, (float(sps.chi2.sf(stat, dof)) if dof > 0 else 1.0)


__all__ = ["ChiSquare", "chi_square", "detectable_tv", "holm", "null_tv", "pool_bins", "pooled_chi_square",
           "rejection_rate", "tempered", "total_variation"]
