"""What the engine does to a proposer's drafts before verification: each row's draft length, the cut of
tokens a request could never generate, and the checks of the proposer contract (shapes, ids, draft_probs)."""

from __future__ import annotations

import dataclasses

import torch

from specdecode.request import Request
from specdecode.tree import tree_depth
from specdecode.types import Draft


def row_gamma(row: Request, gamma: int) -> int:
    """The draft length of one row this step: 0 with speculation off for it, its own gamma when it
    set one, else the policy's."""
    spec = row.speculation
    if not spec.enabled:
        return 0
    return spec.num_speculative_tokens if spec.num_speculative_tokens is not None else gamma


def follows_policy(row: Request) -> bool:
    """Whether the draft-length policy decides this row's draft (speculation on, no gamma of its own) and learns
    from its steps."""
    return row.speculation.enabled and row.speculation.num_speculative_tokens is None


def cut_draft(row: Request, d: Draft) -> Draft:
    """Drop draft tokens the request could never generate (a banned token, a stop token before
    min_tokens, a token the grammar forbids) before verification: a deterministic chain ends before
    the first one. Cutting changes no output distribution there: q is a point mass, verification
    would reject such a token (target probability 0) and sample from p at that position, which is
    what the shortened chain's next position does. A sampling drafter's chain is not cut (its q,
    processed like p, gives such tokens no mass; a q that did would make a cut depend on the draw,
    and verification, not a cut, is then exact), nor is a token tree (the drafter's own cache maps
    its nodes): verification rejects such nodes."""
    n = d.num_tokens
    if not n or d.draft_probs is not None or not row.sampler.active:
        return d
    if d.is_chain():
        keep = row.sampler.valid_prefix(d.token_ids[0].tolist())
        if keep == n:
            return d
        return d.prefix(keep) if keep else dataclasses.replace(Draft.empty(), catch_up_s=d.catch_up_s)
    return d  # a token tree is not cut (the drafter's own cache maps its nodes); such nodes are rejected


#: Most draft nodes a row may propose per step (the slot cache's scratch columns hold them past the context).
MAX_DRAFT_NODES = 128


def draft_problem(d: Draft, cap: int, vocab: int, trees: bool) -> str | None:
    """Why a row's draft breaks the proposer contract, or None."""
    if not isinstance(d, Draft) or not isinstance(d.token_ids, torch.Tensor):
        return f"expected a Draft with a token_ids tensor, got {type(d).__name__}"
    ids = d.token_ids
    if ids.ndim != 2 or ids.shape[0] != 1 or ids.dtype != torch.int64:
        return f"token_ids must be [1, N] int64, got {list(ids.shape)} {ids.dtype}"
    n = ids.shape[1]
    if d.parents.shape != ids.shape:
        return f"parents {list(d.parents.shape)} must match token_ids {list(ids.shape)}"
    if n == 0:
        return None
    if n > MAX_DRAFT_NODES:
        return f"{n} draft nodes; at most {MAX_DRAFT_NODES} per row"
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        return f"draft token ids must be in [0, {vocab}); got {lo if lo < 0 else hi}"
    if d.draft_probs is not None:
        problem = _draft_probs_problem(d.draft_probs, ids, vocab)
        if problem is not None:
            return problem
    parents = d.parents[0]
    if trees:
        ok = bool(((parents >= -1) & (parents < torch.arange(n))).all())
        if not ok:
            return "parents must satisfy -1 <= parents[i] < i (breadth-first token tree)"
        depth = tree_depth(parents)
    else:
        if not torch.equal(parents, torch.arange(-1, n - 1)):
            return "a proposer without produces_trees must return chains (parents -1, 0, 1, ...)"
        depth = n
    if depth > cap:
        return f"drafted {depth} levels; at most {cap} were asked for"
    return None


#: How far a row of draft_probs may sum from 1 (a float32 softmax over any vocabulary sums within ~1e-6).
DRAFT_PROBS_SUM_TOLERANCE = 1e-3


def _draft_probs_problem(q, ids: torch.Tensor, vocab: int) -> str | None:
    """Why a row's draft_probs q (``[1, N, <= V]``, the law each of its ``ids`` [1, N] was drawn from) is not
    one, or None: every entry finite and >= 0, every node's row summing to 1, each drafted token possible.
    Verification reads q as given (an all-zero or NaN row as a deterministic drafter's, q(x) in ratios and
    residuals), so a q that is not a distribution would bias the output silently: refused here instead."""
    n = ids.shape[1]
    if not isinstance(q, torch.Tensor) or not q.is_floating_point():
        return f"draft_probs must be a float tensor, got {type(q).__name__ if not isinstance(q, torch.Tensor) else q.dtype}"
    if q.ndim != 3 or q.shape[:2] != ids.shape or q.shape[2] > vocab:
        return f"draft_probs must be [1, {n}, <= {vocab}], got {list(q.shape)}"
    rows = q[0].float()  # [N, V']
    sums, low = rows.sum(-1), rows.amin(-1)  # [N] each: two cheap reductions; NaN / inf make the sum non-finite
    if bool((~((sums - 1.0).abs() <= DRAFT_PROBS_SUM_TOLERANCE) | (low < 0)).any()):  # then say which rule broke
        finite = torch.isfinite(rows).all(-1)  # [N]
        if not bool(finite.all()):
            return f"draft_probs must be finite; node {int((~finite).nonzero()[0, 0])}'s row has NaN or inf"
        if bool((low < 0).any()):
            node = int(low.argmin())
            return f"draft_probs must be >= 0; node {node}'s row has a negative entry ({float(low[node]):.4g})"
        node = int((sums - 1.0).abs().argmax())
        return (f"each node's draft_probs row must sum to 1 (within {DRAFT_PROBS_SUM_TOLERANCE:g}); node {node}'s "
                f"sums to {float(sums[node]):.6g}")
    if bool((q[0].gather(1, ids[0].unsqueeze(1).clamp(max=q.shape[2] - 1)) <= 0).any()) or ids.max() >= q.shape[2]:
        return "a drafted token has probability 0 under its own draft_probs (q must be the law it was drawn from)"
    return None
