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

This module holds the routes; the rest sits beside it: :mod:`~specdecode.server.errors` (error bodies, reading a
body), :mod:`~specdecode.server.state` (``ServerConfig``, ``ServingState``), :mod:`~specdecode.server.choices`
(one request's choices and its job), :mod:`~specdecode.server.jobs` (a body into a job) and
:mod:`~specdecode.server.responses` (response bodies).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdecode import __version__
from specdecode.server.choices import ClientGone, Job
from specdecode.server.errors import APIError, read_body, validate_body
from specdecode.server.jobs import best_choices, check_served, encode_chat, encode_prompts, make_job, request_grammar
from specdecode.server.metrics import CONTENT_TYPE_LATEST
from specdecode.server.responses import (
    chat_choice,
    completion_choice,
    counted_if_invalid,
    finish_reason_of,
    response_base,
)
from specdecode.server.schemas import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from specdecode.server.state import ServingState


async def _parse(request: Request, model_cls, state: ServingState):
    """The request body as ``model_cls``, for the model this server serves (400 / 404 / 413 otherwise)."""
    body = await read_body(request, state.config.max_request_bytes)
    parsed = await run_in_threadpool(validate_body, body, model_cls)
    check_served(state, parsed.model)
    return parsed


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
        check_served(state, model_id)
        return (await models())["data"][0]

    @app.post("/v1/completions")
    async def completions(request: Request):
        endpoint = "completions"
        with counted_if_invalid(state, endpoint):
            body: CompletionRequest = await _parse(request, CompletionRequest, state)
            prompts = await run_in_threadpool(encode_prompts, state, body.prompts())
            grammar = await run_in_threadpool(request_grammar, state, body)
            job = make_job(state, endpoint, body, prompts, body.max_tokens, 16, body.logprobs, echo=body.echo,
                           grammar=grammar)
            job.submit()
        base = response_base(state, "cmpl", "text_completion")
        if body.stream:
            return _sse(job, body, lambda c, piece, ids, start, fin: {
                **base, "choices": [completion_choice(state, c, piece, ids, start, fin)]}, base, None)
        await _collect(job, request)
        choices = [completion_choice(state, c, c.tracker.text, list(c.tracker.ids), 0, finish_reason_of(c), index=i,
                                     final=True) for i, c in best_choices(job, body.n)]
        return {**base, "choices": choices, "usage": job.usage()}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        endpoint = "chat_completions"
        with counted_if_invalid(state, endpoint):
            body: ChatCompletionRequest = await _parse(request, ChatCompletionRequest, state)
            ids = await run_in_threadpool(encode_chat, state, body.chat_messages())
            grammar = await run_in_threadpool(request_grammar, state, body)
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
            job = make_job(state, endpoint, body, [ids], body.max_new_tokens, state.config.default_max_tokens,
                           logprobs, grammar=grammar)
            job.submit()
        base = response_base(state, "chatcmpl", "chat.completion.chunk")
        if body.stream:
            first = {**base, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None} for c in job.choices]}
            return _sse(job, body, lambda c, piece, ids, start, fin: {
                **base, "choices": [chat_choice(state, c, piece, ids, start, fin)]}, base, first)
        await _collect(job, request)
        choices = [chat_choice(state, c, c.tracker.text, list(c.tracker.ids), 0, finish_reason_of(c), final=True)
                   for c in job.choices]
        return {**base, "object": "chat.completion", "choices": choices, "usage": job.usage()}

    return app


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Wait for the client to leave (the body is read, so the next ASGI message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.client_gone()
            return


async def _collect(job: Job, request: Request) -> None:
    """Run a non-streaming job to the end; cancel it as soon as the client leaves."""
    watcher = asyncio.create_task(_watch_disconnect(request, job))
    try:
        async for _ in job.events():
            pass
    except BaseException as exc:
        job.close("cancelled")
        if isinstance(exc, ClientGone):
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

    def __init__(self, job: Job, content) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.close("cancelled")  # no-op when the stream finished and counted itself


def _sse(job: Job, body, chunk, base: dict, first: dict | None) -> StreamingResponse:
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
            fin = finish_reason_of(c) if c.done else None
            if piece or ids or fin or (c.first_chunk_pending and (c.echo or c.report_prompt_logprobs is not None)):
                yield _event(chunk(c, piece, ids, start, fin))
        job.close(job.outcome())  # before the last bytes: a client that reads [DONE] sees the metrics moved
        if body.include_usage:
            yield _event({**base, "choices": [], "usage": job.usage()})
        yield "data: [DONE]\n\n"

    return _JobStream(job, stream())


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
