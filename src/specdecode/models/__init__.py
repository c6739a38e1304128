"""Load a target or draft model: offline catalog, local directory, GGUF file or hub id.

``load_model(spec)`` accepts, in this order of precedence:

1. a named offline entry of :data:`OFFLINE_MODELS` (``smollm2-135m``,
   ``qwen2.5-coder-0.5b``, ``qwen2.5-coder-1.5b``): real pretrained GGUF weights
   shipped inside registry packages (see ``shared/MODELS.md``);
2. an existing local Hugging Face model directory (``config.json`` present);
3. an existing ``.gguf`` file;
4. otherwise a Hugging Face Hub id (``org/name``), loaded with ``from_pretrained``.

GGUF weights are dequantized by ``transformers`` (slow: 15 s to 95 s), so the
first load writes a converted copy (safetensors + config + tokenizer) under
``<cache_dir>/converted/<key>/``, keyed by the GGUF's sha256; later loads read
that copy in one or two seconds. Every model comes back in eval mode, with
gradients off, on the CPU, in the requested dtype.

The package, by noun (imports run down this list, never up):

- :mod:`~specdecode.models.errors`: ``ModelLoadError``, ``IncompatibleTokenizerError``;
- :mod:`~specdecode.models.catalog`: ``OFFLINE_MODELS``, ``resolve_spec`` and the catalog hints;
- :mod:`~specdecode.models.progress`: spinners, byte bars, Hugging Face's own output off;
- :mod:`~specdecode.models.loaded`: ``LoadedModel``, ``default_cache_dir``, plain Hugging Face loading;
- :mod:`~specdecode.models.hub`: hub access and loading a hub id;
- :mod:`~specdecode.models.fetch`: a catalog model's packages, joined and verified GGUF (``gguf_file``);
- :mod:`~specdecode.models.convert`: the conversion cache (GGUF to a float32 safetensors copy);
- :mod:`~specdecode.models.compat`: tokenizer compatibility (``check_compatible``);
- :mod:`~specdecode.models.loader`: ``load_model``, the dispatch over all of the above.

The names below are re-exported so ``from specdecode.models import X`` works for every name the single
``models.py`` had that a caller uses; a test that monkeypatches one patches it in the module that looks it up.
"""

from __future__ import annotations

from specdecode.models.catalog import (
    OFFLINE_MODELS,
    ModelSource,
    OfflineModel,
    _catalog_hint,
    _chunked,
    _guess,
    _looks_like_path,
    resolve_spec,
)
from specdecode.models.compat import (
    _embedding_problem,
    _first_difference,
    _tokenizer_difference,
    check_compatible,
    incompatible_tokenizer,
    trees_across_vocabularies,
)
from specdecode.models.convert import (
    _MARKER,
    CONVERTED_FORMAT,
    _convert,
    _convert_in_memory,
    _convert_streamed,
    _converted_ok,
    _load_converted,
    _read_marker,
    _stream_plan,
    _write_streamed,
)
from specdecode.models.errors import IncompatibleTokenizerError, ModelLoadError
from specdecode.models.fetch import (
    _assemble,
    _join,
    _locate_parts,
    _module_dir,
    _pip_command,
    _pip_install,
    _run_with_install_bars,
    _sha256_file,
    _verify,
    _wheel_bytes,
    gguf_file,
)
from specdecode.models.hub import (
    HUB_CHECK_TIMEOUT_S,
    _can_connect,
    _hub_address,
    _hub_failure_message,
    _hub_missing_message,
    _in_hf_cache,
    _load_hub,
    hub_access,
    hub_endpoint,
    hub_offline_reason,
    hub_reachable,
)
from specdecode.models.loaded import LoadedModel, _finish, _from_pretrained, _normalize_dtype, default_cache_dir
from specdecode.models.loader import _load_any, load_model
from specdecode.models.progress import ProgressFn, _bar, _status, quiet_hf_output

__all__ = [
    "CONVERTED_FORMAT",
    "HUB_CHECK_TIMEOUT_S",
    "OFFLINE_MODELS",
    "IncompatibleTokenizerError",
    "LoadedModel",
    "ModelLoadError",
    "ModelSource",
    "OfflineModel",
    "ProgressFn",
    "check_compatible",
    "default_cache_dir",
    "gguf_file",
    "hub_access",
    "hub_endpoint",
    "hub_offline_reason",
    "hub_reachable",
    "incompatible_tokenizer",
    "load_model",
    "quiet_hf_output",
    "resolve_spec",
    "trees_across_vocabularies",
]
