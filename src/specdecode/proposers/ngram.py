"""N-gram proposer: prompt lookup decoding (Saxena 2023; vLLM ``ngram``, HF ``prompt_lookup_num_tokens``).

Match the last n committed tokens, for n from ``max_ngram`` down to
``min_ngram``, against everything before them (prompt and output); propose
the tokens that followed the most recent match. No model, deterministic: q
is one-hot, so the verifier accepts a token with probability p(token).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdecode.proposers.base import ProposeContext, RowProposer, register, still_indexed
from specdecode.types import Draft
from specdecode.options import DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN
from specdecode.validate import check_ngram_sizes


@dataclass(frozen=True)
class NgramConfig:
    """Match lengths (tokens). ``min_ngram`` >= 1, ``max_ngram`` >= ``min_ngram``."""

    min_ngram: int = DEFAULT_NGRAM_MIN
    max_ngram: int = DEFAULT_NGRAM_MAX

    def __post_init__(self) -> None:
        check_ngram_sizes(self.min_ngram, self.max_ngram)


def find_continuation(tokens: np.ndarray, n: int, max_tokens: int) -> np.ndarray:
    """Continuation of the most recent earlier occurrence of the last ``n`` tokens.

    Args:
        tokens: [L] int64 committed tokens.
        n: n-gram length to match.
        max_tokens: longest continuation to return.

    Returns:
        [k] int64, 0 <= k <= max_tokens (empty when there is no match).
    """
    if len(tokens) <= n:
        return tokens[:0]
    pattern = tokens[-n:]
    windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # [L-n, n]
    hits = np.flatnonzero((windows == pattern).all(axis=1))
    if hits.size == 0:
        return tokens[:0]
    start = int(hits[-1]) + n
    return tokens[start : start + max_tokens]


class NgramIndex:
    """The latest end position of every n-gram of a token list (n in [min_n, max_n]), kept up to date as the
    list grows: a lookup is a few dictionary reads whatever the context's length (``find_continuation``
    scans the whole context for each n: about 20 us per n at 300 tokens, and a step asks up to three).

    Every n-gram ending before the last position is indexed, so the last n tokens never match themselves
    (``find_continuation``'s rule, and its answer: a test compares them).
    """

    def __init__(self, tokens: list[int], min_n: int, max_n: int) -> None:
        self.tokens: list[int] = []
        self.min_n, self.max_n = min_n, max_n
        self.latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.extend(tokens)

    def extend(self, new: list[int]) -> None:
        """Append ``new`` tokens and index the n-grams that now end before the last position."""
        if not new:
            return
        toks = self.tokens
        first = max(0, len(toks) - 1)  # the old last position is now indexable
        toks.extend(int(t) for t in new)
        for e in range(first, len(toks) - 1):
            for n, latest in self.latest.items():
                if e + 1 >= n:
                    latest[tuple(toks[e + 1 - n : e + 1])] = e

    def continuation(self, max_tokens: int) -> tuple[list[int], int]:
        """(up to ``max_tokens`` tokens after the latest earlier occurrence of the longest matching n-gram, n);
        ([], 0) when no n in [min_n, max_n] matches."""
        toks = self.tokens
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(toks) <= n:
                continue
            e = self.latest[n].get(tuple(toks[len(toks) - n :]))
            if e is not None:
                return toks[e + 1 : e + 1 + max_tokens], n
        return [], 0


@register("ngram")
class NgramProposer(RowProposer):
    """Prompt lookup: proposes continuations copied from the context itself (per row).

    Each request's tokens are indexed in ``ctx.state`` (:class:`NgramIndex`, which keeps a copy of the tokens it
    indexes); it is extended by what was committed since, and rebuilt when the context it mirrors changed
    (replaced, cut, or rewritten in place: ``base.still_indexed``).
    """

    drafts_by_lookup = True  # drafts nearly free, each with its match length (policy.drafts_by_lookup)

    def __init__(self, config: NgramConfig | None = None) -> None:
        self.config = config or NgramConfig()

    def start(self, ctx: ProposeContext) -> None:
        ctx.state["ngram"] = self._new_index(ctx.token_ids)

    def _new_index(self, tokens) -> NgramIndex:
        return NgramIndex(list(tokens), self.config.min_ngram, self.config.max_ngram)

    def _index(self, ctx: ProposeContext) -> NgramIndex:
        """The context's index, brought up to date."""
        index = ctx.state.get("ngram")
        ids = ctx.token_ids
        if index is None or not still_indexed(index.tokens, ids):
            index = self._new_index(ids)  # a new, cut or rewritten context: rebuild
        elif len(index.tokens) < len(ids):
            index.extend(ids[len(index.tokens):])
        ctx.state["ngram"] = index
        return index

    def propose_row(self, ctx: ProposeContext, max_tokens: int) -> Draft:
        """A chain of up to ``max_tokens`` copied tokens, [1, k] int64 (k may be 0); ``match_length`` is the n
        of the n-gram matched (the longest of ``max_ngram`` .. ``min_ngram`` that occurs earlier)."""
        cont, n = self._index(ctx).continuation(max_tokens)
        if not cont:
            return Draft.empty()
        return Draft.chain(torch.tensor([cont], dtype=torch.int64), match_length=n)
