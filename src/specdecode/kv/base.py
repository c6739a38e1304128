"""One KV cache with per-row lengths (slots), behind one runner interface.

A *runner* binds a causal LM to a cache of ``num_slots`` rows. Row ``s`` keeps its
tokens contiguous in columns ``[0, len(ids[s]))`` of slot ``s``; rollback is a
length change (nothing is copied), and a step writes each row's new tokens at
that row's own columns with its own positions and attention-mask row, so rows of
different lengths run in one forward (ragged batches). Columns past the context
(``SCRATCH_COLUMNS``) hold a token tree's pending nodes and the padding of short
rows; no real token ever attends to padding.

Contract (DESIGN.md rule 8, tested in ``tests/test_kv_base.py``): after any sequence
of forwards, tree keeps and rollbacks, each slot's cache equals a fresh prefill
of its ``ids``.

Three kinds of forward, all batched over a contiguous slice of slots:

- :meth:`SlotRunner.forward`: append a chain of tokens per row (causal among them);
- :meth:`SlotRunner.forward_tree`: append token-tree nodes per row (ancestor mask,
  per-node positions); they stay *pending* until :meth:`SlotRunner.keep_tree_path`;
- :meth:`SlotRunner.forward_skipping`: layer-skip drafting, through some layers
  only, writing past the committed length without advancing it.

:class:`RowView` gives one slot the single-sequence API (``forward``,
``forward_tree``, ``rollback``, ``sync``...) for per-row work inside proposers.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch

from specdecode.tree import as_parent_list, node_depths, tree_attention_mask
from specdecode.types import PromptTooLongError, SpecDecodeError


class TreeAttentionUnsupported(SpecDecodeError):
    """The model cannot score a token tree (no custom 4-D mask / position ids through its forward)."""


class UnsupportedCacheError(SpecDecodeError):
    """The model's cache cannot be cut back to a prefix (sliding-window or recurrent layers)."""


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


def sliding_window(model: torch.nn.Module) -> int | None:
    """The attention window of a model's sliding-window layers (tokens), or None when every layer attends
    to the whole context (no window, or one at least as long as the context)."""
    cfg = getattr(model, "config", None)
    window = getattr(cfg, "sliding_window", None)
    uses = getattr(cfg, "use_sliding_window", None)
    kinds = set(getattr(cfg, "layer_types", None) or ())
    if not window or (uses is not None and not uses) or (kinds and "sliding_attention" not in kinds):
        return None
    return int(window) if int(window) < model_context(model) else None


def takes_mask_per_layer_type(model: torch.nn.Module) -> bool:
    """True when the model's decoder forward takes a dict {layer type: 4-D mask} (transformers 5 hybrids)."""
    inner = getattr(model, "model", model)
    for module in (inner, getattr(inner, "language_model", None)):
        if module is None:
            continue
        try:
            src = inspect.getsource(type(module).forward)
        except (OSError, TypeError):
            continue
        if "attention_mask, dict)" in src:
            return True
    return False


def rollback_problem(model: torch.nn.Module) -> str | None:
    """Why a model's cache cannot be cut back to any prefix (a length change), or None if it can.

    Recurrent or state-space layers (Mamba, Jamba, RecurrentGemma) keep a state that a length change
    does not undo. Sliding-window attention (Mistral, Gemma 3, Qwen2 with ``use_sliding_window``) is
    supported: the slot cache keeps every entry and the mask applies the window, so rollback stays a
    length change; a model mixing sliding and full layers needs a forward that takes one mask per
    layer type.
    """
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    kinds = set(getattr(cfg, "layer_types", None) or ())
    other = sorted(kinds - {"full_attention", "sliding_attention"})
    if other:
        return f"it has {other} layers"
    for attr in ("ssm_cfg", "state_size", "mamba_d_state", "attn_layer_period", "lru_width"):
        if getattr(cfg, attr, None):
            return f"it has recurrent (state-space) layers ({attr})"
    if len(kinds) > 1 and sliding_window(model) is not None and not takes_mask_per_layer_type(model):
        return "it mixes sliding-window and full-attention layers and its forward takes one mask for all of them"
    return None


def check_rollback_support(model: torch.nn.Module) -> None:
    """Refuse, before any generation, a model whose cache the engine cannot roll back.

    Raises:
        UnsupportedCacheError: the message names the layer type and what to do.
    """
    problem = rollback_problem(model)
    if problem is not None:
        kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise UnsupportedCacheError(
            f"{kind!r} cannot run speculative decoding here: {problem}, whose cache cannot be cut back to the "
            "tokens verification kept. Use a model whose layers are (sliding-window or full) attention"
        )


def tree_support_problem(model: torch.nn.Module) -> str | None:
    """Why a Hugging Face ``model`` cannot take a custom 4-D attention mask with position ids, or None.

    Transformers (5.x, ``masking_utils``) passes a 4-D mask through unchanged to the eager and SDPA
    attentions; flash / flex kernels ignore it, and sliding-window layers would lose their window.
    """
    params = inspect.signature(model.forward).parameters
    if "attention_mask" not in params or "position_ids" not in params:
        return "its forward takes no attention_mask / position_ids"
    cfg = getattr(model, "config", None)
    impl = getattr(cfg, "_attn_implementation", None)
    if impl not in ("eager", "sdpa"):
        return f"attention implementation {impl!r} does not take a custom 4-D mask (load it with 'sdpa' or 'eager')"
    kinds = set(getattr(cfg, "layer_types", None) or ())
    if kinds - {"full_attention", "sliding_attention"}:
        return f"it has {sorted(kinds - {'full_attention', 'sliding_attention'})} layers, whose masks a custom mask would replace"
    return rollback_problem(model)


def checked_tree_path(nodes: Sequence[int], tree_start: int | None, tree_parents: Sequence[int]) -> list[int]:
    """``nodes`` as a list of ints, checked to be a root path of the pending tree.

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


def causal_mask(columns: torch.Tensor, kv_len: int) -> torch.Tensor:
    """columns [b, q] int64 -> [b, q, kv_len] bool: the token at cache column ``columns[i, j]`` sees the columns up
    to its own (chains; token trees build theirs from the tree)."""
    return torch.arange(kv_len).view(1, 1, kv_len) <= columns.unsqueeze(2)


class SlotRunner:
    """A causal LM bound to a slot KV cache: batched ragged forwards, per-row rollback.

    Subclasses (``kv.owned.OwnedRunner``, ``kv.hf.HFRunner``) implement the storage and
    :meth:`_run`; everything about rows, lengths, trees, masks and positions is here.

    Args:
        model: the causal LM (eval mode).
        num_slots: rows the cache holds (the largest batch).
        max_context: positions per row; None reads the model's config.

    Attributes:
        ids: per slot, the token ids whose keys / values are cached (``len(ids[s])`` = its length).
    """

    #: Cache columns past the context: a token tree's pending nodes, then the padding of short rows.
    SCRATCH_COLUMNS = 257
    #: A ``last_only`` feed longer than this (a long prompt) is fed in pieces of this many tokens, each
    #: row alone (None: whole). The owned low-bit forward sets it: its exact kernel beats a float product.
    prefill_chunk: int | None = None
    #: Whether :meth:`limit_vocabulary` works here (the owned forward).
    limits_vocabulary = False
    #: Whether ``_run`` takes ``mask=None`` for chains as :func:`causal_mask` (each token sees the columns up to its
    #: own) and builds it only where it needs one (the owned forward: its C++ loop derives it from the columns)
    causal_from_columns = False

    def __init__(self, model: torch.nn.Module, num_slots: int = 1, max_context: int | None = None) -> None:
        if not isinstance(num_slots, int) or num_slots < 1:
            raise SpecDecodeError(f"num_slots must be an integer >= 1, got {num_slots!r}")
        self.model = model
        self.num_slots = num_slots
        self.max_context = min(max_context or model_context(model), model_context(model))
        self.max_columns = self.max_context + self.SCRATCH_COLUMNS
        self.ids: list[list[int]] = [[] for _ in range(num_slots)]
        self._tree_start: list[int | None] = [None] * num_slots
        self._tree_parents: list[list[int]] = [[] for _ in range(num_slots)]
        self.capacity = 0  # columns allocated per slot
        #: ``hidden_states`` indices (0 = embeddings, i = after layer i - 1) whose outputs every full forward
        #: keeps in :attr:`last_features` [b, q, len * hidden] (every fed position, before any ``last_only``
        #: cut): what a feature-level draft head (``proposers.eagle``) reads. None: nothing kept.
        self.capture_layers: tuple[int, ...] | None = None
        self.last_features: torch.Tensor | None = None

    # Facts -------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        head = self.model.get_output_embeddings()
        return int(getattr(head, "out_features", None) or head.weight.shape[0])

    def length(self, slot: int) -> int:
        """Committed cached tokens of ``slot`` (pending tree nodes excluded)."""
        start = self._tree_start[slot]
        return len(self.ids[slot]) if start is None else start

    def has_pending_tree(self, slot: int) -> bool:
        return self._tree_start[slot] is not None

    def limit_vocabulary(self, rows: int) -> None:
        """Score only token ids below ``rows`` (a draft's reduced output layer); the rest get -inf logits.

        Raises:
            SpecDecodeError: this forward cannot (only the owned forward slices its output layer).
        """
        raise SpecDecodeError(f"{type(self).__name__} cannot limit its vocabulary: a draft vocabulary needs the "
                              "owned forward (Llama / Qwen2 families)")

    def check_tree_support(self) -> None:
        """Raise TreeAttentionUnsupported when this forward cannot take a tree mask (owned: always can)."""

    def row(self, slot: int) -> "RowView":
        """The single-sequence view of ``slot``."""
        return RowView(self, slot)

    # Forwards ----------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, rows: slice, feeds: Sequence[Sequence[int]], last_only: bool = False) -> torch.Tensor:
        """Append each row's tokens (causal among themselves) after its cached tokens.

        Args:
            rows: a contiguous slice of slots, one per feed.
            feeds: per row n_i >= 0 new token ids (at least one row with n_i >= 1; a row with
                n_i = 0 only pads).
            last_only: only each row's last fed position (prefill, drafting). A feed longer than
                :attr:`prefill_chunk` runs in pieces of that many tokens (same results; all or nothing).

        Returns:
            [b, q, V] float32 logits, q = max n_i (positions past n_i are padding); [b, 1, V] with
            ``last_only`` (a row with n_i = 0: padding).

        Raises:
            PromptTooLongError: a row would pass ``max_context``.
            ValueError: a row has a pending token tree.
        """
        slots = self._slots(rows, feeds)
        chunk = self.prefill_chunk
        if last_only and chunk and any(len(f) > chunk for f in feeds):  # a long prompt: in pieces, row by row
            before = [len(self.ids[s]) for s in slots]
            try:
                rest = []
                for s, feed in zip(slots, feeds):
                    feed = list(feed)
                    while len(feed) > chunk:
                        self.forward(slice(s, s + 1), [feed[:chunk]], last_only=True)
                        feed = feed[chunk:]
                    rest.append(feed)
                return self.forward(rows, rest, last_only=True)
            except Exception:  # all or nothing, as one forward: no row keeps the pieces it got
                for s, n in zip(slots, before):
                    del self.ids[s][n:]
                raise
        starts, regions = [], []
        for s, feed in zip(slots, feeds):
            if self._tree_start[s] is not None:
                raise ValueError("forward: a token tree is pending; call keep_tree_path() first")
            starts.append(len(self.ids[s]))
            regions.append(None)
        logits = self._forward(rows, feeds, starts, regions, None, last_only)
        for s, feed in zip(slots, feeds):
            self.ids[s].extend(int(t) for t in feed)
        return logits

    @torch.inference_mode()
    def forward_tree(self, rows: slice, feeds: Sequence[Sequence[int]],
                     parents: Sequence[Sequence[int]]) -> torch.Tensor:
        """Append token-tree nodes per row in one forward; they stay pending until :meth:`keep_tree_path`.

        Each node attends to the row's committed prefix, its ancestors and itself, at position
        ``prefix length + depth - 1``. Calls may add a tree level by level.

        Args:
            rows: contiguous slots; feeds: per row [n_i] node tokens, breadth-first.
            parents: per row [n_i], each node's parent among the row's pending nodes (earlier
                calls first, then these); -1 = child of the last prefix token.

        Returns:
            [b, q, V] float32 logits (row i, position j scores the token after node j).

        Raises:
            TreeAttentionUnsupported, InvalidTreeError (a parent that is not an earlier pending node).
        """
        self.check_tree_support()
        slots = self._slots(rows, feeds)
        starts, regions = [], []
        for s, feed, par in zip(slots, feeds, parents):
            start = len(self.ids[s]) if self._tree_start[s] is None else self._tree_start[s]
            starts.append(start)
            regions.append(as_parent_list([*self._tree_parents[s], *[int(p) for p in par]]) if len(feed) else None)
        logits = self._forward(rows, feeds, starts, regions, None, False)
        for s, feed, start, region in zip(slots, feeds, starts, regions):
            if len(feed):
                self._tree_start[s], self._tree_parents[s] = start, region
                self.ids[s].extend(int(t) for t in feed)
        return logits

    @torch.inference_mode()
    def forward_skipping(self, rows: slice, feeds: Sequence[Sequence[int]], starts: Sequence[int],
                         layers: Sequence[int], last_only: bool = False) -> torch.Tensor:
        """Layer-skip drafting: run each row's tokens at columns / positions ``starts[i]..`` through
        ``layers`` only. Writes those layers' columns but leaves ``ids`` alone, so they stay past the
        committed length and verification rewrites them before any read.

        Raises:
            ValueError: a start inside the committed cache or a pending tree.
            SpecDecodeError: this forward cannot skip layers (the Hugging Face one).
        """
        slots = self._slots(rows, feeds)
        for s, start in zip(slots, starts):
            if start < len(self.ids[s]) or self._tree_start[s] is not None:
                raise ValueError(f"forward_skipping writes past the committed cache ({len(self.ids[s])}), got {start}")
        return self._forward(rows, feeds, list(starts), [None] * len(slots), list(layers), last_only)

    # Rollback and slots -------------------------------------------------------------

    def rollback(self, slot: int, length: int) -> None:
        """Keep the first ``length`` cached tokens of ``slot`` (a pending tree is dropped; O(1)).

        Raises:
            ValueError: ``length`` outside [0, cached], or past the prefix of a pending tree.
        """
        start = self._tree_start[slot]
        if not 0 <= length <= len(self.ids[slot]):
            raise ValueError(f"cannot roll back to {length} tokens; slot {slot} holds {len(self.ids[slot])}")
        if start is not None and length > start:
            raise ValueError("a token tree is pending: keep_tree_path() first, or roll back into the prefix")
        self._tree_start[slot], self._tree_parents[slot] = None, []
        del self.ids[slot][length:]

    def sync(self, slot: int, token_ids: Sequence[int]) -> None:
        """Roll ``slot`` back to the longest prefix of its cache that agrees with ``token_ids``."""
        if self._tree_start[slot] is not None:
            self.rollback(slot, self._tree_start[slot])
        self.rollback(slot, common_prefix_length(self.ids[slot], token_ids))

    @torch.inference_mode()
    def keep_tree_path(self, slot: int, nodes: Sequence[int]) -> None:
        """Keep the prefix plus the pending nodes ``nodes`` (a root path, in order); drop the other nodes.

        Raises:
            ValueError: no tree pending, or ``nodes`` is not a root path.
        """
        start = self._tree_start[slot]
        nodes = checked_tree_path(nodes, start, self._tree_parents[slot])
        k = len(nodes)
        if nodes != list(range(k)):
            src = torch.tensor(nodes, dtype=torch.int64) + start
            self._copy_columns(slot, src, torch.arange(start, start + k))
            ids = self.ids[slot]
            ids[start : start + k] = [ids[start + i] for i in nodes]
        self._tree_start[slot], self._tree_parents[slot] = None, []
        del self.ids[slot][start + k :]

    def clear(self, slot: int) -> None:
        """Empty ``slot`` (a request leaves or joins)."""
        self.ids[slot] = []
        self._tree_start[slot], self._tree_parents[slot] = None, []

    @torch.inference_mode()
    def move(self, src: int, dst: int) -> None:
        """Move slot ``src``'s tokens into slot ``dst`` (compaction when a row leaves); ``src`` is emptied."""
        if src == dst:
            return
        n = len(self.ids[src])
        if n and self.capacity:
            self._move_slot(src, dst, n)
        self.ids[dst], self._tree_start[dst], self._tree_parents[dst] = \
            self.ids[src], self._tree_start[src], self._tree_parents[src]
        self.clear(src)

    def release(self) -> None:
        """Free every buffer (no rows left): memory goes back to the allocator."""
        self._free()
        self.capacity = 0
        for s in range(self.num_slots):
            self.clear(s)

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache buffers."""
        return 0

    # Internals ---------------------------------------------------------------------

    def _slots(self, rows: slice, feeds: Sequence[Sequence[int]]) -> range:
        slots = range(rows.start or 0, rows.stop)
        if len(slots) != len(feeds) or slots.stop > self.num_slots or slots.start < 0:
            raise ValueError(f"{len(feeds)} feeds for slots {slots} of a {self.num_slots}-slot cache")
        return slots

    def _forward(self, rows: slice, feeds, starts: list[int], regions: list[list[int] | None],
                 layers: list[int] | None, last_only: bool) -> torch.Tensor:
        """Build ids, positions, write columns and masks [b, q, kv_len] for ragged rows; run."""
        b = len(feeds)
        counts = [len(f) for f in feeds]
        q = max(counts, default=0)
        if q == 0:
            raise ValueError("forward: every row's feed is empty")
        # built as lists, one tensor each (a one-token step is ~15 small torch calls fewer: SmolLM2's step is ~2 ms)
        ids_l: list[list[int]] = []
        pos_l: list[list[int]] = []
        col_l: list[list[int]] = []
        trees = any(r is not None for r in regions)
        plain_rows: list[int] = []
        need = 0
        last_column = self.max_columns - 1
        for i, (feed, start, region, n) in enumerate(zip(feeds, starts, regions, counts)):
            offset = 0 if region is None else len(region) - n  # earlier pending nodes of this row
            col = start + offset
            if region is None:
                pos = list(range(start, start + n))
            else:
                pos = [depth + start - 1 for depth in node_depths(region)[offset:]]
            if n and max(pos) >= self.max_context:
                raise PromptTooLongError(
                    f"a row needs position {max(pos)}; the context holds {self.max_context} positions")
            ids_l.append((feed.tolist() if isinstance(feed, torch.Tensor) else [int(t) for t in feed]) + [0] * (q - n))
            pos_l.append(pos + [min(self.max_context - 1, start + n)] * (q - n))
            # padding continues past the row's own columns (never attended by its real tokens); padding past the
            # scratch shares the last column
            col_l.append([min(c, last_column) for c in range(col, col + q)])
            need = max(need, col + n)
            if region is None:
                plain_rows.append(i)
        if need > self.max_columns - 1:
            raise PromptTooLongError(f"{need} cache columns needed; the cache holds {self.max_columns - 1}")
        ids = torch.tensor(ids_l, dtype=torch.int64)
        positions = torch.tensor(pos_l, dtype=torch.int64)
        columns = torch.tensor(col_l, dtype=torch.int64)
        kv_len = max(max(row) for row in col_l) + 1
        self._ensure_capacity(kv_len)
        if b == 1 and not trees and counts[0] == 1:
            mask = None  # one token after the cache: everything visible
        elif not trees and self.causal_from_columns:
            mask = None  # the runner sees each token's columns up to its own (the same mask, built where needed)
        else:
            mask = causal_mask(columns, kv_len)
            for i, region in enumerate(regions):
                if region is not None:
                    n = counts[i]
                    m = tree_attention_mask(region, starts[i], n)  # [n, start + R]
                    mask[i, :n] = False
                    mask[i, :n, : m.shape[1]] = m
        if last_only:
            last = torch.tensor([max(0, n - 1) for n in counts], dtype=torch.int64)
        else:
            last = None
        return self._run(rows, ids, positions, columns, mask, kv_len, layers, last)

    def _ensure_capacity(self, columns: int) -> None:
        if columns <= self.capacity:
            return
        new = min(self.max_columns, max(columns, 2 * self.capacity, 64))
        new = min(self.max_columns, -(-new // 64) * 64)
        self._grow(new)
        self.capacity = new

    # Storage (subclasses) -------------------------------------------------------------

    def _run(self, rows: slice, ids: torch.Tensor, positions: torch.Tensor, columns: torch.Tensor,
             mask: torch.Tensor | None, kv_len: int, layers: list[int] | None,
             last: torch.Tensor | None) -> torch.Tensor:
        """ids / positions / columns [b, q] int64, mask [b, q, kv_len] bool (None: all visible for one token after
        the cache; with :attr:`causal_from_columns`, :func:`causal_mask` of the columns for chains) ->
        [b, q, V] float32 logits ([b, 1, V] at ``last`` [b] when given)."""
        raise NotImplementedError

    def _grow(self, capacity: int) -> None:
        raise NotImplementedError

    def _copy_columns(self, slot: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        raise NotImplementedError

    def _move_slot(self, src: int, dst: int, n: int) -> None:
        raise NotImplementedError

    def _free(self) -> None:
        raise NotImplementedError


class RowView:
    """One slot of a :class:`SlotRunner` with the single-sequence API (per-row work in proposers, tests).

    ``forward(ids)`` -> [n, V], ``forward_tree(ids, parents)``, ``keep_tree_path(nodes)``,
    ``rollback(length)``, ``sync(ids)``, ``forward_skipping(ids, start, layers)``.
    """

    def __init__(self, runner: SlotRunner, slot: int) -> None:
        self.runner, self.slot = runner, slot
        self._rows = slice(slot, slot + 1)

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def cached_ids(self) -> list[int]:
        return self.runner.ids[self.slot]

    @property
    def num_cached(self) -> int:
        return len(self.runner.ids[self.slot])

    @property
    def has_pending_tree(self) -> bool:
        return self.runner.has_pending_tree(self.slot)

    def reset(self) -> None:
        self.runner.clear(self.slot)

    def check_tree_support(self) -> None:
        self.runner.check_tree_support()

    def forward(self, token_ids, last_only: bool = False) -> torch.Tensor:
        """[n] ids -> [n, V] float32 logits ([1, V] with ``last_only``)."""
        ids = _ints(token_ids)
        return self.runner.forward(self._rows, [ids], last_only=last_only)[0]

    def forward_tree(self, token_ids, parents) -> torch.Tensor:
        """[n] node ids, [n] parents among pending nodes -> [n, V] float32 logits."""
        ids = _ints(token_ids)
        return self.runner.forward_tree(self._rows, [ids], [_ints(parents)])[0, : len(ids)]

    def forward_skipping(self, token_ids, start: int, layers: Sequence[int]) -> torch.Tensor:
        ids = _ints(token_ids)
        return self.runner.forward_skipping(self._rows, [ids], [start], layers)[0, : len(ids)]

    def keep_tree_path(self, nodes: Sequence[int]) -> None:
        self.runner.keep_tree_path(self.slot, nodes)

    def rollback(self, length: int) -> None:
        self.runner.rollback(self.slot, length)

    def sync(self, token_ids: Sequence[int]) -> None:
        self.runner.sync(self.slot, token_ids)

    def layer_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys, values) per layer, each [1, kv_heads, num_cached, head_dim]."""
        return self.runner.layer_tensors(self.slot)


def _ints(values) -> list[int]:
    if isinstance(values, torch.Tensor):
        return values.reshape(-1).tolist()
    return [int(v) for v in values]
