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

from specdecode.proposers.base import ProposeContext, register
from specdecode.types import Draft, SpecDecodeError, VerifyResult


@dataclass(frozen=True)
class NgramConfig:
    """Match lengths (tokens). ``min_ngram`` >= 1, ``max_ngram`` >= ``min_ngram``."""

    min_ngram: int = 1
    max_ngram: int = 3

    def __post_init__(self) -> None:
        if self.min_ngram < 1 or self.max_ngram < self.min_ngram:
            raise SpecDecodeError(
                f"ngram sizes need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}"
            )


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
class NgramProposer:
    """Prompt lookup: proposes continuations copied from the context itself."""

    def __init__(self, config: NgramConfig | None = None) -> None:
        self.config = config or NgramConfig()
        self._tokens = np.zeros(0, dtype=np.int64)

    def start(self, ctx: ProposeContext) -> None:
        self._tokens = np.asarray(ctx.token_ids, dtype=np.int64)

    def propose(self, ctx: ProposeContext, max_tokens: int) -> Draft:
        """Return a chain of up to ``max_tokens`` copied tokens, [1, k] int64 (k may be 0)."""
        if len(self._tokens) != len(ctx.token_ids):  # append what was committed since
            new = np.asarray(ctx.token_ids[len(self._tokens) :], dtype=np.int64)
            self._tokens = np.concatenate([self._tokens[: len(ctx.token_ids) - len(new)], new])
        for n in range(self.config.max_ngram, self.config.min_ngram - 1, -1):
            cont = find_continuation(self._tokens, n, max_tokens)
            if cont.size:
                return Draft.chain(torch.from_numpy(cont.copy()).reshape(1, -1))
        return Draft.empty()

    def observe(self, ctx: ProposeContext, result: VerifyResult) -> None:
        return None
