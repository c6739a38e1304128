"""Draft-model proposer: a smaller causal LM drafting for every row at once (Leviathan et al. 2023).

The draft has its own slot KV cache whose rows mirror the engine's (row i in slot i). Each step:
cut every row back to the longest prefix verification kept (a length change), feed what it lacks
(one or two tokens; a prompt is fed alone first so the batch is not padded to it), then draft: per
position each row picks its token with its own parameters and generator (argmax, or a sample from
q after the same temperature / top-k / top-p), and all rows' tokens go through ONE batched draft
forward.

A draft whose context (``max_position_embeddings``) is shorter than the target's drafts for a row
only while its tokens fit: near the end the chains get shorter, past it the row decodes plainly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdecode.kv import FORWARD_BACKENDS, model_context
from specdecode.proposers.base import DraftModelSlots, ProposeContext, draft_room, register
from specdecode.types import Draft, SpecDecodeError


@dataclass(frozen=True)
class DraftModelConfig:
    """Config of the draft-model proposer.

    Attributes:
        forward: the draft's forward backend ("auto", "hf", "owned"; see :func:`specdecode.kv.make_runner`).
        vocab: score only the draft's first ``vocab`` token ids (its output layer's first rows) plus, per
            row, the ids its own context holds past them and the end-of-sequence ids (the others get
            probability 0); 0 = every id; None (default) = :data:`specdecode.options.AUTO_DRAFT_VOCAB` (32,768) where the draft's vocabulary
            holds more than twice that and its forward can limit it (the owned forward), else every id.
            Cuts the draft's step where its output layer is large (the Qwen2.5 0.5B: 151,936 rows; measured
            on the Qwen2.5-Coder pair: tokens/s 1.06x with τ 3.32 against 3.38, docs/results/kernels/
            e2e_qwen_tile32); lossless, since the target verifies every draft token
            (:meth:`specdecode.kv.owned.OwnedRunner.limit_vocabulary`).
    """

    forward: str = "auto"
    vocab: int | None = None

    def __post_init__(self) -> None:
        if self.forward not in FORWARD_BACKENDS:
            raise SpecDecodeError(f"forward must be one of {FORWARD_BACKENDS}, got {self.forward!r}")
        if self.vocab is not None and self.vocab < 0:
            raise SpecDecodeError(f"vocab must be a token count (0: every id; unset: automatic), got {self.vocab!r}")


@register("draft-model")
class DraftModelProposer(DraftModelSlots):
    """Drafts with a small LM sharing the target's tokenizer, all rows in one forward per position.

    Args:
        model: a Hugging Face causal LM (eval mode) whose vocabulary ids match the target's.
        config: DraftModelConfig.
    """

    def __init__(self, model: torch.nn.Module, config: DraftModelConfig | None = None) -> None:
        self.config = config or DraftModelConfig()
        self.model = model
        self.forward = self.config.forward
        self.max_context = model_context(model)
        self.runner = None

    @torch.inference_mode()
    def propose(self, batch: Sequence[ProposeContext], max_tokens: Sequence[int]) -> list[Draft]:
        """Up to ``max_tokens[i]`` tokens for row i: chains [1, k_i] int64 (+ [1, k_i, V] float32 q when sampling)."""
        runner = self._bound()
        caps = [min(k, draft_room(self.max_context, ctx)) for ctx, k in zip(batch, max_tokens)]
        if max(caps, default=0) <= 0:
            return [Draft.empty() for _ in batch]
        rows = slice(0, len(batch))
        logits, catch_up = self.sync_rows([ctx.token_ids for ctx in batch], caps)  # [b, V_draft] at each last token
        tokens: list[list[int]] = [[] for _ in batch]
        probs: list[list[torch.Tensor]] = [[] for _ in batch]
        live = [c > 0 for c in caps]
        for pos in range(max(caps)):
            feed = []
            for i, ctx in enumerate(batch):
                if not live[i]:
                    feed.append([])  # done: padding only
                    continue
                q = ctx.draft_dist(logits[i, : ctx.vocab_size], tokens[i])  # processed along the draft path
                tok = ctx.draft_token(q, len(tokens[i]))
                if not ctx.params.greedy:
                    probs[i].append(q)
                tokens[i].append(tok)
                live[i] = pos + 1 < caps[i] and (ctx.should_continue is None or ctx.keep_drafting(q))
                feed.append([tok] if live[i] else [])  # a row's last draft token is never fed
            if not any(live):
                break
            logits = runner.forward(rows, feed, last_only=True)[:, -1]
        return [Draft.chain(torch.tensor([t], dtype=torch.int64), torch.stack(p).unsqueeze(0) if p else None,
                            catch_up_s=c) if t else Draft.empty()
                for t, p, c in zip(tokens, probs, catch_up)]
