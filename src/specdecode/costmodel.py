"""The one cost model of speculative decoding: expected tokens per step and measured step costs.

Leviathan et al. 2023 (section 3.4) with measured rather than assumed costs and per-position
rather than one acceptance rate::

    E(g)    = 1 + sum_{j=1..g} prod_{i<j} c_i                  tokens a row commits per step
    rate(g) = B * E(g) / (T_draft(B, g) + T_verify(B, g) + T_other)   committed tokens per second

c_i = P(draft position i kept | positions < i kept), from exponentially decayed counts
(:class:`AcceptanceEstimate`); T_draft and T_verify are tables of measured seconds over the batch
size B and the draft length g (:class:`TimeTable`, numpy interpolation); T_other is the per-step
time outside both (:class:`StepOverhead`). Used by the draft-length policies (``policy.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np


def as_rows(values) -> list[int]:
    """Per-row counts: an int (one row) or a sequence -> list of ints."""
    if isinstance(values, (int, np.integer)):
        return [int(values)]
    return [int(v) for v in values]


def _ema(old: float | None, new: float, weight: float) -> float:
    return new if old is None else (1.0 - weight) * old + weight * new


@dataclass
class TimeTable:
    """Seconds of one step part as a function of (batch size B, draft length g), from EMAs of measurements.

    Lookup at (B, g): among the points measured at B, ``numpy.interp`` over g (linear
    extrapolation from the two nearest points past the ends, never negative); with one point at B,
    ``proportional`` scales it by g / g0 (drafting: nothing at g = 0), else each extra token adds
    ``default_slope`` of a one-token step (verification, near flat on this project's kernels). A
    batch size never measured borrows the curve of the nearest measured one, scaled by B / B0
    (rows cost at most linearly).
    """

    smoothing: float = 0.3
    default_slope: float = 0.05
    proportional: bool = False
    points: dict[tuple[int, int], float] = field(default_factory=dict)

    def add(self, batch_size: int, g: int, seconds: float) -> None:
        key = (int(batch_size), int(g))
        self.points[key] = _ema(self.points.get(key), seconds, self.smoothing)

    def has(self, batch_size: int, g: int) -> bool:
        return (batch_size, g) in self.points

    def __call__(self, batch_size: int, g: int) -> float | None:
        if not self.points:
            return None
        sizes = sorted({b for b, _ in self.points})
        near = min(sizes, key=lambda b: (abs(b - batch_size), b))
        scale = batch_size / near
        curve = sorted((k, t) for (b, k), t in self.points.items() if b == near)
        ks = np.array([k for k, _ in curve], dtype=float)
        ts = np.array([t for _, t in curve], dtype=float)
        if len(ks) == 1:
            k0, t0 = ks[0], ts[0]
            if self.proportional:
                return scale * (t0 * g / k0 if k0 else t0)
            return scale * t0 / (1.0 + self.default_slope * k0) * (1.0 + self.default_slope * g)
        if g < ks[0]:
            slope = max(0.0, (ts[1] - ts[0]) / (ks[1] - ks[0]))
            return scale * max(0.0, ts[0] + slope * (g - ks[0]))
        if g > ks[-1]:
            slope = max(0.0, (ts[-1] - ts[-2]) / (ks[-1] - ks[-2]))
            return scale * max(0.0, ts[-1] + slope * (g - ks[-1]))
        return scale * float(np.interp(g, ks, ts))


@dataclass
class StepOverhead:
    """Per-step seconds outside drafting and verification (commit, bookkeeping, the caller's own work).

    Measured as the time between consecutive observations minus the step's draft and verify
    seconds; a gap much longer than the step itself (between requests) is not counted.
    """

    seconds: float = 0.0
    _last: float | None = field(default=None, repr=False)

    def observe(self, busy_s: float | None) -> None:
        now = time.perf_counter()
        if self._last is not None and busy_s is not None:
            other = now - self._last - busy_s
            if 0.0 <= other <= 2.0 * busy_s:
                self.seconds = 0.8 * self.seconds + 0.2 * other
        self._last = now


class AcceptanceEstimate:
    """Per-position acceptance c_i from decayed counts, and E(g).

    Each position's decayed counts are shrunk towards the previous position's estimate (``shrink``
    pseudo-observations), position 0 towards the pooled rate; a position never reached inherits
    the one before it. Bursty drafters (prompt lookup keeps runs or nothing) are rated by position,
    which one i.i.d. rate would under-rate.

    Args:
        max_tokens: positions tracked. decay: per-observation decay in (0, 1].
    """

    def __init__(self, max_tokens: int, decay: float = 0.95, shrink: float = 2.0) -> None:
        self.decay, self.shrink = decay, shrink
        self.hits = [0.0] * max_tokens
        self.trials = [0.0] * max_tokens

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """One row's step: positions 0..min(accepted, drafted - 1) were judged; decay only those."""
        reached = min(num_accepted + 1, num_drafted, len(self.hits))
        for i in range(reached):
            self.hits[i] = self.decay * self.hits[i] + (1.0 if i < num_accepted else 0.0)
            self.trials[i] = self.decay * self.trials[i] + 1.0

    def discount(self, factor: float) -> None:
        """Old evidence counts ``factor`` as much (a re-probe)."""
        self.hits = [h * factor for h in self.hits]
        self.trials = [t * factor for t in self.trials]

    def rates(self) -> list[float]:
        """c_i for every position."""
        pooled = (sum(self.hits) + 1.0) / (sum(self.trials) + 2.0)
        out, prev = [], pooled
        for h, t in zip(self.hits, self.trials):
            prev = (h + self.shrink * prev) / (t + self.shrink)
            out.append(prev)
        return out

    def expected_tokens(self, gamma: int) -> float:
        """E(gamma): expected tokens a row commits in a step drafting gamma tokens (bonus included)."""
        total, reach = 1.0, 1.0
        for c in self.rates()[:gamma]:
            reach *= c
            total += reach
        return total


def best_gamma(acceptance: AcceptanceEstimate, t_draft: TimeTable, t_verify: TimeTable, overhead: float,
               batch_size: int, max_gamma: int) -> tuple[int, list[float]] | None:
    """argmax_g rate(g) over 0..max_gamma for ``batch_size`` rows, and the rates; None until a plain step
    and a drafting step have been timed."""
    if t_verify(batch_size, 0) is None or not t_draft.points:
        return None
    rates: list[float] = []
    for g in range(max_gamma + 1):
        cost = t_verify(batch_size, g) + (t_draft(batch_size, g) if g else 0.0) + overhead
        rates.append(batch_size * acceptance.expected_tokens(g) / max(cost, 1e-9))
    return max(range(len(rates)), key=rates.__getitem__), rates


__all__ = ["AcceptanceEstimate", "StepOverhead", "TimeTable", "as_rows", "best_gamma"]
