"""CPU execution choices for the few-row matrix products of decoding and verification.

On this class of CPU torch's ``F.linear`` with 2..16 rows runs 2-4x slower than
with one row (a different GEMM path), while ``W @ x.T`` keeps near the one-row
cost (../shared/MODELS.md). Verification feeds gamma + 1 rows, so this choice
decides whether verifying costs about one decoding step or several.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from specdecode.options import WEIGHT_PRECISIONS  # the one copy (``--weights``), re-exported here

#: Inputs with at most this many rows use the transposed product.
SMALL_ROWS = 16


def _small_row_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if rows > SMALL_ROWS:
        return F.linear(x, self.weight, self.bias)
    out = (self.weight @ x.reshape(rows, -1).T).T  # [rows, out_features]
    if self.bias is not None:
        out = out + self.bias
    return out.reshape(*x.shape[:-1], self.weight.shape[0])


def use_small_row_matmul(model: torch.nn.Module) -> int:
    """Route every ``nn.Linear`` of ``model`` through ``W @ x.T`` for <= SMALL_ROWS rows.

    Applies to the model in place (weights are shared, nothing is copied) and
    is idempotent. Greedy outputs may differ from the unpatched model only at
    near-ties (a different summation order); speculative and plain decoding
    run the same patched model, so comparisons stay like for like.

    Returns:
        The number of linear layers patched.
    """
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and "forward" not in module.__dict__:
            module.forward = _small_row_linear.__get__(module)
            count += 1
    return count


#: Rows per product in the batch-invariant forward: a call of more rows runs as blocks of this many.
ROW_BLOCK = 16

#: Product kernels of :func:`row_product`; only ``padded`` is row-invariant on every CPU.
ROW_KERNELS = ("linear", "transposed", "padded")


def row_product(kernel: str, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x [m, in] @ weight[out, in].T -> [m, out] with ``kernel``, in blocks of at most ROW_BLOCK rows.

    ``padded`` (what the batch-invariant forward runs): every block padded with zero rows to exactly
    ROW_BLOCK rows, so every call has one shape, hence one kernel and one summation order: row i's
    result does not depend on how many rows share the call (by construction for the kernels of this
    class of CPU, and checked on the machine at hand by ``precision.check_batch_invariance``). ``linear`` (``F.linear`` per
    block) and ``transposed`` (``(W @ x.T).T``) are the fast paths, for comparison: on this class of
    CPU a one-row bf16 ``F.linear`` differs from the same row in a multi-row call on rare inputs
    (about one row in 10^3-10^4 for small shapes; no finite probe rules that out), so exactness never
    relies on them.
    """
    m = x.shape[0]
    if m > ROW_BLOCK:
        return torch.cat([row_product(kernel, weight, x[i : i + ROW_BLOCK]) for i in range(0, m, ROW_BLOCK)])
    if kernel == "linear":
        return F.linear(x, weight)
    if kernel == "transposed":
        return (weight @ x.T).T
    if m < ROW_BLOCK:
        x = torch.cat([x, x.new_zeros(ROW_BLOCK - m, x.shape[1])])
    return F.linear(x, weight)[:m]


class RowwiseInt8Linear(torch.nn.Module):
    """A linear layer with int8 weights whose output rows do not depend on each other.

    Weights: symmetric int8 per output channel (scale = max |w| / 127), packed for
    fbgemm (``torch.ops.quantized.linear_dynamic``). Activations: quantized per *row*
    (per token). fbgemm's dynamic linear picks one activation scale per call from the
    whole input's range, so verifying k tokens together would change every token's
    logits (a verification of k+1 rows must give each row exactly what a one-row step
    gives, or speculative output drifts from plain decoding). Here each row is divided
    by its own max |x| and two pin columns holding +1 and -1 are appended (their weights
    are zero, so they add exactly nothing), so the range fbgemm sees is always exactly
    [-1, 1]: one fixed quantization for every row, whatever its neighbours, with integer
    accumulation (exact) and an elementwise rescale by the row's max afterwards. Row i of
    a k-row call equals a one-row call on row i, bit for bit (tested), and per-token scales
    are also more accurate than one per tensor (per-token activations as in ZeroQuant, Yao
    et al. 2022; per-channel weights as in LLM.int8(), Dettmers et al. 2022). Activations
    use fbgemm's ``reduce_range`` (7 bits: steps of 1/63.5 of the row's max), safe on CPUs
    without VNNI. The exactness relies on fbgemm choosing the activation scale from the
    input's min / max (the x86 / fbgemm quantized engine, torch's default on x86).

    Args:
        weight: [out_features, in_features] float tensor (any float dtype; quantized from float32).
        bias: [out_features] or None (kept in float32, added after the int8 product).

    Input: [..., in_features] float tensor; output: [..., out_features] float32.

    Raises:
        RuntimeError: a NaN in the input (fbgemm cannot choose a range).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        w = weight.detach().float()
        self.out_features, self.in_features = w.shape
        w = torch.cat([w, torch.zeros(self.out_features, 2)], dim=1)  # weights of the two pin columns
        scales = (w.abs().amax(dim=1) / 127.0).double().clamp_min(1e-12)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's deprecation notice for quantized tensor constructors
            q = torch.quantize_per_channel(w, scales, torch.zeros(len(scales), dtype=torch.long), 0, torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(q, None)
        self.bias = None if bias is None else bias.detach().float().clone()
        self._pins = torch.tensor([[1.0, -1.0]])

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> "RowwiseInt8Linear":
        """Quantize an ``nn.Linear`` (its float weights are not kept)."""
        return cls(linear.weight, linear.bias)

    @classmethod
    def concat(cls, parts: list["RowwiseInt8Linear"]) -> "RowwiseInt8Linear":
        """One module computing ``torch.cat([p(x) for p in parts], -1)`` in a single product.

        Stacks the parts' int8 weights and per-channel scales as they are (no requantization),
        so its outputs equal the parts' outputs exactly.

        Raises:
            ValueError: no parts, or parts with different ``in_features``.
        """
        if not parts or len({p.in_features for p in parts}) != 1:
            raise ValueError("concat needs at least one part, all with the same in_features")
        qs = [p.int8_weight() for p in parts]
        fused = cls.__new__(cls)
        torch.nn.Module.__init__(fused)
        fused.in_features = parts[0].in_features
        fused.out_features = sum(p.out_features for p in parts)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scales = torch.cat([q.q_per_channel_scales() for q in qs])
            ints = torch.cat([q.int_repr() for q in qs])
            q = torch._make_per_channel_quantized_tensor(ints, scales, torch.zeros(len(scales), dtype=torch.long), 0)
            fused._packed = torch.ops.quantized.linear_prepack(q, None)
        biases = [p.bias if p.bias is not None else torch.zeros(p.out_features) for p in parts]
        fused.bias = None if all(p.bias is None for p in parts) else torch.cat(biases)
        fused._pins = parts[0]._pins
        return fused

    def int8_weight(self) -> torch.Tensor:
        """The [out_features, in_features + 2] per-channel qint8 weight (the last two columns: pins, zero)."""
        return torch.ops.quantized.linear_unpack(self._packed)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        peak = rows.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
        pinned = torch.cat([rows / peak, self._pins.expand(rows.shape[0], 2)], dim=1)
        out = torch.ops.quantized.linear_dynamic(pinned, self._packed, True) * peak
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel, per-row input"


def set_weight_precision(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    """Execute ``model``'s weights in ``precision``, in place; returns the model.

    - ``fp32``: unchanged (float32).
    - ``bf16``: parameters cast to bfloat16 (AVX512-BF16 CPUs run few-row products at
      about the one-row cost; half the bytes of float32).
    - ``int8``: every ``nn.Linear`` (the LM head included) becomes a
      :class:`RowwiseInt8Linear`: int8 weights per output channel through fbgemm,
      activations quantized per token. A quarter of float32's bytes, and a row's output
      does not depend on the rows verified with it. With the project's own forward
      (``kv.owned.OwnedRunner``, which also runs attention in float64 for int8
      models) an int8 *target* stays lossless: speculative == plain decoding of the same
      int8 model. The Hugging Face forward runs float32 attention, whose rounding depends
      on the number of rows, and 7-bit activations amplify that: there, outputs can leave
      plain decoding's path. Embeddings and norms stay float32.

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
    if precision == "int8":
        model.float()  # activations run in float32 (a bfloat16-loaded model is upcast first)
        linears = [(name, m) for name, m in model.named_modules() if type(m) is torch.nn.Linear]
        for name, linear in linears:
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attr, RowwiseInt8Linear.from_linear(linear))
    return model
