"""The compiled low-bit kernels: the GGUF block formats as the kernels lay them out, the plain-C products
(``csrc/qgemm.c``) compiled per instruction-set variant with gcc and the variant chosen by measuring, the torch
extension (``csrc/lowbit.cpp``, ``csrc/step.cpp``) built once per machine, and which of them runs
(:func:`kernel_status`)."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from specdecode import lowbit_tiles32 as tiles32
from specdecode.errors import SpecDecodeError


logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = [_CSRC / name for name in ("extension.cpp", "lowbit.cpp", "step.cpp")]  # the first includes the others
_QGEMM = _CSRC / "qgemm.c"
_HEADER = _CSRC / "qtable.h"  # the table layout both sides share
_lock = threading.Lock()
_kernel = None  # the compiled torch extension, False once its build failed
_kernel_note = "not loaded yet"
#: GGUF block types run as stored: name -> (format id in csrc/qgemm.c, weights per block, bytes per block).
GGUF_BLOCKS = {"Q4_0": (0, 32, 18), "Q4_1": (1, 32, 20), "Q5_0": (2, 32, 22), "Q8_0": (3, 32, 34),
               "Q4_K": (4, 256, 144), "Q6_K": (5, 256, 210)}

#: The column layout of a 32-weight block format (the last rows % 8 of its tiles, :mod:`lowbit_tiles32`): the
#: fields' byte ranges, each read as one array per row (:func:`_columns`: same bytes, eight blocks' scales in
#: one load). Q6_K's column layout is its blocks. Q4_K and Q6_K are repacked as tiles of 8 output columns
#: (:func:`_q4k_tile`: same bytes; one vpdpbusd multiplies 4 weights of 8 columns); Q4_K's last rows % 8 keep
#: their blocks with the 12 bytes of 6-bit scales and minimums re-ordered (:func:`_q4k_to_kernel`).
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
#: The 32-weight formats, all run as tiles of 8 columns (csrc/qgemm.c passt32 / gemm32; :mod:`lowbit_tiles32`)
TILED32 = ("Q4_0", "Q4_1", "Q5_0", "Q8_0")
#: Formats repacked as tiles of 8 output columns (the last rows % 8 keep the column layout): name ->
#: (tile [8 T, bytes] -> [8 T, bytes], its inverse)
TILED = {"Q4_K": (_q4k_tile, _q4k_untile), **({"Q6_K": (_q6k_tile, _q6k_untile)} if Q6K_TILES else {}),
         **{kind: (partial(tiles32.tile, kind=kind), partial(tiles32.untile, kind=kind)) for kind in TILED32}}


def _columns(raw: np.ndarray, kind: str) -> np.ndarray:
    """GGUF rows [rows, bytes] uint8 -> the column layout [rows, bytes] uint8 (each 32-weight block field as one
    array per row: ``d[nb] | m[nb] | qs[nb][16]`` for Q4_1; Q4_K: scale bytes re-ordered; Q6_K as stored)."""
    if kind == "Q4_K":
        return _q4k_scales_mapped(raw, _q4k_to_kernel)
    if kind not in _FIELDS or raw.shape[0] == 0:
        return np.array(raw, np.uint8)
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, GGUF_BLOCKS[kind][2])
    return np.ascontiguousarray(np.concatenate([blocks[..., a:b].reshape(rows, -1) for a, b in _FIELDS[kind]], axis=1))


def _uncolumns(packed: np.ndarray, kind: str) -> np.ndarray:
    """The inverse of :func:`_columns`."""
    if kind == "Q4_K":
        return _q4k_scales_mapped(packed, _q4k_from_kernel)
    if kind not in _FIELDS or packed.shape[0] == 0:
        return np.array(packed, np.uint8)
    rows, nbytes = packed.shape[0], GGUF_BLOCKS[kind][2]
    nb = packed.shape[1] // nbytes
    out = np.empty((rows, nb, nbytes), np.uint8)
    at = 0
    for a, b in _FIELDS[kind]:
        out[..., a:b] = packed[:, at : at + nb * (b - a)].reshape(rows, nb, b - a)
        at += nb * (b - a)
    return out.reshape(rows, -1)


def repack(raw: np.ndarray, kind: str) -> np.ndarray:
    """GGUF rows [rows, bytes] uint8 -> the kernel's layout [rows, bytes] uint8, the same bytes: the formats in
    :data:`TILED` as tiles of 8 columns, the last rows % 8 (and other formats) in the column layout
    (:func:`_columns`). Packed rows [8 i, 8 i + 8) are tile i: packed matrices concatenate (or slice) as they are
    only at multiples of 8 rows (``quant_linear.concat``); elsewhere concatenate or slice GGUF rows (:func:`unpack`)."""
    raw = np.asarray(raw, np.uint8)
    if kind not in TILED:
        return np.ascontiguousarray(_columns(raw, kind))
    full = raw.shape[0] // Q4K_TILE * Q4K_TILE
    return np.ascontiguousarray(np.concatenate([TILED[kind][0](raw[:full]), _columns(raw[full:], kind)]))


def unpack(packed: np.ndarray, kind: str) -> np.ndarray:
    """The inverse of :func:`repack`: the kernel's layout [rows, bytes] uint8 -> GGUF rows [rows, bytes] uint8."""
    packed = np.asarray(packed, np.uint8)
    if kind not in TILED:
        return np.ascontiguousarray(_uncolumns(packed, kind))
    full = packed.shape[0] // Q4K_TILE * Q4K_TILE
    return np.ascontiguousarray(np.concatenate([TILED[kind][1](packed[:full]), _uncolumns(packed[full:], kind)]))


#: Instruction-set variants of the kernel, richest first where the CPU runs several: name ->
#: (the /proc/cpuinfo flags it needs, gcc flags, the macro csrc/qgemm.c reads).
VARIANTS = {
    "amx": (("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_tile", "amx_int8"),
            ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mamx-tile",
             "-mamx-int8"], "SD_VARIANT_AMX"),
    "avx512vnni": (("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
                   ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"],
                   "SD_VARIANT_AVX512VNNI"),
    "avx512": (("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"),
               ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl"], "SD_VARIANT_AVX512"),
    "avxvnni": (("avx2", "fma", "f16c", "avx_vnni"), ["-mavx2", "-mfma", "-mf16c", "-mavxvnni"], "SD_VARIANT_AVXVNNI"),
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
    """The kernel variants this CPU executes (and the compiler builds: ``amx`` and ``avxvnni`` need gcc 11 or later), in
    :data:`VARIANTS` order."""
    flags = cpu_flags()
    cpu = [name for name, (need, _, _) in VARIANTS.items() if all(f in flags for f in need)]
    return [name for name in cpu if name not in ("amx", "avxvnni") or _compiler_takes(tuple(VARIANTS[name][1]))]


@functools.lru_cache(maxsize=None)
def _compiler_takes(flags: tuple[str, ...]) -> bool:
    """Whether ``$CC`` (gcc) accepts ``flags`` (a gcc older than 11 lacks ``-mamx-tile`` and ``-mavxvnni``: that
    variant is then left out, once per process, instead of failing to compile at every start)."""
    try:
        done = subprocess.run([os.environ.get("CC", "gcc"), *flags, "-E", "-x", "c", os.devnull], capture_output=True,
                              timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    if done.returncode != 0:
        logger.info("the compiler does not take %s: that kernel variant is left out", " ".join(flags))
    return done.returncode == 0


def _cache_base(cache_dir=None) -> Path:
    # lazy: specdecode.models pulls in transformers (start-up time)
    from specdecode.models import default_cache_dir

    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


_variants: dict[str, tuple[ctypes.CDLL, int]] = {}
_variant_errors: dict[str, SpecDecodeError] = {}  # variants whose background compile failed
_variant_locks = {name: threading.Lock() for name in VARIANTS}


def load_variant(name: str, cache_dir=None) -> int:
    """The address of variant ``name``'s kernel table (compiled with gcc on first use, cached; each variant
    compiled once in this process, different variants side by side, each into its own temporary file, then
    an atomic rename).

    Raises:
        SpecDecodeError: unknown variant, a CPU without its instructions, or no compiler.
    """
    if name not in VARIANTS:
        raise SpecDecodeError(f"unknown kernel variant {name!r}; choose one of {', '.join(VARIANTS)} or reference")
    with _variant_locks[name]:
        if name in _variant_errors:  # a compile that failed on a background thread: said once, not retried
            raise _variant_errors[name]
        if name not in _variants:
            _variants[name] = _compile_variant(name, cache_dir)
    return _variants[name][1]


#: gcc flags of every variant. -ffp-contract=off: gcc (GNU C) would otherwise fuse a multiply feeding an add into
#: one FMA where it sees fit, per variant: the float order is the one written (explicit FMA intrinsics stay).
_COMMON_CFLAGS = ["-O3", "-std=gnu11", "-ffp-contract=off", "-shared", "-fPIC"]


def _variant_path(name: str, cache_dir=None) -> Path:
    flags = " ".join(_COMMON_CFLAGS + VARIANTS[name][1])
    digest = hashlib.sha256(_QGEMM.read_bytes() + _HEADER.read_bytes() + flags.encode()).hexdigest()[:12]
    return _cache_base(cache_dir) / "kernels" / f"qgemm-{name}-{digest}.so"


#: How many variants are compiled and timed at first use: the richest this CPU runs and the next one whose code
#: for 1-16 rows differs (the others compile when forced through SPECDECODE_KERNEL_ISA). All five on an AMX Xeon
#: cost about 50 s of gcc at the first run (amx 16 s, avxvnni and avx2 4 s each), beside the torch extension's 26 s.
MEASURED_VARIANTS = 2

#: Variants whose decoding and verification code (1-16 rows) is another's: amx runs avx512vnni's passes below 16
#: rows, so timing one against the other measures noise
_SAME_FEW_ROW_CODE = {"amx": "avx512vnni"}


def candidate_variants() -> list[str]:
    """The variants the start-up measurement times, in :data:`VARIANTS` order (AMX, VNNI, AVX-512, AVX-VNNI,
    AVX2): the richest this CPU executes, then the next ones whose few-row code differs, :data:`MEASURED_VARIANTS`
    in all (an AMX Xeon: amx and avx512; AVX-512 VNNI: avx512vnni and avx512; an Intel Core of the 12th generation
    or later: avxvnni and avx2; Zen 3: avx2)."""
    supported = supported_variants()
    if not supported:
        return []
    chosen = [supported[0]]
    for name in supported[1:]:
        if len(chosen) < MEASURED_VARIANTS and _SAME_FEW_ROW_CODE.get(chosen[0]) != name:
            chosen.append(name)
    return chosen


def _wanted_variants() -> list[str]:
    """The variants this process will load: the forced one, else the candidates (they are measured)."""
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if forced:
        return [forced] if forced in supported_variants() else []
    return candidate_variants()


def _compile_variants_in_background(cache_dir=None) -> dict[str, threading.Thread]:
    """Start compiling the wanted variants not compiled yet, each on its own thread (gcc runs while the torch
    extension builds: the first run waits for the slower of the two, not their sum); their errors surface
    when :func:`load_variant` is called. Returns the threads started, by variant."""
    started = {}
    for name in _wanted_variants():
        if name in _variants or _variant_path(name, cache_dir).is_file():
            continue

        def build(name=name):
            with _variant_locks[name]:
                if name in _variants or name in _variant_errors:
                    return
                try:
                    _variants[name] = _compile_variant(name, cache_dir, quiet=True)
                except Exception as exc:  # noqa: BLE001 - kept for load_variant to raise in the caller's thread
                    _variant_errors[name] = exc if isinstance(exc, SpecDecodeError) else SpecDecodeError(
                        f"could not compile or load the {name} kernel: {type(exc).__name__}: {exc}")
        started[name] = threading.Thread(target=build, name=f"specdecode-compile-{name}", daemon=True)
        started[name].start()
    return started


def _compile_variant(name: str, cache_dir=None, quiet: bool = False) -> tuple[ctypes.CDLL, int]:
    """Compile (unless cached) and load variant ``name``; ``quiet``: the caller has said so on screen."""
    if name not in supported_variants():
        raise SpecDecodeError(f"this CPU cannot run the {name} kernel (it runs: {', '.join(supported_variants()) or 'none'})")
    _, flags, macro = VARIANTS[name]
    out = _variant_path(name, cache_dir)
    if not out.is_file():
        if not quiet:
            print(f"specdecode: compiling the {name} low-bit kernel into {out.parent} (once per machine and version, "
                  "seconds)", file=sys.stderr, flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        for stale in out.parent.glob(f".{out.name}.*.tmp"):  # left by a compile that was interrupted (not a running one)
            with contextlib.suppress(OSError):
                if time.time() - stale.stat().st_mtime > STALE_TMP_S:
                    stale.unlink()
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
        os.close(fd)
        cmd = [os.environ.get("CC", "gcc"), *_COMMON_CFLAGS, *flags, f"-D{macro}",
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


#: Seconds after which a variant's temporary output is taken for one an interrupted compile left (a compile takes
#: under a minute)
STALE_TMP_S = 600


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


def check_forced_variant() -> None:
    """Refuse a wrong ``SPECDECODE_KERNEL_ISA`` at once, before anything compiles or loads (no compiler runs
    except the one-off flag check of ``amx`` and ``avxvnni``).

    Raises:
        SpecDecodeError: an unknown variant, or one this CPU cannot run."""
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if not forced or forced == "reference":
        return
    if forced not in VARIANTS:
        raise SpecDecodeError(f"{ISA_ENV}={forced}: unknown kernel variant {forced!r}; choose one of "
                              f"{', '.join(VARIANTS)} or reference")
    if forced not in supported_variants():
        raise SpecDecodeError(f"{ISA_ENV}={forced}: this CPU cannot run the {forced} kernel (it runs: "
                              f"{', '.join(supported_variants()) or 'none'})")


def build_in_background(cache_dir=None) -> threading.Thread | None:
    """Start :func:`load_kernel` (the torch extension and the wanted variants, compiled at the first use on this
    machine) on a daemon thread, so that a first run compiles while it reads and converts the model; gcc runs in
    child processes, so the thread holds the GIL only to start and join them. None when nothing is left to
    build in this process. The variants are timed later, by :func:`active_variant` in the caller's thread, on
    a CPU no longer busy compiling. Errors surface where :func:`load_kernel` reports them (the reference runs)."""
    if _kernel is not None or os.environ.get(ISA_ENV, "").strip().lower() == "reference" or not supported_variants():
        return None
    thread = threading.Thread(target=load_kernel, args=(cache_dir,), name="specdecode-build-kernel", daemon=True)
    thread.start()
    return thread


_chosen: str | None = None


def active_variant() -> str | None:
    """The variant the products run: ``SPECDECODE_KERNEL_ISA`` when set, else the richest this CPU executes
    unless another of :func:`candidate_variants` measures clearly faster (once per process, about a second);
    None: the torch reference runs.

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
        try:
            load_variant(forced)
        except SpecDecodeError as exc:
            raise SpecDecodeError(f"{ISA_ENV}={forced}: {exc}") from exc
        _kernel_note = f"{forced} kernel{_amx_note(forced)} (forced by {ISA_ENV})"
        return forced
    if _chosen is None:
        with _lock:
            if _chosen is None:
                tables = {}
                for name in candidate_variants():
                    try:
                        tables[name] = load_variant(name)
                    except SpecDecodeError as exc:
                        logger.warning("%s", exc)
                timed = {name: float("inf") for name in tables}
                for _ in range(3):  # interleaved rounds, fastest of each: a busy moment hits every variant
                    for name, address in tables.items():
                        timed[name] = min(timed[name], _time_variant(kernel, address))
                _chosen = _pick_variant(timed) if timed else ""
                if timed:
                    figures = ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in timed.items())
                    _kernel_note = f"{_chosen} kernel{_amx_note(_chosen)} (measured here: {figures})"
    return _chosen or None


def amx_tiles_active(name: str = "amx") -> bool | None:
    """Whether variant ``name`` runs AMX tile products in this process (Linux granted the tile state); None for
    a variant without them or one not loaded."""
    if name != "amx" or name not in _variants:
        return None
    return _variants[name][0].sd_amx_state() > 0


def _amx_note(name: str) -> str:
    """The amx variant's tile state for the status line ('' for other variants)."""
    if amx_tiles_active(name) is not False:
        return ""
    return (f" (Linux refused the AMX tile state, errno {-_variants[name][0].sd_amx_state()}: its VNNI passes run "
            "every product)")


def _pick_variant(timed: dict[str, float]) -> str:
    """The richest variant (``VARIANTS`` order: AMX, VNNI, AVX-512, AVX-VNNI, AVX2) unless another measured clearly faster
    (by more than :data:`VARIANT_MARGIN`): on a noisy machine the choice then stays the same run to run. (The
    timing's 1 and 5 rows run the same code on amx and avx512vnni: :func:`candidate_variants` times amx against
    avx512.)"""
    richest = next(iter(timed))
    best = min(timed, key=timed.get)
    return richest if timed[richest] <= (1 + VARIANT_MARGIN) * timed[best] else best


#: How much faster (a fraction) a poorer variant must measure to be chosen over the richest.
VARIANT_MARGIN = 0.1


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
        variants: dict[str, threading.Thread] = {}
        try:
            # lazy: torch's C++ extension tools (slow to import), only when the extension is built
            from torch.utils.cpp_extension import load

            build.mkdir(parents=True, exist_ok=True)
            name = f"specdecode_lowbit_{digest}"
            fresh = not any(build.glob(f"{name}*.so"))
            start = time.perf_counter()
            variants = _compile_variants_in_background(cache_dir)  # joined below, or in the handler on failure
            if fresh or variants:  # the first use on this machine (or of this source): say why it pauses
                what = ["the low-bit products' thread split and the C++ layer loop"] if fresh else []
                what += [f"the {', '.join(variants)} kernel{'s' if len(variants) > 1 else ''}"] if variants else []
                print(f"specdecode: compiling {' and '.join(what)} into {build.parent} (once per machine and "
                      f"version, {'about 30 s on 2 cores' if fresh else 'seconds'})", file=sys.stderr, flush=True)

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
                _kernel = load(name, [str(_SOURCES[0])], extra_cflags=["-O3", "-fopenmp"],
                               extra_include_paths=[str(_CSRC)],
                               extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False)
            for thread in variants.values():  # wait for them here: the line below then says the whole pause
                thread.join()
            took = time.perf_counter() - start
            if fresh or variants:
                print(f"specdecode: compiled in {took:.0f} s", file=sys.stderr, flush=True)
            _kernel_note = f"kernel extension {'compiled' if fresh else 'loaded'} in {took:.1f} s (variant not chosen yet)"
        except Exception as exc:  # noqa: BLE001 - no compiler / headers / ninja: the reference runs
            for thread in variants.values():  # no gcc left running, no half-written file
                thread.join()
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
