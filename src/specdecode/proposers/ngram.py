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


@register("ngram")
class NgramProposer(RowProposer):
    """Prompt lookup: proposes continuations copied from the context itself (per row).

    Each request's tokens are mirrored in a numpy array in ``ctx.state``, with a copy of the tokens it mirrors;
    it is extended by what was committed since, and rebuilt when the context it mirrors changed (replaced,
    cut, or rewritten in place: ``base.still_indexed``).
    """

    def __init__(self, config: NgramConfig | None = None) -> None:
        self.config = config or NgramConfig()

    def start(self, ctx: ProposeContext) -> None:
        ctx.state["ngram"] = (list(ctx.token_ids), np.asarray(ctx.token_ids, dtype=np.int64))

    def _tokens(self, ctx: ProposeContext) -> np.ndarray:
        """[L] int64: the context as a numpy array (the mirror, brought up to date)."""
        seen, arr = ctx.state.get("ngram", (None, None))
        ids = ctx.token_ids
        if seen is None or not still_indexed(seen, ids):
            seen, arr = list(ids), np.asarray(ids, dtype=np.int64)  # a new, cut or rewritten context: rebuild
        elif len(seen) < len(ids):
            new = ids[len(seen):]
            seen.extend(new)
            arr = np.concatenate([arr, np.asarray(new, dtype=np.int64)])
        ctx.state["ngram"] = (seen, arr)
        return arr

    def propose_row(self, ctx: ProposeContext, max_tokens: int) -> Draft:
        """A chain of up to ``max_tokens`` copied tokens, [1, k] int64 (k may be 0)."""
        tokens = self._tokens(ctx)
        for n in range(self.config.max_ngram, self.config.min_ngram - 1, -1):
            cont = find_continuation(tokens, n, max_tokens)
            if cont.size:
                return Draft.chain(torch.from_numpy(cont.copy()).reshape(1, -1))
        return Draft.empty()
