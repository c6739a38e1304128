"""Replicas of the one engine on Ray Serve, behind one OpenAI-compatible endpoint (``specdecode serve --replicas N``).

Three deployments make one Ray Serve application (:func:`build_app`):

- ``SpecdecodeEngine`` (N replicas, autoscaled when asked): each replica loads the target (and draft) as
  ``specdecode serve`` does (:func:`specdecode.server.launch.load_state`) and runs the very same FastAPI app
  (:func:`specdecode.server.app.create_app`) in-process. Requests reach that app as raw HTTP (method, path,
  headers, body) through :func:`asgi_request`, so every endpoint, streaming, error body and the API key
  behave exactly as in one process: there is no second code path.
- ``SpecdecodeIngress`` (the HTTP entry, on Ray Serve's proxy): reads the body, picks a routing key
  (:func:`routing_key`, for the prefix-affinity router), forwards the request to an engine replica through
  a Ray Serve deployment handle and streams the replica's bytes back. It holds the client's response until
  the first generated output arrives, so a request whose replica dies before that is retried on another
  replica; a stream that had already sent output ends with a retryable ``replica_failed`` error event.
  Its ``/metrics`` is every replica's Prometheus figures with a ``replica`` label
  (:func:`merge_metrics`), its ``/health`` lists the replicas.
- ``SpecdecodeMetrics``: one small actor the engine replicas push their ``/metrics`` text and stats to
  every second.

Routing: Ray Serve's default (power of two choices on queue length), or with ``--router prefix``
:class:`specdecode.server.ray_router.PrefixAffinityRouter`: rendezvous hashing of the routing key over
the replicas (:func:`rank_replicas`), so the turns of one conversation, and prompts sharing a prefix, go to
the same replica (its suffix tree and caches stay warm), unless that replica's queue is far longer than
the shortest.

The entry point for a Ray cluster a user already runs is :func:`app_builder`
(``serve run specdecode.server.replicas:app_builder target=smollm2-135m replicas=2``, or the
``import_path`` of a Ray Serve config file). Ray is optional: ``pip install -e ".[ray]"``; this module
imports without it, and :func:`require_ray` says what to install.
"""

# no "from __future__ import annotations": the ingress routes are pickled to Ray and FastAPI reads their real annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

from specdecode.scaleout import (  # noqa: F401 - the settings, checked without Ray; re-exported here
    RAY_INSTALL,
    ROUTERS,
    ReplicaOptions,
    check_replica_options,
    replica_options_from_args,
    require_ray,
)

__all__ = ["RAY_INSTALL", "ROUTERS", "ReplicaOptions", "app_builder", "build_app", "check_replica_options",
           "replica_options_from_args", "require_ray", "run"]
from specdecode.server.routing import rank_replicas, routing_key  # noqa: F401 - Ray-free, re-exported
from specdecode.types import SpecDecodeError

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
_ENV_PASSED = ("SPECDECODE_CACHE", "HF_HUB_OFFLINE", "HF_HOME", "TRANSFORMERS_OFFLINE", "SPECDECODE_KERNEL_ISA",
               "SPECDECODE_NATIVE_STEP", "TOKENIZERS_PARALLELISM")


def read_ray_config(path: str | Path) -> dict:
    """A Ray Serve config file (the format of ``serve deploy``), validated by Ray's own schema.

    Returns:
        ``{"http_options": {...}, "deployments": {name: {option: value}}, "args": {...}}``: the HTTP options,
        the settings of this application's deployments (``SpecdecodeEngine``, ``SpecdecodeIngress``) and
        its builder args, from the application named ``specdecode`` or, failing that, the only one.

    Raises:
        SpecDecodeError: not YAML, not Ray Serve's schema, or a deployment that is not ours.
    """
    import yaml
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    path = Path(path).expanduser()
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SpecDecodeError(f"--ray-config {path}: cannot read it as YAML ({exc})") from None
    if not isinstance(raw, dict):
        raise SpecDecodeError(f"--ray-config {path}: expected a mapping with 'applications' (Ray Serve's config format)")
    try:
        schema = ServeDeploySchema.model_validate(raw) if hasattr(ServeDeploySchema, "model_validate") \
            else ServeDeploySchema.parse_obj(raw)
    except (ValidationError, ValueError) as exc:
        first = str(exc).strip().splitlines()
        raise SpecDecodeError(f"--ray-config {path}: not a Ray Serve config: {' '.join(first[:3])}") from None
    apps = [a for a in raw.get("applications") or [] if a.get("name") == APP_NAME] or raw.get("applications") or []
    if len(apps) > 1:
        raise SpecDecodeError(f"--ray-config {path}: {len(apps)} applications and none named {APP_NAME!r}; name ours "
                              f"{APP_NAME!r}")
    deployments: dict[str, dict] = {}
    for entry in (apps[0].get("deployments") or []) if apps else []:
        name = entry.get("name")
        if name not in (ENGINE, INGRESS):
            raise SpecDecodeError(f"--ray-config {path}: deployment {name!r} is not one of specdecode's ({ENGINE}, "
                                  f"{INGRESS})")
        deployments[name] = {k: v for k, v in entry.items() if k != "name"}
    http = raw.get("http_options") or {}
    del schema
    return {"http_options": http, "deployments": deployments, "args": dict((apps[0].get("args") or {}) if apps else {})}


# --------------------------------------------------------------------------- routing (pure)


def carries_output(event: bytes) -> bool:
    """Whether one server-sent event (``data: ...``) carries generated output, an error or the end: the
    point after which a retry on another replica would duplicate what the client saw.

    The role-only first chunk of a chat stream (``{"delta": {"role": "assistant", "content": ""}}``)
    carries nothing; neither does a completions chunk with empty text and no finish reason.
    """
    payload = event.strip()
    if not payload.startswith(b"data:"):
        return False
    payload = payload[5:].strip()
    if payload == b"[DONE]":
        return True
    try:
        obj = json.loads(payload)
    except ValueError:
        return True
    if not isinstance(obj, dict) or "error" in obj or "usage" in obj and obj.get("usage"):
        return True
    for c in obj.get("choices") or []:
        delta = c.get("delta") or {}
        if c.get("text") or c.get("finish_reason") or c.get("token_ids") or c.get("logprobs") \
                or delta.get("content") or delta.get("tool_calls") or c.get("prompt_logprobs"):
            return True
    return False


def split_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Complete server-sent events in ``buffer`` (each ending with a blank line) and the rest."""
    events = []
    while True:
        cut = buffer.find(b"\n\n")
        if cut < 0:
            return events, buffer
        events.append(buffer[: cut + 2])
        buffer = buffer[cut + 2:]


def failed_stream_event(replica: str, what: str) -> bytes:
    """The SSE error event a stream ends with when its replica stopped after output had been sent."""
    err = {"message": f"the replica serving this request ({replica}) stopped mid-stream ({what}); the output so far "
                      f"is incomplete: retry the request (another replica takes it)",
           "type": "server_error", "param": None, "code": "replica_failed"}
    return f"data: {json.dumps({'error': err})}\n\ndata: [DONE]\n\n".encode()


# --------------------------------------------------------------------------- metrics (pure)


def merge_metrics(texts: dict[str, str], extra: str = "") -> str:
    """Prometheus text of several replicas as one exposition, each sample labelled ``replica="<id>"``.

    Args:
        texts: replica id -> that replica's ``/metrics`` text.
        extra: the ingress's own metrics text (its samples get no replica label).

    Returns:
        one Prometheus text exposition (``prometheus_client.generate_latest``), one family per name.
    """
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Metric] = {}

    def add(text: str, replica: str | None) -> None:
        for fam in text_string_to_metric_families(text):
            merged = families.get(fam.name)
            if merged is None:
                merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for s in fam.samples:
                labels = dict(s.labels) if replica is None else {**s.labels, "replica": replica}
                merged.add_sample(s.name, labels, s.value, s.timestamp, s.exemplar)

    for replica in sorted(texts):
        add(texts[replica], replica)
    if extra:
        add(extra, None)

    class _Merged:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())
    return generate_latest(registry).decode()


# --------------------------------------------------------------------------- driving the app in-process


async def asgi_request(app, method: str, path: str, query: str = "", headers: Iterable[tuple[str, str]] = (),
                       body: bytes = b"", client: tuple[str, int] = ("127.0.0.1", 0)) -> AsyncIterator[tuple]:
    """Run one HTTP request through an ASGI app in this event loop, yielding its response as it comes.

    Yields:
        ``("start", status: int, headers: list[tuple[str, str]])`` once, then ``("body", bytes)`` per
        non-empty chunk, as the app sends them (a streaming response streams).

    Closing the iterator early (the caller left) tells the app the client disconnected
    (``http.disconnect``), so its requests are cancelled, and waits for the app to finish.
    """
    messages: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": method.upper(), "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": query.encode("latin-1"), "root_path": "",
             "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
             "client": client, "server": ("specdecode-replica", 0), "state": {}}
    task = asyncio.ensure_future(app(scope, receive, send))
    try:
        while True:
            getter = asyncio.ensure_future(messages.get())
            done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                if messages.empty():
                    task.result()  # the app failed before answering: raise it
                    return
                message = messages.get_nowait()
            else:
                message = getter.result()
            if message["type"] == "http.response.start":
                yield ("start", int(message["status"]),
                       [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])])
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield ("body", bytes(message["body"]))
                if not message.get("more_body", False):
                    return
    finally:
        disconnected.set()
        if not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout=10)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                task.cancel()
            except Exception:  # noqa: BLE001 - the app's own failure after the client left: nothing to tell
                pass


# --------------------------------------------------------------------------- the deployments


def _load_lock(cache_dir: str | None):
    """One replica loads at a time per machine (a file lock in the cache directory): the first measures and
    caches (precision, kernels, layer-skip sets), the others read what it wrote, and two loads never compete
    for the same cores and memory."""
    import fcntl

    from specdecode.models import default_cache_dir

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
        import torch
        from ray import serve

        from specdecode.cliargs import set_threads
        from specdecode.server.app import create_app
        from specdecode.server.launch import load_state

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
        from specdecode.types import SamplingParams

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
        import socket

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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def ingress_deployment_class():
    """:class:`Ingress` as a Ray Serve class ingress: a FastAPI app whose routes are its methods
    (``/health``, ``/metrics`` and a catch-all that forwards to a replica). It has no docs routes of its
    own: ``/docs`` and ``/openapi.json`` are the replicas', forwarded and key-checked like the rest."""
    from fastapi import FastAPI, Request  # evaluated now (no postponed annotations), so FastAPI sees the class
    from ray import serve

    from specdecode.server.app import APIError

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

    The API key and the body limit (``app._read_body``: 413 from Content-Length, or as soon as the bytes
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
        from prometheus_client import CollectorRegistry, Counter

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
        import hmac

        from specdecode.server.app import APIError

        if not self.api_key or request.url.path == "/health":
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.api_key.encode()):
            raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the key "
                                "the server was started with (--api-key)", type="authentication_error",
                           code="invalid_api_key")

    async def health(self):
        from fastapi.responses import JSONResponse

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
        from fastapi.responses import Response
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        from specdecode.server.app import APIError

        self._check_key(request)
        try:
            text = await self.hub.collect.remote(generate_latest(self.registry).decode())
        except Exception as exc:  # noqa: BLE001
            raise APIError(503, f"the metrics hub is not answering ({type(exc).__name__}); retry",
                           type="server_error", code="metrics_unavailable") from None
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    async def forward(self, request):
        from ray.serve.exceptions import BackPressureError

        from specdecode.server.app import APIError, _read_body

        self._check_key(request)
        body = await _read_body(request, self.max_request_bytes)
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
                last = _first_line(exc)
                if attempt < self.retries:
                    self.retried.inc()
                    await asyncio.sleep(0.25 * (attempt + 1))
                    continue
                break
            except Exception as exc:  # noqa: BLE001 - any other failure: an OpenAI-style 502, not a bare 500
                gen.cancel()
                raise APIError(502, f"the replica failed: {_first_line(exc)}", type="server_error",
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
        from fastapi.responses import StreamingResponse

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
            yield failed_stream_event(replica, type(exc).__name__ if isinstance(exc, retryable) else _first_line(exc))
        finally:
            gen.cancel()


def _serve_options_type():
    from specdecode.server.launch import ServeOptions

    return ServeOptions


def default_threads(replicas: int) -> int:
    """Torch threads per replica on one machine: the cores shared out, at least one."""
    return max(1, (os.cpu_count() or 1) // max(1, replicas))


def build_app(opts, r: ReplicaOptions, *, ray_config: dict | None = None):
    """The Ray Serve application: ``SpecdecodeIngress`` -> ``SpecdecodeEngine`` x N, and the metrics hub.

    Args:
        opts: ``ServeOptions`` of each replica (``threads`` None: :func:`default_threads`).
        r: the replica settings.
        ray_config: :func:`read_ray_config`'s result, whose deployment settings override ours.

    Returns:
        a ``ray.serve.Application`` for ``serve.run`` (or a Ray Serve config's ``import_path``).

    Raises:
        SpecDecodeError: Ray missing, bad options.
    """
    require_ray()
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from specdecode.server.launch import check_options

    check_options(opts)
    check_replica_options(r)
    if opts.threads is None:
        opts = dataclasses.replace(opts, threads=default_threads(r.max_replicas or r.replicas))
    cpus = float(opts.threads) if r.cpus_per_replica is None else r.cpus_per_replica
    env = {k: os.environ[k] for k in _ENV_PASSED if k in os.environ}
    engine_options: dict = {
        "name": ENGINE,
        "max_ongoing_requests": 2 * opts.max_batch_size,  # a batch running and the next one queued in the replica
        "max_queued_requests": opts.max_queue,  # beyond: 429 from the ingress
        "ray_actor_options": {"num_cpus": cpus, "runtime_env": {"env_vars": env}},
        # a replica leaving (autoscaling down, a redeploy) first drains: it takes no new request and its
        # running ones get DRAIN_SECONDS to finish (Ray's default, 20 s, would cut long CPU generations)
        "health_check_period_s": 5, "health_check_timeout_s": 30, "graceful_shutdown_timeout_s": DRAIN_SECONDS,
    }
    if r.autoscaling:
        engine_options["autoscaling_config"] = {
            "min_replicas": r.min_replicas if r.min_replicas is not None else 1,
            "initial_replicas": r.replicas,
            "max_replicas": r.max_replicas if r.max_replicas is not None else max(r.replicas, r.min_replicas or 1),
            "target_ongoing_requests": r.target_ongoing_requests or float(opts.max_batch_size),
        }
    else:
        engine_options["num_replicas"] = r.replicas
    if r.router == "prefix":
        from specdecode.server.ray_router import PrefixAffinityRouter

        engine_options["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixAffinityRouter, request_router_kwargs={"imbalance": r.imbalance})
    ingress_options: dict = {"name": INGRESS, "num_replicas": 1, "max_ongoing_requests": 10_000,
                             "ray_actor_options": {"num_cpus": 0}}
    for name, mine in ((ENGINE, engine_options), (INGRESS, ingress_options)):
        theirs = dict((ray_config or {}).get("deployments", {}).get(name, {}))
        if "num_replicas" in theirs or "autoscaling_config" in theirs:
            mine.pop("num_replicas", None)
            mine.pop("autoscaling_config", None)
        if "ray_actor_options" in theirs:
            theirs["ray_actor_options"] = {**mine["ray_actor_options"], **theirs["ray_actor_options"]}
        mine.update(theirs)

    engine_cls = serve.deployment(**engine_options)(EngineReplica)
    hub_cls = serve.deployment(name=HUB, num_replicas=1, max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0},
                               logging_config={"enable_access_log": False})(MetricsHub)
    ingress_cls = serve.deployment(**ingress_options)(ingress_deployment_class())
    hub = hub_cls.bind()
    return ingress_cls.bind(engine_cls.bind(opts, hub), hub, router=r.router, prefix_chars=r.prefix_chars,
                            retries=r.retries, max_request_bytes=opts.max_request_bytes, api_key=opts.api_key)




def split_args(args: dict) -> tuple[dict, dict]:
    """``serve run ... key=value`` arguments (or a config file's ``args``) as (ServeOptions fields,
    ReplicaOptions fields), typed like the dataclasses' defaults.

    Raises:
        SpecDecodeError: an unknown key or a value of the wrong type.
    """
    serve_cls = _serve_options_type()
    serve_fields = {f.name: f for f in dataclasses.fields(serve_cls)}
    replica_fields = {f.name: f for f in dataclasses.fields(ReplicaOptions)}
    s, r = {}, {}
    for key, value in (args or {}).items():
        name = str(key).replace("-", "_")
        if name in ("host", "port"):
            raise SpecDecodeError(f"argument {key!r}: on Ray Serve the address is Ray Serve's (http_options in the "
                                  f"config file, or serve start --http-host/--http-port)")
        field = serve_fields.get(name) or replica_fields.get(name)
        if field is None:
            known = sorted((set(serve_fields) - {"host", "port"}) | set(replica_fields))
            raise SpecDecodeError(f"unknown argument {key!r}; known: {', '.join(known)}")
        default = field.default
        if isinstance(value, str) and not isinstance(default, str) and value.lower() not in ("none", "null"):
            kind = type(default) if default is not None else (float if "float" in str(field.type) else
                                                              int if "int" in str(field.type) else str)
            try:
                value = kind(value)
            except ValueError:
                raise SpecDecodeError(f"argument {key}={value!r}: expected {kind.__name__}") from None
        elif isinstance(value, str) and value.lower() in ("none", "null") and default is None:
            value = None
        (s if name in serve_fields else r)[name] = value
    return s, r


def app_builder(args: dict):
    """Ray Serve's application builder for a cluster a user already runs::

        serve run specdecode.server.replicas:app_builder target=smollm2-135m draft=ngram replicas=2 router=prefix

    or a config file's ``import_path: specdecode.server.replicas:app_builder`` with ``args:`` (any
    ``specdecode serve`` setting by its ``ServeOptions`` name, and the :class:`ReplicaOptions` fields).

    Raises:
        SpecDecodeError: unknown or bad arguments, Ray missing.
    """
    s, r = split_args(args)
    return build_app(_serve_options_type()(**s), ReplicaOptions(**r))


def _check_reachable(address: str, timeout: float = 10.0) -> None:
    """A ``HOST:PORT`` Ray address must accept a TCP connection (``ray.init`` would retry it forever);
    "auto" and ``ray://`` addresses are left to Ray.

    Raises:
        SpecDecodeError: nothing answers there.
    """
    import socket

    if address == "auto" or "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except (OSError, ValueError) as exc:
        raise SpecDecodeError(f"--ray-address {address}: no Ray cluster answers there ({exc}); start one with 'ray "
                              f"start --head --port {port}' on that machine, or drop --ray-address for a local "
                              f"cluster") from None


def run(opts, r: ReplicaOptions) -> int:
    """``specdecode serve --replicas N``: start (or join) a Ray cluster, deploy, serve until interrupted
    (Ctrl-C or SIGTERM). On a cluster of the user's (``--ray-address``) only this application is deleted at
    the end; a local cluster started here is shut down.

    Raises:
        SpecDecodeError: Ray missing, bad options, more CPUs asked than a local cluster has, a Ray cluster
            that cannot be reached, replicas that fail to start.
    """
    require_ray()
    import ray
    from ray import serve

    from specdecode.server.launch import check_address, check_options

    say = lambda line: print(f"specdecode: {line}", file=sys.stderr, flush=True)  # noqa: E731
    check_options(opts)
    check_replica_options(r)
    config = read_ray_config(r.ray_config) if r.ray_config else None
    if config is not None and config["args"]:
        say(f"--ray-config: its 'args' ({', '.join(sorted(config['args']))}) are for 'serve deploy'; here the flags "
            f"choose the model and the drafter")
    http = {"host": opts.host, "port": opts.port, **((config or {}).get("http_options") or {})}
    local = r.ray_address is None
    engine_cfg = (config or {}).get("deployments", {}).get(ENGINE, {})
    most = r.max_replicas or r.replicas  # the most engine replicas that can run, flags or config file
    if "num_replicas" in engine_cfg and isinstance(engine_cfg["num_replicas"], int):
        most = engine_cfg["num_replicas"]
    elif "autoscaling_config" in engine_cfg:
        most = int((engine_cfg["autoscaling_config"] or {}).get("max_replicas", most))
    threads = opts.threads or default_threads(most)
    cpus = r.cpus_per_replica if r.cpus_per_replica is not None else threads
    cpus = float((engine_cfg.get("ray_actor_options") or {}).get("num_cpus", cpus))
    if local:
        check_address(http["host"], int(http["port"]))
        cores = os.cpu_count() or 1
        if cpus * most > cores:
            raise SpecDecodeError(f"{most} replica{'s' if most > 1 else ''} x {cpus:g} CPUs need {cpus * most:g} CPUs and "
                                  f"this machine has {cores}: lower --replicas / --max-replicas (or the config file's "
                                  f"count) or --threads / --cpus-per-replica, or join a bigger cluster with --ray-address")
    else:
        _check_reachable(r.ray_address)
    try:
        ray.init(address=r.ray_address, include_dashboard=False, log_to_driver=True, logging_level="warning",
                 **({"num_cpus": os.cpu_count()} if local else {}))
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = f"--ray-address {r.ray_address}: cannot connect to the Ray cluster" if not local else \
            "cannot start a local Ray cluster"
        raise SpecDecodeError(f"{where} ({_first_line(exc)}); start one with 'ray start --head' and pass "
                              f"--ray-address auto, or check /tmp/ray/session_latest/logs") from None

    def _stop(signum, frame):  # SIGTERM (docker stop, a supervisor) stops the replicas as Ctrl-C does
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    try:
        serve.start(http_options=http)
        lo = r.min_replicas if r.min_replicas is not None else 1
        if "num_replicas" in engine_cfg or "autoscaling_config" in engine_cfg:
            n = f"the config file's {engine_cfg.get('num_replicas') or 'autoscaled'}"
        elif r.autoscaling:
            n = f"{lo}..{r.max_replicas or r.replicas} (autoscaled, {r.replicas} at start)"
        else:
            n = str(r.replicas)
        plural = "replica" if n == "1" else "replicas"
        say(f"starting {n} {plural} of {opts.target!r} on Ray Serve (router {r.router}); each loads the model")
        t0 = time.perf_counter()
        try:
            serve.run(build_app(opts, r, ray_config=config), name=APP_NAME, route_prefix="/")
        except RuntimeError as exc:
            raise SpecDecodeError(f"the replicas did not start ({_first_line(exc)}); their logs are above and in "
                                  f"/tmp/ray/session_latest/logs/serve/") from None
        say(f"serving {opts.served_model_name or opts.target!r} from {n} {plural} in {time.perf_counter() - t0:.0f} s "
            f"at http://{http['host']}:{http['port']}/v1 (api key {'on' if opts.api_key else 'off'}; Ctrl-C stops)")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        say("stopping the replicas")
        return 0
    finally:
        with contextlib.suppress(Exception):
            if local:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)  # the user's cluster keeps its other applications
        if local:
            ray.shutdown()
