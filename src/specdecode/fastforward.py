"""A forward owned by the project for the Llama and Qwen2 families, with a static KV cache.

Why (DESIGN.md, "Model execution"): on a 2-core CPU the Hugging Face forward
spends much of a decoding step outside the matrix products (Python, masks,
cache concatenation), and torch's few-row ``F.linear`` is several times slower
than the one-row product. This forward

- loads the same weights (fused q/k/v and gate/up *views*: no second copy),
- keeps keys/values in a preallocated position-indexed cache, so rollback is
  setting a length (no copy) and tree / ancestor masks are plain boolean masks,
- computes every projection as ``W @ x.T`` (near one-row cost for 1..16 rows),
- computes the LM head only for the positions whose logits are needed.

It exposes the same interface as :class:`specdecode.cache.CachedModel`, and a
test checks its logits against the Hugging Face forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from specdecode.cache import CachedTokens, check_rollback, checked_tree_path, model_context
from specdecode.kernels import RowwiseInt8Linear
from specdecode.tree import as_parent_list, node_depths, tree_attention_mask
from specdecode.types import SpecDecodeError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


def supports(model: torch.nn.Module) -> bool:
    """True if :class:`OwnedCachedModel` can run ``model`` (Llama / Qwen2, default RoPE, full attention)."""
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
    linears_ok = all(
        _is_linear(getattr(layer.self_attn, "q_proj", None)) and _is_linear(getattr(layer.mlp, "down_proj", None))
        for layer in getattr(getattr(model, "model", None), "layers", [])
    ) and _is_linear(model.get_output_embeddings())
    return linears_ok and getattr(cfg, "hidden_act", "silu") == "silu"


def _is_linear(module) -> bool:
    """nn.Linear, or an int8 linear (``kernels.set_weight_precision(model, "int8")``)."""
    return type(module) in (torch.nn.Linear, RowwiseInt8Linear, _OutputSlice)


#: Cache slots allowed past the context: a token tree's pending nodes (positions stay inside the context).
SCRATCH_SLOTS = 256

#: Forward backends: "auto" (owned when the model is supported, else Hugging Face), "hf", "owned".
FORWARD_BACKENDS = ("auto", "hf", "owned")


def make_runner(model: torch.nn.Module, backend: str = "auto"):
    """A model bound to its KV cache: :class:`OwnedCachedModel` or :class:`~specdecode.cache.CachedModel`.

    Raises:
        SpecDecodeError: unknown backend, or "owned" for a model it cannot run.
    """
    if backend not in FORWARD_BACKENDS:
        raise SpecDecodeError(f"unknown forward backend {backend!r}; choose one of {FORWARD_BACKENDS}")
    if backend == "owned" or (backend == "auto" and supports(model)):
        return OwnedCachedModel(model)
    from specdecode.cache import CachedModel

    return CachedModel(model)


class _Layer:
    """One decoder layer's weights: fused views of the model's own parameters (float), or fused int8 modules
    whose slices replace the model's own q/k/v and gate/up modules (one copy of the int8 weights)."""

    def __init__(self, layer: torch.nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.ln1 = layer.input_layernorm.weight
        self.ln2 = layer.post_attention_layernorm.weight
        self.qkv_bias = None
        if type(attn.q_proj) is not torch.nn.Linear:  # int8 modules (bias inside)
            self.qkv = _fuse_int8(attn, ("q_proj", "k_proj", "v_proj"))
            self.gate_up = _fuse_int8(mlp, ("gate_proj", "up_proj"))
            self.o, self.down = attn.o_proj, mlp.down_proj
            return
        self.qkv = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        if attn.q_proj.bias is not None:
            self.qkv_bias = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
        self.o = attn.o_proj.weight
        self.gate_up = _fuse([mlp.gate_proj, mlp.up_proj])
        self.down = mlp.down_proj.weight


class _OutputSlice(torch.nn.Module):
    """Columns [start, end) of a fused int8 module's output: what the model's own q/k/v (gate/up)
    modules become once fused, so the Hugging Face forward still runs (at the fused cost) and the
    int8 weights exist once."""

    def __init__(self, fused: RowwiseInt8Linear, start: int, end: int) -> None:
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


def _fuse_int8(parent: torch.nn.Module, names: tuple[str, ...]) -> RowwiseInt8Linear:
    """Fuse ``parent``'s int8 modules ``names`` into one product; re-point them at slices of it."""
    parts = [getattr(parent, n) for n in names]
    if all(isinstance(p, _OutputSlice) for p in parts) and len({id(p.fused) for p in parts}) == 1:
        return parts[0].fused  # fused already (another runner of this model)
    if not all(isinstance(p, RowwiseInt8Linear) for p in parts):
        raise SpecDecodeError(f"cannot fuse {[type(p).__name__ for p in parts]}: expected int8 linear modules")
    fused = RowwiseInt8Linear.concat(parts)
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


def _mm(weight, x: torch.Tensor) -> torch.Tensor:
    """x [n, in] -> [n, out].

    float32 weights with few rows: ``(W @ x.T).T`` (torch's few-row ``F.linear``
    takes a slow path on these CPUs); bfloat16 / float16 and many rows:
    ``F.linear``; a quantized module: the module itself.
    """
    if not isinstance(weight, torch.Tensor):
        return weight(x)
    if x.shape[0] > 16 or weight.dtype != torch.float32:
        return F.linear(x, weight)
    return (weight @ x.T).T


class OwnedCachedModel(CachedTokens):
    """Incremental forward of a Llama / Qwen2 model with a preallocated KV cache.

    Args:
        model: a ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` (eval mode); its
            q/k/v and gate/up weights are re-pointed at fused tensors (shared storage).
        capacity: initial cache length in tokens (grows by doubling).

    Raises:
        SpecDecodeError: the model family / RoPE variant is not supported (use CachedModel).
    """

    def __init__(self, model: torch.nn.Module, capacity: int = 512) -> None:
        if not supports(model):
            raise SpecDecodeError(
                f"the owned forward supports {SUPPORTED_MODEL_TYPES} with default RoPE; "
                f"got {getattr(model.config, 'model_type', type(model).__name__)}: use the Hugging Face forward"
            )
        cfg = model.config
        self.model = model
        inner = model.model
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        head = model.get_output_embeddings()
        self.lm_head = head.weight if type(head) is torch.nn.Linear else head
        # Fused once per model and shared by every runner of it (a self-draft, plain and speculative engines).
        self.layers = model.__dict__.get("_specdecode_fused_layers") or [_Layer(layer) for layer in inner.layers]
        model.__dict__["_specdecode_fused_layers"] = self.layers
        self.eps = float(cfg.rms_norm_eps)
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        dtype = self.embed.dtype
        # float32 like the Hugging Face rotary embedding, so both forwards rotate identically
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim))
        self.dtype = dtype
        # int8 weights: the products are exact integer sums, so a verified row equals a decoded row
        # if the float parts do too. Attention is the one float part whose rounding depends on the
        # number of query rows (SDPA blocks keys by query length); float64 attention with a float64
        # cache makes that rounding ~1e-16, below what a float32 result can show.
        self.cache_dtype = torch.float64 if any(isinstance(l.qkv, RowwiseInt8Linear) for l in self.layers) \
            else dtype
        self.max_context = model_context(model)
        self._capacity = min(capacity, self.max_context)
        self.cached_ids: list[int] = []
        self._tree_start: int | None = None  # prefix length while tree nodes are pending (forward_tree)
        self._tree_parents: list[int] = []
        self._alloc(self._capacity)

    # Cache -------------------------------------------------------------------------

    def _alloc(self, capacity: int) -> None:
        shape = (len(self.layers), self.num_kv_heads, capacity, self.head_dim)
        old_k, old_v = getattr(self, "k_cache", None), getattr(self, "v_cache", None)
        self.k_cache = torch.zeros(shape, dtype=self.cache_dtype)
        self.v_cache = torch.zeros(shape, dtype=self.cache_dtype)
        if old_k is not None:
            n = old_k.shape[2]
            self.k_cache[:, :, :n] = old_k
            self.v_cache[:, :, :n] = old_v
        self._capacity = capacity

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().out_features)

    def reset(self) -> None:
        self.cached_ids = []
        self._tree_start, self._tree_parents = None, []

    def rollback(self, length: int) -> None:
        """Keep the first ``length`` cached tokens (O(1): positions past it are overwritten later)."""
        check_rollback(length, self.num_cached, self._tree_start)
        self._tree_start, self._tree_parents = None, []  # a pending tree is dropped
        del self.cached_ids[length:]

    def layer_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys, values) per layer, each [1, kv_heads, num_cached, head_dim]."""
        n = self.num_cached
        return [(self.k_cache[i, :, :n].unsqueeze(0), self.v_cache[i, :, :n].unsqueeze(0))
                for i in range(len(self.layers))]

    # Forward -----------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, token_ids: Sequence[int] | torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Append ``token_ids`` ([n] int64, causal among themselves) and return [n, V] float32 logits."""
        if self._tree_start is not None:
            raise ValueError("forward: a token tree is pending; call keep_tree_path() first")
        ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)
        start = self.num_cached
        positions = torch.arange(start, start + ids.numel())
        hidden = self._run(ids, positions, mask=None)
        self.cached_ids.extend(ids.tolist())
        if last_only:
            hidden = hidden[-1:]
        return _mm(self.lm_head, hidden).float()

    # Token trees (same contract as CachedModel.forward_tree / keep_tree_path) ----------

    def check_tree_support(self) -> None:
        """The owned forward always takes a tree mask (nothing to check)."""

    @torch.inference_mode()
    def forward_tree(self, token_ids: Sequence[int] | torch.Tensor, parents: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Append token-tree nodes (ancestor mask, position = prefix length + depth - 1); [n, V] float32 logits.

        ``parents[i]``: the node's parent among all pending nodes (earlier calls first), -1 = child
        of the prefix. See :meth:`specdecode.cache.CachedModel.forward_tree`.

        Raises:
            InvalidTreeError: a parent that is not an earlier pending node.
        """
        ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)
        n = ids.numel()
        start = self.num_cached if self._tree_start is None else self._tree_start
        new = parents.tolist() if isinstance(parents, torch.Tensor) else [int(p) for p in parents]
        region = as_parent_list([*self._tree_parents, *new])
        positions = torch.tensor(node_depths(region)[-n:], dtype=torch.int64) + (start - 1)
        hidden = self._run(ids, positions, mask=tree_attention_mask(region, start, n))
        self._tree_start, self._tree_parents = start, region
        self.cached_ids.extend(ids.tolist())
        return _mm(self.lm_head, hidden).float()

    @torch.inference_mode()
    def keep_tree_path(self, nodes: Sequence[int]) -> None:
        """Keep the prefix plus the pending nodes ``nodes`` (a root path, in order): their cache
        slots move into place, the other nodes are cut.

        Raises:
            ValueError: no tree pending, or ``nodes`` is not a root path.
        """
        nodes = checked_tree_path(nodes, self._tree_start, self._tree_parents)
        start, k = self._tree_start, len(nodes)
        if nodes != list(range(k)):
            src = torch.tensor(nodes, dtype=torch.int64) + start
            self.k_cache[:, :, start : start + k] = self.k_cache[:, :, src]
            self.v_cache[:, :, start : start + k] = self.v_cache[:, :, src]
            self.cached_ids[start : start + k] = [self.cached_ids[start + i] for i in nodes]
        self._tree_start, self._tree_parents = None, []
        self.rollback(start + k)

    @torch.inference_mode()
    def forward_skipping(self, token_ids: Sequence[int] | torch.Tensor, start: int,
                         layers: Sequence[int]) -> torch.Tensor:
        """Layer-skip drafting: run ``token_ids`` at positions start.. through ``layers`` only.

        Writes those layers' cache slots start..start+n but leaves ``cached_ids`` alone, so the
        slots stay past the committed length: verification rewrites them before any read
        (``specdecode.proposers.layer_skip``). ``start`` >= ``num_cached``.

        Returns:
            [n, V] float32 logits.
        """
        ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)
        if start < self.num_cached or self._tree_start is not None:
            raise ValueError(f"forward_skipping writes past the committed cache ({self.num_cached}), got {start}")
        positions = torch.arange(start, start + ids.numel())
        return _mm(self.lm_head, self._run(ids, positions, mask=None, start=start, layers=layers)).float()

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, start: int | None = None,
             layers: Sequence[int] | None = None) -> torch.Tensor:
        """Run every layer (or ``layers``) over ``ids`` written at cache slots start..start+n
        (default start: ``num_cached``); returns [n, hidden]."""
        n = ids.numel()
        start = self.num_cached if start is None else start
        end = start + n
        if int(positions.max()) >= self.max_context:
            raise SpecDecodeError(f"position {int(positions.max())} exceeds the context of {self.max_context}")
        if end > self._capacity:
            # Slots past the context are scratch for token-tree nodes (positions stay inside it).
            self._alloc(min(self.max_context + SCRATCH_SLOTS, max(end, 2 * self._capacity)))
            if end > self._capacity:
                raise SpecDecodeError(f"{end} cache slots needed; at most {self._capacity} (context + tree scratch)")
        if mask is None and n > 1:  # causal among the new tokens, everything cached visible
            mask = torch.ones(n, end, dtype=torch.bool).tril(diagonal=start)
        cos, sin = self._rope(positions)
        x = self.embed[ids]  # [n, hidden]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        for i in range(len(self.layers)) if layers is None else layers:
            layer = self.layers[i]
            qkv = _mm(layer.qkv, _rms_norm(x, layer.ln1, self.eps))
            if layer.qkv_bias is not None:
                qkv = qkv + layer.qkv_bias
            q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
            q = _apply_rope(q.view(n, h, d).transpose(0, 1), cos, sin)  # [h, n, d]
            k = _apply_rope(k.view(n, kvh, d).transpose(0, 1), cos, sin)
            self.k_cache[i, :, start:end] = k
            self.v_cache[i, :, start:end] = v.view(n, kvh, d).transpose(0, 1)
            attn = F.scaled_dot_product_attention(
                q.unsqueeze(0).to(self.cache_dtype),
                self.k_cache[i, :, :end].unsqueeze(0),
                self.v_cache[i, :, :end].unsqueeze(0),
                attn_mask=mask,
                enable_gqa=h != kvh,
            ).to(x.dtype)  # [1, h, n, d]
            x = x + _mm(layer.o, attn[0].transpose(0, 1).reshape(n, h * d))
            gate, up = _mm(layer.gate_up, _rms_norm(x, layer.ln2, self.eps)).chunk(2, dim=-1)
            x = x + _mm(layer.down, F.silu(gate) * up)
        return _rms_norm(x, self.norm, self.eps)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [n, d/2] float32
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()  # float32 statistics, as the Hugging Face RMSNorm (also for float64 models)
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * out.to(x.dtype)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [heads, n, d] by position (the rotate-half convention of Llama / Qwen2)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
