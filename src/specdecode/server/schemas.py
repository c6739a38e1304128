"""Wire schemas of the OpenAI-compatible API (pydantic; only the server uses pydantic).

Requests are parsed strictly (``"5"`` is not an integer, ``1`` is not a boolean) so a client bug
gets a 400 that names the field instead of a silent coercion. Nothing is silently ignored: a field
this server does not know gets a 400 naming it (``param`` = the field), and so does a known OpenAI
field it cannot honour (tools, audio, beam search, ...: :data:`NOT_SUPPORTED`; null, and ``"tool_choice":
"none"``, ask for nothing and are accepted). Accepted without effect on the output: ``user``, ``metadata``
(echoed nowhere), ``store: false`` and ``service_tier: "auto" / "default"``. The schemas check the wire's
own forms and limits (types, temperature [0, 2], top_k -1, token-id strings, list lengths); every range
the library also has is checked by the library (``specdecode.validate``) and answered as a 400 naming the
wire field.

Sampling fields, on /v1/completions and /v1/chat/completions alike (OpenAI's unless marked vLLM):
``temperature`` [0, 2], ``top_p`` (0, 1], ``top_k`` (vLLM; 0 or -1 disables), ``min_p`` (vLLM, [0, 1]),
``presence_penalty`` / ``frequency_penalty`` [-2, 2], ``repetition_penalty`` (vLLM, (0, 100]),
``logit_bias`` (token id as a string -> bias in [-100, 100]; -100 bans the token), ``seed``, ``n``,
``stop`` (at most 4 strings), ``min_tokens`` (vLLM: EOS and stop_token_ids held back until then),
``stop_token_ids`` (vLLM), ``ignore_eos`` (vLLM), ``allowed_token_ids`` (vLLM), ``prompt_logprobs``
(vLLM: the top n alternatives of every prompt token, per choice). Completions also take ``echo``
(the prompt, and with ``logprobs`` its tokens' logprobs, first None) and ``best_of`` (that many
candidates per prompt, the ``n`` with the highest cumulative logprob returned; not with ``stream``).

Text options (vLLM's): ``include_stop_str_in_output`` (default false: the text ends before the stop string
that ended it; true: with it, and ``token_ids`` up to the token that completed it) and
``skip_special_tokens`` (default true: special tokens such as EOS and chat markers are left out of the text;
false: their text is kept, in the output and in ``echo``'s prompt).

Structured output, on both endpoints: ``response_format`` as OpenAI's ``{"type": "text"}``, ``{"type":
"json_object"}`` or ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``
(checked and compiled by ``specdecode.grammar``; a malformed one or an invalid schema is a 400 with
``param: "response_format"``), or vLLM's ``guided_json`` (a JSON schema, as an object or its JSON text),
``guided_regex`` (a regular expression the whole output matches) and ``guided_choice`` (a list of strings:
the output is exactly one of them). At most one of these four per request (a 400 naming the second; a
``response_format`` of type text asks for nothing); an invalid one is a 400 naming its field. The grammar
masks the target and the drafts alike: the output is constrained plain decoding's, one-line JSON followed
by EOS (``finish_reason: "stop"``).

The extension ``"speculative"``: this request's own speculation, ``{"enabled": bool (default true;
false decodes it plainly: usage.speculative.num_drafted_tokens is 0 and the output is the same),
"num_speculative_tokens": 1..64 (this request's gamma in place of the server's draft-length policy),
"verification": "token" | "block" | "auto" (how its sampled drafts are verified: token-wise rejection
sampling, Leviathan et al. 2023, or block verification, Sun et al. 2024; both keep the target's
distribution), "sampling_mode": "auto" | "standard" | "coupled" (``SamplingParams.coupled`` None / False /
True: "coupled" keys every random draw by (seed, position, purpose), so a seeded speculative request
reproduces seeded plain decoding token for token; "standard" is rejection sampling with the request's own
generator; "auto", the default, is coupled when a seed is given)}``.

Responses add ``usage.speculative`` (num_drafted_tokens, num_accepted_tokens, acceptance_rate,
mean_accepted_length, num_target_forwards of the request's choices together) and, per choice (also in
stream chunks), ``token_ids``: the ids whose text that choice / chunk carries.

Logprobs are log-softmax of the target's raw logits (temperature 1, before penalties and biases) at
each committed token. A token's ``bytes`` are its own bytes from the vocabulary (``specdecode.token_bytes``:
a character split across tokens gives each token its partial bytes); its ``token`` string is its UTF-8
text, ``bytes:\\xNN...`` when it holds only part of a character, and a special token's name
(``<|im_end|>``). Completions' ``top_logprobs`` dicts keep every alternative: when two alternatives'
strings collide, the later one is keyed ``token_id:ID``.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from specdecode.options import SAMPLING_MODES, VERIFICATION_METHODS

#: Most choices one request may ask for (prompts x n, prompts x best_of).
MAX_CHOICES = 64
#: Most logprobs alternatives per token.
MAX_TOP_LOGPROBS = 20
#: Most stop strings per request (OpenAI's limit).
MAX_STOP = 4
#: Most token ids in stop_token_ids / allowed_token_ids / logit_bias.
MAX_TOKEN_IDS = 4096

#: Known OpenAI / vLLM request fields this server refuses, and what each would ask for.
NOT_SUPPORTED = {
    "tools": "tools / function calling", "tool_choice": "tools / function calling",
    "functions": "tools / function calling", "function_call": "tools / function calling",
    "parallel_tool_calls": "tools / function calling", "audio": "audio output", "modalities": "output modalities",
    "prediction": "predicted outputs", "reasoning_effort": "reasoning effort", "web_search_options": "web search",
    "bad_words": "bad_words (ban a word's tokens with logit_bias -100 instead)",
    "use_beam_search": "beam search", "length_penalty": "beam search",
    "guided_grammar": "vLLM's grammar formats (use guided_json, guided_regex, guided_choice or response_format)",
    "spaces_between_special_tokens": "spaces_between_special_tokens (the fast tokenizers this server decodes with "
                                     "have no such option)",
    "truncate_prompt_tokens": "prompt truncation", "logprobs_mode": "logprobs_mode",
}

#: Values of refused fields that ask for nothing, accepted as if the field were absent (null always is).
_ASKS_FOR_NOTHING = {"tool_choice": "none", "tools": [], "functions": []}


def _asks_for_nothing(name: str, value) -> bool:
    """A refused field given a value that asks for nothing (null, or its :data:`_ASKS_FOR_NOTHING` value)."""
    if name not in NOT_SUPPORTED:
        return False
    return value is None or (name in _ASKS_FOR_NOTHING and value == _ASKS_FOR_NOTHING[name])


#: The fields that ask for a structured output; a request gives at most one.
STRUCTURED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice")


def _token_limit(v: int | None, info: ValidationInfo) -> int | None:
    """``max_tokens`` / ``max_completion_tokens``: unset, or at least one token."""
    if v is not None and v < 1:
        raise ValueError(f"{info.field_name} must be >= 1, got {v}")
    return v


def _logprob_count(v: int | None, info: ValidationInfo) -> int | None:
    """``logprobs`` (completions) / ``top_logprobs`` (chat) / ``prompt_logprobs``: unset, or 0 ..
    MAX_TOP_LOGPROBS alternatives."""
    if v is not None and not 0 <= v <= MAX_TOP_LOGPROBS:
        raise ValueError(f"{info.field_name} must be in [0, {MAX_TOP_LOGPROBS}], got {v}")
    return v


def _token_ids(v: list[int] | None, info: ValidationInfo) -> list[int] | None:
    """``stop_token_ids`` / ``allowed_token_ids``: at most MAX_TOKEN_IDS ids (their values are checked by the
    library, ``validate.check_sampling`` and ``check_token_ids``)."""
    if v is not None and len(v) > MAX_TOKEN_IDS:
        raise ValueError(f"{info.field_name} takes at most {MAX_TOKEN_IDS} token ids, got {len(v)}")
    return v


#: An optional token count of at least one.
TokenLimit = Annotated[int | None, AfterValidator(_token_limit)]
#: An optional number of logprobs alternatives per token.
LogprobCount = Annotated[int | None, AfterValidator(_logprob_count)]
#: An optional list of token ids.
TokenIds = Annotated[list[int] | None, AfterValidator(_token_ids)]


def _in_range(name: str, v: float | None, low: float, high: float, what: str, low_open: bool = False):
    if v is None:
        return v
    ok = (low < v if low_open else low <= v) and v <= high
    if math.isnan(v) or not ok:
        raise ValueError(f"{name} must be in {'(' if low_open else '['}{low:g}, {high:g}] ({what}), got {v}")
    return v


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


#: The names of the sampling modes (``speculative.sampling_mode``).
_SAMPLING_MODE_NAMES = tuple(SAMPLING_MODES)


class SpeculativeOptions(_Strict):
    """The ``"speculative"`` extension: this request's own speculation (see the module docstring). Its values
    are range-checked by the library (``validate.check_request_speculation``)."""

    enabled: bool = True
    num_speculative_tokens: int | None = None
    verification: Literal[VERIFICATION_METHODS] | None = None
    sampling_mode: Literal[_SAMPLING_MODE_NAMES] = "auto"

    @property
    def coupled(self) -> bool | None:
        """``SamplingParams.coupled`` of the sampling mode (None: auto)."""
        return SAMPLING_MODES[self.sampling_mode]


class _SamplingFields(_Strict):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: TokenLimit = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0
    stop_token_ids: TokenIds = None
    allowed_token_ids: TokenIds = None
    prompt_logprobs: LogprobCount = None
    speculative: SpeculativeOptions | None = None
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # accepted, and changing nothing in the output
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_asks_for_nothing(cls, data):
        """A known OpenAI field this server refuses is accepted as null (``"tools": null`` asks for nothing),
        and so are the values in :data:`_ASKS_FOR_NOTHING` (``"tool_choice": "none"``); an unknown name is
        refused even when null (a typo)."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not _asks_for_nothing(k, v)}
        return data

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v):
        return _in_range("temperature", v, 0.0, 2.0, "0 = greedy")

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        """The wire form of the keys (token ids as decimal strings); the biases are the library's to check."""
        if v is None:
            return v
        if len(v) > MAX_TOKEN_IDS:
            raise ValueError(f"logit_bias takes at most {MAX_TOKEN_IDS} token ids, got {len(v)}")
        for key in v:
            if not (key.isascii() and key.isdigit()):  # "²" is a digit to str.isdigit, not to int()
                raise ValueError(f"logit_bias keys must be token ids as strings (\"1234\"), got {key!r}")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v):
        """-1 is the wire's "disabled" (vLLM's), 0 the library's; below that the library refuses."""
        if v is not None and v < -1:
            raise ValueError(f"top_k must be >= 0 (0 or -1 disables it), got {v}")
        return v

    @field_validator("guided_choice")
    @classmethod
    def _guided_choice(cls, v):
        if v is not None and not v:
            raise ValueError("guided_choice must hold at least one string (omit it for free text)")
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

    @field_validator("store")
    @classmethod
    def _store(cls, v):
        if v:
            raise ValueError("store: true is not supported: this server stores no completions; omit it or send false")
        return v

    @field_validator("service_tier")
    @classmethod
    def _service_tier(cls, v):
        if v not in (None, "auto", "default"):
            raise ValueError(f"service_tier {v!r} is not supported: this server has one tier; omit it or send "
                             f"\"auto\"")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true (as OpenAI's API); omit it")
        return self

    @model_validator(mode="after")
    def _one_structured_output(self):
        given = [name for name in STRUCTURED_FIELDS if getattr(self, name) is not None]
        if self.response_format == {"type": "text"}:  # asks for nothing
            given.remove("response_format")
        if len(given) > 1:
            raise ValueError(f"{given[1]} cannot be combined with {given[0]}: give at most one of "
                             f"{', '.join(STRUCTURED_FIELDS)}")
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

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v):
        if v is not None and not 1 <= v <= MAX_CHOICES:
            raise ValueError(f"best_of must be in [1, {MAX_CHOICES}], got {v}")
        return v

    @model_validator(mode="after")
    def _completion_unsupported(self):
        if self.suffix:
            raise ValueError("suffix is not supported by this server (no fill-in-the-middle); omit it")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be >= n ({self.n}): best_of candidates are generated "
                             f"and the n best returned")
        if self.stream and self.candidates > self.n:
            raise ValueError("best_of > n cannot stream (the best are known only at the end); send stream: false")
        return self

    @property
    def candidates(self) -> int:
        """Choices generated per prompt: best_of (when given), else n."""
        return self.best_of if self.best_of is not None else self.n

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


#: Message fields of OpenAI's API this server takes only as null (what a client copying a response back sends).
_NULL_MESSAGE_FIELDS = ("refusal", "tool_calls", "function_call", "audio", "annotations")


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_fields(cls, data):
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in _NULL_MESSAGE_FIELDS)}
        return data

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
    def _top_logprobs_need_logprobs(self):
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

    num_drafted_tokens: int = Field(description="draft tokens verified that could be returned: none past the last "
                                                "returned token (0 with speculative.enabled false)")
    num_accepted_tokens: int = Field(description="draft tokens verification kept, up to the last returned token")
    acceptance_rate: float = Field(description="num_accepted_tokens / num_drafted_tokens (0 when none drafted)")
    mean_accepted_length: float = Field(description="tau: returned tokens per target forward after the prefill")
    num_target_forwards: int = Field(description="target forwards that produced a returned token, the prefills "
                                                 "included (one per choice)")


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
