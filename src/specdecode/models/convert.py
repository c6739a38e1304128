"""The conversion cache: a GGUF dequantized once into a reloadable float32 copy, keyed by its sha256.

GGUF weights are dequantized by ``transformers`` (slow: 15 s to 95 s), so the first load writes a
converted copy (safetensors + config + tokenizer) under ``<cache_dir>/converted/<key>/``; later loads
read that copy in one or two seconds.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import logging
import os
import shutil
import struct
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from specdecode.models.errors import ModelLoadError
from specdecode.models.loaded import LoadedModel, _finish, _from_pretrained
from specdecode.models.progress import ProgressFn, _bar, _hf_bars, _quiet_gguf_tqdm, _status
from specdecode.types import SpecDecodeError

logger = logging.getLogger(__name__)

#: Bumped when the layout of a converted directory changes; older copies are rebuilt.
CONVERTED_FORMAT = 1
_MARKER = "specdecode_converted.json"

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
    except (struct.error, EOFError) as exc:  # the header or tensor list ends early
        raise ModelLoadError(f"{str(gguf)!r} is not a readable GGUF file (truncated or corrupt: {exc}); download it "
                             "again or give another file") from exc
    except ValueError as exc:
        if "cannot reshape array" in str(exc):  # gguf's reader: a tensor's bytes end before its shape does
            raise ModelLoadError(f"{str(gguf)!r} is not a readable GGUF file (truncated or corrupt: a tensor's data "
                                 "ends early); download it again or give another file") from exc
        raise ModelLoadError(f"could not convert GGUF {str(gguf)!r}: {str(exc) or type(exc).__name__}") from exc
    except Exception as exc:  # noqa: BLE001
        detail = (str(exc) or type(exc).__name__) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        raise ModelLoadError(f"could not convert GGUF {str(gguf)!r}: {detail}") from exc
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
        # lazy: gguf and transformers' GGUF reader (start-up time); what they cannot read gives None below
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
    # lazy: gguf (start-up time)
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
    # lazy: gguf (start-up time)
    import gguf as gguf_lib

    with _GGUF_PARSE_LOCK:  # one patch at a time (a thread loading another model waits; nesting shares the outer)
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


_GGUF_PARSE_LOCK = threading.RLock()


def _save_converted(model: transformers.PreTrainedModel, tokenizer, out: Path) -> list[str]:
    """Write weights, config, generation config and tokenizer; return the dropped tied keys."""
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
