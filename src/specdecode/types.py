"""Plain data passed around the speculative-decoding loop.

Shapes use B = batch, N = draft nodes, K = max draft length, V = vocabulary.
The engine works on token ids only; text lives at the edges (CLI, server).
"""

from __future__ import annotations

from collections.abc import Mapping
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
    """How one request samples: the whole OpenAI / vLLM sampling surface, applied identically to the
    target's p and the drafter's q at every verified position (``specdecode.sampling``).

    The processing order: logit_bias with the allowed / banned token ids, a grammar's mask (if any),
    min_tokens (stop tokens masked), the repetition, frequency and presence penalties, temperature,
    then min_p, top-k and top-p (``specdecode.sampling``). A greedy request (temperature 0) takes the
    argmax of the processed logits.

    Attributes:
        temperature: 0 means greedy (argmax); > 0 divides the logits. Range [0, 100].
        top_k: keep the k most likely tokens; 0 disables.
        top_p: nucleus sampling mass in (0, 1]; 1 disables.
        min_p: drop tokens whose probability is below ``min_p`` times the most likely one's; [0, 1], 0 disables.
        repetition_penalty: (0, 100]; a token already in the prompt or the output has its logit divided
            by it when positive, multiplied when negative (Keskar et al. 2019; HF / vLLM). 1 disables.
        presence_penalty: [-2, 2]; subtracted once from the logit of every token already generated (OpenAI).
        frequency_penalty: [-2, 2]; subtracted once per earlier occurrence in the output (OpenAI).
        logit_bias: token id -> additive bias in [-100, 100]; -100 bans the token (OpenAI).
        allowed_token_ids: only these tokens may be generated (None: all).
        banned_token_ids: these tokens are never generated.
        min_tokens: EOS and ``stop_token_ids`` are masked until this many tokens were generated (unless
            they are all that the other masks leave).
        stop_token_ids: more tokens that end generation like EOS (included in the output ids).
        max_new_tokens: hard cap on generated tokens (never exceeded), >= 1.
        seed: seeds the request's randomness; None draws a random seed.
        eos_token_ids: generation ends at (and includes) the first of these tokens.
        ignore_eos: keep generating past EOS (benchmarks with a fixed length).
        coupled: the coupled sampling mode (``specdecode.coupled``): every random draw keyed by
            (seed, position, purpose), so a seeded speculative run reproduces seeded plain decoding
            token for token whatever the drafter, gamma or batch. None = auto: coupled when a seed
            is given, standard rejection sampling otherwise.

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
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    banned_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    coupled: bool | None = None

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p, self.max_new_tokens, self.seed,
                       min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                       presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                       logit_bias=self.logit_bias, allowed_token_ids=self.allowed_token_ids,
                       banned_token_ids=self.banned_token_ids, min_tokens=self.min_tokens,
                       stop_token_ids=self.stop_token_ids, coupled=self.coupled)
        # Frozen, hashable-friendly forms of the collections (a dict or list given by a caller).
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", {int(k): float(v) for k, v in self.logit_bias.items()})
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(int(t) for t in self.allowed_token_ids))
        for name in ("banned_token_ids", "stop_token_ids", "eos_token_ids"):
            object.__setattr__(self, name, tuple(int(t) for t in getattr(self, name)))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Every token that ends generation: EOS (unless ``ignore_eos``) and ``stop_token_ids``."""
        return (() if self.ignore_eos else self.eos_token_ids) + self.stop_token_ids

    @property
    def uses_coupled(self) -> bool:
        """Whether this request samples in the coupled mode (greedy requests draw nothing)."""
        if self.greedy:
            return False
        return self.seed is not None if self.coupled is None else self.coupled

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass
class Draft:
    """A proposer's guess for one row of the batch (proposers return one per row, B = 1 each).

    Attributes:
        token_ids: [B, N] int64 draft tokens.
        parents: [B, N] int64 parent node index, -1 = child of the last committed
            token. A chain has parents -1, 0, 1, ...
        draft_probs: [B, N, V] float32 distribution q each token was drawn from,
            after the request's whole processing along the token's draft path
            (``ProposeContext.draft_dist``): finite, >= 0, each row summing to 1 (the
            engine refuses any other); None for a deterministic drafter (q is then
            one-hot on the token).
        catch_up_s: seconds of this proposal spent bringing the drafter's own cache up to
            tokens committed earlier (a draft model's prompt prefill, or the tokens of plain
            decoding steps it skipped). A one-off cost, not a per-token one: draft-length
            policies learn the draft cost without it.
        match_length: a lookup drafter's evidence (n-gram, suffix): how many tokens of the context it
            matched to find this continuation (a longer match predicts a longer accepted run); None for
            drafters without one (draft models). The ``cost-model`` policy rates drafts by it and may
            verify only a prefix of the chain (``DraftLengthPolicy.trim``).
    """

    token_ids: torch.Tensor
    parents: torch.Tensor
    draft_probs: torch.Tensor | None = None
    catch_up_s: float = 0.0
    match_length: int | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[1])

    @staticmethod
    def chain(token_ids: torch.Tensor, draft_probs: torch.Tensor | None = None, catch_up_s: float = 0.0,
              match_length: int | None = None) -> "Draft":
        """Build a chain draft from [B, K] int64 tokens (and optional [B, K, V] float32 q)."""
        b, k = token_ids.shape
        parents = torch.arange(-1, k - 1, dtype=torch.int64).expand(b, k)
        return Draft(token_ids=token_ids, parents=parents, draft_probs=draft_probs, catch_up_s=catch_up_s,
                     match_length=match_length)

    def is_chain(self) -> bool:
        """Whether the tokens form one chain (parents -1, 0, 1, ...), not a token tree."""
        return self.parents[0].tolist() == list(range(-1, self.num_tokens - 1))

    def prefix(self, n: int) -> "Draft":
        """A chain's first ``n`` tokens (its q too), the rest dropped: what verifying fewer tokens needs.

        Raises:
            ValueError: a token tree, or n outside [0, num_tokens].
        """
        if not 0 <= n <= self.num_tokens or not self.is_chain():
            raise ValueError(f"prefix({n}) of a draft of {self.num_tokens} tokens that is "
                             f"{'a chain' if self.is_chain() else 'a token tree'}")
        if n == self.num_tokens:
            return self
        q = None if self.draft_probs is None else self.draft_probs[:, :n]
        return Draft.chain(self.token_ids[:, :n], q, self.catch_up_s, self.match_length)

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
        prompt_logprobs: on a request's first output only, when asked: per prompt token (logprob,
            rank, top n [(token id, logprob)]) given the tokens before it; (None, None, []) for the first.
    """

    token_ids: list[int]
    num_drafted: int = 0
    num_accepted: int = 0
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    error: str | None = None
    prompt_logprobs: list[tuple[float | None, int | None, list[tuple[int, float]]]] | None = None


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
