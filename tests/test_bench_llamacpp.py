"""The llama.cpp peer (``specdecode.bench.llamacpp``) against a stand-in ``llama_cpp`` module: greedy settings,
EOS and the token cap, the context grown for long prompts, prompt lookup's draft, and errors without it."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest

from specdecode.bench import llamacpp


class FakeLlama:
    """Records how it was built and called; generates ``script`` (then repeats its last token)."""

    instances: list["FakeLlama"] = []
    script: list[int] = []

    def __init__(self, model_path, n_ctx, n_threads, n_threads_batch, n_batch, draft_model, verbose):
        self.kwargs = dict(model_path=model_path, n_ctx=n_ctx, n_threads=n_threads, draft_model=draft_model)
        self.resets = 0
        self.calls = []
        FakeLlama.instances.append(self)

    def token_eos(self):
        return 2

    def reset(self):
        self.resets += 1

    def generate(self, tokens, **kw):
        self.calls.append((tokens, kw))
        i = 0
        while True:
            yield self.script[min(i, len(self.script) - 1)]
            i += 1


class FakeLookup:
    def __init__(self, max_ngram_size, num_pred_tokens):
        self.max_ngram_size, self.num_pred_tokens = max_ngram_size, num_pred_tokens


@pytest.fixture()
def fake_llama_cpp(monkeypatch):
    root = types.ModuleType("llama_cpp")
    root.Llama = FakeLlama
    spec = types.ModuleType("llama_cpp.llama_speculative")
    spec.LlamaPromptLookupDecoding = FakeLookup
    monkeypatch.setitem(sys.modules, "llama_cpp", root)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", spec)
    FakeLlama.instances = []
    return FakeLlama


def test_available_reflects_the_installed_package():
    assert llamacpp.available() == (importlib.util.find_spec("llama_cpp") is not None)


def test_plain_generation_is_greedy_and_stops_at_eos_or_the_cap(fake_llama_cpp):
    runner = llamacpp.LlamaCppRunner("m.gguf", n_threads=3)
    llm = fake_llama_cpp.instances[-1]
    assert llm.kwargs == {"model_path": "m.gguf", "n_ctx": 512, "n_threads": 3, "draft_model": None}
    fake_llama_cpp.script = [5, 6, 9, 7]
    out = runner.generate([1, 4, 4], max_new_tokens=10, eos_token_ids=[9])
    assert out.token_ids == [5, 6, 9] and out.finish_reason == "stop" and out.wall_s >= 0
    tokens, kw = llm.calls[-1]
    assert tokens == [1, 4, 4] and (kw["top_k"], kw["temp"], kw["repeat_penalty"]) == (1, 0.0, 1.0)
    assert llm.resets == 1
    fake_llama_cpp.script = [5, 2]  # the model's own EOS stops too
    assert runner.generate([1], 10, ()).token_ids == [5, 2]
    fake_llama_cpp.script = [5, 6, 7, 8]
    capped = runner.generate([1], 3, [9])
    assert capped.token_ids == [5, 6, 7] and capped.finish_reason == "length"


def test_a_long_prompt_grows_the_context_and_prompt_lookup_gets_its_draft(fake_llama_cpp):
    runner = llamacpp.LlamaCppRunner("m.gguf", "prompt-lookup", gamma=6, max_ngram=3, n_threads=1)
    draft = fake_llama_cpp.instances[-1].kwargs["draft_model"]
    assert isinstance(draft, FakeLookup) and (draft.max_ngram_size, draft.num_pred_tokens) == (3, 6)
    fake_llama_cpp.script = [3]
    runner.generate(list(range(600)), max_new_tokens=20, eos_token_ids=())
    assert len(fake_llama_cpp.instances) == 2  # rebuilt once with room for the prompt
    assert runner.n_ctx == 1024 and runner.n_ctx >= 600 + 20 + 6 + 8
    runner.generate(list(range(100)), 20, ())
    assert len(fake_llama_cpp.instances) == 2  # big enough already: not rebuilt


def test_unknown_method_and_missing_package():
    with pytest.raises(ValueError, match="unknown llama.cpp method"):
        llamacpp.LlamaCppRunner("m.gguf", "lookahead")
    if not llamacpp.available():
        with pytest.raises(ImportError):
            llamacpp.LlamaCppRunner("m.gguf")
