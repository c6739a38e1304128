"""The batched engine on tiny float64 models: every row equals its own single-request run.

Batch isolation is checked against :class:`~specdecode.engine.SpeculativeEngine`
(batch size 1, Hugging Face ``DynamicCache``): greedy and seeded sampled rows,
with rows joining and leaving between steps, each row accepting its own number
of tokens. Float64 keeps greedy ties from flipping between batch shapes.
"""

from __future__ import annotations

import threading

import pytest
import torch

from specdecode.batch import (
    BatchConfig,
    BatchEngine,
    BatchPolicyConfig,
    BatchRequest,
    BatchRunner,
    CostModelPolicy,
    QueueFullError,
    calibrate_forward_cost,
)
from specdecode.cache import CachedModel
from specdecode.engine import EngineConfig, SpeculativeEngine
from specdecode.proposers import DraftModelProposer, NgramConfig, NgramProposer
from specdecode.types import PromptTooLongError, SamplingParams
from tiny import tiny_llama

PROMPTS = [[1], [5, 9, 2], [3, 4, 5, 3, 4, 5, 3, 4], list(range(10, 30)), [7, 7, 7, 7], [40, 2, 40, 2, 40],
           [11, 12, 13, 11, 12, 13, 11], [60, 61]]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=64, seed=0, scale=3.0)


@pytest.fixture(scope="module")
def draft():
    return tiny_llama(vocab_size=64, seed=1, layers=1, hidden=32, scale=3.0)


def _factories(draft):
    return {
        "none": None,
        "ngram": lambda: NgramProposer(NgramConfig(1, 3)),
        "draft-model": lambda: DraftModelProposer(draft),
    }


def _mixed_params(i: int) -> SamplingParams:
    """Greedy and sampled rows with different temperature / top-k / top-p / lengths / EOS."""
    return SamplingParams(
        max_new_tokens=20 + 3 * i,
        temperature=0.0 if i % 2 == 0 else (0.7, 1.0, 1.3)[i % 3],
        top_k=(0, 8, 0)[i % 3], top_p=(1.0, 1.0, 0.9)[i % 3], seed=100 + i,
        eos_token_ids=(2,) if i % 4 == 3 else (),
    )


def _run_batch(engine: BatchEngine, prompts, params, **kw) -> list[list[int]]:
    outs = [[] for _ in prompts]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.submit(BatchRequest(p, sp, lambda ev, i=i: outs[i].extend(ev.token_ids), **kw))
    _drain(engine)
    return outs


def _drain(engine: BatchEngine, limit: int = 10_000) -> None:
    for _ in range(limit):
        if engine.step() is None and not engine.num_pending and not engine.num_active:
            return
    raise AssertionError("engine did not finish")


@pytest.mark.parametrize("kind", ["none", "ngram", "draft-model", "batched-draft-model"])
def test_each_row_equals_its_single_request_run(target, draft, kind):
    batched = kind == "batched-draft-model"
    factory = _factories(draft)["draft-model" if batched else kind]
    params = [_mixed_params(i) for i in range(len(PROMPTS))]
    expected = []
    for p, sp in zip(PROMPTS, params):
        single = SpeculativeEngine(target, factory() if factory else None, EngineConfig(num_speculative_tokens=4))
        expected.append(single.generate(p, sp).token_ids)
    # 3 slots for 8 requests: rows join and leave between steps, slots get compacted.
    cfg = BatchConfig(max_batch_size=3, num_speculative_tokens=4, adaptive=False)
    engine = (BatchEngine(target, None, cfg, draft_model=draft) if batched else BatchEngine(target, factory, cfg))
    assert _run_batch(engine, PROMPTS, params) == expected
    assert engine.num_active == 0 and engine.stats()["kv_cache_bytes"] == 0  # caches released when idle


def test_batched_draft_model_drafts_in_one_forward_per_position(target, draft):
    engine = BatchEngine(target, None, BatchConfig(max_batch_size=4, num_speculative_tokens=3, adaptive=False),
                         draft_model=draft)
    calls = []
    real = engine.draft_model.runner.forward
    engine.draft_model.runner.forward = lambda rows, ids, last_only=False: (
        calls.append((rows.stop - rows.start, last_only)), real(rows, ids, last_only))[1]
    for i in range(4):
        engine.submit(BatchRequest(PROMPTS[3 + i], SamplingParams(max_new_tokens=30), lambda ev: None))
    engine.step()  # admits 4 (target prefills) and runs one step
    batched = [n for n, last in calls if not last]
    assert batched == [4, 4, 4]  # catch-up feed (+ the first draft position), then 2 more positions
    # prompts longer than SOLO_FEED were fed alone first
    assert sum(1 for n, last in calls if last) == sum(len(PROMPTS[3 + i]) > 9 for i in range(4))


def test_ragged_acceptance_happens(target):
    """Rows of one step accept different numbers of tokens (the case the per-row lengths exist for)."""
    seen = []
    engine = BatchEngine(target, lambda: DraftModelProposer(target), BatchConfig(max_batch_size=4,
                         num_speculative_tokens=4, adaptive=False))
    engine.on_step = lambda s: seen.append(s)
    per_row = []
    params = [SamplingParams(max_new_tokens=30, temperature=0.0 if i % 2 else 1.5, seed=i) for i in range(4)]
    for i in range(4):
        engine.submit(BatchRequest(PROMPTS[i], params[i], lambda ev, i=i: per_row.append((i, ev.num_accepted))))
    _drain(engine)
    assert any(s.batch_size == 4 for s in seen)
    by_step = {}
    for i, n in per_row:
        by_step.setdefault(i, []).append(n)
    # self-drafting accepts everything greedily; temperature 1.5 rejects sometimes
    assert set(by_step[1]) == {4} or max(by_step[1]) == 4
    assert min(by_step[0]) < 4


def test_rollback_contract_cache_equals_fresh_prefill(target):
    """After steps with rejections, each row's cached keys/values equal a prefill of its committed tokens."""
    engine = BatchEngine(target, lambda: NgramProposer(NgramConfig(1, 3)),
                         BatchConfig(max_batch_size=3, num_speculative_tokens=4, adaptive=False))
    for i in range(3):
        engine.submit(BatchRequest(PROMPTS[i + 2], SamplingParams(max_new_tokens=60, temperature=1.0, seed=i),
                                   lambda ev: None))
    for _ in range(6):
        engine.step()
    cache = engine.runner.cache
    assert engine.num_active == 3
    for slot, row in enumerate(engine.rows):
        n = cache.lengths[slot]
        assert n == len(row.ctx.token_ids) - 1
        fresh = CachedModel(target)
        fresh.forward(row.ctx.token_ids[:n])
        for layer, (k, v) in enumerate(fresh.layer_tensors()):
            torch.testing.assert_close(cache.keys[layer][slot, :, :n], k[0], rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(cache.values[layer][slot, :, :n], v[0], rtol=1e-9, atol=1e-9)


def test_alone_and_in_a_mixed_batch_are_identical(target, draft):
    """The same request alone and among others with different settings, in the batch engine itself."""
    probe = (PROMPTS[2], SamplingParams(max_new_tokens=40, temperature=0.0))
    probe_sampled = (PROMPTS[3], SamplingParams(max_new_tokens=40, temperature=0.9, top_k=20, seed=7))
    cfg = BatchConfig(max_batch_size=6, num_speculative_tokens=3, adaptive=False)
    builders = [lambda f=f: BatchEngine(target, f, cfg) for f in _factories(draft).values()]
    builders.append(lambda: BatchEngine(target, None, cfg, draft_model=draft))
    for build in builders:
        alone = [_run_batch(build(), [p], [sp])[0] for p, sp in (probe, probe_sampled)]
        others = [(PROMPTS[i], _mixed_params(i)) for i in (0, 4, 5, 6)]
        prompts = [probe[0], probe_sampled[0], *(p for p, _ in others)]
        params = [probe[1], probe_sampled[1], *(sp for _, sp in others)]
        mixed = _run_batch(build(), prompts, params)
        assert mixed[:2] == alone


def test_logprobs_are_the_targets(target):
    engine = BatchEngine(target, lambda: NgramProposer(), BatchConfig(max_batch_size=2, adaptive=False))
    events = []
    engine.submit(BatchRequest(PROMPTS[2], SamplingParams(max_new_tokens=12), events.append, logprobs=3))
    _drain(engine)
    ids = [t for ev in events for t in ev.token_ids]
    lps = [x for ev in events for x in ev.logprobs]
    tops = [x for ev in events for x in ev.top_logprobs]
    full = torch.tensor([PROMPTS[2] + ids])
    with torch.no_grad():
        ref = torch.log_softmax(target(full).logits[0].float(), -1)[len(PROMPTS[2]) - 1: -1]
    want = ref.gather(1, torch.tensor(ids).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor(lps), want, rtol=1e-5, atol=1e-5)
    assert all(len(t) == 3 and t[0][0] == ids[j] for j, t in enumerate(tops))  # greedy: the top token is chosen


def test_cancel_frees_the_slot_and_others_continue(target):
    params = [SamplingParams(max_new_tokens=40) for _ in range(3)]
    expected = _run_batch(BatchEngine(target, None, BatchConfig(max_batch_size=3)), PROMPTS[:3], params)
    engine = BatchEngine(target, None, BatchConfig(max_batch_size=3))
    outs = [[] for _ in range(3)]
    ends = {}
    reqs = [engine.submit(BatchRequest(PROMPTS[i], params[i], lambda ev, i=i: (
        outs[i].extend(ev.token_ids), ev.finished and ends.setdefault(i, ev.finish_reason)))) for i in range(3)]
    for _ in range(5):
        engine.step()
    engine.cancel(reqs[0])  # slot 0 is refilled with the last row's cache
    _drain(engine)
    assert ends[0] == "cancelled" and outs[0] == expected[0][: len(outs[0])]
    assert outs[1:] == expected[1:]
    assert engine.num_active == 0 and engine.runner.cache.nbytes == 0


def test_queue_is_bounded_and_prompts_checked(target):
    engine = BatchEngine(target, None, BatchConfig(max_batch_size=1, max_queue=2))
    for _ in range(3):  # one for the free slot, two waiting
        engine.submit(BatchRequest([1, 2], SamplingParams(max_new_tokens=2), lambda ev: None))
    with pytest.raises(QueueFullError, match="max-queue"):
        engine.submit(BatchRequest([1, 2], SamplingParams(max_new_tokens=2), lambda ev: None))
    with pytest.raises(PromptTooLongError, match="lower max_tokens"):
        engine.submit(BatchRequest([1] * 200, SamplingParams(max_new_tokens=100), lambda ev: None))
    _drain(engine)


def test_engine_failure_ends_running_requests_and_keeps_serving(target, monkeypatch):
    engine = BatchEngine(target, None, BatchConfig(max_batch_size=2))
    events = []
    engine.submit(BatchRequest([1, 2, 3], SamplingParams(max_new_tokens=30), events.append))
    engine.step()
    real = engine.runner.forward
    monkeypatch.setattr(engine.runner, "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    engine.step()
    assert events[-1].finished and events[-1].finish_reason == "error" and "boom" in events[-1].error
    monkeypatch.setattr(engine.runner, "forward", real)
    out = _run_batch(engine, [[1, 2, 3]], [SamplingParams(max_new_tokens=5)])
    assert len(out[0]) == 5


def test_a_failing_prefill_fails_only_its_request(target, monkeypatch):
    engine = BatchEngine(target, None, BatchConfig(max_batch_size=3))
    events = {0: [], 1: []}
    engine.submit(BatchRequest([1, 2, 3], SamplingParams(max_new_tokens=20), events[0].append))
    engine.step()
    real = engine.runner.forward

    def fail_prefill(rows, token_ids, last_only=False):
        if last_only:
            raise RuntimeError("bad prompt")
        return real(rows, token_ids, last_only)

    monkeypatch.setattr(engine.runner, "forward", fail_prefill)
    engine.submit(BatchRequest([4, 5], SamplingParams(max_new_tokens=20), events[1].append))
    _drain(engine)
    assert events[1][-1].finish_reason == "error" and "bad prompt" in events[1][-1].error
    assert events[0][-1].finish_reason == "length" and sum(len(e.token_ids) for e in events[0]) == 20


def test_background_thread_serves_concurrent_submitters(target):
    engine = BatchEngine(target, lambda: NgramProposer(), BatchConfig(max_batch_size=4, adaptive=False))
    expected = _run_batch(BatchEngine(target, None, BatchConfig(max_batch_size=1)), PROMPTS[:6],
                          [SamplingParams(max_new_tokens=25)] * 6)
    engine.start()
    try:
        outs = [[] for _ in range(6)]
        done = [threading.Event() for _ in range(6)]

        def go(i):
            def on_event(ev):
                outs[i].extend(ev.token_ids)
                if ev.finished:
                    done[i].set()
            engine.submit(BatchRequest(PROMPTS[i], SamplingParams(max_new_tokens=25), on_event))

        threads = [threading.Thread(target=go, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        assert all(d.wait(30) for d in done)
        assert outs == expected
    finally:
        engine.close()


# --------------------------------------------------------------------------- draft-length policy


def test_cost_model_turns_speculation_off_when_verification_is_compute_bound():
    linear = [(n, 0.001 * n) for n in (1, 8, 64)]  # every token costs the same: drafts only cost
    flat = [(1, 0.05), (64, 0.051)]  # bandwidth-bound: extra tokens are almost free
    cfg = BatchPolicyConfig(max_gamma=5, prior_acceptance=0.5)
    assert CostModelPolicy(cfg, linear).choose(8) == 0
    assert CostModelPolicy(cfg, flat).choose(8) == 5
    fixed = CostModelPolicy(BatchPolicyConfig(max_gamma=5, adaptive=False), linear)
    assert fixed.choose(8) == 5


def test_cost_model_follows_measured_acceptance_and_probes():
    curve = [(1, 0.050), (2, 0.052), (6, 0.060), (12, 0.090), (24, 0.150), (48, 0.300)]
    policy = CostModelPolicy(BatchPolicyConfig(max_gamma=5, probe_every=4), curve)
    for _ in range(50):
        policy.update([5], [5])  # everything accepted
    assert policy.choose(1) == 5
    for _ in range(200):
        policy.update([5, 5], [0, 0])  # nothing accepted
    gammas = [policy.choose(4) for _ in range(8)]
    assert gammas.count(0) == 6 and gammas.count(5) == 2  # off, with a probe every 4th step


def test_cost_model_rates_bursty_drafts_by_position():
    """Prompt lookup keeps whole runs or nothing: 30% of steps keep all 5, 70% keep none."""
    policy = CostModelPolicy(BatchPolicyConfig(max_gamma=5), [(1, 0.040), (6, 0.046)])
    for step in range(300):
        policy.update([5], [5 if step % 10 < 3 else 0])
    assert abs(policy.expected_tokens(5) - 2.5) < 0.2  # 1 + 5 * 0.3 (decayed), where one rate (0.3) gives 1.43
    assert policy.choose(1) == 5


def test_calibration_is_monotone(target):
    points = calibrate_forward_cost(BatchRunner(target, 1, 256), 24, repeats=1)
    assert [n for n, _ in points][0] == 1 and points[-1][0] == 24
    assert all(a[1] <= b[1] for a, b in zip(points, points[1:]))


# --------------------------------------------------------------------------- rows at the end of a context


def _run_events(engine: BatchEngine, prompts, params) -> list[list]:
    events = [[] for _ in prompts]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.submit(BatchRequest(p, sp, events[i].append))
    _drain(engine)
    return events


@pytest.mark.parametrize("kind", ["self-draft", "batched-self-draft"])
def test_a_row_reaching_the_context_finishes_alone(kind):
    """Rows whose prompt + max_new_tokens fill the context end with "length" while the others draft on.

    A row at its last position feeds one token while the others feed gamma + 1 (or a new row's
    8-token catch-up in the batched draft model): its padding lands past the context. That used to
    fail the whole step, every row ending with an error.
    """
    tgt = tiny_llama(vocab_size=64, seed=0, scale=3.0, max_positions=32)
    def factory():  # drafts every token it may: the most padding
        return DraftModelProposer(tgt)

    prompts = [list(range(1, 21)), [3, 4], [5, 9, 2, 5, 9, 2, 5], [11, 12, 13, 11, 12, 13, 11]]
    params = [SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=24, temperature=1.0, seed=3),
              SamplingParams(max_new_tokens=25), SamplingParams(max_new_tokens=25, temperature=0.8, seed=4)]
    expected = [SpeculativeEngine(tgt, factory(), EngineConfig(num_speculative_tokens=4)).generate(p, sp).token_ids
                for p, sp in zip(prompts, params)]
    cfg = BatchConfig(max_batch_size=3, num_speculative_tokens=4, adaptive=False)
    engine = (BatchEngine(tgt, None, cfg, draft_model=tgt) if kind == "batched-self-draft"
              else BatchEngine(tgt, factory, cfg))
    events = _run_events(engine, prompts, params)
    assert [e[-1].error for e in events] == [None] * 4
    assert [e[-1].finish_reason for e in events] == ["length"] * 4
    assert [sum((ev.token_ids for ev in e), []) for e in events] == expected
    assert [len(p) + len(x) for p, x in zip(prompts, expected)] == [32, 26, 32, 32]  # three rows fill the context


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batched_draft_with_a_shorter_context_stops_drafting_where_it_ends(target, temperature):
    """A 16-position draft under a 256-position target: each row drafts only what fits the draft's context,
    then decodes plainly, exactly like a single-sequence run with the same draft."""
    short = tiny_llama(vocab_size=64, seed=0, scale=3.0, max_positions=16)  # the target's weights
    prompts = [[1], [5, 9, 2], list(range(10, 30)), [7, 7, 7, 7]]
    params = [SamplingParams(max_new_tokens=30, temperature=temperature, seed=i) for i in range(4)]
    expected = [SpeculativeEngine(target, DraftModelProposer(short), EngineConfig(num_speculative_tokens=4))
                .generate(p, sp).token_ids for p, sp in zip(prompts, params)]
    engine = BatchEngine(target, None, BatchConfig(max_batch_size=3, num_speculative_tokens=4, adaptive=False),
                         draft_model=short)
    events = _run_events(engine, prompts, params)
    assert [sum((ev.token_ids for ev in e), []) for e in events] == expected
    for prompt, evs in zip(prompts, events):
        length = len(prompt)
        for ev in evs:
            assert ev.num_drafted <= max(0, 16 - length + 1)  # drafts and fed tokens fit 16 positions
            length += len(ev.token_ids)
        # the 20-token prompt never fits the draft: plain decoding throughout
        assert evs[-1].num_drafted == 0 and (evs[-1].metrics.num_drafted_tokens > 0) == (len(prompt) < 16)
