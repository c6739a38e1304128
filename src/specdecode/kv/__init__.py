"""The KV cache and the forwards that run over it: one slot cache, two runners.

- :class:`~specdecode.kv.owned.OwnedRunner`: the project's own Llama / Qwen2 forward
  (fp32, bf16, int8 weights; trees; layer skipping).
- :class:`~specdecode.kv.hf.HFRunner`: the Hugging Face forward with 4-D masks, for any other causal LM.

:func:`make_runner` picks one.
"""

from __future__ import annotations

import torch

from specdecode.kv.base import (
    RowView,
    SlotRunner,
    TreeAttentionUnsupported,
    UnsupportedCacheError,
    check_rollback_support,
    common_prefix_length,
    model_context,
)
from specdecode.kv.hf import HFRunner
from specdecode.kv.owned import OwnedRunner, supports
from specdecode.types import SpecDecodeError

#: Forward backends: "auto" (owned when the model is supported, else Hugging Face), "hf", "owned".
from specdecode.options import FORWARD_BACKENDS  # noqa: E402 - the one copy (``--forward``)


def make_runner(model: torch.nn.Module, backend: str = "auto", num_slots: int = 1,
                max_context: int | None = None, batch_invariant: bool | None = None) -> SlotRunner:
    """A model bound to a slot KV cache of ``num_slots`` rows.

    Args:
        model: causal LM in eval mode.
        backend: "auto" (the owned forward for supported Llama / Qwen2 models, else Hugging Face),
            "hf" or "owned".
        num_slots: rows (the largest batch); max_context: positions per row (None: the model's).
        batch_invariant: the owned forward's batch-invariant numerics (None: its default for the
            model's precision, see :class:`~specdecode.kv.owned.OwnedRunner`); ignored by the HF forward.

    Raises:
        SpecDecodeError: unknown backend, or "owned" for a model it cannot run.
        UnsupportedCacheError: sliding-window or recurrent layers (the cache cannot roll back).
        TreeAttentionUnsupported: a Hugging Face model that takes no 4-D mask.
    """
    if backend not in FORWARD_BACKENDS:
        raise SpecDecodeError(f"unknown forward backend {backend!r}; choose one of {FORWARD_BACKENDS}")
    check_rollback_support(model)
    if backend == "owned" or (backend == "auto" and supports(model)):
        return OwnedRunner(model, num_slots, max_context, batch_invariant=batch_invariant)
    return HFRunner(model, num_slots, max_context)


__all__ = ["FORWARD_BACKENDS", "HFRunner", "OwnedRunner", "RowView", "SlotRunner", "TreeAttentionUnsupported",
           "UnsupportedCacheError", "check_rollback_support", "common_prefix_length", "make_runner",
           "model_context", "supports"]
