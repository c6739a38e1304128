"""The Hugging Face forward over the slot KV cache: any causal LM that takes a 4-D mask.

:class:`SlotCache` implements transformers' ``Cache`` API on the slot buffers: per layer keys and
values ``[num_slots, kv_heads, columns, head_dim]``; before each forward the runner tells it which
columns each row writes, and :meth:`SlotCache.update` writes them there and returns views of the
active rows. Every forward gets a 4-D additive mask (per row: causal or ancestor) and per-row
``position_ids``, so rows of different lengths and token trees run in one forward.
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import Cache

from specdecode.kv.base import SlotRunner, TreeAttentionUnsupported, sliding_window, tree_support_problem
from specdecode.types import SpecDecodeError


class SlotCache(Cache):
    """transformers ``Cache`` over slot buffers, written at per-row columns.

    The runner calls :meth:`prepare` (rows, [b, q] write columns, kv_len) before each forward;
    :meth:`update` writes [b, kv_heads, q, head_dim] keys / values and returns
    [b, kv_heads, kv_len, head_dim] views of the active rows.
    """

    def __init__(self, num_slots: int) -> None:
        super().__init__(layers=[])
        self.num_slots = num_slots
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.capacity = 0
        self._rows = slice(0, 0)
        self._write: torch.Tensor | None = None
        self._row_index: torch.Tensor | None = None
        self._kv_len = 0

    def prepare(self, rows: slice, write_columns: torch.Tensor, kv_len: int) -> None:
        self._rows = rows
        self._write = write_columns
        self._row_index = torch.arange(write_columns.shape[0]).unsqueeze(1)
        self._kv_len = kv_len

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx == len(self.keys):
            shape = (self.num_slots, key_states.shape[1], self.capacity, key_states.shape[3])
            self.keys.append(torch.zeros(shape, dtype=key_states.dtype))
            self.values.append(torch.zeros(shape, dtype=value_states.dtype))
        keys = self.keys[layer_idx][self._rows]
        values = self.values[layer_idx][self._rows]
        keys[self._row_index, :, self._write] = key_states.transpose(1, 2)
        values[self._row_index, :, self._write] = value_states.transpose(1, 2)
        return keys[:, :, : self._kv_len], values[:, :, : self._kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:  # noqa: ARG002 - positions are always passed
        return self._kv_len

    @torch.inference_mode()
    def grow(self, capacity: int) -> None:
        for store in (self.keys, self.values):
            for i, buf in enumerate(store):
                grown = torch.zeros((*buf.shape[:2], capacity, buf.shape[3]), dtype=buf.dtype)
                grown[:, :, : self.capacity] = buf
                store[i] = grown
        self.capacity = capacity


class HFRunner(SlotRunner):
    """A Hugging Face causal LM over the slot cache (the universal forward).

    Args:
        model: causal LM (eval mode) whose forward takes ``attention_mask`` (4-D), ``position_ids``
            and a ``Cache`` (Llama / Qwen2 / Mistral / Gemma / Phi style models in transformers 5,
            loaded with the ``sdpa`` or ``eager`` attention).
        num_slots, max_context: as :class:`~specdecode.kv.base.SlotRunner`.

    Raises:
        TreeAttentionUnsupported: the model cannot take a custom 4-D mask (every batched or
            speculative forward needs one).
    """

    def __init__(self, model: torch.nn.Module, num_slots: int = 1, max_context: int | None = None) -> None:
        super().__init__(model, num_slots, max_context)
        problem = tree_support_problem(model)
        if problem is not None:
            raise TreeAttentionUnsupported(
                f"{type(model).__name__} cannot run in the engine: {problem}. Load it with attn_implementation="
                "'sdpa' or 'eager'")
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._keeps_logits = "logits_to_keep" in params
        self.cache = SlotCache(num_slots)
        self.dtype = next(model.parameters()).dtype
        # Sliding-window layers: the cache keeps every entry, the mask applies the window (keys at
        # positions > query position - window); hybrids get one mask per layer type.
        self.window = sliding_window(model)
        kinds = set(getattr(model.config, "layer_types", None) or ())
        self._per_type = self.window is not None and len(kinds) > 1

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for store in (self.cache.keys, self.cache.values) for b in store)

    def layer_tensors(self, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        n = len(self.ids[slot])
        return [(k[slot : slot + 1, :, :n], v[slot : slot + 1, :, :n]) for k, v in zip(self.cache.keys, self.cache.values)]

    def _additive(self, mask: torch.Tensor) -> torch.Tensor:
        """[b, q, kv] bool -> [b, 1, q, kv] additive mask in the model's dtype (0 = attend)."""
        out = torch.zeros(mask.shape[0], 1, *mask.shape[1:], dtype=self.dtype)
        return out.masked_fill_(~mask.unsqueeze(1), torch.finfo(self.dtype).min)

    def _grow(self, capacity: int) -> None:
        if not self.cache.keys:
            self.cache.capacity = capacity
            return
        self.cache.grow(capacity)

    def _copy_columns(self, slot: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        for store in (self.cache.keys, self.cache.values):
            for buf in store:
                buf[slot, :, dst] = buf[slot, :, src]

    def _move_slot(self, src: int, dst: int, n: int) -> None:
        for store in (self.cache.keys, self.cache.values):
            for buf in store:
                buf[dst, :, :n] = buf[src, :, :n]

    def _free(self) -> None:
        self.cache = SlotCache(self.num_slots)

    def _run(self, rows, ids, positions, columns, mask, kv_len, layers, last):
        if layers is not None:
            raise SpecDecodeError(
                "the Hugging Face forward cannot skip layers: layer-skip drafting runs on the project's own "
                "Llama / Qwen2 forward (--forward auto or owned)")
        b, q = ids.shape
        self.cache.prepare(rows, columns, kv_len)
        if mask is None:
            mask = torch.ones(b, q, kv_len, dtype=torch.bool)
        additive = self._additive(mask)
        if self.window is not None:
            # prefix columns hold positions = column; tree nodes sit inside any window longer than a tree
            inside = torch.arange(kv_len).view(1, 1, kv_len) > positions.unsqueeze(2) - self.window
            sliding = self._additive(mask & inside)
            additive = {"full_attention": additive, "sliding_attention": sliding} if self._per_type else sliding
        kwargs = {self._cache_kwarg: self.cache, "use_cache": True}
        one_row_last = last is not None and b == 1 and int(last[0]) == q - 1
        if self._keeps_logits:
            kwargs["logits_to_keep"] = 1 if one_row_last else 0  # a prefill: the LM head at the last token only
        if self.capture_layers:
            kwargs["output_hidden_states"] = True
        out = self.model(input_ids=ids, attention_mask=additive, position_ids=positions, **kwargs)
        if self.capture_layers:
            self.last_features = torch.cat([out.hidden_states[k] for k in self.capture_layers], dim=-1)
        logits = out.logits
        if last is not None and not (one_row_last and logits.shape[1] == 1):
            logits = logits[torch.arange(b), last].unsqueeze(1)
        return logits.float()
