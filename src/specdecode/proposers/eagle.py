"""The feature-level draft head as a proposer (EAGLE-3 style heads; chains or EAGLE-2 dynamic trees).

Li et al. 2025, "EAGLE-3"; Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with
Dynamic Draft Trees". The head (:class:`specdecode.eagle.head.EagleHead`) reads the target's hidden
states, which the target's runner keeps from every full forward (``SlotRunner.capture_layers`` /
``last_features``): the prefill gives the prompt's features (:meth:`EagleProposer.start`), each
verification pass the features of the tokens it committed (:meth:`EagleProposer.observe`). No target
forward is added.

Per row the head holds its own one-layer KV cache: *exact* entries for context positions
0..n-1, each made from the target's features f_t and the next token x_{t+1}, and, while drafting,
*speculative* entries for draft nodes, each made from its parent's output hidden state and its own
token. After verification the speculative entries are dropped: the committed tokens' entries are
remade from the target's own features on the next draft (the head never keeps its guesses).

Lossless: the head's q is its softmax over the draft vocabulary, mapped to the target's ids (tokens
outside it have q = 0; they are still produced by the target, as recovered or bonus tokens), after
the request's whole sampling processing (``ProposeContext.draft_dist``). Chains are sampled from q and
verified with q (token-level or block verification); trees take the top-k candidates of q
(deterministic, verified without replacement) as :mod:`specdecode.proposers.tree_draft` explains.
"""

from __future__ import annotations

import json
import sys
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specdecode.eagle.head import CONFIG_FILE, EagleCheckpointError, autocast_dtype, load_head
from specdecode.errors import SpecDecodeError
from specdecode.models import default_cache_dir
from specdecode.options import DEFAULT_TREE_NODES
from specdecode.proposers.base import ProposeContext, register
from specdecode.proposers.tree_draft import TREE_KINDS, TreeDraftConfig, TreeDraftProposer, static_shape
from specdecode.types import Draft, VerifyResult


@dataclass(frozen=True)
class EagleDraftConfig:
    """How the head drafts.

    Attributes:
        tree: "none" (chains), "dynamic" (EAGLE-2: expand by cumulative draft probability) or "static".
        num_nodes: the tree's node budget N (1..64; 15 nodes + the root fill one 16-row block of the
            batch-invariant verification forward, 16 would cost two); top_k: children per expanded node (dynamic);
            max_depth: the tree's deepest level (the engine's draft length caps it further).
        min_confidence: end a chain after a token whose draft probability is below this (0 disables).
        head: the checkpoint directory; None = the head shipped in the package for this target, else
            the one ``specdecode train-drafter`` left in the cache (:func:`find_head`).
        cache_dir: the cache to search (None: ``models.default_cache_dir()``).
    """

    tree: str = "none"
    num_nodes: int = DEFAULT_TREE_NODES
    top_k: int = 4
    max_depth: int = 8
    min_confidence: float = 0.0
    head: str | None = None
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if self.tree not in ("none", *TREE_KINDS):
            raise SpecDecodeError(f"tree must be 'none', 'static' or 'dynamic', got {self.tree!r}")
        if not 0.0 <= self.min_confidence <= 1.0:
            raise SpecDecodeError(f"min_confidence must be in [0, 1], got {self.min_confidence!r}")


class _RowCache:
    """One row's head cache: exact entries (k, v [kv_heads, n, d]), the target features not yet fed
    ([m, F] for positions n..n+m-1), the root output, and the pending speculative nodes."""

    def __init__(self) -> None:
        self.k = self.v = None
        self.n = 0
        self.features: list[torch.Tensor] = []  # [m_i, F] blocks, in position order
        self.root = None  # (N, out [H], logits [V]) for the row's latest committed length N + 1
        self.nodes: list[tuple[torch.Tensor, int, int]] = []  # speculative (out [H], parent, depth)
        self.spec_k: list[torch.Tensor] = []  # per node [kv_heads, 1, d]
        self.spec_v: list[torch.Tensor] = []

    def drop_speculative(self) -> None:
        self.nodes, self.spec_k, self.spec_v = [], [], []

    @property
    def num_features(self) -> int:
        return sum(int(f.shape[0]) for f in self.features)


def _fast_bf16() -> bool:
    """True on CPUs with AMX / AVX512-BF16 (bfloat16 products at least as fast as float32's)."""
    return autocast_dtype("cpu") is torch.bfloat16


#: Where the package ships trained heads (one directory per target).
PACKAGED_HEADS = Path(__file__).resolve().parent.parent / "heads"


def head_directories(cache_dir: str | Path | None = None) -> list[Path]:
    """Candidate head checkpoints: those ``train-drafter`` left in the cache (a user's own training wins), then
    the package's own."""
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    complete = lambda d: (d / "model.safetensors").is_file()  # noqa: E731 - a config alone is no checkpoint
    found = sorted(p.parent for p in (cache / "eagle").glob("*/head/config.json") if complete(p.parent))
    found += sorted(p.parent for p in PACKAGED_HEADS.glob("*/config.json") if complete(p.parent))
    return found


def find_head(target: torch.nn.Module, head: str | Path | None = None, cache_dir: str | Path | None = None) -> Path:
    """The checkpoint directory to draft with for ``target``: ``head`` when given, else the first candidate
    of :func:`head_directories` made for a target of this shape (hidden size, vocabulary, layer count).

    Raises:
        EagleCheckpointError: ``head`` is not a checkpoint, or no candidate fits the target.
    """
    if head is not None:
        path = Path(head).expanduser()
        if not (path / CONFIG_FILE).is_file():
            raise EagleCheckpointError(f"--draft eagle:{head}: {path} is not a draft-head checkpoint (no "
                                       f"{CONFIG_FILE}); make one with specdecode train-drafter --target MODEL")
        return path
    cfg = target.config
    want = (int(cfg.hidden_size), int(target.get_input_embeddings().weight.shape[0]), int(cfg.num_hidden_layers))
    for path in head_directories(cache_dir):
        try:
            c = json.loads((path / CONFIG_FILE).read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if (c.get("hidden_size"), c.get("vocab_size"), c.get("target_num_layers")) == want:
            return path
    raise EagleCheckpointError(
        f"no draft head for this target (hidden size {want[0]}, vocabulary {want[1]}, {want[2]} layers) in the "
        f"package or the cache; train one with: specdecode train-drafter --target MODEL (then --draft eagle), "
        f"or pass --draft eagle:PATH")


#: target module -> checkpoint path -> the loaded head (weak: a head lives as long as its target).
_HEADS: "weakref.WeakKeyDictionary[torch.nn.Module, dict[str, torch.nn.Module]]" = weakref.WeakKeyDictionary()


@register("eagle")
def make_eagle(target: torch.nn.Module, config: EagleDraftConfig | None = None) -> "EagleProposer":
    """The registered factory: the head of ``config.head`` (or :func:`find_head`'s) for ``target``, loaded
    once per (checkpoint, target) and shared by every proposer built for them."""
    config = config or EagleDraftConfig()
    if target is None:
        raise SpecDecodeError("the eagle proposer needs the target model (its embedding and LM head)")
    path = find_head(target, config.head, config.cache_dir)
    heads = _HEADS.setdefault(target, {})
    key = str(path.resolve())
    if key not in heads:
        heads[key] = load_head(path)
    return EagleProposer(heads[key], config)


_WARNED: set[tuple[int, str]] = set()


def _warn_precision(head, model: torch.nn.Module) -> None:
    """One line on stderr when the head was trained on the target in another precision: its features then
    differ from those it learned (the shipped SmolLM2 head, trained on bf16, accepted 4.4% of its drafts
    under int8), which costs acceptance, never exactness."""
    trained = (getattr(head.config, "training", None) or {}).get("weights")
    running = getattr(getattr(model, "config", None), "specdecode_weights", None)
    trained = trained and str(trained).removeprefix("torch.").replace("bfloat16", "bf16").replace("float32", "fp32")
    if trained and running and trained != running and (id(head), running) not in _WARNED:
        _WARNED.add((id(head), running))  # once per head and precision (tune builds many proposers)
        print(f"specdecode: warning: this EAGLE head was trained on the target in {trained}, and the target runs "
              f"in {running}: expect lower acceptance (train one for it: specdecode train-drafter --weights "
              f"{running})", file=sys.stderr, flush=True)


class EagleProposer(TreeDraftProposer):
    """Drafts with a trained head on the target's own hidden states; chains or token trees.

    Args:
        model: an :class:`~specdecode.eagle.head.EagleHead` (from ``eagle.head.load_head``); bound to the
            target's embedding and LM head rows when the engine binds the proposer.
        config: EagleDraftConfig.

    Raises:
        SpecDecodeError (EagleCheckpointError) at bind: a head made for another target shape.
    """

    name = "eagle"

    def __init__(self, model: torch.nn.Module, config: EagleDraftConfig | None = None) -> None:
        self.eagle = config or EagleDraftConfig()
        tree = self.eagle.tree if self.eagle.tree != "none" else "dynamic"
        # the tree builders of TreeDraftProposer (_static / _dynamic) run on this proposer's _feed
        self.config = TreeDraftConfig(kind=tree, num_nodes=self.eagle.num_nodes, top_k=self.eagle.top_k,
                                      max_depth=self.eagle.max_depth, sampled_candidates=False)
        self._shape = static_shape(self.config.branching, self.config.num_nodes)
        self._region: list[int] = []
        self.model = model
        self.runner = None
        self.produces_trees = self.eagle.tree != "none"
        self.head = model
        self.target = None
        self.rows: dict[int, _RowCache] = {}
        self._row: _RowCache | None = None
        self._base = 0  # position of the root entry (N - 1) while drafting

    # Engine calls -----------------------------------------------------------------------------

    def bind(self, target, num_slots: int) -> None:
        model = target.model
        self.target = target
        self.head.attach(model)
        _warn_precision(self.head, model)
        dtype = target.model.get_input_embeddings().weight.dtype
        if dtype not in (torch.float32, torch.bfloat16, torch.float64):
            dtype = torch.float32
        if dtype == torch.float32 and _fast_bf16():
            # an int8 or float32 target: the head's few-row products read half the bytes in bfloat16 (its
            # numerics only change what is proposed, never what is committed)
            dtype = torch.bfloat16
        self.head.to(dtype)
        self.head.embed = self.head.embed.to(dtype)
        self.head.lm_head_weight = self.head.lm_head_weight.to(dtype) if not isinstance(
            self.head.lm_head_weight, torch.nn.Parameter) else self.head.lm_head_weight
        self.dtype = dtype
        layers = tuple(self.head.config.feature_layers)
        if min(layers) < 0 or max(layers) > int(model.config.num_hidden_layers):
            raise SpecDecodeError(f"the draft head reads target layer {max(layers)}; the target has "
                                  f"{model.config.num_hidden_layers}")
        if target.capture_layers not in (None, layers):
            raise SpecDecodeError("another feature-level proposer is bound to this target with other layers")
        target.capture_layers = layers
        self.max_context = target.max_context
        self.vocab_size = int(self.head.config.vocab_size)
        self.runner = target  # DraftModelSlots' bookkeeping: _bound() must succeed

    def start(self, ctx: ProposeContext) -> None:
        """The request was just prefilled: its prompt's features are the target's last forward's."""
        row = self.rows[ctx.slot] = _RowCache()
        feats = self.target.last_features
        n = len(ctx.token_ids) - 1  # features of positions 0..L-1 (the prompt); the first token has none yet
        if feats is not None and feats.shape[1] >= n:
            row.features = [feats[0, :n].detach().clone()]

    def finish(self, ctx: ProposeContext) -> None:
        self.rows.pop(ctx.slot, None)

    def move(self, src: int, dst: int) -> None:
        if src != dst and src in self.rows:
            self.rows[dst] = self.rows.pop(src)

    def release(self) -> None:
        self.rows = {}

    @property
    def nbytes(self) -> int:
        return sum(2 * r.k.numel() * r.k.element_size() for r in self.rows.values() if r.k is not None)

    #: The head needs the features of every verification pass, also of steps that drafted nothing.
    observes_every_step = True

    def observe(self, batch: Sequence[ProposeContext], results: Sequence[VerifyResult]) -> None:
        """Keep the target's features of the tokens this step committed (the verified feed's positions)."""
        feats = self.target.last_features  # [B, q, F] of the verification forward
        for i, (ctx, result) in enumerate(zip(batch, results)):
            row = self.rows.get(ctx.slot)
            if row is None:
                continue
            row.drop_speculative()
            need = len(ctx.token_ids) - 1 - row.n - row.num_features  # positions with features now known
            if need <= 0 or feats is None or i >= feats.shape[0]:
                continue
            n = int(result.num_accepted[0])
            # feed position 0 is the last committed token, draft node k sits at k + 1 (chains: kept 0..n-1)
            idx = [0, *(int(k) + 1 for k in result.kept_nodes[0, :n].tolist())][:need]
            if len(idx) < need or max(idx) >= feats.shape[1]:
                row.features = []  # cannot tell which features: this row drafts nothing until it leaves
                row.n = -1
                continue
            row.features.append(feats[i, idx].detach().clone())

    # Drafting ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose_row(self, ctx: ProposeContext, max_tokens: int) -> Draft:
        row = self.rows.get(ctx.slot)
        max_tokens = min(max_tokens, self.max_context - len(ctx.token_ids))
        if row is None or row.n < 0 or max_tokens <= 0:
            return Draft.empty()
        root = self._root(ctx, row)
        if root is None:
            return Draft.empty()
        self._row = row
        row.drop_speculative()
        self._region = []
        try:
            if not self.produces_trees:
                return self._chain(ctx, root, max_tokens)
            if self.config.kind == "static":
                draft = self._static(ctx, root, max_tokens)
            else:
                draft = self._dynamic(ctx, root, max_tokens)
            return draft
        finally:
            self._row = None

    def _root(self, ctx: ProposeContext, row: _RowCache) -> torch.Tensor | None:
        """Feed the exact entries not yet in the head's cache; [V] logits at the latest committed token's
        position (its entry is the context position N - 1, whose output scores the first draft)."""
        N = len(ctx.token_ids) - 1
        if row.root is not None and row.root[0] == N:
            self._base = N - 1
            return row.root[2]
        m = row.num_features
        if row.n + m != N or m == 0:
            return None
        feats = torch.cat(row.features) if len(row.features) > 1 else row.features[0]
        head = self.head
        hidden = head.fuse(feats.to(self.dtype))
        toks = torch.tensor(ctx.token_ids[row.n + 1 : N + 1], dtype=torch.int64)
        pos = torch.arange(row.n, N)
        kvh, d = head.config.num_kv_heads, head.config.head_dim
        past_k = row.k if row.k is not None else torch.zeros(kvh, 0, d, dtype=self.dtype)
        past_v = row.v if row.v is not None else torch.zeros(kvh, 0, d, dtype=self.dtype)
        out, k, v = head.step(hidden, toks, pos, past_k, past_v, None)
        row.k = torch.cat([past_k, k], dim=1)
        row.v = torch.cat([past_v, v], dim=1)
        row.n = N
        row.features = []
        logits = self._full(head.logits(out[-1:]))[0]
        row.root = (N, out[-1], logits)
        self._base = N - 1
        return logits

    def _full(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[n, Vd] draft-vocabulary logits -> [n, V] (-inf outside the draft vocabulary)."""
        out = torch.full((draft_logits.shape[0], self.vocab_size), float("-inf"), dtype=torch.float32)
        out[:, self.head.d2t] = draft_logits.float()
        return out

    def _forward_nodes(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """Speculative entries for nodes ``tokens`` (parents among the fed nodes, -1 = the root entry);
        [n, V] logits after each. Each node attends to the exact entries, its fed ancestors and itself."""
        row, head = self._row, self.head
        c = row.n
        hidden = torch.stack([row.root[1] if p < 0 else row.nodes[p][0] for p in parents])
        depths = [1 if p < 0 else row.nodes[p][2] + 1 for p in parents]
        pos = torch.tensor([self._base + dep for dep in depths], dtype=torch.int64)
        prev = len(row.nodes)
        m = len(tokens)
        mask = torch.zeros(m, c + prev + m, dtype=torch.bool)
        mask[:, :c] = True
        for i, p in enumerate(parents):
            while p >= 0:
                mask[i, c + p] = True
                p = row.nodes[p][1]
            mask[i, c + prev + i] = True
        past_k = torch.cat([row.k, *row.spec_k], dim=1) if row.spec_k else row.k
        past_v = torch.cat([row.v, *row.spec_v], dim=1) if row.spec_v else row.v
        out, k, v = head.step(hidden, torch.tensor(tokens, dtype=torch.int64), pos, past_k, past_v, mask)
        for i in range(m):
            row.nodes.append((out[i], parents[i], depths[i]))
            row.spec_k.append(k[:, i : i + 1])
            row.spec_v.append(v[:, i : i + 1])
        return self._full(head.logits(out))

    def _feed(self, tokens, region_parents, ctx, paths):  # the tree builders' hook (TreeDraftProposer)
        logits = self._forward_nodes(list(tokens), list(region_parents))
        return self._dist(logits, ctx, paths)

    def _chain(self, ctx: ProposeContext, root: torch.Tensor, max_tokens: int) -> Draft:
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        q = ctx.draft_dist(root[: ctx.vocab_size], [])
        while True:
            if not bool((q > 0).any()):  # nothing the request may generate is in the draft vocabulary
                break
            tok = ctx.draft_token(q, len(tokens))
            tokens.append(tok)
            if not ctx.params.greedy:
                probs.append(q)
            if len(tokens) >= max_tokens or not ctx.keep_drafting(q):
                break
            if self.eagle.min_confidence and float(q[tok]) < self.eagle.min_confidence:
                break
            logits = self._forward_nodes([tok], [len(tokens) - 2])[0]
            q = ctx.draft_dist(logits[: ctx.vocab_size], tokens)
        if not tokens:
            return Draft.empty()
        return Draft.chain(torch.tensor([tokens], dtype=torch.int64), torch.stack(probs).unsqueeze(0) if probs else None)


__all__ = ["EagleDraftConfig", "EagleProposer", "PACKAGED_HEADS", "find_head", "head_directories", "make_eagle"]
