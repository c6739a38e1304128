"""Building jobs: a request body's prompts, sampling parameters, speculation and grammar into a job."""

from __future__ import annotations

import functools

from specdecode.engine import RequestSpeculation
from specdecode.grammar import CompiledGrammar, StructuredOutput, compile_grammar
from specdecode.server.choices import Choice, Job
from specdecode.server.errors import APIError
from specdecode.server.schemas import ChatCompletionRequest
from specdecode.request import too_long
from specdecode.server.state import ServingState
from specdecode.types import PromptTooLongError, SamplingParams, SpecDecodeError
from specdecode.validate import check_token_ids


# --------------------------------------------------------------------------- building jobs


def check_served(state: ServingState, model: str) -> None:
    if model != state.config.model_name:
        raise APIError(404, f"model '{model}' is not served here; this server serves '{state.config.model_name}' "
                            f"(see GET /v1/models)", param="model", code="model_not_found")


def encode_prompts(state: ServingState, prompts: list[str | list[int]]) -> list[list[int]]:
    """Text prompts through the tokenizer, id prompts checked against the vocabulary (thread pool)."""
    out = []
    for prompt in prompts:
        if isinstance(prompt, str):
            try:
                out.append(state.text.encode(prompt))
            except SpecDecodeError as exc:
                raise APIError(400, str(exc), param="prompt") from None
            continue
        try:  # the engine's own prompt checks (ids in the vocabulary, not empty); the context is checked with max_tokens
            out.append(state.engine.check_prompt(prompt, SamplingParams(max_new_tokens=1)))
        except PromptTooLongError:
            out.append(list(prompt))  # reported by _params, which names max_tokens
        except SpecDecodeError as exc:
            raise APIError(400, str(exc), param="prompt", code="invalid_value") from None
    return out


def encode_chat(state: ServingState, messages: list[dict]) -> list[int]:
    """Chat messages through the chat template (thread pool)."""
    try:
        return state.text.encode_chat(messages)
    except SpecDecodeError as exc:
        raise APIError(400, str(exc), param="messages") from None
    except Exception as exc:  # noqa: BLE001 - a chat template may refuse a message order
        raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from None


#: SamplingParams' names of the settings whose wire field has another name.
_WIRE_NAME = {"max_new_tokens": "max_tokens", "enabled": "speculative.enabled",
              "num_speculative_tokens": "speculative.num_speculative_tokens",
              "verification": "speculative.verification"}


def _params(state: ServingState, body, prompt_ids: list[int], max_new: int | None, default: int,
            index: int) -> SamplingParams:
    """SamplingParams of choice ``index``; 400 when the prompt plus max_tokens overflows the context, or a
    value is out of range (``param`` = the wire field)."""
    context = state.engine.max_context
    room = context - len(prompt_ids)
    field = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None else "max_tokens"
    if room < 1:
        raise APIError(400, f"the prompt has {len(prompt_ids)} token{'s' * (len(prompt_ids) != 1)}, which leaves no room in the model's context "
                            f"of {context} tokens: shorten the prompt", param="messages" if
                       isinstance(body, ChatCompletionRequest) else "prompt", code="context_length_exceeded")
    if max_new is None:
        max_new = min(default, room)
    elif max_new > room:  # the library's and the command line's line, with the wire field's name
        raise APIError(400, too_long(len(prompt_ids), max_new, context, field), param=field,
                       code="context_length_exceeded")
    top_k = body.top_k if body.top_k not in (None, -1) else 0
    seed = None if body.seed is None else (body.seed + index) % 2**63
    try:
        params = SamplingParams(
            temperature=1.0 if body.temperature is None else float(body.temperature),
            top_k=top_k, top_p=1.0 if body.top_p is None else float(body.top_p),
            min_p=0.0 if body.min_p is None else float(body.min_p),
            presence_penalty=0.0 if body.presence_penalty is None else float(body.presence_penalty),
            frequency_penalty=0.0 if body.frequency_penalty is None else float(body.frequency_penalty),
            repetition_penalty=1.0 if body.repetition_penalty is None else float(body.repetition_penalty),
            logit_bias={int(k): float(v) for k, v in body.logit_bias.items()} if body.logit_bias else None,
            allowed_token_ids=body.allowed_token_ids, stop_token_ids=tuple(body.stop_token_ids or ()),
            min_tokens=body.min_tokens, max_new_tokens=max_new, seed=seed, eos_token_ids=state.target.eos_token_ids,
            ignore_eos=body.ignore_eos, coupled=None if body.speculative is None else body.speculative.coupled,
        )
        # the engine's own rules for the token ids (in the vocabulary, some token left), before submitting
        check_token_ids(state.engine.vocab_size, logit_bias=params.logit_bias,
                        allowed_token_ids=params.allowed_token_ids, banned_token_ids=params.banned_token_ids,
                        stop_token_ids=params.stop_token_ids)
    except SpecDecodeError as exc:
        name = getattr(exc, "field", None)
        param = field if name == "max_new_tokens" else _WIRE_NAME.get(name, name)
        raise APIError(400, str(exc), param=param, code="invalid_value") from None
    return params


def _speculation(body) -> RequestSpeculation | None:
    """The request's ``"speculative"`` extension as the engine's RequestSpeculation (None: the server's)."""
    spec = body.speculative
    if spec is None:
        return None
    try:
        return RequestSpeculation(enabled=spec.enabled, num_speculative_tokens=spec.num_speculative_tokens,
                                  verification=None if spec.verification in (None, "auto") else spec.verification)
    except SpecDecodeError as exc:
        raise APIError(400, str(exc), param=_WIRE_NAME.get(getattr(exc, "field", None), "speculative"),
                       code="invalid_value") from None


def _structured(body) -> StructuredOutput | None:
    """The request's structured output: vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` or
    OpenAI's ``response_format`` (the schema lets at most one through; None: plain text).

    Raises:
        SpecDecodeError: a malformed one (``field``: its field).
    """
    if body.guided_json is not None:
        return StructuredOutput.json_schema(body.guided_json, "guided_json")
    if body.guided_regex is not None:
        return StructuredOutput.regex(body.guided_regex, "guided_regex")
    if body.guided_choice is not None:
        return StructuredOutput.choice(body.guided_choice, "guided_choice")
    return StructuredOutput.from_response_format(body.response_format)


def request_grammar(state: ServingState, body) -> CompiledGrammar | None:
    """The request's structured output compiled for the target (None: plain text; thread pool, the first
    compile builds the tokenizer's llguidance copy); a 400 naming its field (response_format, guided_json,
    ...) when it is malformed or its schema or regex invalid."""
    try:
        structured = _structured(body)
        if structured is None:
            return None
        return compile_grammar(state.target.tokenizer, state.engine.vocab_size, structured,
                               state.target.eos_token_ids)
    except SpecDecodeError as exc:
        raise APIError(400, str(exc), param=getattr(exc, "field", None) or "response_format",
                       code="invalid_value") from None


def make_job(state: ServingState, endpoint: str, body, prompts: list[list[int]], max_new: int | None,
             default_max: int, logprobs: int | None, *, echo: bool = False, grammar: CompiledGrammar | None = None) -> Job:
    """The engine requests of one HTTP request: per prompt, ``n`` choices (``best_of`` candidates on
    completions; they are ranked at the end). ``logprobs``: what the client asked to see; ``grammar``: the
    structured output every choice follows (each with its own constraint). The prompt is scored (prompt
    logprobs, echo with logprobs) once, by its first choice; the others of that prompt share its scores."""
    per_prompt = getattr(body, "candidates", body.n)
    if len(prompts) * per_prompt > 64:
        what = "best_of" if per_prompt != body.n else "n"
        raise APIError(400, f"{len(prompts)} prompts x {what}={per_prompt} = {len(prompts) * per_prompt} choices; at "
                            f"most 64 per request", param=what, code="invalid_value")
    engine_logprobs = logprobs if per_prompt == body.n else (logprobs or 0)  # best_of ranks by logprobs
    prompt_n = body.prompt_logprobs
    if echo and logprobs is not None:
        prompt_n = max(prompt_n or 0, logprobs)
    speculation = _speculation(body)
    decode = state.text.decode if body.skip_special_tokens else functools.partial(state.text.decode,
                                                                                  skip_special_tokens=False)
    choices = []
    for p, ids in enumerate(prompts):
        first = None
        for j in range(per_prompt):
            index = p * per_prompt + j
            params = _params(state, body, ids, max_new, default_max, index)
            choice = Choice(index, ids, params, body.stops, decode, engine_logprobs, report_logprobs=logprobs,
                             speculation=speculation, prompt_logprobs=prompt_n, echo=echo,
                             include_stop=body.include_stop_str_in_output, prompt_source=first,
                             concatenative=state.text.decode_is_concatenative)
            if first is None:
                first = choice
            choice.report_prompt_logprobs = body.prompt_logprobs
            choice.constraint = None if grammar is None else grammar.new_constraint()
            choices.append(choice)
    return Job(state, endpoint, choices, per_prompt)


def best_choices(job: Job, n: int) -> list[tuple[int, Choice]]:
    """best_of: per prompt, the n candidates with the highest cumulative logprob (ties: the earlier one),
    renumbered 0.. in that order; every candidate still counts in usage."""
    per_prompt = job.n
    if per_prompt == n:
        return [(c.index, c) for c in job.choices]
    out = []
    for p in range(len(job.choices) // per_prompt):
        group = job.choices[p * per_prompt : (p + 1) * per_prompt]
        ranked = sorted(group, key=lambda c: (-c.cumulative_logprob, c.index))[:n]
        out.extend((p * n + j, c) for j, c in enumerate(ranked))
    return out
