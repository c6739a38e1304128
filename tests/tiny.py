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


def fresh_prefill(runner, ids: list[int]):
    """A one-slot runner of the same kind (owned / Hugging Face) and model, prefilled with ``ids``."""
    fresh = type(runner)(runner.model, 1, runner.max_context)
    if ids:
        fresh.forward(slice(0, 1), [list(ids)])
    return fresh


def assert_cache_is_fresh_prefill(runner, slot: int = 0, atol: float = 1e-10) -> None:
    """Rollback contract (DESIGN.md rule 8): slot ``slot`` of ``runner`` (a ``kv.SlotRunner``, or a
    ``RowView`` of one) holds exactly the keys / values a fresh prefill of its ``ids`` gives."""
    if hasattr(runner, "runner"):  # a RowView
        runner, slot = runner.runner, runner.slot
    ids = list(runner.ids[slot])
    assert not runner.has_pending_tree(slot)
    got = runner.layer_tensors(slot) if ids else []
    want = fresh_prefill(runner, ids).layer_tensors(0) if ids else []
    assert len(got) == len(want)
    for (k1, v1), (k2, v2) in zip(got, want):
        assert k1.shape == k2.shape == (1, k2.shape[1], len(ids), k2.shape[3])
        torch.testing.assert_close(k1, k2, atol=atol, rtol=1e-7)
        torch.testing.assert_close(v1, v2, atol=atol, rtol=1e-7)


@torch.inference_mode()
def exact_joint(model, prompt: list[int], n: int = 3, backend: str = "hf"):
    """The target's exact probability of every ``n``-token continuation of ``prompt``.

    Scores all V**(n-1) prefixes in one batched forward of ``backend`` (``kv.make_runner``: the
    forward the engine runs, which matters for int8 / bf16 weights).

    Returns:
        [V**n] float64 numpy array, indexed by ``np.ravel_multi_index(tokens, (V,) * n)``.
    """
    import itertools

    import numpy as np

    from specdecode.kv import make_runner

    vocab = model.config.vocab_size
    heads = list(itertools.product(range(vocab), repeat=n - 1))
    runner = make_runner(model, backend, num_slots=len(heads))
    logits = runner.forward(slice(0, len(heads)), [list(prompt) + list(h) for h in heads])  # [R, L+n-1, V]
    probs = torch.softmax(logits[:, -n:].double(), -1).numpy()  # [R, n, V]
    exact = np.zeros((vocab,) * n)
    for r, head in enumerate(heads):
        p = 1.0
        for j, tok in enumerate(head):
            p *= probs[r, j, tok]
        exact[head] = p * probs[r, n - 1]
    return exact.reshape(-1)


def exact_joint3(model, prompt: list[int]):
    """:func:`exact_joint` of 3 tokens through the Hugging Face forward."""
    return exact_joint(model, prompt, 3)


def step_of(engine, request):
    """Run one engine step; the StepOutput of ``request`` in it (None when it was not in the batch)."""
    for req, out in engine.step():
        if req is request:
            return out
    return None


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
