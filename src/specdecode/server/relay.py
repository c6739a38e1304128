"""What the ingress relays, Ray-free: which server-sent events carry output, the replicas' metrics merged
into one page, and one HTTP request run through an in-process ASGI app."""

import asyncio
import json
from collections.abc import AsyncIterator, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


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
