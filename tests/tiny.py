"""Tiny random-weight causal LMs for unit tests (seeded, CPU, seconds)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(vocab_size: int = 64, seed: int = 0, layers: int = 2, hidden: int = 64,
               dtype: torch.dtype = torch.float64, max_positions: int = 256, scale: float = 1.0) -> LlamaForCausalLM:
    """A seeded random Llama; float64 by default so greedy ties cannot flip between passes.

    ``scale`` multiplies the LM head: > 1 sharpens the distributions (more agreement), < 1 flattens.
    """
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval().to(dtype)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def assert_cache_is_fresh_prefill(runner) -> None:
    """Rollback contract: ``runner``'s cache equals a fresh prefill of its ``cached_ids`` (same backend)."""
    fresh = type(runner)(runner.model)
    fresh.reset()
    fresh.forward(runner.cached_ids)
    for (k1, v1), (k2, v2) in zip(runner.layer_tensors(), fresh.layer_tensors()):
        assert k1.shape == k2.shape
        torch.testing.assert_close(k1, k2)
        torch.testing.assert_close(v1, v2)


def exact_joint3(model, prompt: list[int]):
    """The target's exact probability of every 3-token continuation of ``prompt``.

    Returns:
        [V**3] float64 numpy array, indexed by ``np.ravel_multi_index(tokens, (V, V, V))``.
    """
    import numpy as np

    from specdecode.cache import CachedModel

    vocab = model.config.vocab_size
    exact = np.zeros(vocab**3)
    runner = CachedModel(model)
    with torch.inference_mode():
        for i in range(vocab**3):
            seq = list(np.unravel_index(i, (vocab,) * 3))
            runner.reset()
            probs = torch.softmax(runner.forward(prompt + seq[:2]).double(), -1)[-3:]
            exact[i] = float(probs[0, seq[0]] * probs[1, seq[1]] * probs[2, seq[2]])
    return exact


def chi2_pvalue(counts, probs) -> float:
    """Chi-square goodness-of-fit p-value of observed ``counts`` against exact ``probs``.

    Outcomes expected fewer than 5 times are pooled into one bin (dropped if it is empty).
    """
    import numpy as np
    from scipy import stats

    counts, probs = np.asarray(counts, dtype=float), np.asarray(probs, dtype=float)
    expected = probs / probs.sum() * counts.sum()
    keep = expected >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)
