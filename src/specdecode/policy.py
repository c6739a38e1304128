"""Draft-length policies: how many tokens to draft next step (gamma, ``num_speculative_tokens``).

Every policy answers three questions for the engine:

- ``next_length(batch_size=1) -> int``: gamma for the next step of a batch of that many
  rows; 0 means a plain decoding step.
- ``update(num_drafted, num_accepted, *, draft_time_s=None, verify_time_s=None)``:
  feedback after each verification, per row (``[B]`` lists, or ints for one row):
  what each row's proposer actually drafted (which may be less than asked) and what
  verification kept; the times are the step's measured seconds of drafting and of
  the target's verification forward for the whole batch.
- ``trim(lengths, match_lengths, batch_size, *, padded=0) -> list[int]`` (optional): after a lookup
  drafter (n-gram) proposed, how many tokens of each row's chain to verify, given how long a match
  found it (``Draft.match_length``) and how far the step's other rows pad it (``padded``: passed only to
  a ``trim`` that takes the keyword); a policy that overrides it also gets ``match_lengths=`` (per
  row, None for a row that drafted nothing) in ``update``. The base class verifies every token.
- ``should_continue``: None, or a callable ``probs [V] float32 -> bool`` that a
  model-based proposer (draft-model, layer-skip) consults after each drafted
  token, with the distribution that token came from (greedy requests: the
  softmax of the raw draft logits). False stops the chain there (the token just
  drafted is kept). Deterministic drafters (n-gram, suffix) never call it.

Policies (build them by name with :func:`build_policy`):

- ``auto`` (the default of ``generate``, ``bench`` and the library): ``cost-model`` for a drafter
  whose chains it can trim by their match length (n-gram: :func:`drafts_by_lookup`), ``fixed`` for the
  others (a model's draft costs a forward per token, and the cost model's pooled estimate has not
  beaten a fixed gamma there in this project's runs; suffix decoding drafts token trees sized by its
  own match length, which ``trim`` leaves whole).
- ``fixed``: always gamma (Leviathan et al. 2023; vLLM's ``num_speculative_tokens``).
- ``heuristic``: +2 after a fully accepted step, -1 otherwise, never below 1
  (Hugging Face transformers' ``num_assistant_tokens_schedule="heuristic"``).
- ``confidence``: draft up to a cap, stopping as soon as the draft's top
  probability falls below a threshold (HF ``assistant_confidence_threshold``) or,
  optionally, its entropy exceeds a bound (the SVIP idea, Zhang et al. 2024).
- ``cost-model``: chooses gamma in [0, max] maximising expected committed tokens
  per second, from per-position acceptance and T_draft(k), T_verify(k) measured
  online; gamma = 0 (plain decoding, re-probed later with backoff) when
  speculation would lose. With a lookup drafter it rates each row's draft by its
  match length (acceptance learned per match length and position) and verifies
  the prefix of the chain that pays, none when none does.

``heuristic`` and ``confidence`` also carry a :class:`PlainFallback` guard (on by
default, ``guard=False`` gives the published rule alone): it compares measured
speculative throughput with measured plain decoding and switches to plain
decoding while speculation loses, so neither policy runs much slower than
plain decoding when acceptance collapses.

All policies are per engine: their state (gamma, estimates) carries over from
one request to the next, as Hugging Face's heuristic does. The costs they learn
(``specdecode.costmodel``) are tables over the batch size and the draft length.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdecode.costmodel import AcceptanceEstimate, StepOverhead, TimeTable, as_rows, measured_rates
from specdecode.types import SpecDecodeError
# The limits and checks, without torch (the command line refuses a bad -k / --policy with them too):
# MAX_SPECULATIVE_TOKENS is the largest gamma any policy may choose (the engine's own limit).
from specdecode.validate import MAX_SPECULATIVE_TOKENS, check_policy_name
from specdecode.validate import check_gamma as _check_gamma


def default_max_tokens(num_speculative_tokens: int) -> int:
    """Cap of the adaptive policies: max(2 * gamma, 8), at most 64."""
    return min(MAX_SPECULATIVE_TOKENS, max(2 * num_speculative_tokens, 8))


class DraftLengthPolicy:
    """Base class: the interface the engine uses, with do-nothing defaults."""

    #: The name :func:`build_policy` knows it by.
    name: str = ""
    #: None, or ``probs [V] float32 -> bool`` consulted by model-based drafters after each token.
    should_continue: Callable[[torch.Tensor], bool] | None = None
    #: True when the state carries from one request to the next (the adaptive policies): a repeat of a prompt
    #: then starts from what the first run learned, so its timing is not that of a first run.
    remembers_requests: bool = True

    def next_length(self, batch_size: int = 1) -> int:
        raise NotImplementedError

    def update(
        self,
        num_drafted,
        num_accepted,
        *,
        draft_time_s: float | None = None,
        verify_time_s: float | None = None,
        match_lengths=None,
    ) -> None:
        return None

    def trim(self, lengths: list[int], match_lengths: list[int], batch_size: int, *, padded: int = 0) -> list[int]:
        """How many tokens of each lookup draft to verify: ``lengths[i]`` tokens drafted by a match of
        ``match_lengths[i]`` tokens (rows of a batch of ``batch_size``) -> a count in [0, lengths[i]] each.
        ``padded``: the longest draft of the batch's other rows (verification pads every row to the longest).
        Verifying a prefix of a deterministic chain is exact (its tokens are verified as in the whole chain).
        The base class keeps every token. (The engine passes ``padded`` only to a ``trim`` that takes it.)"""
        return list(lengths)


class FixedPolicy(DraftLengthPolicy):
    """Always draft ``num_speculative_tokens`` (vLLM's and the papers' fixed gamma).

    Raises:
        SpecDecodeError: gamma outside [1, 64].
    """

    name = "fixed"
    remembers_requests = False

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_speculative_tokens = _check_gamma("num_speculative_tokens", num_speculative_tokens)

    def next_length(self, batch_size: int = 1) -> int:
        return self.num_speculative_tokens

    def __repr__(self) -> str:
        return f"FixedPolicy({self.num_speculative_tokens})"


# --------------------------------------------------------------------------- plain-decoding guard


def _ema(old: float | None, new: float, weight: float) -> float:
    return new if old is None else (1.0 - weight) * old + weight * new


@dataclass
class PlainFallback:
    """Switch to plain decoding while speculation is measured to be slower than it.

    Tracks two exponential moving averages: committed tokens per second of
    speculative steps (draft + verify time) and of plain steps (verify time of a
    step with nothing drafted). Plain steps are taken on purpose now and then to
    measure the second (they cost nothing against the plain baseline). After
    ``window`` speculative steps, if speculation runs below ``margin`` x plain,
    the guard holds gamma at 0 for ``backoff`` steps, doubling the hold after
    each failed re-probe (up to ``max_backoff``), and resetting it once
    speculation wins again. While judging (the first steps, and each re-probe)
    gamma is capped at ``probe_gamma``, so a losing probe costs little.

    Attributes:
        window: speculative steps between decisions.
        margin: speculate while spec_rate >= margin * plain_rate.
        backoff, max_backoff: plain steps before the next probe (doubles on failure).
        refresh_every: steps between plain-step measurements while speculating.
        smoothing: EMA weight of a new observation.
        probe_gamma: the most tokens drafted while speculation is on trial; None = the gamma the
            policy would use (so a probe measures what speculation really does).
    """

    window: int = 2
    margin: float = 1.0
    backoff: int = 16
    max_backoff: int = 256
    refresh_every: int = 64
    smoothing: float = 0.25
    probe_gamma: int | None = None
    spec_rate: float | None = field(default=None, init=False)  # committed tokens / s of speculative steps
    plain_step_s: float | None = field(default=None, init=False)  # seconds of one plain step
    _hold: int = field(default=0, init=False, repr=False)
    _current_backoff: int = field(default=0, init=False, repr=False)
    _since_decision: int = field(default=0, init=False, repr=False)
    _since_plain: int = field(default=0, init=False, repr=False)
    _steps: int = field(default=0, init=False, repr=False)
    _probing: bool = field(default=True, init=False, repr=False)
    _overhead: StepOverhead = field(default_factory=StepOverhead, init=False, repr=False)

    def __post_init__(self) -> None:
        self._current_backoff = self.backoff

    def limit(self, gamma: int) -> int:
        """The gamma to use next: 0 while holding, at most ``probe_gamma`` while on trial."""
        if self.holds():
            return 0
        return min(gamma, self.probe_gamma) if self._probing and self.probe_gamma is not None else gamma

    def holds(self) -> bool:
        """True when the next step must be plain (held back, or a plain measurement is due)."""
        if self._hold > 0:
            return True
        due = self.plain_step_s is None and self._steps >= 1
        return due or self._since_plain >= self.refresh_every

    def update(self, num_drafted, num_accepted, draft_time_s: float | None,
               verify_time_s: float | None) -> None:
        """Record one step (per-row counts); decide whether to hold plain decoding."""
        drafted, accepted = as_rows(num_drafted), as_rows(num_accepted)
        self._steps += 1
        if verify_time_s is None:
            return
        busy = (draft_time_s or 0.0) + verify_time_s
        self._overhead.observe(busy)
        rows = max(1, len(drafted))
        if sum(drafted) == 0:
            verify_time_s = verify_time_s / rows  # seconds per committed token of a plain step
            self.plain_step_s = _ema(self.plain_step_s, verify_time_s, self.smoothing)
            self._since_plain = 0
            self._hold = max(0, self._hold - 1)
            return
        self._since_plain += 1
        rate = (sum(accepted) + rows) / max(1e-9, busy + self._overhead.seconds)
        self.spec_rate = _ema(self.spec_rate, rate, self.smoothing)
        self._since_decision += 1
        if self._since_decision < self.window or self.plain_step_s is None:
            return
        self._since_decision = 0
        if self.spec_rate < self.margin / (self.plain_step_s + self._overhead.seconds):
            self._hold = self._current_backoff
            self._current_backoff = min(self.max_backoff, 2 * self._current_backoff)
            self.spec_rate = None  # the next probe is judged on its own steps
            self._probing = True
        else:
            self._current_backoff = self.backoff
            self._probing = False


# --------------------------------------------------------------------------- heuristic


class HeuristicPolicy(DraftLengthPolicy):
    """Hugging Face's schedule: +2 after a fully accepted step, -1 (not below 1) otherwise.

    (transformers ``AssistedCandidateGenerator.update_candidate_strategy``,
    ``num_assistant_tokens_schedule="heuristic"``.) A step whose proposer drafted
    nothing (e.g. no n-gram match) leaves gamma unchanged. Gamma is capped at
    ``max_tokens``.

    Args:
        num_speculative_tokens: starting gamma.
        max_tokens: cap (default :func:`default_max_tokens`).
        guard: add the :class:`PlainFallback` guard (True) or run the schedule alone.
    """

    name = "heuristic"

    def __init__(self, num_speculative_tokens: int = 5, max_tokens: int | None = None, guard: bool = True) -> None:
        self.gamma = _check_gamma("num_speculative_tokens", num_speculative_tokens)
        self.max_tokens = _check_gamma("max_tokens", max_tokens or default_max_tokens(num_speculative_tokens))
        self.gamma = min(self.gamma, self.max_tokens)
        self.guard = PlainFallback() if guard else None

    def next_length(self, batch_size: int = 1) -> int:
        return self.gamma if self.guard is None else self.guard.limit(self.gamma)

    def update(self, num_drafted, num_accepted, *, draft_time_s=None, verify_time_s=None,
               match_lengths=None) -> None:
        if self.guard is not None:
            self.guard.update(num_drafted, num_accepted, draft_time_s, verify_time_s)
        pairs = [(d, a) for d, a in zip(as_rows(num_drafted), as_rows(num_accepted)) if d > 0]
        if not pairs:
            return
        if all(a >= d for d, a in pairs):
            self.gamma = min(self.max_tokens, self.gamma + 2)
        else:
            self.gamma = max(1, self.gamma - 1)

    def __repr__(self) -> str:
        return f"HeuristicPolicy(gamma={self.gamma}, max={self.max_tokens}, guard={self.guard is not None})"


# --------------------------------------------------------------------------- confidence


class ConfidencePolicy(DraftLengthPolicy):
    """Draft up to ``max_tokens``; stop the chain when the draft becomes unsure.

    After each drafted token the proposer calls :attr:`should_continue` with the
    distribution q [V] that token was drawn from: drafting goes on while
    max(q) >= ``min_top_prob`` and (when ``max_entropy`` is set) the entropy of
    q in nats is <= ``max_entropy`` (an SVIP-style bound, Zhang et al. 2024).
    Deterministic drafters never call it: gamma is then ``max_tokens``.

    Args:
        max_tokens: the most tokens drafted per step.
        min_top_prob: threshold on the draft's top probability, in [0, 1].
        max_entropy: optional bound on the draft's entropy (nats).
        guard: add the :class:`PlainFallback` guard.

    Raises:
        SpecDecodeError: a threshold out of range.
    """

    name = "confidence"

    def __init__(self, max_tokens: int = 8, min_top_prob: float = 0.5, max_entropy: float | None = None,
                 guard: bool = True) -> None:
        self.max_tokens = _check_gamma("max_tokens", max_tokens)
        if not 0.0 <= min_top_prob <= 1.0:
            raise SpecDecodeError(f"min_top_prob must be in [0, 1], got {min_top_prob!r}")
        if max_entropy is not None and not max_entropy > 0:
            raise SpecDecodeError(f"max_entropy must be > 0 nats, got {max_entropy!r}")
        self.min_top_prob = float(min_top_prob)
        self.max_entropy = max_entropy
        self.guard = PlainFallback() if guard else None
        self.should_continue = self._confident

    def _confident(self, probs: torch.Tensor) -> bool:
        """probs [V] float32 -> keep drafting? (one host synchronisation per drafted token)."""
        if float(probs.max()) < self.min_top_prob:
            return False
        if self.max_entropy is not None:
            p = probs[probs > 0]
            if float(-(p * p.log()).sum()) > self.max_entropy:
                return False
        return True

    def next_length(self, batch_size: int = 1) -> int:
        return self.max_tokens if self.guard is None else self.guard.limit(self.max_tokens)

    def update(self, num_drafted, num_accepted, *, draft_time_s=None, verify_time_s=None,
               match_lengths=None) -> None:
        if self.guard is not None:
            self.guard.update(num_drafted, num_accepted, draft_time_s, verify_time_s)

    def __repr__(self) -> str:
        return (f"ConfidencePolicy(max={self.max_tokens}, min_top_prob={self.min_top_prob}, "
                f"max_entropy={self.max_entropy}, guard={self.guard is not None})")


# --------------------------------------------------------------------------- cost model


class CostModelPolicy(DraftLengthPolicy):
    """Choose gamma maximising expected committed tokens per second, from online measurements.

    The model is :mod:`specdecode.costmodel` (Leviathan et al. 2023, section 3.4, with measured
    costs over the batch size and per-position acceptance): gamma = argmax over 0..max_tokens of
    B * E(g) / (T_draft(B, g) + T_verify(B, g) + T_other), 0 being plain decoding.

    Exploration: the first ``warmup`` steps draft min(``num_speculative_tokens``, 2) tokens, then
    one plain step measures T_verify(B, 0); from then on the model decides. While the model picks 0,
    after ``probe_interval`` plain steps it probes: the acceptance evidence is discounted
    (x ``probe_discount``) and ``probe_steps`` steps draft the best positive gamma; if speculation
    still loses, the interval doubles (up to ``max_probe_interval``), else it resets. While
    speculating, a plain step every ``refresh_every`` steps keeps T_verify(B, 0) current, and every
    ``explore_every``-th speculative step drafts one token more than the model's choice. A batch
    size not measured yet gets one plain step first.

    Lookup drafters (n-gram: chains with a ``match_length``, nearly free to draft) are rated per draft
    instead: the policy asks for ``num_speculative_tokens`` and :meth:`trim` cuts the batch's chains to one
    length G (verification pads every row to the longest) that maximises sum_i E_i(min(G, n_i)) / T(B, G),
    where E_i comes from acceptance learned per match length m (1, 2, ..., ``match_buckets`` or more tokens
    matched) and position, and T(B, G) is a least-squares line through the measured step times (robust to
    the noise of any one length); every row keeps up to G tokens of its chain (one row alone: the prefix g
    maximising E_m(g) / T(1, g)); G = 0 (a plain step) when nothing pays, at most
    ``num_speculative_tokens``. Every ``explore_every``-th decision for a match length (x B in a batch of B)
    goes one token past the choice where that token could pay were its rate ``EXPLORE_MARGIN`` higher, and
    every 8 x ``explore_every``-th regardless, so a length once written off is measured again. A short match (one token) is
    mostly noise and a long one mostly a copy: one acceptance rate for both would draft too much after
    the first and too little after the second (on Spec-Bench's general prompts a fixed gamma 5 of prompt
    lookup lost 2-12% to plain decoding).

    Args:
        num_speculative_tokens: gamma before anything is measured.
        max_tokens: the largest gamma considered (default :func:`default_max_tokens`).
        decay: per-observation decay of the acceptance counts (0 < decay <= 1).
        match_buckets: match lengths told apart by :meth:`trim` (>= 1; the last bucket takes every longer match).

    Raises:
        SpecDecodeError: a value out of range.
    """

    name = "cost-model"

    def __init__(self, num_speculative_tokens: int = 5, max_tokens: int | None = None, *, decay: float = 0.95,
                 warmup: int = 1, probe_interval: int = 16, max_probe_interval: int = 256, probe_steps: int = 2,
                 probe_discount: float = 0.25, refresh_every: int = 64, explore_every: int = 8,
                 match_buckets: int = 4) -> None:
        self.initial = _check_gamma("num_speculative_tokens", num_speculative_tokens)
        self.max_tokens = _check_gamma("max_tokens", max_tokens or default_max_tokens(num_speculative_tokens))
        self.initial = min(self.initial, self.max_tokens)
        if not 0.0 < decay <= 1.0:
            raise SpecDecodeError(f"decay must be in (0, 1], got {decay!r}")
        if not isinstance(match_buckets, int) or match_buckets < 1:
            raise SpecDecodeError(f"match_buckets must be an integer >= 1, got {match_buckets!r}")
        self.decay = decay
        self.match_buckets = match_buckets
        self.by_match: dict[int, AcceptanceEstimate] = {}  # acceptance of lookup drafts per match-length bucket
        self._decisions: dict[int, int] = {}  # trim decisions per bucket (exploration)
        self._lookup = False  # trim() has been asked (chains with match lengths): it chooses each row's length
        self._plain_asked: set[int] = set()  # batch sizes a plain step to time was asked for
        self.warmup = warmup
        self.probe_interval = probe_interval
        self.max_probe_interval = max_probe_interval
        self.probe_steps = probe_steps
        self.probe_discount = probe_discount
        self.refresh_every = refresh_every
        self.explore_every = explore_every
        self.accept = AcceptanceEstimate(self.max_tokens, decay)
        self.t_draft = TimeTable(proportional=True)
        self.t_verify = TimeTable()
        self.overhead = StepOverhead()
        self._steps = 0
        self._plain_run = 0
        self._interval = probe_interval
        self._probe_left = 0
        self._since_plain = 0
        self._spec_steps = 0
        self._batch = 1

    # Model -----------------------------------------------------------------------

    def acceptance(self) -> list[float]:
        """Estimated c_i for positions 0..max_tokens-1 (conditional on reaching i)."""
        return self.accept.rates()

    def expected_tokens(self, gamma: int) -> float:
        """E(gamma): expected tokens committed by one row's step drafting gamma tokens."""
        return self.accept.expected_tokens(gamma)

    def rates(self, batch_size: int = 1) -> list[float] | None:
        """Predicted committed tokens per second for gamma = 0..max_tokens at ``batch_size`` rows;
        None until a plain step and a drafting step have both been timed."""
        return measured_rates(self.accept, self.t_draft, self.t_verify, self.overhead.seconds, batch_size,
                              self.max_tokens)

    # Policy ----------------------------------------------------------------------

    def next_length(self, batch_size: int = 1) -> int:
        self._batch = batch_size
        if self._steps < self.warmup:
            return min(self.initial, 2)
        # A plain step to time is asked once per batch size: a batch whose rows do not all follow the policy (a row
        # with speculation off or its own gamma) times no step, and must not be held at gamma 0 waiting for one.
        first_ask = batch_size not in self._plain_asked
        if not self.t_verify.has(batch_size, 0) and self.t_verify.points and self._plain_run == 0 \
                and self._since_plain >= 1 and first_ask:
            self._plain_asked.add(batch_size)
            return 0  # a batch size not measured yet: one plain step first
        if self._lookup:  # lookup drafts cost next to nothing: draft gamma, trim() keeps what pays per row
            # one plain step to time when this batch size has no line yet, and one every refresh_every steps
            if (self.t_verify.line(batch_size) is None and first_ask) or self._since_plain >= self.refresh_every:
                self._plain_asked.add(batch_size)
                return 0
            return self.initial
        rates = self.rates(batch_size)
        if rates is None:
            if self.t_verify(batch_size, 0) is None and first_ask:
                self._plain_asked.add(batch_size)
                return 0
            return self.initial
        best_spec = max(range(1, len(rates)), key=rates.__getitem__)
        if self._probe_left > 0:
            return best_spec
        if rates[best_spec] > rates[0]:
            if self._since_plain >= self.refresh_every:
                return 0
            self._spec_steps += 1
            if self._spec_steps % self.explore_every == 0 and best_spec < self.max_tokens:
                return best_spec + 1  # keep measuring the next length up: its cost may be overestimated
            return best_spec
        if self._plain_run >= self._interval:  # re-probe: acceptance may have changed
            self._probe_left = self.probe_steps
            self.accept.discount(self.probe_discount)
            return max(range(1, len(rates)), key=self.rates(batch_size).__getitem__)
        return 0

    #: (rate, weight): a lookup bucket starts as ``weight`` observations at ``rate`` per position, so the first
    #: drafts of a match length are verified (a copy runs on: prompt lookup's drafts are right in long runs or not
    #: at all) until its own evidence says otherwise; from an offline replay of Spec-Bench outputs.
    LOOKUP_PRIOR = (0.8, 2.0)

    def _bucket(self, match_length: int) -> int:
        return max(1, min(int(match_length), self.match_buckets))

    def _estimate(self, match_length: int) -> AcceptanceEstimate:
        """The acceptance of drafts found by a match of this length (its bucket's; a new bucket starts at the prior)."""
        key = self._bucket(match_length)
        if key not in self.by_match:
            self.by_match[key] = AcceptanceEstimate(self.max_tokens, self.decay, prior=self.LOOKUP_PRIOR)
        return self.by_match[key]

    def step_costs(self, batch_size: int = 1) -> list[float] | None:
        """Predicted seconds of a step of ``batch_size`` rows drafting g = 0..max_tokens tokens each (drafting and
        verification on their fitted lines, ``TimeTable.line``, and the per-step overhead); None until a plain
        step at that batch size (or the nearest measured one) and a drafting step have been timed."""
        line, drafting = self.t_verify.line(batch_size), self.t_draft.line(batch_size)
        if line is None or drafting is None:
            return None
        (a, b), (_, per_token) = line, drafting
        a += self.overhead.seconds
        return [a + (b + per_token) * g for g in range(self.max_tokens + 1)]

    #: How much higher than its estimate a bucket's next acceptance rate would have to be for a step of exploration
    #: to be worth it (trim): a match length that could not pay even so is not measured again.
    EXPLORE_MARGIN = 0.25

    def trim(self, lengths: list[int], match_lengths: list[int], batch_size: int, *, padded: int = 0) -> list[int]:
        """How much of each row's lookup draft to verify. A batch's verification pads every row to its longest
        (its step costs T(B, G), G the longest row's draft), so the rows are cut together: G maximises
        (sum_i E_i(min(G, n_i)) + the other rows) / T(B, max(G, padded)), E_i(g) = 1 + the expected accepted
        tokens of g drafted by a match of row i's length (m's bucket), and each row keeps min(n_i, max(G, padded))
        tokens: a token inside the padding costs nothing more. One row alone: the prefix maximising E_m(g) / T(1, g)
        (0: none pays). n_i <= ``num_speculative_tokens``; the step goes one token further every
        ``explore_every``-th decision of a bucket (every ``explore_every`` x B-th in a batch of B: there a token more
        costs B rows), the other rows riding along, where that token would pay were the bucket's rate there
        ``EXPLORE_MARGIN`` higher (and every 8 x that-th decision regardless); before the costs are measured, at
        most ``num_speculative_tokens``.

        Args:
            lengths, match_lengths: per row of the policy's, its draft's tokens and the length of the match
                that found it.
            batch_size: rows in the step (the policy's and the others).
            padded: the longest draft of the step's other rows (the step is padded to it whatever is cut here).

        Returns:
            per row, the tokens to keep, in [0, min(lengths[i], num_speculative_tokens)].

        Raises:
            SpecDecodeError: a negative length, or lengths and match lengths of different counts.
        """
        if len(lengths) != len(match_lengths) or any(int(n) < 0 for n in lengths):
            raise SpecDecodeError(f"trim: {len(lengths)} draft lengths (each >= 0) and {len(match_lengths)} match "
                                  f"lengths, one per row; got {list(lengths)}")
        self._lookup = True  # chains it may cut: from now on next_length asks for gamma and this method decides
        costs = self.step_costs(batch_size)
        caps = [min(int(n), self.initial) for n in lengths]
        if costs is None:
            return caps
        gains = [_expected_by_length(self._estimate(m).rates()[:n]) for n, m in zip(caps, match_lengths)]
        # rows outside the cut: counted as one token each (they may commit more: a slight lean to longer cuts)
        others = max(0, int(batch_size) - len(caps))
        floor = min(max(0, int(padded)), len(costs) - 1)
        best, best_rate = 0, -1.0
        for g in range(max(caps, default=0) + 1):
            tokens = others + sum(row[min(g, len(row) - 1)] for row in gains)
            rate = tokens / max(costs[max(g, floor)], 1e-12)
            if rate > best_rate:
                best, best_rate = g, rate
        padded_to = max(best, floor)
        for i, (n, m) in enumerate(zip(caps, match_lengths)):
            key = self._bucket(m)
            self._decisions[key] = seen = self._decisions.get(key, 0) + 1
            # keep measuring one token past the choice (it may pay by now): every explore_every-th decision of a
            # bucket alone, every (explore_every x B)-th in a batch of B, where one more token costs B more rows;
            # and only where it could pay were the bucket's next rate EXPLORE_MARGIN higher (hopeless: not measured)
            # (every 8 x that-th decision regardless: an estimate changes only when measured)
            g = min(n, max(best, floor) + 1)
            every = self.explore_every * max(1, int(batch_size))
            if self.explore_every and g > padded_to and seen % every == 0:
                bold = list(self._estimate(m).rates()[:g])
                bold[g - 1] = min(1.0, bold[g - 1] + self.EXPLORE_MARGIN)
                tokens = others + _expected_by_length(bold)[-1] + sum(row[min(g, len(row) - 1)] for j, row in enumerate(gains) if j != i)
                if tokens / max(costs[max(g, floor)], 1e-12) >= best_rate or seen % (8 * every) == 0:
                    padded_to = g
        return [min(n, padded_to) for n in caps]  # every row rides the step's padding

    def update(self, num_drafted, num_accepted, *, draft_time_s=None, verify_time_s=None,
               match_lengths=None) -> None:
        drafted, accepted = as_rows(num_drafted), as_rows(num_accepted)
        matched = [None] * len(drafted) if match_lengths is None else list(match_lengths)
        for d, a, m in zip(drafted, accepted, matched):
            if d > 0 and m is not None:
                self._estimate(m).observe(d, a)
        b = max(1, len(drafted))
        g = max(drafted, default=0)
        self._steps += 1
        if verify_time_s is not None:
            self.overhead.observe((draft_time_s or 0.0) + verify_time_s)
        if g <= 0:
            if verify_time_s is not None:
                self.t_verify.add(b, 0, verify_time_s)
            self._since_plain = 0
            self._plain_run += 1
            return
        self._since_plain += 1
        self._plain_run = 0
        for d, a in zip(drafted, accepted):
            if d > 0:
                self.accept.observe(d, a)
        if verify_time_s is not None:
            self.t_verify.add(b, g, verify_time_s)
        if draft_time_s is not None:
            self.t_draft.add(b, g, draft_time_s)
        if self._probe_left > 0:
            self._probe_left -= 1
            if self._probe_left == 0:
                rates = self.rates(b)
                wins = rates is not None and max(rates[1:]) > rates[0]
                self._interval = self.probe_interval if wins else min(self.max_probe_interval, 2 * self._interval)

    def __repr__(self) -> str:
        return f"CostModelPolicy(start={self.initial}, max={self.max_tokens}, decay={self.decay})"


def _expected_by_length(rates) -> list[float]:
    """E(g) for g = 0..len(rates): 1 (the token verification always commits) + the expected accepted drafts of a
    chain of g whose position j is kept with probability rates[j] given the ones before."""
    e, survive, out = 1.0, 1.0, [1.0]
    for rate in rates:
        survive *= rate
        e += survive
        out.append(e)
    return out


# --------------------------------------------------------------------------- registry


def drafts_by_lookup(proposer) -> bool:
    """Whether ``proposer`` drafts chains by lookup in the context (n-gram): nearly free to make, each with a
    ``match_length``, so a policy may draft gamma and trim (the proposer's ``drafts_by_lookup`` attribute)."""
    return bool(getattr(proposer, "drafts_by_lookup", False))


POLICIES: dict[str, Callable[..., DraftLengthPolicy]] = {
    "auto": lambda num_speculative_tokens=5, proposer=None, **kw: (  # (kw: the cost model's; fixed takes none)
        CostModelPolicy(num_speculative_tokens, **kw) if drafts_by_lookup(proposer)
        else FixedPolicy(num_speculative_tokens)),
    "fixed": lambda num_speculative_tokens=5, **kw: FixedPolicy(num_speculative_tokens, **kw),
    "heuristic": lambda num_speculative_tokens=5, **kw: HeuristicPolicy(num_speculative_tokens, **kw),
    "confidence": lambda num_speculative_tokens=5, max_tokens=None, **kw: ConfidencePolicy(
        max_tokens or default_max_tokens(num_speculative_tokens), **kw),
    "cost-model": lambda num_speculative_tokens=5, **kw: CostModelPolicy(num_speculative_tokens, **kw),
}


def build_policy(name: str, num_speculative_tokens: int = 5, *, proposer=None, **kwargs) -> DraftLengthPolicy:
    """Build a draft-length policy by name.

    Args:
        name: ``auto`` | ``fixed`` | ``heuristic`` | ``confidence`` | ``cost-model``.
        num_speculative_tokens: gamma for ``fixed``; the starting gamma of ``heuristic``
            and ``cost-model``; ``confidence`` drafts up to ``default_max_tokens(gamma)``.
        proposer: the drafter the policy serves (``auto`` chooses by it: :func:`drafts_by_lookup`).
        kwargs: passed to the policy's constructor (e.g. ``min_top_prob=0.6``, ``guard=False``).

    Raises:
        SpecDecodeError: unknown name (the message lists the choices), an option the policy does not take, or a
            value out of range.
    """
    key = check_policy_name(name)  # the names of POLICIES (options.POLICY_NAMES, kept equal by a test)
    _check_gamma("num_speculative_tokens", num_speculative_tokens)
    if key == "auto":
        kwargs["proposer"] = proposer
    try:
        return POLICIES[key](num_speculative_tokens, **kwargs)
    except TypeError as err:  # an option the policy does not take (the constructor's own message names it)
        options = ", ".join(sorted(k for k in kwargs if k != "proposer"))
        raise SpecDecodeError(f"the {key} policy does not take the option(s) {options}: {err}") from None
