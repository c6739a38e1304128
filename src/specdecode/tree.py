"""Token trees: structure, attention masks, position ids and lossless tree verification.

Pure functions. A draft tree of N nodes is given by ``parents`` [N] (int64 or a
list): ``parents[i]`` is the index of node i's parent, -1 for a child of the
last committed token (the *root*); nodes come in breadth-first order, so
``parents[i] < i``. A chain is the tree ``-1, 0, 1, ...``. Node depth counts
from 1 (a root child).

The target scores the root and every node in one forward: the input is
``[root, node 0, ..., node N-1]``, node i sits at position ``P + depth(i)``
(P = position of the root) and attends to the committed prefix, the root and
its own ancestors (``tree_attention_mask``).

Verification walks the tree from the root:

- **greedy** (:func:`verify_tree_greedy`): keep the deepest node whose every
  token on its root path is the target's argmax at its parent; the next token
  is the target's argmax after that node. Equal to plain greedy decoding.
- **sampling** (:func:`verify_tree_sampling`): multi-candidate speculative
  sampling (SpecInfer, Miao et al. 2024, Algorithm 2 "multi-step speculative
  sampling"; Jeon et al. 2024, recursive rejection sampling). At a node with
  target distribution p, try its children c_1, c_2, ... in order with
  r_1 = p: accept c_i's token x_i with probability min(1, r_i(x_i) / q_i(x_i)),
  else r_{i+1} = norm(max(0, r_i - q_i)). If every child is rejected, sample
  the next token from the last residual (a leaf: from p, the bonus token).

Losslessness: ``q_i`` must be the distribution x_i was drawn from *given
everything the verifier conditions on* (the path, the earlier siblings), and
the tree's shape must not depend on the sampled tokens' own values. Then each
try is a one-candidate speculative-sampling step from target r_i, whose
outcome is distributed as r_i (accepted with mass min(r_i, q_i), otherwise
handed on to the residual), so by induction over the siblings the token
leaving each node is distributed exactly as p, and by induction over depth
the committed sequence follows the target (Leviathan et al. 2023, Thm 3.5,
applied per try). The drafters use three variants:

1. i.i.d. candidates: every child drawn from the parent's q (SpecInfer MSS):
   ``q_i = q``;
2. without replacement from q (Gumbel-top-k): ``q_i`` = q with x_1..x_{i-1}
   removed, renormalised;
3. deterministic candidates (n-gram, suffix trees, top-k of a draft model,
   EAGLE-2 dynamic trees): q_i one-hot on x_i, so acceptance is r_i(x_i) and
   the residual is r_i without x_i: the without-replacement form, where child
   i is kept with probability p(x_i) / (1 - sum of p over the distinct earlier
   siblings), i.e. the token leaving the node is exactly p-distributed.

Treating top-k *chosen* candidates as if they had been *sampled* from q (q_i = q
for a deterministic token) is not lossless; ``tests/test_tree.py`` keeps that
as a negative control.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdecode.sampling import argmax
from specdecode.types import PAD_TOKEN_ID, SpecDecodeError, VerifyResult
from specdecode.verify import residual_distribution


class InvalidTreeError(SpecDecodeError):
    """A parents array is not a breadth-first tree (a parent index >= its child's or < -1)."""


# --------------------------------------------------------------------------- structure


def as_parent_list(parents: Sequence[int] | torch.Tensor) -> list[int]:
    """[N] int parents (tensor or list) -> list of ints, checked: -1 <= parents[i] < i.

    Raises:
        InvalidTreeError: a parent index out of range (not breadth-first / not a tree).
    """
    plist = parents.tolist() if isinstance(parents, torch.Tensor) else [int(p) for p in parents]
    for i, p in enumerate(plist):
        if not -1 <= p < i:
            raise InvalidTreeError(f"parents[{i}] = {p}: each node's parent must be -1 (root) or an earlier node")
    return plist


def node_depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node (1 = child of the root) for a checked parent list [N]."""
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def tree_depth(parents: Sequence[int] | torch.Tensor) -> int:
    """Depth of the deepest node (0 for an empty tree)."""
    plist = as_parent_list(parents)
    return max(node_depths(plist), default=0)


def is_chain(parents: Sequence[int]) -> bool:
    """True if the parent list is -1, 0, 1, ... (a chain draft)."""
    return all(p == i - 1 for i, p in enumerate(parents))


def children_of(parents: Sequence[int]) -> dict[int, list[int]]:
    """{parent index (-1 = root): [children in order]} for a checked parent list."""
    kids: dict[int, list[int]] = {-1: []}
    for i, p in enumerate(parents):
        kids.setdefault(p, []).append(i)
    return kids


def ancestor_matrix(parents: Sequence[int]) -> torch.Tensor:
    """[N, N] bool: ``A[i, j]`` is True if node j is node i or one of its ancestors."""
    n = len(parents)
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] = anc[p]
        anc[i, i] = True
    return anc


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """Node indices from the root's child down to ``node`` (empty for node -1)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


# --------------------------------------------------------------------------- target inputs


def tree_attention_mask(parents: Sequence[int], num_prefix: int, num_new: int | None = None) -> torch.Tensor:
    """Boolean attention mask of the last ``num_new`` nodes of a tree continuing a prefix.

    Args:
        parents: [T] checked parent list of every tree node in the cache region
            (earlier nodes already cached, then the new ones); -1 = child of the prefix.
        num_prefix: P, cached tokens before the tree (all visible to every node).
        num_new: rows to return (default: all T nodes).

    Returns:
        [num_new, P + T] bool, True = may attend: the whole prefix, the node itself
        and its ancestors.
    """
    t = len(parents)
    n = t if num_new is None else num_new
    anc = ancestor_matrix(parents)[t - n :]  # [n, T]
    return torch.cat([torch.ones(n, num_prefix, dtype=torch.bool), anc], dim=1)


def tree_inputs(parents: Sequence[int] | torch.Tensor) -> tuple[list[int], list[int]]:
    """Parents and position offsets of the verification input ``[root, node 0 .. node N-1]``.

    Returns:
        (input_parents [N+1]: -1 for the root, node parents shifted by one;
         offsets [N+1]: 0 for the root, node depths), positions = root position + offsets.
    """
    plist = as_parent_list(parents)
    return [-1, *(p + 1 for p in plist)], [0, *node_depths(plist)]


# --------------------------------------------------------------------------- verification


def _result(rows: list[tuple[list[int], list[int], int]], width: int) -> VerifyResult:
    """VerifyResult from per-row (path node indices, path tokens, next token)."""
    b = len(rows)
    num_accepted = torch.tensor([len(path) for path, _, _ in rows], dtype=torch.int64)
    new_ids = torch.full((b, width + 1), PAD_TOKEN_ID, dtype=torch.int64)
    kept = torch.full((b, width + 1), -1, dtype=torch.int64)
    for r, (path, toks, nxt) in enumerate(rows):
        a = len(path)
        if a:
            kept[r, :a] = torch.tensor(path)
            new_ids[r, :a] = torch.tensor(toks)
        new_ids[r, a] = nxt
    return VerifyResult(num_accepted=num_accepted, new_token_ids=new_ids, kept_nodes=kept)


def verify_tree_greedy(token_ids: torch.Tensor, parents: torch.Tensor, target_logits: torch.Tensor) -> VerifyResult:
    """Greedy tree verification: the longest root path of target-argmax tokens.

    Args:
        token_ids: [B, N] int64 draft tokens (N may be 0).
        parents: [B, N] int64 breadth-first parents (-1 = root child).
        target_logits: [B, N+1, V] target logits of the input ``[root, node 0, ...]``:
            row 0 scores the token after the root, row i+1 the token after node i.

    Returns:
        VerifyResult: num_accepted [B] = accepted depth; new_token_ids [B, D+1]
        (D = deepest tree of the batch) = accepted path tokens then the target's
        argmax after the path (PAD after); kept_nodes [B, D+1] = the path's node indices.
        Among equal-depth candidates (duplicate tokens) the first in breadth-first order wins.

    Raises:
        InvalidTreeError: parents not breadth-first.
    """
    rows, width = [], 0
    top = argmax(target_logits)  # [B, N+1]: the target's choice after each node
    for r in range(token_ids.shape[0]):
        plist = as_parent_list(parents[r])
        depths = node_depths(plist)
        width = max(width, max(depths, default=0))
        if not plist:
            rows.append(([], [], int(top[r, 0])))
            continue
        parent_rows = torch.tensor(plist) + 1
        match = token_ids[r] == top[r, parent_rows]  # [N]: token is the argmax at its parent
        valid = ~(ancestor_matrix(plist) & ~match).any(1)  # every node on the root path matches
        score = torch.where(valid, torch.tensor(depths), torch.zeros(len(plist), dtype=torch.int64))
        best, best_depth = (int(x) for x in torch.stack([score.argmax(), score.max()]).tolist())
        path = path_to(plist, best) if best_depth > 0 else []
        nxt = int(top[r, path[-1] + 1]) if path else int(top[r, 0])
        rows.append((path, token_ids[r, path].tolist(), nxt))
    return _result(rows, width)


def verify_tree_sampling(
    token_ids: torch.Tensor,
    parents: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generators: Sequence[torch.Generator],
) -> VerifyResult:
    """Lossless multi-candidate speculative sampling over a token tree (see the module docstring).

    Args:
        token_ids: [B, N] int64 draft tokens.
        parents: [B, N] int64 breadth-first parents (-1 = root child).
        draft_probs: [B, N, V] float32, row i = the distribution node i's token was drawn
            from given its path and earlier siblings; None = deterministic candidates
            (every q one-hot: the without-replacement form).
        target_probs: [B, N+1, V] float32 p of the input ``[root, node 0, ...]`` after the
            same processing as q (``sampling.RequestSampler`` along the node's path).
        generators: one ``torch.Generator`` per row.

    Returns:
        VerifyResult as :func:`verify_tree_greedy`; the committed tokens are distributed
        exactly as the target's own sampling.

    Raises:
        InvalidTreeError: parents not breadth-first.
    """
    rows, width = [], 0
    for r in range(token_ids.shape[0]):
        plist = as_parent_list(parents[r])
        width = max(width, max(node_depths(plist), default=0))
        q = None if draft_probs is None else draft_probs[r]
        rows.append(_sample_row(token_ids[r], plist, q, target_probs[r], generators[r]))
    return _result(rows, width)


def _sample_row(
    tokens: torch.Tensor,  # [N] int64
    plist: list[int],
    q: torch.Tensor | None,  # [N, V] float32 or None
    p: torch.Tensor,  # [N+1, V] float32
    generator: torch.Generator,
) -> tuple[list[int], list[int], int]:
    n = len(plist)
    kids = children_of(plist)
    toks = tokens.tolist()
    accept = _acceptance(toks, plist, kids, q, p, torch.rand(n, generator=generator)) if n else []
    node, path = -1, []
    while True:  # walk: at each node, the first accepted child wins
        nxt = next((c for c in kids.get(node, ()) if accept[c]), None)
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    final = _final_residual(p[node + 1], kids.get(node, []), toks, q)
    return path, [toks[c] for c in path], int(torch.multinomial(final, 1, generator=generator))


def _acceptance(
    toks: list[int], plist: list[int], kids: dict[int, list[int]],
    q: torch.Tensor | None, p: torch.Tensor, u: torch.Tensor,
) -> list[bool]:
    """[N] whether each node's try succeeds *if reached* (u_i q_i(x_i) < r_i(x_i)).

    r_i depends only on the parent's p and the earlier siblings' q, never on random
    outcomes, so every try is decided up front from independent uniforms u [N].
    """
    n = len(toks)
    idx = torch.arange(n)
    if q is None:  # one-hot q: r_i(x_i) = p(x_i) / (1 - mass of distinct earlier siblings), 0 if repeated
        px = p[torch.tensor(plist) + 1, torch.tensor(toks)].tolist()  # [N] p at the parent
        r_at = [0.0] * n
        for children in kids.values():
            removed, seen = 0.0, set()
            for c in children:
                if toks[c] not in seen:
                    r_at[c] = px[c] / max(1.0 - removed, 1e-30)
                    seen.add(toks[c])
                    removed += px[c]
        return [ui < ri for ui, ri in zip(u.tolist(), r_at)]
    r_at = torch.zeros(n)
    for parent, children in kids.items():
        r = p[parent + 1]
        for c in children:
            r_at[c] = r[toks[c]]
            r = residual_distribution(r, q[c], toks[c])
    q_at = q[idx, torch.tensor(toks)]
    return (u * q_at < r_at).tolist()


def _final_residual(p: torch.Tensor, children: list[int], toks: list[int], q: torch.Tensor | None) -> torch.Tensor:
    """The distribution left at a node after all its children were rejected ([V]; p at a leaf)."""
    if not children:
        return p
    if q is None:
        r = p.clone()
        r[torch.tensor([toks[c] for c in children])] = 0.0
        total = r.sum()
        return r / total if bool(total > 1e-12) else p
    r = p
    for c in children:
        r = residual_distribution(r, q[c], toks[c])
    return r
