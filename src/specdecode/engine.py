"""The speculative-decoding loop: propose -> verify in one target pass -> accept / reject -> commit -> adapt.

Token ids in, token ids out; the engine never sees text. With no proposer
(or a draft length of 0) a step is one plain decoding step through the same
model, cache and sampling code, so the baseline compares like with like.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from specdecode.cache import model_context
from specdecode.fastforward import FORWARD_BACKENDS, make_runner
from specdecode.metrics import RunMetrics
from specdecode.policy import FixedPolicy
from specdecode.proposers.base import ProposeContext, Proposer
from specdecode.sampling import logits_to_probs, next_token
from specdecode.types import (
    Draft,
    EmptyPromptError,
    GenerationOutput,
    PromptTooLongError,
    SamplingParams,
    SpecDecodeError,
    StepOutput,
    VerifyResult,
)
from specdecode.tree import tree_depth, tree_inputs, verify_tree_greedy, verify_tree_sampling
from specdecode.verify import verify_greedy, verify_sampling


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings.

    Attributes:
        num_speculative_tokens: gamma, draft tokens per step (>= 1) for the fixed policy.
        max_context: context length in tokens; None reads the target's config.
        forward: target forward backend: "auto" (the project's own Llama / Qwen2
            forward when the model is supported, else Hugging Face), "hf", or "owned".
    """

    num_speculative_tokens: int = 5
    max_context: int | None = None
    forward: str = "auto"

    def __post_init__(self) -> None:
        if self.forward not in FORWARD_BACKENDS:
            raise SpecDecodeError(f"forward must be one of {FORWARD_BACKENDS}, got {self.forward!r}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 64:
            raise SpecDecodeError(
                f"num_speculative_tokens must be an integer in [1, 64], got {self.num_speculative_tokens!r}"
            )


@dataclass
class RequestState:
    """One request in flight: its context, randomness, counters and progress."""

    ctx: ProposeContext
    metrics: RunMetrics
    started_at: float
    finish_reason: str | None = None
    generated: list[int] = field(default_factory=list)

    @property
    def remaining(self) -> int:
        return self.ctx.params.max_new_tokens - len(self.generated)


class SpeculativeEngine:
    """Lossless speculative decoding of one target with one proposer (batch size 1).

    Args:
        target: Hugging Face causal LM (eval mode) whose distribution is preserved.
        proposer: a :class:`~specdecode.proposers.base.Proposer`, or None for plain decoding.
        config: EngineConfig.
        policy: draft-length policy (``next_length()``, ``update(drafted, accepted)``);
            default fixed gamma = ``config.num_speculative_tokens``.
    """

    def __init__(
        self,
        target: torch.nn.Module,
        proposer: Proposer | None = None,
        config: EngineConfig | None = None,
        policy=None,
    ) -> None:
        self.config = config or EngineConfig()
        self.target = make_runner(target, self.config.forward)
        self.proposer = proposer
        # Token-tree drafts (proposer.produces_trees) take the ancestor-mask path; decided once, here.
        self._trees = bool(getattr(proposer, "produces_trees", False))
        if self._trees:
            self.target.check_tree_support()
        self.policy = policy or FixedPolicy(self.config.num_speculative_tokens)
        self.max_context = self.config.max_context or model_context(target)

    # Public API ------------------------------------------------------------------

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> GenerationOutput:
        """Generate for one prompt.

        Args:
            prompt_ids: [L] int64 token ids, L >= 1.
            params: SamplingParams (greedy when temperature is 0).

        Returns:
            GenerationOutput with the generated ids, finish reason and RunMetrics.

        Raises:
            EmptyPromptError, PromptTooLongError.
        """
        state = self.start(prompt_ids, params)
        while state.finish_reason is None:
            self.step(state)
        return self.output(state)

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[StepOutput]:
        """Like :meth:`generate`, yielding each step's committed tokens as they come.

        The first item carries the token sampled from the prefill. The final
        GenerationOutput is available as ``engine.last_output`` afterwards, also
        when the caller stops iterating early (a stop string): its finish reason
        is then "stop".
        """
        state = self.start(prompt_ids, params)
        try:
            yield StepOutput(list(state.generated), 0, 0, state.finish_reason is not None, state.finish_reason)
            while state.finish_reason is None:
                yield self.step(state)
        finally:
            state.finish_reason = state.finish_reason or "stop"
            self.last_output = self.output(state)

    # The loop --------------------------------------------------------------------

    def start(self, prompt_ids: Sequence[int], params: SamplingParams) -> RequestState:
        """Validate, prefill the target, sample the first token, start the proposer."""
        prompt = self._check_prompt(prompt_ids, params)
        seed = params.seed if params.seed is not None else random.randrange(2**63)
        ctx = ProposeContext(
            list(prompt), len(prompt), params, torch.Generator().manual_seed(seed), self.target.vocab_size,
            should_continue=getattr(self.policy, "should_continue", None), target=self.target,
        )
        state = RequestState(ctx=ctx, metrics=RunMetrics(num_prompt_tokens=len(prompt)), started_at=time.perf_counter())
        self.target.reset()
        logits = self.target.forward(prompt, last_only=True)[-1]
        first = int(next_token(logits, params, ctx.generator))
        state.metrics.num_target_forwards += 1
        state.metrics.prefill_time_s = time.perf_counter() - state.started_at
        state.metrics.time_to_first_token_s = state.metrics.prefill_time_s
        self._commit(state, [first])
        if self.proposer is not None:
            self.proposer.start(ctx)
        self._finish_timing(state)
        return state

    def step(self, state: RequestState) -> StepOutput:
        """One iteration: propose, verify in one target pass, commit, adapt."""
        t0 = time.perf_counter()
        draft = self._propose(state)
        t1 = time.perf_counter()
        result = self._verify(state, draft)
        t2 = time.perf_counter()
        committed = self._commit(state, result.new_token_ids[0, : int(result.num_accepted[0]) + 1].tolist())
        self._observe(state, draft, result, committed, t1 - t0, t2 - t1)
        m = state.metrics
        m.draft_time_s += t1 - t0
        m.verify_time_s += t2 - t1
        self._finish_timing(state)
        return StepOutput(committed, draft.num_tokens, int(result.num_accepted[0]),
                          state.finish_reason is not None, state.finish_reason)

    def output(self, state: RequestState) -> GenerationOutput:
        return GenerationOutput(
            token_ids=list(state.generated),
            finish_reason=state.finish_reason or "length",
            metrics=state.metrics,
            prompt_token_ids=state.ctx.token_ids[: state.ctx.num_prompt_tokens],
        )

    # Parts -----------------------------------------------------------------------

    def _propose(self, state: RequestState) -> Draft:
        k = min(self.policy.next_length(), state.remaining - 1) if self.proposer is not None else 0
        if k <= 0:
            return Draft.empty()
        return self.proposer.propose(state.ctx, k)

    def _verify(self, state: RequestState, draft: Draft) -> VerifyResult:
        """Score the last committed token plus every draft token in one target forward."""
        if self._trees and draft.num_tokens:
            return self._verify_tree(state, draft)
        ctx = state.ctx
        draft_ids = draft.token_ids  # [1, K]
        logits = self.target.forward([ctx.token_ids[-1], *draft_ids[0].tolist()])  # [K+1, V]
        if ctx.params.greedy:
            return verify_greedy(draft_ids, logits.unsqueeze(0))
        target_probs = logits_to_probs(logits, ctx.params).unsqueeze(0)  # [1, K+1, V]
        draft_probs = draft.draft_probs
        if draft_probs is not None:
            draft_probs = _match_vocab(draft_probs, target_probs.shape[-1])
        return verify_sampling(draft_ids, draft_probs, target_probs, [ctx.generator])

    def _verify_tree(self, state: RequestState, draft: Draft) -> VerifyResult:
        """Score the root (last committed token) and every tree node in one forward with an
        ancestor mask; verify (greedy / multi-candidate sampling, ``specdecode.tree``); keep only
        the accepted path in the target cache."""
        ctx = state.ctx
        parents, _ = tree_inputs(draft.parents[0])
        logits = self.target.forward_tree([ctx.token_ids[-1], *draft.token_ids[0].tolist()], parents)  # [N+1, V]
        if ctx.params.greedy:
            result = verify_tree_greedy(draft.token_ids, draft.parents, logits.unsqueeze(0))
        else:
            target_probs = logits_to_probs(logits, ctx.params).unsqueeze(0)  # [1, N+1, V]
            draft_probs = draft.draft_probs
            if draft_probs is not None:
                draft_probs = _match_vocab(draft_probs, target_probs.shape[-1])
            result = verify_tree_sampling(draft.token_ids, draft.parents, draft_probs, target_probs, [ctx.generator])
        n = int(result.num_accepted[0])
        self.target.keep_tree_path([0, *(result.kept_nodes[0, :n] + 1).tolist()])
        return result

    def _commit(self, state: RequestState, tokens: list[int]) -> list[int]:
        """Append ``tokens`` after the stopping rules; cut the target cache back to them.

        Returns the tokens actually committed (cut at max_new_tokens and at EOS).
        """
        tokens, reason = apply_stopping_rules(tokens, state.ctx.params, len(state.generated))
        state.finish_reason = state.finish_reason or reason
        state.generated.extend(tokens)
        state.ctx.token_ids.extend(tokens)
        # The target cache holds every committed token but the last (the next step feeds it).
        self.target.rollback(min(self.target.num_cached, len(state.ctx.token_ids) - 1))
        return tokens

    def _observe(self, state: RequestState, draft: Draft, result: VerifyResult, committed: list[int],
                 draft_time_s: float | None = None, verify_time_s: float | None = None) -> None:
        n_acc = int(result.num_accepted[0])
        depth = tree_depth(draft.parents[0]) if self._trees and draft.num_tokens else None
        state.metrics.record_step(draft.num_tokens, n_acc, len(committed), depth=depth)
        if self.proposer is not None and draft.num_tokens:
            self.proposer.observe(state.ctx, result)
        # Policies reason in draft depth (gamma): a tree's depth, not its node count.
        drafted = depth if depth is not None else draft.num_tokens
        if draft_time_s is not None and draft.catch_up_s:
            draft_time_s = max(0.0, draft_time_s - draft.catch_up_s)  # a one-off cost, not per drafted token
        self.policy.update(drafted, n_acc, draft_time_s=draft_time_s, verify_time_s=verify_time_s)

    def _finish_timing(self, state: RequestState) -> None:
        state.metrics.num_generated_tokens = len(state.generated)
        state.metrics.wall_time_s = time.perf_counter() - state.started_at

    def _check_prompt(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise EmptyPromptError(
                "the prompt is empty: give at least one token (text callers: the tokenizer's BOS token is used "
                "when it has one)"
            )
        vocab = self.target.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise SpecDecodeError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
        if len(prompt) + params.max_new_tokens > self.max_context:
            raise PromptTooLongError(
                f"prompt of {len(prompt)} tokens + max_new_tokens {params.max_new_tokens} exceeds the model's "
                f"context of {self.max_context} tokens: shorten the prompt or lower max_new_tokens"
            )
        return prompt


def apply_stopping_rules(tokens: list[int], params: SamplingParams, num_generated: int) -> tuple[list[int], str | None]:
    """The stopping rules of one request (single-sequence and batched engines alike).

    Args:
        tokens: [n] token ids a step would commit, in order.
        params: the request's SamplingParams (max_new_tokens, eos_token_ids, ignore_eos).
        num_generated: tokens the request generated before these.

    Returns:
        (the tokens to commit: cut at max_new_tokens and just after the first EOS, the finish
        reason: "stop" (EOS committed), "length" (max_new_tokens reached) or None (go on)).
    """
    remaining = params.max_new_tokens - num_generated
    tokens = tokens[:remaining]
    if not params.ignore_eos and params.eos_token_ids:
        for i, tok in enumerate(tokens):
            if tok in params.eos_token_ids:
                return tokens[: i + 1], "stop"
    return tokens, "length" if len(tokens) >= remaining else None


def _match_vocab(probs: torch.Tensor, vocab: int) -> torch.Tensor:
    """Zero-pad [..., V_draft] q up to the target's V (drafters never exceed V: see ProposeContext)."""
    v = probs.shape[-1]
    return probs if v == vocab else torch.nn.functional.pad(probs, (0, vocab - v))
