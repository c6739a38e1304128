"""Scheduling around the one engine: a queue, admission, a background thread, cancellation.

The engine (:class:`~specdecode.engine.SpeculativeEngine`) owns the step; this module decides
which requests are in the batch. ``submit`` and ``cancel`` may be called from any thread (the
server's event loop); the loop thread admits waiting requests into free slots between steps
(each one prefilled on its own), runs :meth:`SpeculativeEngine.step`, delivers each row's
:class:`RowEvent` to its request's ``on_event`` and drops cancelled requests within one step.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specdecode.engine import Request, RequestSpeculation, SpeculativeEngine
from specdecode.metrics import RunMetrics
from specdecode.types import SamplingParams, SpecDecodeError, StepOutput

logger = logging.getLogger(__name__)


class QueueFullError(SpecDecodeError):
    """The waiting queue is full; the caller should retry later (HTTP 429)."""


class EngineStoppedError(SpecDecodeError):
    """The scheduler was closed and takes no more requests (HTTP 503)."""


@dataclass
class RowEvent(StepOutput):
    """What one step did for one request, as delivered on the scheduler thread: the engine's
    :class:`~specdecode.types.StepOutput` plus the request's RunMetrics (totals so far; final when
    finished). A request that never ran (cancelled while waiting, failed at admission) gets one
    event with no tokens."""

    metrics: RunMetrics | None = None


@dataclass
class BatchRequest:
    """A request for :meth:`Scheduler.submit`.

    Attributes:
        prompt_ids: [L] token ids, L >= 1.
        params: SamplingParams (greedy when temperature is 0; seed seeds the row's own generator).
        on_event: called with each RowEvent on the scheduler thread (keep it short: hand off to a queue).
        logprobs: None = no logprobs; n >= 0 = the chosen token's logprob plus the top n.
        speculation: the request's own ``engine.RequestSpeculation`` (None: the engine's settings).
        prompt_logprobs: None, or n >= 0: score the prompt tokens too (on the first event).
        constraint: a structured-output constraint of this request alone (``grammar.CompiledGrammar.new_constraint()``),
            or None.
    """

    prompt_ids: list[int]
    params: SamplingParams
    on_event: Callable[[RowEvent], None]
    logprobs: int | None = None
    speculation: RequestSpeculation | None = None
    prompt_logprobs: int | None = None
    constraint: object = None
    id: int = field(default_factory=itertools.count().__next__)
    cancelled: bool = False
    submitted_at: float = field(default_factory=time.perf_counter)
    row: Request | None = None
    ended: bool = False  # its last event (finished) was delivered


@dataclass
class StepStats:
    """One iteration, for monitoring: rows decoded, gamma, seconds, tokens committed / drafted / accepted."""

    batch_size: int
    gamma: int
    seconds: float
    num_committed: int
    num_drafted: int
    num_accepted: int
    queue_length: int


class Scheduler:
    """Continuous batching over one :class:`SpeculativeEngine`.

    Args:
        engine: the engine (its ``max_batch_size`` is the number of rows run together).
        max_queue: requests waiting for a slot before :meth:`submit` raises QueueFullError.
        on_step: called with StepStats after each iteration (scheduler thread).
    """

    def __init__(self, engine: SpeculativeEngine, max_queue: int = 64,
                 on_step: Callable[[StepStats], None] | None = None) -> None:
        if not isinstance(max_queue, int) or max_queue < 0:
            raise SpecDecodeError(f"max_queue must be an integer >= 0, got {max_queue!r}")
        self.engine = engine
        self.max_queue = max_queue
        self.on_step = on_step
        self.vocab_size = engine.vocab_size
        self.max_context = engine.max_context
        self._pending: deque[BatchRequest] = deque()
        self._lock = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    # Thread-safe API ---------------------------------------------------------------

    def check_prompt(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise the error a request would get (empty prompt, ids out of range, too long)."""
        self.engine.check_prompt(prompt_ids, params)

    def submit(self, request: BatchRequest) -> BatchRequest:
        """Queue a request; it joins the batch at the next step with a free slot.

        Raises:
            EmptyPromptError, PromptTooLongError, SpecDecodeError, QueueFullError, EngineStoppedError.
        """
        self.check_prompt(request.prompt_ids, request.params)
        with self._lock:
            if self._closed:
                raise EngineStoppedError("the engine is shutting down; no new requests are taken")
            free = self.engine.max_batch_size - len(self.engine.rows)
            waiting = sum(not r.cancelled for r in self._pending)  # cancelled ones leave at the next step
            if waiting >= self.max_queue + max(0, free):
                raise QueueFullError(
                    f"the server is busy: {len(self.engine.rows)} requests running and {len(self._pending)} waiting "
                    f"(--max-queue {self.max_queue}); retry later")
            self._pending.append(request)
            self._lock.notify_all()
        return request

    def cancel(self, request: BatchRequest) -> None:
        """Stop a request at the next step boundary and free its slot (no events after 'cancelled')."""
        with self._lock:
            request.cancelled = True
            self._lock.notify_all()

    @property
    def num_active(self) -> int:
        return len(self.engine.rows)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def start(self) -> None:
        """Run the loop in a daemon thread until :meth:`close`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="specdecode-scheduler", daemon=True)
            self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the loop; cancel what is running or waiting."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        for row in list(self.engine.rows):
            row.tag.cancelled = True
        self._drop_cancelled()
        while self._pending:
            self._end(self._pending.popleft(), None, "cancelled")

    @property
    def alive(self) -> bool:
        """True while the loop thread runs (or was never started: ``step`` is driven by hand)."""
        return self._thread is None or self._thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not self.engine.rows and not self._pending:
                    self._lock.wait()
                if self._closed:
                    return
            try:
                self.step()
            except Exception:  # noqa: BLE001 - e.g. a failing on_step hook: log it, keep serving
                logger.exception("scheduler step failed")

    # One iteration -------------------------------------------------------------------

    def step(self) -> StepStats | None:
        """Drop cancelled rows, admit waiting requests (prefill), one engine step, deliver its events.

        Returns StepStats, or None when there was nothing to decode. An exception inside the model
        ends the running requests with an error event; the scheduler keeps serving. An interrupt that
        is not an Exception (KeyboardInterrupt while the scheduler is stepped by hand), wherever it comes
        from (a listener, an admission, the engine's step), ends every request that had a row with a
        "cancelled" event, frees every row, and is raised; requests still waiting stay queued.
        """
        rows: list[Request] = []
        try:
            self._drop_cancelled()
            self._admit()
            if not self.engine.rows:
                self._maybe_release()
                return None
            t0 = time.perf_counter()
            rows = list(self.engine.rows)
            outputs = self.engine.step()
            drafted = accepted = committed = 0
            for row, out in outputs:
                self._emit(row, out)
                drafted += out.num_drafted
                accepted += out.num_accepted
                committed += len(out.token_ids)
        except BaseException as exc:  # noqa: BLE001 - report to the requests; keep the loop alive on an Exception
            self._fail_all(exc, rows)
            if not isinstance(exc, Exception):
                raise
            return None
        batch = len(rows)
        self._maybe_release()
        stats = StepStats(batch, self.engine.last_gamma, time.perf_counter() - t0,
                          committed, drafted, accepted, len(self._pending))
        if self.on_step is not None:
            self.on_step(stats)
        return stats

    def _admit(self) -> None:
        """Prefill waiting requests into free slots, one forward each; a failing one fails alone."""
        while len(self.engine.rows) < self.engine.max_batch_size:
            with self._lock:
                if not self._pending:
                    return
                request = self._pending.popleft()
            if request.cancelled:
                self._end(request, None, "cancelled")
                continue
            try:  # a failing admission frees its own row (``engine.add``)
                row, first = self.engine.add(request.prompt_ids, request.params, request.logprobs, tag=request,
                                             speculation=request.speculation,
                                             prompt_logprobs=request.prompt_logprobs, constraint=request.constraint)
            except BaseException as exc:  # noqa: BLE001 - this request fails alone; the batch goes on
                if isinstance(exc, Exception):
                    self._end(request, None, "error", f"{type(exc).__name__}: {exc}")
                    continue
                self._end(request, None, "cancelled")
                raise
            request.row = row
            self._emit(row, first)

    def _emit(self, row: Request, out: StepOutput) -> None:
        request: BatchRequest = row.tag
        event = RowEvent(out.token_ids, out.num_drafted, out.num_accepted, out.finished, out.finish_reason,
                         out.logprobs, out.top_logprobs, out.error or row.error, out.prompt_logprobs,
                         metrics=row.metrics)
        request.ended = request.ended or out.finished
        try:
            request.on_event(event)
        except Exception:  # noqa: BLE001 - a broken listener cancels its own request, not the engine
            request.cancelled = True

    def _end(self, request: BatchRequest, row: Request | None, reason: str, error: str | None = None) -> None:
        """The last event of a request that did not finish in a step (cancelled, failed)."""
        metrics = row.metrics if row is not None else RunMetrics(num_prompt_tokens=len(request.prompt_ids))
        request.ended = True
        try:
            request.on_event(RowEvent([], finished=True, finish_reason=reason, metrics=metrics, error=error))
        except Exception:  # noqa: BLE001 - a broken listener must not stop the scheduler
            pass

    def _drop_cancelled(self) -> None:
        for row in [r for r in self.engine.rows if r.tag is not None and r.tag.cancelled]:
            self.engine.abort(row)
            self._end(row.tag, row, "cancelled")

    def _maybe_release(self) -> None:
        if not self.engine.rows and self.engine.runner.capacity:
            self.engine.release()
            _trim_heap()

    def _fail_all(self, exc: BaseException, rows: Sequence[Request] = ()) -> None:
        """``exc`` cut a step short: every row leaves the engine (``rows``, the step's batch, may have left
        it already) and every request among them without its last event gets one: "error" naming ``exc``,
        or "cancelled" for an interrupt that is not an Exception."""
        reason = "error" if isinstance(exc, Exception) else "cancelled"
        message = f"{type(exc).__name__}: {exc}" if reason == "error" else None
        every = list(rows) + [r for r in self.engine.rows if not any(r is s for s in rows)]
        for row in every:
            self.engine.abort(row, reason)
            if row.tag is not None and not row.tag.ended:
                self._end(row.tag, row, reason, message)
        self.engine.release()

    # Introspection -----------------------------------------------------------------

    def stats(self) -> dict:
        """Rows running, requests waiting, bytes held by the KV caches, the policy's acceptance estimate."""
        engine = self.engine
        estimate = None
        if hasattr(engine.policy, "acceptance"):  # read-only: never asks the policy for a length
            rates = engine.policy.acceptance()
            estimate = rates[0] if rates else None
        return {
            "active": len(engine.rows),
            "pending": sum(not r.cancelled for r in self._pending),
            "kv_cache_bytes": engine.runner.nbytes + (engine.proposer.nbytes if engine.proposer is not None else 0),
            "gamma": engine.last_gamma,
            "acceptance_estimate": estimate,
        }


def _trim_heap() -> None:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim``), so an idle server's resident
    memory drops back after a burst."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
