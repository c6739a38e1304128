"""A causal LM bound to its KV cache, with rollback.

Contract (DESIGN.md rule 8): after any sequence of ``forward`` and ``rollback``
calls, the cache equals a fresh prefill of ``cached_ids``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from transformers import DynamicCache


class CachedModel:
    """Runs a Hugging Face causal LM incrementally over a growing token sequence.

    Attributes:
        model: the ``PreTrainedModel`` (eval mode).
        cached_ids: the token ids whose keys/values are in the cache, in order.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._keeps_logits = "logits_to_keep" in params
        self.cache: DynamicCache | None = None
        self.cached_ids: list[int] = []

    @property
    def num_cached(self) -> int:
        return len(self.cached_ids)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    def reset(self) -> None:
        """Drop the cache (start of a new request)."""
        self.cache = DynamicCache(config=self.model.config)
        self.cached_ids = []

    @torch.inference_mode()
    def forward(self, token_ids: Sequence[int] | torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Append ``token_ids`` to the cache and return their logits.

        Args:
            token_ids: [n] int64 (tensor or list), n >= 1, positions continue the cache.
            last_only: compute the LM head for the last position only (prefill).

        Returns:
            [n, V] float32 logits ([1, V] with ``last_only``).
        """
        if self.cache is None:
            self.reset()
        ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(1, -1)
        kwargs = {self._cache_kwarg: self.cache, "use_cache": True}
        if self._keeps_logits:
            kwargs["logits_to_keep"] = 1 if last_only else 0
        out = self.model(input_ids=ids, **kwargs)
        self.cached_ids.extend(ids[0].tolist())
        logits = out.logits[0]
        return logits[-1:].float() if last_only else logits.float()

    def rollback(self, length: int) -> None:
        """Cut the cache back to its first ``length`` tokens (0 <= length <= num_cached)."""
        if not 0 <= length <= self.num_cached:
            raise ValueError(f"cannot roll back to {length} tokens; cache holds {self.num_cached}")
        remove = self.num_cached - length
        if remove:
            self.cache.crop(-remove)
            del self.cached_ids[length:]

    def sync(self, token_ids: Sequence[int]) -> None:
        """Roll back to the longest prefix of the cache that agrees with ``token_ids``."""
        self.rollback(common_prefix_length(self.cached_ids, token_ids))

    def layer_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The cache's (keys, values) per layer, each [1, heads, num_cached, head_dim]."""
        return [(layer.keys, layer.values) for layer in self.cache.layers]


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences (list slices compare in C)."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    lo, hi = 0, n  # prefix of length lo agrees, of length hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if list(a[:mid]) == list(b[:mid]):
            lo = mid
        else:
            hi = mid
    return lo
