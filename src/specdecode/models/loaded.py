"""The loaded model: :class:`LoadedModel`, the dtype it comes in, the cache directory, plain Hugging Face loading."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdecode.models.errors import ModelLoadError
from specdecode.models.progress import _hf_bars

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


@dataclass
class LoadedModel:
    """A causal LM and its tokenizer, ready for inference.

    Attributes:
        model: in eval mode, ``requires_grad`` off, on the CPU, in the dtype asked for.
        tokenizer: the model's own tokenizer (with its chat template when it has one).
        name: the spec the user passed to :func:`load_model`.
        source: what it resolved to: a local directory, a hub id or a GGUF path.
        sha256: hex digest of the GGUF file the weights came from, None otherwise.
    """

    model: transformers.PreTrainedModel
    tokenizer: transformers.PreTrainedTokenizerBase
    name: str
    source: str
    sha256: str | None = None

    @property
    def max_context(self) -> int:
        """Context length in tokens: config.max_position_embeddings, else tokenizer.model_max_length, else 2048."""
        config = self.model.config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        n = getattr(text_config, "max_position_embeddings", None)
        if isinstance(n, int) and n > 0:
            return n
        n = getattr(self.tokenizer, "model_max_length", None)
        if isinstance(n, int) and 0 < n < 10_000_000:  # tokenizers use ~1e30 for "unset"
            return n
        return 2048

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """End-of-sequence token ids: generation_config's (int or list) then the tokenizer's, deduplicated."""
        ids: list[int] = []
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None)
        ids += eos if isinstance(eos, (list, tuple)) else [eos]
        ids.append(getattr(self.tokenizer, "eos_token_id", None))
        return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def default_cache_dir() -> Path:
    """Where converted models live: ``$SPECDECODE_CACHE``, else ``~/.cache/specdecode``."""
    env = os.environ.get("SPECDECODE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specdecode"


def _normalize_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """torch.float32 / bfloat16 / float16, from a dtype or its name; ModelLoadError otherwise."""
    if isinstance(dtype, str):
        dtype = _DTYPES.get(dtype.lower().removeprefix("torch."), dtype)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ModelLoadError(f"unsupported dtype {dtype!r}; use float32, bfloat16 or float16")
    return dtype


def _finish(model: transformers.PreTrainedModel, dtype: torch.dtype) -> transformers.PreTrainedModel:
    """Eval mode, gradients off, CPU, ``dtype``."""
    model = model.to(device="cpu", dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    return model


def _from_pretrained(where, spec: str, **kwargs):
    """``AutoModelForCausalLM.from_pretrained`` that says so when weights were missing from the files (they
    are then random: transformers' own warning is silenced with the rest of its output, so we print it)."""
    model, info = AutoModelForCausalLM.from_pretrained(where, output_loading_info=True, **kwargs)
    missing = list(info.get("missing_keys") or [])
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        print(f"specdecode: warning: {len(missing)} weight(s) of {spec!r} are not in its files and were initialized "
              f"at random ({shown}): its output will be meaningless; check the model files", file=sys.stderr,
              flush=True)
    return model


def _load_local_dir(spec: str, path: Path, dtype: torch.dtype, cache: Path, progress: bool) -> LoadedModel:
    """A Hugging Face model directory (config.json, weights, tokenizer files)."""
    try:
        with _hf_bars(progress):
            model = _from_pretrained(path, spec, dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - any loader failure becomes one clear error
        raise ModelLoadError(f"could not load the model directory {str(path)!r}: {exc}") from exc
    return LoadedModel(_finish(model, dtype), tokenizer, spec, str(path.resolve()))
