"""A causal LM bound to its KV cache, with rollback.

Contract (DESIGN.md rule 8): after any sequence of ``forward`` and ``rollback``
calls, the cache equals a fresh prefill of ``cached_ids``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from transformers import DynamicCache

from specdecode.tree import additive_mask, as_parent_list, node_depths, tree_attention_mask
from specdecode.types import SpecDecodeError


class CachedTokens:
    """What every runner (:class:`CachedModel`, ``fastforward.OwnedCachedModel``) keeps the same way:
    the ids whose keys / values are cached, a pending token tree, and rollback to a common prefix.

    A subclass sets ``cached_ids``, ``_tree_start`` (prefix length while tree nodes are pending,
    else None) and ``_tree_parents``, and implements ``rollback(length)``.
    """

    cached_ids: list[int]
    _tree_start: int | None
    _tree_parents: list[int]

    @property
    def num_cached(self) -> int:
        return len(self.cached_ids)

    @property
    def has_pending_tree(self) -> bool:
        """True between ``forward_tree`` and ``keep_tree_path`` (or a rollback into the prefix)."""
        return self._tree_start is not None

    def rollback(self, length: int) -> None:
        raise NotImplementedError

    def sync(self, token_ids: Sequence[int]) -> None:
        """Roll back to the longest prefix of the cache that agrees with ``token_ids`` (a pending tree is dropped)."""
        if self._tree_start is not None:
            self.rollback(self._tree_start)
        self.rollback(common_prefix_length(self.cached_ids, token_ids))


class CachedModel(CachedTokens):
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
        self._tree_start: int | None = None  # prefix length while tree nodes are pending (forward_tree)
        self._tree_parents: list[int] = []  # parents of the pending tree nodes, -1 = child of the prefix
        self._tree_support: str | None | bool = False  # False = not checked yet; None = supported

    @property
    def vocab_size(self) -> int:
        head = self.model.get_output_embeddings()  # nn.Linear or a quantized linear: both have out_features
        return int(getattr(head, "out_features", None) or head.weight.shape[0])

    def reset(self) -> None:
        """Drop the cache (start of a new request)."""
        self.cache = DynamicCache(config=self.model.config)
        self.cached_ids = []
        self._tree_start, self._tree_parents = None, []

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
        self._no_pending_tree("forward")
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
        check_rollback(length, self.num_cached, self._tree_start)
        self._tree_start, self._tree_parents = None, []  # a pending tree is dropped
        remove = self.num_cached - length
        if remove:
            self.cache.crop(-remove)
            del self.cached_ids[length:]

    def layer_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The cache's (keys, values) per layer, each [1, heads, num_cached, head_dim]."""
        return [(layer.keys, layer.values) for layer in self.cache.layers]

    # Token trees -------------------------------------------------------------------

    def check_tree_support(self) -> None:
        """Check once that the model takes a custom 4-D attention mask and position ids.

        Raises:
            TreeAttentionUnsupported: the message names the reason and what to do.
        """
        if self._tree_support is False:
            self._tree_support = tree_support_problem(self.model)
        if self._tree_support is not None:
            raise TreeAttentionUnsupported(
                f"{type(self.model).__name__} cannot verify token trees: {self._tree_support}. "
                "Use a chain drafter (--tree none) or a model with full attention through eager / sdpa."
            )

    @torch.inference_mode()
    def forward_tree(self, token_ids: Sequence[int] | torch.Tensor, parents: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Append token-tree nodes after the cached prefix and return their logits, in one forward.

        Each node attends to the prefix, its ancestors and itself (a 4-D additive mask) and
        sits at position ``prefix length + depth - 1``. Calls may add a tree level by level:
        until :meth:`keep_tree_path` (or a rollback into the prefix) the nodes stay *pending*
        and :meth:`forward` refuses to run.

        Args:
            token_ids: [n] int64 node tokens, breadth-first.
            parents: [n] int64, each node's parent among all pending nodes (those of earlier
                calls first, then these, in order); -1 = child of the last prefix token.

        Returns:
            [n, V] float32 logits (row i scores the token after node i).

        Raises:
            TreeAttentionUnsupported: the model cannot take a custom mask.
            InvalidTreeError: a parent index that is not an earlier pending node.
        """
        self.check_tree_support()
        if self.cache is None:
            self.reset()
        ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(1, -1)
        n = ids.shape[1]
        start = self.num_cached if self._tree_start is None else self._tree_start
        region = as_parent_list([*self._tree_parents, *_int_list(parents)])
        positions = torch.tensor(node_depths(region)[-n:], dtype=torch.int64).add_(start - 1).reshape(1, -1)
        mask = additive_mask(tree_attention_mask(region, start, n), self.model.dtype)
        kwargs = {self._cache_kwarg: self.cache, "use_cache": True}
        if self._keeps_logits:
            kwargs["logits_to_keep"] = 0
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, **kwargs)
        self._tree_start, self._tree_parents = start, region
        self.cached_ids.extend(ids[0].tolist())
        return out.logits[0].float()

    @torch.inference_mode()
    def keep_tree_path(self, nodes: Sequence[int]) -> None:
        """Keep the prefix plus the pending tree nodes ``nodes`` (a root path, in order); drop the rest.

        Afterwards the cache equals a fresh prefill of ``cached_ids`` (prefix + path tokens):
        keys / values of the path are moved into place, the other nodes are cut.

        Args:
            nodes: indices among the pending nodes, each the child of the one before
                (the first a child of the prefix); may be empty.

        Raises:
            ValueError: no tree pending, or ``nodes`` is not a root path.
        """
        nodes = checked_tree_path(nodes, self._tree_start, self._tree_parents)
        start, k = self._tree_start, len(nodes)
        if nodes != list(range(k)):  # move the path's entries to the front of the tree region
            src = torch.tensor(nodes, dtype=torch.int64) + start
            for layer in self.cache.layers:
                layer.keys[..., start : start + k, :] = layer.keys.index_select(-2, src)
                layer.values[..., start : start + k, :] = layer.values.index_select(-2, src)
            self.cached_ids[start : start + k] = [self.cached_ids[start + i] for i in nodes]
        self._tree_start, self._tree_parents = None, []
        self.rollback(start + k)

    def _no_pending_tree(self, what: str) -> None:
        if self._tree_start is not None:
            raise ValueError(f"{what}: a token tree is pending; call keep_tree_path() first")


def check_rollback(length: int, num_cached: int, tree_start: int | None) -> None:
    """Check a rollback to ``length`` tokens: 0 <= length <= num_cached and, while a token tree is
    pending (``tree_start`` not None), into the prefix; the caller then drops the pending tree.

    Raises:
        ValueError: ``length`` out of range, or past the prefix of a pending tree.
    """
    if not 0 <= length <= num_cached:
        raise ValueError(f"cannot roll back to {length} tokens; cache holds {num_cached}")
    if tree_start is not None and length > tree_start:
        raise ValueError("a token tree is pending: keep_tree_path() first, or roll back into the prefix")


def checked_tree_path(nodes: Sequence[int], tree_start: int | None, tree_parents: Sequence[int]) -> list[int]:
    """``nodes`` as a list of ints, checked to be a root path of the pending tree (``keep_tree_path``).

    Args:
        nodes: indices among the pending nodes, each the child of the one before (the first a
            child of the prefix); may be empty.
        tree_start: the prefix length while a tree is pending, None when none is.
        tree_parents: each pending node's parent among the pending nodes, -1 = child of the prefix.

    Raises:
        ValueError: no tree pending, or ``nodes`` is not a root path.
    """
    if tree_start is None:
        raise ValueError("keep_tree_path: no token tree is pending")
    nodes = [int(i) for i in nodes]
    for prev, node in zip([-1, *nodes], nodes):
        if not 0 <= node < len(tree_parents) or tree_parents[node] != prev:
            raise ValueError(f"keep_tree_path: {nodes} is not a root path of the pending tree")
    return nodes


def model_context(model: torch.nn.Module) -> int:
    """A model's context in tokens (positions it was built for): config.max_position_embeddings, else 2048."""
    cfg = getattr(model, "config", None)
    return int(getattr(cfg, "max_position_embeddings", None) or 2048)


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


class TreeAttentionUnsupported(SpecDecodeError):
    """The model cannot score a token tree (no custom 4-D mask / position ids through its forward)."""


def tree_support_problem(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot take a custom 4-D attention mask with position ids, or None if it can.

    Transformers (5.x, ``masking_utils``) passes a 4-D mask through unchanged to the eager
    and SDPA attentions; flash / flex kernels ignore it, and layers with a sliding window
    would lose their window under a full custom mask.
    """
    params = inspect.signature(model.forward).parameters
    if "attention_mask" not in params or "position_ids" not in params:
        return "its forward takes no attention_mask / position_ids"
    cfg = getattr(model, "config", None)
    impl = getattr(cfg, "_attn_implementation", None)
    if impl not in ("eager", "sdpa"):
        return f"attention implementation {impl!r} does not take a custom 4-D mask (load it with 'sdpa' or 'eager')"
    kinds = set(getattr(cfg, "layer_types", None) or ())
    if kinds - {"full_attention"}:
        return f"it has {sorted(kinds - {'full_attention'})} layers, whose masks a custom tree mask would replace"
    return None


def _int_list(values: Sequence[int] | torch.Tensor) -> list[int]:
    """[n] ints (tensor or sequence) -> list of Python ints."""
    return values.tolist() if isinstance(values, torch.Tensor) else [int(v) for v in values]
