"""Prometheus metrics of the server (``specdecode.server.metrics.ServerMetrics``): each hook moves exactly
its series, buckets follow gamma, and every app has its own registry. (The live server's /metrics against
the usage it answered: ``tests/test_server_app.py``.)"""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdecode.scheduler import StepStats
from specdecode.server.metrics import ServerMetrics


def _samples(m: ServerMetrics) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_a_fresh_registry_per_app_starts_at_zero():
    a, b = ServerMetrics(4), ServerMetrics(4)  # two apps in one process: no duplicate-series error
    a.prompt_tokens.inc(5)
    assert _samples(a)["specdecode_prompt_tokens_total"] == 5 and _samples(b)["specdecode_prompt_tokens_total"] == 0
    assert a.registry is not b.registry


def test_step_hook_moves_histograms_and_gauges():
    m = ServerMetrics(4)
    m.observe_step(StepStats(batch_size=3, gamma=2, seconds=0.04, num_committed=7, num_drafted=6, num_accepted=4,
                             queue_length=5), kv_cache_bytes=4096)
    m.observe_step(StepStats(batch_size=1, gamma=0, seconds=0.2, num_committed=1, num_drafted=0, num_accepted=0,
                             queue_length=0), kv_cache_bytes=1024)
    s = _samples(m)
    assert s["specdecode_batch_size_count"] == 2 and s["specdecode_batch_size_sum"] == 4
    assert s["specdecode_draft_length_count"] == 2 and s["specdecode_draft_length_bucket{le=0.0}"] == 1
    assert s["specdecode_step_seconds_sum"] == pytest.approx(0.24) and s["specdecode_step_seconds_count"] == 2
    assert s["specdecode_queue_length"] == 0 and s["specdecode_running_requests"] == 1  # the latest step
    assert s["specdecode_kv_cache_bytes"] == 1024


def test_acceptance_hook_adds_a_requests_counts_by_position():
    m = ServerMetrics(4)
    m.observe_acceptance([3, 2, 2], [2, 1, 0])  # one ended request's RunMetrics lists
    m.observe_acceptance([1, 1, 1, 1, 1], [1, 1, 1, 1, 0])  # deeper than max_gamma: the series grow
    m.observe_acceptance([], [])  # plain decoding
    s = _samples(m)
    drafted = [s[f"specdecode_draft_tokens_by_position_total{{position={i}}}"] for i in range(5)]
    accepted = [s[f"specdecode_accepted_tokens_by_position_total{{position={i}}}"] for i in range(5)]
    assert drafted == [4, 3, 3, 1, 1] and accepted == [3, 2, 1, 1, 0]


def test_usage_hook_adds_the_usage_figures():
    m = ServerMetrics(4)
    for prompt, completion, drafted, accepted, steps in ((10, 20, 16, 9, 6), (3, 1, 0, 0, 0)):
        m.observe_usage({"prompt_tokens": prompt, "completion_tokens": completion,
                         "speculative": {"num_drafted_tokens": drafted, "num_accepted_tokens": accepted}}, steps)
    s = _samples(m)
    assert s["specdecode_prompt_tokens_total"] == 13 and s["specdecode_generation_tokens_total"] == 21
    assert s["specdecode_draft_tokens_total"] == 16 and s["specdecode_accepted_tokens_total"] == 9
    assert s["specdecode_verify_steps_total"] == 6


def test_buckets_follow_the_configured_gamma():
    s = _samples(ServerMetrics(10))
    assert "specdecode_mean_accepted_length_bucket{le=11.0}" in s  # tau can reach gamma + 1
    assert "specdecode_draft_length_bucket{le=10.0}" in s and "specdecode_draft_length_bucket{le=11.0}" not in s
    m = ServerMetrics(2)
    m.tau.observe(3.0)
    m.requests.labels("completions", "ok").inc()
    s = _samples(m)
    assert s["specdecode_mean_accepted_length_bucket{le=3.0}"] == 1
    assert s["specdecode_mean_accepted_length_bucket{le=2.5}"] == 0
    assert s["specdecode_requests_total{endpoint=completions,outcome=ok}"] == 1
