"""One request in the engine's batch (its context, randomness, counters and progress), the prompt checks every
front end shares, and the stopping rules applied to the tokens a step commits."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from specdecode.config import RequestSpeculation
from specdecode.metrics import RunMetrics
from specdecode.proposers.base import ProposeContext
from specdecode.sampling import RequestSampler
from specdecode.types import EmptyPromptError, PromptTooLongError, SamplingParams, SpecDecodeError


_request_ids = itertools.count()


@dataclass
class Request:
    """One request in the batch: its context, randomness, counters and progress.

    Attributes:
        ctx: what the proposer sees (``ctx.slot`` = its row); metrics: RunMetrics.
        logprobs: None, or n >= 0: report each committed token's logprob and the top n.
        generated: committed output tokens; finish_reason: None while running; error: why it failed.
        tag: anything the caller attaches (the scheduler's event sink).
        seed: the seed of the request's generator (the one given, or the fresh one drawn for it).
        prompt_logprobs: None unless asked (``add(prompt_logprobs=n)``): per prompt token
            (logprob, rank, top n [(token id, logprob)]) under the target given the tokens before it;
            the first token has (None, None, []).
    """

    ctx: ProposeContext
    metrics: RunMetrics
    started_at: float
    logprobs: int | None = None
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    tag: object = None
    seed: int | None = None
    speculation: RequestSpeculation = field(default_factory=RequestSpeculation)
    prompt_logprobs: list[tuple[float | None, int | None, list[tuple[int, float]]]] | None = None
    id: int = field(default_factory=_request_ids.__next__)

    @property
    def sampler(self) -> RequestSampler:
        return self.ctx.sampler

    @property
    def params(self) -> SamplingParams:
        return self.ctx.params

    @property
    def remaining(self) -> int:
        return self.ctx.params.max_new_tokens - len(self.generated)


def check_prompt(prompt_ids: Sequence[int], params: SamplingParams, vocab_size: int, max_context: int) -> list[int]:
    """The prompt checks every front end shares (see :meth:`SpeculativeEngine.check_prompt`)."""
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise EmptyPromptError("the prompt is empty: give at least one token (text callers: the tokenizer's BOS "
                               "token is used when it has one)")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise SpecDecodeError(f"prompt token ids must be in [0, {vocab_size}); got {bad[:5]}")
    if len(prompt) + params.max_new_tokens > max_context:
        raise PromptTooLongError(too_long(len(prompt), params.max_new_tokens, max_context))
    return prompt


def too_long(n: int, max_new_tokens: int, context: int, knob: str = "max_new_tokens", prompt: str = "the prompt") -> str:
    """The one line for a prompt of ``n`` tokens that, with ``max_new_tokens`` more, does not fit the model's
    ``context`` tokens, and what to do: lower ``knob`` (the setting's name where the caller reads it: the library's
    ``max_new_tokens``, the command line's ``--max-new-tokens``) when the prompt leaves room, else shorten the prompt,
    and both when the cap alone fills the context. ``prompt``: how to name the prompt (e.g. "prompt 'spec-bench/3'")."""
    room = context - n
    if room >= 1:
        advice = f"shorten the prompt or lower {knob} to at most {room}"
    elif max_new_tokens < context:
        advice = f"shorten the prompt to at most {context - max_new_tokens} tokens (it leaves no room to generate)"
    else:
        advice = f"lower {knob} below {context} and shorten the prompt"
    return (f"{prompt} has {n} token{'s' * (n != 1)}; with {knob} {max_new_tokens} it exceeds the model's context of "
            f"{context} tokens: {advice}")


def apply_stopping_rules(tokens: list[int], params: SamplingParams, num_generated: int) -> tuple[list[int], str | None]:
    """The stopping rules of one request.

    Args:
        tokens: [n] token ids a step would commit, in order.
        params: the request's SamplingParams (max_new_tokens, eos_token_ids, ignore_eos, stop_token_ids).
        num_generated: tokens the request generated before these.

    Returns:
        (the tokens to commit: cut at max_new_tokens and just after the first EOS, the finish reason:
        "stop" (EOS committed), "length" (max_new_tokens reached) or None (go on)).
    """
    remaining = params.max_new_tokens - num_generated
    tokens = tokens[:remaining]
    stops = params.stop_ids
    if stops:
        for i, tok in enumerate(tokens):
            if tok in stops:
                return tokens[: i + 1], "stop"
    return tokens, "length" if len(tokens) >= remaining else None
