"""Shared fixtures: a tiny random-weight Llama with a tiny character-level tokenizer, on disk.

The model directory loads through ``specdecode.models.load_model`` like any local
Hugging Face directory, so the generator and the CLI are tested end to end in
seconds without pretrained weights.
"""

from __future__ import annotations

import os
import string
from pathlib import Path

import pytest
import torch

#: Chat template of the tiny tokenizer: "<bos>user: ...\nassistant: ".
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
TINY_SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
TINY_MERGES = (("t", "h"), ("th", "e"), ("e", " "), ("i", "n"), ("a", "n"), ("an", "d"), ("e", "r"), ("o", "n"))
TINY_MAX_CONTEXT = 256


def make_tiny_tokenizer(*, with_bos: bool = True, chat_template: str | None = TINY_CHAT_TEMPLATE):
    """A character-level BPE tokenizer (lowercase letters, digits, punctuation, a few merges).

    Ids 0..3 are <pad>, <bos>, <eos>, <unk>; text is lowercased; decoding concatenates tokens.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    chars = string.ascii_lowercase + string.digits + " .,!?:;'\n-()"
    tokens = [*TINY_SPECIALS, *chars, *("".join(m) for m in TINY_MERGES)]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(TINY_MERGES), unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.decoder = decoders.Fuse()
    specials = dict(eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    if with_bos:
        specials["bos_token"] = "<bos>"
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **specials)
    if chat_template is not None:
        fast.chat_template = chat_template if with_bos else chat_template.replace("{{ bos_token }}", "")
    return fast


def make_byte_level_tokenizer():
    """A byte-level BPE tokenizer (GPT-2 / Qwen / SmolLM2's decoder): the 256 byte symbols, two merges ("Ġt",
    "Ġth") and specials <pad>, <bos>, <|im_end|> (EOS), <unk>; every character beyond ASCII spans several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from specdecode.token_bytes import byte_decoder

    table = byte_decoder()
    alphabet = sorted(table, key=table.get)
    tokens = ["<pad>", "<bos>", "<|im_end|>", "<unk>", *alphabet, "\u0120t", "\u0120th"]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[("\u0120", "t"),
                                                                                    ("\u0120t", "h")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<|im_end|>",
                                   pad_token="<pad>", unk_token="<unk>")
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


def make_tiny_model(vocab_size: int, *, seed: int = 0, max_positions: int = TINY_MAX_CONTEXT):
    """A seeded random 2-layer Llama (float32) with <bos>=1, <eos>=2, <pad>=0."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=max_positions,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    return LlamaForCausalLM(cfg).eval()


def save_tiny_model_dir(path: Path, *, seed: int = 0) -> Path:
    """Write a loadable model directory (weights, config, generation config, tokenizer) to ``path``."""
    tokenizer = make_tiny_tokenizer()
    model = make_tiny_model(len(tokenizer), seed=seed)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama + character tokenizer with a chat template, as a local model directory."""
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "tiny-llama", seed=0)


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir):
    """The tiny model directory loaded with ``load_model`` and cast to float64 (no greedy near-ties)."""
    from specdecode.models import load_model

    loaded = load_model(str(tiny_model_dir), progress=False)
    loaded.model.to(torch.float64)
    return loaded


def _shared_data_available() -> bool:
    from specdecode.data import SharedDataMissing, shared_data_dir

    try:
        shared_data_dir()
    except SharedDataMissing:
        return False
    return True


#: Torch threads for the tests (``SPECDECODE_TEST_THREADS`` overrides). One: the tiny models gain nothing
#: from a second thread, and two OpenMP threads on a busy 2-core machine can make a test 20x slower.
TEST_THREADS = int(os.environ.get("SPECDECODE_TEST_THREADS", "1"))


def pytest_configure(config):
    config.addinivalue_line("markers", "shared_data: reads ../shared/data (Spec-Bench, GSM8K)")
    os.environ.setdefault("OMP_NUM_THREADS", str(TEST_THREADS))  # subprocesses (the CLI tests) too
    torch.set_num_threads(TEST_THREADS)


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects: an integration test is always in the slow lane
def pytest_collection_modifyitems(config, items):
    """Mark every ``integration`` test ``slow`` too (so ``-m "not slow"``, the fast lane, never runs real
    weights); skip tests that read ../shared/data when it is not beside the clone (CI always has it)."""
    for item in items:
        if item.get_closest_marker("integration") is not None and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)
    if _shared_data_available():
        return
    skip = pytest.mark.skip(reason="../shared/data not found (set SPECDECODE_SHARED_DATA to run these)")
    for item in items:
        if "shared_data" in item.keywords:
            item.add_marker(skip)


# The tiny target / draft pair most engine tests share (a module may define its own ``target``).
@pytest.fixture(scope="module")
def target():
    """A seeded random Llama target, V = 64, float64, sharpened (scale 3) so drafts are often kept."""
    from tiny import tiny_llama

    return tiny_llama(vocab_size=64, seed=0, scale=3.0)


@pytest.fixture(scope="module")
def draft():
    """A smaller seeded random Llama draft with the target's vocabulary."""
    from tiny import tiny_llama

    return tiny_llama(vocab_size=64, seed=1, layers=1, hidden=32, scale=3.0)
