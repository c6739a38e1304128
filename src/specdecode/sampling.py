"""Logits -> probabilities, identically for target p and draft q.

Speculative sampling is lossless only if p and q are the distributions *after*
the same temperature / top-k / top-p (Leviathan et al. 2023, section 2.3);
every caller goes through :func:`logits_to_probs`.
"""

from __future__ import annotations

import torch

from specdecode.types import SamplingParams


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn raw logits into the sampling distribution of ``params``.

    Args:
        logits: [..., V] float logits.
        params: temperature (> 0 here), top_k, top_p.

    Returns:
        [..., V] float32 probabilities summing to 1 on the last axis. For a greedy
        request (temperature 0) the result is one-hot on the argmax.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = _top_p_filter(logits, params.top_p)
    return torch.softmax(logits, dim=-1)


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p`` ([..., V])."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(-1) - probs  # mass of strictly more likely tokens
    drop_sorted = mass_before >= top_p  # the most likely token always stays
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Draw one token per row from [..., V] float32 probs; returns [...] int64."""
    flat = probs.reshape(-1, probs.shape[-1])
    out = torch.multinomial(flat, 1, generator=generator)
    return out.reshape(probs.shape[:-1])


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """Greedy argmax or a sample from the processed distribution. logits [..., V] -> [...] int64."""
    if params.greedy:
        return logits.argmax(-1)
    return sample(logits_to_probs(logits, params), generator)
