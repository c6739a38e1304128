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
