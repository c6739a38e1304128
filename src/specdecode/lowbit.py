"""Low-bit linear layers that run a GGUF file's own blocks (``--weights int4``) or blocks quantized
from float weights (``--weights int8``: Q8_0), and the CPU kernels that run them.

A GGUF model *is* its quantized blocks: our converted float32 copy is those blocks dequantized
(``models._write_streamed``). :func:`modules_from_gguf` keeps every linear layer's blocks as the
file stores them (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K: 4.5 to 8.5 bits per weight, the LM head
included), so a step reads the file's bytes and no more.

The products (``csrc/qgemm.c``: our kernels over llama.cpp's GGUF block formats) quantize each
activation row to 8 bits on its own (a scale per block of 32 for the 32-weight formats, per 256
with sums per 16 for the K-quants) and accumulate every (row, output) in one fixed order: integer
dot products inside a block, float32 across blocks. Each weight block is read and unpacked once
per call and dotted with every row, so verifying gamma + 1 tokens costs little more than one
decoding step, and a row's result is bit for bit the same alone or among 1..16 rows: speculative
decoding equals plain decoding of the same low-bit target by construction.

Kernels: one plain-C source compiled per instruction-set variant with gcc (seconds, cached under
``<cache dir>/kernels/``): ``avx2`` (AVX2 + FMA + F16C, every x86-64 CPU of the last ten years),
``avxvnni`` (the avx2 code with AVX-VNNI's dot products, for CPUs with AVX-VNNI and no AVX-512: Intel Core
12th generation and later, Core Ultra, Sierra Forest),
``avx512`` (the same with AVX-512 F/BW/VL), ``avx512vnni`` (VNNI dot products), ``amx`` (VNNI plus
AMX-INT8 tile products for calls of many rows, a prompt's prefill: from 48 rows for the 32-weight formats,
32 for Q4_K, 16 for Q6_K; the same bits). At first use the richest variant this CPU runs and the next
whose few-row code differs are compiled and timed (``lowbit_kernels.candidate_variants``), and the richest is
kept unless the other is clearly faster; ``SPECDECODE_KERNEL_ISA=amx|avx512vnni|avx512|avxvnni|avx2`` forces one (tests,
benchmarks; compiled then), ``SPECDECODE_KERNEL_ISA=reference`` the torch reference. The thread
split and the C++ layer loop live in a torch extension (``csrc/lowbit.cpp``, ``csrc/step.cpp``, built
once per machine with torch's C++ extension tools, about 25-30 s on 2 cores; it says so). Without a compiler the
same products run as a torch reference (slower, row-invariant too). :func:`kernel_status` says which.

This module turns whole models low-bit (from the GGUF file, or from the float copy) and caches them; the layer
is :mod:`specdecode.quant_linear`, the kernels :mod:`specdecode.lowbit_kernels` (both re-exported here).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from specdecode.errors import SpecDecodeError
from specdecode.lowbit_kernels import (  # noqa: F401 - the kernels' names, re-exported here (lowbit.kernel_status, ...)
    GGUF_BLOCKS,
    ISA_ENV,
    Q4K_TILE,
    Q6K_TILES,
    TILED,
    TILED32,
    VARIANTS,
    active_variant,
    build_in_background,
    check_forced_variant,
    cpu_flags,
    fast_bf16,
    kernel_status,
    load_kernel,
    load_variant,
    repack,
    supported_variants,
    unpack,
    variant_table,
)
from specdecode.options import WEIGHT_PRECISIONS
from specdecode.quant_linear import (  # noqa: F401 - the layer's names, re-exported here (lowbit.QuantLinear, ...)
    LARGE_MODEL_BYTES,
    LOWBIT_TYPES,
    PREFILL_ROWS,
    PREFILL_ROWS_LARGE,
    QuantLinear,
    concat,
    prefill_rows,
    quantize_activations,
)

logger = logging.getLogger(__name__)


# Whole models ------------------------------------------------------------------------------------

#: Bump when the cached low-bit file's layout changes (older files are rebuilt).
CACHE_FORMAT = 6 if TILED32 else 5 if Q6K_TILES else 4  # 3: Q4_K scale bytes in the kernel's order (repack); 4: Q4_K
#     tiles of 8 columns; 5: Q6_K tiles too; 6: Q4_0 / Q4_1 / Q5_0 / Q8_0 tiles too (lowbit_tiles32)


def _linear_names(model: torch.nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if type(m) is torch.nn.Linear]


def _set_module(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, module)


def _row_order(processor, name: str, rows: int) -> np.ndarray | None:
    """The permutation transformers' tensor processor applies to a GGUF tensor's rows (Llama's q / k)."""
    index = np.arange(rows, dtype=np.float32)[:, None]
    out = processor.process(weights=index.copy(), name=name, tensor_key_mapping={},
                            parsed_parameters={"tensors": {}}).weights
    order = np.asarray(out).reshape(-1).astype(np.int64)
    if order.shape != (rows,) or np.array_equal(order, np.arange(rows)):
        return None
    return order


def modules_from_gguf(model: torch.nn.Module, gguf: str | Path, progress: bool = False) -> dict[str, QuantLinear]:
    """Low-bit modules for ``model``'s linear layers, holding the blocks of the GGUF file it was converted
    from as the file stores them: {module name: QuantLinear}. A tied LM head takes the embedding's blocks.

    Raises:
        SpecDecodeError: the file is not what the model was converted from (shapes), or a linear
            layer's tensor is stored in a type without a low-bit layout here (F16 / F32: use bf16).
    """
    # lazy: specdecode.models pulls in transformers (start-up time)
    from specdecode.models.convert import _one_gguf_parse, _stream_plan

    with _one_gguf_parse():  # our reader and transformers' config reader: one parse (seconds per parse)
        plan = _stream_plan(Path(gguf))
    if plan is None:
        raise SpecDecodeError(f"{gguf}: this GGUF file's architecture is not read block by block here; "
                              "use --weights bf16 or fp32")
    by_key = {key: t for t, key, _ in plan.tensors}
    params = dict(model.named_parameters(remove_duplicate=False))
    mapping = model.get_expanded_tied_weights_keys() if hasattr(model, "get_expanded_tied_weights_keys") else {}
    out: dict[str, QuantLinear] = {}
    names = _linear_names(model)
    iterator = names
    if progress and getattr(sys.stderr, "isatty", lambda: False)():  # (a log file would get every frame of the bar)
        iterator = tqdm(names, desc=f"reading the blocks of {Path(gguf).name}", unit="layer", leave=False)
    for name in iterator:
        key = f"{name}.weight"
        t = by_key.get(key) or by_key.get(mapping.get(key, ""))
        if t is None:
            raise SpecDecodeError(f"{gguf}: no GGUF tensor for {key}")
        kind = t.tensor_type.name
        if kind not in GGUF_BLOCKS:
            raise SpecDecodeError(f"{gguf}: {t.name} ({key}) is stored as {kind}, which has no low-bit layout here "
                                  f"(read: {', '.join(GGUF_BLOCKS)}); use --weights bf16")
        rows, cols = params[key].shape
        raw = np.asarray(t.data).reshape(rows, -1)  # a read-only view of the file
        order = _row_order(plan.processor, t.name, rows)
        raw = raw[order] if order is not None else np.array(raw)  # a writable copy either way
        out[name] = QuantLinear(torch.from_numpy(np.ascontiguousarray(raw)), kind, cols, params.get(f"{name}.bias"))
    return out


def modules_from_float(model: torch.nn.Module, precision: str) -> dict[str, QuantLinear]:
    """Low-bit modules quantized from ``model``'s float weights ("int4": Q4_1, 4-bit groups of 32 with
    a scale and a minimum; "int8": Q8_0, symmetric int8 groups of 32)."""
    kind = "Q4_1" if precision == "int4" else "Q8_0"
    return {name: QuantLinear.from_float(m.weight, m.bias, kind, precision) for name, m in model.named_modules()
            if type(m) is torch.nn.Linear and m.in_features % 32 == 0}  # other layers stay float


def cache_path(converted_dir: str | Path, precision: str) -> Path:
    """Where a converted model's low-bit weights are kept: next to its float copy."""
    return Path(converted_dir) / f"specdecode-{precision}.safetensors"


def save_modules(path: Path, modules: dict[str, QuantLinear], source: dict) -> None:
    """Write ``modules`` as one safetensors file (atomic rename), with ``source`` in its metadata."""
    tensors, layout = {}, {}
    for name, m in modules.items():
        for part, t in m.state_tensors().items():
            tensors[f"{name}.{part}"] = t.contiguous()
        if m.bias is not None:
            tensors[f"{name}.bias"] = m.bias.contiguous()
        layout[name] = [m.kind, m.in_features, m.weight_precision]
    meta = {"format": str(CACHE_FORMAT), "layout": json.dumps(layout), "source": json.dumps(source)}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)


def load_modules(path: Path, source: dict) -> dict[str, QuantLinear] | None:
    """The modules :func:`save_modules` wrote, memory-mapped; None when missing, stale or unreadable."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        if meta.get("format") != str(CACHE_FORMAT) or json.loads(meta.get("source", "null")) != source:
            return None
        layout = json.loads(meta["layout"])
        tensors = load_file(str(path))
    except Exception:  # noqa: BLE001 - a missing or damaged cache is rebuilt
        return None
    out = {}
    for name, (kind, in_features, precision) in layout.items():
        out[name] = QuantLinear(tensors[f"{name}.packed"], kind, in_features, tensors.get(f"{name}.bias"), precision,
                                packed=True)
    return out


def install(model: torch.nn.Module, modules: dict[str, QuantLinear]) -> torch.nn.Module:
    """Replace ``model``'s linear layers by ``modules`` (in place; activations run in float32)."""
    model.__dict__.pop("_specdecode_fused_layers", None)  # owned-forward weight views of the old precision
    model.float()
    for name, module in modules.items():
        _set_module(model, name, module)
    return model


def _source(loaded, precision: str, from_gguf: bool) -> dict:
    return {"sha256": loaded.sha256, "precision": precision, "from": "gguf" if from_gguf else "float"}


def converted_dir(loaded, cache_dir=None) -> Path | None:
    """The converted copy of a GGUF model ``loaded`` was read from (where its low-bit weights are
    cached), or None (a model directory of the user's or a hub model: nothing is written there)."""
    # lazy: specdecode.models pulls in transformers (start-up time)
    from specdecode.models import default_cache_dir

    source = Path(str(loaded.source))
    if source.is_dir() and (source / "specdecode_converted.json").exists():
        return source
    if loaded.sha256 and source.suffix == ".gguf":  # a user's GGUF file: the cache dir keyed by its digest
        base = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        for d in (base / "converted").glob(f"*-{loaded.sha256[:16]}"):
            return d
    return None


def weight_digest(model: torch.nn.Module) -> str:
    """sha256 (hex) of the weights ``model`` executes: every parameter and buffer (name, dtype, shape, bytes)
    and every low-bit module's blocks (block type and packed bytes), in name order. Two loads with the same
    digest run the same model; the test that every front end loads a spec the same way compares it.
    """
    digest = hashlib.sha256()
    tensors = dict(model.state_dict(keep_vars=False))
    for name, module in model.named_modules():
        fused = getattr(module, "fused", None)
        if hasattr(module, "state_tensors") and not name.endswith(".fused"):
            rows, kind, bias = module.packed, module.kind, module.bias
        elif fused is not None and hasattr(fused, "packed"):  # q/k/v of a fused low-bit product: its rows
            rows, kind = fused.packed[module.start : module.end], fused.kind
            if kind in TILED:  # tiles of 8 columns: the file's rows, as the unfused module holds them
                rows = torch.from_numpy(repack(fused.gguf_raw()[module.start : module.end], kind))
            bias = None if fused.bias is None else fused.bias[module.start : module.end]
        else:
            continue
        tensors[f"{name}.packed"] = rows
        if bias is not None:
            tensors[f"{name}.bias"] = bias
        digest.update(f"{name}:{kind};".encode())
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)};".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def set_weight_precision(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    """Execute ``model``'s weights in ``precision``, in place; returns the model.

    - ``fp32``: unchanged (float32).
    - ``bf16``: parameters cast to bfloat16 (AVX512-BF16 CPUs run few-row products at
      about the one-row cost; half the bytes of float32).
    - ``int8``: every ``nn.Linear`` (the LM head included) whose ``in_features`` is a multiple of
      32 becomes a :class:`specdecode.lowbit.QuantLinear` of Q8_0 blocks (int8, one float16 scale per
      32 weights: 8.5 bits per weight), activations quantized to 8 bits per row by the kernel.
    - ``int4``: the same with Q4_1 blocks (4-bit groups of 32 with a scale and a minimum), quantized
      from the float weights. A model converted from a GGUF file gets its file's own blocks instead
      (``lowbit.quantize_loaded``, what ``load_target`` runs).

    Both low-bit kinds give a row the same result whatever rows share the call, so with the
    project's own forward (``kv.owned.OwnedRunner``: the C++ layer loop, row by row) a low-bit target
    stays lossless: speculative == plain decoding of the same model. Embeddings and norms stay
    float32.

    Raises:
        ValueError: unknown precision.
    """
    if precision not in WEIGHT_PRECISIONS:
        raise ValueError(f"unknown weight precision {precision!r}; choose one of {', '.join(WEIGHT_PRECISIONS)}")
    model.__dict__.pop("_specdecode_fused_layers", None)  # owned-forward weight views of the old precision
    if getattr(model, "config", None) is not None:
        model.config.specdecode_weights = precision  # names the precision in per-model caches (layer_search)
    if precision == "bf16":
        return model.to(torch.bfloat16)
    if precision in ("int8", "int4"):
        install(model, modules_from_float(model, precision))
    return model


def load_in_precision(spec: str, precision: str, *, dtype=torch.float32, cache_dir=None, progress: bool = True,
                      say=None):
    """:func:`specdecode.models.load_model` with the weights in ``precision``.

    int4 / int8 of a catalog model whose low-bit weights are cached: built from the cache without
    reading the float copy's linear weights (:func:`load_cached`); otherwise the float model is
    loaded and :func:`quantize_loaded` (which fills the cache). fp32 / bf16: as
    set_weight_precision.

    Raises:
        ModelLoadError (from load_model), SpecDecodeError (a GGUF tensor without a low-bit layout).
    """
    # lazy: specdecode.models pulls in transformers (start-up time)
    from specdecode.models import _converted_ok, default_cache_dir, load_model, resolve_spec
    from specdecode.models.convert import _one_gguf_parse

    if precision not in WEIGHT_PRECISIONS:
        raise SpecDecodeError(f"unknown weight precision {precision!r}; choose one of {', '.join(WEIGHT_PRECISIONS)}")
    if precision in ("int4", "int8"):
        source = resolve_spec(spec)
        if source.kind == "catalog":
            base = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
            out_dir = base / "converted" / source.entry.name
            if _converted_ok(out_dir, source.entry.sha256):
                fast = load_cached(spec, out_dir, source.entry.sha256, precision, precision == "int4")
                if fast is not None:
                    return fast
        # a first load converts the GGUF file, then reads its blocks: one parse of it for both
        with _one_gguf_parse():
            loaded = load_model(spec, dtype=torch.float32, cache_dir=cache_dir, progress=progress)
            quantize_loaded(loaded, precision, cache_dir=cache_dir, progress=progress, say=say)
        return loaded
    loaded = load_model(spec, dtype=dtype, cache_dir=cache_dir, progress=progress)
    set_weight_precision(loaded.model, precision)
    return loaded


def _gguf_of(loaded, out_dir: Path | None, cache_dir=None) -> Path | None:
    """The GGUF file behind ``loaded`` (joined again from its packages for a catalog model), or None."""
    if not loaded.sha256:
        return None
    # lazy: specdecode.models pulls in transformers (start-up time)
    from specdecode.models import gguf_file

    try:
        marker = json.loads((out_dir / "specdecode_converted.json").read_text()) if out_dir else {}
    except (OSError, ValueError):
        marker = {}
    path = Path(marker.get("gguf", "")) if marker.get("gguf") else None
    if path is not None and path.is_file():
        return path
    try:
        return gguf_file(loaded.name, cache_dir=cache_dir, progress=False)
    except Exception:  # noqa: BLE001 - no file: quantize from float instead, and say so
        return None


def quantize_loaded(loaded, precision: str, *, cache_dir=None, progress: bool = False, say=None) -> torch.nn.Module:
    """Put ``loaded.model`` in ``precision`` ("int4" / "int8") in place, from the GGUF's own blocks when
    the model came from one (int4), else quantized from its float weights; cached next to the
    converted copy and reused (memory-mapped) by later loads. Returns the model."""
    out_dir = converted_dir(loaded, cache_dir)
    gguf = _gguf_of(loaded, out_dir, cache_dir) if precision == "int4" else None
    source = _source(loaded, precision, gguf is not None)
    path = cache_path(out_dir, precision) if out_dir is not None else None
    modules = load_modules(path, source) if path is not None else None
    if modules is None:
        if gguf is not None:
            modules = modules_from_gguf(loaded.model, gguf, progress)
        else:
            if precision == "int4" and say is not None:
                say(f"{loaded.name}: no GGUF file behind it: int4 weights quantized from its float weights "
                    "(groups of 32, min / max), which changes the model")
            modules = modules_from_float(loaded.model, precision)
        if path is not None:
            try:
                save_modules(path, modules, source)
            except OSError as exc:
                logger.warning("could not cache %s weights in %s: %s", precision, path, exc)
    install(loaded.model, modules)
    loaded.model.config.specdecode_weights = precision
    return loaded.model


def load_cached(spec: str, out_dir: Path, sha256: str | None, precision: str, from_gguf: bool):
    """A LoadedModel in ``precision`` built from the cached low-bit file and the float copy's other
    tensors (embeddings, norms) without reading the float copy's linear weights; None when no valid
    cache exists. Seconds instead of a minute for the 1.5B."""
    # lazy: these pull in transformers (start-up time)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.initialization import no_init_weights

    from specdecode.models import LoadedModel, quiet_hf_output

    source = {"sha256": sha256, "precision": precision, "from": "gguf" if from_gguf else "float"}
    modules = load_modules(cache_path(out_dir, precision), source)
    weights = out_dir / "model.safetensors"
    if modules is None or not weights.is_file():
        return None
    with quiet_hf_output():
        config = AutoConfig.from_pretrained(out_dir)
        with no_init_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(out_dir)
    install(model, modules)
    state = dict(model.named_parameters())  # what is left to read: embeddings, norms (no duplicates)
    read = set()
    with safe_open(str(weights), framework="pt") as f:
        for key in f.keys():
            if key in state:
                module_name, _, attr = key.rpartition(".")
                setattr(model.get_submodule(module_name), attr, torch.nn.Parameter(f.get_tensor(key), requires_grad=False))
                read.add(key)
    if set(state) - read:  # a tensor the float copy does not hold: take the ordinary load instead
        logger.info("low-bit fast load of %s: %s not in %s", spec, sorted(set(state) - read)[:3], weights)
        return None
    model.eval()
    model.requires_grad_(False)
    model.config.specdecode_weights = precision
    return LoadedModel(model, tokenizer, spec, str(out_dir), sha256)
