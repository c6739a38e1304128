"""What the routes share: the server's configuration and its serving state (scheduler, engine, tokenizer,
metrics)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from specdecode.engine import SpeculativeEngine
from specdecode.generator import SpecDecoder
from specdecode.models import LoadedModel
from specdecode.options import DEFAULT_GAMMA, DEFAULT_MAX_REQUEST_BYTES
from specdecode.scheduler import Scheduler, StepStats
from specdecode.server.metrics import ServerMetrics
from specdecode.token_bytes import TokenBytes


# --------------------------------------------------------------------------- state


@dataclass(frozen=True)
class ServerConfig:
    """What the HTTP layer needs besides the engine.

    Attributes:
        model_name: the id clients send as ``model`` (``GET /v1/models`` lists it).
        draft: a description of the proposer (``ngram``, ``none``, the draft model spec, ...).
        num_speculative_tokens: gamma (for /v1/models and the metric buckets).
        policy: the draft-length policy's name ("none" without a proposer).
        api_key: when set, every endpoint but /health needs ``Authorization: Bearer <api_key>``.
        default_max_tokens: ``max_tokens`` of a chat request that does not say (capped by the context);
            completions default to 16 like OpenAI's.
        max_request_bytes: largest request body; larger ones get HTTP 413.
    """

    model_name: str
    draft: str = "none"
    num_speculative_tokens: int = DEFAULT_GAMMA
    policy: str = "fixed"
    api_key: str | None = None
    default_max_tokens: int = 256
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES


class ServingState:
    """The scheduler (and its engine), the target's tokenizer and the metrics, shared by the routes.

    Attributes:
        scheduler: the Scheduler the routes submit to; engine: its SpeculativeEngine.
    """

    def __init__(self, scheduler: Scheduler, target: LoadedModel, config: ServerConfig,
                 metrics: ServerMetrics | None = None) -> None:
        self.scheduler = scheduler
        self.engine: SpeculativeEngine = scheduler.engine
        self.target = target
        self.config = config
        #: What the target's weights run in and why (``precision.PrecisionChoice``; set by ``launch.load_state``).
        self.precision = None
        self.text = SpecDecoder(target, None)  # encode / encode_chat / decode, no engine use
        self.token_bytes = TokenBytes(target.tokenizer)  # each token's own bytes and string, for logprobs
        policy = self.engine.policy if self.engine.proposer is not None else None
        max_gamma = max(config.num_speculative_tokens, getattr(policy, "max_tokens", 0) or 0)
        self.metrics = metrics or ServerMetrics(max_gamma)
        self.created = int(time.time())
        previous = scheduler.on_step

        def on_step(stats: StepStats) -> None:  # scheduler thread
            self.metrics.observe_step(stats, self.kv_cache_bytes())
            if previous is not None:
                previous(stats)

        scheduler.on_step = on_step

    def kv_cache_bytes(self) -> int:
        """Bytes held by the target's KV cache and the drafters' own caches (a suffix fallback's included)."""
        return self.scheduler.stats()["kv_cache_bytes"]

    def stats(self) -> dict:
        """Rows running, requests waiting, KV cache bytes, the last step's gamma, the policy and its
        acceptance estimate (read-only: nothing here moves the policy's state)."""
        return {**self.scheduler.stats(), "policy": self.config.policy}
