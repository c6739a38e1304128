"""Batched speculative decoding: many requests, one target forward per step, ragged acceptance.

The loop is the engine's (propose -> verify in one target pass -> accept / reject
-> commit -> adapt), run over a batch of requests that join and leave between
steps. Each step:

1. every row drafts up to gamma tokens with its own proposer (rows may get
   fewer, e.g. no n-gram match);
2. the target scores ``[last committed token, draft...]`` of every row in ONE
   batched forward ``[B, K+1]`` (rows with shorter drafts are right-padded);
3. each row is verified with its own sampling parameters and its own
   ``torch.Generator`` (greedy rows together, sampled rows one by one) and
   accepts its own number of tokens;
4. each row's cache length is set back to what it committed (rollback is a
   length change, nothing is copied);
5. the draft-length policy picks the next gamma for the batch size, from a
   cost model measured on this machine (speculation is shortened or switched
   off when the batch is large enough that verifying padded drafts costs more
   than it brings).

KV cache layout (:class:`BatchKVCache`): per layer one buffer
``[slots, kv_heads, capacity, head_dim]``; row i keeps its tokens contiguous in
columns ``[0, length_i)`` of slot i, and a step writes its new tokens at
columns ``length_i ..`` of that row (per-row write positions). Every forward
gets a 4-D attention mask with ``column <= position`` per row and per-row
``position_ids``, so stale entries past a row's length (rejected draft tokens,
padding) are never attended and are overwritten by the next step. The active
rows always occupy slots ``0..B-1`` (a leaving row's slot is filled with the
last row), so the attention reads a view of the buffers: no per-step copy.

A request's output does not depend on the rest of the batch: its tokens,
positions, mask row, draft and random draws are its own; only floating-point
summation order can differ between batch shapes (exact in float64; in float32
a greedy near-tie can flip). Sampled requests draw the same random numbers as
alone whenever the draft lengths are the same (fixed policy); the cost-model
policy makes gamma depend on the batch size, which changes which random
numbers are drawn, not the output distribution.

Drafting: a draft model drafts for all rows together (:class:`BatchDraftModel`:
its own slot-per-row cache, one batched draft forward per draft position);
other proposers (n-gram lookup) run per row, each request with its own
instance.
"""

from __future__ import annotations

import ctypes
import inspect
import itertools
import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache

from specdecode.cache import model_context
from specdecode.engine import apply_stopping_rules
from specdecode.metrics import RunMetrics
from specdecode.proposers.base import ProposeContext, Proposer, draft_room
from specdecode.sampling import logits_to_probs, next_token, sample
from specdecode.types import (
    PAD_TOKEN_ID,
    Draft,
    EmptyPromptError,
    PromptTooLongError,
    SamplingParams,
    SpecDecodeError,
    VerifyResult,
)
from specdecode.verify import verify_greedy, verify_sampling


logger = logging.getLogger(__name__)


class QueueFullError(SpecDecodeError):
    """The engine's waiting queue is full; the caller should retry later (HTTP 429)."""


class EngineStoppedError(SpecDecodeError):
    """The engine was closed and takes no more requests (HTTP 503)."""


# --------------------------------------------------------------------------- KV cache


class BatchKVCache(Cache):
    """A KV cache with one contiguous row per slot and per-row lengths (Hugging Face ``Cache`` API).

    Buffers: per layer, keys and values ``[num_slots, kv_heads, capacity, head_dim]`` in the model's
    dtype, allocated on the first forward and grown (doubled) when a row needs more columns, up to
    ``max_capacity`` (the runner's context plus its scratch column).
    ``lengths[s]`` is the number of valid tokens of slot s (columns ``[0, lengths[s])``).

    The runner sets ``_rows`` (a slice of slots), ``_write`` ([b, q] int64 columns) and ``_kv_len``
    before each forward; :meth:`update` writes the new keys / values of row i at its own columns
    and returns views ``[b, kv_heads, kv_len, head_dim]``.
    """

    def __init__(self, num_slots: int, max_capacity: int) -> None:
        super().__init__(layers=[])
        self.num_slots = num_slots
        self.max_capacity = max_capacity
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.capacity = 0
        self.lengths = [0] * num_slots
        self._rows = slice(0, 0)
        self._write: torch.Tensor | None = None
        self._row_index: torch.Tensor | None = None
        self._kv_len = 0

    # What a forward needs ----------------------------------------------------------

    def prepare(self, rows: slice, write_columns: torch.Tensor, kv_len: int) -> None:
        """Set the rows (slots) and the [b, q] int64 columns the next forward writes."""
        self.ensure_capacity(kv_len)
        self._rows = rows
        self._write = write_columns
        self._row_index = torch.arange(write_columns.shape[0]).unsqueeze(1)
        self._kv_len = kv_len

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write [b, kv_heads, q, head_dim] keys / values at each row's columns; return [b, kv_heads, kv_len, d]."""
        if layer_idx == len(self.keys):
            shape = (self.num_slots, key_states.shape[1], self.capacity, key_states.shape[3])
            self.keys.append(torch.zeros(shape, dtype=key_states.dtype))
            self.values.append(torch.zeros(shape, dtype=value_states.dtype))
        keys = self.keys[layer_idx][self._rows]
        values = self.values[layer_idx][self._rows]
        keys[self._row_index, :, self._write] = key_states.transpose(1, 2)
        values[self._row_index, :, self._write] = value_states.transpose(1, 2)
        return keys[:, :, : self._kv_len], values[:, :, : self._kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:  # noqa: ARG002 - positions are always passed
        return self._kv_len

    # Storage management -------------------------------------------------------------

    @torch.inference_mode()
    def ensure_capacity(self, columns: int) -> None:
        """Grow every buffer to hold ``columns`` columns (doubling, in steps of 64, up to max_capacity)."""
        if columns <= self.capacity:
            return
        if columns > self.max_capacity:
            raise PromptTooLongError(f"a row needs {columns} cache columns; the cache holds {self.max_capacity}")
        new = min(self.max_capacity, max(columns, 2 * self.capacity, 64))
        new = min(self.max_capacity, -(-new // 64) * 64)
        for store in (self.keys, self.values):
            for i, buf in enumerate(store):
                grown = torch.zeros((*buf.shape[:2], new, buf.shape[3]), dtype=buf.dtype)
                grown[:, :, : self.capacity] = buf
                store[i] = grown
        self.capacity = new

    @torch.inference_mode()
    def move(self, src: int, dst: int) -> None:
        """Copy slot ``src``'s valid tokens into slot ``dst`` (compaction when a row leaves)."""
        n = self.lengths[src]
        for store in (self.keys, self.values):
            for buf in store:
                buf[dst, :, :n] = buf[src, :, :n]
        self.lengths[dst] = n
        self.lengths[src] = 0

    def release(self) -> None:
        """Free every buffer (no active rows): memory goes back to the allocator."""
        self.keys, self.values = [], []
        self.capacity = 0
        self.lengths = [0] * self.num_slots

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(b.numel() * b.element_size() for store in (self.keys, self.values) for b in store)


class BatchRunner:
    """A Hugging Face causal LM run over rows of a :class:`BatchKVCache`, each at its own length.

    A batched forward pads every row to the longest feed; padding that would land past the context
    (a row near its end beside rows that draft more) is written to one scratch column at index
    ``max_context``, which no real token attends to, so a row at the context limit never stops
    the batch.

    Args:
        model: causal LM in eval mode whose forward takes ``attention_mask`` (4-D), ``position_ids``
            and a ``Cache`` (every Llama / Qwen2 / Mistral / Gemma style model in transformers 5).
        num_slots: rows the cache holds (the maximum batch size).
        max_context: positions per row.
    """

    #: Cache columns past the context: where padding that would fall beyond it is written.
    SCRATCH_COLUMNS = 1

    def __init__(self, model: torch.nn.Module, num_slots: int, max_context: int) -> None:
        self.model = model
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._keeps_logits = "logits_to_keep" in params
        self.max_context = max_context
        self.cache = BatchKVCache(num_slots, max_context + self.SCRATCH_COLUMNS)
        self.dtype = next(model.parameters()).dtype

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @torch.inference_mode()
    def forward(self, rows: slice, token_ids: Sequence[Sequence[int]], last_only: bool = False) -> torch.Tensor:
        """Append each row's tokens at its own length and return their logits.

        Args:
            rows: the slots to run (``slice(0, B)`` for the batch, ``slice(s, s + 1)`` for one row).
            token_ids: one list of n_i new token ids per row, at least one row with n_i >= 1
                (a row with n_i = 0 only pads: its logits are padding).
            last_only: only the last position's logits (one row only: prefill).

        Returns:
            [b, q, V] float32 logits, q = max n_i (positions past n_i are padding: ignore them);
            [b, 1, V] with ``last_only``.

        Raises:
            PromptTooLongError: a row's own tokens would pass ``max_context``.
        """
        cache = self.cache
        b = len(token_ids)
        if last_only and b != 1:
            raise ValueError("last_only needs a single row")
        counts = [len(t) for t in token_ids]
        q = max(counts)
        lengths = cache.lengths[rows]
        need = max(n + c for n, c in zip(lengths, counts))
        if need > self.max_context:
            raise PromptTooLongError(f"a row needs {need} positions; the context holds {self.max_context}")
        ids = torch.zeros(b, q, dtype=torch.int64)
        for i, toks in enumerate(token_ids):
            ids[i, : counts[i]] = torch.as_tensor(list(toks), dtype=torch.int64)
        # [b, q] where each token's keys go; padding past the context shares the scratch column
        columns = (torch.tensor(lengths, dtype=torch.int64).unsqueeze(1) + torch.arange(q)).clamp(max=self.max_context)
        kv_len = min(max(lengths) + q, self.max_context + 1)
        cache.prepare(rows, columns, kv_len)
        positions = columns.clamp(max=self.max_context - 1)  # padding past the context never reads a position
        visible = torch.arange(kv_len).view(1, 1, kv_len) <= columns.unsqueeze(2)  # [b, q, kv_len]
        mask = torch.zeros(b, 1, q, kv_len, dtype=self.dtype)
        mask.masked_fill_(~visible.unsqueeze(1), torch.finfo(self.dtype).min)
        kwargs = {self._cache_kwarg: cache, "use_cache": True}
        if self._keeps_logits:
            kwargs["logits_to_keep"] = 1 if last_only else 0
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, **kwargs)
        for i, slot in enumerate(range(rows.start, rows.stop)):
            cache.lengths[slot] += counts[i]
        logits = out.logits
        return logits[:, -1:].float() if last_only else logits.float()


# --------------------------------------------------------------------------- draft-length policy


@dataclass(frozen=True)
class BatchPolicyConfig:
    """How the batch chooses gamma.

    Attributes:
        max_gamma: the configured ``num_speculative_tokens`` (upper bound).
        adaptive: False = always ``max_gamma`` (capped by each row's remaining tokens).
        prior_acceptance: acceptance rate assumed before any step is measured.
        decay: per-step decay of the acceptance counts (recent steps weigh more).
        probe_every: when speculation is off, draft ``max_gamma`` once every this many steps to
            keep measuring acceptance.
    """

    max_gamma: int = 5
    adaptive: bool = True
    prior_acceptance: float = 0.6
    decay: float = 0.98
    probe_every: int = 32


class CostModelPolicy:
    """Gamma for a batch of B rows that maximises expected tokens per second.

    A row that may draft g tokens commits E(g) = 1 + sum_{i<g} P(draft position i kept) tokens per
    step, where P(position i kept) is measured per position over the rows' steps (accepted at i /
    steps whose row could draft position i, decayed, blended with prior^(i+1)): bursty drafters
    such as prompt lookup keep long runs or nothing, which one i.i.d. acceptance rate (Leviathan
    et al. 2023, eq. 1) would under-rate. The step costs T(B * (g + 1)) + D(B, g), where T(n) is the
    measured time of one target forward over n tokens (piecewise-linear between calibration points)
    and D the drafting time: g batched draft forwards g * T_draft(B) for a batched draft model
    (``draft_forward_cost``), B * g * t_draft for per-row drafting (``draft_token_cost_s``; 0 for
    n-gram). Gamma = argmax over 0..max_gamma of B * E(g) / cost(g); 0 is plain decoding.
    """

    #: Weight (in row-steps) of the prior in each position's estimate.
    PRIOR_WEIGHT = 4.0

    def __init__(self, config: BatchPolicyConfig, forward_cost: Sequence[tuple[int, float]] | None = None,
                 draft_token_cost_s: float = 0.0,
                 draft_forward_cost: Sequence[tuple[int, float]] | None = None) -> None:
        self.config = config
        self.forward_cost = sorted(forward_cost or [])
        self.draft_forward_cost = sorted(draft_forward_cost or [])
        self.draft_token_cost_s = draft_token_cost_s
        self._reached = [0.0] * config.max_gamma  # decayed row-steps that could draft position i
        self._kept = [0.0] * config.max_gamma  # decayed row-steps that kept position i
        self._off_steps = 0
        self.last_gamma = config.max_gamma

    def kept_probability(self, position: int) -> float:
        """P(draft position ``position`` (0-based) is kept | the row could draft it), measured + prior."""
        prior = self.config.prior_acceptance ** (position + 1)
        w = self.PRIOR_WEIGHT
        return (self._kept[position] + w * prior) / (self._reached[position] + w)

    @property
    def acceptance(self) -> float:
        """Measured accepted / asked-for draft tokens over all positions (with the prior)."""
        w = self.PRIOR_WEIGHT
        return (sum(self._kept) + w * self.config.prior_acceptance) / (sum(self._reached) + w)

    def draft_cost(self, batch_size: int, gamma: int) -> float:
        """Seconds of drafting ``gamma`` tokens for ``batch_size`` rows."""
        if self.draft_forward_cost:
            return gamma * _interpolate(self.draft_forward_cost, batch_size)
        return batch_size * gamma * self.draft_token_cost_s

    def cost(self, num_tokens: int) -> float:
        """Seconds of one target forward over ``num_tokens`` tokens (interpolated; linear past the last point)."""
        return _interpolate(self.forward_cost, num_tokens)

    def expected_tokens(self, gamma: int) -> float:
        """Tokens a row commits per step when it may draft ``gamma`` tokens (bonus / recovered included)."""
        return 1.0 + sum(self.kept_probability(i) for i in range(gamma))

    def choose(self, batch_size: int) -> int:
        """Gamma for the next step of ``batch_size`` rows."""
        cfg = self.config
        if not cfg.adaptive or not self.forward_cost:
            gamma = cfg.max_gamma
        else:
            def rate(g: int) -> float:
                return batch_size * self.expected_tokens(g) / (
                    self.cost(batch_size * (g + 1)) + self.draft_cost(batch_size, g))

            gamma = max(range(cfg.max_gamma + 1), key=rate)
            if gamma == 0:
                self._off_steps += 1
                if self._off_steps >= cfg.probe_every:
                    self._off_steps = 0
                    gamma = cfg.max_gamma
        self.last_gamma = gamma
        return gamma

    def update(self, capacities: Sequence[int], accepted: Sequence[int]) -> None:
        """Record a step: per row, the draft tokens it could take and the number verification kept."""
        d = self.config.decay
        self._reached = [x * d for x in self._reached]
        self._kept = [x * d for x in self._kept]
        for cap, n in zip(capacities, accepted):
            for i in range(min(cap, len(self._reached))):
                self._reached[i] += 1.0
            for i in range(min(n, len(self._kept))):
                self._kept[i] += 1.0


def _interpolate(points: Sequence[tuple[int, float]], n: int) -> float:
    """Piecewise-linear y(n) through sorted (n, y) points; linear extrapolation past the last one."""
    if not points:
        return float(n)
    if n <= points[0][0]:
        return points[0][1]
    for (n0, t0), (n1, t1) in itertools.pairwise(points):
        if n <= n1:
            return t0 + (t1 - t0) * (n - n0) / (n1 - n0)
    if len(points) == 1:
        return points[0][1]
    (n0, t0), (n1, t1) = points[-2:]
    return t1 + (t1 - t0) / (n1 - n0) * (n - n1)


def calibrate_forward_cost(runner: BatchRunner, max_tokens: int, repeats: int = 2) -> list[tuple[int, float]]:
    """Measure seconds per target forward over n tokens (one row, short context), n = 1, 2, 4, ... max_tokens.

    Uses slot 0 of an empty runner and releases the cache afterwards.
    """
    points = []
    sizes = sorted({1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256} | {max_tokens})
    sizes = [n for n in sizes if n <= max(1, max_tokens)]
    context = min(32, runner.max_context - max(sizes))
    for n in sizes:
        best = math.inf
        for _ in range(repeats):
            runner.cache.lengths[0] = context
            t0 = time.perf_counter()
            runner.forward(slice(0, 1), [[0] * n])
            best = min(best, time.perf_counter() - t0)
        points.append((n, best))
    runner.cache.release()
    # Contention only ever adds time: make the curve non-decreasing by a running minimum from the right.
    for i in range(len(points) - 2, -1, -1):
        points[i] = (points[i][0], min(points[i][1], points[i + 1][1]))
    return points


# --------------------------------------------------------------------------- batched draft model


class BatchDraftModel:
    """Draft-model drafting for the whole batch: one draft forward per draft position (Leviathan et al. 2023).

    The draft model has its own :class:`BatchKVCache` whose slots mirror the target's (row i in slot i).
    A row's draft cache holds a prefix of its committed tokens plus, while drafting, its own drafts.
    Each step: cut every row back to the longest prefix verification kept (a length change), feed what
    it lacks (one or two tokens, or a whole prompt fed alone first), then draft: per position, each row
    picks its token with its own params and generator (argmax, or a sample from q after the same
    temperature / top-k / top-p), and all rows' tokens go through one batched draft forward. A row
    draws exactly the random numbers :class:`~specdecode.proposers.DraftModelProposer` draws alone.

    A draft whose context (``max_position_embeddings``) is shorter than the target's drafts for a row
    only while the row's tokens and drafts fit it, as ``DraftModelProposer`` does; past that the row
    decodes plainly (no draft tokens) and its draft cache is no longer fed.

    Args:
        model: the draft causal LM (eval mode), sharing the target's tokenizer.
        num_slots, max_context: as the target's runner (the draft's own context caps max_context).
        vocab_size: the target's V; drafts never propose ids past it.
    """

    #: Rows lacking more tokens than this (a new prompt) are fed alone before the batched forward.
    SOLO_FEED = 8

    def __init__(self, model: torch.nn.Module, num_slots: int, max_context: int, vocab_size: int) -> None:
        self.runner = BatchRunner(model, num_slots, min(max_context, model_context(model)))
        self.cached: list[list[int]] = [[] for _ in range(num_slots)]
        self.vocab_size = vocab_size

    def join(self, slot: int) -> None:
        self.cached[slot] = []
        self.runner.cache.lengths[slot] = 0

    def move(self, src: int, dst: int) -> None:
        if src != dst:
            self.runner.cache.move(src, dst)
            self.cached[dst] = self.cached[src]
        self.cached[src] = []
        self.runner.cache.lengths[src] = 0

    def release(self) -> None:
        self.runner.cache.release()
        self.cached = [[] for _ in self.cached]

    @torch.inference_mode()
    def propose(self, rows: Sequence["_Row"], caps: Sequence[int]) -> list[Draft]:
        """Up to ``caps[i]`` draft tokens for row i: chains [1, k_i] int64 (+ [1, k_i, V] float32 q when sampling)."""
        b = len(rows)
        caps = [min(cap, draft_room(self.runner.max_context, row.ctx)) for row, cap in zip(rows, caps)]
        if max(caps, default=0) <= 0:
            return [Draft.empty() for _ in rows]
        logits = self._sync(rows)  # [b, V_draft] at each row's last committed token
        vocab = min(self.vocab_size, logits.shape[-1])
        tokens: list[list[int]] = [[] for _ in range(b)]
        probs: list[list[torch.Tensor]] = [[] for _ in range(b)]
        k_max = max(caps)
        for pos in range(k_max):
            feed = []
            for i, row in enumerate(rows):
                if pos >= caps[i]:
                    feed.append([])  # this row's draft is done: padding only
                    continue
                params = row.ctx.params
                if params.greedy:
                    tok = int(logits[i, :vocab].argmax())
                else:
                    q = logits_to_probs(logits[i, :vocab], params)
                    tok = int(sample(q, row.ctx.generator))
                    probs[i].append(q)
                tokens[i].append(tok)
                feed.append([tok] if pos + 1 < caps[i] else [])  # a row's last draft token is never fed
            if pos + 1 < k_max:
                logits = self._feed(feed)[:, -1]
        return [Draft.chain(torch.tensor([t], dtype=torch.int64).reshape(1, -1),
                            torch.stack(p).unsqueeze(0) if p else None) if t else Draft.empty()
                for t, p in zip(tokens, probs)]

    def _sync(self, rows: Sequence["_Row"]) -> torch.Tensor:
        """Cut each row's draft cache to its committed prefix (at least one token left to feed); feed the rest.

        A row past the draft's context is not fed (padding only; its logits are padding).
        """
        cache = self.runner.cache
        feeds = []
        for i, row in enumerate(rows):
            ids = row.ctx.token_ids
            if len(ids) > self.runner.max_context:
                feeds.append([])
                continue
            keep = min(_common_prefix(self.cached[i], ids), len(ids) - 1)
            del self.cached[i][keep:]
            cache.lengths[i] = keep
            lacking = ids[keep:]
            if len(lacking) > self.SOLO_FEED:  # a prompt: alone, so the batch is not padded to its length
                self.runner.forward(slice(i, i + 1), [lacking[:-1]], last_only=True)
                self.cached[i].extend(lacking[:-1])
                lacking = lacking[-1:]
            feeds.append(lacking)
        counts = [max(1, len(f)) for f in feeds]
        out = self._feed(feeds)  # [b, q, V]
        return out[torch.arange(len(rows)), torch.tensor(counts) - 1]

    def _feed(self, feeds: list[list[int]]) -> torch.Tensor:
        """One batched draft forward of each row's new tokens (an empty feed only pads); [b, q, V] logits."""
        out = self.runner.forward(slice(0, len(feeds)), feeds)
        for i, f in enumerate(feeds):
            self.cached[i].extend(f)
        return out


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    return next(i for i in range(n) if a[i] != b[i])


# --------------------------------------------------------------------------- requests and events


@dataclass
class RowEvent:
    """What one step did for one request (delivered on the engine thread).

    Attributes:
        token_ids: tokens committed this step (after max_tokens / EOS), possibly empty on error.
        logprobs: log p_target of each committed token (raw logits, temperature 1), when asked.
        top_logprobs: per committed token, the ``top_logprobs`` most likely (token id, logprob), when asked.
        num_drafted, num_accepted: draft tokens verified / kept this step (0 for the prefill).
        finished: last event of the request.
        finish_reason: "length", "stop" (EOS), "cancelled", "error" when finished.
        metrics: the request's RunMetrics (totals so far; final when finished).
        error: a message when the engine failed while running this request.
    """

    token_ids: list[int]
    num_drafted: int = 0
    num_accepted: int = 0
    finished: bool = False
    finish_reason: str | None = None
    metrics: RunMetrics | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    error: str | None = None


@dataclass
class BatchRequest:
    """A request for :meth:`BatchEngine.submit`.

    Attributes:
        prompt_ids: [L] token ids, L >= 1.
        params: SamplingParams (greedy when temperature is 0; seed seeds the row's own generator).
        on_event: called with each RowEvent, on the engine thread (keep it short: hand off to a queue).
        logprobs: None = no logprobs; n >= 0 = the chosen token's logprob plus the top n.
    """

    prompt_ids: list[int]
    params: SamplingParams
    on_event: Callable[[RowEvent], None]
    logprobs: int | None = None
    id: int = field(default_factory=itertools.count().__next__)
    cancelled: bool = False
    submitted_at: float = field(default_factory=time.perf_counter)


@dataclass
class _Row:
    """A request in the batch: its slot's context, generator, proposer and counters."""

    request: BatchRequest
    ctx: ProposeContext
    metrics: RunMetrics
    proposer: Proposer | None
    started_at: float
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def remaining(self) -> int:
        return self.ctx.params.max_new_tokens - len(self.generated)


@dataclass(frozen=True)
class BatchConfig:
    """Batch engine settings.

    Attributes:
        max_batch_size: rows decoded together (cache slots), >= 1.
        max_queue: requests waiting for a slot before :meth:`BatchEngine.submit` raises QueueFullError.
        num_speculative_tokens: gamma, the most draft tokens per row per step (1..64).
        adaptive: choose gamma per step with the cost model (False: always gamma).
        max_context: positions per row; None reads the target's config.
    """

    max_batch_size: int = 8
    max_queue: int = 64
    num_speculative_tokens: int = 5
    adaptive: bool = True
    max_context: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_batch_size, int) or not 1 <= self.max_batch_size <= 256:
            raise SpecDecodeError(f"max_batch_size must be an integer in [1, 256], got {self.max_batch_size!r}")
        if not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise SpecDecodeError(f"max_queue must be an integer >= 0, got {self.max_queue!r}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 64:
            raise SpecDecodeError(
                f"num_speculative_tokens must be an integer in [1, 64], got {self.num_speculative_tokens!r}")


@dataclass
class StepStats:
    """One engine iteration, for monitoring: rows decoded, gamma, seconds, tokens committed."""

    batch_size: int
    gamma: int
    seconds: float
    num_committed: int
    num_drafted: int
    num_accepted: int
    queue_length: int


# --------------------------------------------------------------------------- the engine


class BatchEngine:
    """Speculative decoding of many requests at once over one target (continuous batching).

    Requests join (prefill) and leave (finish, cancel) between steps. Thread model: ``submit`` and
    ``cancel`` may be called from any thread; ``step`` (or the thread started by ``start``) runs the
    model, one forward at a time.

    Args:
        target: Hugging Face causal LM (eval mode) whose distribution is preserved.
        proposer_factory: builds one proposer per request (its own state / cache), drafting row
            after row; None with no ``draft_model`` = plain decoding.
        config: BatchConfig.
        draft_model: a draft causal LM drafting for all rows in batched forwards
            (:class:`BatchDraftModel`); excludes ``proposer_factory``.
        forward_cost: calibration points ``[(tokens, seconds)]`` of the target for the cost-model
            policy (see :func:`calibrate_forward_cost`); None disables adaptation (fixed gamma).
        draft_forward_cost: the same for ``draft_model`` (rows = tokens of a one-position forward).
        draft_token_cost_s: seconds per drafted token per row of a per-row proposer (0 for n-gram).
        on_step: called with StepStats after each iteration (engine thread).

    Raises:
        SpecDecodeError: both ``proposer_factory`` and ``draft_model``; a proposer that drafts trees.
    """

    def __init__(
        self,
        target: torch.nn.Module,
        proposer_factory: Callable[[], Proposer] | None = None,
        config: BatchConfig | None = None,
        *,
        draft_model: torch.nn.Module | None = None,
        forward_cost: Sequence[tuple[int, float]] | None = None,
        draft_forward_cost: Sequence[tuple[int, float]] | None = None,
        draft_token_cost_s: float = 0.0,
        on_step: Callable[[StepStats], None] | None = None,
    ) -> None:
        self.config = config or BatchConfig()
        cfg = self.config
        if proposer_factory is not None and draft_model is not None:
            raise SpecDecodeError("give a proposer factory or a draft model, not both")
        if proposer_factory is not None and getattr(proposer_factory(), "produces_trees", False):
            raise SpecDecodeError("the batched engine verifies chain drafts; this proposer drafts token trees")
        self.max_context = cfg.max_context or model_context(target)
        self.runner = BatchRunner(target, cfg.max_batch_size, self.max_context)
        self.vocab_size = self.runner.vocab_size
        self.proposer_factory = proposer_factory
        self.draft_model = (BatchDraftModel(draft_model, cfg.max_batch_size, self.max_context, self.vocab_size)
                            if draft_model is not None else None)
        self.speculates = proposer_factory is not None or draft_model is not None
        self.policy = CostModelPolicy(
            BatchPolicyConfig(max_gamma=cfg.num_speculative_tokens, adaptive=cfg.adaptive and forward_cost is not None),
            forward_cost, draft_token_cost_s, draft_forward_cost)
        self.on_step = on_step
        self.rows: list[_Row] = []  # row i lives in cache slot i
        self._pending: deque[BatchRequest] = deque()
        self._lock = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    # Thread-safe API ---------------------------------------------------------------

    def submit(self, request: BatchRequest) -> BatchRequest:
        """Queue a request; it joins the batch at the next step with a free slot.

        Raises:
            EmptyPromptError, PromptTooLongError, SpecDecodeError (token ids out of range),
            QueueFullError (``max_queue`` requests already waiting), EngineStoppedError.
        """
        self.check_prompt(request.prompt_ids, request.params)
        with self._lock:
            if self._closed:
                raise EngineStoppedError("the engine is shutting down; no new requests are taken")
            free = self.config.max_batch_size - len(self.rows)
            if len(self._pending) >= self.config.max_queue + max(0, free):
                raise QueueFullError(
                    f"the server is busy: {len(self.rows)} requests running and {len(self._pending)} waiting "
                    f"(--max-queue {self.config.max_queue}); retry later")
            self._pending.append(request)
            self._lock.notify_all()
        return request

    def cancel(self, request: BatchRequest) -> None:
        """Stop a request at the next step boundary and free its slot (no further events after 'cancelled')."""
        with self._lock:
            request.cancelled = True
            self._lock.notify_all()

    def check_prompt(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise the error a request would get: empty prompt, ids out of range, prompt + max tokens too long."""
        if len(prompt_ids) == 0:
            raise EmptyPromptError("the prompt is empty: give at least one token")
        bad = [t for t in prompt_ids if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise SpecDecodeError(f"prompt token ids must be in [0, {self.vocab_size}); got {bad[:5]}")
        if len(prompt_ids) + params.max_new_tokens > self.max_context:
            raise PromptTooLongError(
                f"prompt of {len(prompt_ids)} tokens + max_tokens {params.max_new_tokens} exceeds the model's "
                f"context of {self.max_context} tokens: shorten the prompt or lower max_tokens to at most "
                f"{max(0, self.max_context - len(prompt_ids))}")

    @property
    def num_active(self) -> int:
        return len(self.rows)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def start(self) -> None:
        """Run the loop in a daemon thread until :meth:`close`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="specdecode-batch-engine", daemon=True)
            self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the loop; cancel what is running or waiting."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        for row in list(self.rows):
            row.request.cancelled = True
        self._drop_cancelled()
        while self._pending:
            self._emit_end(self._pending.popleft(), None, "cancelled")

    @property
    def alive(self) -> bool:
        """True while the background loop runs (or was never started: ``step`` is driven by hand)."""
        return self._thread is None or self._thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not self.rows and not self._pending:
                    self._lock.wait()
                if self._closed:
                    return
            try:
                self.step()
            except Exception:  # noqa: BLE001 - e.g. a failing on_step hook: log it, keep serving
                logger.exception("engine step failed")

    # The loop ----------------------------------------------------------------------

    def step(self) -> StepStats | None:
        """One iteration: drop cancelled rows, admit waiting requests (prefill), one batched step.

        Returns StepStats, or None when there was nothing to decode. An exception inside the model
        ends every running request with an error event; the engine keeps serving.
        """
        try:
            self._drop_cancelled()
            self._admit()
            if not self.rows:
                self._maybe_release()
                return None
            stats = self._decode_step()
        except Exception as exc:  # noqa: BLE001 - report to the requests, keep the loop alive
            self._fail_all(f"{type(exc).__name__}: {exc}")
            return None
        self._drop_finished()
        self._maybe_release()
        if self.on_step is not None:
            self.on_step(stats)
        return stats

    def _decode_step(self) -> StepStats:
        t0 = time.perf_counter()
        rows = self.rows
        gamma = self.policy.choose(len(rows)) if self.speculates else 0
        # Draft tokens each row may take; they fit its context (prompt + max_new_tokens <= max_context).
        capacity = [min(gamma, row.remaining - 1) for row in rows]
        if self.draft_model is not None:
            drafts = self.draft_model.propose(rows, capacity)
            capacity = [d.num_tokens for d in drafts]  # all it could draft (less past the draft's context)
        else:
            drafts = [self._propose(row, k) for row, k in zip(rows, capacity)]
        t1 = time.perf_counter()
        feeds = [[row.ctx.token_ids[-1], *draft.token_ids[0].tolist()] for row, draft in zip(rows, drafts)]
        logits = self.runner.forward(slice(0, len(rows)), feeds)  # [B, K+1, V]
        t2 = time.perf_counter()
        results = self._verify(rows, drafts, logits)
        committed_total = drafted = accepted = 0
        for i, (row, draft, (n_acc, new_ids)) in enumerate(zip(rows, drafts, results)):
            committed = self._commit(i, row, new_ids)
            k = draft.num_tokens
            row.metrics.record_step(k, n_acc, len(committed))
            row.metrics.draft_time_s += (t1 - t0) / len(rows)
            row.metrics.verify_time_s += (t2 - t1) / len(rows)
            if row.proposer is not None and k:
                row.proposer.observe(row.ctx, _row_result(n_acc, new_ids, k))
            lp, top = self._logprobs(row, logits[i], committed)
            self._emit(row, committed, k, n_acc, lp, top)
            committed_total += len(committed)
            drafted += k
            accepted += n_acc
        self.policy.update(capacity, [n for n, _ in results])
        return StepStats(len(rows), gamma, time.perf_counter() - t0, committed_total, drafted, accepted,
                         len(self._pending))

    def _propose(self, row: _Row, k: int) -> Draft:
        if row.proposer is None or k <= 0:
            return Draft.empty()
        return row.proposer.propose(row.ctx, k)

    def _verify(self, rows: list[_Row], drafts: list[Draft], logits: torch.Tensor) -> list[tuple[int, list[int]]]:
        """Per row (num_accepted, tokens to commit): greedy rows in one batched call, sampled rows one by one."""
        out: list[tuple[int, list[int]] | None] = [None] * len(rows)
        greedy = [i for i, r in enumerate(rows) if r.ctx.params.greedy]
        if greedy:
            k = max(drafts[i].num_tokens for i in greedy)
            ids = torch.full((len(greedy), k), PAD_TOKEN_ID, dtype=torch.int64)  # -1 never equals an argmax
            for j, i in enumerate(greedy):
                ids[j, : drafts[i].num_tokens] = drafts[i].token_ids[0]
            res = verify_greedy(ids, logits[greedy, : k + 1])
            n_acc = res.num_accepted.tolist()  # the step's host synchronisation for greedy rows
            new = res.new_token_ids.tolist()
            for j, i in enumerate(greedy):
                out[i] = (n_acc[j], new[j][: n_acc[j] + 1])
        for i, row in enumerate(rows):
            if out[i] is not None:
                continue
            draft = drafts[i]
            k = draft.num_tokens
            params = row.ctx.params
            target_probs = logits_to_probs(logits[i, : k + 1], params).unsqueeze(0)  # [1, k+1, V]
            q = draft.draft_probs
            if q is not None and q.shape[-1] != target_probs.shape[-1]:
                q = torch.nn.functional.pad(q, (0, target_probs.shape[-1] - q.shape[-1]))
            res = verify_sampling(draft.token_ids, q, target_probs, [row.ctx.generator])
            n = int(res.num_accepted[0])
            out[i] = (n, res.new_token_ids[0, : n + 1].tolist())
        return out  # type: ignore[return-value]

    def _commit(self, slot: int, row: _Row, tokens: list[int]) -> list[int]:
        """Append ``tokens`` after max_tokens / EOS; set the slot's cache length to the committed tokens but the last."""
        tokens, reason = apply_stopping_rules(tokens, row.ctx.params, len(row.generated))
        row.finish_reason = row.finish_reason or reason
        row.generated.extend(tokens)
        row.ctx.token_ids.extend(tokens)
        self.runner.cache.lengths[slot] = len(row.ctx.token_ids) - 1  # rollback: a length, nothing copied
        row.metrics.num_generated_tokens = len(row.generated)
        row.metrics.wall_time_s = time.perf_counter() - row.started_at
        return tokens

    def _admit(self) -> None:
        """Prefill waiting requests into free slots, one forward each."""
        while len(self.rows) < self.config.max_batch_size:
            with self._lock:
                if not self._pending:
                    return
                request = self._pending.popleft()
            if request.cancelled:
                self._emit_end(request, None, "cancelled")
                continue
            slot = len(self.rows)
            try:
                self._prefill(request)
            except Exception as exc:  # noqa: BLE001 - this request fails alone; the batch goes on
                if len(self.rows) > slot:
                    self.rows.pop()
                self.runner.cache.lengths[slot] = 0
                self._emit_end(request, None, "error", f"{type(exc).__name__}: {exc}")

    def _prefill(self, request: BatchRequest) -> None:
        params = request.params
        seed = params.seed if params.seed is not None else random.randrange(2**63)
        prompt = [int(t) for t in request.prompt_ids]
        ctx = ProposeContext(prompt, len(prompt), params, torch.Generator().manual_seed(seed), self.vocab_size)
        t0 = time.perf_counter()
        row = _Row(request, ctx, RunMetrics(num_prompt_tokens=len(prompt)),
                   self.proposer_factory() if self.proposer_factory is not None else None, t0)
        slot = len(self.rows)
        self.runner.cache.lengths[slot] = 0
        if self.draft_model is not None:
            self.draft_model.join(slot)
        self.rows.append(row)
        logits = self.runner.forward(slice(slot, slot + 1), [prompt], last_only=True)[0]  # [1, V]
        first = int(next_token(logits[-1], params, ctx.generator))
        m = row.metrics
        m.num_target_forwards += 1
        m.prefill_time_s = m.time_to_first_token_s = time.perf_counter() - t0
        committed = self._commit(slot, row, [first])
        if row.proposer is not None:
            row.proposer.start(ctx)
        lp, top = self._logprobs(row, logits, committed)
        self._emit(row, committed, 0, 0, lp, top)

    def _logprobs(self, row: _Row, logits: torch.Tensor, committed: list[int]):
        """log_softmax of the target's raw logits at the committed tokens (and the top-n), when asked."""
        n_top = row.request.logprobs
        if n_top is None or not committed:
            return None, None
        lsm = torch.log_softmax(logits[: len(committed)].float(), dim=-1)  # [n, V]
        chosen = lsm.gather(1, torch.tensor(committed).unsqueeze(1)).squeeze(1).tolist()
        if n_top <= 0:
            return chosen, [[] for _ in committed]
        vals, idx = lsm.topk(n_top, dim=-1)
        top = [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
        return chosen, top

    # Events and removal ------------------------------------------------------------

    def _emit(self, row: _Row, tokens: list[int], drafted: int, accepted: int, lp, top) -> None:
        finished = row.finish_reason is not None
        event = RowEvent(tokens, drafted, accepted, finished, row.finish_reason, row.metrics, lp, top)
        try:
            row.request.on_event(event)
        except Exception:  # noqa: BLE001 - a broken listener cancels its own request, not the engine
            row.request.cancelled = True

    def _emit_end(self, request: BatchRequest, row: _Row | None, reason: str, error: str | None = None) -> None:
        metrics = row.metrics if row is not None else RunMetrics(num_prompt_tokens=len(request.prompt_ids))
        try:
            request.on_event(RowEvent([], finished=True, finish_reason=reason, metrics=metrics, error=error))
        except Exception:  # noqa: BLE001 - a broken listener must not stop the engine
            pass

    def _remove(self, index: int) -> None:
        """Free row ``index``'s slot: the last row moves into it, so rows stay in slots 0..B-1."""
        last = len(self.rows) - 1
        if index != last:
            self.runner.cache.move(last, index)
            self.rows[index] = self.rows[last]
        else:
            self.runner.cache.lengths[last] = 0
        if self.draft_model is not None:
            self.draft_model.move(last, index)
        self.rows.pop()

    def _drop_cancelled(self) -> None:
        for i in range(len(self.rows) - 1, -1, -1):
            row = self.rows[i]
            if row.request.cancelled:
                self._remove(i)
                self._emit_end(row.request, row, "cancelled")

    def _drop_finished(self) -> None:
        for i in range(len(self.rows) - 1, -1, -1):
            if self.rows[i].finish_reason is not None:
                self._remove(i)

    def _maybe_release(self) -> None:
        if not self.rows and self.runner.cache.capacity:
            self.runner.cache.release()
            if self.draft_model is not None:
                self.draft_model.release()
            _trim_heap()

    def _fail_all(self, message: str) -> None:
        rows, self.rows = self.rows, []
        self.runner.cache.release()
        if self.draft_model is not None:
            self.draft_model.release()
        for row in rows:
            if row.finish_reason is None:
                self._emit_end(row.request, row, "error", message)

    # Introspection -----------------------------------------------------------------

    def stats(self) -> dict:
        """Rows running, requests waiting, bytes held by the KV cache, last gamma, acceptance estimate."""
        return {
            "active": len(self.rows),
            "pending": len(self._pending),
            "kv_cache_bytes": self.runner.cache.nbytes + (self.draft_model.runner.cache.nbytes
                                                          if self.draft_model is not None else 0),
            "gamma": self.policy.last_gamma,
            "acceptance_estimate": self.policy.acceptance,
        }


def _trim_heap() -> None:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim``), so an idle server's resident memory
    drops back after a burst; the cache buffers are a few MB each, under malloc's mmap threshold."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _row_result(num_accepted: int, new_ids: list[int], k: int) -> VerifyResult:
    """A batch-size-1 VerifyResult for a proposer's ``observe``."""
    ids = torch.full((1, k + 1), PAD_TOKEN_ID, dtype=torch.int64)
    ids[0, : len(new_ids)] = torch.tensor(new_ids, dtype=torch.int64)
    kept = torch.full((1, k + 1), -1, dtype=torch.int64)
    kept[0, :num_accepted] = torch.arange(num_accepted)
    return VerifyResult(num_accepted=torch.tensor([num_accepted]), new_token_ids=ids, kept_nodes=kept)
