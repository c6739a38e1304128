"""Draft-length policies: decisions on scripted feedback, the confidence hook, and the engine wiring."""

from __future__ import annotations

import time

import pytest
import torch

from specdecode.engine import EngineConfig, SpeculativeEngine
from specdecode.policy import (
    ConfidencePolicy,
    CostModelPolicy,
    FixedPolicy,
    HeuristicPolicy,
    PlainFallback,
    build_policy,
    default_max_tokens,
)
from specdecode.proposers import DraftModelProposer, LayerSkipConfig, LayerSkipProposer, NgramProposer
from specdecode.types import SamplingParams, SpecDecodeError
from tiny import tiny_llama

PLAIN_S = 0.010  # scripted seconds of one plain step (target forward on 1 token)


def verify_s(k: int) -> float:
    """Scripted T_verify(k): nearly flat, as after the few-row matmul fix."""
    return PLAIN_S * (1 + 0.05 * k)


def draft_s(k: int, per_token: float = 0.004) -> float:
    return per_token * k


def drive(policy, accepted_for, steps: int, per_token: float = 0.004) -> list[int]:
    """Run ``steps`` scripted steps; ``accepted_for(gamma)`` gives the accepted count. Returns the gammas chosen."""
    chosen = []
    for _ in range(steps):
        g = policy.next_length()
        chosen.append(g)
        a = accepted_for(g) if g else 0
        policy.update(g, a, draft_time_s=draft_s(g, per_token) if g else 0.0, verify_time_s=verify_s(g))
    return chosen


# --------------------------------------------------------------------------- fixed / heuristic


def test_fixed_policy_never_changes():
    p = FixedPolicy(4)
    assert drive(p, lambda g: 0, 10) == [4] * 10
    with pytest.raises(SpecDecodeError):
        FixedPolicy(0)


def test_heuristic_follows_hugging_face_schedule():
    p = HeuristicPolicy(5, max_tokens=9, guard=False)
    script = [(5, 5), (7, 7), (9, 2), (8, 8), (9, 9), (9, 0), (8, 0), (7, 0), (6, 0), (5, 0), (4, 0), (3, 0),
              (2, 0), (1, 0), (1, 1), (3, 3)]
    seen = []
    for drafted, accepted in script:
        g = p.next_length()
        seen.append(g)
        assert g == drafted
        p.update(drafted, accepted)
    assert p.next_length() == 5  # 3 fully accepted -> +2
    # the cap holds, gamma never goes below 1, and a step with nothing drafted changes nothing
    p.update(0, 0)
    assert p.next_length() == 5


def test_heuristic_counts_what_was_actually_drafted():
    p = HeuristicPolicy(5, guard=False)
    p.update(2, 2)  # the proposer drafted only 2 (short n-gram match), both kept: fully accepted
    assert p.next_length() == 7


def test_heuristic_guard_falls_back_to_plain_when_speculation_loses():
    p = HeuristicPolicy(4)
    # expensive draft (a full target forward per token) and nothing accepted: speculation loses
    chosen = drive(p, lambda g: 0, 200, per_token=PLAIN_S)
    assert chosen[0] == 4  # on trial at the policy's own gamma (probe_gamma None): a probe measures what it does
    assert chosen.count(0) > 150, chosen
    probes = [i for i in range(1, len(chosen)) if chosen[i] and not chosen[i - 1]]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]  # re-probes back off


def test_heuristic_guard_keeps_speculating_when_it_wins():
    p = HeuristicPolicy(4)
    chosen = drive(p, lambda g: g, 200, per_token=0.001)
    assert chosen.count(0) <= 1 + 200 // PlainFallback().refresh_every + 1
    assert max(chosen) == p.max_tokens
    assert chosen[0] == 4
    capped = HeuristicPolicy(4)
    capped.guard.probe_gamma = 1  # a guard may cap the gamma of its trials
    assert drive(capped, lambda g: g, 1)[0] == 1


@pytest.mark.parametrize("policy, floor", [("heuristic", 0.95), ("confidence", 0.95), ("cost-model", 0.95),
                                           ("confidence-uncapped", 0.75)])
def test_adaptive_policies_stay_near_plain_speed_when_nothing_is_accepted(policy, floor):
    """A costly drafter (85% of a target forward per token) whose tokens are never accepted: 3 x 96 steps.

    ``confidence`` probes with its guard capped at 1 token; ``confidence-uncapped`` (the default guard,
    probe_gamma None) probes at its whole cap of 8, each losing probe costing ~8 plain steps: 0.80 of
    plain decoding's speed in this worst case."""
    p = build_policy(policy.removesuffix("-uncapped"), 4)
    if policy == "confidence":
        p.guard.probe_gamma = 1
    tokens = seconds = 0.0
    for _ in range(3 * 96):
        g = p.next_length()
        d, v = draft_s(g, 0.85 * PLAIN_S), verify_s(g)
        p.update(g, 0, draft_time_s=d, verify_time_s=v)
        tokens += 1
        seconds += d + v
    assert tokens / seconds >= floor / PLAIN_S


# --------------------------------------------------------------------------- confidence


def test_confidence_hook_thresholds():
    p = ConfidencePolicy(max_tokens=6, min_top_prob=0.6, guard=False)
    assert p.next_length() == 6
    assert p.should_continue(torch.tensor([0.7, 0.2, 0.1]))
    assert not p.should_continue(torch.tensor([0.5, 0.3, 0.2]))
    e = ConfidencePolicy(max_tokens=6, min_top_prob=0.0, max_entropy=0.5, guard=False)
    assert e.should_continue(torch.tensor([0.95, 0.05, 0.0]))
    assert not e.should_continue(torch.tensor([0.4, 0.3, 0.3]))
    with pytest.raises(SpecDecodeError):
        ConfidencePolicy(min_top_prob=1.5)


def test_confidence_guard_falls_back_to_plain():
    p = ConfidencePolicy(max_tokens=8)
    chosen = drive(p, lambda g: 0, 120, per_token=PLAIN_S)
    assert chosen.count(0) > 90


# --------------------------------------------------------------------------- cost model


def test_cost_model_expected_tokens():
    p = CostModelPolicy(4, max_tokens=4)
    p.accept.hits = [80.0, 40.0, 0.0, 0.0]
    p.accept.trials = [100.0, 80.0, 0.0, 0.0]
    c = p.acceptance()
    assert c[0] == pytest.approx(0.8, abs=0.01) and c[1] == pytest.approx(0.5, abs=0.01)
    assert c[2] == c[1] == c[3]  # never reached: inherit the deepest estimate
    assert p.expected_tokens(0) == 1.0
    assert p.expected_tokens(2) == pytest.approx(1 + c[0] + c[0] * c[1])


def test_cost_model_picks_plain_when_acceptance_is_near_zero():
    p = CostModelPolicy(4)
    chosen = drive(p, lambda g: 0, 300)
    assert chosen[:2] == [2, 0]  # a cheap warm-up step, then one timed plain step
    assert chosen[-100:].count(0) >= 97  # plain decoding, with rare re-probes
    bursts = [i for i in range(2, len(chosen)) if chosen[i] and not chosen[i - 1]]  # a probe is a short burst
    assert len(bursts) >= 3, "it re-probes"
    gaps = [b - a for a, b in zip(bursts, bursts[1:])]
    assert all(b > a for a, b in zip(gaps, gaps[1:]))  # with growing intervals


def test_cost_model_drafts_long_when_everything_is_accepted_and_drafting_is_cheap():
    p = CostModelPolicy(2, max_tokens=12)
    chosen = drive(p, lambda g: g, 60, per_token=0.0005)
    assert chosen[-1] >= 10
    assert chosen[20:].count(0) <= 1


@pytest.mark.parametrize("acceptance, per_token, intercept", [
    (0.7, 0.3 * PLAIN_S, 0.0), (0.8, 0.1 * PLAIN_S, 0.0), (0.9, 0.02 * PLAIN_S, 0.0),
    (0.7, 0.15 * PLAIN_S, 0.4 * PLAIN_S),  # a draft whose first forward costs more (catch-up, setup)
])
def test_cost_model_is_within_5_percent_of_the_best_fixed_gamma(acceptance, per_token, intercept):
    """Scripted i.i.d. acceptance per position and scripted costs: compare realised tokens/s."""

    def draft_s(k, per_token):  # noqa: F811 - affine draft cost for this test
        return intercept + per_token * k if k else 0.0

    gen = torch.Generator().manual_seed(0)

    def accepted(g):
        n = 0
        while n < g and torch.rand(1, generator=gen).item() < acceptance:
            n += 1
        return n

    def rate(g):  # exact expected tokens per second of fixed gamma g
        tokens = (1 - acceptance ** (g + 1)) / (1 - acceptance)
        return tokens / (verify_s(g) + draft_s(g, per_token))

    best = max(rate(g) for g in range(0, 13))
    p = CostModelPolicy(4, max_tokens=12)
    tokens = seconds = 0.0
    for _ in range(1500):
        g = p.next_length()
        a = accepted(g) if g else 0
        d, v = (draft_s(g, per_token) if g else 0.0), verify_s(g)
        p.update(g, a, draft_time_s=d, verify_time_s=v)
        tokens += a + 1
        seconds += d + v
    assert tokens / seconds >= 0.95 * best


def test_cost_model_returns_to_speculation_when_acceptance_recovers():
    p = CostModelPolicy(4)
    drive(p, lambda g: 0, 100)
    assert p.next_length() == 0
    chosen = drive(p, lambda g: g, 400)
    assert chosen[-50:].count(0) <= 2


# --------------------------------------------------------------------------- registry and engine


def test_build_policy_by_name():
    assert isinstance(build_policy("fixed", 3), FixedPolicy)
    assert isinstance(build_policy("heuristic", 3), HeuristicPolicy)
    c = build_policy("confidence", 3, min_top_prob=0.7)
    assert isinstance(c, ConfidencePolicy) and c.max_tokens == default_max_tokens(3) and c.min_top_prob == 0.7
    assert isinstance(build_policy("Cost-Model", 3), CostModelPolicy)
    with pytest.raises(SpecDecodeError, match="choose one of"):
        build_policy("greedy")
    with pytest.raises(SpecDecodeError):
        build_policy("fixed", 0)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=64, seed=0, layers=4, scale=3.0)


@pytest.fixture(scope="module")
def draft():
    return tiny_llama(vocab_size=64, seed=1, layers=1, hidden=32, scale=3.0)


@pytest.mark.parametrize("policy", ["fixed", "heuristic", "confidence", "cost-model"])
@pytest.mark.parametrize("kind", ["ngram", "draft-model", "layer-skip"])
def test_every_policy_with_every_proposer_equals_plain_greedy(target, draft, policy, kind):
    make = {
        "ngram": lambda: NgramProposer(),
        "draft-model": lambda: DraftModelProposer(draft),
        "layer-skip": lambda: LayerSkipProposer(target, LayerSkipConfig(skip_layers=(1, 2))),
    }[kind]
    plain = SpeculativeEngine(target, None)
    spec = SpeculativeEngine(target, make(), EngineConfig(num_speculative_tokens=3), policy=build_policy(policy, 3))
    for prompt in ([1], [5, 9, 2, 5, 9], list(range(10, 30))):
        params = SamplingParams(max_new_tokens=40)
        out = spec.generate(prompt, params)
        assert out.token_ids == plain.generate(prompt, params).token_ids
        m = out.metrics
        assert len(m.draft_lengths) == m.num_verify_steps
        assert sum(m.draft_length_histogram.values()) == m.num_verify_steps
        assert m.mean_draft_length == pytest.approx(sum(m.draft_lengths) / len(m.draft_lengths))


def test_gamma_zero_steps_are_plain_steps(target):
    class Always0(FixedPolicy):
        def next_length(self, batch_size=1):
            return 0

    out = SpeculativeEngine(target, NgramProposer(), policy=Always0(1)).generate([3, 4, 3, 4, 3], SamplingParams(
        max_new_tokens=12))
    assert out.metrics.draft_lengths == [0] * 11 and out.metrics.num_drafted_tokens == 0
    assert out.metrics.draft_length_histogram == {0: 11}


def test_confidence_hook_shortens_draft_model_chains(target, draft):
    params = SamplingParams(max_new_tokens=40)
    sure = SpeculativeEngine(target, DraftModelProposer(draft), policy=ConfidencePolicy(6, min_top_prob=0.0,
                                                                                          guard=False))
    never = SpeculativeEngine(target, DraftModelProposer(draft), policy=ConfidencePolicy(6, min_top_prob=1.0,
                                                                                           guard=False))
    a, b = sure.generate([1, 2, 3], params), never.generate([1, 2, 3], params)
    assert a.token_ids == b.token_ids
    assert a.metrics.draft_lengths[:3] == [6, 6, 6]  # (later steps may be cut by max_new_tokens)
    assert set(b.metrics.draft_lengths) - {0} == {1}  # stops after the first token whatever the cap


def test_policy_receives_measured_times(target):
    class Recorder(FixedPolicy):
        def __init__(self):
            super().__init__(2)
            self.calls = []

        def update(self, num_drafted, num_accepted, *, draft_time_s=None, verify_time_s=None):
            self.calls.append((num_drafted, num_accepted, draft_time_s, verify_time_s))

    rec = Recorder()
    SpeculativeEngine(target, NgramProposer(), policy=rec).generate([7, 8, 7, 8], SamplingParams(max_new_tokens=8))
    assert rec.calls and all(d >= 0 and v > 0 for _, _, d, v in rec.calls)


def test_step_overhead_counts_time_between_updates_but_not_gaps():
    from specdecode.costmodel import StepOverhead

    o = StepOverhead()
    o.observe(0.015)
    time.sleep(0.02)
    o.observe(0.015)  # 20 ms between updates, 15 ms of them busy: about 5 ms of overhead
    assert 0.0 < o.seconds < 0.01
    before = o.seconds
    time.sleep(0.2)
    o.observe(0.015)  # a long gap (another request, a pause): not overhead
    assert o.seconds == before


def test_cost_model_counts_per_step_overhead():
    """Equal draft / verify costs; a large per-step overhead makes speculation pay where it otherwise would not."""
    lean, heavy = CostModelPolicy(2, max_tokens=6), CostModelPolicy(2, max_tokens=6)
    for p in (lean, heavy):
        p.t_verify.add(1, 0, PLAIN_S)  # batch size 1
        for k in range(1, 7):
            p.t_verify.add(1, k, verify_s(k))
            p.t_draft.add(1, k, draft_s(k, PLAIN_S))  # a draft token costs a whole target forward
        p.accept.hits, p.accept.trials = [6.0] * 6, [10.0] * 6  # acceptance 0.6
        p._steps = 10
    heavy.overhead.seconds = 4 * PLAIN_S
    assert lean.next_length() == 0
    assert heavy.next_length() > 0


def test_draft_model_catch_up_is_not_learned_as_per_token_draft_cost():
    """A draft model's first proposal prefills the prompt, and one after plain steps feeds the
    skipped tokens: that one-off time is reported as catch_up_s and kept out of the draft cost a
    policy learns (else one long prefill makes the cost model decode plainly for a long while)."""
    from specdecode.policy import FixedPolicy

    class Recording(FixedPolicy):
        def __init__(self):
            super().__init__(3)
            self.plan = [3] + [0] * 70 + [3, 3]  # speculate, 70 plain steps (> SOLO_FEED tokens), speculate again
            self.draft_times = []

        def next_length(self, batch_size=1) -> int:
            return self.plan.pop(0) if self.plan else 3

        def update(self, num_drafted, num_accepted, *, draft_time_s=None, verify_time_s=None) -> None:
            if sum(num_drafted):
                self.draft_times.append(draft_time_s)

    target = tiny_llama(seed=0)
    proposer = DraftModelProposer(tiny_llama(seed=1))
    catch_ups = []
    real_propose = proposer.propose

    def propose(batch, max_tokens):
        drafts = real_propose(batch, max_tokens)
        catch_ups.append(drafts[0].catch_up_s)
        return drafts

    proposer.propose = propose
    policy = Recording()
    engine = SpeculativeEngine(target, proposer, EngineConfig(num_speculative_tokens=3), policy=policy)
    engine.generate([i % 60 + 1 for i in range(120)], SamplingParams(max_new_tokens=90, ignore_eos=True))
    assert catch_ups[0] > 0  # the prompt's prefill in the draft
    # after 70 plain steps: more than DraftModelProposer.SOLO_FEED tokens to feed, fed alone and timed
    # (a few skipped tokens ride along in the batched draft forward and count as drafting)
    assert catch_ups[1] > 0
    assert all(c == 0 for c in catch_ups[2:])  # normal steps feed one or two tokens
    assert len(policy.draft_times) == len(catch_ups)


# --------------------------------------------------------------------------- lookup drafts: trim by match length


class ScriptedTrim(FixedPolicy):
    """Keeps lengths[i] = a scripted cycle of 0, 1, 2, ... tokens; records what trim and update saw."""

    def __init__(self, gamma: int, cycle=(0, 1, 2, 5)):
        super().__init__(gamma)
        self.cycle, self.calls, self.seen, self.updates = cycle, 0, [], []

    def trim(self, lengths, match_lengths, batch_size):
        self.seen.append((list(lengths), list(match_lengths), batch_size))
        keep = [min(n, self.cycle[(self.calls + i) % len(self.cycle)]) for i, n in enumerate(lengths)]
        self.calls += 1
        return keep

    def update(self, num_drafted, num_accepted, *, draft_time_s=None, verify_time_s=None, match_lengths=None):
        self.updates.append((num_drafted, match_lengths))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_trimmed_lookup_drafts_verify_their_prefix_and_commit_plain_decodings_tokens(target, temperature):
    """Greedy and seeded sampled output under a trimming policy equal plain decoding's (a prefix of a
    deterministic chain is verified exactly as the chain up to there); the drafts verified are the cut ones."""
    params = SamplingParams(max_new_tokens=40, temperature=temperature, seed=7)
    plain = SpeculativeEngine(target, None)
    policy = ScriptedTrim(5)
    spec = SpeculativeEngine(target, NgramProposer(), EngineConfig(num_speculative_tokens=5), policy=policy)
    for prompt in ([5, 9, 2, 5, 9], [3, 4, 5, 3, 4, 5, 3, 4], list(range(10, 30)) * 2):
        out = spec.generate(prompt, params)
        assert out.token_ids == plain.generate(prompt, params).token_ids
    assert policy.seen and all(1 <= m <= 3 for _, ms, _ in policy.seen for m in ms)  # n-gram sizes 1..3
    drafted = [d[0] for d, _ in policy.updates]
    assert 0 in drafted and 1 in drafted and max(drafted) <= 5
    assert all(ms == [None] for d, ms in policy.updates if d == [0])  # a row cut to nothing drafted nothing
    assert all(ms[0] in (1, 2, 3) for d, ms in policy.updates if d != [0])


def test_policies_without_a_trim_keep_every_draft_token_and_get_no_match_lengths(target):
    class Recorder(FixedPolicy):
        def __init__(self):
            super().__init__(4)
            self.drafted = []

        def update(self, num_drafted, num_accepted, *, draft_time_s=None, verify_time_s=None):  # the old signature
            self.drafted.extend(num_drafted)

    rec = Recorder()
    out = SpeculativeEngine(target, NgramProposer(), policy=rec).generate([3, 4, 5, 3, 4, 5, 3, 4],
                                                                          SamplingParams(max_new_tokens=20))
    assert out.metrics.num_drafted_tokens == sum(rec.drafted) and max(rec.drafted) >= 2


def _trained(accept_by_match: dict[int, float], steps: int = 400, per_token: float = 0.3) -> CostModelPolicy:
    """A cost-model policy fed scripted lookup steps: a row drafting g tokens by a match of m tokens keeps each
    token with probability accept_by_match[m] (given the ones before); a step of g tokens costs
    PLAIN_S * (1 + per_token * g)."""
    import random

    rng = random.Random(0)
    p = CostModelPolicy(5)
    for i in range(steps):
        m = list(accept_by_match)[i % len(accept_by_match)]
        g = p.next_length()
        if g:
            g = p.trim([g], [m], 1)[0]
        a = 0
        while a < g and rng.random() < accept_by_match[m]:
            a += 1
        p.update(g, a, draft_time_s=1e-5 * g, verify_time_s=PLAIN_S * (1 + per_token * g),
                 match_lengths=[m if g else None])
    return p


def test_cost_model_trims_each_match_length_by_its_own_acceptance():
    """One-token matches never right, four-token matches always right: the first are not verified at all
    (but for exploration), the second in full, from the same policy in the same steps."""
    p = _trained({1: 0.0, 4: 1.0})
    assert p._lookup and p.next_length() in (0, 5)
    decisions = [(p.trim([5], [1], 1)[0], p.trim([5], [4], 1)[0]) for _ in range(16)]  # each row a step alone
    assert [d[1] for d in decisions] == [5] * 16
    short = [d[0] for d in decisions]
    assert short.count(0) >= 14 and max(short) <= 1  # nothing, or one token to measure again
    assert p.by_match[4] is p._estimate(9)  # longer matches share the last bucket (match_buckets = 4)
    assert set(p.by_match) == {1, 4}


def test_cost_model_cuts_a_batch_together_and_lets_rows_ride_the_padding_for_free():
    """Verification pads every row to the longest: a row whose drafts are never right is cut to nothing alone, but
    beside a row that verifies 5 tokens it keeps them (they cost nothing more); beside other rows padded to 3 it
    keeps 3; a batch of rows that never pay is cut to nothing."""
    p = _trained({1: 0.0, 4: 1.0})
    p.explore_every = 0  # decisions without exploration
    assert p.trim([5], [1], 1) == [0] and p.trim([5], [4], 1) == [5]
    assert p.trim([5, 5], [1, 4], 2) == [5, 5]
    assert p.trim([5, 2], [1, 4], 2) == [2, 2]  # the good row has 2 tokens: the step is padded to 2
    assert p.trim([5], [1], 2, padded=3) == [3]
    assert p.trim([5, 5], [1, 1], 2) == [0, 0]
    assert p.trim([5, 5], [1, 1], 3, padded=9) == [5, 5]  # (padding past gamma: the longest cost measured)


def test_cost_model_explores_a_written_off_match_length_only_where_it_could_pay():
    """A one-token match never right: where a token costs 0.6 of a step, even a rate 0.25 higher would not pay, so it
    is never verified again; where a token costs 0.05, exploration measures it again now and then."""
    dear, cheap = _trained({1: 0.0}, per_token=0.6), _trained({1: 0.0}, per_token=0.05)
    assert max(dear.trim([5], [1], 1)[0] for _ in range(40)) == 0
    explored = [cheap.trim([5], [1], 1)[0] for _ in range(40)]
    assert max(explored) == 1 and explored.count(1) <= 6


def test_cost_model_in_a_batch_explores_every_8_x_b_decisions_with_the_other_rows_riding_along():
    """Two rows of one match length whose tokens could pay at a higher rate: exploration comes every 8 x 2 = 16th
    decision of the bucket (the 8th step of two rows), and then both rows keep the extra token; lengths that are
    negative or do not pair with match lengths are refused in one line."""
    p = _trained({2: 0.3}, per_token=0.3)
    p._decisions.clear()
    steps = [p.trim([5, 5], [2, 2], 2) for _ in range(16)]
    best = min(min(s) for s in steps)
    explored = [i for i, s in enumerate(steps) if s[0] > best]
    assert explored == [7, 15] and all(s[0] == s[1] for s in steps)
    with pytest.raises(SpecDecodeError, match="draft lengths"):
        p.trim([-1], [2], 1)
    with pytest.raises(SpecDecodeError, match="one per row"):
        p.trim([3, 3], [2], 2)


def test_cost_model_drafts_less_where_verifying_a_token_costs_more():
    cheap, dear = _trained({2: 0.6}, per_token=0.05), _trained({2: 0.6}, per_token=0.6)
    pick = lambda p: max(p.trim([5], [2], 1)[0] for _ in range(7))  # (7 decisions: no exploration among them)
    assert pick(cheap) > pick(dear)


def test_cost_model_before_any_timing_keeps_gamma_tokens():
    p = CostModelPolicy(3)
    assert p.step_costs() is None and p.trim([8, 2], [1, 1], 2) == [3, 2]
    with pytest.raises(SpecDecodeError, match="match_buckets"):
        CostModelPolicy(3, match_buckets=0)


class PaddedTrim(ScriptedTrim):
    def trim(self, lengths, match_lengths, batch_size, *, padded=0):
        self.seen.append((list(lengths), list(match_lengths), batch_size, padded))
        return [0 for _ in lengths]


def test_engine_tells_a_trim_that_takes_it_how_far_the_other_rows_pad_the_step(target):
    """A row with its own gamma (not the policy's) beside a policy row: the policy's trim hears the other row's draft
    length as ``padded`` (a trim without the keyword keeps working: ScriptedTrim above)."""
    from specdecode.config import RequestSpeculation

    policy = PaddedTrim(5)
    eng = SpeculativeEngine(target, NgramProposer(), EngineConfig(num_speculative_tokens=5, max_batch_size=2),
                            policy=policy)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    own, _ = eng.add([5, 6, 7, 5, 6, 7, 5, 6], params, speculation=RequestSpeculation(num_speculative_tokens=3))
    mine, _ = eng.add([3, 4, 5, 3, 4, 5, 3, 4], params)
    while mine.finish_reason is None or own.finish_reason is None:
        eng.step()
    assert policy.seen and all(len(s) == 4 and 0 <= s[3] <= 3 for s in policy.seen)
    assert any(s[2] == 2 and s[3] > 0 for s in policy.seen)  # (a row that finished first leaves a batch of one)
    assert all(s[3] == 0 for s in policy.seen if s[2] == 1)


def test_engine_rows_with_their_own_gamma_are_not_trimmed(target):
    from specdecode.config import RequestSpeculation

    policy = ScriptedTrim(5, cycle=(0,))
    eng = SpeculativeEngine(target, NgramProposer(), EngineConfig(num_speculative_tokens=5), policy=policy)
    req, _ = eng.add([3, 4, 5, 3, 4, 5, 3, 4], SamplingParams(max_new_tokens=20),
                     speculation=RequestSpeculation(num_speculative_tokens=2))
    while req.finish_reason is None:
        eng.step()
    assert not policy.seen and req.metrics.num_drafted_tokens > 0


def test_auto_is_the_cost_model_for_ngram_drafts_and_fixed_for_the_others(draft):
    from specdecode.proposers import SuffixProposer

    assert isinstance(build_policy("auto", 4, proposer=NgramProposer()), CostModelPolicy)
    for other in (None, DraftModelProposer(draft), SuffixProposer()):
        p = build_policy("auto", 4, proposer=other)
        assert isinstance(p, FixedPolicy) and p.num_speculative_tokens == 4
    assert isinstance(build_policy("AUTO ", 3, proposer=NgramProposer()), CostModelPolicy)


def test_cost_model_keeps_choosing_gamma_for_drafts_it_cannot_trim():
    """Suffix decoding's token trees carry a match length but are never trimmed: the policy keeps its own choice of
    gamma for them (lookup mode starts only once trim() is asked)."""
    p = CostModelPolicy(4)
    drive(p, lambda g: 0, 40)  # nothing accepted: the model chooses plain decoding
    for _ in range(5):
        p.update(3, 0, draft_time_s=1e-5, verify_time_s=verify_s(3), match_lengths=[2])
    assert not p._lookup and p.next_length() == 0


def test_a_bucket_seen_first_at_a_trim_starts_at_the_prior_not_at_the_pooled_rate():
    p = _trained({1: 0.0})
    assert 2 not in p.by_match
    p.trim([5], [2], 1)
    assert p.by_match[2].rates()[0] == pytest.approx(CostModelPolicy.LOOKUP_PRIOR[0], abs=0.05)


def test_lookup_mode_keeps_speculating_beside_rows_that_do_not_follow_the_policy(target):
    """A row with speculation off beside an n-gram row: the step's times are never the policy's to learn (not the
    whole batch), so no plain step can be timed; the n-gram row still drafts (was: plain decoding for good)."""
    from specdecode.config import RequestSpeculation

    eng = SpeculativeEngine(target, NgramProposer(), EngineConfig(num_speculative_tokens=4, max_batch_size=2),
                            policy=CostModelPolicy(4))
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    off, _ = eng.add([5, 6, 7, 5, 6, 7, 5, 6], params, speculation=RequestSpeculation(enabled=False))
    on, _ = eng.add([3, 4, 5, 3, 4, 5, 3, 4], params)
    while on.finish_reason is None:
        eng.step()
    assert on.metrics.num_drafted_tokens > 10 and off.metrics.num_drafted_tokens == 0
    assert on.generated == SpeculativeEngine(target, None).generate([3, 4, 5, 3, 4, 5, 3, 4], params).token_ids


def test_suffix_decodings_trees_leave_the_cost_model_its_own_choice_of_gamma(target):
    """Through the engine: suffix drafts (trees, or single chains) are never trimmed, so the policy never enters its
    lookup mode and keeps choosing gamma (0 when speculation loses) as for any drafter."""
    from specdecode.proposers import SuffixProposer

    policy = CostModelPolicy(4)
    eng = SpeculativeEngine(target, SuffixProposer(), EngineConfig(num_speculative_tokens=4), policy=policy)
    out = eng.generate([3, 4, 5, 3, 4, 5, 3, 4, 5, 3], SamplingParams(max_new_tokens=40))
    assert out.metrics.num_drafted_tokens > 0 and not policy._lookup


def test_policies_of_other_shapes_still_drive_the_engine(target):
    """A duck-typed policy (next_length / update only) and a cost-model subclass whose update predates
    match_lengths: the engine runs both (it passes match_lengths only to an update that takes it)."""
    class Duck:
        should_continue = None

        def next_length(self, batch_size=1):
            return 3

        def update(self, num_drafted, num_accepted, *, draft_time_s=None, verify_time_s=None):
            self.seen = num_drafted

    class OldCostModel(CostModelPolicy):
        def update(self, num_drafted, num_accepted, *, draft_time_s=None, verify_time_s=None):
            super().update(num_drafted, num_accepted, draft_time_s=draft_time_s, verify_time_s=verify_time_s)

    prompt, params = [3, 4, 5, 3, 4, 5, 3, 4], SamplingParams(max_new_tokens=30)
    want = SpeculativeEngine(target, None).generate(prompt, params).token_ids
    for policy in (Duck(), OldCostModel(4)):
        assert SpeculativeEngine(target, NgramProposer(), policy=policy).generate(prompt, params).token_ids == want


@pytest.mark.slow
def test_trimmed_lookup_drafts_keep_the_targets_distribution_in_the_standard_mode():
    """3 sampled tokens of 2,000 seeded requests (the standard rejection-sampling mode, not the coupled one), n-gram
    drafts cut by a scripted policy to 0, 1, 2 or 3 tokens: chi-square against the target's exact joint; the
    negative control, the same counts against another model's joint, fails."""
    import numpy as np

    from tiny import chi2_pvalue, exact_joint

    vocab, prompt = 5, [1, 2, 1, 2, 1]
    tgt = tiny_llama(vocab_size=vocab, seed=3, layers=1, hidden=32, scale=4.0)
    other = tiny_llama(vocab_size=vocab, seed=4, layers=1, hidden=32, scale=4.0)
    policy = ScriptedTrim(3, cycle=(0, 1, 2, 3))
    engine = SpeculativeEngine(tgt, NgramProposer(), EngineConfig(num_speculative_tokens=3, max_batch_size=64),
                               policy=policy)
    params = [SamplingParams(temperature=1.0, max_new_tokens=5, seed=s, coupled=False) for s in range(2000)]
    counts = np.zeros(vocab**3)
    for out in engine.generate_batch([prompt] * 2000, params):  # (5 tokens: drafts of up to 3; the first 3 counted)
        counts[np.ravel_multi_index(out.token_ids[:3], (vocab,) * 3)] += 1
    assert policy.seen and {n for d, _ in policy.updates for n in d} >= {0, 1, 2}  # it did cut
    assert chi2_pvalue(counts, exact_joint(tgt, prompt, 3, backend="owned")) > 1e-3
    assert chi2_pvalue(counts, exact_joint(other, prompt, 3, backend="owned")) < 1e-6


def test_build_policy_refuses_options_a_policy_does_not_take_and_names_that_are_no_strings():
    with pytest.raises(SpecDecodeError, match="fixed policy does not take the option.*bogus"):
        build_policy("fixed", 5, bogus=1)
    with pytest.raises(SpecDecodeError, match="cost-model policy does not take"):
        build_policy("cost-model", 5, bogus=1)
    with pytest.raises(SpecDecodeError, match="unknown draft-length policy 5"):
        build_policy(5)
    assert isinstance(build_policy("auto", 5, proposer=NgramProposer(), decay=0.9), CostModelPolicy)
