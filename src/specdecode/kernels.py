"""CPU execution choices for the few-row matrix products of decoding and verification.

On this class of CPU torch's ``F.linear`` with 2..16 rows runs 2-4x slower than
with one row (a different GEMM path), while ``W @ x.T`` keeps near the one-row
cost (../shared/MODELS.md). Verification feeds gamma + 1 rows, so this choice
decides whether verifying costs about one decoding step or several.
"""

from __future__ import annotations

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


