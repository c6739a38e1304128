"""The proposer contract (batched) and the registry that builds proposers by name.

A proposer drafts for every row of the engine's batch at once::

    propose(batch: [ProposeContext] * B, max_tokens: [int] * B) -> [Draft] * B

Row i's draft is a chain or a token tree of at most ``max_tokens[i]`` levels, [1, N_i] int64
ids in [0, V) (checked by the engine, which names the proposer on a violation). Per-row work stays
inside the proposer (vLLM's ``batch_propose``): a draft model runs one batched forward per draft
position; model-free drafters loop over rows. Per-request state lives in ``ctx.state``; slot state
(a draft model's own KV cache rows) follows ``ctx.slot``, and :meth:`Proposer.move` is called when
the engine compacts its rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specdecode.kv import make_runner
from specdecode.options import AUTO_DRAFT_VOCAB
from specdecode.sampling import argmax, logits_to_probs
from specdecode.types import Draft, SamplingParams, SpecDecodeError, VerifyResult


@dataclass
class ProposeContext:
    """What a proposer may look at for one request (one row of the batch).

    Attributes:
        token_ids: every committed token, prompt first (a list the engine appends to).
        num_prompt_tokens: how many of ``token_ids`` are the prompt.
        params: the request's sampling parameters (drafts use the same processing).
        generator: the request's random generator (sampling drafters draw from it).
        vocab_size: the target's output vocabulary V; drafts must stay below it.
        should_continue: the draft-length policy's per-token hook, or None. Model-based
            drafters call it after each drafted token with the [V] float32 distribution
            the token came from (greedy: softmax of the processed logits); False ends the chain.
        slot: the row's slot in the engine's KV cache (rows occupy slots 0..B-1, in batch order).
        state: per-request state owned by the proposer (lookup indexes, tree regions).
        sampler: the request's ``sampling.RequestSampler`` (penalties, biases, masks, grammar), or None.
        noise: the request's ``coupled.CoupledNoise`` in the coupled mode, else None.
    """

    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator
    vocab_size: int
    should_continue: Callable[[torch.Tensor], bool] | None = None
    slot: int = 0
    state: dict = field(default_factory=dict)
    sampler: object = None
    noise: object = None

    def draft_dist(self, logits: torch.Tensor, path: Sequence[int] = ()) -> torch.Tensor:
        """q at one draft position: [V'] raw draft logits -> [V'] float32, after the request's whole
        processing with the context that position has (committed tokens + ``path``, the tokens drafted
        before it on its branch). Greedy requests get the softmax of the processed logits (a score
        for candidate ranking and the policy's hook)."""
        if self.sampler is None:
            return torch.softmax(logits.float(), -1) if self.params.greedy else logits_to_probs(logits, self.params)
        processed = self.sampler.process(logits.unsqueeze(0), [list(path)])[0]
        if self.params.greedy:
            return torch.softmax(processed, -1)
        return logits_to_probs(processed, self.params)

    def draft_token(self, q: torch.Tensor, depth: int) -> int:
        """Draw a draft token from [V'] q at ``depth`` draft tokens past the committed ones: the argmax
        for greedy requests, the coupled mode's Gumbel-max choice (the target's own noise at that
        output position), else a sample from the request's generator."""
        if self.params.greedy:
            return int(argmax(q))
        if self.noise is not None:
            return int(self.noise.choose(q.unsqueeze(0), [len(self.token_ids) - self.num_prompt_tokens + depth])[0])
        return int(torch.multinomial(q, 1, generator=self.generator))

    def keep_drafting(self, probs: torch.Tensor) -> bool:
        """Ask the policy hook whether to draft another token after one drawn from ``probs`` [V]."""
        return self.should_continue is None or bool(self.should_continue(probs))


def still_indexed(seen: list[int], token_ids: list[int]) -> bool:
    """Whether ``token_ids`` still starts with ``seen``, the copy of the tokens a lookup index was built from.

    A copy, compared whole each step (list equality, C speed: ~20 us per 8k tokens), because a context can
    change in place (``ids[:] = other``, a token in the middle) while the list object, its length and its last
    token stay: an index must then be rebuilt, never appended to (a cut or replaced context as well).
    """
    n = len(seen)
    return len(token_ids) >= n and token_ids[:n] == seen


def draft_room(max_context: int, ctx: ProposeContext) -> int:
    """Most tokens a draft model of ``max_context`` positions can draft after ``ctx.token_ids``.

    It feeds every committed token and every drafted token but the last, so k drafts need
    ``len(token_ids) + k - 1 <= max_context``; 0 or less: the draft cannot hold the context.
    """
    return max_context - len(ctx.token_ids) + 1


class Proposer:
    """Base class of every proposer: the engine's calls, with do-nothing defaults.

    Lifecycle: ``bind`` once when the engine is built; per request ``start`` (joins the batch),
    then per step ``propose`` / ``observe`` for the whole batch, ``finish`` when it leaves.
    """

    #: True when drafts may be token trees (the engine then verifies with the tree verifier).
    produces_trees: bool = False
    #: True when drafts may depend on earlier requests (suffix decoding's global tree of earlier outputs, a
    #: layer-skip set searched on an earlier prompt): a repeat of a prompt is then not the same run as its first,
    #: so its timing is not a first run's. True unless a proposer declares that nothing carries over.
    remembers_requests: bool = True
    #: True when :meth:`observe` must run after every verification, also when nothing was drafted
    #: (a feature-level head reads the target's hidden states of every committed token).
    observes_every_step: bool = False
    #: Name used in error messages and metrics.
    name: str = "proposer"

    def bind(self, target, num_slots: int) -> None:
        """The engine's target runner (a ``kv.SlotRunner``) and its number of slots."""

    def start(self, ctx: ProposeContext) -> None:
        """A request joined the batch at ``ctx.slot``."""

    def propose(self, batch: Sequence[ProposeContext], max_tokens: Sequence[int]) -> list[Draft]:
        """Draft for every row at once.

        Args:
            batch: [B] the rows' contexts, in slot order (``batch[i].slot == i``).
            max_tokens: [B] the most draft levels row i may propose (0: none this step).

        Returns:
            [B] drafts: per row token_ids [1, N] int64 in [0, V), parents [1, N] int64 (a chain
            -1, 0, 1, ... unless ``produces_trees``), depth <= max_tokens[i], and draft_probs
            [1, N, <= V] float32 (the law each token was drawn from, after the row's sampling
            processing: finite, >= 0, each node's row summing to 1) or None for deterministic drafters. ``Draft.empty()`` proposes nothing.
            The engine checks this contract and fails a violating row alone.
        """
        raise NotImplementedError

    def observe(self, batch: Sequence[ProposeContext], results: Sequence[VerifyResult]) -> None:
        """After verification (the rows' ``token_ids`` already hold what was committed)."""

    def finish(self, ctx: ProposeContext) -> None:
        """A request left the batch (finished or cancelled)."""

    def move(self, src: int, dst: int) -> None:
        """The engine moved the row in slot ``src`` to slot ``dst`` (compaction)."""

    def release(self) -> None:
        """No rows left: free whatever memory the proposer holds (its own KV cache)."""

    @property
    def nbytes(self) -> int:
        """Bytes the proposer's own KV cache holds (0 for model-free drafters)."""
        return 0


class RowProposer(Proposer):
    """A proposer whose work is per row: ``propose_row(ctx, k) -> Draft [1, N]``; rows loop here."""

    remembers_requests = False  # a row's draft reads its own context only (subclasses with memory say so)

    def propose(self, batch: Sequence[ProposeContext], max_tokens: Sequence[int]) -> list[Draft]:
        return [self.propose_row(ctx, k) if k > 0 else Draft.empty() for ctx, k in zip(batch, max_tokens)]

    def propose_row(self, ctx: ProposeContext, max_tokens: int) -> Draft:
        raise NotImplementedError


class DraftModelSlots(Proposer):
    """A proposer running its own model on a slot KV cache that mirrors the engine's rows (row i in slot i).

    Subclasses set ``self.model`` and ``self.forward`` (a ``kv`` backend name); :meth:`bind` builds the
    runner with the engine's number of slots and the shorter of both contexts.
    """

    remembers_requests = False  # a request starts and ends with its slot cleared (start / finish)

    model: torch.nn.Module
    forward: str = "auto"
    runner = None

    def bind(self, target, num_slots: int) -> None:
        from_ctx = min(getattr(self, "max_context", target.max_context), target.max_context)
        # a draft needs no batch invariance (its tokens are verified by the target): its fast numerics
        self.runner = make_runner(self.model, self.forward, num_slots, from_ctx, batch_invariant=False)
        vocab = getattr(getattr(self, "config", None), "vocab", 0)  # DraftModelConfig.vocab (0: every id)
        if vocab is None:  # automatic: a large vocabulary, where the forward can limit it
            big = self.runner.limits_vocabulary and self.runner.vocab_size > 2 * AUTO_DRAFT_VOCAB
            vocab = AUTO_DRAFT_VOCAB if big else 0
        if vocab:
            self.runner.limit_vocabulary(vocab)
        self.max_context = self.runner.max_context

    #: Rows lacking more tokens than this (a new prompt) are fed alone before the batched forward; shorter
    #: gaps (the tokens of plain steps the draft skipped) are caught up together in the batched forward.
    SOLO_FEED = 64

    def sync_rows(self, contexts: Sequence[Sequence[int]], caps: Sequence[int]) -> tuple[torch.Tensor, list[float]]:
        """Cut row i's draft cache to the longest prefix it shares with ``contexts[i]`` (the committed tokens in
        the draft's ids; at least one left to feed), feed the rest: rows lacking more than :attr:`SOLO_FEED`
        alone first, then every row in one batched forward. Rows with ``caps[i] <= 0`` are not touched.

        Returns:
            [b, V_draft] logits at each row's last context token, and per-row catch-up seconds (a prompt fed
            alone; see ``Draft.catch_up_s``).
        """
        runner = self._bound()
        feeds, catch_up = [], [0.0] * len(contexts)
        for i, ids in enumerate(contexts):
            if caps[i] <= 0:
                feeds.append([])
                continue
            runner.sync(i, ids)
            if runner.length(i) == len(ids):  # never feed nothing: recompute the last token
                runner.rollback(i, len(ids) - 1)
            lacking = list(ids[runner.length(i):])
            if len(lacking) > self.SOLO_FEED:  # a prompt: alone, so the batch is not padded to its length
                t0 = time.perf_counter()
                runner.forward(slice(i, i + 1), [lacking[:-1]], last_only=True)
                catch_up[i] = time.perf_counter() - t0
                lacking = lacking[-1:]
            feeds.append(lacking)
        out = runner.forward(slice(0, len(contexts)), feeds, last_only=True)  # [b, 1, V]
        return out[:, -1], catch_up

    def start(self, ctx: ProposeContext) -> None:
        self._bound().clear(ctx.slot)

    def finish(self, ctx: ProposeContext) -> None:
        self._bound().clear(ctx.slot)

    def move(self, src: int, dst: int) -> None:
        self._bound().move(src, dst)

    def release(self) -> None:
        if self.runner is not None:
            self.runner.release()

    @property
    def nbytes(self) -> int:
        return 0 if self.runner is None else self.runner.nbytes

    def _bound(self):
        if self.runner is None:
            raise SpecDecodeError(f"the {self.name} proposer is not bound to an engine (SpeculativeEngine binds it)")
        return self.runner


ProposerFactory = Callable[..., Proposer]
PROPOSERS: dict[str, ProposerFactory] = {}


def register(name: str) -> Callable[[ProposerFactory], ProposerFactory]:
    """Class decorator: make a proposer buildable by ``build_proposer(name, ...)``."""

    def deco(factory: ProposerFactory) -> ProposerFactory:
        PROPOSERS[name] = factory
        factory.name = name  # a class's proposers report it; a factory function carries it too
        return factory

    return deco
