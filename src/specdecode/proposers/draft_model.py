"""Draft-model proposer: a smaller causal LM with its own KV cache (Leviathan et al. 2023).

The draft cache holds a prefix of the committed tokens; each ``propose`` first
feeds whatever committed tokens the cache lacks (one, or two after a fully
accepted step), then drafts autoregressively. ``observe`` rolls the cache back
to the longest prefix that verification kept.

A draft whose context (``max_position_embeddings``) is shorter than the target's
drafts only as far as it fits: near its end the chains get shorter, and once the
committed tokens no longer fit it proposes nothing, so the engine decodes plainly
(lossless, and the metrics count no draft tokens for those steps).
"""

from __future__ import annotations

import dataclasses
import time

from dataclasses import dataclass

import torch

from specdecode.cache import model_context
from specdecode.fastforward import make_runner
from specdecode.proposers.base import ProposeContext, draft_room, register
from specdecode.sampling import logits_to_probs, sample
from specdecode.types import Draft, VerifyResult


@dataclass(frozen=True)
class DraftModelConfig:
    """Config of the draft-model proposer.

    Attributes:
        forward: the draft's forward backend ("auto", "hf", "owned"; see
            :func:`specdecode.fastforward.make_runner`).
    """

    forward: str = "auto"


@register("draft-model")
class DraftModelProposer:
    """Drafts with a small LM sharing the target's tokenizer.

    Args:
        model: a Hugging Face causal LM (eval mode) whose vocabulary ids match the target's.
        config: DraftModelConfig.
    """

    def __init__(self, model: torch.nn.Module, config: DraftModelConfig | None = None) -> None:
        self.config = config or DraftModelConfig()
        self.runner = make_runner(model, self.config.forward)
        self.max_context = model_context(model)  # positions the draft can hold

    def start(self, ctx: ProposeContext) -> None:
        self.runner.reset()

    @torch.inference_mode()
    def propose(self, ctx: ProposeContext, max_tokens: int) -> Draft:
        """Draft up to ``max_tokens`` tokens: [1, K] int64 ids and, when sampling, [1, K, V_draft] float32 q.

        Fewer when the draft's context cannot hold more (none: an empty draft).
        """
        max_tokens = min(max_tokens, draft_room(self.max_context, ctx))
        if max_tokens <= 0:
            return Draft.empty()
        self.runner.sync(ctx.token_ids)
        if self.runner.num_cached == len(ctx.token_ids):  # never feed nothing: recompute the last token
            self.runner.rollback(len(ctx.token_ids) - 1)
        vocab = ctx.vocab_size  # a draft with extra embedding rows never proposes past the target's
        gap = len(ctx.token_ids) - self.runner.num_cached
        t0 = time.perf_counter()
        logits = self.runner.forward(ctx.token_ids[self.runner.num_cached :], last_only=True)[-1, :vocab]
        # Feeding more than the usual 1-2 tokens is catching up (prompt prefill, skipped plain steps).
        catch_up_s = (time.perf_counter() - t0) * (gap - 1) / gap if gap > 2 else 0.0
        tokens, probs = [], []
        for i in range(max_tokens):
            if ctx.params.greedy:
                tok = logits.argmax(-1)
                q = None
            else:
                q = logits_to_probs(logits, ctx.params)
                tok = sample(q, ctx.generator)
                probs.append(q)
            tokens.append(tok)
            if i + 1 >= max_tokens:
                break
            if ctx.should_continue is not None:  # the policy's confidence hook (policy.py)
                if not ctx.keep_drafting(q if q is not None else torch.softmax(logits.float(), -1)):
                    break
            logits = self.runner.forward(tok.reshape(1))[-1, :vocab]
        token_ids = torch.stack(tokens).reshape(1, -1)
        draft_probs = torch.stack(probs).unsqueeze(0) if probs else None
        return dataclasses.replace(Draft.chain(token_ids, draft_probs), catch_up_s=catch_up_s)

    def observe(self, ctx: ProposeContext, result: VerifyResult) -> None:
        """Roll the draft cache back to what was committed."""
        self.runner.sync(ctx.token_ids)
