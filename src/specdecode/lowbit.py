"""Weight-only low-bit linear layers made from a GGUF file's own blocks (``--weights int4``) or from
float weights (``--weights int8``), and the CPU kernel that runs them.

A GGUF model *is* its quantized blocks: our converted float32 copy is those blocks dequantized
(``models._write_streamed``). :func:`gguf_linear_weights` reads the blocks of every linear layer
back out of the file, without requantizing anything:

- 4-bit types (Q4_0, Q4_1, Q4_K) become :class:`GroupInt4Linear`: per group of 32 weights along
  ``in_features``, ``w = scale * q + offset`` with ``q`` in 0..15 (Q4_K's two-level scales
  ``d * sc`` and ``dmin * m`` are exact in float32).
- Wider types (Q5_0, Q6_K, Q8_0) become :class:`GroupInt8Linear`: ``w = scale * q`` with ``q`` in
  -128..127 per group of 32 (Q6_K: 16).

So the low-bit model computes with the very weights of the float copy (up to one float32
rounding of ``scale * q + offset``); activations stay float32. Both modules read each weight byte
once per call whatever the number of rows (one decoding step, a verification of gamma + 1 tokens,
a batch), and a row's result does not depend on the other rows (the kernel accumulates every
row in one fixed order), so speculative decoding stays token-for-token equal to plain decoding of
the same low-bit target (the batch-invariance contract of ``kv.owned.OwnedRunner``).

The kernel (``csrc/lowbit.cpp``, AVX-512) is compiled with torch's C++ extension tools on first
use (about a minute; it says so) and cached under ``<cache dir>/kernels/``; without a compiler or AVX-512 the
same products run as a torch reference (dequantize, then a float32 product in fixed 16-row
blocks: slower, same contract). :func:`kernel_status` says which one runs.

Formats: ggml's block layouts (``ggml-common.h`` / ``ggml-quants.c`` of llama.cpp, and the ``gguf``
Python package's ``quants.py``), read here with numpy.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specdecode.errors import SpecDecodeError

logger = logging.getLogger(__name__)

#: Rows above which a call that need not be row-invariant (a prompt's prefill) dequantizes the
#: weight and runs one float32 matrix product instead of the few-row kernel.
PREFILL_ROWS = 32

_SOURCES = [Path(__file__).with_name("csrc") / name for name in ("lowbit.cpp", "step.cpp")]
_lock = threading.Lock()
_kernel = None  # the compiled module, False once its build failed
_kernel_note = "not loaded yet"


def _cpu_has_avx512() -> bool:
    try:
        return torch.backends.cpu.get_cpu_capability() in ("AVX512", "AMX")
    except Exception:  # noqa: BLE001 - an old torch: read the flags
        try:
            return "avx512bw" in Path("/proc/cpuinfo").read_text()
        except OSError:
            return False


def load_kernel(cache_dir: str | Path | None = None):
    """The compiled low-bit kernel module, building it on first use; None where it cannot run.

    Build directory: ``<cache dir>/kernels/lowbit-<torch version>-<source hash>`` (reused by later
    processes). ``SPECDECODE_LOWBIT_KERNEL=reference`` forces the torch reference (tests).
    """
    global _kernel, _kernel_note
    if os.environ.get("SPECDECODE_LOWBIT_KERNEL") == "reference":
        if _kernel_note != "torch reference (SPECDECODE_LOWBIT_KERNEL=reference)":
            _kernel_note = "torch reference (SPECDECODE_LOWBIT_KERNEL=reference)"
            print(f"specdecode: low-bit products run the slower {_kernel_note}", file=sys.stderr, flush=True)
        return None
    with _lock:
        if _kernel is not None:
            return _kernel or None
        if not _cpu_has_avx512():
            _kernel, _kernel_note = False, "torch reference (this CPU has no AVX-512)"
            print(f"specdecode: low-bit products run the slower {_kernel_note}", file=sys.stderr, flush=True)
            return None
        from specdecode.models import default_cache_dir

        # the source, this checkout and this interpreter (ninja's build file holds their absolute paths)
        where = f"{Path(__file__).resolve().parent}|{sys.prefix}".encode()
        digest = hashlib.sha256(b"".join(s.read_bytes() for s in _SOURCES) + where).hexdigest()[:12]
        base = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        build = base / "kernels" / f"lowbit-{torch.__version__.split('+')[0]}-{digest}"
        try:
            from torch.utils.cpp_extension import load

            build.mkdir(parents=True, exist_ok=True)
            flags = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-fopenmp"]
            name = f"specdecode_lowbit_{digest}"
            fresh = not any(build.glob(f"{name}*.so"))
            if fresh:  # the first use on this machine (or of this source): say why it pauses
                print(f"specdecode: compiling the low-bit kernel and the C++ layer loop into {build} "
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
                _kernel = load(name, [str(s) for s in _SOURCES], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                               build_directory=str(build), verbose=False)
            took = time.perf_counter() - start
            if fresh:
                print(f"specdecode: compiled in {took:.0f} s", file=sys.stderr, flush=True)
            _kernel_note = f"AVX-512 kernel ({build}; {'compiled' if fresh else 'loaded'} in {took:.1f} s)"
        except Exception as exc:  # noqa: BLE001 - no compiler / headers / ninja: the reference runs
            _kernel = False
            _kernel_note = f"torch reference (the AVX-512 kernel did not build: {type(exc).__name__}: {str(exc)[:200]})"
            print(f"specdecode: low-bit products run the slower {_kernel_note}", file=sys.stderr, flush=True)
        return _kernel or None


_bf16_fast = None


def fast_bf16() -> bool:
    """Whether this CPU runs bfloat16 matrix products natively (AVX512-BF16 or AMX-BF16)."""
    global _bf16_fast
    if _bf16_fast is None:
        try:
            flags = Path("/proc/cpuinfo").read_text().split()
        except OSError:
            flags = []
        _bf16_fast = "avx512_bf16" in flags or "amx_bf16" in flags
    return _bf16_fast


def kernel_status() -> str:
    """One line: which implementation runs the low-bit products (after :func:`load_kernel`)."""
    return _kernel_note


class _GroupLinear(torch.nn.Module):
    """Shared parts of the two low-bit linear modules (bias, row blocking, prefill path)."""

    weight_precision = "int4"
    bits = 4

    def __init__(self, out_features: int, in_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = int(out_features), int(in_features)
        self.bias = None if bias is None else bias.detach().float().clone()

    def dequantize(self) -> torch.Tensor:  # [out, in] float32
        raise NotImplementedError

    def _kernel_call(self, kernel, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, exact: bool = True, prompt: bool = False) -> torch.Tensor:
        """x [..., in_features] (any float dtype) -> [..., out_features] float32.

        ``exact=False`` with more than :data:`PREFILL_ROWS` rows: dequantize once and run one
        many-row product (not row-invariant): float32, or with ``prompt`` (a prompt's prefill, which
        plain and speculative decoding run alike) bfloat16 on CPUs with AVX512-BF16 / AMX, 3-5x faster
        there. Otherwise the few-row kernel (float32 products on the exact weights).
        """
        rows = x.reshape(-1, self.in_features).float().contiguous()
        if not exact and rows.shape[0] > PREFILL_ROWS:
            kernel = load_kernel()
            weight = self.dequantize() if kernel is None else self._kernel_dequantize(kernel)
            if prompt and fast_bf16():
                out = F.linear(rows.to(torch.bfloat16), weight.to(torch.bfloat16)).float()
            else:
                out = F.linear(rows, weight)
        else:
            kernel = load_kernel()
            if kernel is not None:
                out = self._kernel_call(kernel, rows)
            else:  # the reference: fixed 16-row blocks, every block padded (row-invariant)
                from specdecode.kernels import row_product

                out = row_product("padded", self.dequantize(), rows)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def weight_nbytes(self) -> int:
        """Bytes one product reads: the quantized values, their scales (and offsets), the bias."""
        return sum(t.numel() * t.element_size() for t in self._buffers_for_bytes())

    def _buffers_for_bytes(self) -> list[torch.Tensor]:
        return [t for t in (*self.state_tensors().values(), self.bias) if t is not None]

    def state_tensors(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.bits}-bit groups of "
                f"{self.group}, bias={self.bias is not None}")


class GroupInt4Linear(_GroupLinear):
    """A linear layer with 4-bit weights in groups of 32: ``w[n, k] = scales[n, g] * q + offsets[n, g]``.

    Args:
        qweight: [out, in / 2] uint8; per group of 32, byte j holds element j (low nibble) and
            element j + 16 (high nibble).
        scales, offsets: [out, in / 32] float32.
        bias: [out] or None.

    Input [..., in] float; output [..., out] float32. ``in`` must be a multiple of 32.
    """

    group = 32

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__(qweight.shape[0], qweight.shape[1] * 2, bias)
        if self.in_features % 32 or scales.shape != (self.out_features, self.in_features // 32) or offsets.shape != scales.shape:
            raise ValueError(f"int4 groups: qweight {tuple(qweight.shape)}, scales {tuple(scales.shape)}, "
                             f"offsets {tuple(offsets.shape)} do not fit groups of 32")
        self.qweight = qweight.to(torch.uint8).contiguous()
        self.scales = scales.float().contiguous()
        self.offsets = offsets.float().contiguous()

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "GroupInt4Linear":
        """Quantize float weights [out, in] to 4-bit groups of 32 (asymmetric min / max per group;
        for models that do not come from a 4-bit file, and tests)."""
        w = weight.detach().float()
        n, k = w.shape
        g = w.reshape(n, k // 32, 32)
        lo, hi = g.amin(-1), g.amax(-1)
        scales = ((hi - lo) / 15).clamp_min(1e-12)
        q = ((g - lo[..., None]) / scales[..., None]).round().clamp(0, 15).to(torch.uint8)
        return cls(pack_nibbles(q.reshape(n, k)), scales, lo, bias)

    def dequantize(self) -> torch.Tensor:
        q = unpack_nibbles(self.qweight).reshape(self.out_features, -1, 32).float()
        return (q * self.scales[..., None] + self.offsets[..., None]).reshape(self.out_features, self.in_features)

    def _kernel_call(self, kernel, x):
        return kernel.int4_linear(x, self.qweight, self.scales, self.offsets)

    def _kernel_dequantize(self, kernel):
        return kernel.int4_dequantize(self.qweight, self.scales, self.offsets)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"qweight": self.qweight, "scales": self.scales, "offsets": self.offsets}


class GroupInt8Linear(_GroupLinear):
    """A linear layer with int8 weights in groups of 16 or 32: ``w[n, k] = scales[n, g] * q``.

    Args:
        qweight: [out, in] int8; scales: [out, in / group] float32; bias: [out] or None.
        group: 16 or 32.
    """

    weight_precision = "int8"
    bits = 8

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                 group: int = 32) -> None:
        super().__init__(qweight.shape[0], qweight.shape[1], bias)
        if group not in (16, 32) or self.in_features % group or scales.shape != (self.out_features, self.in_features // group):
            raise ValueError(f"int8 groups: qweight {tuple(qweight.shape)}, scales {tuple(scales.shape)}, group {group}")
        self.group = int(group)
        self.qweight = qweight.to(torch.int8).contiguous()
        self.scales = scales.float().contiguous()

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, group: int = 32) -> "GroupInt8Linear":
        """Quantize float weights [out, in] to symmetric int8 per group (scale = max |w| / 127)."""
        w = weight.detach().float()
        n, k = w.shape
        g = w.reshape(n, k // group, group)
        scales = (g.abs().amax(-1) / 127).clamp_min(1e-12)
        q = (g / scales[..., None]).round().clamp(-127, 127).to(torch.int8)
        return cls(q.reshape(n, k), scales, bias, group)

    def dequantize(self) -> torch.Tensor:
        q = self.qweight.reshape(self.out_features, -1, self.group).float()
        return (q * self.scales[..., None]).reshape(self.out_features, self.in_features)

    def _kernel_call(self, kernel, x):
        return kernel.int8_linear(x, self.qweight, self.scales, self.group)

    def _kernel_dequantize(self, kernel):
        return kernel.int8_dequantize(self.qweight, self.scales, self.group)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"qweight": self.qweight, "scales": self.scales}


LOWBIT_TYPES = (GroupInt4Linear, GroupInt8Linear)


def concat(parts: list[_GroupLinear]) -> _GroupLinear | None:
    """One module computing ``cat([p(x) for p in parts], -1)`` in one product, or None when the
    parts differ in kind or group (then they run one after another)."""
    kinds = {(type(p), p.group, p.in_features) for p in parts}
    if len(kinds) != 1:
        return None
    biases = None
    if any(p.bias is not None for p in parts):
        biases = torch.cat([p.bias if p.bias is not None else torch.zeros(p.out_features) for p in parts])
    tensors = {name: torch.cat([p.state_tensors()[name] for p in parts]) for name in parts[0].state_tensors()}
    if isinstance(parts[0], GroupInt4Linear):
        return GroupInt4Linear(tensors["qweight"], tensors["scales"], tensors["offsets"], biases)
    return GroupInt8Linear(tensors["qweight"], tensors["scales"], biases, parts[0].group)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[out, in] values 0..15 -> [out, in / 2] uint8, per group of 32: byte j = q[j] | q[j + 16] << 4."""
    n, k = q.shape
    g = q.to(torch.uint8).reshape(n, k // 32, 32)
    return (g[..., :16] | (g[..., 16:] << 4)).reshape(n, k // 2).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_nibbles`: [out, in / 2] uint8 -> [out, in] uint8."""
    n, half = packed.shape
    g = packed.reshape(n, half // 16, 16)
    return torch.cat([g & 0xF, g >> 4], dim=-1).reshape(n, half * 2)


# GGUF blocks ------------------------------------------------------------------------------------

#: GGUF tensor types this module reads, with their block size (weights) and bytes per block.
GGUF_BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144), "Q5_0": (32, 22), "Q8_0": (32, 34),
               "Q6_K": (256, 210)}


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)[..., 0]


def decode_blocks(kind: str, raw: np.ndarray, rows: int, cols: int) -> tuple:
    """One GGUF tensor's raw blocks -> ("int4", q [rows, cols] uint8, scales, offsets [rows, cols/32])
    or ("int8", q [rows, cols] int8, scales [rows, cols/group], group).

    ``raw``: the tensor's bytes ([rows, bytes per row] uint8, as ``gguf.GGUFReader`` gives them).
    Scales and offsets are float32 and exact: ``scales * q + offsets`` is what ``gguf.dequantize``
    returns (up to float32 rounding of that one expression).

    Raises:
        SpecDecodeError: a type this module does not read, or a size that does not fit.
    """
    if kind not in GGUF_BLOCKS:
        raise SpecDecodeError(f"GGUF tensor type {kind} has no low-bit layout here (types read: {', '.join(GGUF_BLOCKS)})")
    size, nbytes = GGUF_BLOCKS[kind]
    if cols % size or raw.size != rows * cols // size * nbytes:
        raise SpecDecodeError(f"GGUF {kind} tensor of {rows}x{cols} has {raw.size} bytes, expected {rows * cols // size * nbytes}")
    b = np.ascontiguousarray(raw).reshape(rows, cols // size, nbytes)
    if kind in ("Q4_0", "Q4_1"):
        d = _f16(b[..., 0:2])
        qs = b[..., 4:20] if kind == "Q4_1" else b[..., 2:18]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # [rows, blocks, 32]: element j, then j + 16
        offsets = _f16(b[..., 2:4]) if kind == "Q4_1" else -8 * d
        return "int4", q.reshape(rows, cols), d, offsets.astype(np.float32)
    if kind == "Q4_K":
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc_raw, qs = b[..., 4:16], b[..., 16:144]
        sc = np.empty(b.shape[:2] + (8,), np.uint8)
        mn = np.empty_like(sc)
        sc[..., :4], mn[..., :4] = sc_raw[..., 0:4] & 63, sc_raw[..., 4:8] & 63
        sc[..., 4:] = (sc_raw[..., 8:12] & 0xF) | ((sc_raw[..., 0:4] >> 6) << 4)
        mn[..., 4:] = (sc_raw[..., 8:12] >> 4) | ((sc_raw[..., 4:8] >> 6) << 4)
        chunks = qs.reshape(rows, -1, 4, 32)  # 4 chunks of 32 bytes: sub-blocks 2c (low) and 2c + 1 (high)
        q = np.stack([chunks & 0xF, chunks >> 4], axis=3)  # [rows, blocks, 4, 2, 32]
        scales = d[..., None] * sc.astype(np.float32)
        offsets = -(dmin[..., None] * mn.astype(np.float32))
        return "int4", q.reshape(rows, cols), scales.reshape(rows, -1), offsets.reshape(rows, -1)
    if kind == "Q8_0":
        d = _f16(b[..., 0:2])
        return "int8", b[..., 2:34].view(np.int8).reshape(rows, cols), d, 32
    if kind == "Q5_0":
        d = _f16(b[..., 0:2])
        qh = b[..., 2:6].copy().view("<u4")[..., 0]  # [rows, blocks]
        qs = b[..., 6:22].astype(np.int16)
        j = np.arange(16)
        high0 = ((qh[..., None] >> j) & 1) << 4
        high1 = ((qh[..., None] >> (j + 16)) & 1) << 4
        q = np.concatenate([(qs & 0xF) | high0, (qs >> 4) | high1], axis=-1) - 16
        return "int8", q.astype(np.int8).reshape(rows, cols), d, 32
    # Q6_K: ql[128], qh[64], scales[16] int8, d
    ql, qh = b[..., 0:128].astype(np.int16), b[..., 128:192].astype(np.int16)
    sc = b[..., 192:208].view(np.int8).astype(np.float32)
    d = _f16(b[..., 208:210])
    out = np.empty(b.shape[:2] + (256,), np.int16)
    for half in range(2):
        l0, h0 = ql[..., 64 * half : 64 * half + 32], qh[..., 32 * half : 32 * half + 32]
        l1 = ql[..., 64 * half + 32 : 64 * half + 64]
        base = 128 * half
        out[..., base : base + 32] = (l0 & 0xF) | (((h0 >> 0) & 3) << 4)
        out[..., base + 32 : base + 64] = (l1 & 0xF) | (((h0 >> 2) & 3) << 4)
        out[..., base + 64 : base + 96] = (l0 >> 4) | (((h0 >> 4) & 3) << 4)
        out[..., base + 96 : base + 128] = (l1 >> 4) | (((h0 >> 6) & 3) << 4)
    q = (out - 32).astype(np.int8)
    return "int8", q.reshape(rows, cols), (d[..., None] * sc).reshape(rows, -1), 16


def module_from_blocks(kind: str, raw: np.ndarray, rows: int, cols: int, bias: torch.Tensor | None = None,
                       row_order: np.ndarray | None = None) -> _GroupLinear:
    """A low-bit linear layer [rows, cols] holding one GGUF tensor's blocks (``row_order``: the
    output rows' order in the model, when the converter permuted them, as for Llama's q / k)."""
    decoded = decode_blocks(kind, raw, rows, cols)
    arrays = [decoded[1], decoded[2]] + ([decoded[3]] if decoded[0] == "int4" else [])
    if row_order is not None:
        arrays = [a[row_order] for a in arrays]
    tensors = [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
    if decoded[0] == "int4":
        return GroupInt4Linear(pack_nibbles(tensors[0]), tensors[1].float(), tensors[2].float(), bias)
    return GroupInt8Linear(tensors[0], tensors[1].float(), bias, decoded[3])


# Whole models ------------------------------------------------------------------------------------

#: Bump when the cached low-bit file's layout changes (older files are rebuilt).
CACHE_FORMAT = 1


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


def modules_from_gguf(model: torch.nn.Module, gguf: str | Path, progress: bool = False) -> dict[str, _GroupLinear]:
    """Low-bit modules for ``model``'s linear layers, from the blocks of the GGUF file it was converted
    from: {module name: GroupInt4Linear / GroupInt8Linear}. A tied LM head takes the embedding's blocks.

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
    out: dict[str, _GroupLinear] = {}
    names = _linear_names(model)
    iterator = names
    if progress:
        from tqdm import tqdm

        iterator = tqdm(names, desc=f"reading 4-bit blocks of {Path(gguf).name}", unit="layer", leave=False)
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
        bias = params.get(f"{name}.bias")
        out[name] = module_from_blocks(kind, np.asarray(t.data), rows, cols, bias,
                                       _row_order(plan.processor, t.name, rows))
    return out


def modules_from_float(model: torch.nn.Module, precision: str) -> dict[str, _GroupLinear]:
    """Low-bit modules quantized from ``model``'s float weights ("int4": asymmetric 4-bit groups of
    32; "int8": symmetric int8 groups of 32)."""
    make = GroupInt4Linear.from_float if precision == "int4" else GroupInt8Linear.from_float
    return {name: make(m.weight, m.bias) for name, m in model.named_modules()
            if type(m) is torch.nn.Linear and m.in_features % 32 == 0}  # other layers stay float


def cache_path(converted_dir: str | Path, precision: str) -> Path:
    """Where a converted model's low-bit weights are kept: next to its float copy."""
    return Path(converted_dir) / f"specdecode-{precision}.safetensors"


def save_modules(path: Path, modules: dict[str, _GroupLinear], source: dict) -> None:
    """Write ``modules`` as one safetensors file (atomic rename), with ``source`` in its metadata."""
    import json

    from safetensors.torch import save_file

    tensors, layout = {}, {}
    for name, m in modules.items():
        for part, t in m.state_tensors().items():
            tensors[f"{name}.{part}"] = t.contiguous()
        if m.bias is not None:
            tensors[f"{name}.bias"] = m.bias.contiguous()
        layout[name] = [type(m).__name__, m.group]
    meta = {"format": str(CACHE_FORMAT), "layout": json.dumps(layout), "source": json.dumps(source)}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)


def load_modules(path: Path, source: dict) -> dict[str, _GroupLinear] | None:
    """The modules :func:`save_modules` wrote, memory-mapped; None when missing, stale or unreadable."""
    import json

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
    for name, (kind, group) in layout.items():
        bias = tensors.get(f"{name}.bias")
        if kind == "GroupInt4Linear":
            out[name] = GroupInt4Linear(tensors[f"{name}.qweight"], tensors[f"{name}.scales"],
                                        tensors[f"{name}.offsets"], bias)
        else:
            out[name] = GroupInt8Linear(tensors[f"{name}.qweight"], tensors[f"{name}.scales"], bias, group)
    return out


def install(model: torch.nn.Module, modules: dict[str, _GroupLinear]) -> torch.nn.Module:
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


def load_in_precision(spec: str, precision: str, *, dtype=torch.float32, cache_dir=None, progress: bool = True,
                      say=None):
    """:func:`specdecode.models.load_model` with the weights in ``precision``.

    int4 / int8 of a catalog model whose low-bit weights are cached: built from the cache without
    reading the float copy's linear weights (:func:`load_cached`); otherwise the float model is
    loaded and :func:`quantize_loaded` (which fills the cache). fp32 / bf16: as
    ``kernels.set_weight_precision``.

    Raises:
        ModelLoadError (from load_model), SpecDecodeError (a GGUF tensor without a low-bit layout).
    """
    from specdecode.kernels import WEIGHT_PRECISIONS, set_weight_precision
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
    import json

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
