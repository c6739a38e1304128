"""CPU execution choices for the few-row matrix products of decoding and verification.

On this class of CPU torch's ``F.linear`` with 2..16 rows runs 2-4x slower than
with one row (a different GEMM path), while ``W @ x.T`` keeps near the one-row
cost (../shared/MODELS.md). Verification feeds gamma + 1 rows, so this choice
decides whether verifying costs about one decoding step or several.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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


#: Weight precisions a model can be executed in (``--weights``).
WEIGHT_PRECISIONS = ("fp32", "bf16", "int8")


def set_weight_precision(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    """Execute ``model``'s weights in ``precision``, in place; returns the model.

    - ``fp32``: unchanged (float32).
    - ``bf16``: parameters cast to bfloat16 (slower than float32 on AVX2 CPUs; for memory).
    - ``int8``: every ``nn.Linear`` (the LM head included) becomes fbgemm's
      dynamic-quantized linear: int8 weights per output channel, activations
      quantized per call. On this CPU it moves 4x fewer bytes than float32 and
      1..16 rows cost about what one row costs, so verification is nearly free.
      Embeddings and norms stay float32.

    Use int8 for drafts only: a draft's precision changes speed, never the output
    distribution. fbgemm quantizes activations per tensor, so an int8 *target*'s
    logits for one row depend on the other rows verified with it, and speculative
    output would drift from plain decoding (``generator`` refuses it).

    Raises:
        ValueError: unknown precision.
    """
    if precision not in WEIGHT_PRECISIONS:
        raise ValueError(f"unknown weight precision {precision!r}; choose one of {', '.join(WEIGHT_PRECISIONS)}")
    if precision == "bf16":
        return model.to(torch.bfloat16)
    if precision == "int8":
        import warnings

        from torch.ao.quantization import quantize_dynamic

        model.float()  # fbgemm quantizes from float32 weights (a bfloat16-loaded model is upcast first)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notice
            quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
    return model
