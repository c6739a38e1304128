"""A draft's reduced vocabulary beyond its first ids: each row's own context ids and the end-of-sequence ids.

:meth:`specdecode.kv.owned.OwnedRunner.limit_vocabulary` reads only the output layer's first ``limit`` rows
(byte-level BPE vocabularies put frequent tokens first). The ids a draft most needs past them are the ones
its row's context holds (a prompt's identifiers, which a draft copies): :class:`ContextVocabulary` scores
those per row from their dequantized output rows, so a row's draft vocabulary depends on its own tokens
only. Every other id keeps probability 0; lossless, since the target verifies whatever is drafted.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdecode.kv.base import common_prefix_length
from specdecode.lowbit import TILED, QuantLinear, unpack


def eos_ids(model: torch.nn.Module) -> set[int]:
    """The end-of-sequence ids of a Hugging Face model's config and generation config."""
    ids: set[int] = set()
    for cfg in (model.config, getattr(model, "generation_config", None)):
        eos = getattr(cfg, "eos_token_id", None)
        ids.update(int(t) for t in ([] if eos is None else eos if isinstance(eos, (list, tuple)) else [eos]))
    return ids


def head_rows(head, ids: Sequence[int]) -> torch.Tensor:
    """Output rows ``ids`` of an output layer as float32 [len(ids), hidden]: a float weight's rows, or a
    ``QuantLinear``'s blocks for those rows (a tile of 8 unpacked at a time) dequantized like
    ``gguf.dequantize`` (a bias is not included)."""
    if not isinstance(head, QuantLinear):
        return head[list(ids)].float()
    import gguf  # lazy: start-up time
    import numpy as np

    packed = head.packed.numpy()
    tiled = head.kind in TILED
    whole = head.out_features // 8 * 8 if tiled else head.out_features
    raws = []
    for t in ids:
        if tiled and t < whole:  # its tile of 8, unpacked
            raws.append(unpack(packed[t // 8 * 8 : t // 8 * 8 + 8], head.kind)[t % 8])
        elif tiled:  # the last columns (fewer than 8) keep a column layout
            raws.append(unpack(packed[whole:], head.kind)[t - whole])
        else:
            raws.append(unpack(packed[t : t + 1], head.kind)[0])
    values = gguf.quants.dequantize(np.stack(raws), gguf.GGMLQuantizationType[head.kind])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(len(ids), -1)


class ContextVocabulary:
    """Scores, per row, the ids at or past ``limit`` that its context holds, plus ``always`` (EOS ids).

    Args:
        head: the full output layer (a ``QuantLinear`` or a float weight [V, hidden]).
        limit: the first id not read from the truncated output layer.
        always: ids scored for every row (the end-of-sequence ids past the limit).

    Per row the context ids past the limit are kept with their positions and re-scanned only past the
    longest prefix the row's tokens still share with what was scanned (a rollback or a new feed), so a
    draft step costs a prefix comparison (in C) and its few new tokens. Dequantized rows are cached (at
    most :attr:`MAX_ROWS`; then the cache starts over with what the row needs).
    """

    MAX_ROWS = 8192

    def __init__(self, head, limit: int, always: set[int]) -> None:
        self.head, self.limit, self.always = head, int(limit), set(always)
        self._index: dict[int, int] = {}  # id -> its row in _rows
        self._rows: list[torch.Tensor] = []  # [n, hidden] float32 blocks, concatenated on demand
        self._table: torch.Tensor | None = None
        self._seen: dict[int, tuple[list[int], list[tuple[int, int]]]] = {}  # slot -> (tokens scanned, (pos, id))

    def context_ids(self, slot: int, tokens: Sequence[int]) -> set[int]:
        """The ids at or past the limit among ``tokens`` (slot ``slot``'s cached tokens)."""
        scanned, found = self._seen.get(slot, ([], []))
        keep = common_prefix_length(scanned, tokens)
        if keep < len(scanned):
            found = [(p, t) for p, t in found if p < keep]
        found = found + [(p, t) for p, t in enumerate(tokens[keep:], keep) if t >= self.limit]
        self._seen[slot] = (list(tokens), found)
        return {t for _, t in found}

    def _weights(self, ids: list[int]) -> torch.Tensor:
        """[len(ids), hidden] float32 output rows of ``ids``, dequantized once and cached."""
        missing = [t for t in ids if t not in self._index]
        if missing:
            if len(self._index) + len(missing) > self.MAX_ROWS:  # a long-lived server: start over
                self._index, self._rows, self._table, missing = {}, [], None, ids
            base = len(self._index)
            self._index.update((t, base + i) for i, t in enumerate(missing))
            self._rows.append(head_rows(self.head, missing))
            self._table = None
        if self._table is None:
            self._table = torch.cat(self._rows)
            self._rows = [self._table]
        return self._table[torch.tensor([self._index[t] for t in ids])]

    def score(self, full: torch.Tensor, hidden: torch.Tensor, slots: Sequence[int],
              context_of, feeds: Sequence[Sequence[int]]) -> None:
        """Write row i's scores of its own ids past the limit into ``full`` [b, q, V] (the rest stays as it is).

        Args:
            hidden: [b, q, hidden] (any float dtype; the product runs in float32).
            slots: row i's slot. context_of: slot -> its cached tokens. feeds: row i's tokens of this forward.
        """
        bias = self.head.bias if isinstance(self.head, QuantLinear) else None
        for i, (slot, feed) in enumerate(zip(slots, feeds)):
            wanted = self.context_ids(slot, context_of(slot)) | {t for t in feed if t >= self.limit} | self.always
            if not wanted:
                continue
            ids = sorted(wanted)
            scores = hidden[i].float() @ self._weights(ids).T  # [q, U]
            full[i, :, ids] = scores if bias is None else scores + bias[ids]
