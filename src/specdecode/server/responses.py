"""Response bodies: choices, logprobs and finish reasons in OpenAI's wire format."""

from __future__ import annotations

import time
import uuid
from contextlib import contextmanager

from starlette.requests import ClientDisconnect

from specdecode.server.choices import Choice
from specdecode.server.errors import APIError
from specdecode.server.state import ServingState
from specdecode.token_bytes import TokenBytes


# --------------------------------------------------------------------------- response bodies


def _top_dict(tb: TokenBytes, top: list[tuple[int, float]]) -> dict[str, float]:
    """Completions' top_logprobs of one token: {token string: logprob}, every alternative kept (a string
    already taken by a more likely alternative is keyed ``token_id:ID``)."""
    out: dict[str, float] = {}
    for t, lp in top:
        key = tb.text_of(t)
        out[key if key not in out else f"token_id:{t}"] = lp
    return out


def _completion_logprobs(state: ServingState, c: Choice, start: int, ids: list[int],
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


def _chat_logprobs(state: ServingState, c: Choice, start: int, ids: list[int]) -> dict | None:
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


def _prompt_logprobs(state: ServingState, c: Choice) -> list | None:
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


def completion_choice(state: ServingState, c: Choice, piece: str, ids: list[int], start: int, fin,
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


def chat_choice(state: ServingState, c: Choice, piece: str, ids: list[int], start: int, fin,
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


def response_base(state: ServingState, id_prefix: str, obj: str) -> dict:
    """The fields every response body and stream chunk of one request starts with."""
    return {"id": f"{id_prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
            "model": state.config.model_name}


@contextmanager
def counted_if_invalid(state: ServingState, endpoint: str):
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


def finish_reason_of(c: Choice) -> str | None:
    """OpenAI's finish_reason: "length" or "stop" (EOS or a stop string); engine-only reasons pass through."""
    return c.finish_reason
