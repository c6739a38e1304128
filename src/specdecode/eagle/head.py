"""The feature-level draft head (EAGLE-3 style) and its checkpoint format.

Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test"; Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty"; Zhao et al. 2025, "FR-Spec" (frequency-ranked reduced draft vocabulary).

The head drafts from the target's own hidden states. For the context position t (the target has
read tokens x_0..x_t) its input is

- ``f_t``: the target's hidden states after a low, a middle and a high decoder layer
  (``feature_layers``, Hugging Face ``hidden_states`` indices: 0 = the embeddings, i = after
  layer i - 1), concatenated, [3H], fused to [H] by ``fc``;
- ``e_{t+1}``: the target's (frozen) embedding of the next token x_{t+1}, [H];

and one decoder layer whose attention projections read ``[norm(e), norm(h)]`` ([2H]) maps them to
an output hidden state ``o_t`` [H]; the target's final norm and the LM head restricted to the
draft vocabulary (the ``Vd`` most frequent target tokens of the training set) score x_{t+2}.
Drafting the next token feeds ``o_t`` in place of the fused features (the head reads its own
output, which the training-time test trains it to do), with the drafted token's embedding, at
position t + 1. The head keeps its own KV cache of one layer.

Only the head's own weights are stored (``fc``, the norms, the layer, and the LM head when it was
trained): the embedding and, by default, the LM head rows come from the target when the head is
bound to it, so a checkpoint is a few MB.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from specdecode.errors import SpecDecodeError

#: The checkpoint's file names inside its directory.
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
#: Bump when the format changes (loading refuses another version).
FORMAT_VERSION = 1


def autocast_dtype(device: str) -> torch.dtype | None:
    """bfloat16 autocast where it pays: CUDA, or a CPU with AMX / AVX512-BF16 (Linux flags); else None."""
    if device.startswith("cuda"):
        return torch.bfloat16
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return torch.bfloat16 if ("amx_bf16" in flags or "avx512_bf16" in flags) else None


class EagleCheckpointError(SpecDecodeError):
    """A draft-head checkpoint is missing, malformed or made for another target."""


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's choice of target layers: the inputs of layers 2, L // 2 and L - 3 (as vLLM / SpecForge)."""
    return (min(2, num_layers), max(1, num_layers // 2), max(1, num_layers - 3))


@dataclass
class EagleConfig:
    """Shape and provenance of a draft head.

    Attributes:
        hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, rms_norm_eps, rope_theta:
            the layer's shape (the target's by default).
        vocab_size: the target's vocabulary V.
        feature_layers: the three target ``hidden_states`` indices fused by ``fc``.
        draft_vocab: [Vd] target token ids the head scores, most frequent first (the map back to
            the target's ids); tokens outside it have draft probability 0.
        train_lm_head: the LM head rows were trained (and stored) rather than taken from the target.
        target_name, target_sha256: what the head was trained for (sha256 of the target's weights
            file, or of its GGUF, when known).
        training: facts of the run that made it (corpus size, steps, time, accuracy per step).
    """

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    feature_layers: tuple[int, ...]
    draft_vocab: list[int]
    target_num_layers: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    train_lm_head: bool = False
    target_name: str = ""
    target_sha256: str | None = None
    training: dict = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    @classmethod
    def for_target(cls, model: torch.nn.Module, draft_vocab: list[int], feature_layers=None,
                   intermediate_size: int | None = None, **kwargs) -> "EagleConfig":
        """The head shaped like ``model``'s decoder layers (Llama / Qwen2 config fields)."""
        cfg = model.config
        heads = int(cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        layers = feature_layers or default_feature_layers(int(cfg.num_hidden_layers))
        return cls(hidden_size=int(cfg.hidden_size), num_heads=heads, num_kv_heads=int(cfg.num_key_value_heads),
                   head_dim=head_dim, intermediate_size=int(intermediate_size or cfg.intermediate_size),
                   vocab_size=int(model.get_input_embeddings().weight.shape[0]),
                   feature_layers=tuple(int(i) for i in layers), draft_vocab=[int(t) for t in draft_vocab],
                   target_num_layers=int(cfg.num_hidden_layers),
                   rms_norm_eps=float(cfg.rms_norm_eps), rope_theta=theta, **kwargs)


class _RMSNorm(torch.nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(_work_dtype(x.dtype))
        return (self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a norm or a softmax computes in: float32 for bf16 / fp16 / float32 inputs, float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin [..., head_dim] for int64 ``positions`` [...] (rotate-half convention)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = positions.float().unsqueeze(-1) * inv
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class EagleHead(torch.nn.Module):
    """The trainable head: ``fc``, one decoder layer over [norm(embedding), norm(hidden)], the final norm
    and the reduced-vocabulary LM head.

    Args:
        config: EagleConfig.

    The embedding (``embed`` [V, H]) and, unless ``config.train_lm_head``, the LM head rows
    (``lm_head`` [Vd, H]) are buffers set by :meth:`attach` from the target; they are never stored.
    """

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = c = config
        h, qd, kvd = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.fc = torch.nn.Linear(len(c.feature_layers) * h, h, bias=False)
        self.input_norm = _RMSNorm(h, c.rms_norm_eps)  # the token embedding
        self.hidden_norm = _RMSNorm(h, c.rms_norm_eps)  # the fused features / the head's own output
        self.q_proj = torch.nn.Linear(2 * h, qd, bias=False)
        self.k_proj = torch.nn.Linear(2 * h, kvd, bias=False)
        self.v_proj = torch.nn.Linear(2 * h, kvd, bias=False)
        self.o_proj = torch.nn.Linear(qd, h, bias=False)
        self.post_norm = _RMSNorm(h, c.rms_norm_eps)
        self.gate_proj = torch.nn.Linear(h, c.intermediate_size, bias=False)
        self.up_proj = torch.nn.Linear(h, c.intermediate_size, bias=False)
        self.down_proj = torch.nn.Linear(c.intermediate_size, h, bias=False)
        self.norm = _RMSNorm(h, c.rms_norm_eps)  # initialised from the target's final norm
        vd = len(c.draft_vocab)
        if c.train_lm_head:
            self.lm_head_weight = torch.nn.Parameter(torch.zeros(vd, h))
        else:
            self.register_buffer("lm_head_weight", torch.zeros(vd, h), persistent=False)
        self.register_buffer("embed", torch.zeros(0, h), persistent=False)
        self.register_buffer("d2t", torch.tensor(c.draft_vocab, dtype=torch.int64), persistent=False)

    # Binding to the target ---------------------------------------------------------------------

    def attach(self, target: torch.nn.Module, init: bool = False) -> "EagleHead":
        """Take the embedding (and the LM head rows, unless trained) from ``target``; check its shape.

        ``init``: also initialise the final norm (and a trained LM head) from the target (training).

        Raises:
            EagleCheckpointError: the target's hidden size or vocabulary differs from the head's.
        """
        c = self.config
        emb = target.get_input_embeddings().weight
        head = target.get_output_embeddings()
        head_w = head.weight if isinstance(getattr(head, "weight", None), torch.Tensor) else None
        if head_w is None or head_w.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            head_w = _dequantized_weight(head)
        if emb.shape[1] != c.hidden_size or head_w.shape[0] != c.vocab_size:
            raise EagleCheckpointError(
                f"the draft head was trained for a target with hidden size {c.hidden_size} and vocabulary "
                f"{c.vocab_size}; this target has {emb.shape[1]} and {head_w.shape[0]}. Train a head for it: "
                f"specdecode train-drafter --target MODEL")
        dtype = self.fc.weight.dtype
        self.embed = emb.detach().to(dtype)
        rows = head_w.detach()[self.d2t].to(dtype)
        if c.train_lm_head:
            if init:
                self.lm_head_weight.data.copy_(rows)
        else:
            self.lm_head_weight = rows
        if init:
            norm = getattr(getattr(target, "model", None), "norm", None)
            if norm is not None and getattr(norm, "weight", None) is not None:
                self.norm.weight.data.copy_(norm.weight.detach().float())
        return self

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint stores: the head's own parameters."""
        return {k: v.detach() for k, v in self.named_parameters()}

    # Forward pieces -----------------------------------------------------------------------------

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """[..., 3H] target features -> [..., H] fused hidden input."""
        return self.fc(features.to(self.fc.weight.dtype))

    def qkv(self, hidden: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor):
        """hidden [n, H], token_ids [n], positions [n] -> q [heads, n, d], k, v [kv_heads, n, d] (RoPE applied)."""
        c = self.config
        x = torch.cat([self.input_norm(self.embed[token_ids]), self.hidden_norm(hidden)], dim=-1)
        n = x.shape[0]
        cos, sin = rope_tables(positions, c.head_dim, c.rope_theta, x.dtype)
        q = apply_rope(self.q_proj(x).view(n, c.num_heads, c.head_dim).transpose(0, 1), cos, sin)
        k = apply_rope(self.k_proj(x).view(n, c.num_kv_heads, c.head_dim).transpose(0, 1), cos, sin)
        v = self.v_proj(x).view(n, c.num_kv_heads, c.head_dim).transpose(0, 1)
        return q, k, v

    def finish(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual + MLP: hidden [n, H], attn [heads, n, d] -> the output hidden state [n, H]."""
        n = hidden.shape[0]
        out = hidden + self.o_proj(attn.transpose(0, 1).reshape(n, -1))
        y = self.post_norm(out)
        return out + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """[..., H] output hidden states -> [..., Vd] draft-vocabulary logits (float32)."""
        return F.linear(self.norm(out), self.lm_head_weight).float()

    def step(self, hidden: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor,
             past_k: torch.Tensor, past_v: torch.Tensor, mask: torch.Tensor | None):
        """One head forward of n new entries (inference).

        Args:
            hidden: [n, H] fused features or the parents' output hidden states.
            token_ids: [n] int64 target ids whose embeddings are read; positions: [n] int64.
            past_k, past_v: [kv_heads, C, d] cached entries the new ones may attend to.
            mask: [n, C + n] bool (True = visible), or None for causal over the new entries.

        Returns:
            (out [n, H], k [kv_heads, n, d], v [kv_heads, n, d]).
        """
        q, k, v = self.qkv(hidden, token_ids, positions)
        keys = torch.cat([past_k, k], dim=1)
        values = torch.cat([past_v, v], dim=1)
        if mask is None:
            c = past_k.shape[1]
            n = q.shape[1]
            mask = torch.ones(n, c + n, dtype=torch.bool)
            mask[:, c:] = torch.ones(n, n, dtype=torch.bool).tril()
        attn = F.scaled_dot_product_attention(q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                              attn_mask=mask, enable_gqa=q.shape[0] != k.shape[0])[0]
        return self.finish(hidden, attn), k, v

    # Training: the training-time test -----------------------------------------------------------

    def unrolled(self, features: torch.Tensor, next_ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test: the head run ``steps`` times over whole sequences, each time on its own
        previous output, with the attention drafting would see.

        Args:
            features: [B, T, 3H] target features f_t; next_ids: [B, T] int64 tokens x_{t+1}.
            steps: unrolled draft positions K >= 1.

        Returns:
            [K] logits [B, T, Vd] float32: step j at position t scores x_{t+2} as the (j+1)-th draft
            token after the context x_0..x_{t-j+1} (valid for t >= j). Step j's query at t attends to
            step 0's entries at positions <= t - j and to step i's entry at t - j + i (i = 1..j), as the
            head's KV cache holds them while drafting.
        """
        c = self.config
        b, t, _ = features.shape
        pos = torch.arange(t)
        cos, sin = rope_tables(pos, c.head_dim, c.rope_theta, self.fc.weight.dtype)
        emb = self.input_norm(self.embed[next_ids])  # [B, T, H]
        hidden = self.fuse(features)
        keys, values, outs = [], [], []
        scale = 1.0 / math.sqrt(c.head_dim)
        group = c.num_heads // c.num_kv_heads
        for j in range(steps):
            if j:
                hidden = torch.cat([torch.zeros_like(hidden[:, :1]), outs[-1][:, :-1]], dim=1)  # o_{t-1}
            x = torch.cat([emb, self.hidden_norm(hidden)], dim=-1)
            q = apply_rope(self.q_proj(x).view(b, t, c.num_heads, c.head_dim).transpose(1, 2), cos, sin)
            k = apply_rope(self.k_proj(x).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2), cos, sin)
            v = self.v_proj(x).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [B, h, T, d]
            keys.append(k)
            values.append(v)
            scores = [torch.matmul(q, keys[0].transpose(-1, -2)) * scale]  # [B, h, T, T]
            causal = torch.ones(t, t, dtype=torch.bool).tril(-j)  # step 0's entries at s <= t - j
            scores[0] = scores[0].masked_fill(~causal, float("-inf"))
            diag_values = []
            for i in range(1, j + 1):  # step i's entry at position t - j + i
                shift = j - i
                ki = _shift_right(keys[i], shift)
                diag_values.append(_shift_right(values[i], shift))
                scores.append((q * ki).sum(-1, keepdim=True) * scale)  # [B, h, T, 1]
            probs = torch.softmax(torch.cat(scores, dim=-1).to(_work_dtype(q.dtype)), dim=-1).to(q.dtype)
            probs = torch.nan_to_num(probs)  # rows t < j see nothing valid (masked out of the loss)
            attn = torch.matmul(probs[..., :t], values[0])
            for i, dv in enumerate(diag_values):
                attn = attn + probs[..., t + i : t + i + 1] * dv
            out = hidden + self.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
            y = self.post_norm(out)
            out = out + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))
            outs.append(out)
        return outs


def _shift_right(x: torch.Tensor, shift: int) -> torch.Tensor:
    """[B, h, T, d] -> row t holds row t - shift (zeros before)."""
    if shift == 0:
        return x
    return torch.cat([torch.zeros_like(x[:, :, :shift]), x[:, :, :-shift]], dim=2)


def _dequantized_weight(module: torch.nn.Module) -> torch.Tensor:
    """The float weight of a low-bit module (``lowbit.QuantLinear``)."""
    unpack = getattr(module, "dequantize", None)
    if callable(unpack):
        return unpack()
    raise EagleCheckpointError(f"cannot read the LM head weights of {type(module).__name__}")


# --------------------------------------------------------------------------- checkpoints


def save_head(head: EagleHead, directory: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``directory/model.safetensors`` (the head's own weights in ``dtype``) and ``config.json``."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.to(dtype).contiguous() for k, v in head.trainable_state().items()}
    tmp = out / (WEIGHTS_FILE + ".tmp")
    save_file(state, str(tmp), metadata={"format": "specdecode-eagle", "version": str(FORMAT_VERSION)})
    tmp.replace(out / WEIGHTS_FILE)
    config = asdict(head.config)
    config["feature_layers"] = list(config["feature_layers"])
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")
    return out


def load_head(directory: str | Path, dtype: torch.dtype = torch.float32) -> EagleHead:
    """Read a checkpoint written by :func:`save_head` (unbound: call :meth:`EagleHead.attach`).

    Raises:
        EagleCheckpointError: no such directory, missing files, another format version, missing weights.
    """
    path = Path(directory).expanduser()
    if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        raise EagleCheckpointError(
            f"{path} is not a draft-head checkpoint (it needs {CONFIG_FILE} and {WEIGHTS_FILE}); make one with "
            f"specdecode train-drafter --target MODEL --out {path}")
    try:
        raw = json.loads((path / CONFIG_FILE).read_text())
        if raw.get("format_version") != FORMAT_VERSION:
            raise EagleCheckpointError(f"{path}: format version {raw.get('format_version')!r}, this "
                                       f"specdecode reads {FORMAT_VERSION}; retrain the head")
        raw["feature_layers"] = tuple(raw["feature_layers"])
        config = EagleConfig(**raw)
    except (json.JSONDecodeError, TypeError, KeyError) as exc:
        raise EagleCheckpointError(f"{path / CONFIG_FILE} is malformed ({exc}); retrain the head") from exc
    head = EagleHead(config)
    try:
        state = load_file(str(path / WEIGHTS_FILE))
    except Exception as exc:  # safetensors raises its own error types for a truncated / foreign file
        raise EagleCheckpointError(f"{path / WEIGHTS_FILE} cannot be read ({exc}); retrain the head") from exc
    own = dict(head.named_parameters())
    missing = sorted(set(own) - set(state))
    if missing:
        raise EagleCheckpointError(f"{path / WEIGHTS_FILE} lacks {missing}; retrain the head")
    with torch.no_grad():
        for name, param in own.items():
            if tuple(state[name].shape) != tuple(param.shape):
                raise EagleCheckpointError(f"{name}: shape {tuple(state[name].shape)} in the file, the config "
                                           f"says {tuple(param.shape)}")
            param.copy_(state[name].to(param.dtype))
    head.requires_grad_(False)
    return head.to(dtype).eval()


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file (the target's weights), read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
