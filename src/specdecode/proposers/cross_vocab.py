"""A draft model with another tokenizer (heterogeneous vocabularies; Timor et al., ICML 2025).

The draft reads the committed text in its own tokens and drafts in its own tokens; what it proposes to
the target is in the target's tokens, and the target verifies it as any chain, so the output is the
target's whatever the draft does:

- **Greedy: string-level exact match** (Timor et al.'s SLEM, transformers' universal assisted
  generation). The draft decodes up to k of its tokens greedily; their text is encoded with the target's
  tokenizer and the first k target tokens are proposed (deterministic: no q). Verification keeps the
  target's own argmax token by token, so the output equals plain greedy decoding whatever the
  re-tokenization gives; the boundary only costs acceptance.
- **Sampling: token-level intersection** (Timor et al.'s TLI). Only tokens whose bytes exist in both
  vocabularies can be drafted: the draft's logits are restricted to the intersection, put at the target
  ids of the same bytes (-inf elsewhere), processed by the request's own sampling settings over the
  target's vocabulary, and one target token is sampled per draft step (the draft is fed the draft id of
  the same bytes). That q is a distribution over the target's vocabulary with q = 0 outside the
  intersection, so standard speculative sampling (accept with min(1, p/q), else sample the residual
  norm(max(0, p - q))) returns exactly p: Leviathan et al.'s proof needs only that the drafted token was
  drawn from the q reported, for any q. String-level rejection sampling (SLRS) is not implemented: its
  q of a string sums over every draft tokenization of that string, which costs a forward per
  tokenization.

The draft's context: the committed target tokens as bytes (``token_bytes.TokenBytes``, exact for byte-level
and SentencePiece vocabularies), decoded incrementally as UTF-8 (a character split across target tokens
waits for its last byte) and encoded with the draft's tokenizer up to the last whitespace (a stable
prefix that later text cannot re-tokenize); the text after it is re-encoded each step with what follows.
The draft's slot cache is synced to those ids by longest common prefix, so a rejection rolls it back to
the text the target committed.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdecode.kv import model_context
from specdecode.proposers.base import DraftModelSlots, ProposeContext, register, still_indexed
from specdecode.sampling import argmax
from specdecode.token_bytes import TokenBytes
from specdecode.types import Draft, SpecDecodeError


class VocabMap:
    """The tokens two vocabularies share: same bytes, same special-ness (one id each way).

    Args:
        target_tokenizer, draft_tokenizer: Hugging Face tokenizers.
        target_vocab, draft_vocab: the models' output sizes (ids at or past them are never mapped).

    Attributes:
        target_ids, draft_ids: [N] int64, the shared tokens' ids in each vocabulary (pairwise).
        to_draft: target id -> draft id of the shared tokens.
    """

    def __init__(self, target_tokenizer, draft_tokenizer, target_vocab: int, draft_vocab: int) -> None:
        self.target_bytes, self.draft_bytes = TokenBytes(target_tokenizer), TokenBytes(draft_tokenizer)
        by_bytes: dict[tuple[bytes, bool], int] = {}
        for i in range(min(len(draft_tokenizer), draft_vocab)):
            data = self.draft_bytes.bytes_of(i)
            if data:
                by_bytes.setdefault((data, self.draft_bytes.is_special(i)), i)
        pairs, used = [], set()
        for j in range(min(len(target_tokenizer), target_vocab)):
            data = self.target_bytes.bytes_of(j)
            i = by_bytes.get((data, self.target_bytes.is_special(j))) if data else None
            if i is not None and i not in used:
                used.add(i)
                pairs.append((j, i))
        self.target_ids = torch.tensor([j for j, _ in pairs], dtype=torch.int64)
        self.draft_ids = torch.tensor([i for _, i in pairs], dtype=torch.int64)
        self.to_draft = dict(pairs)
        self.target_size, self.draft_size = min(len(target_tokenizer), target_vocab), min(len(draft_tokenizer),
                                                                                          draft_vocab)

    def __len__(self) -> int:
        return len(self.to_draft)

    def describe(self) -> str:
        """One line: the intersection's size against both vocabularies."""
        return (f"{len(self):,} tokens shared of {self.target_size:,} (target) and {self.draft_size:,} (draft): "
                f"{len(self) / max(1, self.target_size):.0%} of the target's")


@dataclass
class _RowText:
    """One row's committed text as the draft sees it (``ctx.state``)."""

    seen: list[int] = field(default_factory=list)  # a copy of the target tokens already turned into text
    decoder: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))
    stable: list[int] = field(default_factory=list)  # draft ids of the text up to the last boundary
    tail: str = ""  # text after it, re-encoded every step


@dataclass(frozen=True)
class CrossVocabConfig:
    """Config of the cross-vocabulary draft proposer.

    Attributes:
        forward: the draft's forward backend ("auto", "hf", "owned").
    """

    forward: str = "auto"


@register("cross-vocab")
class CrossVocabProposer(DraftModelSlots):
    """Drafts with a model whose tokenizer differs from the target's (all rows in one forward per position).

    Args:
        model: the draft causal LM (eval mode).
        target_tokenizer, draft_tokenizer: the two Hugging Face tokenizers.
        target_vocab: the target's output size V (``config.vocab_size``; its logits' last dimension).
        config: CrossVocabConfig.

    Raises:
        SpecDecodeError: the vocabularies share no token.
    """

    name = "cross-vocab"

    def __init__(self, model: torch.nn.Module, target_tokenizer, draft_tokenizer, target_vocab: int,
                 config: CrossVocabConfig | None = None) -> None:
        self.config = config or CrossVocabConfig()
        self.model = model
        self.forward = self.config.forward
        self.max_context = model_context(model)
        self.runner = None
        self.target_tokenizer, self.draft_tokenizer = target_tokenizer, draft_tokenizer
        self.map = VocabMap(target_tokenizer, draft_tokenizer, target_vocab, int(model.config.vocab_size))
        if not len(self.map):
            raise SpecDecodeError("the draft's and the target's vocabularies share no token: nothing can be drafted")
        probe = draft_tokenizer("a")["input_ids"]
        bos = getattr(draft_tokenizer, "bos_token_id", None)
        self._bos = [bos] if bos is not None and probe and probe[0] == bos else []

    # ------------------------------------------------------------------ the draft's view of the text

    def _encode_draft(self, text: str) -> list[int]:
        return self.draft_tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def context_ids(self, ctx: ProposeContext) -> list[int]:
        """The committed tokens as draft ids: the stable prefix, then the re-encoded tail. A context that
        changed (replaced, cut, or rewritten in place: ``base.still_indexed``) is turned into text afresh."""
        row: _RowText | None = ctx.state.get("cross_vocab")
        if row is None or not still_indexed(row.seen, ctx.token_ids):
            row = ctx.state["cross_vocab"] = _RowText(stable=list(self._bos))
        new = ctx.token_ids[len(row.seen):]
        if new:
            data = b"".join(self.map.target_bytes.bytes_of(t) for t in new)
            row.seen.extend(new)
            text = row.tail + row.decoder.decode(data)
            cut = max(text.rfind(" "), text.rfind("\n"))  # a word starts with its space: cut before it
            if cut > 0:
                row.stable.extend(self._encode_draft(text[:cut]))
                text = text[cut:]
            row.tail = text
        return row.stable + self._encode_draft(row.tail)

    def to_target(self, draft_ids: Sequence[int], limit: int) -> list[int]:
        """The text of ``draft_ids`` in at most ``limit`` target tokens (a trailing partial character dropped)."""
        data = b"".join(self.map.draft_bytes.bytes_of(t) for t in draft_ids)
        text = codecs.getincrementaldecoder("utf-8")("replace").decode(data)  # final=False: a partial end waits
        if not text:
            return []
        ids = self.target_tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids[:limit]

    # ------------------------------------------------------------------ drafting

    @torch.inference_mode()
    def propose(self, batch: Sequence[ProposeContext], max_tokens: Sequence[int]) -> list[Draft]:
        """Row i: greedy, up to ``max_tokens[i]`` target tokens re-tokenized from the draft's text (no q);
        sampling, up to ``max_tokens[i]`` shared tokens with their q [1, k, V] over the target's vocabulary."""
        runner = self._bound()
        contexts = [self.context_ids(ctx) if k > 0 else [] for ctx, k in zip(batch, max_tokens)]
        caps = [min(k, self.max_context - len(ids) + 1) if ids else 0 for k, ids in zip(max_tokens, contexts)]
        if max(caps, default=0) <= 0:
            return [Draft.empty() for _ in batch]
        rows = slice(0, len(batch))
        logits, catch_up = self.sync_rows(contexts, caps)
        drafted: list[list[int]] = [[] for _ in batch]  # draft ids
        path: list[list[int]] = [[] for _ in batch]  # target ids (sampling)
        probs: list[list[torch.Tensor]] = [[] for _ in batch]
        live = [c > 0 for c in caps]
        v_draft = self.map.draft_size
        for pos in range(max(caps)):
            feed = []
            for i, ctx in enumerate(batch):
                if not live[i]:
                    feed.append([])
                    continue
                row_logits = logits[i, :v_draft]
                if ctx.params.greedy:
                    tok = int(argmax(row_logits))
                    hook = torch.softmax(row_logits.float(), -1)
                else:
                    full = torch.full((ctx.vocab_size,), float("-inf"), dtype=torch.float32)
                    keep = self.map.target_ids < ctx.vocab_size
                    full[self.map.target_ids[keep]] = row_logits[self.map.draft_ids[keep]].float()
                    q = ctx.draft_dist(full, path[i])
                    target_tok = ctx.draft_token(q, len(path[i]))
                    tok = self.map.to_draft.get(target_tok)
                    if tok is None:  # q is zero outside the intersection; a 0-probability draw cannot happen
                        live[i] = False
                        feed.append([])
                        continue
                    probs[i].append(q)
                    path[i].append(target_tok)
                    hook = q
                drafted[i].append(tok)
                live[i] = pos + 1 < caps[i] and ctx.keep_drafting(hook)
                feed.append([tok] if live[i] else [])
            if not any(live):
                break
            logits = runner.forward(rows, feed, last_only=True)[:, -1]
        out = []
        for i, ctx in enumerate(batch):
            if ctx.params.greedy:
                ids = [t for t in self.to_target(drafted[i], max_tokens[i]) if t < ctx.vocab_size]
                out.append(Draft.chain(torch.tensor([ids], dtype=torch.int64), None, catch_up_s=catch_up[i])
                           if ids else Draft.empty())
            elif path[i]:
                out.append(Draft.chain(torch.tensor([path[i]], dtype=torch.int64), torch.stack(probs[i]).unsqueeze(0),
                                       catch_up_s=catch_up[i]))
            else:
                out.append(Draft.empty())
        return out
