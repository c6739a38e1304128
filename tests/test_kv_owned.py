"""The project's own Llama / Qwen2 forward (``specdecode.kv.owned``): what it supports, its logits and cache
against the Hugging Face forward (float32, int8, bfloat16, trees), and layer-skip forwards."""

from __future__ import annotations

import pytest
import torch

from specdecode.kernels import set_weight_precision
from specdecode.kv import make_runner
from specdecode.kv.owned import supports
from specdecode.types import SpecDecodeError
from tiny import assert_cache_is_fresh_prefill, close, reference, tiny_llama, tiny_mistral, tiny_qwen2

TREE = [-1, -1, 0, 0, 1, 3]  # root -> {0, 1}; 0 -> {2, 3}; 1 -> {4}; 3 -> {5}
MODELS = {"llama": lambda dtype=torch.float64: tiny_llama(vocab_size=64, seed=0, dtype=dtype),
          "qwen2": lambda dtype=torch.float64: tiny_qwen2(seed=3, layers=2, scale=1.0, dtype=dtype)}


def test_supported_models():
    assert supports(tiny_llama()) and supports(tiny_qwen2(seed=3, layers=2))
    assert supports(set_weight_precision(tiny_llama(dtype=torch.float32), "int8"))
    assert not supports(tiny_mistral(None))  # another family
    assert not supports(tiny_qwen2(seed=3, layers=2, sliding=True))  # sliding-window layers
    biased = tiny_llama()
    biased.config.attention_bias = True
    assert not supports(biased)
    scaled = tiny_llama()
    scaled.config.rope_parameters = {"rope_type": "linear", "factor": 2.0}
    assert not supports(scaled)
    assert not supports(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("family", list(MODELS))
def test_owned_forward_matches_hugging_face_in_float32_across_cache_growth(family):
    model = MODELS[family](torch.float32)
    hf, owned = make_runner(model, "hf").row(0), make_runner(model, "owned").row(0)
    prefix = [(7 * i) % 60 + 1 for i in range(70)]  # past the first 64-column allocation
    for chunk in (prefix, [6], [7, 8, 9]):
        torch.testing.assert_close(owned.forward(chunk), hf.forward(chunk), atol=1e-5, rtol=1e-4)
    hf.rollback(71)
    owned.rollback(71)
    torch.testing.assert_close(owned.forward([10, 11]), hf.forward([10, 11]), atol=1e-5, rtol=1e-4)
    for (k1, v1), (k2, v2) in zip(owned.layer_tensors(), hf.layer_tensors()):
        torch.testing.assert_close(k1.float(), k2, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(v1.float(), v2, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", list(MODELS))
def test_owned_forward_runs_an_int8_model_like_the_hf_forward(family):
    model = set_weight_precision(MODELS[family](torch.float32), "int8")  # Qwen2: q/k/v biases inside the int8 modules
    hf, owned = make_runner(model, "hf").row(0), make_runner(model, "owned").row(0)  # owned fuses q/k/v (shared)
    for chunk in ([1, 2, 3, 4], [5], [6, 7]):
        torch.testing.assert_close(owned.forward(chunk), hf.forward(chunk), atol=1e-4, rtol=1e-4)


def test_owned_forward_in_bfloat16_matches_hf():
    model = tiny_llama(seed=0, dtype=torch.bfloat16)
    hf, owned = make_runner(model, "hf").row(0), make_runner(model, "owned").row(0)
    for chunk in ([1, 2, 3, 4], [5], [6, 7]):
        torch.testing.assert_close(owned.forward(chunk), hf.forward(chunk), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("family", list(MODELS))
def test_owned_forward_scores_and_commits_trees_like_the_hf_forward(family):
    model = MODELS[family](torch.float32)
    prefix, tokens = [3, 4, 5, 6], [10, 11, 12, 13, 14, 15]
    hf, owned = make_runner(model, "hf").row(0), make_runner(model, "owned").row(0)
    hf.forward(prefix)
    owned.forward(prefix)
    ref = hf.forward_tree(tokens, TREE)
    got = torch.cat([owned.forward_tree(tokens[:2], TREE[:2]), owned.forward_tree(tokens[2:], TREE[2:])])
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)  # both return float32 logits
    hf.keep_tree_path([0, 3, 5])
    owned.keep_tree_path([0, 3, 5])
    assert owned.cached_ids == hf.cached_ids == prefix + [10, 13, 15]
    assert_cache_is_fresh_prefill(owned, atol=1e-6)
    for (ko, vo), (kh, vh) in zip(owned.layer_tensors(), hf.layer_tensors()):
        torch.testing.assert_close(ko, kh, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(owned.forward([7, 8]), hf.forward([7, 8]), atol=1e-5, rtol=1e-4)


def test_forward_skipping_writes_only_past_the_committed_length():
    model = tiny_llama(seed=0, layers=4)
    runner = make_runner(model, "owned", num_slots=2)
    runner.forward(slice(0, 2), [[1, 2, 3, 4], [5, 6]])
    before = [[(k.clone(), v.clone()) for k, v in runner.layer_tensors(s)] for s in range(2)]
    everything = runner.forward_skipping(slice(0, 2), [[7, 8], [9]], [4, 2], range(4))  # nothing skipped
    close(everything[0, :2], reference(model, [1, 2, 3, 4, 7, 8])[-2:])
    close(everything[1, :1], reference(model, [5, 6, 9])[-1:])
    skipped = runner.forward_skipping(slice(0, 2), [[7], [9]], [4, 2], [0, 3], last_only=True)
    assert skipped.shape == (2, 1, 64) and not torch.allclose(skipped[0, 0], everything[0, 0].float())
    assert runner.ids == [[1, 2, 3, 4], [5, 6]]
    for s in range(2):
        for (k0, v0), (k1, v1) in zip(before[s], runner.layer_tensors(s)):
            assert torch.equal(k0, k1) and torch.equal(v0, v1)
    with pytest.raises(ValueError):
        runner.forward_skipping(slice(0, 1), [[7]], [3], [0])  # inside the committed cache
    hf = make_runner(model, "hf")
    hf.forward(slice(0, 1), [[1, 2]])
    with pytest.raises(SpecDecodeError, match="cannot skip layers"):
        hf.forward_skipping(slice(0, 1), [[3]], [2], [0])

