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


def weight_digest(model: torch.nn.Module) -> str:
    """sha256 (hex) of the weights ``model`` executes: every parameter and buffer (name, dtype, shape, bytes)
    and every low-bit module's blocks (block type and packed bytes), in name order. Two loads with the same
    digest run the same model; the test that every front end loads a spec the same way compares it.
    """
    import hashlib

    digest = hashlib.sha256()
    tensors = dict(model.state_dict(keep_vars=False))
    for name, module in model.named_modules():
        fused = getattr(module, "fused", None)
        if hasattr(module, "state_tensors") and not name.endswith(".fused"):
            rows, kind, bias = module.packed, module.kind, module.bias
        elif fused is not None and hasattr(fused, "packed"):  # q/k/v of a fused low-bit product: its rows
            rows, kind = fused.packed[module.start : module.end], fused.kind
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
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
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
        from specdecode import lowbit

        lowbit.install(model, lowbit.modules_from_float(model, precision))
    return model
