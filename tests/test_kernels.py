"""Weight precisions and matmul choices: losslessness holds for the target as loaded."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from specdecode.engine import EngineConfig, SpeculativeEngine
from specdecode.kernels import use_small_row_matmul
from specdecode.lowbit import set_weight_precision
from specdecode.kv import make_runner
from specdecode.proposers import DraftModelProposer, NgramProposer
from specdecode.types import SamplingParams
from tiny import chi2_pvalue, exact_joint, tiny_llama

PROMPTS = [[1], [5, 9, 2], [3, 4, 5, 3, 4, 5, 3, 4], list(range(10, 30))]


def _int8(seed, precision="int8", **kw):
    return set_weight_precision(tiny_llama(seed=seed, dtype=torch.float32, **kw), precision)


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_int8_draft_with_float_target_greedy_equals_plain_decoding(precision):
    target = tiny_llama(seed=0, scale=3.0)
    draft = set_weight_precision(tiny_llama(seed=0, dtype=torch.float32, scale=3.0), precision)  # target, quantized
    params = SamplingParams(max_new_tokens=30)
    plain = SpeculativeEngine(target, None)
    for gamma in (1, 4):
        spec = SpeculativeEngine(target, DraftModelProposer(draft), EngineConfig(num_speculative_tokens=gamma))
        for prompt in PROMPTS:
            out = spec.generate(prompt, params)
            assert out.token_ids == plain.generate(prompt, params).token_ids
            assert out.metrics.acceptance_rate > 0.5  # an int8 copy of the target mostly agrees with it


def _two_token_distribution_pvalue(target, draft, backend: str, vocab: int = 5, samples: int = 1500,
                                   coupled: bool = False) -> float:
    """Chi-square p-value of speculative samples (gamma 1, T=1, 2 tokens, batches of 8) against the
    target's exact two-token distribution computed with the ``backend`` forward (the one the engine runs);
    standard rejection sampling unless ``coupled`` (a seeded request is coupled by default)."""
    prompt = [1, 2]
    exact = exact_joint(target, prompt, 2, backend=backend)
    engine = SpeculativeEngine(target, DraftModelProposer(draft), EngineConfig(num_speculative_tokens=1,
                                                                               max_batch_size=8))
    outs = engine.generate_batch([prompt] * samples, [SamplingParams(temperature=1.0, max_new_tokens=2, seed=s,
                                                                     coupled=coupled)
                                                      for s in range(samples)])
    counts = np.zeros(vocab**2)
    for out in outs:
        counts[np.ravel_multi_index(out.token_ids, (vocab,) * 2)] += 1
    return chi2_pvalue(counts, exact)


@pytest.mark.parametrize("coupled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_int8_draft_sampling_follows_the_float_target_distribution(coupled):
    target = tiny_llama(seed=3, vocab_size=5, layers=1, hidden=32, scale=4.0)
    draft = _int8(4, vocab_size=5, layers=1, hidden=32, scale=4.0)
    assert _two_token_distribution_pvalue(target, draft, "owned", coupled=coupled) > 1e-3


@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize("forward", ["owned", "hf"])
def test_int8_target_speculative_greedy_equals_its_plain_decoding(forward, precision):
    target = _int8(0, precision, scale=3.0)
    draft = tiny_llama(seed=0, scale=3.0)  # the float original drafts for its int8 copy
    params = SamplingParams(max_new_tokens=30)
    plain = SpeculativeEngine(target, None, EngineConfig(forward=forward))
    for gamma in (1, 3, 8):
        spec = SpeculativeEngine(target, DraftModelProposer(draft), EngineConfig(num_speculative_tokens=gamma, forward=forward))
        ngram = SpeculativeEngine(target, NgramProposer(), EngineConfig(num_speculative_tokens=gamma, forward=forward))
        for prompt in PROMPTS:
            want = plain.generate(prompt, params).token_ids
            out = spec.generate(prompt, params)
            assert out.token_ids == want
            assert out.metrics.acceptance_rate > (0.5 if precision == "int8" else 0.2)  # 4-bit of random weights: coarser
            assert ngram.generate(prompt, params).token_ids == want


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_int8_target_sampling_follows_its_own_distribution(precision):
    target = _int8(3, precision, vocab_size=5, layers=1, hidden=32, scale=4.0)
    draft = tiny_llama(seed=4, vocab_size=5, layers=1, hidden=32, scale=4.0)
    assert _two_token_distribution_pvalue(target, draft, "owned") > 1e-3


def test_bf16_target_speculative_greedy_equals_its_plain_decoding():
    """bf16 is lossless up to near-ties (one-row and multi-row bf16 kernels may round differently);
    with the peaked logits of this tiny model no tie is near, so outputs must be equal."""
    target = set_weight_precision(tiny_llama(seed=0, dtype=torch.float32, scale=3.0), "bf16")
    draft = _int8(0, scale=3.0)
    params = SamplingParams(max_new_tokens=30)
    plain = SpeculativeEngine(target, None)
    for gamma in (1, 4):
        spec = SpeculativeEngine(target, DraftModelProposer(draft), EngineConfig(num_speculative_tokens=gamma))
        for prompt in PROMPTS:
            assert spec.generate(prompt, params).token_ids == plain.generate(prompt, params).token_ids


def test_bf16_target_sampling_follows_its_own_distribution():
    target = set_weight_precision(tiny_llama(seed=3, vocab_size=5, layers=1, hidden=32, scale=4.0), "bf16")
    draft = tiny_llama(seed=4, vocab_size=5, layers=1, hidden=32, scale=4.0)
    assert _two_token_distribution_pvalue(target, draft, "owned") > 1e-3


def test_small_row_matmul_keeps_the_hf_forward():
    model = tiny_llama(seed=0, dtype=torch.float64)
    expected = make_runner(model, "hf").row(0).forward([1, 2, 3, 4])
    assert use_small_row_matmul(model) > 0
    assert use_small_row_matmul(model) == 0  # idempotent
    torch.testing.assert_close(make_runner(model, "hf").row(0).forward([1, 2, 3, 4]), expected)


# ----------------------------------------------------------------------------- row-invariant products

ROW_COUNTS = range(1, 41)  # past two ROW_BLOCK blocks: full blocks, a partial last block, one row


def _rows_alone(kernel, weight, x):
    """Each row of ``x`` through ``row_product`` on its own, stacked."""
    from specdecode.kernels import row_product

    return torch.cat([row_product(kernel, weight, x[i : i + 1]) for i in range(x.shape[0])])


def _row_invariance_failures(kernel, weight, x) -> list[int]:
    """The row counts m for which row_product(kernel, weight, x[:m]) differs from the rows computed alone."""
    from specdecode.kernels import row_product

    alone = _rows_alone(kernel, weight, x)
    return [m for m in ROW_COUNTS if not torch.equal(row_product(kernel, weight, x[:m]), alone[:m])]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kernel", ["linear", "transposed", "padded"])
def test_row_product_computes_the_linear_product(kernel, dtype):
    from specdecode.kernels import ROW_BLOCK, ROW_KERNELS, row_product

    assert kernel in ROW_KERNELS and ROW_BLOCK == 16
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(48, 96, generator=gen).to(dtype)
    x = torch.randn(40, 96, generator=gen).to(dtype)
    want = F.linear(x.double(), weight.double())
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-4  # the product's own rounding (bf16: 8 mantissa bits)
    for m in (1, 2, 15, 16, 17, 33, 40):
        got = row_product(kernel, weight, x[:m])
        assert got.shape == (m, 48) and got.dtype == dtype
        torch.testing.assert_close(got.double(), want[:m], atol=tol * want.abs().max().item(), rtol=0)
        torch.testing.assert_close(got, F.linear(x[:m], weight), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_padded_row_product_is_row_invariant_by_construction(dtype):
    """Every call is a [ROW_BLOCK, in] product: row i cannot depend on how many rows share the call, on any CPU.
    (float32 ``F.linear`` is *not* row-invariant on most CPUs, so the float32 case is a real check.)"""
    gen = torch.Generator().manual_seed(2)
    for out_f, in_f in ((64, 64), (192, 64), (40, 136)):
        weight = torch.randn(out_f, in_f, generator=gen).to(dtype)
        x = torch.randn(40, in_f, generator=gen).to(dtype)
        x[3] *= 1000.0  # a loud row must not change its neighbours
        assert _row_invariance_failures("padded", weight, x) == [], (out_f, in_f)


