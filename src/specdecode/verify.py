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
- Block verification of sampled chains (Sun et al. 2024, Algorithm 2; :func:`verify_block`):
  the block is judged jointly, keeping X_1..X_tau for the largest tau whose uniform is below its
  threshold, then a token from a weighted residual. The same output distribution and uniforms;
  never fewer kept tokens in expectation (equal for one-token drafts and for deterministic
  drafters, where token level is already optimal).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from specdecode.sampling import argmax
from specdecode.types import PAD_TOKEN_ID, VerifyResult


def _result(num_accepted: torch.Tensor, draft_ids: torch.Tensor, next_ids: torch.Tensor) -> VerifyResult:
    """Assemble a VerifyResult (on ``draft_ids``' device) from [B] int64 accepted counts, [B, K] int64 drafts and
    [B] int64 next tokens.

    In numpy: the eight small torch operations this took cost about 100 us per verification, against a SmolLM2
    decoding step of about 2 ms."""
    n = num_accepted.cpu().numpy().astype(np.int64)
    ids = draft_ids.cpu().numpy()
    b, k = ids.shape
    pos = np.arange(k + 1)[None, :]
    new_ids = np.full((b, k + 1), PAD_TOKEN_ID, dtype=np.int64)
    new_ids[:, :k] = np.where(pos[:, :k] < n[:, None], ids, PAD_TOKEN_ID)
    new_ids[np.arange(b), n] = next_ids.cpu().numpy()
    kept = np.where(pos < n[:, None], pos, -1).astype(np.int64)
    device = draft_ids.device
    return VerifyResult(num_accepted=torch.from_numpy(n).to(device), new_token_ids=torch.from_numpy(new_ids).to(device),
                        kept_nodes=torch.from_numpy(np.ascontiguousarray(kept)).to(device))


def _greedy_accepted(draft_ids: torch.Tensor, num_drafted: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    """How many draft tokens each greedy row keeps: [B] int64 on ``draft_ids``' device.

    A row keeps its drafts ``draft_ids`` [B, K] int64 while each equals the target's argmax ``best`` [B, K+1] int64
    at its position, up to the first that does not or its k_i (``num_drafted`` [B] int64). The one greedy rule of
    :func:`verify_chains`, for all-greedy batches and for the greedy rows of mixed ones (numpy: about 10 us)."""
    k = draft_ids.shape[1]
    live = np.arange(k)[None, :] < num_drafted.cpu().numpy()[:, None]
    kept = (draft_ids.cpu().numpy() == best.cpu().numpy()[:, :k]) & live
    return torch.from_numpy(np.cumprod(kept, axis=1).sum(1).astype(np.int64)).to(draft_ids.device)


def greedy_chain_results(draft_ids: np.ndarray, num_drafted: np.ndarray, logits: torch.Tensor) -> list[VerifyResult]:
    """Greedy chains verified on raw logits, one VerifyResult [1, k_i + 1] per row: :func:`verify_chains`' greedy
    rule (:func:`_greedy_accepted` on the target's :func:`~specdecode.sampling.argmax`, assembled by :func:`_result`)
    for batches whose rows are all greedy without logit processing, from numpy draft ids.

    Args:
        draft_ids: [B, K] int64, PAD (-1) past each row's k_i.
        num_drafted: [B] int64 k_i.
        logits: [B, K+1, V] float target logits (any values whose argmax is the target's).

    Returns:
        per row, VerifyResult with num_accepted [1], new_token_ids [1, k_i + 1], kept_nodes [1, k_i + 1].
    """
    assert draft_ids.ndim == 2 and logits.ndim == 3 and logits.shape[1] >= draft_ids.shape[1] + 1
    ids = torch.from_numpy(draft_ids)
    best = argmax(logits)  # [B, K+1]
    n = _greedy_accepted(ids, torch.from_numpy(num_drafted), best)
    return split_rows(_result(n, ids, best.gather(1, n.unsqueeze(1)).squeeze(1)), [int(c) for c in num_drafted])


def split_rows(res: VerifyResult, counts: Sequence[int]) -> list[VerifyResult]:
    """A batch's VerifyResult [B, K+1] as one VerifyResult [1, k_i + 1] per row (``counts``: each row's k_i)."""
    return [VerifyResult(res.num_accepted[i : i + 1], res.new_token_ids[i : i + 1, : k + 1],
                         res.kept_nodes[i : i + 1, : k + 1]) for i, k in enumerate(counts)]


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
        greedy: [B] bool: rows verified by exact match on the target's argmax (greedy rows, and the
            coupled mode's rows, whose target_probs are one-hot on the target's own choices).
        uniforms: [B, K+1] float64 in [0, 1): each row's first k_i + 1 entries are used.

    Returns:
        VerifyResult: num_accepted [B], new_token_ids [B, K+1] (PAD after num_accepted + 1).
    """
    assert draft_ids.ndim == 2 and target_probs.ndim == 3 and uniforms.ndim == 2
    b, k = draft_ids.shape
    best = argmax(target_probs)  # [B, K+1]
    greedy_n = _greedy_accepted(draft_ids, num_drafted, best)  # [B]
    if bool(greedy.all()):  # no sampled row: no acceptance test and no residual to draw from
        return _result(greedy_n, draft_ids, best.gather(1, greedy_n.unsqueeze(1)).squeeze(1))
    v = target_probs.shape[-1]
    pos = torch.arange(k).expand(b, k)
    live = pos < num_drafted.unsqueeze(1)  # [B, K]
    safe_ids = draft_ids.clamp_min(0)
    p_tok = target_probs[:, :k].gather(2, safe_ids.unsqueeze(2)).squeeze(2)  # [B, K]
    if draft_probs is not None:
        q_rows = draft_probs.sum(-1) > 0  # [B, K] positions with a real q
        q_tok = torch.where(q_rows, draft_probs.gather(2, safe_ids.unsqueeze(2)).squeeze(2), 1.0)
    else:
        q_rows = torch.zeros(b, k, dtype=torch.bool)
        q_tok = torch.ones(b, k)
    sampled_ok = (uniforms[:, :k] * q_tok.double() < p_tok.double()) & live
    num_accepted = torch.where(greedy, greedy_n, sampled_ok.to(torch.int64).cumprod(1).sum(1))  # [B]
    n = num_accepted.unsqueeze(1)
    greedy_tok = best.gather(1, n).squeeze(1)
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


def _positive_mass(weights: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
    """sum_x max(0, w p(x) - q(x)) for [B, J] float64 w, [B, J, V] float32 p and q (None = zeros): [B, J] float64.

    Works through the positions a few at a time, so the [B, J, V] difference is never held whole.
    """
    b, j, v = p.shape
    if q is None:
        return weights * p.sum(-1).double()
    out = torch.zeros(b, j, dtype=torch.float64)
    step = max(1, (1 << 22) // max(1, b * v))  # positions per chunk: ~16 MB of float32 temporaries
    for s in range(0, j, step):
        w = weights[:, s : s + step].to(p.dtype).unsqueeze(2)
        out[:, s : s + step] = (w * p[:, s : s + step] - q[:, s : s + step]).clamp_min_(0.0).sum(-1).double()
    return out


def block_stop_probabilities(
    draft_ids: torch.Tensor,
    num_drafted: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The thresholds of block verification (Sun et al. 2024, Algorithm 2), with its weights.

    1-based over draft positions i = 1..k (k = a row's k_i): the weights are w_0 = 1,
    w_i = min(1, w_{i-1} p_i(X_i) / q_i(X_i)); the threshold of position i < k is
    h_i = S_i / (S_i + 1 - w_i) with S_i = sum_x max(0, w_i p_{i+1}(x) - q_{i+1}(x)) (1 when both
    are 0: w_i = 1 and p_{i+1} = q_{i+1}, where a later position is always kept, so any value is
    exact), and h_k = w_k. Here p_i is ``target_probs[:, i - 1]`` and q_i ``draft_probs[:, i - 1]``
    (the distributions of draft token i - 1, 0-based); a position with an all-zero q (or
    ``draft_probs`` None) is a deterministic drafter's, q one-hot on its token.

    Args: as :func:`verify_block` (no uniforms).

    Returns:
        h: [B, K] float64, column c the threshold of position i = c + 1 (0 past k_i: never kept).
        weights: [B, K+1] float64 w_0..w_K (entries past k_i are meaningless).
    """
    assert draft_ids.ndim == 2 and target_probs.ndim == 3
    b, k = draft_ids.shape
    live = torch.arange(k).expand(b, k) < num_drafted.unsqueeze(1)  # [B, K]
    safe_ids = draft_ids.clamp_min(0)
    p_tok = target_probs[:, :k].gather(2, safe_ids.unsqueeze(2)).squeeze(2).double()  # [B, K]
    if draft_probs is not None:
        has_q = draft_probs.sum(-1) > 0  # [B, K]
        q_tok = torch.where(has_q, draft_probs.gather(2, safe_ids.unsqueeze(2)).squeeze(2).double(), 1.0)
    else:
        has_q = torch.zeros(b, k, dtype=torch.bool)
        q_tok = torch.ones(b, k, dtype=torch.float64)
    p_tok = torch.where(live, p_tok, 0.0)
    weights = torch.ones(b, k + 1, dtype=torch.float64)
    for i in range(k):  # w_i = min(1, w_{i-1} p / q); a token q gave no mass (but p did) has ratio 1
        num = weights[:, i] * p_tok[:, i]
        weights[:, i + 1] = torch.where((num >= q_tok[:, i]) & (num > 0), 1.0,
                                        num / q_tok[:, i].clamp_min(torch.finfo(torch.float64).tiny))
    # S_i for i = 1..K-1 from the distributions of draft token i (0-based): q zeros first, then the one-hot's share
    mass = _positive_mass(weights[:, 1:k], target_probs[:, 1:k], None if draft_probs is None else draft_probs[:, 1:k])
    mass = mass - torch.where(has_q[:, 1:], 0.0, (weights[:, 1:k] * p_tok[:, 1:]).clamp(max=1.0))
    mass = torch.cat([mass.clamp_min(0.0), torch.zeros(b, min(k, 1), dtype=torch.float64)], dim=1)  # [B, K]
    w = weights[:, 1:]
    denom = mass + (1.0 - w)
    inner = torch.where(denom > 0, mass / denom.clamp_min(torch.finfo(torch.float64).tiny), 1.0)
    i = torch.arange(1, k + 1).expand(b, k)
    n = num_drafted.unsqueeze(1)
    h = torch.where(i < n, inner, torch.where(i == n, w, 0.0))
    return h, weights


def verify_block(
    draft_ids: torch.Tensor,
    num_drafted: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
) -> VerifyResult:
    """Block verification of sampled chains, every row of a batch at once (Sun, Mendlovic, Leviathan,
    Aharoni, Beirami, Ro, Suresh 2024, "Block Verification Accelerates Speculative Decoding", Algorithm 2).

    The draft block is verified jointly: with the thresholds h_i and weights w_i of
    :func:`block_stop_probabilities`, a row keeps X_1..X_tau for tau the *largest* i in 1..k with
    eta_i < h_i (0 if none), eta_i = ``uniforms[:, i - 1]``. After tau = k the bonus token is drawn
    from p_{k+1}; otherwise from norm(max(0, w_tau p_{tau+1} - q_{tau+1})) (tau = 0: the usual
    residual; a residual without mass falls back to p_{tau+1}, as :func:`verify_chains` does), by
    inverse CDF with ``uniforms[:, k]``. The output distribution of repeated rounds is the target's;
    the expected number of kept tokens is the largest any valid verifier achieves from the same
    drafts, never below token-level verification (equal at k = 1). A row consumes exactly its first
    k_i + 1 uniforms, the same as :func:`verify_chains`, so the two methods draw the same randomness.

    Args:
        draft_ids: [B, K] int64, PAD (-1) past each row's k_i.
        num_drafted: [B] int64 k_i (0: the next token is sampled from p_0).
        draft_probs: [B, K, V] float32 q; a position whose q is all zeros (or None for every row)
            is a deterministic drafter's, q one-hot on its token.
        target_probs: [B, K+1, V] float32 p after the request's processing; ``target_probs[:, j]``
            is the distribution of the token after j draft tokens.
        uniforms: [B, K+1] float64 in [0, 1): each row's first k_i + 1 entries are used.

    Returns:
        VerifyResult: num_accepted [B], new_token_ids [B, K+1] (PAD after num_accepted + 1).
    """
    assert draft_ids.ndim == 2 and target_probs.ndim == 3 and uniforms.ndim == 2
    b, k = draft_ids.shape
    v = target_probs.shape[-1]
    h, weights = block_stop_probabilities(draft_ids, num_drafted, draft_probs, target_probs)
    kept = uniforms[:, :k] < h  # [B, K]
    num_accepted = (kept.to(torch.int64) * torch.arange(1, k + 1)).amax(1) if k else torch.zeros(b, dtype=torch.int64)
    n = num_accepted.unsqueeze(1)
    p_stop = target_probs.gather(1, n.unsqueeze(2).expand(b, 1, v)).squeeze(1)  # [B, V] p_{tau+1}
    residual = p_stop
    if k:
        at = n.clamp(max=k - 1)
        tok_stop = draft_ids.clamp_min(0).gather(1, at).squeeze(1)  # [B]
        one_hot = torch.nn.functional.one_hot(tok_stop, v).to(p_stop.dtype)
        if draft_probs is not None:
            q_stop = draft_probs.gather(1, at.unsqueeze(2).expand(b, 1, v)).squeeze(1)
            q_used = torch.where((q_stop.sum(-1) > 0).unsqueeze(1), q_stop, one_hot)
        else:
            q_used = one_hot
        w_stop = weights.gather(1, n).to(p_stop.dtype)  # [B, 1] w_tau
        cut = (w_stop * p_stop - q_used).clamp_min(0.0)
        # no residual mass: rounding where a stop had probability ~0; p is then exact
        cut = torch.where(cut.sum(-1, keepdim=True) > 1e-12, cut, p_stop)
        residual = torch.where((num_accepted < num_drafted).unsqueeze(1), cut, p_stop)
    cdf = residual.double().cumsum(-1)
    u_final = uniforms.gather(1, num_drafted.unsqueeze(1)).squeeze(1)  # [B]: each row's (k_i + 1)-th uniform
    next_ids = torch.searchsorted(cdf, (u_final * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1).clamp(max=v - 1)
    return _result(num_accepted, draft_ids, next_ids)
