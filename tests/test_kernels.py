"""Weight precisions and matmul choices: losslessness holds for the target as loaded."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdecode.engine import EngineConfig, SpeculativeEngine
from specdecode.kernels import set_weight_precision, use_small_row_matmul
from specdecode.kv import make_runner
from specdecode.proposers import DraftModelProposer, NgramProposer
from specdecode.types import SamplingParams
from tiny import chi2_pvalue, exact_joint, tiny_llama

PROMPTS = [[1], [5, 9, 2], [3, 4, 5, 3, 4, 5, 3, 4], list(range(10, 30))]


def _int8(seed, **kw):
    return set_weight_precision(tiny_llama(seed=seed, dtype=torch.float32, **kw), "int8")


def test_int8_draft_with_float_target_greedy_equals_plain_decoding():
    target = tiny_llama(seed=0, scale=3.0)
    draft = set_weight_precision(tiny_llama(seed=0, dtype=torch.float32, scale=3.0), "int8")  # target, quantized
    params = SamplingParams(max_new_tokens=30)
    plain = SpeculativeEngine(target, None)
    for gamma in (1, 4):
        spec = SpeculativeEngine(target, DraftModelProposer(draft), EngineConfig(num_speculative_tokens=gamma))
        for prompt in PROMPTS:
            out = spec.generate(prompt, params)
            assert out.token_ids == plain.generate(prompt, params).token_ids
            assert out.metrics.acceptance_rate > 0.5  # an int8 copy of the target mostly agrees with it


def _two_token_distribution_pvalue(target, draft, backend: str, vocab: int = 5, samples: int = 1500) -> float:
    """Chi-square p-value of speculative samples (gamma 1, T=1, 2 tokens, batches of 8) against the
    target's exact two-token distribution computed with the ``backend`` forward (the one the engine runs)."""
    prompt = [1, 2]
    exact = exact_joint(target, prompt, 2, backend=backend)
    engine = SpeculativeEngine(target, DraftModelProposer(draft), EngineConfig(num_speculative_tokens=1,
                                                                               max_batch_size=8))
    outs = engine.generate_batch([prompt] * samples, [SamplingParams(temperature=1.0, max_new_tokens=2, seed=s)
                                                      for s in range(samples)])
    counts = np.zeros(vocab**2)
    for out in outs:
        counts[np.ravel_multi_index(out.token_ids, (vocab,) * 2)] += 1
    return chi2_pvalue(counts, exact)


def test_int8_draft_sampling_follows_the_float_target_distribution():
    target = tiny_llama(seed=3, vocab_size=5, layers=1, hidden=32, scale=4.0)
    draft = _int8(4, vocab_size=5, layers=1, hidden=32, scale=4.0)
    assert _two_token_distribution_pvalue(target, draft, "owned") > 1e-3


def test_rowwise_int8_rows_are_independent_bit_for_bit():
    """Why an int8 *target* is lossless: a row's output is the same whatever rows share the call
    (fbgemm's per-call activation range is pinned to [-1, 1] by per-row scaling and two pin columns)."""
    from specdecode.kernels import RowwiseInt8Linear

    torch.manual_seed(0)
    lin = RowwiseInt8Linear.from_linear(torch.nn.Linear(64, 48))
    x = torch.randn(9, 64)
    x[3] *= 1000.0  # one loud row must not change the others
    together = lin(x)
    for i in range(9):
        assert torch.equal(lin(x[i : i + 1])[0], together[i])
    dense = torch.nn.Linear(64, 48)
    q = RowwiseInt8Linear.from_linear(dense)
    err = (q(x) - dense(x)).norm() / dense(x).norm()
    assert err < 0.03  # per-token activations, per-channel weights


def test_rowwise_int8_fused_modules_equal_their_parts():
    from specdecode.kernels import RowwiseInt8Linear

    parts = [RowwiseInt8Linear.from_linear(torch.nn.Linear(32, n)) for n in (16, 8, 8)]
    fused = RowwiseInt8Linear.concat(parts)
    x = torch.randn(5, 32)
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))


@pytest.mark.parametrize("forward", ["owned", "hf"])
def test_int8_target_speculative_greedy_equals_its_plain_decoding(forward):
    target = _int8(0, scale=3.0)
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
            assert out.metrics.acceptance_rate > 0.5
            assert ngram.generate(prompt, params).token_ids == want


def test_int8_target_sampling_follows_its_own_distribution():
    target = _int8(3, vocab_size=5, layers=1, hidden=32, scale=4.0)
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
