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
``avx512`` (the same with AVX-512 F/BW/VL), ``avx512vnni`` (VNNI dot products). The fastest variant
this CPU runs is chosen by measuring at first use; ``SPECDECODE_KERNEL_ISA=avx2|avx512|avx512vnni``
forces one (tests, benchmarks), ``SPECDECODE_KERNEL_ISA=reference`` the torch reference. The thread
split and the C++ layer loop live in a torch extension (``csrc/lowbit.cpp``, ``csrc/step.cpp``, built
once per machine with torch's C++ extension tools, about a minute; it says so). Without a compiler the
same products run as a torch reference (slower, row-invariant too). :func:`kernel_status` says which.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specdecode.errors import SpecDecodeError
from specdecode.kernels import row_product
from specdecode.options import WEIGHT_PRECISIONS

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = [_CSRC / name for name in ("lowbit.cpp", "step.cpp")]
_QGEMM = _CSRC / "qgemm.c"
_HEADER = _CSRC / "qtable.h"  # the table layout both sides share
_lock = threading.Lock()
_kernel = None  # the compiled torch extension, False once its build failed
_kernel_note = "not loaded yet"

#: Rows above which a prompt's prefill (which need not be row-invariant: plain and speculative decoding
#: prefill alike) dequantizes the weight and runs one many-row float product instead of the kernel.
PREFILL_ROWS = 32

#: The same for models whose low-bit weights exceed :data:`LARGE_MODEL_BYTES`: dequantizing them costs
#: seconds (measured, 2 cores: the Qwen 1.5B prefilled 150 tokens in 1.7 s with the kernel against 3.9 s
#: with the float product, 400 tokens in 5.2 s against 6.4 s; SmolLM2's 92 MB dequantize in milliseconds).
PREFILL_ROWS_LARGE = 512
LARGE_MODEL_BYTES = 256 * 2**20


def prefill_rows(model: torch.nn.Module) -> int:
    """Prompt tokens above which ``model``'s prefill takes the dequantized float product."""
    total = sum(m.weight_nbytes() for m in model.modules() if isinstance(m, QuantLinear))
    return PREFILL_ROWS_LARGE if total > LARGE_MODEL_BYTES else PREFILL_ROWS

#: GGUF block types run as stored: name -> (format id in csrc/qgemm.c, weights per block, bytes per block).
GGUF_BLOCKS = {"Q4_0": (0, 32, 18), "Q4_1": (1, 32, 20), "Q5_0": (2, 32, 22), "Q8_0": (3, 32, 34),
               "Q4_K": (4, 256, 144), "Q6_K": (5, 256, 210)}

#: Fields of a 32-weight block (byte ranges), which the kernel reads as one array per field per row
#: (:func:`repack`: same bytes, eight blocks' scales in one load). Q6_K keeps its blocks. Q4_K is repacked
#: as tiles of 8 output columns (:func:`_q4k_tile`: same bytes; one vpdpbusd multiplies 4 weights of 8
#: columns); the last rows % 8 keep their blocks with the 12 bytes of 6-bit scales and minimums re-ordered
#: (:func:`_q4k_to_kernel`: same bytes, decoded in a few vector instructions).
_FIELDS = {"Q4_0": ((0, 2), (2, 18)), "Q4_1": ((0, 2), (2, 4), (4, 20)), "Q5_0": ((0, 2), (2, 6), (6, 22)),
           "Q8_0": ((0, 2), (2, 34))}


def _q4k_values(q: np.ndarray) -> np.ndarray:
    """Q4_K's scale bytes as GGUF stores them [..., 12] uint8 -> [..., 16] uint8: the 8 sub-block scales, then
    the 8 minimums (6 bits each)."""
    v = np.empty(q.shape[:-1] + (16,), np.uint8)
    v[..., 0:4] = q[..., 0:4] & 63
    v[..., 8:12] = q[..., 4:8] & 63
    v[..., 4:8] = (q[..., 8:12] & 0xF) | ((q[..., 0:4] >> 6) << 4)
    v[..., 12:16] = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    return v


def _q4k_to_kernel(q: np.ndarray) -> np.ndarray:
    """GGUF's 12 Q4_K scale bytes [..., 12] -> the kernel's 12 (csrc/qgemm.c ``q4k_scale_bytes``): byte i < 8 =
    low nibbles of value i and 8 + i; byte 8 + b = the high two bits of values 4t + b at bits 2t."""
    v = _q4k_values(q)
    out = np.empty_like(q)
    out[..., 0:8] = (v[..., 0:8] & 0xF) | ((v[..., 8:16] & 0xF) << 4)
    high = v >> 4
    out[..., 8:12] = 0
    for t in range(4):
        out[..., 8:12] |= high[..., 4 * t : 4 * t + 4] << (2 * t)
    return out


def _q4k_from_kernel(k: np.ndarray) -> np.ndarray:
    """The inverse of :func:`_q4k_to_kernel`."""
    v = np.empty(k.shape[:-1] + (16,), np.uint8)
    v[..., 0:8] = k[..., 0:8] & 0xF
    v[..., 8:16] = k[..., 0:8] >> 4
    for t in range(4):
        v[..., 4 * t : 4 * t + 4] |= ((k[..., 8:12] >> (2 * t)) & 3) << 4
    return _q4k_from_values(v)


def _q4k_from_values(v: np.ndarray) -> np.ndarray:
    """The inverse of :func:`_q4k_values`: [..., 16] (8 scales, 8 minimums) -> GGUF's 12 bytes."""
    q = np.empty(v.shape[:-1] + (12,), np.uint8)
    q[..., 0:4] = (v[..., 0:4] & 63) | ((v[..., 4:8] >> 4) << 6)
    q[..., 4:8] = (v[..., 8:12] & 63) | ((v[..., 12:16] >> 4) << 6)
    q[..., 8:12] = (v[..., 4:8] & 0xF) | ((v[..., 12:16] & 0xF) << 4)
    return q


def _q4k_scales_mapped(raw: np.ndarray, fn) -> np.ndarray:
    if raw.shape[0] == 0:
        return np.array(raw, dtype=np.uint8, copy=True)
    blocks = np.array(raw, dtype=np.uint8, copy=True).reshape(raw.shape[0], -1, GGUF_BLOCKS["Q4_K"][2])
    blocks[..., 4:16] = fn(blocks[..., 4:16])
    return blocks.reshape(raw.shape[0], -1)


#: Q4_K columns repacked together (csrc/qgemm.c ``passt``): the first ``rows // 8 * 8`` weight rows (output
#: columns) as tiles of 8, the last ``rows % 8`` in the column layout (:func:`_q4k_to_kernel` scale bytes).
Q4K_TILE = 8


def _q4k_tile(raw: np.ndarray) -> np.ndarray:
    """GGUF Q4_K rows [8 T, nb * 144] -> tiles of 8 columns (csrc/qgemm.c, the comment above ``passt``): per
    tile and super-block 1152 bytes = d[8] f16 | dmin[8] f16 | 64 bytes of low scale / minimum nibbles |
    32 bytes of their high two bits | 8 sub-blocks of 128 bytes of weight nibbles, 4 k-values x 8 columns
    per 32-bit group."""
    n, nb = raw.shape[0], raw.shape[1] // 144
    t = n // Q4K_TILE
    b = raw.reshape(t, Q4K_TILE, nb, 144).transpose(0, 2, 1, 3)  # [tile, super-block, column, byte]
    out = np.empty((t, nb, 1152), np.uint8)
    out[..., 0:16] = b[..., 0:2].reshape(t, nb, 16)
    out[..., 16:32] = b[..., 2:4].reshape(t, nb, 16)
    v = _q4k_values(b[..., 4:16])  # [t, nb, column, 16]
    sc = v[..., 0:8].transpose(0, 1, 3, 2).reshape(t, nb, 64)  # S[8 j + c]
    mn = v[..., 8:16].reshape(t, nb, 8, 4, 2).transpose(0, 1, 3, 2, 4).reshape(t, nb, 64)  # M[16 p + 2 c + e]
    out[..., 32:96] = (sc & 15) | ((mn & 15) << 4)
    hs, hm = sc >> 4, mn >> 4
    out[..., 96:128] = hm[..., :32] | (hm[..., 32:] << 2) | (hs[..., :32] << 4) | (hs[..., 32:] << 6)
    qs = b[..., 16:144].reshape(t, nb, 8, 4, 32)  # [.., column, chunk of 64, byte]: low nibbles then high
    w = np.stack([qs & 15, qs >> 4], axis=-2).reshape(t, nb, 8, 8, 8, 4)  # [.., column, sub-block, group, e]
    w = w.transpose(0, 1, 3, 4, 2, 5)  # [.., sub-block, group of 4 k, column, e]
    out[..., 128:] = (w[:, :, :, 0:4] | (w[:, :, :, 4:8] << 4)).reshape(t, nb, 1024)
    return out.reshape(n, nb * 144)


def _q4k_untile(packed: np.ndarray) -> np.ndarray:
    """The inverse of :func:`_q4k_tile`."""
    n, nb = packed.shape[0], packed.shape[1] // 144
    t = n // Q4K_TILE
    p = packed.reshape(t, nb, 1152)
    b = np.empty((t, nb, Q4K_TILE, 144), np.uint8)
    b[..., 0:2] = p[..., 0:16].reshape(t, nb, 8, 2)
    b[..., 2:4] = p[..., 16:32].reshape(t, nb, 8, 2)
    nib, h = p[..., 32:96], p[..., 96:128]
    sc = (nib & 15) | (np.concatenate([(h >> 4) & 3, h >> 6], axis=-1) << 4)
    mn = (nib >> 4) | (np.concatenate([h & 3, (h >> 2) & 3], axis=-1) << 4)
    v = np.empty((t, nb, 8, 16), np.uint8)
    v[..., 0:8] = sc.reshape(t, nb, 8, 8).transpose(0, 1, 3, 2)
    v[..., 8:16] = mn.reshape(t, nb, 4, 8, 2).transpose(0, 1, 3, 2, 4).reshape(t, nb, 8, 8)
    b[..., 4:16] = _q4k_from_values(v)
    q = p[..., 128:].reshape(t, nb, 8, 4, 8, 4)  # [.., sub-block, vector, column, e]
    w = np.concatenate([q & 15, q >> 4], axis=3)  # [.., sub-block, group, column, e]
    w = w.transpose(0, 1, 4, 2, 3, 5).reshape(t, nb, 8, 4, 2, 32)  # [.., column, chunk, nibble, byte]
    b[..., 16:144] = (w[..., 0, :] | (w[..., 1, :] << 4)).reshape(t, nb, 8, 128)
    return np.ascontiguousarray(b.transpose(0, 2, 1, 3)).reshape(n, nb * 144)


def _q6k_values(b: np.ndarray) -> np.ndarray:
    """Q6_K blocks [..., 210] -> the 256 unsigned 6-bit values u [..., 256] (w = d * scale * (u - 32))."""
    ql = b[..., 0:128].reshape(b.shape[:-1] + (2, 2, 32))
    lo = np.concatenate([ql & 15, ql >> 4], axis=-2)  # [.., half of 128, 32-group, l]
    qh = b[..., 128:192].reshape(b.shape[:-1] + (2, 1, 32))
    hi = (qh >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
    return (lo | (hi << 4)).reshape(b.shape[:-1] + (256,))


def _q6k_from_values(u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of :func:`_q6k_values`: u [..., 256] -> (ql [..., 128], qh [..., 64])."""
    v = u.reshape(u.shape[:-1] + (2, 4, 32))
    lo, hi = v & 15, v >> 4
    ql = (lo[..., 0:2, :] | (lo[..., 2:4, :] << 4)).reshape(u.shape[:-1] + (128,))
    qh = (hi[..., 0, :] | (hi[..., 1, :] << 2) | (hi[..., 2, :] << 4) | (hi[..., 3, :] << 6)).reshape(u.shape[:-1] + (64,))
    return ql, qh


def _q6k_tile(raw: np.ndarray) -> np.ndarray:
    """GGUF Q6_K rows [8 T, nb * 210] -> tiles of 8 columns (csrc/qgemm.c, the comment above ``passt6``): per
    tile and super-block 1680 bytes = d[8] f16 | 128 int8 scales (per 16 weights, 8 columns each) | per
    sub-block of 32: 128 bytes of low nibbles as Q4_K's tiles, 64 bytes of high two bits."""
    n, nb = raw.shape[0], raw.shape[1] // 210
    t = n // Q4K_TILE
    b = raw.reshape(t, Q4K_TILE, nb, 210).transpose(0, 2, 1, 3)  # [tile, super-block, column, byte]
    out = np.empty((t, nb, 1680), np.uint8)
    out[..., 0:16] = b[..., 208:210].reshape(t, nb, 16)
    out[..., 16:144] = b[..., 192:208].transpose(0, 1, 3, 2).reshape(t, nb, 128)
    w = _q6k_values(b).reshape(t, nb, 8, 8, 8, 4).transpose(0, 1, 3, 4, 2, 5)  # [.., sub-block, group, column, e]
    lo, hi = w & 15, w >> 4
    sub = out[..., 144:].reshape(t, nb, 8, 192)  # per sub-block: 128 bytes of low nibbles, 64 of high bits
    sub[..., 0:128] = (lo[:, :, :, 0:4] | (lo[:, :, :, 4:8] << 4)).reshape(t, nb, 8, 128)
    h = hi.reshape(t, nb, 8, 2, 4, 32)  # [.., sub-block, vector, group in vector, 4 c + e]
    sub[..., 128:192] = (h[..., 0, :] | (h[..., 1, :] << 2) | (h[..., 2, :] << 4) | (h[..., 3, :] << 6)).reshape(t, nb, 8, 64)
    return out.reshape(n, nb * 210)


def _q6k_untile(packed: np.ndarray) -> np.ndarray:
    """The inverse of :func:`_q6k_tile`."""
    n, nb = packed.shape[0], packed.shape[1] // 210
    t = n // Q4K_TILE
    p = packed.reshape(t, nb, 1680)
    b = np.empty((t, nb, Q4K_TILE, 210), np.uint8)
    b[..., 208:210] = p[..., 0:16].reshape(t, nb, 8, 2)
    b[..., 192:208] = p[..., 16:144].reshape(t, nb, 16, 8).transpose(0, 1, 3, 2)
    sub = p[..., 144:].reshape(t, nb, 8, 192)
    q = sub[..., 0:128].reshape(t, nb, 8, 4, 32)
    lo = np.concatenate([q & 15, q >> 4], axis=3)  # [.., sub-block, group, 4 c + e]
    h = sub[..., 128:192].reshape(t, nb, 8, 2, 1, 32)
    hi = ((h >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3).reshape(t, nb, 8, 8, 32)
    u = (lo | (hi << 4)).reshape(t, nb, 8, 8, 8, 4).transpose(0, 1, 4, 2, 3, 5).reshape(t, nb, 8, 256)
    b[..., 0:128], b[..., 128:192] = _q6k_from_values(u)
    return np.ascontiguousarray(b.transpose(0, 2, 1, 3)).reshape(n, nb * 210)


#: Q6_K tiles (csrc/qgemm.c SD_Q6K_TILES, the same switch)
Q6K_TILES = True
#: K-quants repacked as tiles of 8 output columns (the last rows % 8 keep the column layout)
TILED = {"Q4_K": (_q4k_tile, _q4k_untile), **({"Q6_K": (_q6k_tile, _q6k_untile)} if Q6K_TILES else {})}


def repack(raw: np.ndarray, kind: str) -> np.ndarray:
    """GGUF rows [rows, bytes] uint8 -> the kernel's layout [rows, bytes] uint8 (the same bytes, each block field
    as one array per row: ``d[nb] | m[nb] | qs[nb][16]`` for Q4_1; Q4_K: tiles of 8 columns, :func:`_q4k_tile`,
    the last rows % 8 with their scale bytes re-ordered, :func:`_q4k_to_kernel`). Q6_K is returned as it is.
    A Q4_K layout is whole: slice or concatenate GGUF rows (:func:`unpack`), not packed ones."""
    if kind in TILED:
        full = raw.shape[0] // Q4K_TILE * Q4K_TILE
        tail = _q4k_scales_mapped(raw[full:], _q4k_to_kernel) if kind == "Q4_K" else np.array(raw[full:], np.uint8)
        return np.ascontiguousarray(np.concatenate([TILED[kind][0](np.asarray(raw[:full], np.uint8)), tail]))
    if kind not in _FIELDS:
        return np.ascontiguousarray(raw)
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, GGUF_BLOCKS[kind][2])
    return np.ascontiguousarray(np.concatenate([blocks[..., a:b].reshape(rows, -1) for a, b in _FIELDS[kind]], axis=1))


def unpack(packed: np.ndarray, kind: str) -> np.ndarray:
    """The inverse of :func:`repack`: the kernel's layout [rows, bytes] uint8 -> GGUF rows [rows, bytes] uint8."""
    if kind in TILED:
        full = packed.shape[0] // Q4K_TILE * Q4K_TILE
        tail = (_q4k_scales_mapped(packed[full:], _q4k_from_kernel) if kind == "Q4_K"
                else np.array(packed[full:], np.uint8))
        return np.ascontiguousarray(np.concatenate([TILED[kind][1](np.asarray(packed[:full], np.uint8)), tail]))
    if kind not in _FIELDS:
        return np.ascontiguousarray(packed)
    rows, nbytes = packed.shape[0], GGUF_BLOCKS[kind][2]
    nb = packed.shape[1] // nbytes
    out = np.empty((rows, nb, nbytes), np.uint8)
    at = 0
    for a, b in _FIELDS[kind]:
        out[..., a:b] = packed[:, at : at + nb * (b - a)].reshape(rows, nb, b - a)
        at += nb * (b - a)
    return out.reshape(rows, -1)


#: Instruction-set variants of the kernel, fastest first where the CPU runs several: name ->
#: (the /proc/cpuinfo flags it needs, gcc flags, the macro csrc/qgemm.c reads).
VARIANTS = {
    "avx512vnni": (("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
                   ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"],
                   "SD_VARIANT_AVX512VNNI"),
    "avx512": (("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"),
               ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl"], "SD_VARIANT_AVX512"),
    "avx2": (("avx2", "fma", "f16c"), ["-mavx2", "-mfma", "-mf16c"], "SD_VARIANT_AVX2"),
}
#: The environment variable that forces a variant (or ``reference``).
ISA_ENV = "SPECDECODE_KERNEL_ISA"


def cpu_flags() -> set[str]:
    """This CPU's feature flags (``/proc/cpuinfo``); empty where they cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def supported_variants() -> list[str]:
    """The kernel variants this CPU executes, in :data:`VARIANTS` order."""
    flags = cpu_flags()
    return [name for name, (need, _, _) in VARIANTS.items() if all(f in flags for f in need)]


def _cache_base(cache_dir=None) -> Path:
    from specdecode.models import default_cache_dir

    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


_variants: dict[str, tuple[ctypes.CDLL, int]] = {}
_variant_lock = threading.Lock()


def load_variant(name: str, cache_dir=None) -> int:
    """The address of variant ``name``'s kernel table (compiled with gcc on first use, cached; one
    compilation at a time in this process, each into its own temporary file, then an atomic rename).

    Raises:
        SpecDecodeError: unknown variant, a CPU without its instructions, or no compiler.
    """
    if name not in VARIANTS:
        raise SpecDecodeError(f"unknown kernel variant {name!r}; choose one of {', '.join(VARIANTS)} or reference")
    with _variant_lock:
        if name not in _variants:
            _variants[name] = _compile_variant(name, cache_dir)
    return _variants[name][1]


def _compile_variant(name: str, cache_dir=None) -> tuple[ctypes.CDLL, int]:
    import tempfile

    if name not in supported_variants():
        raise SpecDecodeError(f"this CPU cannot run the {name} kernel (it runs: {', '.join(supported_variants()) or 'none'})")
    _, flags, macro = VARIANTS[name]
    digest = hashlib.sha256(_QGEMM.read_bytes() + _HEADER.read_bytes() + " ".join(flags).encode()).hexdigest()[:12]
    out = _cache_base(cache_dir) / "kernels" / f"qgemm-{name}-{digest}.so"
    if not out.is_file():
        print(f"specdecode: compiling the {name} low-bit kernel into {out.parent} (once per machine and version, "
              "seconds)", file=sys.stderr, flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
        os.close(fd)
        cmd = [os.environ.get("CC", "gcc"), "-O3", "-std=gnu11", "-shared", "-fPIC", *flags, f"-D{macro}",
               f"-I{_CSRC}", str(_QGEMM), "-o", tmp, "-lm"]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True)
            os.replace(tmp, out)
        except (OSError, subprocess.CalledProcessError) as exc:
            Path(tmp).unlink(missing_ok=True)
            detail = (getattr(exc, "stderr", "") or str(exc)).strip()
            first = next((line for line in detail.splitlines() if "error" in line), detail.splitlines()[0] if detail else "")
            raise SpecDecodeError(f"could not compile the {name} kernel: {first[:200]}") from exc
    lib = ctypes.CDLL(str(out))
    lib.sd_table.restype = ctypes.c_void_p
    return lib, int(lib.sd_table())


def _time_variant(kernel, address: int) -> float:
    """Seconds of a Q4_K product of 1 and 5 rows (the decoding and verification shapes), best of 5."""
    rng = np.random.default_rng(0)
    n, k = 1024, 2048
    raw = torch.from_numpy(_random_raw("Q4_K", n, k, rng))
    total = 0.0
    for rows in (1, 5):
        x = torch.from_numpy(rng.standard_normal((rows, k), dtype=np.float32))
        times = []
        for _ in range(5):
            start = time.perf_counter()
            kernel.q_linear(x, raw, GGUF_BLOCKS["Q4_K"][0], address)  # timing only: the layout does not matter
            times.append(time.perf_counter() - start)
        total += min(times)
    return total


def _random_raw(kind: str, rows: int, cols: int, rng) -> np.ndarray:
    """Random bytes shaped as ``kind`` blocks with sane float16 scales (random bytes are valid blocks)."""
    _, size, nbytes = GGUF_BLOCKS[kind]
    raw = rng.integers(0, 256, size=(rows, cols // size, nbytes), dtype=np.uint8)
    scale = lambda n: rng.uniform(1e-3, 2e-2, size=(rows, cols // size, n)).astype(np.float16).view(np.uint8)  # noqa: E731
    if kind == "Q6_K":
        raw[..., 208:210] = scale(1)
    elif kind in ("Q4_K", "Q4_1"):
        raw[..., 0:4] = scale(2)
    else:
        raw[..., 0:2] = scale(1)
    return raw.reshape(rows, -1)


_chosen: str | None = None


def active_variant() -> str | None:
    """The variant the products run: ``SPECDECODE_KERNEL_ISA`` when set, else the fastest this CPU
    executes (measured once per process, about a second); None: the torch reference runs.

    Raises:
        SpecDecodeError: a forced variant that is unknown or that this CPU cannot run."""
    global _chosen, _kernel_note
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if forced == "reference":
        return None
    kernel = load_kernel()
    if kernel is None:
        return None
    if forced:
        load_variant(forced)
        _kernel_note = f"{forced} kernel (forced by {ISA_ENV})"
        return forced
    if _chosen is None:
        with _lock:
            if _chosen is None:
                timed = {}
                for name in supported_variants():
                    try:
                        timed[name] = _time_variant(kernel, load_variant(name))
                    except SpecDecodeError as exc:
                        logger.warning("%s", exc)
                _chosen = min(timed, key=timed.get) if timed else ""
                if timed:
                    figures = ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in timed.items())
                    _kernel_note = f"{_chosen} kernel (measured here: {figures})"
    return _chosen or None


def variant_table() -> int:
    """The kernel table address of :func:`active_variant`, 0 for the torch reference.

    Raises:
        SpecDecodeError: as :func:`active_variant`."""
    name = active_variant()
    return load_variant(name) if name else 0


def load_kernel(cache_dir: str | Path | None = None):
    """The compiled torch extension (thread split, C++ layer loop), building it on first use; None
    where it cannot run. Build directory: ``<cache dir>/kernels/lowbit-<torch version>-<source hash>``.
    ``SPECDECODE_KERNEL_ISA=reference`` forces the torch reference (tests)."""
    global _kernel, _kernel_note
    if os.environ.get(ISA_ENV, "").strip().lower() == "reference":
        if _kernel_note != f"torch reference ({ISA_ENV}=reference)":
            _kernel_note = f"torch reference ({ISA_ENV}=reference)"
            print(f"specdecode: low-bit products run the slower {_kernel_note}", file=sys.stderr, flush=True)
        return None
    with _lock:
        if _kernel is not None:
            return _kernel or None
        if not supported_variants():
            _kernel, _kernel_note = False, "torch reference (this CPU has no AVX2 + FMA + F16C)"
            print(f"specdecode: low-bit products run the slower {_kernel_note}", file=sys.stderr, flush=True)
            return None
        # the source, this checkout and this interpreter (ninja's build file holds their absolute paths)
        where = f"{Path(__file__).resolve().parent}|{sys.prefix}".encode()
        digest = hashlib.sha256(b"".join(s.read_bytes() for s in (*_SOURCES, _HEADER)) + where).hexdigest()[:12]
        build = _cache_base(cache_dir) / "kernels" / f"lowbit-{torch.__version__.split('+')[0]}-{digest}"
        try:
            from torch.utils.cpp_extension import load

            build.mkdir(parents=True, exist_ok=True)
            name = f"specdecode_lowbit_{digest}"
            fresh = not any(build.glob(f"{name}*.so"))
            if fresh:  # the first use on this machine (or of this source): say why it pauses
                print(f"specdecode: compiling the low-bit products' thread split and the C++ layer loop into {build} "
                      "(once per machine and version, about a minute)", file=sys.stderr, flush=True)
            start = time.perf_counter()
            import fcntl

            # Our own lock first: the OS drops it when its holder dies, so while we hold it no build of ours
            # runs, and torch's lock file (which a build killed mid-way leaves behind, and which torch
            # then waits on forever) can only be stale.
            with open(build / "specdecode.lock", "w") as guard:
                fcntl.flock(guard, fcntl.LOCK_EX)
                stale = build / "lock"
                if stale.exists():
                    print(f"specdecode: removing {stale}, left by a build that was interrupted", file=sys.stderr,
                          flush=True)
                    stale.unlink(missing_ok=True)
                _kernel = load(name, [str(s) for s in _SOURCES], extra_cflags=["-O3", "-fopenmp"],
                               extra_include_paths=[str(_CSRC)],
                               extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False)
            took = time.perf_counter() - start
            if fresh:
                print(f"specdecode: compiled in {took:.0f} s", file=sys.stderr, flush=True)
            _kernel_note = f"kernel extension {'compiled' if fresh else 'loaded'} in {took:.1f} s (variant not chosen yet)"
        except Exception as exc:  # noqa: BLE001 - no compiler / headers / ninja: the reference runs
            _kernel = False
            first = next((line for line in str(exc).splitlines() if line.strip()), "")
            _kernel_note = f"torch reference (the kernel extension did not build: {type(exc).__name__}: {first[:200]})"
            print(f"specdecode: low-bit products run the slower {_kernel_note}", file=sys.stderr, flush=True)
        return _kernel or None


_bf16_fast = None


def fast_bf16() -> bool:
    """Whether this CPU runs bfloat16 matrix products natively (AVX512-BF16 or AMX-BF16)."""
    global _bf16_fast
    if _bf16_fast is None:
        flags = cpu_flags()
        _bf16_fast = "avx512_bf16" in flags or "amx_bf16" in flags
    return _bf16_fast


def kernel_status() -> str:
    """One line: which implementation (and instruction-set variant) runs the low-bit products."""
    return _kernel_note


# Activations ------------------------------------------------------------------------------------

def quantize_activations(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The float32 values the kernel multiplies for ``x`` [rows, in] (8 bits per row, a scale per
    block of 32 for the 32-weight formats, per 256 for Q4_K / Q6_K), dequantized: the torch
    reference's input, and the tests' float64 reference. Rounding: to nearest, ties to even."""
    block = 256 if GGUF_BLOCKS[kind][1] == 256 else 32
    rows, k = x.shape
    g = x.float().reshape(rows, k // block, block)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(g * inv).clamp(-127, 127)
    return (q * (amax / 127.0)).reshape(rows, k)


# The module -------------------------------------------------------------------------------------

class QuantLinear(torch.nn.Module):
    """A linear layer whose weight is GGUF blocks, run by the few-row kernel.

    Args:
        raw: [out, bytes per row] uint8: each output row's blocks as a GGUF file stores them (or, with
            ``packed``, as :func:`repack` lays them out for the kernel; :attr:`packed` holds that).
        kind: the block type, a key of :data:`GGUF_BLOCKS` ("Q4_K", "Q6_K", "Q4_1", ...).
        in_features: the row length in weights (a multiple of the type's block size).
        bias: [out] or None.
        precision: the model-level name this layer belongs to ("int4": a GGUF file's own blocks;
            "int8": Q8_0 quantized from float weights).

    Input [..., in_features] (any float dtype); output [..., out_features] float32.

    Raises:
        SpecDecodeError: an unknown type, or ``raw`` that does not hold ``in_features`` of it.
    """

    def __init__(self, raw: torch.Tensor, kind: str, in_features: int, bias: torch.Tensor | None = None,
                 precision: str = "int4", packed: bool = False) -> None:
        super().__init__()
        if kind not in GGUF_BLOCKS:
            raise SpecDecodeError(f"GGUF tensor type {kind} has no low-bit kernel here (types run: {', '.join(GGUF_BLOCKS)})")
        fmt, size, nbytes = GGUF_BLOCKS[kind]
        if in_features % size or raw.dim() != 2 or raw.shape[1] != in_features // size * nbytes:
            raise SpecDecodeError(f"GGUF {kind} weight of {tuple(raw.shape)} bytes does not hold rows of {in_features} "
                                  f"weights ({in_features // size * nbytes} bytes each)")
        raw = raw.to(torch.uint8).contiguous()
        self.packed = raw if packed else torch.from_numpy(repack(raw.numpy(), kind))
        self.kind, self.fmt = kind, fmt
        self.out_features, self.in_features = int(raw.shape[0]), int(in_features)
        self.bias = None if bias is None else bias.detach().float().clone()
        self.weight_precision = precision
        self._reference_weight = None
        #: rows above which a non-exact call (a prompt's prefill) takes the float product (set per model by
        #: the owned forward, :func:`prefill_rows`)
        self.prefill_rows = PREFILL_ROWS

    @property
    def bits(self) -> float:
        """Bits per weight as stored (Q4_K 4.5, Q6_K 6.56, Q4_1 5, Q8_0 8.5)."""
        _, size, nbytes = GGUF_BLOCKS[self.kind]
        return 8 * nbytes / size

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, kind: str = "Q8_0",
                   precision: str = "int8") -> "QuantLinear":
        """Quantize float weights [out, in] to ``kind`` blocks with the gguf package (Q8_0, Q4_0, Q4_1,
        Q5_0: the types it quantizes)."""
        import gguf

        w = weight.detach().float().numpy()
        raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])
        return cls(torch.from_numpy(np.ascontiguousarray(raw)), kind, w.shape[1], bias, precision)

    def dequantize(self) -> torch.Tensor:
        """[out, in] float32: the weights these blocks hold (``gguf.dequantize``)."""
        import gguf

        values = gguf.quants.dequantize(self.gguf_raw(), gguf.GGMLQuantizationType[self.kind])
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(self.out_features, -1)

    def gguf_raw(self) -> np.ndarray:
        """[out, bytes per row] uint8: the blocks as a GGUF file stores them."""
        return unpack(self.packed.numpy(), self.kind)

    def forward(self, x: torch.Tensor, exact: bool = True, prompt: bool = False) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features] float32; the same arithmetic for any number of rows.

        ``exact=False`` with more than :attr:`prefill_rows` rows (a prompt's prefill): the weight is
        dequantized once and multiplied in one many-row product (float32, or with ``prompt`` bfloat16 on
        CPUs with AVX512-BF16 / AMX), which is faster there and not row-invariant.
        """
        rows = x.reshape(-1, self.in_features).float().contiguous()
        kernel, table = load_kernel(), variant_table()
        if not exact and rows.shape[0] > self.prefill_rows:
            weight = kernel.q_dequantize(self.packed, self.fmt, self.in_features, table) if table else self.dequantize()
            if prompt and fast_bf16():
                out = F.linear(rows.to(torch.bfloat16), weight.to(torch.bfloat16)).float()
            else:
                out = F.linear(rows, weight)
        elif kernel is not None and table:
            out = kernel.q_linear(rows, self.packed, self.fmt, table)
        else:  # the reference: 8-bit activations, fixed 16-row blocks, every block padded (row-invariant)
            if self._reference_weight is None:
                self._reference_weight = self.dequantize()
            out = row_product("padded", self._reference_weight, quantize_activations(rows, self.kind))
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def weight_nbytes(self) -> int:
        """Bytes one product reads: the blocks and the bias."""
        return self.packed.numel() + (0 if self.bias is None else self.bias.numel() * 4)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"packed": self.packed}

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.kind} "
                f"({self.bits:.2f} bits per weight), bias={self.bias is not None}")


LOWBIT_TYPES = (QuantLinear,)


def concat(parts: list[QuantLinear]) -> QuantLinear | None:
    """One module computing ``cat([p(x) for p in parts], -1)`` in one product, or None when the
    parts differ in block type or row length (then they run one after another)."""
    if len({(p.kind, p.in_features) for p in parts}) != 1:
        return None
    biases = None
    if any(p.bias is not None for p in parts):
        biases = torch.cat([p.bias if p.bias is not None else torch.zeros(p.out_features) for p in parts])
    if parts[0].kind in TILED:  # tiles of 8 columns: concatenate the file's rows and repack them
        return QuantLinear(torch.from_numpy(np.concatenate([p.gguf_raw() for p in parts])), parts[0].kind,
                           parts[0].in_features, biases, parts[0].weight_precision)
    return QuantLinear(torch.cat([p.packed for p in parts]), parts[0].kind, parts[0].in_features, biases,
                       parts[0].weight_precision, packed=True)


# Whole models ------------------------------------------------------------------------------------

#: Bump when the cached low-bit file's layout changes (older files are rebuilt).
CACHE_FORMAT = 5 if Q6K_TILES else 4  # 3: Q4_K scale bytes in the kernel's order (repack); 4: Q4_K tiles of 8
#                                       columns; 5: Q6_K tiles too


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
    from specdecode.models import _stream_plan

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
    if progress:
        from tqdm import tqdm

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
    from safetensors.torch import save_file

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
    from safetensors import safe_open
    from safetensors.torch import load_file

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
    from specdecode.models import _converted_ok, default_cache_dir, load_model, resolve_spec

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
    from safetensors import safe_open
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
