"""Plain data passed around the speculative-decoding loop.

Shapes use B = batch, N = draft nodes, K = max draft length, V = vocabulary.
The engine works on token ids only; text lives at the edges (CLI, server).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# The errors and the range checks live in modules without torch, so the CLI refuses a bad value at once.
from specdecode.errors import InvalidSamplingParams, SpecDecodeError  # noqa: F401 - re-exported
from specdecode.validate import MAX_NEW_TOKENS_LIMIT, check_sampling  # noqa: F401 - re-exported


class ProposerContractError(SpecDecodeError):
    """A proposer returned drafts that break the contract (ids outside [0, V), wrong shapes)."""


class EngineFullError(SpecDecodeError):
    """Every slot of the engine's batch is taken; wait for a request to finish (the scheduler queues)."""


class PromptTooLongError(SpecDecodeError):
    """The prompt plus the requested new tokens does not fit the model's context."""


class EmptyPromptError(SpecDecodeError):
    """The prompt has no tokens and the tokenizer has no BOS token to start from."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples.

    Attributes:
        temperature: 0 means greedy (argmax); > 0 divides the logits. Range [0, 100].
        top_k: keep the k most likely tokens; 0 disables.
        top_p: nucleus sampling mass in (0, 1]; 1 disables.
        max_new_tokens: hard cap on generated tokens (never exceeded), >= 1.
        seed: seeds the request's own ``torch.Generator``; None draws a random seed.
        eos_token_ids: generation ends at (and includes) the first of these tokens.
        ignore_eos: keep generating past EOS (benchmarks with a fixed length).

    Raises:
        InvalidSamplingParams: on construction, for any value out of range (``validate.check_sampling``).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 128
    seed: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p, self.max_new_tokens, self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Draft:
    """A proposer's guess for one row of the batch (proposers return one per row, B = 1 each).

    Attributes:
        token_ids: [B, N] int64 draft tokens.
        parents: [B, N] int64 parent node index, -1 = child of the last committed
            token. A chain has parents -1, 0, 1, ...
        draft_probs: [B, N, V] float32 distribution q each token was drawn from,
            after the request's temperature / top-k / top-p; None for a
            deterministic drafter (q is then one-hot on the token).
        catch_up_s: seconds of this proposal spent bringing the drafter's own cache up to
            tokens committed earlier (a draft model's prompt prefill, or the tokens of plain
            decoding steps it skipped). A one-off cost, not a per-token one: draft-length
            policies learn the draft cost without it.
    """

    token_ids: torch.Tensor
    parents: torch.Tensor
    draft_probs: torch.Tensor | None = None
    catch_up_s: float = 0.0

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[1])

    @staticmethod
    def chain(token_ids: torch.Tensor, draft_probs: torch.Tensor | None = None, catch_up_s: float = 0.0) -> "Draft":
        """Build a chain draft from [B, K] int64 tokens (and optional [B, K, V] float32 q)."""
        b, k = token_ids.shape
        parents = torch.arange(-1, k - 1, dtype=torch.int64).expand(b, k)
        return Draft(token_ids=token_ids, parents=parents, draft_probs=draft_probs, catch_up_s=catch_up_s)

    @staticmethod
    def empty(batch_size: int = 1) -> "Draft":
        """A draft with no tokens: the step becomes one plain decoding step."""
        z = torch.zeros(batch_size, 0, dtype=torch.int64)
        return Draft(token_ids=z, parents=z.clone(), draft_probs=None)


@dataclass
class VerifyResult:
    """What verification kept.

    Attributes:
        num_accepted: [B] int64 draft tokens kept (0..K).
        new_token_ids: [B, K+1] int64 tokens to commit: the accepted draft tokens,
            then one recovered (after a rejection) or bonus (all kept) token; PAD
            (-1) after ``num_accepted + 1``.
        kept_nodes: [B, K+1] int64 draft node indices of the accepted tokens (-1 after);
            for a chain, 0..num_accepted-1.
    """

    num_accepted: torch.Tensor
    new_token_ids: torch.Tensor
    kept_nodes: torch.Tensor


PAD_TOKEN_ID = -1


@dataclass
class StepOutput:
    """One engine step of one request, as streamed: the tokens it committed (after stopping rules).

    Attributes:
        token_ids: tokens committed this step (the prefill's first token for the request's first output).
        num_drafted, num_accepted: draft tokens verified / kept that could be committed (counted
            up to an EOS or the token cap inside the block).
        finished, finish_reason: "length" | "stop" (EOS) | "cancelled" | "error" | None.
        logprobs: log p_target (raw logits, temperature 1) of each committed token, when asked.
        top_logprobs: per committed token, the n most likely (token id, logprob), when asked.
        error: a message when the request failed (finish_reason "error").
    """

    token_ids: list[int]
    num_drafted: int = 0
    num_accepted: int = 0
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    error: str | None = None


@dataclass
class GenerationOutput:
    """The result of one request (batch size 1).

    Attributes:
        token_ids: generated token ids (prompt excluded).
        finish_reason: "length" (max_new_tokens), "stop" (EOS or stop string).
        metrics: counters and times of this run (see ``specdecode.metrics``).
    """

    token_ids: list[int]
    finish_reason: str
    metrics: "object"
    text: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
