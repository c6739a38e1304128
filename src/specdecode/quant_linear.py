"""The low-bit linear layer (:class:`QuantLinear`): a GGUF file's blocks as stored, multiplied by the kernels of
:mod:`specdecode.lowbit_kernels` with activations quantized per row, and the row count above which a
prefill takes the dequantized float product."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from specdecode.errors import SpecDecodeError
from specdecode.kernels import row_product
from specdecode.lowbit_kernels import (GGUF_BLOCKS, Q4K_TILE, TILED, fast_bf16, load_kernel, repack, unpack,
                                       variant_table)


#: Rows above which a prompt's prefill (which need not be row-invariant: plain and speculative decoding
#: prefill alike) dequantizes the weight and runs one many-row float product instead of the kernel.
PREFILL_ROWS = 32

#: The same for models whose low-bit weights exceed :data:`LARGE_MODEL_BYTES` (every real model): the
#: kernel's exact products (longer prompts in pieces of this many rows) beat dequantizing and one float
#: product. Measured 2026-12-04, 2 cores, quiet: the Qwen 1.5B prefilled 150 tokens in 1.7 s against 3.9 s,
#: 1,000 in 7.1 s against 16.1 s; SmolLM2-135M on the 32-weight tiles: 128 tokens 1,059-1,104 tokens/s
#: against 385-388 (bfloat16 product), 400: 914-953 against 658-706, 1,000: 622-652 against 606-614.
#: Tiny test models keep :data:`PREFILL_ROWS`.
PREFILL_ROWS_LARGE = 512
LARGE_MODEL_BYTES = 16 * 2**20


def prefill_rows(model: torch.nn.Module) -> int:
    """Prompt tokens above which ``model``'s prefill takes the dequantized float product."""
    total = sum(m.weight_nbytes() for m in model.modules() if isinstance(m, QuantLinear))
    return PREFILL_ROWS_LARGE if total > LARGE_MODEL_BYTES else PREFILL_ROWS

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
        # lazy: gguf (start-up time)
        import gguf

        w = weight.detach().float().numpy()
        raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])
        return cls(torch.from_numpy(np.ascontiguousarray(raw)), kind, w.shape[1], bias, precision)

    def dequantize(self) -> torch.Tensor:
        """[out, in] float32: the weights these blocks hold (``gguf.dequantize``)."""
        # lazy: gguf (start-up time)
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
    parts differ in block type or row length (then they run one after another). Tiled layouts concatenate as
    they are when every part but the last holds whole tiles of 8 columns (packed rows [8 i, 8 i + 8) are tile
    i, the last rows % 8 follow row by row: the bytes :func:`repack` gives the concatenated file rows), which
    is every real model; a load then repacks nothing (the Qwen pair's q / k / v and gate / up: seconds)."""
    if len({(p.kind, p.in_features) for p in parts}) != 1:
        return None
    biases = None
    if any(p.bias is not None for p in parts):
        biases = torch.cat([p.bias if p.bias is not None else torch.zeros(p.out_features) for p in parts])
    if parts[0].kind in TILED and any(p.out_features % Q4K_TILE for p in parts[:-1]):
        # tiles of 8 columns that a part's last rows would split: concatenate the file's rows and repack them
        return QuantLinear(torch.from_numpy(np.concatenate([p.gguf_raw() for p in parts])), parts[0].kind,
                           parts[0].in_features, biases, parts[0].weight_precision)
    return QuantLinear(torch.cat([p.packed for p in parts]), parts[0].kind, parts[0].in_features, biases,
                       parts[0].weight_precision, packed=True)
