"""Draft-length policies: how many tokens to draft next step (gamma, ``num_speculative_tokens``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FixedPolicy:
    """Always draft ``num_speculative_tokens`` (vLLM's and the paper's fixed gamma)."""

    num_speculative_tokens: int

    def next_length(self) -> int:
        return self.num_speculative_tokens

    def update(self, num_drafted: int, num_accepted: int) -> None:  # noqa: ARG002 - fixed ignores feedback
        return None


POLICIES = {"fixed": FixedPolicy}
