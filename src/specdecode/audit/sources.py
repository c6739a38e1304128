"""Where an audit's samples come from: an OpenAI-compatible endpoint, or this project's engine in-process.

A source answers two questions (:class:`SampleSource`): ``draw`` (completions of a prompt, one per seed, with
the request's sampling settings, each cut to its first n tokens) and ``greedy`` (one greedy completion).
Both return :class:`Outcome`: the completion's token ids when the source gives them (our server's
``token_ids``; the engine's own), else its text, and why it ended. A wrong sampler for a negative control
is a source too: the same interface, a deliberately different law.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

from specdecode.audit.config import AuditError
from specdecode.types import SamplingParams

#: How often a request is retried after a 429 (queue full) or a 5xx / a dropped connection.
MAX_BUSY_RETRIES, MAX_ERROR_RETRIES = 120, 3


@dataclass(frozen=True)
class AuditPrompt:
    """One audited prompt.

    Attributes:
        id: its name in the report. token_ids: [L] int the prompt as the target's ids (chat template applied
            when asked). text: the same prompt as text (what ``--prompt-format text`` sends).
    """

    id: str
    token_ids: tuple[int, ...]
    text: str | None = None


@dataclass(frozen=True)
class Outcome:
    """One completion as the source returned it.

    Attributes:
        token_ids: its ids (a stop token included or not), None when the source gives only text.
        text: its text, None when not given.
        finish_reason: "stop" (a stop token ended it), "length", or what the source said.
    """

    token_ids: tuple[int, ...] | None
    text: str | None
    finish_reason: str | None

    @property
    def stopped(self) -> bool:
        return self.finish_reason == "stop"


class SampleSource(Protocol):
    """What :mod:`specdecode.audit.runner` samples from."""

    name: str

    def draw(self, prompt: AuditPrompt, params: SamplingParams, num_tokens: int, seeds: Sequence[int],
             progress: Callable[[int], None] | None = None) -> list[Outcome]:
        """One completion of at least ``num_tokens`` tokens (fewer when a stop token ends it) per seed, in seed
        order, sampled with ``params`` (its seed and max_new_tokens replaced); ``progress(k)`` after k more."""

    def greedy(self, prompt: AuditPrompt, params: SamplingParams, max_new_tokens: int) -> Outcome:
        """One greedy completion of up to ``max_new_tokens`` tokens (``params``' processing, temperature 0)."""


# --------------------------------------------------------------------------- in-process


class EngineSource:
    """Samples from a :class:`specdecode.engine.SpeculativeEngine` (batched; every drafter).

    A request runs ``num_tokens + gamma`` tokens and is aborted once it holds ``num_tokens``: its first block
    then drafts a full gamma, and when to stop looking depends on nothing but the count, so the first tokens
    keep their law. Rows are seeded ``seeds[i]``; ``coupled`` is the requests' sampling mode
    (``SamplingParams.coupled``: False = standard rejection sampling, the default here; True = coupled; None
    = auto, coupled since every row is seeded).

    Args:
        engine: the engine (its ``max_batch_size`` rows are filled at once).
        name: how the report names the source.
        coupled: see above.

    Attributes:
        drafted, accepted: draft tokens verified / kept over every request drawn so far, counted up to the
            tokens drawn (``SpeculativeEngine.abort(keep=)``).
    """

    def __init__(self, engine, name: str = "specdecode engine (in-process)", coupled: bool | None = False) -> None:
        self.engine = engine
        self.name = name
        self.coupled = coupled
        self.drafted = self.accepted = 0

    def request_params(self, params: SamplingParams) -> SamplingParams:
        """The SamplingParams a row is added with (a negative control overrides this)."""
        return params

    def draw(self, prompt, params, num_tokens, seeds, progress=None) -> list[Outcome]:
        engine = self.engine
        gamma = engine.config.num_speculative_tokens
        base = dataclasses.replace(params, max_new_tokens=num_tokens + gamma, coupled=self.coupled)
        waiting = list(seeds)[::-1]
        requests = []
        ids = list(prompt.token_ids)
        done = 0
        with contextlib.ExitStack() as running:  # however this ends, no request of this draw keeps a row
            while waiting or engine.rows:
                while waiting and len(engine.rows) < engine.max_batch_size:
                    params_i = self.request_params(dataclasses.replace(base, seed=waiting.pop()))
                    requests.append(running.enter_context(engine.running(ids, params_i))[0])
                engine.step()
                for row in [r for r in engine.rows if len(r.generated) >= num_tokens]:
                    engine.abort(row)
                if progress is not None:
                    progress(len(requests) - len(engine.rows) - done)
                done = len(requests) - len(engine.rows)
        for r in requests:
            engine.abort(r, keep=num_tokens)  # the counters cover the tokens drawn, not the extra ones
            self.drafted += r.metrics.num_drafted_tokens
            self.accepted += r.metrics.num_accepted_tokens
        return [Outcome(tuple(r.generated[:num_tokens]), None, "stop" if r.finish_reason == "stop" else "length")
                for r in requests]

    def greedy(self, prompt, params, max_new_tokens) -> Outcome:
        out = self.engine.generate(list(prompt.token_ids), dataclasses.replace(
            params, temperature=0.0, max_new_tokens=max_new_tokens, seed=None, coupled=None))
        self.drafted += out.metrics.num_drafted_tokens
        self.accepted += out.metrics.num_accepted_tokens
        return Outcome(tuple(out.token_ids), None, out.finish_reason)


# --------------------------------------------------------------------------- OpenAI-compatible endpoint


def _base_url(url: str) -> str:
    """``http://host:port`` from what a user may type (a trailing ``/``, ``/v1``, ``/v1/completions``)."""
    base = url.strip().rstrip("/")
    for suffix in ("/v1/completions", "/v1"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
    if not base.startswith(("http://", "https://")):
        raise AuditError(f"--endpoint {url!r} is not an http(s) URL: give the server's address, like "
                         "http://127.0.0.1:8000")

    try:
        host, _ = urlsplit(base).hostname, urlsplit(base).port  # .port raises on a malformed port
    except ValueError as exc:
        raise AuditError(f"--endpoint {url!r} is not a valid URL ({exc}): give the server's address, like "
                         "http://127.0.0.1:8000") from None
    if not host:
        raise AuditError(f"--endpoint {url!r} names no host: give the server's address, like http://127.0.0.1:8000")
    return base


class EndpointSource:
    """Samples from an OpenAI-compatible server's ``POST /v1/completions`` (ours, vLLM, llama.cpp's server).

    Each sample is one request (``n`` 1, ``max_tokens`` = the tokens tested, the request's sampling fields,
    ``seed`` = its seed), sent ``concurrency`` at a time from a thread pool. Only fields that differ from the
    OpenAI defaults are sent (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``stop_token_ids``
    are vLLM's extensions, which our server also takes). A 429 is retried after its Retry-After.

    Args:
        url: the server's base URL (``http://127.0.0.1:8000``, with or without ``/v1``).
        model: the ``model`` the server serves (checked by :meth:`check`).
        api_key: sent as ``Authorization: Bearer ...`` when given.
        concurrency: requests in flight (1..256). timeout: seconds per request.
        prompt_format: "ids" sends the prompt as token ids (no re-tokenization by the server), "text" as text.
        extra: more fields for every request (e.g. our server's ``speculative`` extension).

    Raises:
        AuditError: a URL that is not http(s).
    """

    def __init__(self, url: str, model: str, *, api_key: str | None = None, concurrency: int = 8,
                 timeout: float = 120.0, prompt_format: str = "ids", extra: dict | None = None) -> None:
        # lazy: httpx (start-up time)
        import httpx

        self.base = _base_url(url)
        self.url = url
        self.model = model
        self.name = f"{model} at {self.base}"
        self.concurrency = concurrency
        self.prompt_format = prompt_format
        self.extra = dict(extra or {})
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
        self.client = httpx.Client(base_url=self.base, headers=headers, timeout=timeout, limits=limits)
        self.card: dict = {}

    # Checks ------------------------------------------------------------------------------

    def check(self) -> dict:
        """``GET /v1/models``: the server answers and serves ``model``; returns its model card.

        Raises:
            AuditError: unreachable, no OpenAI API there, an API key needed, or another model served.
        """
        resp = self._send("GET", "/v1/models")
        try:
            data = resp.json()["data"]
            ids = [str(m["id"]) for m in data]
        except (ValueError, KeyError, TypeError):
            raise AuditError(f"{self.base}/v1/models did not answer an OpenAI model list (got "
                             f"{resp.text[:120]!r}): is --endpoint an OpenAI-compatible server?") from None
        if self.model not in ids:
            raise AuditError(f"the server at {self.base} does not serve model {self.model!r}; it serves "
                             f"{', '.join(map(repr, ids)) or 'nothing'}: give --model {ids[0] if ids else 'NAME'}")
        self.card = next(m for m in data if str(m["id"]) == self.model)
        return self.card

    @property
    def is_specdecode(self) -> bool:
        """Whether the server is ``specdecode serve`` (its model card's ``owned_by``)."""
        return self.card.get("owned_by") == "specdecode"

    # Requests ----------------------------------------------------------------------------

    def body(self, prompt: AuditPrompt, params: SamplingParams, max_tokens: int, seed: int | None) -> dict:
        """The JSON body of one completion request."""
        if self.prompt_format == "text":
            if prompt.text is None:
                raise AuditError(f"prompt {prompt.id!r} has no text to send: use --prompt-format ids")
            sent = prompt.text
        else:
            sent = list(prompt.token_ids)
        body = {"model": self.model, "prompt": sent, "max_tokens": max_tokens, "temperature": params.temperature,
                "n": 1, "stream": False}
        optional = {"top_p": (params.top_p, 1.0), "top_k": (params.top_k, 0), "min_p": (params.min_p, 0.0),
                    "presence_penalty": (params.presence_penalty, 0.0),
                    "frequency_penalty": (params.frequency_penalty, 0.0),
                    "repetition_penalty": (params.repetition_penalty, 1.0), "min_tokens": (params.min_tokens, 0),
                    "ignore_eos": (params.ignore_eos, False)}
        for name, (value, default) in optional.items():
            if value != default:
                body[name] = value
        if params.logit_bias:
            body["logit_bias"] = {str(k): v for k, v in params.logit_bias.items()}
        if params.stop_token_ids:
            body["stop_token_ids"] = list(params.stop_token_ids)
        if seed is not None:
            body["seed"] = seed
        body.update(self.extra)
        return body

    def complete(self, body: dict) -> Outcome:
        """POST one completion; the first choice as an Outcome.

        Raises:
            AuditError: the server refused the request (its message), or answered no completion.
        """
        busy = errors = 0
        while True:
            resp = self._send("POST", "/v1/completions", json=body, retry=errors < MAX_ERROR_RETRIES)
            if resp.status_code == 429 and busy < MAX_BUSY_RETRIES:
                busy += 1
                time.sleep(min(5.0, float(resp.headers.get("retry-after", "1") or 1)))
                continue
            if resp.status_code >= 500 and errors < MAX_ERROR_RETRIES:
                errors += 1
                time.sleep(1.0)
                continue
            break
        if resp.status_code != 200:
            raise AuditError(f"the server refused a completion request ({resp.status_code}): {_message(resp)}")
        try:
            choice = resp.json()["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            raise AuditError(f"{self.base}/v1/completions answered no completion choice (got "
                             f"{resp.text[:120]!r})") from None
        ids = choice.get("token_ids")
        if ids is None and isinstance(choice.get("tokens"), list) and all(isinstance(t, int) for t in choice["tokens"]):
            ids = choice["tokens"]  # some servers name the ids so
        return Outcome(None if ids is None else tuple(int(t) for t in ids), choice.get("text"),
                       choice.get("finish_reason"))

    def _send(self, method: str, path: str, retry: bool = True, **kw):
        # lazy: httpx (start-up time)
        import httpx

        for attempt in range(MAX_ERROR_RETRIES + 1):
            try:
                resp = self.client.request(method, path, **kw)
            except httpx.ConnectError as exc:  # nothing listens there: said at once
                raise AuditError(f"cannot reach {self.base} ({exc}): start the server (e.g. 'specdecode serve "
                                 "--target MODEL --port 8000') or fix --endpoint") from None
            except httpx.TimeoutException:
                if retry and attempt < MAX_ERROR_RETRIES:
                    continue
                raise AuditError(f"{self.base}{path} did not answer within {self.client.timeout.read} s: raise "
                                 "--timeout or lower --concurrency") from None
            except httpx.HTTPError as exc:
                if retry and attempt < MAX_ERROR_RETRIES:
                    time.sleep(1.0)
                    continue
                raise AuditError(f"{method} {self.base}{path} failed: {exc}") from None
            if resp.status_code == 401:
                raise AuditError(f"{self.base} wants an API key ({_message(resp)}): give --api-key")
            if resp.status_code == 404 and path == "/v1/models":
                raise AuditError(f"no OpenAI-compatible API at {self.base} (GET /v1/models answered 404): give the "
                                 "server's base URL, like http://127.0.0.1:8000")
            return resp
        raise AssertionError("unreachable")

    def draw(self, prompt, params, num_tokens, seeds, progress=None) -> list[Outcome]:
        bodies = [self.body(prompt, params, num_tokens, seed) for seed in seeds]
        out: list[Outcome | None] = [None] * len(bodies)
        with ThreadPoolExecutor(self.concurrency) as pool:
            futures = {pool.submit(self.complete, b): i for i, b in enumerate(bodies)}
            try:
                for fut in as_completed(futures):
                    out[futures[fut]] = fut.result()
                    if progress is not None:
                        progress(1)
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
        return out  # type: ignore[return-value]

    def greedy(self, prompt, params, max_new_tokens) -> Outcome:
        return self.complete(self.body(prompt, dataclasses.replace(params, temperature=0.0), max_new_tokens, None))

    def close(self) -> None:
        self.client.close()


def _message(resp) -> str:
    """The error message of an OpenAI-style error body (else the start of the body)."""
    try:
        err = resp.json()["error"]
        param = f" (param {err['param']})" if err.get("param") else ""
        return f"{err['message']}{param}"
    except (ValueError, KeyError, TypeError):
        return resp.text[:200] or resp.reason_phrase


__all__ = ["AuditPrompt", "EndpointSource", "EngineSource", "Outcome", "SampleSource"]
