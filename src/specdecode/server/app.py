"""The OpenAI-compatible HTTP API over the one engine (:class:`~specdecode.engine.SpeculativeEngine`)
and its :class:`~specdecode.scheduler.Scheduler`.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(both with ``stream: true`` as server-sent events), ``GET /health``, ``GET /metrics``.

Threads: the scheduler runs the engine in its own thread (one model forward at a time);
the asyncio side reads and parses bodies, encodes prompts (both in the thread pool, so a
big body never stalls the event loop), submits one engine request per choice and
receives that request's events through an ``asyncio.Queue`` fed with
``loop.call_soon_threadsafe``. Text lives here (tokenize, detokenize, stop strings);
the engine sees token ids only. A client that leaves (streaming or not) has its
requests cancelled at once; the scheduler drops them at its next step.

Every error is an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``
with a 4xx status (5xx only for the server's own failures), and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from specdecode import __version__
from specdecode.engine import RequestSpeculation, SpeculativeEngine
from specdecode.generator import SpecDecoder, TextTracker
from specdecode.grammar import CompiledGrammar, StructuredOutput, compile_grammar
from specdecode.metrics import RunMetrics
from specdecode.models import LoadedModel
from specdecode.scheduler import BatchRequest, EngineStoppedError, QueueFullError, RowEvent, Scheduler, StepStats
from specdecode.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from specdecode.server.schemas import (
    NOT_SUPPORTED,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    SpeculativeOptions,
)
from specdecode.token_bytes import TokenBytes
from specdecode.options import DEFAULT_MAX_REQUEST_BYTES  # noqa: F401 - largest body by default (bytes), re-exported
from specdecode.types import PromptTooLongError, SamplingParams, SpecDecodeError
from specdecode.validate import check_token_ids



# --------------------------------------------------------------------------- errors


class APIError(Exception):
    """An error answered as ``{"error": {...}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


_TYPE_HINTS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of at most 4 strings",
    "messages": "a list of {\"role\": ..., \"content\": ...} objects",
    "content": "a string or a list of {\"type\": \"text\", \"text\": ...} parts",
}


def _validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error as a 400 that names the field and what to send."""
    err = exc.errors()[0]
    kind, loc, msg = err["type"], list(err["loc"]), err["msg"]
    if kind == "json_invalid":
        return APIError(400, f"the request body is not valid JSON ({err.get('ctx', {}).get('error', msg)}); send a "
                             f"JSON object", code="invalid_json")
    if kind == "model_type" and not loc:
        return APIError(400, "the request body must be a JSON object", code="invalid_json")
    if kind == "extra_forbidden":  # nothing is silently ignored: an unknown or unsupported field is named
        name = str(loc[-1])
        param = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(loc))
        if name in NOT_SUPPORTED and len(loc) == 1:
            return APIError(400, f"{name} is not supported by this server ({NOT_SUPPORTED[name]}); omit it",
                            param=param, code="unsupported_field")
        return APIError(400, f"unknown field '{param}': this server does not take it (a typo? see the fields "
                             f"of the OpenAI API and specdecode.server.schemas); omit it", param=param,
                        code="unknown_field")
    # keep the field path, drop pydantic's union-member tags ("str", "list[int]", ...)
    path = [p for p in loc if isinstance(p, int) or p in _FIELD_NAMES]
    param = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(path)) or None
    if kind == "missing":
        return APIError(400, f"missing required field '{param}'", param=param, code="missing_field")
    if kind == "value_error":
        msg = msg.removeprefix("Value error, ")
        if param is None:  # a check across fields: its message starts with the field it refuses
            first = msg.split(" ", 1)[0].rstrip(":")
            param = first if first in _FIELD_NAMES else None
        return APIError(400, msg, param=param, code="invalid_value")
    field = path[-1] if path and isinstance(path[-1], str) else (path[-2] if len(path) > 1 else None)
    hint = _TYPE_HINTS.get(field) if isinstance(field, str) else None
    got = json.dumps(err.get("input"), default=str)[:60]
    what = f"must be {hint}" if hint else msg[0].lower() + msg[1:]
    return APIError(400, f"{param}: {what} (got {got})", param=param, code="invalid_type")


_FIELD_NAMES = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields) | set(
    SpeculativeOptions.model_fields) | {"role", "content", "name", "type", "text", "include_usage"}


def _too_large(size: int, limit: int, declared: bool) -> APIError:
    what = f"declares {size} bytes" if declared else f"is over {limit} bytes"
    return APIError(413, f"the request body {what}; this server takes at most {limit} bytes per request "
                         f"(--max-request-bytes): send a shorter prompt", code="request_too_large",
                    headers={"Connection": "close"})


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, at most ``limit`` bytes: 413 from Content-Length before reading, or as soon as
    the bytes read pass the limit (chunked uploads, or a Content-Length that lies)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise APIError(400, f"Content-Length must be an integer, got {declared[:40]!r}",
                           code="invalid_request") from None
        if size > limit:
            raise _too_large(size, limit, declared=True)
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise _too_large(total, limit, declared=False)
        chunks.append(chunk)
    return b"".join(chunks)


def _validate(body: bytes, model_cls):
    """Parse and validate ``body`` as ``model_cls`` (thread pool: a big body takes milliseconds)."""
    if not body.strip():
        raise APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        return model_cls.model_validate_json(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None


async def _parse(request: Request, model_cls, state: ServingState):
    """The request body as ``model_cls``, for the model this server serves (400 / 404 / 413 otherwise)."""
    body = await _read_body(request, state.config.max_request_bytes)
    parsed = await run_in_threadpool(_validate, body, model_cls)
    _served(state, parsed.model)
    return parsed


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
    num_speculative_tokens: int = 5
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


# --------------------------------------------------------------------------- one request's choices


class _TextOffsets:
    """Where each token of a growing id list starts in its text: ``at(j) == len(decode(ids[:j]).rstrip("\ufffd"))``
    (a token that continues a character starts where the character does), in one pass.

    Decoding every prefix would cost O(L^2). Instead the text after an *anchor* (the last token boundary
    whose text ends with a whole character) is decoded in a window that starts ``CONTEXT`` tokens before
    it, and extends the anchor's text: a decoder's start-of-text rules (SentencePiece's dropped leading
    space, a partial byte sequence) fall on the same window tokens with and without the new ones. Where
    the window's text does not extend the anchor's (a decoder this does not fit), the prefix is decoded
    whole, so every offset is the one the whole prefix gives.

    Args:
        decode: ids -> text; ids: the id list, only ever appended to while offsets are asked for.
    """

    CONTEXT = 4

    def __init__(self, decode, ids: list[int]) -> None:
        self.decode, self.ids = decode, ids
        self.offsets: list[int] = [0]
        self._anchor, self._base, self._head = 0, 0, ""  # token boundary, len(text of ids[:anchor]), window head

    def at(self, j: int) -> int:
        """Where token j starts (0 <= j <= len(ids))."""
        while len(self.offsets) <= j:
            self._next()
        return self.offsets[j]

    def _next(self) -> None:
        j = len(self.offsets)  # the text of ids[:j]: the anchor's, then the window's beyond its head
        window = self.decode(self.ids[max(0, self._anchor - self.CONTEXT) : j])
        if window.startswith(self._head):
            tail = window[len(self._head) :]
            length, whole = self._base + len(tail), not tail.endswith("\ufffd")
            self.offsets.append(self._base + len(tail.rstrip("\ufffd")))
        else:
            text = self.decode(self.ids[:j])
            length, whole = len(text), not text.endswith("\ufffd")
            self.offsets.append(len(text.rstrip("\ufffd")))
        if whole:  # a new anchor
            self._anchor, self._base = j, length
            self._head = self.decode(self.ids[max(0, j - self.CONTEXT) : j])


class _Choice:
    """One choice: an engine request, its text tracker and what has been sent.

    ``logprobs_n`` is what the engine computes (best_of needs every candidate's logprobs to rank them),
    ``report_logprobs`` what the client asked to see (None: no logprobs in the response). ``prompt_source``:
    the prompt's first choice, whose engine request alone scores the prompt (its prompt logprobs are this
    choice's too); None when this choice scores it (or nobody asked)."""

    def __init__(self, index: int, prompt_ids: list[int], params: SamplingParams, stops: list[str],
                 decode, logprobs: int | None, *, report_logprobs: int | None = None,
                 speculation: RequestSpeculation | None = None, prompt_logprobs: int | None = None,
                 echo: bool = False, include_stop: bool = False, prompt_source: _Choice | None = None) -> None:
        self.index = index
        self.prompt_ids = prompt_ids
        self.params = params
        self.decode = decode
        self.tracker = TextTracker(decode, stops, include_stop)
        self.logprobs_n = logprobs
        self.report_logprobs = report_logprobs
        self.speculation = speculation
        self.prompt_source = prompt_source
        # what the engine scores (echo with logprobs needs it too); only the prompt's first choice asks
        self.prompt_logprobs_n = prompt_logprobs if prompt_source is None else None
        self.report_prompt_logprobs: int | None = None  # the client's prompt_logprobs
        self._prompt_logprobs: list | None = None  # from the engine's first event
        self.echo = echo
        self.prompt_text = decode(prompt_ids) if echo else ""
        self.first_chunk_pending = True  # the stream's first chunk of this choice (echo, prompt logprobs)
        self._offsets = _TextOffsets(decode, self.tracker.ids)
        self._prompt_offsets: _TextOffsets | None = None
        self.lps: list[float] = []
        self.tops: list[list[tuple[int, float]]] = []
        self.sent = 0  # ids whose text has been handed out
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.snapshot = RunMetrics()  # the engine request's metrics as of the last event taken (a copy)
        self.events = 0
        self.request: BatchRequest | None = None
        self.constraint = None  # this choice's own structured-output constraint (response_format)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def prompt_logprobs(self) -> list | None:
        """The engine's scores of the prompt tokens: this choice's own, or its prompt source's (whose engine
        request is admitted first, so they have arrived before this choice's first event)."""
        return self._prompt_logprobs if self.prompt_source is None else self.prompt_source.prompt_logprobs

    def feed(self, ev: RowEvent) -> tuple[str, list[int], int]:
        """Take an engine event; return (new text, the ids it covers, index of the first of them)."""
        self.events += 1
        if ev.prompt_logprobs is not None:
            self._prompt_logprobs = ev.prompt_logprobs
        if ev.logprobs is not None:
            self.lps.extend(ev.logprobs)
            self.tops.extend(ev.top_logprobs or [[] for _ in ev.logprobs])
        piece = self.tracker.add(ev.token_ids) if ev.token_ids else ""
        if self.tracker.stop_string is not None:
            self.finish_reason = "stop"
        elif ev.finished:
            self.finish_reason = ev.finish_reason or "stop"
            self.error = ev.error
        if self.done:
            piece += self.tracker.finish()
            covered = len(self.tracker.ids)
        else:
            covered = self._covered()
        start = self.sent
        ids = self.tracker.ids[start:covered]
        self.sent = max(self.sent, covered)
        return piece, ids, start

    def _covered(self) -> int:
        """How many ids have their whole text inside the text shown so far."""
        shown, ids, j = self.tracker.shown, self.tracker.ids, self.sent
        while j < len(ids):
            prefix = self.decode(ids[: j + 1])
            if len(prefix) > len(shown) or not shown.startswith(prefix):
                break
            j += 1
        return j

    @property
    def completion_tokens(self) -> int:
        return len(self.tracker.ids)

    @property
    def counted(self) -> RunMetrics:
        """The engine request's counters up to the tokens this choice returns (a stop string's tail and any
        step the scheduler ran before it saw the cancel are not counted: ``RunMetrics.cut``)."""
        m = self.snapshot.copy()
        m.cut(len(self.tracker.ids))
        return m

    @property
    def cumulative_logprob(self) -> float:
        """Sum of the target's logprobs of the returned tokens (best_of ranks candidates by it)."""
        return float(sum(self.lps[: len(self.tracker.ids)]))

    def offset(self, j: int) -> int:
        """Where generated token j starts in the choice's text: the length of the text of the tokens before
        it, less a trailing incomplete character (a token that continues a character starts where it does)."""
        return self._offsets.at(j)

    def prompt_offset(self, j: int) -> int:
        """Where prompt token j starts in the echoed prompt text (the rule of :meth:`offset`)."""
        if self._prompt_offsets is None:
            self._prompt_offsets = _TextOffsets(self.decode, self.prompt_ids)
        return self._prompt_offsets.at(j)


def _snapshot(ev: RowEvent) -> RunMetrics:
    """A copy of the request's metrics, taken on the scheduler thread as the event is emitted."""
    return RunMetrics() if ev.metrics is None else ev.metrics.copy()


class _ClientGone(Exception):
    """The client of a non-streaming request disconnected."""


#: Queued in a job's event queue when its client disconnects.
_GONE = object()


class _Job:
    """The engine requests of one HTTP request (prompts x n choices) and their event queue.

    :meth:`close` ends its accounting once: the outcome counter, and the token counters from
    :meth:`usage`, so /metrics totals are the sums of the usage the requests report.
    """

    def __init__(self, state: ServingState, endpoint: str, choices: list[_Choice], n: int = 1) -> None:
        self.state = state
        self.n = n
        self.endpoint = endpoint
        self.choices = choices
        self.queue: asyncio.Queue = asyncio.Queue()
        self.arrived = time.perf_counter()
        self._last: dict[int, float] = {}
        self.first_token_at: float | None = None
        self.closed = False

    def submit(self) -> None:
        """Submit one engine request per choice; if any submission fails, those already made are cancelled.

        Raises:
            APIError: 429 (queue full), 503 (shutting down), 400 (the engine's prompt checks).
        """
        try:
            for choice in self.choices:
                self._submit(choice)
        except BaseException:
            self.cancel()  # nothing of a refused job runs on
            raise

    def _submit(self, choice: _Choice) -> None:
        loop = asyncio.get_running_loop()

        def on_event(ev: RowEvent, i=choice.index) -> None:  # scheduler thread
            loop.call_soon_threadsafe(self.queue.put_nowait, (i, ev, _snapshot(ev)))

        req = BatchRequest(choice.prompt_ids, choice.params, on_event, logprobs=choice.logprobs_n,
                           speculation=choice.speculation, prompt_logprobs=choice.prompt_logprobs_n,
                           constraint=choice.constraint)
        try:
            self.state.scheduler.submit(req)
        except (QueueFullError, EngineStoppedError) as exc:
            self.closed = True  # refused: nothing was served
            self.state.metrics.requests.labels(self.endpoint, "queue_full").inc()
            if isinstance(exc, QueueFullError):
                raise APIError(429, str(exc), type="rate_limit_error", code="queue_full",
                               headers={"Retry-After": "1"}) from None
            raise APIError(503, str(exc), type="server_error", code="shutting_down") from None
        except SpecDecodeError as exc:  # the prompt checks of the engine (already made here; kept as a guard)
            raise APIError(400, str(exc), param="prompt", code="invalid_value") from None
        choice.request = req

    def cancel(self) -> None:
        """Stop every unfinished choice (client gone, stop string, error)."""
        for c in self.choices:
            if c.request is not None and not c.request.cancelled and not c.done:
                self.state.scheduler.cancel(c.request)

    def client_gone(self) -> None:
        """The client disconnected: cancel now, and wake :meth:`events`."""
        self.cancel()
        self.queue.put_nowait(_GONE)

    @property
    def done(self) -> bool:
        return all(c.done for c in self.choices)

    async def events(self) -> AsyncIterator[tuple[_Choice, str, list[int], int]]:
        """Yield (choice, new text, ids, first id index) until every choice has finished.

        Raises:
            _ClientGone: :meth:`client_gone` was called.
        """
        while not self.done:
            item = await self.queue.get()
            if item is _GONE:
                raise _ClientGone
            i, ev, snap = item
            choice = self.choices[i]
            if choice.done:
                continue  # events after a stop string (before the scheduler saw the cancel)
            choice.snapshot = snap
            self._observe(choice, ev)
            piece, ids, start = choice.feed(ev)
            if choice.done and choice.finish_reason == "stop" and not ev.finished and choice.request is not None:
                self.state.scheduler.cancel(choice.request)  # a stop string ended it
            yield choice, piece, ids, start

    def _observe(self, choice: _Choice, ev: RowEvent) -> None:
        """Latency histograms, per engine event (acceptance by position is counted in :meth:`close`)."""
        m = self.state.metrics
        now = time.perf_counter()
        n = len(ev.token_ids)
        if n:
            last = self._last.get(choice.index)
            if last is None:
                if self.first_token_at is None:
                    self.first_token_at = now
                    m.ttft.observe(now - self.arrived)
            else:
                for _ in range(n):
                    m.itl.observe((now - last) / n)
            self._last[choice.index] = now

    def close(self, outcome: str) -> None:
        """Count the request once: its outcome, and what it committed (the figures of :meth:`usage`;
        a cancelled or failed request adds what it had committed)."""
        if self.closed:
            return
        self.closed = True
        self.cancel()
        m = self.state.metrics
        m.requests.labels(self.endpoint, outcome).inc()
        counted = [c.counted for c in self.choices]
        m.observe_usage(self.usage(counted), sum(k.num_verify_steps for k in counted))
        for k in counted:
            m.observe_acceptance(k.drafted_by_position, k.accepted_by_position)
        if outcome == "ok":
            m.e2e.observe(time.perf_counter() - self.arrived)
            for k in counted:
                if k.num_verify_steps:
                    m.tau.observe(k.mean_accepted_length)

    def outcome(self) -> str:
        return "error" if any(c.finish_reason == "error" for c in self.choices) else "ok"

    def usage(self, counted: list[RunMetrics] | None = None) -> dict:
        """The ``usage`` body: tokens, and the speculative counters of every choice up to the tokens it
        returns (``counted``: the choices' :attr:`_Choice.counted`, computed here when not given)."""
        snaps = [c.counted for c in self.choices] if counted is None else counted
        drafted = sum(s.num_drafted_tokens for s in snaps)
        accepted = sum(s.num_accepted_tokens for s in snaps)
        steps = sum(s.num_verify_steps for s in snaps)
        prompt = sum(len(c.prompt_ids) for c in self.choices if c.index % self.n == 0)  # each prompt once
        completion = sum(c.completion_tokens for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "speculative": {
                "num_drafted_tokens": drafted,
                "num_accepted_tokens": accepted,
                "acceptance_rate": accepted / drafted if drafted else 0.0,
                "mean_accepted_length": sum(s.num_step_tokens for s in snaps) / steps if steps else 0.0,
                "num_target_forwards": sum(s.num_target_forwards for s in snaps),
            },
        }


# --------------------------------------------------------------------------- building jobs


def _served(state: ServingState, model: str) -> None:
    if model != state.config.model_name:
        raise APIError(404, f"model '{model}' is not served here; this server serves '{state.config.model_name}' "
                            f"(see GET /v1/models)", param="model", code="model_not_found")


def _encode_prompts(state: ServingState, prompts: list[str | list[int]]) -> list[list[int]]:
    """Text prompts through the tokenizer, id prompts checked against the vocabulary (thread pool)."""
    out = []
    for prompt in prompts:
        if isinstance(prompt, str):
            try:
                out.append(state.text.encode(prompt))
            except SpecDecodeError as exc:
                raise APIError(400, str(exc), param="prompt") from None
            continue
        try:  # the engine's own prompt checks (ids in the vocabulary, not empty); the context is checked with max_tokens
            out.append(state.engine.check_prompt(prompt, SamplingParams(max_new_tokens=1)))
        except PromptTooLongError:
            out.append(list(prompt))  # reported by _params, which names max_tokens
        except SpecDecodeError as exc:
            raise APIError(400, str(exc), param="prompt", code="invalid_value") from None
    return out


def _encode_chat(state: ServingState, messages: list[dict]) -> list[int]:
    """Chat messages through the chat template (thread pool)."""
    try:
        return state.text.encode_chat(messages)
    except SpecDecodeError as exc:
        raise APIError(400, str(exc), param="messages") from None
    except Exception as exc:  # noqa: BLE001 - a chat template may refuse a message order
        raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from None


#: SamplingParams' names of the settings whose wire field has another name.
_WIRE_NAME = {"max_new_tokens": "max_tokens", "enabled": "speculative.enabled",
              "num_speculative_tokens": "speculative.num_speculative_tokens",
              "verification": "speculative.verification"}


def _params(state: ServingState, body, prompt_ids: list[int], max_new: int | None, default: int,
            index: int) -> SamplingParams:
    """SamplingParams of choice ``index``; 400 when the prompt plus max_tokens overflows the context, or a
    value is out of range (``param`` = the wire field)."""
    context = state.engine.max_context
    room = context - len(prompt_ids)
    field = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None else "max_tokens"
    if room < 1:
        raise APIError(400, f"the prompt has {len(prompt_ids)} tokens, which leaves no room in the model's context "
                            f"of {context} tokens: shorten the prompt", param="messages" if
                       isinstance(body, ChatCompletionRequest) else "prompt", code="context_length_exceeded")
    if max_new is None:
        max_new = min(default, room)
    elif max_new > room:
        raise APIError(400, f"the prompt has {len(prompt_ids)} tokens and {field} is {max_new}, which exceeds the "
                            f"model's context of {context} tokens: lower {field} to at most {room} or shorten the "
                            f"prompt", param=field, code="context_length_exceeded")
    top_k = body.top_k if body.top_k not in (None, -1) else 0
    seed = None if body.seed is None else (body.seed + index) % 2**63
    try:
        params = SamplingParams(
            temperature=1.0 if body.temperature is None else float(body.temperature),
            top_k=top_k, top_p=1.0 if body.top_p is None else float(body.top_p),
            min_p=0.0 if body.min_p is None else float(body.min_p),
            presence_penalty=0.0 if body.presence_penalty is None else float(body.presence_penalty),
            frequency_penalty=0.0 if body.frequency_penalty is None else float(body.frequency_penalty),
            repetition_penalty=1.0 if body.repetition_penalty is None else float(body.repetition_penalty),
            logit_bias={int(k): float(v) for k, v in body.logit_bias.items()} if body.logit_bias else None,
            allowed_token_ids=body.allowed_token_ids, stop_token_ids=tuple(body.stop_token_ids or ()),
            min_tokens=body.min_tokens, max_new_tokens=max_new, seed=seed, eos_token_ids=state.target.eos_token_ids,
            ignore_eos=body.ignore_eos, coupled=None if body.speculative is None else body.speculative.coupled,
        )
        # the engine's own rules for the token ids (in the vocabulary, some token left), before submitting
        check_token_ids(state.engine.vocab_size, logit_bias=params.logit_bias,
                        allowed_token_ids=params.allowed_token_ids, banned_token_ids=params.banned_token_ids,
                        stop_token_ids=params.stop_token_ids)
    except SpecDecodeError as exc:
        name = getattr(exc, "field", None)
        param = field if name == "max_new_tokens" else _WIRE_NAME.get(name, name)
        raise APIError(400, str(exc), param=param, code="invalid_value") from None
    return params


def _speculation(body) -> RequestSpeculation | None:
    """The request's ``"speculative"`` extension as the engine's RequestSpeculation (None: the server's)."""
    spec = body.speculative
    if spec is None:
        return None
    try:
        return RequestSpeculation(enabled=spec.enabled, num_speculative_tokens=spec.num_speculative_tokens,
                                  verification=None if spec.verification in (None, "auto") else spec.verification)
    except SpecDecodeError as exc:
        raise APIError(400, str(exc), param=_WIRE_NAME.get(getattr(exc, "field", None), "speculative"),
                       code="invalid_value") from None


def _structured(body) -> StructuredOutput | None:
    """The request's structured output: vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` or
    OpenAI's ``response_format`` (the schema lets at most one through; None: plain text).

    Raises:
        SpecDecodeError: a malformed one (``field``: its field).
    """
    if body.guided_json is not None:
        return StructuredOutput.json_schema(body.guided_json, "guided_json")
    if body.guided_regex is not None:
        return StructuredOutput.regex(body.guided_regex, "guided_regex")
    if body.guided_choice is not None:
        return StructuredOutput.choice(body.guided_choice, "guided_choice")
    return StructuredOutput.from_response_format(body.response_format)


def _grammar(state: ServingState, body) -> CompiledGrammar | None:
    """The request's structured output compiled for the target (None: plain text; thread pool, the first
    compile builds the tokenizer's llguidance copy); a 400 naming its field (response_format, guided_json,
    ...) when it is malformed or its schema or regex invalid."""
    try:
        structured = _structured(body)
        if structured is None:
            return None
        return compile_grammar(state.target.tokenizer, state.engine.vocab_size, structured,
                               state.target.eos_token_ids)
    except SpecDecodeError as exc:
        raise APIError(400, str(exc), param=getattr(exc, "field", None) or "response_format",
                       code="invalid_value") from None


def _job(state: ServingState, endpoint: str, body, prompts: list[list[int]], max_new: int | None,
         default_max: int, logprobs: int | None, *, echo: bool = False, grammar: CompiledGrammar | None = None) -> _Job:
    """The engine requests of one HTTP request: per prompt, ``n`` choices (``best_of`` candidates on
    completions; they are ranked at the end). ``logprobs``: what the client asked to see; ``grammar``: the
    structured output every choice follows (each with its own constraint). The prompt is scored (prompt
    logprobs, echo with logprobs) once, by its first choice; the others of that prompt share its scores."""
    per_prompt = getattr(body, "candidates", body.n)
    if len(prompts) * per_prompt > 64:
        what = "best_of" if per_prompt != body.n else "n"
        raise APIError(400, f"{len(prompts)} prompts x {what}={per_prompt} = {len(prompts) * per_prompt} choices; at "
                            f"most 64 per request", param=what, code="invalid_value")
    engine_logprobs = logprobs if per_prompt == body.n else (logprobs or 0)  # best_of ranks by logprobs
    prompt_n = body.prompt_logprobs
    if echo and logprobs is not None:
        prompt_n = max(prompt_n or 0, logprobs)
    speculation = _speculation(body)
    decode = state.text.decode if body.skip_special_tokens else functools.partial(state.text.decode,
                                                                                  skip_special_tokens=False)
    choices = []
    for p, ids in enumerate(prompts):
        first = None
        for j in range(per_prompt):
            index = p * per_prompt + j
            params = _params(state, body, ids, max_new, default_max, index)
            choice = _Choice(index, ids, params, body.stops, decode, engine_logprobs, report_logprobs=logprobs,
                             speculation=speculation, prompt_logprobs=prompt_n, echo=echo,
                             include_stop=body.include_stop_str_in_output, prompt_source=first)
            if first is None:
                first = choice
            choice.report_prompt_logprobs = body.prompt_logprobs
            choice.constraint = None if grammar is None else grammar.new_constraint()
            choices.append(choice)
    return _Job(state, endpoint, choices, per_prompt)


def _best(job: _Job, n: int) -> list[tuple[int, _Choice]]:
    """best_of: per prompt, the n candidates with the highest cumulative logprob (ties: the earlier one),
    renumbered 0.. in that order; every candidate still counts in usage."""
    per_prompt = job.n
    if per_prompt == n:
        return [(c.index, c) for c in job.choices]
    out = []
    for p in range(len(job.choices) // per_prompt):
        group = job.choices[p * per_prompt : (p + 1) * per_prompt]
        ranked = sorted(group, key=lambda c: (-c.cumulative_logprob, c.index))[:n]
        out.extend((p * n + j, c) for j, c in enumerate(ranked))
    return out


# --------------------------------------------------------------------------- response bodies


def _top_dict(tb: TokenBytes, top: list[tuple[int, float]]) -> dict[str, float]:
    """Completions' top_logprobs of one token: {token string: logprob}, every alternative kept (a string
    already taken by a more likely alternative is keyed ``token_id:ID``)."""
    out: dict[str, float] = {}
    for t, lp in top:
        key = tb.text_of(t)
        out[key if key not in out else f"token_id:{t}"] = lp
    return out


def _completion_logprobs(state: ServingState, c: _Choice, start: int, ids: list[int],
                         with_prompt: bool = False) -> dict | None:
    """The completions ``logprobs`` object of ``ids`` (generated tokens ``start``..): tokens, their logprobs,
    the top alternatives and where each token starts in the returned text; ``with_prompt`` (echo) puts the
    prompt's tokens first (the first one's logprob None)."""
    n = c.report_logprobs
    if n is None:
        return None
    tb = state.token_bytes
    tokens, lps, tops, offsets = [], [], [], []
    if with_prompt:
        scored = c.prompt_logprobs or [(None, None, [])] * len(c.prompt_ids)
        for j, (t, (lp, _, top)) in enumerate(zip(c.prompt_ids, scored)):
            tokens.append(tb.text_of(t))
            lps.append(lp)
            tops.append(None if lp is None else _top_dict(tb, top[:n]))
            offsets.append(c.prompt_offset(j))
    base = len(c.prompt_text)
    for k, t in enumerate(ids):
        tokens.append(tb.text_of(t))
        lps.append(c.lps[start + k])
        tops.append(_top_dict(tb, c.tops[start + k][:n]))
        offsets.append(base + c.offset(start + k))
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(state: ServingState, c: _Choice, start: int, ids: list[int]) -> dict | None:
    if c.report_logprobs is None:
        return None
    tb = state.token_bytes

    def entry(t: int, lp: float) -> dict:
        data, text = tb.entry(t)
        return {"token": text, "logprob": lp, "bytes": list(data)}

    content = []
    for k, t in enumerate(ids):
        e = entry(t, c.lps[start + k])
        e["top_logprobs"] = [entry(a, lp) for a, lp in c.tops[start + k][: c.report_logprobs]]
        content.append(e)
    return {"content": content}


def _prompt_logprobs(state: ServingState, c: _Choice) -> list | None:
    """vLLM's ``prompt_logprobs`` of a choice: None for the first prompt token, then per token {token id:
    {logprob, rank, decoded_token}} for the prompt token itself and the top ``prompt_logprobs`` alternatives."""
    n = c.report_prompt_logprobs
    if n is None or c.prompt_logprobs is None:
        return None
    tb = state.token_bytes
    out: list[dict | None] = [None]
    for t, (lp, rank, top) in zip(c.prompt_ids[1:], c.prompt_logprobs[1:]):
        entry = {str(t): {"logprob": lp, "rank": rank, "decoded_token": tb.text_of(t)}}
        for r, (a, alp) in enumerate(top[:n], start=1):
            entry.setdefault(str(a), {"logprob": alp, "rank": r, "decoded_token": tb.text_of(a)})
        out.append(entry)
    return out


def _completion_choice(state: ServingState, c: _Choice, piece: str, ids: list[int], start: int, fin,
                       index: int | None = None, final: bool = False) -> dict:
    """One completions choice: a stream chunk's (``piece``: its new text; the first chunk also carries the echoed
    prompt and the prompt logprobs) or, with ``final``, the whole choice."""
    first = final or c.first_chunk_pending
    c.first_chunk_pending = False
    echo = c.echo and first
    out = {"index": c.index if index is None else index, "text": (c.prompt_text if echo else "") + piece,
           "token_ids": ids, "logprobs": _completion_logprobs(state, c, start, ids, with_prompt=echo),
           "finish_reason": fin}
    if echo:
        out["prompt_token_ids"] = list(c.prompt_ids)
    if first and c.report_prompt_logprobs is not None:
        out["prompt_logprobs"] = _prompt_logprobs(state, c)
    return out


def _chat_choice(state: ServingState, c: _Choice, piece: str, ids: list[int], start: int, fin,
                 final: bool = False) -> dict:
    """One chat choice: a stream chunk's delta or, with ``final``, the whole message."""
    first = final or c.first_chunk_pending
    c.first_chunk_pending = False
    if final:
        out = {"index": c.index, "message": {"role": "assistant", "content": piece}}
    else:
        out = {"index": c.index, "delta": {"content": piece} if piece or not fin else {}}
    out.update({"token_ids": ids, "logprobs": _chat_logprobs(state, c, start, ids), "finish_reason": fin})
    if first and c.report_prompt_logprobs is not None:
        out["prompt_logprobs"] = _prompt_logprobs(state, c)
    return out


def _response_base(state: ServingState, id_prefix: str, obj: str) -> dict:
    """The fields every response body and stream chunk of one request starts with."""
    return {"id": f"{id_prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
            "model": state.config.model_name}


@contextmanager
def _counted_if_invalid(state: ServingState, endpoint: str):
    """Count a request refused with an APIError as ``invalid`` (a full queue or a shutdown is counted where
    it happens), and let the error through. A client that leaves before its body was read, or while its prompt
    was being tokenized, is counted ``cancelled`` (HTTP 499: nobody reads it)."""
    try:
        yield
    except APIError as exc:
        if exc.code not in ("queue_full", "shutting_down"):
            state.metrics.requests.labels(endpoint, "invalid").inc()
        raise
    except ClientDisconnect:
        state.metrics.requests.labels(endpoint, "cancelled").inc()
        raise APIError(499, "the client closed the request", code="client_closed") from None


def _finish_reason(c: _Choice) -> str | None:
    """OpenAI's finish_reason: "length" or "stop" (EOS or a stop string); engine-only reasons pass through."""
    return c.finish_reason


# --------------------------------------------------------------------------- the app


class _APIKeyMiddleware:
    """Pure ASGI: every path but /health needs ``Authorization: Bearer <key>`` (401 otherwise)."""

    def __init__(self, app, key: str) -> None:
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            scheme, _, given = Headers(scope=scope).get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.key):
                response = APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' "
                                         "with the key the server was started with (--api-key)",
                                    type="authentication_error", code="invalid_api_key").response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(state: ServingState) -> FastAPI:
    """The FastAPI app; its lifespan starts and stops the scheduler thread."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.scheduler.start()
        try:
            yield
        finally:
            await run_in_threadpool(state.scheduler.close)

    app = FastAPI(title="specdecode", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible server with lossless speculative decoding")
    app.state.serving = state
    if state.config.api_key:
        app.add_middleware(_APIKeyMiddleware, key=state.config.api_key)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            msg = f"no such endpoint: {request.method} {request.url.path} (see /v1/models, /v1/completions, " \
                  f"/v1/chat/completions, /health, /metrics)"
        elif exc.status_code == 405:
            msg = f"method {request.method} is not allowed on {request.url.path}"
        else:
            msg = str(exc.detail)
        return APIError(exc.status_code, msg, code=str(exc.status_code)).response()

    @app.exception_handler(RequestValidationError)
    async def _fastapi_validation(request: Request, exc: RequestValidationError):
        return APIError(400, f"invalid request: {exc.errors()[0].get('msg')}").response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()

    @app.get("/health")
    async def health():
        if not state.scheduler.alive:
            return JSONResponse({"status": "engine stopped", **state.stats()}, status_code=503)
        return {"status": "ok", **state.stats()}

    @app.get("/metrics")
    async def metrics():
        s = state.stats()
        state.metrics.queue_length.set(s["pending"])
        state.metrics.running.set(s["active"])
        state.metrics.kv_cache_bytes.set(s["kv_cache_bytes"])
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        cfg = state.config
        card = ModelCard(id=cfg.model_name, created=state.created, max_model_len=state.engine.max_context,
                         draft=cfg.draft, num_speculative_tokens=cfg.num_speculative_tokens)
        return ModelList(data=[card]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        _served(state, model_id)
        return (await models())["data"][0]

    @app.post("/v1/completions")
    async def completions(request: Request):
        endpoint = "completions"
        with _counted_if_invalid(state, endpoint):
            body: CompletionRequest = await _parse(request, CompletionRequest, state)
            prompts = await run_in_threadpool(_encode_prompts, state, body.prompts())
            grammar = await run_in_threadpool(_grammar, state, body)
            job = _job(state, endpoint, body, prompts, body.max_tokens, 16, body.logprobs, echo=body.echo,
                       grammar=grammar)
            job.submit()
        base = _response_base(state, "cmpl", "text_completion")
        if body.stream:
            return _sse(job, body, lambda c, piece, ids, start, fin: {
                **base, "choices": [_completion_choice(state, c, piece, ids, start, fin)]}, base, None)
        await _collect(job, request)
        choices = [_completion_choice(state, c, c.tracker.text, list(c.tracker.ids), 0, _finish_reason(c), index=i,
                                      final=True) for i, c in _best(job, body.n)]
        return {**base, "choices": choices, "usage": job.usage()}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        endpoint = "chat_completions"
        with _counted_if_invalid(state, endpoint):
            body: ChatCompletionRequest = await _parse(request, ChatCompletionRequest, state)
            ids = await run_in_threadpool(_encode_chat, state, body.chat_messages())
            grammar = await run_in_threadpool(_grammar, state, body)
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
            job = _job(state, endpoint, body, [ids], body.max_new_tokens, state.config.default_max_tokens, logprobs,
                       grammar=grammar)
            job.submit()
        base = _response_base(state, "chatcmpl", "chat.completion.chunk")
        if body.stream:
            first = {**base, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None} for c in job.choices]}
            return _sse(job, body, lambda c, piece, ids, start, fin: {
                **base, "choices": [_chat_choice(state, c, piece, ids, start, fin)]}, base, first)
        await _collect(job, request)
        choices = [_chat_choice(state, c, c.tracker.text, list(c.tracker.ids), 0, _finish_reason(c), final=True)
                   for c in job.choices]
        return {**base, "object": "chat.completion", "choices": choices, "usage": job.usage()}

    return app


async def _watch_disconnect(request: Request, job: _Job) -> None:
    """Wait for the client to leave (the body is read, so the next ASGI message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.client_gone()
            return


async def _collect(job: _Job, request: Request) -> None:
    """Run a non-streaming job to the end; cancel it as soon as the client leaves."""
    watcher = asyncio.create_task(_watch_disconnect(request, job))
    try:
        async for _ in job.events():
            pass
    except BaseException as exc:
        job.close("cancelled")
        if isinstance(exc, _ClientGone):
            raise APIError(499, "the client closed the request", code="client_closed") from None
        raise
    finally:
        watcher.cancel()
    job.close(job.outcome())
    errors = [c.error for c in job.choices if c.finish_reason == "error"]
    if errors:
        raise APIError(500, f"the engine failed: {errors[0]}", type="server_error", code="engine_error")


class _JobStream(StreamingResponse):
    """A StreamingResponse that cancels its job however the response ends: the client leaving before
    the first chunk (when the body generator never started, so its own ``finally`` never runs), a
    failed send, or a cancelled task."""

    def __init__(self, job: _Job, content) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.close("cancelled")  # no-op when the stream finished and counted itself


def _sse(job: _Job, body, chunk, base: dict, first: dict | None) -> StreamingResponse:
    """Server-sent events: one chunk per engine step per choice, then usage (if asked) and [DONE]."""

    async def stream():
        if first is not None:
            yield _event(first)
        async for c, piece, ids, start in job.events():
            if c.finish_reason == "error":
                err = {"message": f"the engine failed: {c.error}", "type": "server_error", "param": None,
                       "code": "engine_error"}
                yield _event({"error": err})
                continue
            fin = _finish_reason(c) if c.done else None
            if piece or ids or fin or (c.first_chunk_pending and (c.echo or c.report_prompt_logprobs is not None)):
                yield _event(chunk(c, piece, ids, start, fin))
        job.close(job.outcome())  # before the last bytes: a client that reads [DONE] sees the metrics moved
        if body.include_usage:
            yield _event({**base, "choices": [], "usage": job.usage()})
        yield "data: [DONE]\n\n"

    return _JobStream(job, stream())


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
