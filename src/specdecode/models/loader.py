"""``load_model``: a catalog name, local directory, GGUF file or hub id to a :class:`LoadedModel`.

The dispatch (in :func:`load_model`'s order of precedence), the offline catalog's set-up (fetch, convert,
load the converted copy) and a user's own GGUF file.
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import torch

from specdecode.models.catalog import OfflineModel, resolve_spec
from specdecode.models.convert import _convert, _converted_ok, _load_converted
from specdecode.models.errors import ModelLoadError
from specdecode.models.fetch import _assemble, _locate_parts, _module_dir, _sha256_file
from specdecode.models.hub import _load_hub
from specdecode.models.loaded import LoadedModel, _load_local_dir, _normalize_dtype, default_cache_dir
from specdecode.models.progress import _bar, quiet_hf_output

logger = logging.getLogger(__name__)

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


def _load_gguf_file(spec: str, path: Path, dtype: torch.dtype, cache: Path, progress: bool) -> LoadedModel:
    """A user's GGUF file, converted once into a cache directory keyed by its sha256.

    Raises:
        ModelLoadError: the file does not start with the GGUF magic bytes (checked before hashing it).
    """
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes); give a "
                                 ".gguf file from llama.cpp's converter or a model directory")
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
