"""The project's own forward for the Llama and Qwen2 families, over the slot KV cache.

Why (DESIGN.md, "Model execution"): on a 2-core CPU the Hugging Face forward
spends much of a decoding step outside the matrix products (Python, masks,
cache concatenation), and torch's few-row ``F.linear`` is several times slower
than the one-row product. This forward

- loads the same weights (fused q/k/v and gate/up *views*: no second copy),
- keeps keys/values in preallocated slot buffers ``[layers, slots, kv_heads, columns, head_dim]``
  (:class:`specdecode.kv.base.SlotRunner`): rollback is a length change, tree and
  ragged-batch masks are boolean masks, the active rows' buffers are views (no copy);
- computes every projection as ``W @ x.T`` (near one-row cost for 1..16 rows),
- runs a subset of the layers for layer-skip drafting.

A test checks its logits against the Hugging Face forward (``tests/test_kv_owned.py``).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from specdecode.kernels import ROW_BLOCK, row_product
from specdecode.lowbit import Q4K_TILE
from specdecode.lowbit import TILED as lowbit_tiled
from specdecode.lowbit import (
    LOWBIT_TYPES,
    PREFILL_ROWS,
    QuantLinear,
    concat as concat_lowbit,
    load_kernel,
    prefill_rows,
    variant_table,
)
from specdecode.kv.base import SlotRunner, causal_mask
from specdecode.kv.draft_vocab import ContextVocabulary, eos_ids
from specdecode.types import SpecDecodeError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")

logger = logging.getLogger(__name__)


def supports(model: torch.nn.Module) -> bool:
    """True if :class:`OwnedRunner` can run ``model`` (Llama / Qwen2, default RoPE, full attention)."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") != "default":
        return False
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", False):
        return False
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        return False  # o_proj / MLP biases are not carried by the owned forward (q/k/v biases are)
    layers = getattr(getattr(model, "model", None), "layers", [])
    linears_ok = all(
        _is_linear(getattr(layer.self_attn, "q_proj", None)) and _is_linear(getattr(layer.mlp, "down_proj", None))
        for layer in layers
    ) and _is_linear(model.get_output_embeddings())
    # every projection float, or every one low-bit (a layer too narrow for 32-weight blocks stays float)
    kinds = {type(getattr(parent, name)) is torch.nn.Linear for layer in layers
             for parent, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                                   (layer.mlp, ("gate_proj", "up_proj", "down_proj"))) for name in names
             if hasattr(parent, name)}
    linears_ok = linears_ok and len(kinds) <= 1
    return linears_ok and getattr(cfg, "hidden_act", "silu") == "silu"


def _is_linear(module) -> bool:
    """nn.Linear, or a low-bit linear (``lowbit.QuantLinear``: GGUF blocks)."""
    return type(module) in (torch.nn.Linear, *LOWBIT_TYPES, _OutputSlice)


class _Layer:
    """One decoder layer's weights: fused views of the model's own parameters (float), or fused low-bit
    modules whose slices replace the model's own q/k/v and gate/up modules (one copy of the weights;
    parts of different kinds, as a GGUF file's Q4_K q / k with a Q6_K v, run one after another)."""

    def __init__(self, layer: torch.nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.ln1 = layer.input_layernorm.weight
        self.ln2 = layer.post_attention_layernorm.weight
        self.qkv_bias = None
        if type(attn.q_proj) is not torch.nn.Linear:  # low-bit modules (bias inside)
            self.qkv = _fuse_lowbit(attn, ("q_proj", "k_proj", "v_proj"))
            self.gate_up = _fuse_lowbit(mlp, ("gate_proj", "up_proj"))
            self.o, self.down = attn.o_proj, mlp.down_proj
            return
        self.qkv = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        if attn.q_proj.bias is not None:
            self.qkv_bias = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
        self.o = attn.o_proj.weight
        self.gate_up = _fuse([mlp.gate_proj, mlp.up_proj])
        self.down = mlp.down_proj.weight


class _OutputSlice(torch.nn.Module):
    """Columns [start, end) of a fused low-bit module's output: what the model's own q/k/v (gate/up)
    modules become once fused, so the Hugging Face forward still runs (at the fused cost) and the
    low-bit weights exist once."""

    def __init__(self, fused: torch.nn.Module, start: int, end: int) -> None:
        super().__init__()
        self.fused, self.start, self.end = fused, start, end

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # q/k/v (gate/up) are called one after another on the same input: compute the fused product once
        memo = self.fused.__dict__.get("_memo")
        if memo is not None and memo[0] is x:
            out = memo[1]
        else:
            out = self.fused(x)
            self.fused.__dict__["_memo"] = (x, out)
        if self.end == self.fused.out_features:  # the last slice: drop the memo (no activations kept alive)
            self.fused.__dict__.pop("_memo", None)
        return out[..., self.start : self.end]


class _Parts:
    """Low-bit modules of different kinds on one input, outputs concatenated (not fused)."""

    def __init__(self, parts: list[torch.nn.Module]) -> None:
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)

    def __call__(self, x: torch.Tensor, exact: bool = True, prompt: bool = False) -> torch.Tensor:
        return torch.cat([p(x, exact=exact, prompt=prompt) for p in self.parts], dim=-1)


def _fuse_lowbit(parent: torch.nn.Module, names: tuple[str, ...]):
    """Fuse ``parent``'s low-bit modules ``names`` into one product and re-point them at slices of it;
    parts of different kinds stay as they are and run one after another."""
    parts = [getattr(parent, n) for n in names]
    if all(isinstance(p, _OutputSlice) for p in parts) and len({id(p.fused) for p in parts}) == 1:
        return parts[0].fused  # fused already (another runner of this model)
    if not all(isinstance(p, LOWBIT_TYPES) for p in parts):
        raise SpecDecodeError(f"cannot fuse {[type(p).__name__ for p in parts]}: expected low-bit linear modules")
    fused = concat_lowbit(parts)
    if fused is None:
        return _Parts(parts)
    start = 0
    for name, part in zip(names, parts):
        setattr(parent, name, _OutputSlice(fused, start, start + part.out_features))
        start += part.out_features
    return fused


def _fuse(linears: list[torch.nn.Linear]) -> torch.Tensor:
    """Concatenate the weights of ``linears`` along the output axis and re-point each layer at a view.

    Afterwards the model's own parameters live inside the fused tensor, so the
    Hugging Face forward and this one share one copy of the weights.
    """
    fused = torch.cat([lin.weight.detach() for lin in linears], dim=0)
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = torch.nn.Parameter(fused[start : start + rows], requires_grad=False)
        start += rows
    return fused


def _mm(weight, x: torch.Tensor, kernel: str | None = None, exact: bool = True, prompt: bool = False) -> torch.Tensor:
    """x [n, in] -> [n, out].

    ``kernel`` (the batch-invariant forward): :func:`specdecode.kernels.row_product` with that kernel.
    Otherwise float32 weights with few rows: ``(W @ x.T).T`` (torch's few-row ``F.linear``
    takes a slow path on these CPUs); bfloat16 / float16 and many rows:
    ``F.linear``. A low-bit module: the module itself (row-invariant by construction; ``exact=False``,
    a prompt's prefill, lets it run one dequantized product for many rows).
    """
    if not isinstance(weight, torch.Tensor):
        return weight(x, exact=exact, prompt=prompt)
    if kernel is not None:
        return row_product(kernel, weight, x)
    if x.shape[0] > 16 or weight.dtype != torch.float32:
        return F.linear(x, weight)
    return (weight @ x.T).T


class OwnedRunner(SlotRunner):
    """Batched incremental forward of a Llama / Qwen2 model over a slot KV cache.

    Args:
        model: a ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` (eval mode); its q/k/v and gate/up
            weights are re-pointed at fused tensors (shared storage), low-bit modules are fused.
        num_slots, max_context: as :class:`~specdecode.kv.base.SlotRunner`.

    Numerics, the batch-invariance contract: with ``batch_invariant`` a token's logits do not depend
    on how many tokens share a decoding / verification forward (one row or k + 1; one request or a
    batch), so speculative output equals plain decoding token for token.

    - Low-bit weights (``lowbit.QuantLinear``: GGUF blocks): every layer runs in the C++ layer loop
      (``csrc/step.cpp`` ``run_fused``): the products quantize each activation row on its own and
      accumulate it in one fixed order, and RMSNorm, RoPE, attention over a float16 key / value
      cache (visible columns in column order) and SiLU are computed row by row: invariant by
      construction, no float64 needed. A prompt runs the same kernel in pieces of
      ``lowbit.prefill_rows(model)`` tokens (512; :attr:`prefill_chunk`); tiny models (tests) prefill
      prompts over 32 tokens with fast float products instead (each row of a batch alone, so a row's
      prefill never depends on the rows beside it).
    - Float weights run :func:`specdecode.kernels.row_product` as zero-padded blocks of exactly
      ``ROW_BLOCK`` rows (one shape, one kernel, one summation order; checked per machine by
      ``precision.check_batch_invariance``; a one-token step then costs a 16-row product), with
      attention in float64 on a float64 cache (rounding ~1e-16, below what a bfloat16 / float32 result
      can show). Prefill (``last_only`` forwards) needs no invariance (plain and speculative decoding
      prefill alike) and runs the fast kernels with attention in the model's dtype.
    (Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025, make GPU kernels
    batch-invariant the same way: one reduction order whatever the batch.)

    Raises:
        SpecDecodeError: the model family / RoPE variant is not supported (use the Hugging Face forward).
    """

    def __init__(self, model: torch.nn.Module, num_slots: int = 1, max_context: int | None = None,
                 batch_invariant: bool | None = None) -> None:
        if not supports(model):
            raise SpecDecodeError(
                f"the owned forward supports {SUPPORTED_MODEL_TYPES} with default RoPE and full attention; "
                f"got {getattr(model.config, 'model_type', type(model).__name__)}: use the Hugging Face forward"
            )
        super().__init__(model, num_slots, max_context)
        cfg = model.config
        inner = model.model
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        head = model.get_output_embeddings()
        self.lm_head = head.weight if type(head) is torch.nn.Linear else head
        # Fused once per model and shared by every runner of it (target, self-draft, plain engine).
        self.layers = model.__dict__.get("_specdecode_fused_layers") or [_Layer(layer) for layer in inner.layers]
        model.__dict__["_specdecode_fused_layers"] = self.layers
        self.num_layers = len(self.layers)
        self.eps = float(cfg.rms_norm_eps)
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        self.dtype = self.embed.dtype
        # float32 like the Hugging Face rotary embedding, so both forwards rotate identically
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim))
        lowbit = any(not isinstance(l.qkv, torch.Tensor) for l in self.layers)  # GGUF-block modules
        asked_fast = batch_invariant is False  # teacher forcing: invariance not needed
        if batch_invariant is None:
            batch_invariant = default_batch_invariant(model)
        self.batch_invariant = bool(batch_invariant or lowbit)
        self.lowbit = lowbit
        #: low-bit products of many rows in a full forward take the fast dequantized product unless the
        #: caller asked for invariance (the engine's default); ``batch_invariant=False`` (teacher forcing)
        #: gets the fast one
        self._exact_products = not asked_fast
        # float16 keys / values for low-bit weights (attention row by row in C, fixed order: no float64 needed)
        self.cache_dtype = torch.float16 if lowbit else torch.float64 if self.batch_invariant else self.dtype
        self._table = 0  # the low-bit kernel table the C++ layer loop calls (set when it is built)
        #: The product kernel of float weights in decoding / verification forwards
        #: (``kernels.row_product``; None: int8 modules, row-invariant themselves, or not invariant).
        self.row_kernel = "padded" if batch_invariant and not lowbit else None
        self.k_cache = self.v_cache = None
        self._native = None  # the layer loop in C++ (built on first use; False: unavailable)
        self._native_head, self._native_head_ok = None, False  # (C++ loop, output layer) it holds, and whether
        #: prompt tokens above which a low-bit prefill takes the dequantized float products
        self.prefill_rows = prefill_rows(model) if lowbit else 32
        # longer prompts in pieces through the kernel (a model whose prefill_rows are large: the kernel wins)
        self.prefill_chunk = self.prefill_rows if lowbit and self.prefill_rows > PREFILL_ROWS else None
        for m in model.modules():
            if isinstance(m, QuantLinear):
                m.prefill_rows = self.prefill_rows
        self._vocab_rows: int | None = None  # limit_vocabulary
        self._context_vocab: ContextVocabulary | None = None
        self._full_head = self.lm_head
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [positions, d] float32

    #: This forward can run a subset of the layers (layer-skip drafting) and limit its vocabulary (a draft's).
    skips_layers = limits_vocabulary = causal_from_columns = True

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().out_features)

    @property
    def nbytes(self) -> int:
        if self.k_cache is None:
            return 0
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    def layer_tensors(self, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys, values) per layer of ``slot``, each [1, kv_heads, length, head_dim]."""
        n = len(self.ids[slot])
        return [(self.k_cache[i, slot : slot + 1, :, :n], self.v_cache[i, slot : slot + 1, :, :n])
                for i in range(self.num_layers)]

    # Storage -----------------------------------------------------------------------

    def _grow(self, capacity: int) -> None:
        shape = (self.num_layers, self.num_slots, self.num_kv_heads, capacity, self.head_dim)
        old_k, old_v = self.k_cache, self.v_cache
        self.k_cache = torch.zeros(shape, dtype=self.cache_dtype)
        self.v_cache = torch.zeros(shape, dtype=self.cache_dtype)
        if old_k is not None:
            n = old_k.shape[3]
            self.k_cache[:, :, :, :n] = old_k
            self.v_cache[:, :, :, :n] = old_v

    def _copy_columns(self, slot: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        for cache in (self.k_cache, self.v_cache):
            cache[:, slot, :, dst] = cache[:, slot, :, src]

    def _move_slot(self, src: int, dst: int, n: int) -> None:
        for cache in (self.k_cache, self.v_cache):
            cache[:, dst, :, :n] = cache[:, src, :, :n]

    def _free(self) -> None:
        self.k_cache = self.v_cache = None

    # Forward -----------------------------------------------------------------------

    def _run(self, rows, ids, positions, columns, mask, kv_len, layers, last):
        b, q = ids.shape
        n = b * q
        if mask is None and n > 1:  # chains (causal_from_columns): built here for the paths that read a mask
            mask = _LazyCausal(columns, kv_len)
        if self.lowbit and last is not None and b > 1 and n > self.prefill_rows:
            return self._prefill_rows_alone(rows, ids, positions, columns, _tensor(mask), layers, last)
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = self._rope(positions.reshape(-1))  # [n, d]
        x = self.embed[ids.reshape(-1)]  # [n, hidden]
        row_index = torch.arange(b).unsqueeze(1)  # [b, 1]
        start = int(columns[0, 0]) if b == 1 else None
        exact = self.batch_invariant and last is None  # decoding / verification (not prefill, not drafting)
        kernel = self.row_kernel if exact else None
        exact = exact and self._exact_products
        prompt = last is not None  # a prompt's prefill (or drafting): low-bit many-row products may run in bf16
        # a prompt-sized last_only forward attends in the model's dtype (its cache columns converted once per
        # layer); small ones (drafting) read the cache as it is
        att_dtype = x.dtype if last is not None and n > ROW_BLOCK else self.cache_dtype
        prefill = last is not None and n > self.prefill_rows  # a long prompt: float products, not row-invariant
        if self.lowbit:  # float16 cache; the Python loop attends in float64 (exact) but for a prompt
            att_dtype = torch.float32 if prefill else torch.float64
        capture = self.capture_layers if layers is None else None  # a draft head's features (full forwards)
        head = False  # the output layer inside the C++ loop's region (below)
        kept = {0: x} if capture and 0 in capture else {}
        if self.lowbit:  # the C++ layer loop, but for a prompt (the Python loop's fast float products)
            native = None if prefill else self._native_stack()
        else:
            native = self._native_stack() if layers is None and not capture else None
        if native is not None and self.lowbit:  # every layer in C++, row-invariant by construction
            order = list(range(self.num_layers)) if layers is None else list(layers)
            wanted = sorted(set(capture or ()))
            head = last is None and layers is None and self._native_head_ready(native)
            outs = native.run_fused(x, cos.float(), sin.float(), self.k_cache, self.v_cache, rows.start or 0,
                                    columns.contiguous(), None if isinstance(mask, _LazyCausal) else mask, kv_len,
                                    self._table, order, wanted, head)  # (None: causal by column, in C++)
            if head:  # the final norm and the output layer ran in the same parallel region
                *outs, hidden, logits = outs
            x = outs[0]
            met = [a for a in [0] + [i + 1 for i in order] if a in wanted]
            kept = dict(zip(met, outs[1:]))
        if not (native is not None and self.lowbit):  # the mask as a tensor where it is read
            mask = _tensor(mask)
            attn_mask = None if mask is None else mask.unsqueeze(1)  # [b, 1, q, kv_len]
        if native is not None and not self.lowbit:  # the same operations as the loop below, in one C++ call
            x = native.run(x, cos, sin, self.k_cache, self.v_cache, rows.start or 0, rows.stop, columns,
                           -1 if start is None else start, attn_mask, kv_len, att_dtype == self.cache_dtype,
                           kernel == "padded")
        for i in () if native is not None else range(self.num_layers) if layers is None else layers:
            layer = self.layers[i]
            qkv = _mm(layer.qkv, _rms_norm(x, layer.ln1, self.eps), kernel, exact, prompt)
            if layer.qkv_bias is not None:
                qkv = qkv + layer.qkv_bias
            qs, ks, vs = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
            qs = _apply_rope(qs.view(n, h, d).transpose(0, 1), cos, sin)  # [h, n, d]
            ks = _apply_rope(ks.view(n, kvh, d).transpose(0, 1), cos, sin)  # [kvh, n, d]
            k_rows = self.k_cache[i, rows]  # [b, kvh, columns, d] view of the active slots
            v_rows = self.v_cache[i, rows]
            if start is not None:  # one row: its columns are one slice (no scatter)
                k_rows[0, :, start : start + q] = ks
                v_rows[0, :, start : start + q] = vs.view(n, kvh, d).transpose(0, 1)
                queries = qs.unsqueeze(0)
            else:
                k_rows[row_index, :, columns] = ks.reshape(kvh, b, q, d).permute(1, 2, 0, 3).to(self.cache_dtype)
                v_rows[row_index, :, columns] = vs.reshape(b, q, kvh, d).to(self.cache_dtype)
                queries = qs.reshape(h, b, q, d).transpose(0, 1)
            attn = F.scaled_dot_product_attention(
                queries.to(att_dtype),  # [b, h, q, d]
                k_rows[:, :, :kv_len].to(att_dtype),
                v_rows[:, :, :kv_len].to(att_dtype),
                attn_mask=attn_mask,
                enable_gqa=h != kvh,
            ).to(x.dtype)
            x = x + _mm(layer.o, attn.transpose(1, 2).reshape(n, h * d), kernel, exact, prompt)
            gate, up = _mm(layer.gate_up, _rms_norm(x, layer.ln2, self.eps), kernel, exact, prompt).chunk(2, dim=-1)
            x = x + _mm(layer.down, F.silu(gate) * up, kernel, exact, prompt)
            if capture and i + 1 in capture:
                kept[i + 1] = x
        if capture:
            if self.num_layers in capture:  # Hugging Face's last hidden state is the final norm's output
                kept[self.num_layers] = _rms_norm(kept[self.num_layers], self.norm, self.eps)
            self.last_features = torch.cat([kept[k] for k in capture], dim=-1).view(b, q, -1)
        x = x.view(b, q, -1)
        if head:
            logits = logits.view(b, q, -1)
        else:
            if last is not None:
                x = x[torch.arange(b), last].unsqueeze(1)  # [b, 1, hidden]
            hidden = _rms_norm(x.reshape(-1, x.shape[-1]), self.norm, self.eps)
            logits = _mm(self.lm_head, hidden, kernel, exact, prompt).float().view(b, x.shape[1], -1)
        if self._vocab_rows is None:
            return logits
        full = logits.new_full((b, x.shape[1], self.vocab_size), float("-inf"))
        full[..., : self._vocab_rows] = logits
        self._context_vocab.score(full, hidden.view(b, x.shape[1], -1), range(rows.start or 0, (rows.start or 0) + b),
                                  self.ids.__getitem__, ids.tolist())
        return full

    def limit_vocabulary(self, tokens: int) -> None:
        """Score only token ids below ``tokens`` plus, per row, the ids its own context holds and the
        end-of-sequence ids: the output layer's first ``tokens`` rows are read, and the few context ids past
        them (a prompt's identifiers, which a draft copies) from their dequantized rows; every other id gets
        a -inf logit (probability 0). For a draft: byte-level BPE vocabularies put frequent tokens at low
        ids, and a draft's output layer is a large share of its step (the Qwen2.5 0.5B's 151,936 x 896 rows
        are a third of its bytes). Lossless: the target verifies whatever is drafted, and a sampled draft
        reports q = 0 outside (EAGLE-2 / EAGLE-3's draft vocabulary, Li et al. 2024/2025). A row's set
        depends on its own tokens only, never on the rows beside it.

        Raises:
            SpecDecodeError: ``tokens`` outside 1..vocabulary size.
        """
        if not 1 <= tokens <= self.vocab_size:
            raise SpecDecodeError(f"a draft vocabulary of {tokens} tokens: give 1..{self.vocab_size}")
        head = self._full_head
        if tokens == self.vocab_size:
            self.lm_head = head
        elif isinstance(head, QuantLinear):
            bias = None if head.bias is None else head.bias[:tokens]
            if head.kind in lowbit_tiled and tokens % Q4K_TILE:  # a tile of 8 columns cut: the file's rows, repacked
                self.lm_head = QuantLinear(torch.from_numpy(head.gguf_raw()[:tokens]), head.kind, head.in_features,
                                           bias, head.weight_precision)
            else:
                self.lm_head = QuantLinear(head.packed[:tokens], head.kind, head.in_features, bias,
                                           head.weight_precision, packed=True)
        else:
            self.lm_head = head[:tokens]
        self._vocab_rows = tokens if tokens < self.vocab_size else None
        self._context_vocab = ContextVocabulary(head, tokens, {t for t in eos_ids(self.model)
                                                              if tokens <= t < self.vocab_size})

    def _prefill_rows_alone(self, rows, ids, positions, columns, mask, layers, last):
        """A low-bit batch's prompts prefilled one row at a time, each with its own token count: a long
        prompt's fast float products are not row-invariant, so a row's prefill must not depend on the
        rows beside it (plain decoding prefills it alone)."""
        b, q = ids.shape
        first = rows.start or 0
        logits, features = [], []
        for i in range(b):
            c = int(last[i]) + 1
            kv_len = int(columns[i, :c].max()) + 1
            m = None if mask is None else mask[i : i + 1, :c, :kv_len]
            logits.append(self._run(slice(first + i, first + i + 1), ids[i : i + 1, :c], positions[i : i + 1, :c],
                                    columns[i : i + 1, :c], m, kv_len, layers, last[i : i + 1]))
            if self.capture_layers and layers is None:
                f = self.last_features
                features.append(torch.cat([f, f.new_zeros(1, q - c, f.shape[-1])], dim=1))
        if features:
            self.last_features = torch.cat(features)
        return torch.cat(logits)

    def _native_stack(self):
        """The C++ layer loop (``csrc/step.cpp``) over this runner's weights, or None: the extension did
        not build, ``SPECDECODE_NATIVE_STEP=0``, or a product this loop does not know."""
        if self._native is None:
            self._native = _build_native(self) or False
        return self._native or None

    def _native_head_ready(self, native) -> bool:
        """Whether ``native`` runs the final norm and the current output layer (GGUF blocks) in run_fused's
        region, handing it the output layer when it changed (:meth:`limit_vocabulary`)."""
        if self._native_head != (native, self.lm_head):
            parts = _native_parts(self.lm_head, self._table) if isinstance(self.lm_head, QuantLinear) else None
            ok = parts is not None
            if ok:
                try:
                    native.set_head(self.norm.float().contiguous(), parts)
                except RuntimeError as exc:  # a layout the loop refuses: the Python norm and product run it
                    logger.info("the output layer runs outside the C++ loop: %s", exc)
                    ok = False
            self._native_head, self._native_head_ok = (native, self.lm_head), ok
        return self._native_head_ok

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin [n, d] of ``positions`` [n], read from a table computed once per runner: a position's
        values never depend on which positions share the call (a vectorised cos may round an element in a
        vector body and in a scalar tail differently)."""
        need = int(positions.max()) + 1 if positions.numel() else 1
        if self._rope_table is None or self._rope_table[0].shape[0] < need:
            size = max(need, 256, 2 * (0 if self._rope_table is None else self._rope_table[0].shape[0]))
            freqs = torch.arange(size).float()[:, None] * self.inv_freq[None, :]  # [size, d/2] float32
            emb = torch.cat([freqs, freqs], dim=-1)
            if self._rope_table is not None:  # the rows already handed out keep their bits
                old = self._rope_table[0].shape[0]
                cos, sin = emb.cos(), emb.sin()
                cos[:old], sin[:old] = self._rope_table
                self._rope_table = (cos, sin)
            else:
                self._rope_table = (emb.cos(), emb.sin())
        cos, sin = self._rope_table
        return cos[positions].to(self.dtype), sin[positions].to(self.dtype)


class _LazyCausal:
    """A chain forward's mask, :func:`specdecode.kv.base.causal_mask`, not built yet (the C++ loop derives it)."""

    __slots__ = ("columns", "kv_len")

    def __init__(self, columns: torch.Tensor, kv_len: int) -> None:
        self.columns, self.kv_len = columns, kv_len


def _tensor(mask):
    """``mask`` as a [b, q, kv_len] bool tensor (or None)."""
    return causal_mask(mask.columns, mask.kv_len) if isinstance(mask, _LazyCausal) else mask


def _native_parts(weight, table: int) -> list[tuple] | None:
    """A product's parts as the C++ loop takes them: (kind, weight, fmt, in_features, table, bias)."""
    if isinstance(weight, torch.Tensor):
        return [(0, weight, 0, 0, 0, None)]
    if isinstance(weight, _Parts):
        parts = [_native_parts(p, table) for p in weight.parts]
        return None if any(p is None for p in parts) else [x for p in parts for x in p]
    if isinstance(weight, QuantLinear) and table:
        return [(1, weight.packed, weight.fmt, weight.in_features, table, weight.bias)]
    return None


def _build_native(runner: OwnedRunner):
    if os.environ.get("SPECDECODE_NATIVE_STEP", "1") == "0":
        return None
    kernel = load_kernel()
    if kernel is None or not hasattr(kernel, "LayerStack"):
        return None
    table = variant_table() if runner.lowbit else 0
    if runner.lowbit and not table:
        return None
    runner._table = table
    stack = kernel.LayerStack(runner.num_heads, runner.num_kv_heads, runner.head_dim, runner.eps)
    for layer in runner.layers:
        products = [_native_parts(w, table) for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if any(p is None for p in products):
            return None
        stack.add_layer(layer.ln1, layer.ln2, layer.qkv_bias, products)
    return stack


def default_batch_invariant(model: torch.nn.Module) -> bool:
    """Whether runners of ``model`` are batch-invariant by default: int8 (always), bfloat16 / float16
    weights (the invariant forward is what keeps them exact, see :class:`OwnedRunner`) unless
    ``model.config.specdecode_batch_invariant`` says otherwise; float32 not (its few-row products
    would have to run as 16-row blocks, the slow path on most CPUs: float32 stays exact up to
    near-ties only)."""
    flag = getattr(getattr(model, "config", None), "specdecode_batch_invariant", None)
    if flag is not None:
        return bool(flag)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return dtype in (torch.bfloat16, torch.float16)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()  # float32 statistics, as the Hugging Face RMSNorm (also for float64 models)
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * out.to(x.dtype)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [heads, n, d] by position (the rotate-half convention of Llama / Qwen2)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
