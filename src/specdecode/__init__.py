"""specdecode: lossless speculative decoding (draft model, prompt lookup, ...) on any causal LM.

Quick start::

    from specdecode.engine import EngineConfig, SpeculativeEngine
    from specdecode.models import load_model
    from specdecode.proposers import build_proposer
    from specdecode.types import SamplingParams

The names below load on first use (PEP 562), so ``import specdecode.cli`` and
``specdecode --help`` do not import torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

#: Public name -> the module that defines it, imported on first access.
_LAZY = {
    "Draft": "specdecode.types",
    "GenerationOutput": "specdecode.types",
    "SamplingParams": "specdecode.types",
    "SpecDecodeError": "specdecode.errors",
    "StepOutput": "specdecode.types",
    "VerifyResult": "specdecode.types",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'specdecode' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "Draft",
    "GenerationOutput",
    "SamplingParams",
    "SpecDecodeError",
    "StepOutput",
    "VerifyResult",
    "__version__",
]
