"""specdecode: lossless speculative decoding (draft model, prompt lookup, ...) on any causal LM.

Quick start::

    from specdecode import load_model, SpeculativeEngine, SamplingParams, build_proposer
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
