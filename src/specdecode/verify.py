"""Chain verification: which draft tokens to keep, and the token that follows.

Pure functions over tensors. Shapes: B batch, K draft length, V vocabulary. :func:`verify_chains`
verifies every row of a batch at once (greedy and sampled rows together); ``tests/oracles.py`` keeps
a row-at-a-time reference the tests compare it with.

- Greedy: keep draft tokens while each equals the target's argmax; then append
  the target's argmax at the first mismatch (or after the last draft token).
- Sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, Algorithm 2):
  keep draft token x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first
  rejection sample the *recovered* token from norm(max(0, p_i - q_i)); if every
  token is kept sample a *bonus* token from p_K. A deterministic drafter has q
  one-hot on its token, so acceptance is p(x) and the residual is p without x.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdecode.types import PAD_TOKEN_ID, VerifyResult


def _result(num_accepted: torch.Tensor, draft_ids: torch.Tensor, next_ids: torch.Tensor) -> VerifyResult:
    """Assemble a VerifyResult from [B] accepted counts, [B, K] drafts, [B] next tokens."""
    b, k = draft_ids.shape
    pos = torch.arange(k + 1).expand(b, k + 1)
    n = num_accepted.unsqueeze(1)
    padded = torch.cat([draft_ids, torch.full((b, 1), PAD_TOKEN_ID, dtype=torch.int64)], dim=1)
    new_ids = torch.where(pos < n, padded, torch.full_like(padded, PAD_TOKEN_ID))
    new_ids = new_ids.scatter(1, n, next_ids.unsqueeze(1))
    kept = torch.where(pos < n, pos, torch.full_like(pos, -1))
    return VerifyResult(num_accepted=num_accepted, new_token_ids=new_ids, kept_nodes=kept)


def residual_distribution(p: torch.Tensor, q: torch.Tensor | None, draft_token: int) -> torch.Tensor:
    """norm(max(0, p - q)) for [V] float32 p and q (q None = one-hot on ``draft_token``).

    If the residual has no mass (p == q up to rounding, so a rejection had
    probability ~0) falls back to p, which is then the exact conditional.
    """
    if q is None:
        residual = p.clone()
        residual[draft_token] = 0.0
    else:
        residual = (p - q).clamp_min(0.0)
    total = residual.sum()
    if not bool(total > 1e-12):
        return p
    return residual / total


def verify_chains(
    draft_ids: torch.Tensor,
    num_drafted: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    greedy: torch.Tensor,
    uniforms: torch.Tensor,
) -> VerifyResult:
    """Greedy and sampled rows of a batch verified together (vectorised; Leviathan et al. 2023, Algorithm 1).

    Row i drafted ``num_drafted[i]`` = k_i tokens. A greedy row keeps draft tokens while each is the
    target's argmax and appends the argmax after them. A sampled row keeps x_j with probability
    min(1, p_j(x_j) / q_j(x_j)) using ``uniforms[i, j]``; at the first rejection j the recovered token
    is drawn from norm(max(0, p_j - q_j)), after k_i kept tokens the bonus token from p_{k_i}, both by
    inverse CDF with ``uniforms[i, k_i]``. A row therefore consumes exactly k_i + 1 uniforms from its
    own generator, whatever the rest of the batch is.

    Args:
        draft_ids: [B, K] int64, PAD (-1) past each row's k_i.
        num_drafted: [B] int64 k_i.
        draft_probs: [B, K, V] float32 q (rows or positions without q: zeros = one-hot on the token,
            see ``has_q`` below), or None when no row has q.
        target_probs: [B, K+1, V] float32 p after the request's processing (greedy rows: anything
            whose argmax is the target's argmax, e.g. the raw logits).
        greedy: [B] bool.
        uniforms: [B, K+1] float64 in [0, 1): each row's first k_i + 1 entries are used.

    Returns:
        VerifyResult: num_accepted [B], new_token_ids [B, K+1] (PAD after num_accepted + 1).
    """
    assert draft_ids.ndim == 2 and target_probs.ndim == 3 and uniforms.ndim == 2
    b, k = draft_ids.shape
    v = target_probs.shape[-1]
    pos = torch.arange(k).expand(b, k)
    live = pos < num_drafted.unsqueeze(1)  # [B, K]
    safe_ids = draft_ids.clamp_min(0)
    argmax = target_probs.argmax(-1)  # [B, K+1]
    p_tok = target_probs[:, :k].gather(2, safe_ids.unsqueeze(2)).squeeze(2)  # [B, K]
    if draft_probs is not None:
        q_rows = draft_probs.sum(-1) > 0  # [B, K] positions with a real q
        q_tok = torch.where(q_rows, draft_probs.gather(2, safe_ids.unsqueeze(2)).squeeze(2), 1.0)
    else:
        q_rows = torch.zeros(b, k, dtype=torch.bool)
        q_tok = torch.ones(b, k)
    sampled_ok = uniforms[:, :k] * q_tok.double() < p_tok.double()
    greedy_ok = draft_ids == argmax[:, :k]
    ok = torch.where(greedy.unsqueeze(1), greedy_ok, sampled_ok) & live
    num_accepted = ok.to(torch.int64).cumprod(1).sum(1)  # [B]
    n = num_accepted.unsqueeze(1)
    greedy_tok = argmax.gather(1, n).squeeze(1)
    if bool(greedy.all()):  # no sampled row: no residual to draw from
        return _result(num_accepted, draft_ids, greedy_tok)
    # The final distribution of each sampled row: p at its stop position, minus q (or the draft token) on a rejection.
    p_stop = target_probs.gather(1, n.unsqueeze(2).expand(b, 1, v)).squeeze(1)  # [B, V]
    rejected = num_accepted < num_drafted
    residual = p_stop.clone()
    if k:
        tok_stop = safe_ids.gather(1, n.clamp(max=k - 1)).squeeze(1)  # [B]
        if draft_probs is not None:
            q_stop = draft_probs.gather(1, n.clamp(max=k - 1).unsqueeze(2).expand(b, 1, v)).squeeze(1)
            has_q = q_rows.gather(1, n.clamp(max=k - 1)).squeeze(1)
        else:
            q_stop, has_q = torch.zeros_like(p_stop), torch.zeros(b, dtype=torch.bool)
        one_hot = torch.nn.functional.one_hot(tok_stop, v).to(p_stop.dtype)
        q_used = torch.where(has_q.unsqueeze(1), q_stop, one_hot)
        cut = (p_stop - q_used).clamp_min(0.0)
        mass = cut.sum(-1, keepdim=True)
        # no residual mass: p == q up to rounding, a rejection had probability ~0; p is then exact
        cut = torch.where(mass > 1e-12, cut, p_stop)
        residual = torch.where(rejected.unsqueeze(1), cut, p_stop)
    cdf = residual.double().cumsum(-1)
    u_final = uniforms.gather(1, num_drafted.unsqueeze(1)).squeeze(1)  # [B]: each row's (k_i + 1)-th uniform
    sampled_tok = torch.searchsorted(cdf, (u_final * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1).clamp(max=v - 1)
    next_ids = torch.where(greedy, greedy_tok, sampled_tok)
    return _result(num_accepted, draft_ids, next_ids)


def verify_block(
    draft_ids: torch.Tensor,
    num_drafted: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
) -> VerifyResult:
    """Block verification of sampled chains (Sun et al. 2024). Same arguments as :func:`verify_chains`
    for sampled rows (no greedy rows)."""
    raise NotImplementedError("block verification: being written")
