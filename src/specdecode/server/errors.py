"""The server's errors: OpenAI-style error bodies, and reading and validating a request body."""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from specdecode.server.schemas import NOT_SUPPORTED, ChatCompletionRequest, CompletionRequest, SpeculativeOptions


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


async def read_body(request: Request, limit: int) -> bytes:
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


def validate_body(body: bytes, model_cls):
    """Parse and validate ``body`` as ``model_cls`` (thread pool: a big body takes milliseconds)."""
    if not body.strip():
        raise APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        return model_cls.model_validate_json(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None
