"""Tiny random-weight causal LMs for unit tests (seeded, CPU, seconds)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM


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


def tiny_gguf_llama(kinds=("Q4_K", "Q6_K", "Q4_1", "Q5_0", "Q8_0"), vocab_size: int = 61, seed: int = 0):
    """tiny_llama (hidden 256) whose linear layers are random GGUF blocks of ``kinds`` in turn (the default mixes
    K-quants and 32-weight formats inside one fused q / k / v product; the 61-row LM head: 7 tiles of 8 columns
    and 5 after them), and the Hugging Face model of the same (dequantized) weights."""
    import numpy as np

    from specdecode import lowbit, lowbit_kernels

    model = tiny_llama(seed=seed, hidden=256, vocab_size=vocab_size, dtype=torch.float32)
    reference = tiny_llama(seed=seed, hidden=256, vocab_size=vocab_size, dtype=torch.float32)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    modules = {}
    for i, (name, m) in enumerate(linears):
        kind = kinds[i % len(kinds)]
        raw = lowbit_kernels._random_raw(kind, m.out_features, m.in_features, np.random.default_rng(100 + i))
        modules[name] = lowbit.QuantLinear(torch.from_numpy(raw), kind, m.in_features)
    with torch.no_grad():
        for name, q in modules.items():
            reference.get_submodule(name).weight.copy_(q.dequantize())
    lowbit.install(model, modules)
    return model, reference


def tiny_qwen2(vocab_size: int = 64, seed: int = 0, layers: int = 4, scale: float = 3.0,
               dtype: torch.dtype = torch.float64, sliding: bool = False) -> Qwen2ForCausalLM:
    """A seeded random Qwen2 (q/k/v biases), LM head x ``scale``; ``sliding`` gives every layer after the first
    a sliding window of 8 tokens (a hybrid of full and sliding-window layers)."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=256,
                      tie_word_embeddings=False, use_sliding_window=sliding, sliding_window=8, max_window_layers=1)
    model = Qwen2ForCausalLM(cfg).eval().to(dtype)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


def tiny_mistral(window: int | None = 4) -> MistralForCausalLM:
    """A seeded random 2-layer Mistral (vocabulary 32) in float64 with a sliding window of ``window`` tokens."""
    torch.manual_seed(0)
    cfg = MistralConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=32, max_position_embeddings=256, sliding_window=window)
    model = MistralForCausalLM(cfg).eval().to(torch.float64)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model


@torch.inference_mode()
def reference(model, ids: list[int]) -> torch.Tensor:
    """[n, V] logits of the model's own Hugging Face forward over ``ids`` (no cache)."""
    return model(input_ids=torch.tensor([ids])).logits[0]


def close(got, want, atol=1e-6):
    """Runners return float32 logits: compare with a float64 reference at float32 resolution."""
    torch.testing.assert_close(got.double(), want.double(), atol=atol, rtol=1e-6)


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


def engine_of(target, proposer, gamma: int = 4):
    """A batch-size-1 SpeculativeEngine over ``target`` with a fixed gamma."""
    from specdecode.engine import EngineConfig, SpeculativeEngine

    return SpeculativeEngine(target, proposer, EngineConfig(num_speculative_tokens=gamma))


def check_index_rebuild(proposer, ctx) -> None:
    """A lookup proposer's index describes the context it is given: replaced or cut contexts are re-indexed.

    ``ctx`` starts as [10, 11, 12, 13, 10, 11]; the proposer must copy [12, 13] after it.
    """
    proposer.start(ctx)
    assert proposer.propose([ctx], [2])[0].token_ids[0].tolist() == [12, 13]
    ctx.token_ids = [20, 21, 22, 20]  # replaced by a shorter list: the old tokens must not be matched
    assert proposer.propose([ctx], [2])[0].token_ids[0].tolist() == [21, 22]
    del ctx.token_ids[2:]  # cut in place, then extended
    ctx.token_ids.append(20)
    assert proposer.propose([ctx], [2])[0].token_ids[0].tolist() == [21, 20]  # not 21, 22 of the cut tokens
    ctx.token_ids.append(50)  # extended as the engine does
    assert proposer.propose([ctx], [2])[0].num_tokens == 0


def load_float64(path):
    """A local model directory loaded with ``load_model`` and cast to float64 (no greedy near-ties)."""
    from specdecode.models import load_model

    loaded = load_model(str(path), progress=False)
    loaded.model.to(torch.float64)
    return loaded
