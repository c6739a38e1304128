"""Reference verifiers, one row at a time (the engine uses ``verify.verify_chains``): test oracles.

Greedy: keep draft tokens while each equals the target's argmax. Sampling (Leviathan et al. 2023,
Algorithm 1): keep x_i with probability min(1, p_i(x_i) / q_i(x_i)), recovered token from the residual
at the first rejection, bonus from p_K when every token is kept.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdecode.types import VerifyResult
from specdecode import verify
from specdecode.verify import _result


def verify_greedy(draft_ids: torch.Tensor, target_logits: torch.Tensor) -> VerifyResult:
    """Greedy chain verification.

    Args:
        draft_ids: [B, K] int64 draft tokens (K may be 0).
        target_logits: [B, K+1, V] target logits; row i scores the token after
            draft position i-1 (row 0 follows the last committed token).

    Returns:
        VerifyResult with num_accepted [B] and new_token_ids [B, K+1].
    """
    target_ids = target_logits.argmax(-1)  # [B, K+1]
    match = (draft_ids == target_ids[:, :-1]).to(torch.int64)
    num_accepted = match.cumprod(dim=1).sum(dim=1)  # [B]
    next_ids = target_ids.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    return _result(num_accepted, draft_ids, next_ids)


def verify_sampling(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generators: Sequence[torch.Generator],
) -> VerifyResult:
    """Lossless speculative sampling over a chain.

    Args:
        draft_ids: [B, K] int64 draft tokens.
        draft_probs: [B, K, V] float32 q each draft token was drawn from, or None
            for a deterministic drafter (q one-hot).
        target_probs: [B, K+1, V] float32 p after the same temperature / top-k / top-p.
        generators: one ``torch.Generator`` per row (a request's own randomness).

    Returns:
        VerifyResult; the committed tokens are distributed exactly as the target's
        own sampling (Leviathan et al. 2023, Theorem 3.5).
    """
    b, k = draft_ids.shape
    num_accepted = torch.empty(b, dtype=torch.int64)
    next_ids = torch.empty(b, dtype=torch.int64)
    for row in range(b):
        n, tok = _verify_row(
            draft_ids[row],
            None if draft_probs is None else draft_probs[row],
            target_probs[row],
            generators[row],
        )
        num_accepted[row] = n
        next_ids[row] = tok
    return _result(num_accepted, draft_ids, next_ids)


def _verify_row(
    draft_ids: torch.Tensor,  # [K] int64
    draft_probs: torch.Tensor | None,  # [K, V] float32 or None
    target_probs: torch.Tensor,  # [K+1, V] float32
    generator: torch.Generator,
) -> tuple[int, int]:
    k = draft_ids.shape[0]
    idx = torch.arange(k)
    p_tok = target_probs[idx, draft_ids]  # [K]
    q_tok = torch.ones(k) if draft_probs is None else draft_probs[idx, draft_ids]
    u = torch.rand(k, generator=generator)
    accepted = (u * q_tok < p_tok).to(torch.int64)
    n = int(accepted.cumprod(0).sum())
    if n == k:
        return n, int(torch.multinomial(target_probs[k], 1, generator=generator))
    residual = verify.residual_distribution(  # looked up at call time (negative controls patch it)
        target_probs[n], None if draft_probs is None else draft_probs[n], int(draft_ids[n])
    )
    return n, int(torch.multinomial(residual, 1, generator=generator))
