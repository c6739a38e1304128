"""The scheduler over the one engine, on tiny float64 models: every row equals its own single-request run.

Batch isolation is checked against :meth:`SpeculativeEngine.generate` with batch size 1: greedy
and seeded sampled rows, with rows joining and leaving between steps (3 slots, 8 requests),
each row accepting its own number of tokens. Float64 keeps greedy ties from flipping between
batch shapes. Drafters are built through ``proposers.factory`` (the server's and the CLI's path).
"""

from __future__ import annotations

import threading

import pytest
import torch

from specdecode.engine import EngineConfig, SpeculativeEngine
from specdecode.kv import make_runner
from specdecode.proposers import DraftModelProposer, NgramConfig, NgramProposer
from specdecode.proposers.factory import factory_from_spec
from specdecode.scheduler import BatchRequest, EngineStoppedError, QueueFullError, Scheduler
from specdecode.spec import DrafterSpec
from specdecode.types import PromptTooLongError, SamplingParams
from tiny import tiny_llama

PROMPTS = [[1], [5, 9, 2], [3, 4, 5, 3, 4, 5, 3, 4], list(range(10, 30)), [7, 7, 7, 7], [40, 2, 40, 2, 40],
           [11, 12, 13, 11, 12, 13, 11], [60, 61]]

#: Drafter choices and their flags (``--draft`` and the others, read by ``DrafterSpec.from_settings``); "draft"
#: names the draft model.
CHAIN_DRAFTERS = {
    "none": ("none", {}),
    "ngram": ("ngram", {}),
    "draft-model": ("draft", {}),
    "layer-skip": ("layer-skip", {"skip_layers": (1,)}),
}
TREE_DRAFTERS = {
    "suffix": ("suffix", {}),
    "suffix:ngram": ("suffix:ngram", {}),
    "tree-dynamic": ("draft", {"tree": "dynamic", "tree_nodes": 8}),
    "tree-static": ("draft", {"tree": "static", "tree_nodes": 8}),
}


def _factory(kind: str, target, draft):
    """A zero-argument proposer factory for a drafter kind, or None (plain decoding)."""
    choice, options = {**CHAIN_DRAFTERS, **TREE_DRAFTERS}[kind]
    return factory_from_spec(DrafterSpec.from_settings({"draft": choice, **options}), target=target, draft=draft)


def _engine(target, factory, batch: int, gamma: int = 4) -> SpeculativeEngine:
    return SpeculativeEngine(target, factory() if factory else None,
                             EngineConfig(num_speculative_tokens=gamma, max_batch_size=batch))


def _scheduler(target, factory, batch: int, gamma: int = 4, **kw) -> Scheduler:
    return Scheduler(_engine(target, factory, batch, gamma), **kw)


def _mixed_params(i: int) -> SamplingParams:
    """Greedy and sampled rows with different temperature / top-k / top-p / lengths / EOS."""
    return SamplingParams(
        max_new_tokens=12 + 2 * i,
        temperature=0.0 if i % 2 == 0 else (0.7, 1.0, 1.3)[i % 3],
        top_k=(0, 8, 0)[i % 3], top_p=(1.0, 1.0, 0.9)[i % 3], seed=100 + i,
        eos_token_ids=(2,) if i % 4 == 3 else (),
    )


def _run_batch(scheduler: Scheduler, prompts, params, **kw) -> list[list[int]]:
    outs = [[] for _ in prompts]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        scheduler.submit(BatchRequest(p, sp, lambda ev, i=i: outs[i].extend(ev.token_ids), **kw))
    _drain(scheduler)
    return outs


def _run_events(scheduler: Scheduler, prompts, params) -> list[list]:
    events = [[] for _ in prompts]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        scheduler.submit(BatchRequest(p, sp, events[i].append))
    _drain(scheduler)
    return events


def _drain(scheduler: Scheduler, limit: int = 10_000) -> None:
    for _ in range(limit):
        if scheduler.step() is None and not scheduler.num_pending and not scheduler.num_active:
            return
    raise AssertionError("scheduler did not finish")


def _solo(target, factory, prompt, params, gamma: int = 4) -> list[int]:
    return _engine(target, factory, 1, gamma).generate(prompt, params).token_ids


@pytest.fixture(scope="module")
def plain_mixed(target) -> list[list[int]]:
    """Plain decoding of PROMPTS with ``_mixed_params``, one request at a time."""
    return [_solo(target, None, p, _mixed_params(i)) for i, p in enumerate(PROMPTS)]


# --------------------------------------------------------------------------- batch isolation


@pytest.mark.parametrize("kind", list(CHAIN_DRAFTERS))
def test_each_row_equals_its_single_request_run(target, draft, plain_mixed, kind):
    factory = _factory(kind, target, draft)
    params = [_mixed_params(i) for i in range(len(PROMPTS))]
    expected = plain_mixed if factory is None else [_solo(target, factory, p, sp) for p, sp in zip(PROMPTS, params)]
    # 3 slots for 8 requests: rows join and leave between steps, slots get compacted.
    scheduler = _scheduler(target, factory, batch=3)
    assert _run_batch(scheduler, PROMPTS, params) == expected
    assert scheduler.num_active == 0 and scheduler.engine.runner.nbytes == 0  # caches released when idle
    draft_runner = getattr(scheduler.engine.proposer, "runner", None)
    assert draft_runner is None or draft_runner.nbytes == 0


@pytest.mark.parametrize("kind", list(TREE_DRAFTERS))
def test_tree_drafters_in_a_batch_are_lossless(target, draft, plain_mixed, kind):
    """Token trees (suffix decoding, draft-model trees) in a batch of 3: greedy rows equal plain decoding,
    sampled rows run to their length (their draws depend on the tree, and suffix's global trie on the others)."""
    factory = _factory(kind, target, draft)
    params = [_mixed_params(i) for i in range(len(PROMPTS))]
    plain = plain_mixed
    scheduler = _scheduler(target, factory, batch=3)
    assert scheduler.engine.trees
    events = _run_events(scheduler, PROMPTS, params)
    outs = [[t for ev in evs for t in ev.token_ids] for evs in events]
    for i, sp in enumerate(params):
        assert events[i][-1].error is None
        if sp.greedy:
            assert outs[i] == plain[i]
        elif not sp.eos_token_ids:
            assert len(outs[i]) == sp.max_new_tokens
    assert sum(evs[-1].metrics.num_accepted_tokens for evs in events) > 0


def test_batched_draft_model_drafts_in_one_forward_per_position(target, draft):
    scheduler = _scheduler(target, lambda: DraftModelProposer(draft), batch=4, gamma=3)
    runner = scheduler.engine.proposer.runner
    calls = []
    real = runner.forward
    runner.forward = lambda rows, ids, last_only=False: (calls.append(rows.stop - rows.start), real(rows, ids,
                                                                                                    last_only))[1]
    prompts = PROMPTS[3:7]
    for p in prompts:
        scheduler.submit(BatchRequest(p, SamplingParams(max_new_tokens=30), lambda ev: None))
    scheduler.step()  # admits 4 (target prefills) and runs one step
    # rows lacking more than SOLO_FEED tokens (a prompt + its first token) are fed alone first
    solo = sum(len(p) + 1 > DraftModelProposer.SOLO_FEED for p in prompts)
    assert calls.count(1) == solo
    assert [n for n in calls if n > 1] == [4, 4, 4]  # catch-up feed (+ the first draft position), 2 more positions


def test_ragged_acceptance_happens(target):
    """Rows of one step accept different numbers of tokens (the case the per-row lengths exist for)."""
    seen = []
    scheduler = _scheduler(target, lambda: DraftModelProposer(target), batch=4, on_step=seen.append)
    per_row = []
    params = [SamplingParams(max_new_tokens=30, temperature=0.0 if i % 2 else 1.5, seed=i) for i in range(4)]
    for i in range(4):
        scheduler.submit(BatchRequest(PROMPTS[i], params[i], lambda ev, i=i: per_row.append((i, ev.num_accepted))))
    _drain(scheduler)
    assert any(s.batch_size == 4 for s in seen)
    by_step = {}
    for i, n in per_row:
        by_step.setdefault(i, []).append(n)
    # self-drafting accepts everything greedily; temperature 1.5 rejects sometimes
    assert max(by_step[1]) == 4
    assert min(by_step[0]) < 4


@pytest.mark.parametrize("kind", ["ngram", "suffix"])
def test_rollback_contract_cache_equals_fresh_prefill(target, draft, kind):
    """After steps with rejections, each row's cached keys/values equal a prefill of its committed tokens."""
    scheduler = _scheduler(target, _factory(kind, target, draft), batch=3)
    for i in range(3):
        scheduler.submit(BatchRequest(PROMPTS[i + 2], SamplingParams(max_new_tokens=60, temperature=1.0, seed=i),
                                      lambda ev: None))
    for _ in range(6):
        scheduler.step()
    runner = scheduler.engine.runner
    assert scheduler.num_active == 3
    for slot, row in enumerate(scheduler.engine.rows):
        n = runner.length(slot)
        assert n == len(row.ctx.token_ids) - 1 and runner.ids[slot] == row.ctx.token_ids[:n]
        fresh = make_runner(target, "auto", 1)
        fresh.forward(slice(0, 1), [row.ctx.token_ids[:n]])
        for (k, v), (k2, v2) in zip(runner.layer_tensors(slot), fresh.layer_tensors(0)):
            torch.testing.assert_close(k, k2, rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(v, v2, rtol=1e-9, atol=1e-9)


def test_alone_and_in_a_mixed_batch_are_identical(target, draft):
    """The same request alone and among others with different settings, in the scheduler itself."""
    probe = (PROMPTS[2], SamplingParams(max_new_tokens=24, temperature=0.0))
    probe_sampled = (PROMPTS[3], SamplingParams(max_new_tokens=24, temperature=0.9, top_k=20, seed=7))
    for kind in CHAIN_DRAFTERS:
        factory = _factory(kind, target, draft)
        alone = [_run_batch(_scheduler(target, factory, 6, 3), [p], [sp])[0] for p, sp in (probe, probe_sampled)]
        others = [(PROMPTS[i], _mixed_params(i)) for i in (0, 4, 5, 6)]
        prompts = [probe[0], probe_sampled[0], *(p for p, _ in others)]
        params = [probe[1], probe_sampled[1], *(sp for _, sp in others)]
        mixed = _run_batch(_scheduler(target, factory, 6, 3), prompts, params)
        assert mixed[:2] == alone, kind


def test_logprobs_are_the_targets(target, draft):
    scheduler = _scheduler(target, _factory("ngram", target, draft), batch=2)
    events = []
    scheduler.submit(BatchRequest(PROMPTS[2], SamplingParams(max_new_tokens=12), events.append, logprobs=3))
    _drain(scheduler)
    ids = [t for ev in events for t in ev.token_ids]
    lps = [x for ev in events for x in ev.logprobs]
    tops = [x for ev in events for x in ev.top_logprobs]
    full = torch.tensor([PROMPTS[2] + ids])
    with torch.no_grad():
        ref = torch.log_softmax(target(full).logits[0].float(), -1)[len(PROMPTS[2]) - 1: -1]
    want = ref.gather(1, torch.tensor(ids).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor(lps), want, rtol=1e-5, atol=1e-5)
    assert all(len(t) == 3 and t[0][0] == ids[j] for j, t in enumerate(tops))  # greedy: the top token is chosen


# --------------------------------------------------------------------------- cancellation and the queue


def test_cancel_frees_the_slot_and_others_continue(target):
    params = [SamplingParams(max_new_tokens=40) for _ in range(3)]
    expected = _run_batch(_scheduler(target, None, 3), PROMPTS[:3], params)
    scheduler = _scheduler(target, None, 3)
    outs = [[] for _ in range(3)]
    ends = {}
    reqs = [scheduler.submit(BatchRequest(PROMPTS[i], params[i], lambda ev, i=i: (
        outs[i].extend(ev.token_ids), ev.finished and ends.setdefault(i, ev.finish_reason)))) for i in range(3)]
    for _ in range(5):
        scheduler.step()
    scheduler.cancel(reqs[0])  # slot 0 is refilled with the last row's cache
    scheduler.step()
    assert ends[0] == "cancelled" and scheduler.num_active == 2  # dropped within one step
    _drain(scheduler)
    assert outs[0] == expected[0][: len(outs[0])]
    assert outs[1:] == expected[1:]
    assert scheduler.num_active == 0 and scheduler.engine.runner.nbytes == 0


def test_a_cancelled_waiting_request_never_runs(target):
    scheduler = _scheduler(target, None, 1)
    events = {0: [], 1: []}
    scheduler.submit(BatchRequest([1, 2, 3], SamplingParams(max_new_tokens=10), events[0].append))
    waiting = scheduler.submit(BatchRequest([4, 5], SamplingParams(max_new_tokens=10), events[1].append))
    scheduler.step()
    scheduler.cancel(waiting)
    _drain(scheduler)
    assert [(ev.token_ids, ev.finish_reason) for ev in events[1]] == [([], "cancelled")]
    assert sum(len(ev.token_ids) for ev in events[0]) == 10


def test_queue_is_bounded_and_prompts_checked(target):
    scheduler = _scheduler(target, None, 1, max_queue=2)
    for _ in range(3):  # one for the free slot, two waiting
        scheduler.submit(BatchRequest([1, 2], SamplingParams(max_new_tokens=2), lambda ev: None))
    with pytest.raises(QueueFullError, match="max-queue"):
        scheduler.submit(BatchRequest([1, 2], SamplingParams(max_new_tokens=2), lambda ev: None))
    with pytest.raises(PromptTooLongError, match="lower max_new_tokens"):
        scheduler.submit(BatchRequest([1] * 200, SamplingParams(max_new_tokens=100), lambda ev: None))
    _drain(scheduler)


def test_engine_failure_ends_running_requests_and_keeps_serving(target, monkeypatch):
    scheduler = _scheduler(target, None, 2)
    runner = scheduler.engine.runner
    events = []
    scheduler.submit(BatchRequest([1, 2, 3], SamplingParams(max_new_tokens=30), events.append))
    scheduler.step()
    real = runner.forward
    monkeypatch.setattr(runner, "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    scheduler.step()
    assert events[-1].finished and events[-1].finish_reason == "error" and "boom" in events[-1].error
    assert scheduler.num_active == 0
    monkeypatch.setattr(runner, "forward", real)
    out = _run_batch(scheduler, [[1, 2, 3]], [SamplingParams(max_new_tokens=5)])
    assert len(out[0]) == 5


def test_a_failing_prefill_fails_only_its_request(target, monkeypatch):
    scheduler = _scheduler(target, None, 3)
    runner = scheduler.engine.runner
    events = {0: [], 1: []}
    scheduler.submit(BatchRequest([1, 2, 3], SamplingParams(max_new_tokens=20), events[0].append))
    scheduler.step()
    real = runner.forward

    def fail_prefill(rows, token_ids, last_only=False):
        if last_only:
            raise RuntimeError("bad prompt")
        return real(rows, token_ids, last_only)

    monkeypatch.setattr(runner, "forward", fail_prefill)
    scheduler.submit(BatchRequest([4, 5], SamplingParams(max_new_tokens=20), events[1].append))
    _drain(scheduler)
    assert events[1][-1].finish_reason == "error" and "bad prompt" in events[1][-1].error
    assert events[0][-1].finish_reason == "length" and sum(len(e.token_ids) for e in events[0]) == 20


def test_a_broken_listener_cancels_only_its_request(target):
    scheduler = _scheduler(target, None, 2)
    good = []

    def broken(ev):
        raise ValueError("listener bug")

    scheduler.submit(BatchRequest([1, 2, 3], SamplingParams(max_new_tokens=20), broken))
    scheduler.submit(BatchRequest([4, 5], SamplingParams(max_new_tokens=20), good.append))
    _drain(scheduler)
    assert good[-1].finish_reason == "length" and sum(len(e.token_ids) for e in good) == 20
    assert scheduler.num_active == 0


def test_background_thread_serves_concurrent_submitters(target, draft):
    factory = _factory("ngram", target, draft)
    expected = _run_batch(_scheduler(target, None, 1), PROMPTS[:6], [SamplingParams(max_new_tokens=25)] * 6)
    scheduler = _scheduler(target, factory, 4)
    scheduler.start()
    try:
        outs = [[] for _ in range(6)]
        done = [threading.Event() for _ in range(6)]

        def go(i):
            def on_event(ev):
                outs[i].extend(ev.token_ids)
                if ev.finished:
                    done[i].set()
            scheduler.submit(BatchRequest(PROMPTS[i], SamplingParams(max_new_tokens=25), on_event))

        threads = [threading.Thread(target=go, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        assert all(d.wait(30) for d in done)
        assert outs == expected
        assert scheduler.alive
    finally:
        scheduler.close()


def test_close_cancels_running_and_waiting_and_refuses_new(target):
    scheduler = _scheduler(target, None, 1)
    ends = []
    for p in ([1, 2, 3], [4, 5]):
        scheduler.submit(BatchRequest(p, SamplingParams(max_new_tokens=50),
                                      lambda ev: ev.finished and ends.append(ev.finish_reason)))
    scheduler.step()
    scheduler.close()
    assert ends == ["cancelled", "cancelled"] and scheduler.num_active == 0 and scheduler.num_pending == 0
    with pytest.raises(EngineStoppedError):
        scheduler.submit(BatchRequest([1], SamplingParams(max_new_tokens=2), lambda ev: None))


# --------------------------------------------------------------------------- rows at the end of a context


@pytest.mark.parametrize("kind", ["self-draft", "self-layer-skip"])
def test_a_row_reaching_the_context_finishes_alone(kind):
    """Rows whose prompt + max_new_tokens fill the context end with "length" while the others draft on.

    A row at its last position feeds one token while the others feed gamma + 1: its padding lands
    past the context. That must not fail the step for every row.
    """
    tgt = tiny_llama(vocab_size=64, seed=0, scale=3.0, max_positions=32)
    factory = (lambda: DraftModelProposer(tgt)) if kind == "self-draft" else _factory("layer-skip", tgt, None)
    prompts = [list(range(1, 21)), [3, 4], [5, 9, 2, 5, 9, 2, 5], [11, 12, 13, 11, 12, 13, 11]]
    params = [SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=24, temperature=1.0, seed=3),
              SamplingParams(max_new_tokens=25), SamplingParams(max_new_tokens=25, temperature=0.8, seed=4)]
    expected = [_solo(tgt, factory, p, sp) for p, sp in zip(prompts, params)]
    events = _run_events(_scheduler(tgt, factory, 3), prompts, params)
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
    factory = lambda: DraftModelProposer(short)  # noqa: E731
    expected = [_solo(target, factory, p, sp) for p, sp in zip(prompts, params)]
    events = _run_events(_scheduler(target, factory, 3), prompts, params)
    assert [sum((ev.token_ids for ev in e), []) for e in events] == expected
    for prompt, evs in zip(prompts, events):
        length = len(prompt)
        for ev in evs:
            assert ev.num_drafted <= max(0, 16 - length + 1)  # drafts and fed tokens fit 16 positions
            length += len(ev.token_ids)
        # the 20-token prompt never fits the draft: plain decoding throughout
        assert evs[-1].num_drafted == 0 and (evs[-1].metrics.num_drafted_tokens > 0) == (len(prompt) < 16)


def test_stats(target, draft):
    scheduler = _scheduler(target, _factory("draft-model", target, draft), 2)
    scheduler.submit(BatchRequest([1, 2, 3], SamplingParams(max_new_tokens=20), lambda ev: None))
    scheduler.step()
    s = scheduler.stats()
    assert s["active"] == 1 and s["pending"] == 0 and s["kv_cache_bytes"] > 0 and s["gamma"] == 4
    _drain(scheduler)
    assert scheduler.stats()["kv_cache_bytes"] == 0


def test_cancelled_waiting_requests_free_their_queue_place(target):
    scheduler = _scheduler(target, None, 1, max_queue=2)
    waiting = [scheduler.submit(BatchRequest([1, 2], SamplingParams(max_new_tokens=2), lambda ev: None))
               for _ in range(3)]  # one for the free slot, two waiting
    for req in waiting[1:]:
        scheduler.cancel(req)  # the client went away before its turn
    scheduler.submit(BatchRequest([1, 2], SamplingParams(max_new_tokens=2), lambda ev: None))  # no QueueFullError
    assert scheduler.stats()["pending"] == 2  # the new one plus the free slot's request
    _drain(scheduler)


def test_stats_never_move_the_policy(target):
    from specdecode.policy import CostModelPolicy

    engine = SpeculativeEngine(target, _factory("ngram", target, None)(), EngineConfig(num_speculative_tokens=4,
                               max_batch_size=2), policy=CostModelPolicy(4))
    scheduler = Scheduler(engine)
    scheduler.submit(BatchRequest([1, 2, 3], SamplingParams(max_new_tokens=30), lambda ev: None))
    for _ in range(5):
        scheduler.step()
    before = (engine.policy.acceptance(), engine.policy._steps, engine.policy._plain_run, engine.policy._probe_left)
    for _ in range(20):  # /health polls
        scheduler.stats()
    assert (engine.policy.acceptance(), engine.policy._steps, engine.policy._plain_run,
            engine.policy._probe_left) == before
    _drain(scheduler)


# --------------------------------------------------------------------------- every way out frees the rows


class _InterruptOnce(NgramProposer):
    """An n-gram drafter that raises KeyboardInterrupt once: in ``start`` (admission) or its second ``propose``."""

    def __init__(self, where: str | None) -> None:
        super().__init__(NgramConfig(1, 3))
        self.where, self.proposals = where, 0

    def start(self, ctx) -> None:
        if self.where == "start":
            self.where = None
            raise KeyboardInterrupt
        super().start(ctx)

    def propose(self, batch, max_tokens):
        self.proposals += 1
        if self.where == "propose" and self.proposals == 2:
            self.where = None
            raise KeyboardInterrupt
        return super().propose(batch, max_tokens)


@pytest.mark.parametrize("where", ["listener", "start", "propose"])
def test_an_interrupted_step_frees_every_row_and_ends_every_request(target, where):
    """Ctrl-C while the scheduler is stepped by hand (in a listener, in an admission, in the engine's step):
    the interrupt reaches the caller, no row stays taken, every request that had started gets its last event,
    a request still waiting stays queued, and the scheduler then serves as before."""
    proposer = _InterruptOnce(None if where == "listener" else where)
    scheduler = Scheduler(SpeculativeEngine(target, proposer, EngineConfig(num_speculative_tokens=4,
                                                                           max_batch_size=3)))
    events = {0: [], 1: []}
    interrupted = []

    def listener(ev, i):
        events[i].append(ev)
        if where == "listener" and i == 1 and len(events[1]) == 2 and not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt

    scheduler.submit(BatchRequest(PROMPTS[2], SamplingParams(max_new_tokens=30), lambda ev: listener(ev, 0)))
    if where != "start":
        scheduler.step()
    scheduler.submit(BatchRequest(PROMPTS[6], SamplingParams(max_new_tokens=30), lambda ev: listener(ev, 1)))
    with pytest.raises(KeyboardInterrupt):
        for _ in range(5):
            scheduler.step()
    assert scheduler.num_active == 0 and scheduler.engine.rows == []
    _drain(scheduler)  # a request still waiting when the interrupt came runs now
    for evs in events.values():
        assert evs and evs[-1].finished and sum(ev.finished for ev in evs) == 1
    waited = where == "start"  # the second request was still waiting
    assert [events[i][-1].finish_reason for i in (0, 1)] == ["cancelled", "length" if waited else "cancelled"]
    out = _run_batch(scheduler, PROMPTS[:2], [SamplingParams(max_new_tokens=12)] * 2)
    assert out == [_solo(target, None, p, SamplingParams(max_new_tokens=12)) for p in PROMPTS[:2]]
