"""llama.cpp as a peer in ``specdecode bench`` (optional: needs ``llama-cpp-python``).

The same prompts (token ids from our tokenizer, which is the GGUF's own vocabulary) and
max tokens, greedy, batch size 1, run through llama.cpp on the GGUF file our target was
converted from (e.g. Qwen2.5-Coder 1.5B Q4_K_M):

- ``llama.cpp/plain``: plain decoding (``Llama.generate``, top-k 1);
- ``llama.cpp/prompt-lookup``: llama-cpp-python's prompt-lookup drafting
  (``LlamaPromptLookupDecoding``, ``num_pred_tokens`` = gamma), the n-gram method's peer. This is
  the Python binding's lookup (it turns on logits for every position), not llama.cpp's C++
  ``llama-lookup`` example.

Timing is the same as ours: wall time around the whole generation, prefill included.
Outputs are not compared with ours (4-bit GGUF weights against our converted weights give
other near-ties); speedups are over llama.cpp's own plain decoding, and tokens/s sit next to
ours in the report. Install: ``pip install llama-cpp-python`` (builds llama.cpp from source).
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Sequence
from dataclasses import dataclass

ENGINE = "llama.cpp"


def available() -> bool:
    """True when ``llama_cpp`` can be imported."""
    return importlib.util.find_spec("llama_cpp") is not None


@dataclass
class LlamaCppResult:
    """One llama.cpp generation: new token ids, wall seconds around it (prefill included), finish reason."""

    token_ids: list[int]
    wall_s: float
    finish_reason: str


class LlamaCppRunner:
    """One llama.cpp context on a GGUF file.

    Args:
        gguf: path of the .gguf file.
        method: "plain" or "prompt-lookup".
        gamma: draft tokens per step of prompt lookup (``num_pred_tokens``).
        max_ngram: longest n-gram prompt lookup matches.
        n_ctx: initial context length in tokens (grown, untimed, when a prompt needs more).
        n_threads: CPU threads (default: torch's thread count, so both engines use the same cores).

    Raises:
        ImportError: llama-cpp-python is not installed. ValueError: unknown method.
    """

    def __init__(self, gguf: str, method: str = "plain", *, gamma: int = 10, max_ngram: int = 2,
                 n_ctx: int = 512, n_threads: int | None = None) -> None:
        # lazy: torch (start-up time)
        import torch

        if method not in ("plain", "prompt-lookup"):
            raise ValueError(f"unknown llama.cpp method {method!r}; use plain or prompt-lookup")
        self.gguf, self.method, self.gamma, self.max_ngram = str(gguf), method, gamma, max_ngram
        self.threads = n_threads or torch.get_num_threads()
        self.llm = None
        self.n_ctx = 0
        self._load(n_ctx)

    def _load(self, n_ctx: int) -> None:
        """(Re)create the context with room for ``n_ctx`` tokens. A draft makes llama-cpp-python keep
        logits for every position (n_ctx x vocab floats), so the context is sized to the need."""
        # optional: llama-cpp-python, a benchmark peer
        from llama_cpp import Llama

        draft = None
        if self.method == "prompt-lookup":
            # optional: llama-cpp-python, a benchmark peer
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(max_ngram_size=self.max_ngram, num_pred_tokens=self.gamma)
        self.llm = None  # free the old context first
        self.llm = Llama(model_path=self.gguf, n_ctx=n_ctx, n_threads=self.threads, n_threads_batch=self.threads,
                         n_batch=512, draft_model=draft, verbose=False)
        self.n_ctx = n_ctx

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, eos_token_ids: Sequence[int]) -> LlamaCppResult:
        """Greedy decoding of ``max_new_tokens`` at most, stopping at any of ``eos_token_ids``."""
        need = len(prompt_ids) + max_new_tokens + self.gamma + 8
        if need > self.n_ctx:  # a long prompt: grow the context (not timed)
            self._load(-(-need // 512) * 512)
        eos = set(eos_token_ids) | {self.llm.token_eos()}
        out: list[int] = []
        finish = "length"
        start = time.perf_counter()
        self.llm.reset()
        for tok in self.llm.generate(list(prompt_ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                     repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            if tok in eos:
                finish = "stop"
                break
            if len(out) >= max_new_tokens:
                break
        return LlamaCppResult(out, time.perf_counter() - start, finish)
