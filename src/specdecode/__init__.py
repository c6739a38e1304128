"""specdecode: lossless speculative decoding (draft model, prompt lookup, ...) on any causal LM.

Quick start::

    from specdecode.engine import EngineConfig, SpeculativeEngine
    from specdecode.models import load_model
    from specdecode.proposers import build_proposer
    from specdecode.types import SamplingParams
"""

from specdecode.types import (
    Draft,
    GenerationOutput,
    SamplingParams,
    SpecDecodeError,
    StepOutput,
    VerifyResult,
)

__version__ = "0.1.0"

__all__ = [
    "Draft",
    "GenerationOutput",
    "SamplingParams",
    "SpecDecodeError",
    "StepOutput",
    "VerifyResult",
    "__version__",
]
