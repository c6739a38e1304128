"""The Hugging Face forward over the slot cache (``specdecode.kv.hf``): sliding-window models with the window
in the mask, models that cannot take a tree mask refused clearly, and the cache buffers it writes."""

from __future__ import annotations

import pytest
import torch

from specdecode.engine import EngineConfig, SpeculativeEngine
from specdecode.kv import HFRunner, TreeAttentionUnsupported, make_runner
from specdecode.proposers import NgramProposer
from specdecode.proposers.suffix import SuffixProposer
from tiny import assert_cache_is_fresh_prefill, close, reference, tiny_llama, tiny_mistral, tiny_qwen2


@pytest.mark.parametrize("kind", ["mistral", "qwen2-hybrid"])
def test_sliding_window_attention_runs_with_the_window_in_the_mask(kind):
    """A window shorter than the context: the slot cache keeps every entry and the mask applies the
    window, so chunks, rollback and trees equal the model's own (windowed) forward."""
    model = tiny_mistral(4) if kind == "mistral" else tiny_qwen2(seed=3, layers=2, scale=1.0, sliding=True)
    runner = make_runner(model)
    assert isinstance(runner, HFRunner)
    row = runner.row(0)
    ids = [(5 * i + 1) % 30 for i in range(14)]
    ref = reference(model, ids)
    close(torch.cat([row.forward(ids[:7]), row.forward(ids[7:8]), row.forward(ids[8:])]), ref, atol=1e-6)
    row.rollback(9)
    close(row.forward([3, 4]), reference(model, ids[:9] + [3, 4])[-2:], atol=1e-6)
    row.rollback(10)
    prefix = list(row.cached_ids)
    logits = row.forward_tree([7, 8, 9], [-1, -1, 0])
    for i, path in enumerate([[7], [8], [7, 9]]):
        close(logits[i], reference(model, prefix + path)[-1], atol=1e-6)
    row.keep_tree_path([0, 2])
    assert_cache_is_fresh_prefill(row, atol=1e-8)
    if kind == "mistral":  # the window matters here: a model without one gives other logits
        unwindowed = tiny_mistral(None)
        assert not torch.allclose(reference(unwindowed, ids), ref, atol=1e-3)


def test_sliding_window_model_through_the_engine_equals_its_greedy_decoding():
    model = tiny_mistral(4)
    prompt, ids = [1, 2, 3], [1, 2, 3]
    for _ in range(20):
        ids.append(int(reference(model, ids)[-1].argmax()))
    from specdecode.types import SamplingParams

    out = SpeculativeEngine(model, NgramProposer(), EngineConfig(num_speculative_tokens=3)).generate(
        prompt, SamplingParams(max_new_tokens=20))
    assert out.token_ids == ids[3:]


class _NoPositions(torch.nn.Module):
    """A causal LM whose forward cannot take position ids."""

    def __init__(self, model):
        super().__init__()
        self.inner = model
        self.config = model.config

    def forward(self, input_ids, past_key_values=None, use_cache=True):
        return self.inner(input_ids=input_ids, past_key_values=past_key_values, use_cache=use_cache)

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()


def test_models_that_cannot_take_a_tree_mask_fail_clearly():
    with pytest.raises(TreeAttentionUnsupported, match="position_ids"):
        make_runner(_NoPositions(tiny_llama(vocab_size=64)), "hf")
    flash = tiny_llama(vocab_size=64)
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(TreeAttentionUnsupported, match="flash_attention_2"):
        # refused when the engine is built (the Hugging Face forward; the owned one always takes masks)
        SpeculativeEngine(flash, SuffixProposer(), EngineConfig(forward="hf"))
    make_runner(flash, "owned").check_tree_support()


def test_slot_cache_grows_and_keeps_what_it_holds():
    model = tiny_llama(seed=0)
    runner = make_runner(model, "hf", num_slots=2)
    ids = [(3 * i) % 60 + 1 for i in range(70)]  # past the first allocation: the buffers grow
    runner.forward(slice(0, 2), [ids[:10], ids[:5]])
    small = runner.nbytes
    runner.forward(slice(0, 1), [ids[10:]])
    assert runner.nbytes > small
    for slot, n in ((0, 70), (1, 5)):
        assert runner.ids[slot] == ids[:n]
        assert_cache_is_fresh_prefill(runner, slot)
    close(runner.forward(slice(1, 2), [[9]])[0, 0], reference(model, ids[:5] + [9])[-1])
