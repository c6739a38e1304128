"""Wire schemas of the OpenAI-compatible API (pydantic; only the server uses pydantic).

Requests are parsed strictly (``"5"`` is not an integer, ``1`` is not a boolean) so
a client bug gets a 400 that names the field instead of a silent coercion. Unknown
fields are ignored (OpenAI clients send ``user``, ``metadata`` and the like);
known OpenAI fields this server cannot honour get a 400 that says so.

Extensions beyond the OpenAI API: ``top_k`` (0 or -1 disables), ``ignore_eos``;
responses add ``usage.speculative`` and, per choice (also in stream chunks),
``token_ids``: the ids whose text that choice / chunk carries.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

#: Most choices one request may ask for (prompts x n).
MAX_CHOICES = 64
#: Most logprobs alternatives per token.
MAX_TOP_LOGPROBS = 20
#: Most stop strings per request (OpenAI's limit).
MAX_STOP = 4


def _token_limit(v: int | None, info: ValidationInfo) -> int | None:
    """``max_tokens`` / ``max_completion_tokens``: unset, or at least one token."""
    if v is not None and v < 1:
        raise ValueError(f"{info.field_name} must be >= 1, got {v}")
    return v


def _logprob_count(v: int | None, info: ValidationInfo) -> int | None:
    """``logprobs`` (completions) / ``top_logprobs`` (chat): unset, or 0 .. MAX_TOP_LOGPROBS alternatives."""
    if v is not None and not 0 <= v <= MAX_TOP_LOGPROBS:
        raise ValueError(f"{info.field_name} must be in [0, {MAX_TOP_LOGPROBS}], got {v}")
    return v


#: An optional token count of at least one.
TokenLimit = Annotated[int | None, AfterValidator(_token_limit)]
#: An optional number of logprobs alternatives per token.
LogprobCount = Annotated[int | None, AfterValidator(_logprob_count)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: TokenLimit = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v):
        if v is not None and (math.isnan(v) or not 0.0 <= v <= 2.0):
            raise ValueError(f"temperature must be in [0, 2] (0 = greedy), got {v}")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v):
        if v is not None and (math.isnan(v) or not 0.0 < v <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {v}")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v):
        if v is not None and v < -1:
            raise ValueError(f"top_k must be >= 0 (0 or -1 disables it), got {v}")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v):
        if not 1 <= v <= MAX_CHOICES:
            raise ValueError(f"n must be in [1, {MAX_CHOICES}], got {v}")
        return v

    @field_validator("seed")
    @classmethod
    def _seed(cls, v):
        if v is not None and not 0 <= v < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return v

    @model_validator(mode="after")
    def _unsupported(self):
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value not in (None, 0, 0.0):
                raise ValueError(f"{name} is not supported by this server; omit it or send 0")
        if self.repetition_penalty not in (None, 1, 1.0):
            raise ValueError("repetition_penalty is not supported by this server; omit it or send 1")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this server; omit it")
        return self

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: LogprobCount = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list: send a string, a list of strings or token ids")
        if isinstance(v, list) and isinstance(v[0], list) and any(not p for p in v):
            raise ValueError("each token-id prompt must hold at least one token")
        return v

    @model_validator(mode="after")
    def _completion_unsupported(self):
        if self.echo:
            raise ValueError("echo is not supported by this server; omit it or send false")
        if self.suffix:
            raise ValueError("suffix is not supported by this server; omit it")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (only best_of == n); omit it")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str | None:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: TokenLimit = None
    logprobs: bool = False
    top_logprobs: LogprobCount = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _messages(cls, v):
        if not v:
            raise ValueError("messages must hold at least one message, e.g. [{\"role\": \"user\", \"content\": \"Hi\"}]")
        for i, m in enumerate(v):
            if m.role != "assistant" and m.text() is None:
                raise ValueError(f"messages[{i}] ({m.role}) has no content")
        return v

    @model_validator(mode="after")
    def _chat_unsupported(self):
        if self.tools or self.functions or self.tool_choice not in (None, "none"):
            raise ValueError("tools / function calling are not supported by this server; omit them")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError("response_format other than {\"type\": \"text\"} is not supported; omit it")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self) -> list[dict]:
        """Messages as template input; 'developer' becomes 'system' (templates rarely know it)."""
        out = []
        for m in self.messages:
            role = "system" if m.role == "developer" else m.role
            out.append({"role": role, "content": m.text() or ""})
        return out


# --------------------------------------------------------------------------- responses


class SpeculativeUsage(BaseModel):
    """The speculative-decoding figures of one request (all its choices)."""

    drafted_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    mean_accepted_length: float = Field(description="tau: tokens committed per target forward after the prefill")
    target_forwards: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    speculative: SpeculativeUsage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specdecode"
    max_model_len: int
    draft: str
    num_speculative_tokens: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
