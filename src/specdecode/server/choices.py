"""One request's choices: each choice's text offsets, stop strings and logprobs, and the job that runs them
on the scheduler and hands their events to the asyncio side."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from specdecode.engine import RequestSpeculation
from specdecode.generator import TextTracker
from specdecode.metrics import RunMetrics
from specdecode.scheduler import BatchRequest, EngineStoppedError, QueueFullError, RowEvent
from specdecode.server.errors import APIError
from specdecode.server.state import ServingState
from specdecode.types import SamplingParams, SpecDecodeError


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


class Choice:
    """One choice: an engine request, its text tracker and what has been sent.

    ``logprobs_n`` is what the engine computes (best_of needs every candidate's logprobs to rank them),
    ``report_logprobs`` what the client asked to see (None: no logprobs in the response). ``prompt_source``:
    the prompt's first choice, whose engine request alone scores the prompt (its prompt logprobs are this
    choice's too); None when this choice scores it (or nobody asked). ``concatenative``: ``decode`` joins the
    tokens' texts (:func:`specdecode.generator.concatenative_decoder`; the tracker then decodes new ids only)."""

    def __init__(self, index: int, prompt_ids: list[int], params: SamplingParams, stops: list[str],
                 decode, logprobs: int | None, *, report_logprobs: int | None = None,
                 speculation: RequestSpeculation | None = None, prompt_logprobs: int | None = None,
                 echo: bool = False, include_stop: bool = False, prompt_source: Choice | None = None,
                 concatenative: bool = False) -> None:
        self.index = index
        self.prompt_ids = prompt_ids
        self.params = params
        self.decode = decode
        self.tracker = TextTracker(decode, stops, include_stop, concatenative=concatenative)
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
        self._base: tuple[int, str] = (0, "")  # a covered boundary and its text (concatenative decoders)
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
        """How many ids have their whole text inside the text shown so far (tokens that end inside a character
        count with the token that completes it)."""
        shown, ids, covered = self.tracker.shown, self.tracker.ids, self.sent
        for n in range(self.sent + 1, len(ids) + 1):
            prefix = self._text_of(n)
            whole = not prefix.endswith("\ufffd")
            prefix = prefix.rstrip("\ufffd")
            if len(prefix) > len(shown) or not shown.startswith(prefix):
                break
            if whole:
                covered = n
                if self.tracker.concatenative:  # decode from here next time
                    self._base = (n, prefix)
        return covered

    def _text_of(self, n: int) -> str:
        """``decode(ids[:n])``: with a concatenative decoder from the last covered boundary that ends with a whole
        character (O(new ids)), else whole."""
        b, text = self._base
        if self.tracker.concatenative and n >= b:
            return text + self.decode(self.tracker.ids[b:n])
        return self.decode(self.tracker.ids[:n])

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


class ClientGone(Exception):
    """The client of a non-streaming request disconnected."""


#: Queued in a job's event queue when its client disconnects.
_GONE = object()


class Job:
    """The engine requests of one HTTP request (prompts x n choices) and their event queue.

    :meth:`close` ends its accounting once: the outcome counter, and the token counters from
    :meth:`usage`, so /metrics totals are the sums of the usage the requests report.
    """

    def __init__(self, state: ServingState, endpoint: str, choices: list[Choice], n: int = 1) -> None:
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

    def _submit(self, choice: Choice) -> None:
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

    async def events(self) -> AsyncIterator[tuple[Choice, str, list[int], int]]:
        """Yield (choice, new text, ids, first id index) until every choice has finished.

        Raises:
            ClientGone: :meth:`client_gone` was called.
        """
        while not self.done:
            item = await self.queue.get()
            if item is _GONE:
                raise ClientGone
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

    def _observe(self, choice: Choice, ev: RowEvent) -> None:
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
        returns (``counted``: the choices' :attr:`Choice.counted`, computed here when not given)."""
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
