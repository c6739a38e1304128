"""The OpenAI-compatible HTTP API over a :class:`~specdecode.batch.BatchEngine`.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(both with ``stream: true`` as server-sent events), ``GET /health``, ``GET /metrics``.

Threads: the engine loop runs in its own thread (one model forward at a time);
the asyncio side encodes prompts, submits one engine request per choice and
receives that request's events through an ``asyncio.Queue`` fed with
``loop.call_soon_threadsafe``. Text lives here (tokenize, detokenize, stop
strings); the engine sees token ids only.

Every error is an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``
with a 4xx status (5xx only for the server's own failures), and the server keeps serving.
"""

from __future__ import annotations

import asyncio
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
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdecode import __version__
from specdecode.batch import BatchEngine, BatchRequest, EngineStoppedError, QueueFullError, RowEvent
from specdecode.generator import SpecDecoder, TextTracker
from specdecode.models import LoadedModel
from specdecode.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from specdecode.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from specdecode.types import SamplingParams, SpecDecodeError

#: How often a non-streaming request checks whether its client went away (seconds).
DISCONNECT_POLL_S = 0.5


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
    # keep the field path, drop pydantic's union-member tags ("str", "list[int]", ...)
    path = [p for p in loc if isinstance(p, int) or p in _FIELD_NAMES]
    param = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(path)) or None
    if kind == "missing":
        return APIError(400, f"missing required field '{param}'", param=param, code="missing_field")
    if kind == "value_error":
        return APIError(400, msg.removeprefix("Value error, "), param=param, code="invalid_value")
    field = path[-1] if path and isinstance(path[-1], str) else (path[-2] if len(path) > 1 else None)
    hint = _TYPE_HINTS.get(field) if isinstance(field, str) else None
    got = json.dumps(err.get("input"), default=str)[:60]
    what = f"must be {hint}" if hint else msg[0].lower() + msg[1:]
    return APIError(400, f"{param}: {what} (got {got})", param=param, code="invalid_type")


_FIELD_NAMES = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields) | {
    "role", "content", "name", "type", "text", "include_usage"}


async def _parse(request: Request, model_cls, state: ServingState):
    """The request body as ``model_cls``, for the model this server serves (400 / 404 otherwise)."""
    body = await request.body()
    if not body.strip():
        raise APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        parsed = model_cls.model_validate_json(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    _served(state, parsed.model)
    return parsed


# --------------------------------------------------------------------------- state


@dataclass(frozen=True)
class ServerConfig:
    """What the HTTP layer needs besides the engine.

    Attributes:
        model_name: the id clients send as ``model`` (``GET /v1/models`` lists it).
        draft: a description of the proposer (``ngram``, ``none`` or the draft model spec).
        num_speculative_tokens: gamma (for /v1/models and the metric buckets).
        api_key: when set, every endpoint but /health needs ``Authorization: Bearer <api_key>``.
        default_max_tokens: ``max_tokens`` of a chat request that does not say (capped by the context);
            completions default to 16 like OpenAI's.
    """

    model_name: str
    draft: str = "none"
    num_speculative_tokens: int = 5
    api_key: str | None = None
    default_max_tokens: int = 256


class ServingState:
    """The engine, the target's tokenizer and the metrics, shared by the routes."""

    def __init__(self, engine: BatchEngine, target: LoadedModel, config: ServerConfig,
                 metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.target = target
        self.config = config
        self.text = SpecDecoder(target, None)  # encode / encode_chat / decode, no engine use
        self.metrics = metrics or ServerMetrics(config.num_speculative_tokens)
        self.created = int(time.time())
        previous = engine.on_step

        def on_step(stats):
            self.metrics.observe_step(stats, engine.runner.cache.nbytes)
            if previous is not None:
                previous(stats)

        engine.on_step = on_step


# --------------------------------------------------------------------------- one request's choices


@dataclass
class _Snapshot:
    """Counters of an engine request, copied on the engine thread when an event is emitted."""

    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    step_tokens: int = 0
    target_forwards: int = 0


class _Choice:
    """One choice: an engine request, its text tracker and what has been sent."""

    def __init__(self, index: int, prompt_ids: list[int], params: SamplingParams, stops: list[str],
                 decode, logprobs: int | None) -> None:
        self.index = index
        self.prompt_ids = prompt_ids
        self.params = params
        self.decode = decode
        self.tracker = TextTracker(decode, stops)
        self.logprobs_n = logprobs
        self.lps: list[float] = []
        self.tops: list[list[tuple[int, float]]] = []
        self.sent = 0  # ids whose text has been handed out
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.snapshot = _Snapshot()
        self.events = 0
        self.request: BatchRequest | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def feed(self, ev: RowEvent) -> tuple[str, list[int], int]:
        """Take an engine event; return (new text, the ids it covers, index of the first of them)."""
        self.events += 1
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


def _snapshot(ev: RowEvent) -> _Snapshot:
    m = ev.metrics
    if m is None:
        return _Snapshot()
    return _Snapshot(m.num_drafted_tokens, m.num_accepted_tokens, m.num_verify_steps, m.num_step_tokens,
                     m.num_target_forwards)


class _Job:
    """The engine requests of one HTTP request (prompts x n choices) and their event queue."""

    def __init__(self, state: ServingState, endpoint: str, choices: list[_Choice], n: int = 1) -> None:
        self.state = state
        self.n = n
        self.endpoint = endpoint
        self.choices = choices
        self.queue: asyncio.Queue = asyncio.Queue()
        self.arrived = time.perf_counter()
        self._last: dict[int, float] = {}
        self.first_token_at: float | None = None

    def submit(self) -> None:
        loop = asyncio.get_running_loop()
        engine = self.state.engine
        for choice in self.choices:
            def on_event(ev: RowEvent, i=choice.index) -> None:  # engine thread
                loop.call_soon_threadsafe(self.queue.put_nowait, (i, ev, _snapshot(ev)))

            req = BatchRequest(choice.prompt_ids, choice.params, on_event, logprobs=choice.logprobs_n)
            try:
                engine.submit(req)
            except (QueueFullError, EngineStoppedError) as exc:
                self.cancel()
                self.state.metrics.requests.labels(self.endpoint, "queue_full").inc()
                if isinstance(exc, QueueFullError):
                    raise APIError(429, str(exc), type="rate_limit_error", code="queue_full",
                                   headers={"Retry-After": "1"}) from None
                raise APIError(503, str(exc), type="server_error", code="shutting_down") from None
            choice.request = req
        self.state.metrics.prompt_tokens.inc(sum(len(c.prompt_ids) for c in self.choices))

    def cancel(self) -> None:
        """Stop every unfinished choice (client gone, stop string, error)."""
        for c in self.choices:
            if c.request is not None and not c.request.cancelled:
                self.state.engine.cancel(c.request)

    @property
    def done(self) -> bool:
        return all(c.done for c in self.choices)

    async def events(self, request: Request | None = None) -> AsyncIterator[tuple[_Choice, str, list[int], int]]:
        """Yield (choice, new text, ids, first id index) until every choice has finished.

        With ``request`` (non-streaming), checks every DISCONNECT_POLL_S whether the client left,
        and then cancels and stops.
        """
        while not self.done:
            try:
                if request is None:
                    i, ev, snap = await self.queue.get()
                else:
                    i, ev, snap = await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    raise _ClientGone from None
                continue
            choice = self.choices[i]
            if choice.done:
                continue  # events after a stop string (before the engine saw the cancel)
            choice.snapshot = snap
            self._observe(choice, ev)
            piece, ids, start = choice.feed(ev)
            if choice.done and choice.finish_reason == "stop" and not ev.finished and choice.request is not None:
                self.state.engine.cancel(choice.request)  # a stop string ended it
            yield choice, piece, ids, start

    def _observe(self, choice: _Choice, ev: RowEvent) -> None:
        m = self.state.metrics
        now = time.perf_counter()
        n = len(ev.token_ids)
        is_step = choice.events > 0 and (n > 0 or ev.num_drafted > 0)
        m.observe_tokens(n, ev.num_drafted, ev.num_accepted, is_step)
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

    def finish_metrics(self, outcome: str) -> None:
        m = self.state.metrics
        m.requests.labels(self.endpoint, outcome).inc()
        if outcome == "ok":
            m.e2e.observe(time.perf_counter() - self.arrived)
            for c in self.choices:
                if c.snapshot.verify_steps:
                    m.tau.observe(c.snapshot.step_tokens / c.snapshot.verify_steps)

    def outcome(self) -> str:
        return "error" if any(c.finish_reason == "error" for c in self.choices) else "ok"

    def usage(self) -> dict:
        snaps = [c.snapshot for c in self.choices]
        drafted = sum(s.drafted for s in snaps)
        accepted = sum(s.accepted for s in snaps)
        steps = sum(s.verify_steps for s in snaps)
        prompt = sum(len(c.prompt_ids) for c in self.choices if c.index % self.n == 0)  # each prompt once
        completion = sum(c.completion_tokens for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "speculative": {
                "drafted_tokens": drafted,
                "accepted_tokens": accepted,
                "acceptance_rate": accepted / drafted if drafted else 0.0,
                "mean_accepted_length": sum(s.step_tokens for s in snaps) / steps if steps else 0.0,
                "target_forwards": sum(s.target_forwards for s in snaps),
            },
        }


# --------------------------------------------------------------------------- building jobs


def _served(state: ServingState, model: str) -> None:
    if model != state.config.model_name:
        raise APIError(404, f"model '{model}' is not served here; this server serves '{state.config.model_name}' "
                            f"(see GET /v1/models)", param="model", code="model_not_found")


def _encode_prompt(state: ServingState, prompt: str | list[int], index: int) -> list[int]:
    if isinstance(prompt, str):
        try:
            return state.text.encode(prompt)
        except SpecDecodeError as exc:
            raise APIError(400, str(exc), param="prompt") from None
    vocab = state.engine.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"prompt token ids must be in [0, {vocab}); got {bad[:5]}", param="prompt",
                       code="invalid_value")
    return list(prompt)


def _params(state: ServingState, body, prompt_ids: list[int], max_new: int | None, default: int,
            index: int) -> SamplingParams:
    """SamplingParams of choice ``index``; 400 when the prompt plus max_tokens overflows the context."""
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
        return SamplingParams(
            temperature=1.0 if body.temperature is None else float(body.temperature),
            top_k=top_k, top_p=1.0 if body.top_p is None else float(body.top_p),
            max_new_tokens=max_new, seed=seed, eos_token_ids=state.target.eos_token_ids,
            ignore_eos=body.ignore_eos,
        )
    except SpecDecodeError as exc:
        raise APIError(400, str(exc), code="invalid_value") from None


def _job(state: ServingState, endpoint: str, body, prompts: list[list[int]], max_new: int | None,
         default_max: int, logprobs: int | None) -> _Job:
    n = body.n
    if len(prompts) * n > 64:
        raise APIError(400, f"{len(prompts)} prompts x n={n} = {len(prompts) * n} choices; at most 64 per request",
                       param="n", code="invalid_value")
    choices = []
    for p, ids in enumerate(prompts):
        for j in range(n):
            index = p * n + j
            params = _params(state, body, ids, max_new, default_max, index)
            choices.append(_Choice(index, ids, params, body.stops, state.text.decode, logprobs))
    return _Job(state, endpoint, choices, n)


# --------------------------------------------------------------------------- response bodies


def _completion_logprobs(state: ServingState, c: _Choice, start: int, ids: list[int], offset: int) -> dict | None:
    if c.logprobs_n is None:
        return None
    tok = state.text.decode
    tokens = [tok([t]) for t in ids]
    offsets, pos = [], offset
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": c.lps[start : start + len(ids)],
        "top_logprobs": [{tok([t]): lp for t, lp in top} for top in c.tops[start : start + len(ids)]],
        "text_offset": offsets,
    }


def _chat_logprobs(state: ServingState, c: _Choice, start: int, ids: list[int]) -> dict | None:
    if c.logprobs_n is None:
        return None
    tok = state.text.decode

    def entry(t: int, lp: float) -> dict:
        s = tok([t])
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    content = []
    for k, t in enumerate(ids):
        e = entry(t, c.lps[start + k])
        e["top_logprobs"] = [entry(a, lp) for a, lp in c.tops[start + k]]
        content.append(e)
    return {"content": content}


def _response_base(state: ServingState, id_prefix: str, obj: str) -> dict:
    """The fields every response body and stream chunk of one request starts with."""
    return {"id": f"{id_prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
            "model": state.config.model_name}


@contextmanager
def _counted_if_invalid(state: ServingState, endpoint: str):
    """Count a request refused with an APIError as ``invalid`` (a full queue or a shutdown is counted where
    it happens), and let the error through."""
    try:
        yield
    except APIError as exc:
        if exc.code not in ("queue_full", "shutting_down"):
            state.metrics.requests.labels(endpoint, "invalid").inc()
        raise


def _finish_reason(c: _Choice) -> str | None:
    """OpenAI's finish_reason: "length" or "stop" (EOS or a stop string); engine-only reasons pass through."""
    return c.finish_reason


# --------------------------------------------------------------------------- the app


def create_app(state: ServingState) -> FastAPI:
    """The FastAPI app; its lifespan starts and stops the engine thread."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        try:
            yield
        finally:
            state.engine.close()

    app = FastAPI(title="specdecode", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible server with lossless speculative decoding")
    app.state.serving = state

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

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        key = state.config.api_key
        if key and request.url.path != "/health":
            header = request.headers.get("authorization", "")
            scheme, _, given = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
                return APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' "
                                     "with the key the server was started with (--api-key)",
                                type="authentication_error", code="invalid_api_key").response()
        return await call_next(request)

    @app.get("/health")
    async def health():
        if not state.engine.alive:
            return JSONResponse({"status": "engine stopped", **state.engine.stats()}, status_code=503)
        return {"status": "ok", **state.engine.stats()}

    @app.get("/metrics")
    async def metrics():
        s = state.engine.stats()
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
            prompts = [_encode_prompt(state, p, i) for i, p in enumerate(body.prompts())]
            job = _job(state, endpoint, body, prompts, body.max_tokens, 16, body.logprobs)
            job.submit()
        base = _response_base(state, "cmpl", "text_completion")
        if body.stream:
            return _sse(job, body, request, lambda c, piece, ids, start, fin: {
                **base, "choices": [{"index": c.index, "text": piece, "token_ids": ids,
                                     "logprobs": _completion_logprobs(state, c, start, ids, len(c.tracker.shown) - len(piece)),
                                     "finish_reason": fin}]}, base, None)
        await _collect(job, request)
        choices = [{"index": c.index, "text": c.tracker.text, "token_ids": list(c.tracker.ids),
                    "logprobs": _completion_logprobs(state, c, 0, list(c.tracker.ids), 0),
                    "finish_reason": _finish_reason(c)} for c in job.choices]
        return {**base, "choices": choices, "usage": job.usage()}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        endpoint = "chat_completions"
        with _counted_if_invalid(state, endpoint):
            body: ChatCompletionRequest = await _parse(request, ChatCompletionRequest, state)
            try:
                ids = state.text.encode_chat(body.chat_messages())
            except SpecDecodeError as exc:
                raise APIError(400, str(exc), param="messages") from None
            except Exception as exc:  # noqa: BLE001 - a chat template may refuse a message order
                raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from None
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
            job = _job(state, endpoint, body, [ids], body.max_new_tokens, state.config.default_max_tokens, logprobs)
            job.submit()
        base = _response_base(state, "chatcmpl", "chat.completion.chunk")
        if body.stream:
            first = {**base, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None} for c in job.choices]}
            return _sse(job, body, request, lambda c, piece, ids, start, fin: {
                **base, "choices": [{"index": c.index, "delta": {"content": piece} if piece or not fin else {},
                                     "token_ids": ids, "logprobs": _chat_logprobs(state, c, start, ids),
                                     "finish_reason": fin}]}, base, first)
        await _collect(job, request)
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.tracker.text},
                    "token_ids": list(c.tracker.ids),
                    "logprobs": _chat_logprobs(state, c, 0, list(c.tracker.ids)),
                    "finish_reason": _finish_reason(c)} for c in job.choices]
        return {**base, "object": "chat.completion", "choices": choices, "usage": job.usage()}

    return app


class _ClientGone(Exception):
    """The client of a non-streaming request disconnected."""


async def _collect(job: _Job, request: Request) -> None:
    """Run a non-streaming job to the end; cancel it if the client leaves."""
    try:
        async for _ in job.events(request):
            pass
    except BaseException as exc:
        job.cancel()
        job.finish_metrics("cancelled")
        if isinstance(exc, _ClientGone):
            raise APIError(499, "the client closed the request", code="client_closed") from None
        raise
    job.finish_metrics(job.outcome())
    errors = [c.error for c in job.choices if c.finish_reason == "error"]
    if errors:
        raise APIError(500, f"the engine failed: {errors[0]}", type="server_error", code="engine_error")


def _sse(job: _Job, body, request: Request, chunk, base: dict, first: dict | None) -> StreamingResponse:
    """Server-sent events: one chunk per engine step per choice, then usage (if asked) and [DONE]."""

    async def stream():
        outcome = "cancelled"
        try:
            if first is not None:
                yield _event(first)
            async for c, piece, ids, start in job.events():
                if c.finish_reason == "error":
                    err = {"message": f"the engine failed: {c.error}", "type": "server_error", "param": None,
                           "code": "engine_error"}
                    yield _event({"error": err})
                    continue
                fin = _finish_reason(c) if c.done else None
                if piece or ids or fin:
                    yield _event(chunk(c, piece, ids, start, fin))
            if body.include_usage:
                yield _event({**base, "choices": [], "usage": job.usage()})
            yield "data: [DONE]\n\n"
            outcome = job.outcome()
        finally:
            if outcome == "cancelled":
                job.cancel()
            job.finish_metrics(outcome)

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
