"""Token trees from a draft model: a static shape (top-k per depth) or a dynamic tree (EAGLE-2).

Both grow the tree level by level: one draft forward per depth scores every node
of that level that gets children (``forward_tree`` of the draft's runner, ancestor mask),
so a tree of depth D costs D draft forwards like a chain of D tokens, with more
rows each.

- **static** (Medusa / SpecInfer style): a fixed shape given as children per node
  at each depth (``branching``), cut to the node budget N in breadth-first order,
  preferring low-rank (more likely) paths.
- **dynamic** (Li et al. 2024, EAGLE-2): at each depth, give each expanded node
  its ``top_k`` most likely children, score every node by its cumulative draft
  probability (the product of q along its path), expand the ``top_k`` best new
  nodes next; finally keep the N best-scored nodes of everything drafted
  (*rerank*). A node never scores above its parent, so the kept set is a tree.

Which candidates, and why verification stays lossless (``specdecode.tree``):

- greedy requests: candidates are top-k of the draft's softmax; greedy tree
  verification keeps exactly the target's argmax path.
- sampling, dynamic trees and static trees with ``sampled_candidates=False``:
  candidates are the top-k of the processed q, i.e. a *deterministic* function
  of the context (the draft model is deterministic), so the shape and the tokens
  never depend on the verifier's randomness. They are verified as deterministic
  candidates (q one-hot: ``draft_probs`` is None), the without-replacement form:
  child i is kept with probability p(x_i) / (1 - sum of p over earlier siblings),
  so the token leaving each node is exactly p-distributed. (Verifying top-k
  tokens as if they were *samples* from q, ``q_i = q``, would not be lossless.)
- sampling, static trees with ``sampled_candidates=True`` (default): the children
  of a node are a Gumbel-top-k draw, i.e. k samples from q *without replacement*;
  child i's ``draft_probs`` row is q with its earlier siblings removed and
  renormalised, its exact conditional law, and the shape is fixed in advance.
  That is recursive rejection sampling (Jeon et al. 2024), lossless per try.
  A dynamic tree cannot use sampled candidates: keeping the best-scored nodes
  selects on the sampled tokens' own values, which biases them.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from dataclasses import dataclass

import torch

from specdecode.kv import model_context
from specdecode.kv import FORWARD_BACKENDS
from specdecode.options import DEFAULT_TREE_NODES
from specdecode.proposers.base import DraftModelSlots, RowProposer, ProposeContext, draft_room, register
from specdecode.types import Draft, SpecDecodeError, VerifyResult
from specdecode.validate import check_tree_nodes

TREE_KINDS = ("static", "dynamic")


@dataclass(frozen=True)
class TreeDraftConfig:
    """Shape of the draft tree.

    Attributes:
        kind: "static" or "dynamic".
        num_nodes: N, the node budget verified per step (1..64).
        branching: static: children per node at depth 1, 2, ... (the tree is then cut
            to ``num_nodes`` breadth-first, lower-ranked paths first); its length caps the depth.
        top_k: dynamic: children per expanded node and nodes expanded per depth.
        max_depth: dynamic: deepest level (= draft forwards per step); the engine's
            draft length caps both kinds further.
        sampled_candidates: static, temperature > 0: draw children without replacement
            from q (Gumbel-top-k) instead of taking q's top-k.
        forward: the draft's forward backend ("auto", "hf", "owned"; see
            :func:`specdecode.kv.make_runner`).

    Raises:
        SpecDecodeError: a value out of range.
    """

    kind: str = "dynamic"
    num_nodes: int = DEFAULT_TREE_NODES
    branching: tuple[int, ...] = (4, 2, 2, 1, 1, 1, 1, 1)
    top_k: int = 4
    max_depth: int = 8
    sampled_candidates: bool = True
    forward: str = "auto"

    def __post_init__(self) -> None:
        if self.forward not in FORWARD_BACKENDS:
            raise SpecDecodeError(f"forward must be one of {FORWARD_BACKENDS}, got {self.forward!r}")
        if self.kind not in TREE_KINDS:
            raise SpecDecodeError(f"tree kind must be one of {TREE_KINDS}, got {self.kind!r}")
        check_tree_nodes(self.num_nodes)
        if not self.branching or any(not isinstance(b, int) or b < 1 for b in self.branching):
            raise SpecDecodeError(f"branching must be positive integers per depth, got {self.branching!r}")
        if not 1 <= self.top_k <= 16 or not 1 <= self.max_depth <= 64:
            raise SpecDecodeError(f"top_k must be in [1, 16] and max_depth in [1, 64], got {self.top_k}, {self.max_depth}")


def static_shape(branching: tuple[int, ...], num_nodes: int) -> list[tuple[int, ...]]:
    """Rank paths of a static tree, breadth-first, cut to ``num_nodes``.

    A rank path (r_1, ..., r_d) is the node reached by taking the r_1-th most likely
    child of the root, then its r_2-th child, ... Within a depth, paths with a smaller
    rank sum come first, so the cut drops the least likely branches.

    Returns:
        [<= num_nodes] rank paths; every path's prefix comes before it.
    """
    paths, level = [], [()]
    for k in branching:
        level = sorted((p + (r,) for p in level for r in range(k)), key=lambda p: (sum(p), p))
        paths.extend(level)
        if len(paths) >= num_nodes:
            break
    return paths[:num_nodes]


@register("tree-draft")
class TreeDraftProposer(DraftModelSlots, RowProposer):
    """A draft model that proposes token trees (static shape or EAGLE-2 dynamic).

    Args:
        model: a Hugging Face causal LM (eval mode) sharing the target's vocabulary ids.
        config: TreeDraftConfig.

    Raises:
        TreeAttentionUnsupported: the draft model cannot take a custom 4-D mask.
    """

    produces_trees = True

    def __init__(self, model: torch.nn.Module, config: TreeDraftConfig | None = None) -> None:
        self.config = config or TreeDraftConfig()
        self.model = model
        self.forward = self.config.forward
        self.max_context = model_context(model)  # positions the draft can hold
        self.runner = None
        self._view = None  # the row being drafted (a kv.RowView of the draft's slot cache)
        self._region: list[int] = []  # draft node -> index among the row's pending draft nodes (-1: not fed)
        self._shape = static_shape(self.config.branching, self.config.num_nodes)

    def bind(self, target, num_slots: int) -> None:
        super().bind(target, num_slots)
        self.runner.check_tree_support()

    @torch.inference_mode()
    def propose_row(self, ctx: ProposeContext, max_tokens: int) -> Draft:
        """A tree of at most ``num_nodes`` nodes and depth ``max_tokens`` (shallower where the draft's
        context cannot hold that depth: the deepest level is never fed; empty when nothing fits).

        Returns:
            Draft with token_ids / parents [1, N] int64 (breadth-first) and draft_probs
            [1, N, V] float32 for sampled candidates, else None (deterministic candidates).
        """
        max_tokens = min(max_tokens, draft_room(self.max_context, ctx))
        ctx.state["tree_region"] = []
        if max_tokens <= 0:
            return Draft.empty()
        self._view = view = self._bound().row(ctx.slot)
        view.sync(ctx.token_ids)
        if view.num_cached == len(ctx.token_ids):  # never feed nothing: recompute the last token
            view.rollback(len(ctx.token_ids) - 1)
        gap = len(ctx.token_ids) - view.num_cached
        t0 = time.perf_counter()
        root = view.forward(ctx.token_ids[view.num_cached :], last_only=True)[-1, : ctx.vocab_size]
        catch_up_s = (time.perf_counter() - t0) * (gap - 1) / gap if gap > 2 else 0.0  # see Draft.catch_up_s
        if self.config.kind == "static":
            draft = self._static(ctx, root, max_tokens)
        else:
            draft = self._dynamic(ctx, root, max_tokens)
        ctx.state["tree_region"], self._view = self._region, None
        return dataclasses.replace(draft, catch_up_s=catch_up_s)

    def observe(self, batch, results) -> None:
        """Keep the accepted path's draft-cache entries (those that were fed), drop the other nodes."""
        for ctx, result in zip(batch, results):
            region = ctx.state.get("tree_region") or []
            view = self._bound().row(ctx.slot)
            n = int(result.num_accepted[0])
            fed = []
            for node in result.kept_nodes[0, :n].tolist():
                if node >= len(region) or region[node] < 0:
                    break
                fed.append(region[node])
            if view.has_pending_tree:
                view.keep_tree_path(fed)
            view.sync(ctx.token_ids)

    # Scoring ---------------------------------------------------------------------

    def _dist(self, logits: torch.Tensor, ctx: ProposeContext, paths: list[list[int]]) -> torch.Tensor:
        """[n, V] candidate scores: q after the request's processing with each node's own path of
        draft tokens (greedy: the softmax of the processed logits)."""
        return torch.stack([ctx.draft_dist(row, path) for row, path in zip(logits, paths)])

    def _feed(self, tokens: list[int], region_parents: list[int], ctx: ProposeContext,
              paths: list[list[int]]) -> torch.Tensor:
        """Run the draft on nodes (parents among the fed nodes); [n, V] candidate distributions
        (``paths[i]``: the draft tokens from the root to node i, itself included)."""
        logits = self._view.forward_tree(tokens, region_parents)[:, : ctx.vocab_size]
        return self._dist(logits, ctx, paths)

    # Static ----------------------------------------------------------------------

    def _static(self, ctx: ProposeContext, root_logits: torch.Tensor, max_tokens: int) -> Draft:
        shape = [p for p in self._shape if len(p) <= max_tokens]
        sampled = self.config.sampled_candidates and not ctx.params.greedy
        index = {(): -1}
        has_kids = {p[:-1] for p in shape}
        tokens, parents, rows, self._region = [], [], [], []
        dists = {(): self._dist(root_logits.unsqueeze(0), ctx, [[]])[0]}
        fed = 0
        for depth in range(1, max((len(p) for p in shape), default=0) + 1):
            level = [p for p in shape if len(p) == depth]
            for parent_path in dict.fromkeys(p[:-1] for p in level):  # parents in order
                if parent_path not in dists:  # the parent itself was not drafted (q had too few tokens)
                    continue
                kids = [p for p in level if p[:-1] == parent_path]
                toks, qrows = _children(dists[parent_path], len(kids), sampled, ctx.generator,
                                        _coupled_noise(ctx, len(parent_path)))
                for path, tok, q in zip(kids, toks, qrows):
                    index[path] = len(tokens)
                    tokens.append(tok)
                    parents.append(index[parent_path])
                    rows.append(q)
                    self._region.append(-1)
            expand = [p for p in level if p in has_kids and p in index]
            if expand:
                region_parents = [self._region[index[p[:-1]]] if p[:-1] else -1 for p in expand]
                token_paths = [[tokens[index[p[:d]]] for d in range(1, len(p) + 1)] for p in expand]
                out = self._feed([tokens[index[p]] for p in expand], region_parents, ctx, token_paths)
                for i, p in enumerate(expand):
                    dists[p] = out[i]
                    self._region[index[p]] = fed + i
                fed += len(expand)
        probs = torch.stack(rows).unsqueeze(0) if sampled and rows else None
        return _draft(tokens, parents, probs)

    # Dynamic (EAGLE-2) -----------------------------------------------------------

    def _dynamic(self, ctx: ProposeContext, root_logits: torch.Tensor, max_tokens: int) -> Draft:
        cfg = self.config
        depth_cap = min(cfg.max_depth, max_tokens)
        tokens, parents, scores, depths, self._region = [], [], [], [], []
        frontier = [(-1, 1.0, self._dist(root_logits.unsqueeze(0), ctx, [[]])[0])]  # (node, score, q at the node)
        fed = 0
        for depth in range(1, depth_cap + 1):
            new = []
            for node, score, q in frontier:
                top = torch.topk(q, min(cfg.top_k, q.shape[-1]))
                for prob, tok in zip(top.values.tolist(), top.indices.tolist()):
                    if not prob > 0.0:  # also NaN: nothing the request may generate has draft mass
                        break
                    new.append(len(tokens))
                    tokens.append(tok)
                    parents.append(node)
                    scores.append(score * prob)
                    depths.append(depth)
                    self._region.append(-1)
            if depth == depth_cap or not new:
                break
            expand = heapq.nlargest(cfg.top_k, new, key=lambda i: scores[i])
            region_parents = [self._region[parents[i]] if parents[i] >= 0 else -1 for i in expand]
            out = self._feed([tokens[i] for i in expand], region_parents, ctx, [_path(tokens, parents, i) for i in expand])
            for j, i in enumerate(expand):
                self._region[i] = fed + j
            fed += len(expand)
            frontier = [(i, scores[i], out[j]) for j, i in enumerate(expand)]
        keep = sorted(range(len(tokens)), key=lambda i: (-scores[i], depths[i], i))[: cfg.num_nodes]
        order = sorted(keep, key=lambda i: (depths[i], i))  # breadth-first
        new_index = {old: new for new, old in enumerate(order)}
        self._region = [self._region[i] for i in order]
        return _draft([tokens[i] for i in order], [new_index.get(parents[i], -1) for i in order], None)


def _coupled_noise(ctx: ProposeContext, depth: int) -> torch.Tensor | None:
    """In the coupled mode, the [V] exponential noise E of the output position ``depth`` tokens past the
    committed ones (the target's own noise there), else None."""
    if ctx.noise is None:
        return None
    return ctx.noise.at(len(ctx.token_ids) - ctx.num_prompt_tokens + depth)


def _children(q: torch.Tensor, k: int, sampled: bool, generator: torch.Generator,
              noise: torch.Tensor | None = None) -> tuple[list[int], list]:
    """k candidate tokens from [V] q: top-k, or k draws without replacement (Gumbel-top-k). In the
    coupled mode ``noise`` is the position's own [V] Gumbel noise, so the first child is the token
    the target picks when it agrees with q.

    Returns:
        (tokens, rows): rows[i] is the [V] law child i was drawn from given the earlier
        siblings (q without them, renormalised) when sampled, else None. Fewer than k
        tokens when q has fewer non-zero entries.
    """
    k = min(k, int((q > 0).sum()))
    if not sampled:
        return torch.topk(q, k).indices.tolist(), [None] * k
    if noise is not None:
        keys = torch.where(q > 0, q.double().log() - noise[: q.shape[-1]].log(),  # log q + Gumbel, G = -log E
                           torch.tensor(float("-inf"), dtype=torch.float64))
    else:
        u = torch.rand(q.shape, generator=generator, dtype=torch.float64).clamp_min_(1e-300)
        keys = q.double().log() - (-u.log()).log()  # log q + Gumbel noise
    toks = torch.topk(keys, k).indices.tolist()
    rows, rest = [], q.clone()
    for tok in toks:
        rows.append(rest / rest.sum())
        rest[tok] = 0.0
    return toks, rows


def _path(tokens: list[int], parents: list[int], node: int) -> list[int]:
    """The draft tokens from the root to ``node``, itself included."""
    out = []
    while node >= 0:
        out.append(tokens[node])
        node = parents[node]
    return out[::-1]


def _draft(tokens: list[int], parents: list[int], probs: torch.Tensor | None) -> Draft:
    if not tokens:
        return Draft.empty()
    return Draft(
        token_ids=torch.tensor([tokens], dtype=torch.int64),
        parents=torch.tensor([parents], dtype=torch.int64),
        draft_probs=probs,
    )


__all__ = ["TREE_KINDS", "TreeDraftConfig", "TreeDraftProposer", "static_shape"]
