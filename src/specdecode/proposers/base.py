"""The proposer protocol and the registry that builds proposers by name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from specdecode.types import Draft, SamplingParams, VerifyResult


@dataclass
class ProposeContext:
    """What a proposer may look at for one request (batch size 1).

    Attributes:
        token_ids: every committed token, prompt first (a list the engine appends to).
        num_prompt_tokens: how many of ``token_ids`` are the prompt.
        params: the request's sampling parameters (drafts use the same processing).
        generator: the request's random generator (sampling drafters draw from it).
        vocab_size: the target's output vocabulary V; drafts must stay below it.
        should_continue: the draft-length policy's per-token hook, or None. Model-based
            drafters call it after each drafted token with the [V] float32 distribution
            the token came from (greedy: softmax of the raw logits); False ends the chain
            after that token. Deterministic drafters ignore it.
        target: the engine's target runner (``CachedModel`` or ``OwnedCachedModel``), for
            self-speculative drafters that draft on the target's own cache; they must leave
            its committed tokens' cache exactly as they found it. None where an engine does
            not offer it.
    """

    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator
    vocab_size: int
    should_continue: Callable[[torch.Tensor], bool] | None = None
    target: object | None = None

    def keep_drafting(self, probs: torch.Tensor) -> bool:
        """Ask the policy hook whether to draft another token after one drawn from ``probs`` [V]."""
        return self.should_continue is None or bool(self.should_continue(probs))


def draft_room(max_context: int, ctx: ProposeContext) -> int:
    """Most tokens a draft model of ``max_context`` positions can draft after ``ctx.token_ids``.

    It feeds every committed token and every drafted token but the last, so k drafts need
    ``len(token_ids) + k - 1 <= max_context``; 0 or less: the draft cannot hold the context.
    """
    return max_context - len(ctx.token_ids) + 1


class Proposer(Protocol):
    """Guesses the next tokens; the engine verifies them against the target.

    ``start`` is called once per request before the first ``propose``;
    ``observe`` after every verification (learn, or roll back own state).
    """

    def start(self, ctx: ProposeContext) -> None: ...

    def propose(self, ctx: ProposeContext, max_tokens: int) -> Draft: ...

    def observe(self, ctx: ProposeContext, result: VerifyResult) -> None: ...


ProposerFactory = Callable[..., Proposer]
PROPOSERS: dict[str, ProposerFactory] = {}


def register(name: str) -> Callable[[ProposerFactory], ProposerFactory]:
    """Class decorator: make a proposer buildable by ``build_proposer(name, ...)``."""

    def deco(factory: ProposerFactory) -> ProposerFactory:
        PROPOSERS[name] = factory
        return factory

    return deco
