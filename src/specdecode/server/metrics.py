"""Prometheus metrics of the server (prometheus-client), one registry per app.

Counters count work; rates (acceptance rate, acceptance by position, tokens/s)
are derived in PromQL, e.g. ``rate(specdecode_accepted_tokens_total[1m]) /
rate(specdecode_draft_tokens_total[1m])``.

The token counters (prompt, generation, draft, accepted, verify steps, acceptance by position)
move once per request, when it ends, by the figures of its ``usage``: their totals are the sums
of the usage the server reported (a cancelled or failed request adds what it had committed).
Completion tokens are the committed tokens the client got (a stop string's tail excluded), and
every speculative counter stops with them (``RunMetrics.cut``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401 - re-exported for the app

from specdecode.scheduler import StepStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 60.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    """Every metric the server exports; thread-safe (the engine thread updates the step figures).

    Args:
        max_gamma: the configured num_speculative_tokens (bounds of the tau and draft-length buckets).
    """

    def __init__(self, max_gamma: int, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.requests = Counter("specdecode_requests", "Requests answered, by endpoint and outcome "
                                "(ok, cancelled, error, invalid, queue_full)", ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("specdecode_prompt_tokens", "Prompt tokens of ended requests (usage."
                                     "prompt_tokens: each prompt once)", registry=r)
        self.generation_tokens = Counter("specdecode_generation_tokens", "Committed tokens of ended requests "
                                         "(usage.completion_tokens)", registry=r)
        self.drafted = Counter("specdecode_draft_tokens", "Draft tokens verified by the target, of ended requests "
                               "(usage.speculative.num_drafted_tokens)", registry=r)
        self.accepted = Counter("specdecode_accepted_tokens", "Draft tokens kept by verification, of ended requests "
                                "(usage.speculative.num_accepted_tokens)", registry=r)
        self.verify_steps = Counter("specdecode_verify_steps", "Target forwards after the prefill, per request, of "
                                    "ended requests", registry=r)
        self.drafted_at = Counter("specdecode_draft_tokens_by_position", "Steps whose draft reached this position "
                                  "(0-based)", ["position"], registry=r)
        self.accepted_at = Counter("specdecode_accepted_tokens_by_position", "Steps that kept the draft token at "
                                   "this position (0-based); acceptance at i = accepted / drafted",
                                   ["position"], registry=r)
        tau_buckets = sorted({1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, float(max_gamma + 1)})
        self.tau = Histogram("specdecode_mean_accepted_length", "tau of each finished request: tokens committed per "
                             "target forward after the prefill", buckets=tau_buckets, registry=r)
        self.ttft = Histogram("specdecode_time_to_first_token_seconds", "Request arrival to its first token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("specdecode_inter_token_latency_seconds", "Time between committed tokens of a request "
                             "(a step's gap split over the tokens it committed; one observation per token)",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("specdecode_request_latency_seconds", "Request arrival to its last token",
                             buckets=_E2E_BUCKETS, registry=r)
        self.queue_length = Gauge("specdecode_queue_length", "Requests waiting for a batch slot", registry=r)
        self.running = Gauge("specdecode_running_requests", "Requests in the batch now", registry=r)
        self.batch_size = Histogram("specdecode_batch_size", "Rows decoded per engine step",
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256), registry=r)
        self.gamma = Histogram("specdecode_draft_length", "Draft length (gamma) chosen per engine step; 0 = plain "
                               "decoding", buckets=tuple(range(0, max_gamma + 1)), registry=r)
        self.step_seconds = Histogram("specdecode_step_seconds", "Seconds per engine step (draft + verify + commit)",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.kv_cache_bytes = Gauge("specdecode_kv_cache_bytes", "Bytes held by the batch KV cache", registry=r)
        self._positions_d: list = []
        self._positions_a: list = []

    def observe_step(self, stats: StepStats, kv_cache_bytes: int) -> None:
        """Engine-thread hook: batch size, gamma, step time, queue and cache gauges."""
        self.batch_size.observe(stats.batch_size)
        self.gamma.observe(stats.gamma)
        self.step_seconds.observe(stats.seconds)
        self.queue_length.set(stats.queue_length)
        self.running.set(stats.batch_size)
        self.kv_cache_bytes.set(kv_cache_bytes)

    def observe_acceptance(self, drafted_by_position: list[int], accepted_by_position: list[int]) -> None:
        """An ended request's acceptance by position: ``RunMetrics.drafted_by_position`` /
        ``accepted_by_position`` counted to its committed end (the steps whose draft reached position i, and
        those that kept the token there)."""
        self._grow(len(drafted_by_position))
        for i, (d, a) in enumerate(zip(drafted_by_position, accepted_by_position)):
            if d:
                self._positions_d[i].inc(d)
            if a:
                self._positions_a[i].inc(a)

    def observe_usage(self, usage: dict, verify_steps: int) -> None:
        """An ended request: the figures of its ``usage`` body (and its target forwards after the prefill)."""
        self.prompt_tokens.inc(usage["prompt_tokens"])
        self.generation_tokens.inc(usage["completion_tokens"])
        self.drafted.inc(usage["speculative"]["num_drafted_tokens"])
        self.accepted.inc(usage["speculative"]["num_accepted_tokens"])
        self.verify_steps.inc(verify_steps)

    def _grow(self, n: int) -> None:
        while len(self._positions_d) < n:
            pos = str(len(self._positions_d))
            self._positions_d.append(self.drafted_at.labels(position=pos))
            self._positions_a.append(self.accepted_at.labels(position=pos))

    def render(self) -> bytes:
        return generate_latest(self.registry)
