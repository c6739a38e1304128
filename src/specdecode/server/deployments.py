"""The deployments of the Ray Serve application: the engine replica, the metrics hub and the ingress
(:mod:`specdecode.server.replicas` builds and runs the application from them)."""

# no "from __future__ import annotations": the ingress routes are pickled to Ray and FastAPI reads their real annotations

import asyncio
import contextlib
import fcntl
import hmac
import os
import socket
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import torch
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from specdecode.threads import set_threads
from specdecode.models import default_cache_dir
from specdecode.server.app import create_app
from specdecode.server.errors import APIError, read_body
from specdecode.server.launch import load_state
from specdecode.server.relay import asgi_request, carries_output, failed_stream_event, merge_metrics, split_events
from specdecode.server.routing import routing_key
from specdecode.types import SamplingParams


APP_NAME = "specdecode"
ENGINE = "SpecdecodeEngine"
INGRESS = "SpecdecodeIngress"
HUB = "SpecdecodeMetrics"
#: Seconds between a replica's pushes of its metrics and stats to the hub; a replica silent for
#: :data:`STALE_AFTER` seconds is dropped from ``/metrics`` and ``/health``.
PUSH_PERIOD = 1.0
STALE_AFTER = 15.0
#: Seconds a leaving replica's running requests get to finish (``graceful_shutdown_timeout_s``; a Ray Serve
#: config file can set another).
DRAIN_SECONDS = 300.0


def _load_lock(cache_dir: str | None):
    """One replica loads at a time per machine (a file lock in the cache directory): the first measures and
    caches (precision, kernels, layer-skip sets), the others read what it wrote, and two loads never compete
    for the same cores and memory."""
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    root.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def held():
        with open(root / "replica-load.lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    return held()


class EngineReplica:
    """One replica: the target (and draft) loaded as ``specdecode serve`` loads them, the one engine, and
    the FastAPI app of :func:`specdecode.server.app.create_app` run in-process.

    Args:
        opts: the ``ServeOptions`` of every replica (host / port unused here).
        hub: a handle to the ``SpecdecodeMetrics`` deployment (None: no push).
    """

    async def __init__(self, opts, hub=None) -> None:
        # optional: Ray Serve (pip install -e ".[ray]")
        from ray import serve

        torch.set_grad_enabled(False)
        set_threads(opts.threads)
        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id
        self.pid = os.getpid()
        def load():
            with _load_lock(opts.cache_dir):  # a blocking lock: taken in the executor, not on the event loop
                return load_state(opts, progress=False)

        self.state = await asyncio.get_running_loop().run_in_executor(None, load)
        await asyncio.get_running_loop().run_in_executor(None, self._warm_up)
        self.api_key = opts.api_key
        self.app = create_app(self.state)
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()  # starts the scheduler thread
        self.hub = hub
        self._pusher = asyncio.ensure_future(self._push_forever()) if hub is not None else None

    def _warm_up(self) -> None:
        """One short generation before the replica counts as started: kernels compile and caches fill now,
        not on the first request."""
        ids = self.state.text.encode("Hello", chat=False)
        self.state.engine.generate(ids, SamplingParams(max_new_tokens=2))

    async def handle(self, method: str, path: str, query: str = "", headers: list[tuple[str, str]] = (),
                     body: bytes = b"", routing_key: str | None = None,
                     client: tuple[str, int] = ("127.0.0.1", 0)) -> AsyncIterator[tuple]:
        """One HTTP request through this replica's app (``routing_key`` is for the router only; ``client``
        is the original client's address, as the app's logs and ``request.client`` see it).

        Yields :func:`asgi_request`'s messages; the start message carries this replica's id as an
        ``x-specdecode-replica`` header."""
        del routing_key
        async for message in asgi_request(self.app, method, path, query, headers, body, client=tuple(client)):
            if message[0] == "start":
                message = ("start", message[1], [*message[2], ("x-specdecode-replica", self.replica_id)])
            yield message

    def info(self) -> dict:
        """This replica's id, process and engine figures (``ServingState.stats``)."""
        return {"replica": self.replica_id, "pid": self.pid, "host": socket.gethostname(),
                "engine_alive": self.state.scheduler.alive, **self.state.stats()}

    async def metrics_text(self) -> str:
        """This replica's ``/metrics`` as its own app serves it."""
        headers = [("authorization", f"Bearer {self.api_key}")] if self.api_key else []
        chunks = [m[1] async for m in asgi_request(self.app, "GET", "/metrics", headers=headers) if m[0] == "body"]
        return b"".join(chunks).decode()

    async def _push_forever(self) -> None:
        while True:
            try:
                await self.hub.push.remote(self.replica_id, await self.metrics_text(), self.info())
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the hub restarting: push again next period
                pass
            await asyncio.sleep(PUSH_PERIOD)

    async def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine thread died is replaced.

        Raises:
            RuntimeError: the engine thread stopped."""
        if not self.state.scheduler.alive:
            raise RuntimeError("the engine thread of this replica stopped")

    async def __del__(self) -> None:
        """Ray Serve's graceful shutdown: stop pushing, leave the hub, stop the scheduler."""
        with contextlib.suppress(Exception):
            if self._pusher is not None:
                self._pusher.cancel()
                await self.hub.gone.remote(self.replica_id)
        with contextlib.suppress(Exception):
            await self._lifespan.__aexit__(None, None, None)


class MetricsHub:
    """What each engine replica last pushed: its ``/metrics`` text and its stats (one replica, no CPU)."""

    def __init__(self) -> None:
        self.reports: dict[str, tuple[float, str, dict]] = {}

    async def push(self, replica: str, text: str, info: dict) -> None:
        self.reports[replica] = (time.monotonic(), text, info)

    async def gone(self, replica: str) -> None:
        """A replica that shut down gracefully leaves at once (a dead one after :data:`STALE_AFTER` s)."""
        self.reports.pop(replica, None)

    def _fresh(self) -> dict[str, tuple[float, str, dict]]:
        now = time.monotonic()
        self.reports = {r: v for r, v in self.reports.items() if now - v[0] <= STALE_AFTER}
        return self.reports

    async def collect(self, extra: str = "") -> str:
        """Every fresh replica's metrics, merged with a ``replica`` label (:func:`merge_metrics`)."""
        return merge_metrics({r: v[1] for r, v in self._fresh().items()}, extra)

    async def replicas(self) -> list[dict]:
        """Each fresh replica's stats, with the age of its last report (seconds)."""
        now = time.monotonic()
        return [{**v[2], "report_age_s": round(now - v[0], 2)} for _, v in sorted(self._fresh().items())]


def _retryable_errors() -> tuple[type[BaseException], ...]:
    """What a deployment handle raises when the replica serving the call died or cannot be reached."""
    # optional: Ray Serve (pip install -e ".[ray]")
    import ray.exceptions as rex

    kinds = [rex.RayActorError]
    for name in ("ActorUnavailableError", "ActorDiedError", "WorkerCrashedError", "NodeDiedError"):
        if hasattr(rex, name):
            kinds.append(getattr(rex, name))
    return tuple(kinds)


#: Hop-by-hop headers (RFC 9110 section 7.6.1): they describe one connection and are never forwarded
#: (Content-Length neither: the forwarder sets its own).
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
                        "upgrade", "expect", "proxy-authenticate", "proxy-authorization", "host", "content-length"})


def forwarded_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """``headers`` without the hop-by-hop ones, repeated headers kept in order."""
    return [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP]


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def ingress_deployment_class():
    """:class:`Ingress` as a Ray Serve class ingress: a FastAPI app whose routes are its methods
    (``/health``, ``/metrics`` and a catch-all that forwards to a replica). It has no docs routes of its
    own: ``/docs`` and ``/openapi.json`` are the replicas', forwarded and key-checked like the rest."""
    from fastapi import FastAPI, Request  # evaluated now (no postponed annotations), so FastAPI sees the class
    # optional: Ray Serve (pip install -e ".[ray]")
    from ray import serve

    app = FastAPI(title="specdecode (Ray Serve replicas)", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @serve.ingress(app)
    class SpecdecodeIngress(Ingress):
        @app.get("/health")
        async def _health(self):
            return await self.health()

        @app.get("/metrics")
        async def _metrics(self, request: Request):
            return await self.metrics(request)

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
        async def _forward(self, request: Request):
            return await self.forward(request)

    return SpecdecodeIngress


class Ingress:
    """The HTTP entry: forwards each request to an engine replica and streams its answer back.

    The API key and the body limit (``errors.read_body``: 413 from Content-Length, or as soon as the bytes
    pass it) apply here first, with the replicas' own messages, so a refused request never takes a
    replica's slot; the replica's app checks both again.

    Args:
        engine: the ``SpecdecodeEngine`` deployment handle; hub: the ``SpecdecodeMetrics`` one.
        router: "power-of-two" or "prefix"; prefix_chars: see :func:`routing_key`.
        retries: attempts on another replica when one fails before its first output.
        max_request_bytes: the largest body taken.
        api_key: required on every endpoint but ``/health``, as on one server.
    """

    def __init__(self, engine, hub, router: str = "power-of-two", prefix_chars: int = 256, retries: int = 2,
                 max_request_bytes: int = 1 << 20, api_key: str | None = None) -> None:
        self.engine = engine.options(stream=True)
        self.hub = hub
        self.router, self.prefix_chars, self.retries = router, prefix_chars, retries
        self.max_request_bytes, self.api_key = max_request_bytes, api_key
        self.registry = CollectorRegistry()
        self.retried = Counter("specdecode_replica_retries", "Requests retried on another replica after theirs "
                               "failed before any output", registry=self.registry)
        self.failed = Counter("specdecode_replica_failed_requests", "Requests the ingress answered with a "
                              "replica_failed error: their replica failed after output had been sent, or every "
                              "retry failed before any", registry=self.registry)
        self.routed = Counter("specdecode_ingress_requests", "Requests the ingress forwarded, by router",
                              ["router"], registry=self.registry)

    def _check_key(self, request) -> None:
        """Raise the replicas' own 401 when the key is missing or wrong (``/health`` is open, as there).

        Raises:
            APIError: 401 invalid_api_key.
        """
        if not self.api_key or request.url.path == "/health":
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.api_key.encode()):
            raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the key "
                                "the server was started with (--api-key)", type="authentication_error",
                           code="invalid_api_key")

    async def health(self):
        try:
            replicas = await self.hub.replicas.remote()
        except Exception as exc:  # noqa: BLE001 - the hub restarting: say so, as JSON
            return JSONResponse({"status": f"the metrics hub is not answering ({type(exc).__name__}); retry",
                                 "replicas": [], "router": self.router}, status_code=503)
        alive = [r for r in replicas if r.get("engine_alive")]
        status = "ok" if alive else "no replica is serving"
        return JSONResponse({"status": status, "replicas": replicas, "router": self.router},
                            status_code=200 if alive else 503)

    async def metrics(self, request):
        self._check_key(request)
        try:
            text = await self.hub.collect.remote(generate_latest(self.registry).decode())
        except Exception as exc:  # noqa: BLE001
            raise APIError(503, f"the metrics hub is not answering ({type(exc).__name__}); retry",
                           type="server_error", code="metrics_unavailable") from None
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    async def forward(self, request):
        # optional: Ray Serve (pip install -e ".[ray]")
        from ray.serve.exceptions import BackPressureError

        self._check_key(request)
        body = await read_body(request, self.max_request_bytes)
        path = request.url.path
        key = routing_key(path, body, self.prefix_chars) if self.router == "prefix" else None
        headers = [*forwarded_headers(request.headers.items()), ("content-length", str(len(body)))]
        client = (request.client.host, request.client.port) if request.client else ("127.0.0.1", 0)
        retryable = _retryable_errors()
        self.routed.labels(self.router).inc()
        last = "no replica answered"
        for attempt in range(self.retries + 1):
            gen = self.engine.handle.remote(method=request.method, path=path, query=request.url.query,
                                            headers=headers, body=body, routing_key=key, client=client)
            try:
                status, out_headers, held, replica = await self._until_output(gen)
            except BackPressureError:
                gen.cancel()
                raise APIError(429, "every replica's queue is full (--max-queue); retry later",
                               type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"}) from None
            except retryable as exc:
                gen.cancel()  # whatever that replica still runs, it runs for nobody
                last = first_line(exc)
                if attempt < self.retries:
                    self.retried.inc()
                    await asyncio.sleep(0.25 * (attempt + 1))
                    continue
                break
            except Exception as exc:  # noqa: BLE001 - any other failure: an OpenAI-style 502, not a bare 500
                gen.cancel()
                raise APIError(502, f"the replica failed: {first_line(exc)}", type="server_error",
                               code="replica_error") from None
            except BaseException:  # cancelled: the client left
                gen.cancel()
                raise
            return self._response(status, out_headers, self._rest(gen, held, replica, retryable))
        self.failed.inc()
        raise APIError(503, f"the replicas serving this request failed {self.retries + 1} times before any output "
                            f"({last}); retry the request", type="server_error", code="replica_failed",
                       headers={"Retry-After": "1"})

    @staticmethod
    def _response(status: int, headers: list[tuple[str, str]], body: AsyncIterator[bytes]):
        """A streaming response with the replica's status and headers as they were (repeated ones kept,
        hop-by-hop ones dropped)."""
        response = StreamingResponse(body, status_code=status)
        response.raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1"))
                                for k, v in forwarded_headers(headers)]
        return response

    async def _until_output(self, gen) -> tuple[int, list, list[bytes], str]:
        """Read the replica's answer up to its first output (a non-streaming answer: all of it).

        Returns:
            (status, headers, the body chunks read, the replica's id).
        Raises:
            what the handle raises when the replica died (retryable: nothing reached the client).
        """
        status, headers, held, buffer = 500, [], [], b""
        streaming = False
        async for message in gen:
            if message[0] == "start":
                status, headers = message[1], message[2]
                streaming = any(k.lower() == "content-type" and v.startswith("text/event-stream") for k, v in headers)
                continue
            held.append(message[1])
            if not streaming:
                continue  # a JSON answer: hold it all (it comes in one piece)
            events, buffer = split_events(buffer + message[1])
            if any(carries_output(e) for e in events):
                break
        replica = next((v for k, v in headers if k == "x-specdecode-replica"), "?")
        return status, headers, held, replica

    async def _rest(self, gen, held: list[bytes], replica: str, retryable) -> AsyncIterator[bytes]:
        """The held chunks, then the rest of the replica's stream; a failure after output ends the stream
        with the retryable ``replica_failed`` event and ``[DONE]``."""
        try:
            for chunk in held:
                yield chunk
            async for message in gen:
                if message[0] == "body":
                    yield message[1]
        except Exception as exc:  # noqa: BLE001 - a replica death, or anything else: the client must learn it
            self.failed.inc()
            yield failed_stream_event(replica, type(exc).__name__ if isinstance(exc, retryable) else first_line(exc))
        finally:
            gen.cancel()
