"""The one cost model of speculative decoding: expected tokens per step, speedups, and measured step costs.

Leviathan et al. 2023, section 3, as pure functions (the benchmark's predictions use them), plus
the online measurements the draft-length policies learn from (``policy.py``):

- :class:`AcceptanceEstimate`: per-position acceptance c_i from decayed counts;
- :class:`TimeTable`: seconds of drafting / verification over (batch size B, draft length g),
  interpolated with numpy;
- :class:`StepOverhead`: the per-step time outside both;
- :func:`measured_rates`: B * E(g) / (T_draft(B, g) + T_verify(B, g) + T_other) for g = 0..max.

Notation (one speculative step = draft gamma tokens, verify them in one target pass):

- ``gamma``: draft length per step.
- ``alpha``: i.i.d. acceptance rate, P(a draft token is kept | every earlier one was).
- ``survival[i]``: P(draft tokens 0..i are all kept | the draft reached position i), the
  per-position figure ``RunMetrics.acceptance_by_position`` measures (positions from 0).
  For i.i.d. acceptance ``survival[i] = alpha ** (i + 1)``.
- ``rates[i]``: conditional acceptance at position i, ``survival[i] / survival[i - 1]``.
- Times are seconds per step or per token, as each argument says.

The paper's quantities:

- expected tokens per step, bonus / recovered token included (paper eq. 1 for i.i.d.):
  ``E[tokens] = 1 + sum_{i < gamma} survival[i] = (1 - alpha^(gamma+1)) / (1 - alpha)``;
- the ideal speedup (free drafting, verification as cheap as one decoding step): ``E[tokens]``;
- the paper's walltime improvement with cost ratio ``c = T_draft / T_target`` (Theorem 3.8):
  ``E[tokens] / (gamma * c + 1)``;
- the overhead-aware speedup in per-step form: one step costs
  ``gamma * T_draft + T_verify(gamma) + T_overhead`` and yields ``E[tokens]`` tokens, while
  plain decoding costs ``T_plain`` per token, so
  ``speedup = E[tokens] * T_plain / (gamma * T_draft + T_verify(gamma) + T_overhead)``.
  (Writing ``gamma * T_target`` in the numerator, as some summaries do, counts gamma
  tokens per step instead of the E[tokens] a step actually yields.)
- the best gamma: the one maximising expected tokens per unit cost.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
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

    def line(self, batch_size: int) -> tuple[float, float] | None:
        """(a, b): seconds a + b * g through the points at the batch size measured nearest ``batch_size`` (scaled
        by B / B0 as in a lookup): a the point at g = 0, b >= 0 the least-squares slope through it (proportional:
        a = 0, the slope through the origin); with one point, b from ``default_slope`` (or
        proportional). None when nothing is measured, or (not ``proportional``) g = 0 is not among the points.
        A line is steadier than interpolating between lengths that were each measured a few times on a
        noisy machine."""
        if not self.points:
            return None
        near = min({b for b, _ in self.points}, key=lambda b: (abs(b - batch_size), b))
        scale = batch_size / near
        curve = sorted((k, t) for (b, k), t in self.points.items() if b == near)  # (plain Python: a few points,
        if not self.proportional and curve[0][0] != 0:                           # asked once per step)
            return None
        k0, t0 = curve[0]
        if len(curve) == 1:
            if self.proportional:
                return 0.0, scale * (t0 / k0 if k0 else 0.0)
            return scale * t0, scale * t0 * self.default_slope
        if self.proportional and k0 != 0:
            return 0.0, scale * sum(k * t for k, t in curve) / sum(k * k for k, _ in curve)
        # through the plain step's point (g = 0): b = sum g (t - t0) / sum g^2 over the other points
        slope = sum(k * (t - t0) for k, t in curve[1:]) / sum(k * k for k, _ in curve[1:])
        return scale * t0, scale * max(0.0, slope)

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
        prior: (rate, weight): start every position at ``weight`` observations of acceptance ``rate``
            (decayed like real ones); None: no observations.
    """

    def __init__(self, max_tokens: int, decay: float = 0.95, shrink: float = 2.0,
                 prior: tuple[float, float] | None = None) -> None:
        self.decay, self.shrink = decay, shrink
        rate, weight = prior if prior is not None else (0.0, 0.0)
        self.hits = [rate * weight] * max_tokens
        self.trials = [float(weight)] * max_tokens

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
        return expected_tokens(survival_from_rates(self.rates()[:gamma]), gamma)


def measured_rates(acceptance: AcceptanceEstimate, t_draft: TimeTable, t_verify: TimeTable, overhead: float,
                   batch_size: int, max_gamma: int) -> list[float] | None:
    """Predicted committed tokens per second for g = 0..max_gamma at ``batch_size`` rows:
    B * E(g) / (T_draft(B, g) + T_verify(B, g) + T_other); None until a plain step and a drafting
    step have been timed."""
    if t_verify(batch_size, 0) is None or not t_draft.points:
        return None
    survival = survival_from_rates(acceptance.rates()[:max_gamma])
    rates: list[float] = []
    for g in range(max_gamma + 1):
        cost = t_verify(batch_size, g) + (t_draft(batch_size, g) if g else 0.0) + overhead
        rates.append(batch_size * expected_tokens(survival, g) / max(cost, 1e-9))
    return rates


# --------------------------------------------------------------------------- acceptance


def survival_iid(alpha: float, gamma: int) -> list[float]:
    """[gamma] survival for i.i.d. acceptance: ``alpha ** (i + 1)``.

    Raises:
        ValueError: alpha outside [0, 1] or gamma < 0.
    """
    _check_alpha(alpha)
    _check_gamma(gamma)
    return [alpha ** (i + 1) for i in range(gamma)]


def survival_from_rates(rates: Sequence[float]) -> list[float]:
    """Conditional per-position acceptance -> survival (running product)."""
    out, s = [], 1.0
    for r in rates:
        s *= float(r)
        out.append(s)
    return out


def rates_from_survival(survival: Sequence[float]) -> list[float]:
    """Survival -> conditional per-position acceptance (0 where the previous survival is 0)."""
    out, prev = [], 1.0
    for s in survival:
        out.append(min(1.0, s / prev) if prev > 0 else 0.0)
        prev = s
    return out


def extend_survival(survival: Sequence[float], gamma: int) -> list[float]:
    """Survival up to ``gamma`` positions, continuing past the measured ones at the last conditional rate.

    Measured acceptance exists only up to the longest draft run; to predict a longer gamma the
    last measured conditional rate is assumed to hold from there on (the i.i.d. tail).

    Raises:
        ValueError: empty ``survival`` with gamma > 0.
    """
    _check_gamma(gamma)
    s = [float(x) for x in survival[:gamma]]
    if len(s) >= gamma:
        return s
    if not s:
        raise ValueError("no measured acceptance to extend")
    rate = rates_from_survival(survival)[-1]
    while len(s) < gamma:
        s.append(s[-1] * rate)
    return s


def expected_accepted(survival: Sequence[float], gamma: int | None = None) -> float:
    """E[draft tokens kept per step] = sum of the first gamma survival values (all when gamma is None)."""
    s = survival if gamma is None else survival[:gamma]
    if gamma is not None and len(s) < gamma:
        raise ValueError(f"survival has {len(survival)} positions, gamma {gamma} needs more (see extend_survival)")
    return float(sum(s))


def expected_tokens(survival: Sequence[float], gamma: int | None = None) -> float:
    """E[tokens committed per step] = 1 + E[accepted] (the recovered or bonus token is always added)."""
    return 1.0 + expected_accepted(survival, gamma)


def expected_tokens_iid(alpha: float, gamma: int) -> float:
    """Closed form (1 - alpha^(gamma+1)) / (1 - alpha) (Leviathan et al. 2023, eq. 1); gamma + 1 at alpha = 1."""
    _check_alpha(alpha)
    _check_gamma(gamma)
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_tokens_mixture(survival: Sequence[float], lengths: Sequence[int]) -> float:
    """E[tokens per step] when the draft length varies per step (n-gram drafters, adaptive policies).

    Args:
        survival: per-position survival, at least ``max(lengths)`` long (see extend_survival).
        lengths: the draft length of each step (0 = a plain step, 1 token).
    """
    if not lengths:
        return 1.0
    prefix = [0.0]
    for s in survival:
        prefix.append(prefix[-1] + s)
    if max(lengths) >= len(prefix):
        raise ValueError(f"survival has {len(survival)} positions, a step drafted {max(lengths)}")
    return 1.0 + sum(prefix[k] for k in lengths) / len(lengths)


# --------------------------------------------------------------------------- speedups


def ideal_speedup(survival: Sequence[float], gamma: int) -> float:
    """Speedup with free drafting and verification as cheap as one decoding step: E[tokens]."""
    return expected_tokens(survival, gamma)


def leviathan_speedup(survival: Sequence[float], gamma: int, c: float) -> float:
    """Walltime improvement E[tokens] / (gamma * c + 1), c = T_draft(1 token) / T_target(1 token).

    Leviathan et al. 2023, Theorem 3.8 (there for i.i.d. alpha; here for any survival). It
    assumes verifying gamma + 1 tokens costs one target step.

    Raises:
        ValueError: c < 0.
    """
    if c < 0:
        raise ValueError(f"cost ratio c must be >= 0, got {c}")
    return expected_tokens(survival, gamma) / (gamma * c + 1.0)


@dataclass(frozen=True)
class StepCosts:
    """Measured costs in seconds.

    Attributes:
        t_plain: one plain decoding step (one token: a 1-token target forward plus the loop's overhead).
        t_draft: drafting one token (a draft-model forward; ~0 for lookup drafters).
        verify_ratio: ``verify_ratio(k)`` = T_verify(k) / T_decode(1): a target forward over
            k draft tokens + 1 over a 1-token forward (1.0 at k = 0).
        t_decode: a 1-token target forward (T_decode(1)); T_verify(k) = verify_ratio(k) * t_decode.
        t_overhead: per-step time outside drafting and verification (commit, rollback, Python).
    """

    t_plain: float
    t_draft: float
    verify_ratio: Callable[[int], float]
    t_decode: float
    t_overhead: float = 0.0

    def step_time(self, gamma: int) -> float:
        """Seconds of one speculative step drafting gamma tokens."""
        return gamma * self.t_draft + self.verify_ratio(gamma) * self.t_decode + self.t_overhead


def overhead_aware_speedup(survival: Sequence[float], gamma: int, costs: StepCosts) -> float:
    """E[tokens] * T_plain / (gamma * T_draft + T_verify(gamma) + T_overhead): the per-step cost model."""
    step = costs.step_time(gamma)
    if step <= 0:
        raise ValueError("a step must take a positive time")
    return expected_tokens(survival, gamma) * costs.t_plain / step


def overhead_aware_speedup_mixture(survival: Sequence[float], lengths: Sequence[int], costs: StepCosts) -> float:
    """The per-step model over steps of varying draft length: E over steps of tokens / E of time."""
    if not lengths:
        return 1.0
    mean_time = sum(costs.step_time(k) for k in lengths) / len(lengths)
    return expected_tokens_mixture(survival, lengths) * costs.t_plain / mean_time


def tokens_per_second(survival: Sequence[float], gamma: int, costs: StepCosts) -> float:
    """Expected tokens per unit cost at draft length gamma (gamma = 0: plain decoding)."""
    if gamma == 0:
        return 1.0 / costs.t_plain
    return expected_tokens(survival, gamma) / costs.step_time(gamma)


def best_gamma(survival: Sequence[float], costs: StepCosts, max_gamma: int, *, allow_zero: bool = True) -> int:
    """The gamma in [0 or 1, max_gamma] maximising expected tokens per unit cost (0 = do not speculate).

    ``survival`` is extended past its measured positions (see extend_survival).
    """
    _check_gamma(max_gamma)
    s = extend_survival(survival, max_gamma) if max_gamma else []
    start = 0 if allow_zero else 1
    return max(range(start, max_gamma + 1), key=lambda g: (tokens_per_second(s, g, costs), -g))


def best_gamma_iid(alpha: float, c: float, max_gamma: int = 64) -> int:
    """Leviathan et al. 2023, section 3.4: the integer gamma >= 1 maximising E[tokens] / (gamma c + 1)."""
    _check_alpha(alpha)
    return max(range(1, max_gamma + 1), key=lambda g: (expected_tokens_iid(alpha, g) / (g * c + 1.0), -g))


# --------------------------------------------------------------------------- fitting


def verify_ratio_from_samples(samples: dict[int, float]) -> Callable[[int], float]:
    """T_verify(k) / T_decode(1) as a function of k, from measured {k: seconds} (k = 0 required).

    Linear interpolation between measured k, linear extrapolation past the largest
    (from the last two points, never decreasing).

    Raises:
        ValueError: no sample at k = 0, or a non-positive time.
    """
    if 0 not in samples or samples[0] <= 0:
        raise ValueError("need a positive T_verify(0) (a 1-token forward) to normalise by")
    ks = sorted(samples)
    base = samples[0]
    ys = [samples[k] / base for k in ks]

    def ratio(k: int) -> float:
        if k <= 0:
            return 1.0
        for (k0, y0), (k1, y1) in zip(zip(ks, ys), zip(ks[1:], ys[1:])):
            if k0 <= k <= k1:
                return y0 + (y1 - y0) * (k - k0) / (k1 - k0)
        if len(ks) == 1:
            return 1.0
        slope = max(0.0, (ys[-1] - ys[-2]) / (ks[-1] - ks[-2]))
        return ys[-1] + slope * (k - ks[-1])

    return ratio


def _check_alpha(alpha: float) -> None:
    if not (0.0 <= alpha <= 1.0) or math.isnan(alpha):
        raise ValueError(f"acceptance rate must be in [0, 1], got {alpha}")


def _check_gamma(gamma: int) -> None:
    if not isinstance(gamma, int) or gamma < 0:
        raise ValueError(f"gamma must be an integer >= 0, got {gamma!r}")


__all__ = ["AcceptanceEstimate", "StepCosts", "StepOverhead", "TimeTable", "as_rows", "best_gamma", "best_gamma_iid",
           "expected_accepted", "expected_tokens", "expected_tokens_iid", "expected_tokens_mixture", "extend_survival",
           "ideal_speedup", "leviathan_speedup", "measured_rates", "overhead_aware_speedup",
           "overhead_aware_speedup_mixture", "rates_from_survival", "survival_from_rates", "survival_iid",
           "tokens_per_second", "verify_ratio_from_samples",
           # scaling out
           "allreduce_seconds", "pipelined_speedup", "pipelined_step_time", "replicas_vs_batch", "replicate_draft",
           "tensor_parallel_forward_seconds"]


# --------------------------------------------------------------------------- scaling out (docs/scaling.md)


def pipelined_step_time(survival: Sequence[float], gamma: int, t_draft: float, t_verify: float) -> float:
    """Expected seconds of one step of pipeline speculation: draft and target on different workers.

    While the target verifies window n, the draft worker drafts window n + 1 from the end of window n
    (the guess that all of n is kept; PEARL's post-verify, Liu et al. 2024). When all gamma tokens are
    kept (probability ``survival[gamma - 1]``) that draft is ready and the step costs
    ``max(T_verify, gamma * T_draft)``; otherwise it is discarded and redrafted from the corrected
    prefix while the target waits: ``+ gamma * T_draft``. The times are those of each worker *while
    the other runs* (a shared memory bus slows both; measure them so).

    Args:
        survival: P(draft tokens 0..i all kept), per position (``survival_iid`` for i.i.d. alpha).
        gamma: draft tokens per window (>= 1). t_draft: seconds per draft token. t_verify: seconds
            of a (gamma + 1)-token target forward.

    Returns:
        expected seconds per step (each step yields ``expected_tokens(survival, gamma)`` tokens).

    Raises:
        ValueError: gamma < 0.
    """
    _check_gamma(gamma)
    if gamma == 0:
        return t_verify
    s = extend_survival(survival, gamma)
    all_kept = s[gamma - 1]
    overlapped = max(t_verify, gamma * t_draft)
    return overlapped + (1.0 - all_kept) * gamma * t_draft


def pipelined_speedup(survival: Sequence[float], gamma: int, t_draft: float, t_verify: float,
                      t_plain: float) -> float:
    """Tokens per second of pipeline speculation over plain decoding at ``t_plain`` s per token (the target
    alone, with every core: the fair baseline): ``E[tokens] * t_plain / pipelined_step_time``."""
    return expected_tokens(survival, gamma) * t_plain / pipelined_step_time(survival, gamma, t_draft, t_verify)


def allreduce_seconds(message_bytes: float, world: int, latency: float, bandwidth: float) -> float:
    """One ring all-reduce of ``message_bytes`` over ``world`` devices: ``latency + 2 (p - 1) / p * bytes /
    bandwidth`` (each device sends and receives that much; Patarasuk & Yuan 2009). 0 for one device.

    Args:
        latency: seconds per all-reduce (alpha, measured for small messages); bandwidth: bytes/s per link.
    """
    if world <= 1:
        return 0.0
    return latency + 2.0 * (world - 1) / world * message_bytes / bandwidth


def tensor_parallel_forward_seconds(weight_bytes: float, device_bandwidth: float, world: int, layers: int,
                                    rows: int, hidden: int, activation_bytes: int, ar_latency: float,
                                    ar_bandwidth: float, allreduces_per_layer: int = 2) -> float:
    """A memory-bound forward of ``rows`` tokens sharded Megatron-style over ``world`` devices.

    Each device reads ``weight_bytes / world`` at ``device_bandwidth`` (bytes/s); each layer all-reduces its
    attention and MLP outputs (``allreduces_per_layer`` = 2 messages of ``rows * hidden * activation_bytes``).
    The LM head's logits stay sharded (a distributed argmax / Gumbel-max needs only tiny all-reduces),
    which this ignores.
    """
    weights = weight_bytes / world / device_bandwidth
    message = rows * hidden * activation_bytes
    return weights + layers * allreduces_per_layer * allreduce_seconds(message, world, ar_latency, ar_bandwidth)


def replicate_draft(weight_bytes: float, device_bandwidth: float, world: int, layers: int, hidden: int,
                    activation_bytes: int, ar_latency: float, ar_bandwidth: float) -> tuple[bool, float, float]:
    """Whether a draft model should be replicated on every device rather than sharded with the target.

    Per draft token, replicated: ``W_d / BW`` (no communication); sharded:
    :func:`tensor_parallel_forward_seconds` with one row. Replicate when replicated is not slower.

    Returns:
        (replicate?, seconds per draft token replicated, seconds sharded).
    """
    replicated = weight_bytes / device_bandwidth
    sharded = tensor_parallel_forward_seconds(weight_bytes, device_bandwidth, world, layers, 1, hidden,
                                              activation_bytes, ar_latency, ar_bandwidth)
    return replicated <= sharded, replicated, sharded


def replicas_vs_batch(tokens_per_s_one: Callable[[int], float], tokens_per_s_replica: Callable[[int], float],
                      concurrency: int, replicas: int) -> tuple[float, float]:
    """Throughput of one server at batch ``concurrency`` against ``replicas`` servers sharing it.

    Args:
        tokens_per_s_one: measured tokens/s of one server (all cores) at a batch of b rows.
        tokens_per_s_replica: measured tokens/s of one replica (its share of the cores, the others
            busy too) at a batch of b rows.

    Returns:
        (one server's tokens/s, the replicas' total tokens/s) with the requests split as evenly as they
        go (a replica with none adds nothing).

    Raises:
        ValueError: concurrency or replicas below 1.
    """
    if concurrency < 1 or replicas < 1:
        raise ValueError(f"concurrency and replicas must be >= 1, got {concurrency}, {replicas}")
    shares = [concurrency // replicas + (i < concurrency % replicas) for i in range(replicas)]
    return tokens_per_s_one(concurrency), sum(tokens_per_s_replica(b) for b in shares if b > 0)
