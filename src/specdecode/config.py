"""Settings of the engine and of one request's speculation: frozen dataclasses, checked on construction by
:mod:`specdecode.validate` (the one copy of the limits, which the command line uses too)."""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.options import DEFAULT_GAMMA
from specdecode.validate import check_engine, check_request_speculation  # the rules, without torch: the CLI checks with them too


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings: the engine's defaults, checked on construction by ``validate.check_engine`` (the one copy
    of its limits, which the command line uses too).

    Attributes:
        num_speculative_tokens: gamma, draft tokens per step (1..64) for the fixed policy.
        max_batch_size: rows decoded together (KV cache slots), 1..256.
        max_context: positions per row; None reads the target's config.
        forward: target forward backend: "auto" (the project's own Llama / Qwen2 forward when the
            model is supported, else Hugging Face), "hf", or "owned".
        verification: how sampled chains are verified: "token" (Leviathan et al. 2023), "block"
            (Sun et al. 2024, ``verify.verify_block``), or "auto": block for sampling drafters,
            token-level for deterministic ones (where block keeps exactly as much). Greedy and
            coupled rows are verified by exact match either way; token trees by ``specdecode.tree``.

    Raises:
        SpecDecodeError: a value out of range.
    """

    num_speculative_tokens: int = DEFAULT_GAMMA
    max_batch_size: int = 1
    max_context: int | None = None
    forward: str = "auto"
    verification: str = "auto"

    def __post_init__(self) -> None:
        check_engine(self.num_speculative_tokens, self.max_batch_size, self.max_context, self.forward,
                     self.verification)


@dataclass(frozen=True)
class RequestSpeculation:
    """One request's own speculation settings (the server's ``"speculative"`` extension field).

    Attributes:
        enabled: False decodes this request plainly (one token per step) whatever the engine's proposer.
        num_speculative_tokens: this request's gamma (1..64) in place of the draft-length policy's
            choice; None follows the policy.
        verification: "token" | "block" | None (the engine's setting) for this request's sampled chains.

    Raises:
        SpecDecodeError: gamma outside 1..64 or an unknown verification method.
    """

    enabled: bool = True
    num_speculative_tokens: int | None = None
    verification: str | None = None

    def __post_init__(self) -> None:
        check_request_speculation(self.enabled, self.num_speculative_tokens, self.verification)
