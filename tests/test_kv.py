"""Choosing a forward (``specdecode.kv.make_runner``): the backend for each model family, and models whose
cache cannot roll back refused before any generation.

The slot-cache contract both runners share is tested in ``tests/test_kv_base.py``, each forward in
``tests/test_kv_hf.py`` and ``tests/test_kv_owned.py``.
"""

from __future__ import annotations

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from specdecode import kv
from specdecode.engine import SpeculativeEngine
from specdecode.kv import FORWARD_BACKENDS, HFRunner, OwnedRunner, UnsupportedCacheError, make_runner
from specdecode.proposers import NgramProposer
from specdecode.types import SpecDecodeError
from tiny import tiny_llama, tiny_qwen2


def test_make_runner_picks_the_backend():
    llama = tiny_llama(seed=0)
    assert isinstance(make_runner(llama), OwnedRunner)
    assert isinstance(make_runner(llama, "hf"), HFRunner)
    assert isinstance(make_runner(llama, "owned", num_slots=3), OwnedRunner)
    torch.manual_seed(0)
    mistral = MistralForCausalLM(MistralConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=32,
                                               max_position_embeddings=64, sliding_window=None)).eval()
    assert isinstance(make_runner(mistral), HFRunner)  # auto: an unsupported family runs on Hugging Face
    with pytest.raises(SpecDecodeError, match="owned forward supports"):
        make_runner(mistral, "owned")
    with pytest.raises(SpecDecodeError, match="unknown forward backend"):
        make_runner(llama, "fast")
    with pytest.raises(SpecDecodeError, match="num_slots"):
        make_runner(llama, num_slots=0)


def test_recurrent_models_are_refused_before_any_generation():
    from transformers import MambaConfig, MambaForCausalLM

    mamba = MambaForCausalLM(MambaConfig(vocab_size=32, hidden_size=16, state_size=4, num_hidden_layers=1)).eval()
    for backend in ("auto", "hf"):
        with pytest.raises(UnsupportedCacheError, match="cannot be cut back"):
            make_runner(mamba, backend)
    with pytest.raises(UnsupportedCacheError, match="linear_attention"):
        SpeculativeEngine(mamba, NgramProposer())


def test_make_runner_passes_slots_and_context_and_exports_the_api():
    runner = make_runner(tiny_qwen2(seed=3, layers=2), "auto", num_slots=5, max_context=40)
    assert isinstance(runner, OwnedRunner) and runner.num_slots == 5 and runner.max_context == 40
    assert runner.ids == [[]] * 5 and runner.vocab_size == 64
    hybrid = make_runner(tiny_qwen2(seed=3, layers=2, sliding=True))  # sliding-window layers: Hugging Face
    assert isinstance(hybrid, HFRunner)
    assert FORWARD_BACKENDS == ("auto", "hf", "owned")
    for name in kv.__all__:
        assert hasattr(kv, name), name
