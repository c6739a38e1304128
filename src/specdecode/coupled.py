"""The coupled sampling mode: every random draw keyed by (seed, position, purpose).

Plain decoding in this mode samples the token at output position t as the Gumbel-max choice
``argmax_x(log p_t(x) + G_t(x))`` with ``G_t`` i.i.d. Gumbel noise drawn from a generator seeded by
a hash of (seed, t, purpose) (Gumbel 1954; the Gumbel-max trick, e.g. Maddison et al. 2014). This is
an exact sample of p_t (up to the 2**-53 resolution of the uniforms): G_t is independent of
everything before t, and the Gumbel-max of ``log p + G`` is distributed as p. Because the noise of a position does not depend on how the position is
reached, speculation can reproduce it exactly:

- a sampling drafter draws its token at position t with the same noise, ``argmax(log q_t + G_t)``
  (so a drafter close to the target usually picks the target's token);
- verification computes the target's own choice at every drafted position, keeps draft tokens while
  they equal it, and commits the target's choice at the first mismatch (or the bonus position).

The committed text is then token for token the text of seeded plain decoding in this mode, for any
drafter, any gamma, any batch and any draft-length policy ("seeds that mean something"), as long as
the target's logits of a token do not depend on how many tokens share its forward: the batch-invariant
forward (bf16 / int8 with the owned forward, ``kv/owned.py``) guarantees it; with float32 a near-tie
can flip, as for greedy decoding. A
deterministic drafter (n-gram, suffix) is accepted with probability p_t(x), as under standard
rejection sampling; a sampling drafter is accepted with the probability that the two Gumbel-max
choices agree, ``P[argmax(log p + G) = argmax(log q + G)]``, which is at most ``sum min(p, q)``
(the standard acceptance), so the default keeps standard rejection sampling for unseeded requests.

The choice is computed as the exponential race ``argmin(E / p)`` with ``E = -log U`` (equivalent to
``argmax(log p + G)`` with ``G = -log E``). Noise comes from ``torch.Generator`` (Mersenne Twister)
seeded with a 63-bit BLAKE2b hash of the key, so it is the same run after run and request after
request; across CPUs only the last bit of the vectorised logarithm could differ.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

#: The purpose of the noise that picks a position's token (target and drafter share it).
TOKEN = "token"


def key(seed: int, position: int, purpose: str = TOKEN) -> int:
    """A 63-bit generator seed for (seed, position, purpose), stable across machines and runs."""
    digest = hashlib.blake2b(f"{seed}:{position}:{purpose}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def exponential(seed: int, position: int, vocab_size: int, purpose: str = TOKEN) -> torch.Tensor:
    """[V] float64 i.i.d. standard exponential noise E for output position ``position`` of request ``seed``.

    The Gumbel-max choice ``argmax(log p + G)`` with ``G = -log E`` is ``argmin(E / p)`` (the
    exponential race): one logarithm per token instead of two, no logarithm of p. Float64 uniforms
    (53-bit steps) keep E away from 0: a float32 uniform is 0 with probability 2**-24 per token, and
    a token with E = 0 would win the race whatever its probability.
    """
    g = torch.Generator().manual_seed(key(seed, position, purpose))
    u = torch.rand(vocab_size, generator=g, dtype=torch.float64)  # [0, 1) in steps of 2**-53
    return torch.log1p(-u).neg_().clamp_(min=torch.finfo(torch.float64).tiny)


class CoupledNoise:
    """The noise of one request (exponential E; Gumbel G = -log E), by output position, cached while it may still be needed.

    Args:
        seed: the request's seed. vocab_size: V of the target.
    """

    def __init__(self, seed: int, vocab_size: int) -> None:
        self.seed = seed
        self.vocab_size = vocab_size
        self._cache: dict[int, torch.Tensor] = {}

    def at(self, position: int) -> torch.Tensor:
        """[V] float64 exponential noise of output position ``position`` (0 = the first generated token)."""
        g = self._cache.get(position)
        if g is None:
            g = self._cache[position] = exponential(self.seed, position, self.vocab_size)
        return g

    def forget_before(self, position: int) -> None:
        """Positions before ``position`` are committed: drop their noise."""
        for p in [p for p in self._cache if p < position]:
            del self._cache[p]

    def choose(self, probs: torch.Tensor, positions: Sequence[int]) -> torch.Tensor:
        """The Gumbel-max choice of each row: [N, V'] float32 probs at output ``positions`` -> [N] int64.

        Tokens of probability 0 are never chosen (log 0 = -inf). V' may be below V (a draft model's
        vocabulary): the noise of token x is the same whichever model scores it.
        """
        vp = probs.shape[-1]
        noise = torch.stack([self.at(p)[:vp] for p in positions])
        p = probs.double()
        race = torch.where(p > 0, noise / p, torch.full_like(p, float("inf")))
        return race.argmin(-1)
