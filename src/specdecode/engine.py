"""The one engine: batched speculative decoding, propose -> verify in one target pass -> commit -> adapt.

Token ids in, token ids out; the engine never sees text. Requests join (:meth:`SpeculativeEngine.add`,
which prefills them) and leave (finish, :meth:`SpeculativeEngine.abort`) between steps: continuous
batching, with batch size 1 as a case, not a second path. Row i of the batch lives in slot i of the
target's KV cache (``kv.SlotRunner``); a leaving row's slot is filled by the last row, so the active
rows' cache is always a view. With no proposer, or a draft length of 0, a step is one plain decoding
step through the same model, cache and sampling code, so the baseline compares like with like.

A request's output does not depend on the rest of the batch: its tokens, positions, mask row, draft
and random draws are its own (a row consumes k + 1 uniforms of its own generator per step whatever
the batch is); only floating-point summation order can differ between batch shapes (exact with
int8 weights and float64 models; a float32 greedy near-tie can flip). One caveat for *seeded
sampling*: an adaptive draft-length policy chooses gamma from the whole batch, and gamma decides how
many random numbers a row draws, so a seeded sampled request reproduces its exact text only with the
fixed policy (``auto``, the default, is the adaptive ``cost-model`` for n-gram drafts); its output
*distribution* is the target's under every policy. The same holds for drafts
that learn across requests: suffix decoding's global tree is therefore not read for a seeded request in
the standard sampling mode, and a layer-skip drafter drafts the same only with the same skip set (pin it
with ``skip_layers``: a search on a first prompt changes it once). The coupled mode, the default for
seeded requests, reproduces seeded plain decoding under any policy and drafter.

Scheduling (queue, admission, the server's thread, cancellation) lives in ``scheduler.py``.
"""

from __future__ import annotations

import inspect
import secrets
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager

import numpy as np
import torch

from specdecode.config import EngineConfig, RequestSpeculation
from specdecode.coupled import CoupledNoise
from specdecode.drafts import cut_draft, draft_problem, follows_policy, row_gamma
from specdecode.kv import SlotRunner, make_runner
from specdecode.metrics import RunMetrics, StepRecord
from specdecode.policy import DraftLengthPolicy, FixedPolicy, drafts_by_lookup
from specdecode.proposers.base import ProposeContext, Proposer
from specdecode.request import Request, apply_stopping_rules, check_prompt
from specdecode.sampling import RequestSampler, chain_paths, tree_paths
from specdecode.tree import tree_depth, verify_tree_greedy, verify_tree_sampling
from specdecode.types import (
    PAD_TOKEN_ID,
    Draft,
    EngineFullError,
    GenerationOutput,
    ProposerContractError,
    SamplingParams,
    SpecDecodeError,
    StepOutput,
    VerifyResult,
)
from specdecode.verify import greedy_chain_results, split_rows, verify_block, verify_chains


def _takes_keyword(fn, name: str) -> bool:
    """Whether ``fn`` accepts the keyword ``name`` (or any keyword): policies written before it existed do not."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


class SpeculativeEngine:
    """Lossless speculative decoding of a batch of requests with one target and one proposer.

    Args:
        target: a causal LM (eval mode) whose distribution is preserved, or a ``kv.SlotRunner``.
        proposer: a :class:`~specdecode.proposers.base.Proposer`, or None for plain decoding.
        config: EngineConfig.
        policy: draft-length policy (``specdecode.policy``); default fixed gamma.

    Raises:
        SpecDecodeError: a bad config; UnsupportedCacheError / TreeAttentionUnsupported for a
            model whose cache cannot roll back or cannot take the masks (before any generation).
    """

    def __init__(self, target, proposer: Proposer | None = None, config: EngineConfig | None = None,
                 policy=None) -> None:
        self.config = cfg = config or EngineConfig()
        self.runner: SlotRunner = target if isinstance(target, SlotRunner) else make_runner(
            target, cfg.forward, cfg.max_batch_size, cfg.max_context)
        self.max_context = self.runner.max_context
        self.vocab_size = self.runner.vocab_size
        self.proposer = proposer
        self.trees = bool(proposer is not None and proposer.produces_trees)
        if self.trees:
            self.runner.check_tree_support()
        if proposer is not None:
            proposer.bind(self.runner, self.runner.num_slots)
        self.policy = policy or FixedPolicy(cfg.num_speculative_tokens)
        # policies that override DraftLengthPolicy.trim cut lookup drafts (any other object, e.g. a duck-typed policy
        # of next_length / update, keeps them whole); those whose update takes match_lengths= learn from them
        self._policy_trims = getattr(type(self.policy), "trim", DraftLengthPolicy.trim) is not DraftLengthPolicy.trim
        self._policy_learns_matches = self._policy_trims and _takes_keyword(self.policy.update, "match_lengths")
        self._policy_trims_padded = self._policy_trims and _takes_keyword(self.policy.trim, "padded")
        self.rows: list[Request] = []  # row i lives in cache slot i
        self.last_gamma = 0  # the draft length the policy chose for the last step (before any per-row trim)
        self.last_output: GenerationOutput | None = None

    @property
    def target(self) -> SlotRunner:
        return self.runner

    @property
    def max_batch_size(self) -> int:
        return self.runner.num_slots

    # Requests ----------------------------------------------------------------------

    def check_prompt(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt as ints, checked: non-empty, ids in [0, V), prompt + max_new_tokens within the context.

        Raises:
            EmptyPromptError, SpecDecodeError (ids out of range), PromptTooLongError.
        """
        return check_prompt(prompt_ids, params, self.vocab_size, self.max_context)

    def add(self, prompt_ids: Sequence[int], params: SamplingParams, logprobs: int | None = None,
            tag: object = None, constraint=None, speculation: RequestSpeculation | None = None,
            prompt_logprobs: int | None = None) -> tuple[Request, StepOutput]:
        """Admit a request: validate, prefill the target in a free slot, sample the first token, start
        the proposer. A request that finishes at once (EOS, max_new_tokens = 1) leaves at once.

        Args:
            prompt_ids: [L] int token ids. params: SamplingParams. logprobs: None or the top-n count.
            tag: anything the caller attaches. constraint: a structured-output constraint
                (``specdecode.grammar``) applied to the target and the drafts. speculation: this
                request's own RequestSpeculation (None: the engine's settings). prompt_logprobs: None, or
                n >= 0: score every prompt token (``Request.prompt_logprobs``, also on the first StepOutput)
                with the top n alternatives, in a forward of its own before the prefill.

        Returns:
            (the Request, the StepOutput of its first token).

        Raises:
            EmptyPromptError, PromptTooLongError, SpecDecodeError (also: token ids of the sampling
            parameters outside the vocabulary), EngineFullError (no free slot).
        """
        prompt = self.check_prompt(prompt_ids, params)
        if len(self.rows) >= self.runner.num_slots:
            raise EngineFullError(f"all {self.runner.num_slots} slots are taken; wait for a request to finish")
        sampler = RequestSampler(params, prompt, self.vocab_size, constraint)
        slot = len(self.rows)
        seed = params.seed if params.seed is not None else secrets.randbits(63)  # unseeded: a fresh seed, kept
        noise = CoupledNoise(seed, self.vocab_size) if params.uses_coupled else None
        ctx = ProposeContext(prompt, len(prompt), params, torch.Generator().manual_seed(seed), self.vocab_size,
                             should_continue=getattr(self.policy, "should_continue", None), slot=slot,
                             sampler=sampler, noise=noise)
        req = Request(ctx, RunMetrics(num_prompt_tokens=len(prompt)), time.perf_counter(), logprobs, tag=tag, seed=seed,
                      speculation=speculation or RequestSpeculation())
        if prompt_logprobs is not None:
            req.prompt_logprobs = self._score_prompt(slot, prompt, prompt_logprobs)
        self.runner.clear(slot)
        self.rows.append(req)  # the one place a row is taken: whatever fails from here frees it
        started = False
        try:
            logits = self.runner.forward(slice(slot, slot + 1), [prompt], last_only=True)[:, -1:]  # [1, 1, V]
            first = self._verify_chains([req], [Draft.empty()], logits)[0]
            m = req.metrics
            m.num_target_forwards += 1
            m.prefill_time_s = m.time_to_first_token_s = time.perf_counter() - req.started_at
            out = self._commit(req, Draft.empty(), first, logits[0], prefill=True)
            out.prompt_logprobs = req.prompt_logprobs
            if req.finish_reason is None and self.proposer is not None:
                started = True  # a proposer interrupted inside start() cleans up in finish()
                self.proposer.start(ctx)
        except BaseException as exc:
            self._fail([req], exc, started=started)
            raise
        if req.finish_reason is not None:
            self._remove(slot, started=False)
        return req, out

    @contextmanager
    def running(self, prompt_ids: Sequence[int], params: SamplingParams, **add_kwargs
                ) -> Iterator[tuple[Request, StepOutput]]:
        """:meth:`add` as a context: ``with engine.running(ids, params) as (request, first): ...``. However the
        block is left, the request's row is free afterwards: at the block's end (or a generator closed early,
        GeneratorExit) a request still running is aborted with finish reason "stop"; on any other exception
        (one raised by a callback, KeyboardInterrupt) with "cancelled", and the exception goes on. Every
        in-process front end (``generate``, ``stream``, ``generate_batch``, ``SpecDecoder.generate``) runs its
        requests through it.

        Args:
            prompt_ids, params, add_kwargs: as :meth:`add`.

        Raises:
            as :meth:`add`.
        """
        req, first = self.add(prompt_ids, params, **add_kwargs)
        reason = "cancelled"
        try:
            yield req, first
            reason = "stop"
        except GeneratorExit:
            reason = "stop"
            raise
        finally:
            if req.finish_reason is None:
                self.abort(req, reason)

    def abort(self, request: Request, reason: str = "cancelled", keep: int | None = None) -> None:
        """Remove a running request at a step boundary (its slot is freed now).

        Args:
            request: a Request of this engine, running or finished (then only ``keep`` applies).
            reason: its finish reason, when it had none.
            keep: None, or the number of generated tokens the caller delivers (a front end found a stop string
                there): the request's tokens after them are dropped and every counter of its RunMetrics stops
                there (``RunMetrics.cut``), so every front end reports what was delivered.

        Raises:
            SpecDecodeError: ``keep`` < 0.
        """
        if keep is not None and keep < 0:
            raise SpecDecodeError(f"keep must be >= 0, got {keep}")
        if request.finish_reason is None:
            request.finish_reason = reason
        for i, row in enumerate(self.rows):
            if row is request:
                self._remove(i)
                break
        if keep is not None and keep < len(request.generated):
            del request.generated[keep:]
            del request.ctx.token_ids[request.ctx.num_prompt_tokens + keep :]
            request.metrics.cut(keep)

    def release(self) -> None:
        """Free the KV cache buffers (no rows): memory goes back to the allocator."""
        if not self.rows:
            self.runner.release()
            if self.proposer is not None:
                self.proposer.release()

    # The loop ------------------------------------------------------------------------

    def step(self) -> list[tuple[Request, StepOutput]]:
        """One iteration over every row: propose, verify in one target pass, commit, adapt.

        Returns:
            per row (Request, StepOutput) in batch order; finished rows have left the batch.

        Raises:
            whatever cut the step short (a model or proposer error, KeyboardInterrupt), after every row of
            the batch left it: finish reason "error" ("cancelled" for an interrupt that is not an
            Exception), ``Request.error`` naming the exception.
        """
        rows = list(self.rows)
        if not rows:
            return []
        try:
            t0 = time.perf_counter()
            drafts = self._propose(rows)  # 1. propose: every row drafts at once
            t1 = time.perf_counter()
            results, logits = self._verify(rows, drafts)  # 2. verify: one target forward over every row
            t2 = time.perf_counter()
            outputs = [self._commit(r, d, v, logits[i])  # 3. commit: kept tokens, caches cut back to them
                       for i, (r, d, v) in enumerate(zip(rows, drafts, results))]
            self._adapt(rows, drafts, results, outputs, t1 - t0, t2 - t1)  # 4. adapt: proposer and policy learn
        except BaseException as exc:  # a step cut short leaves its rows' caches unknown: every row leaves
            self._fail(rows, exc)
            raise
        for i in range(len(rows) - 1, -1, -1):  # 5. finished rows leave the batch
            if rows[i].finish_reason is not None:
                self._remove(i)
        return list(zip(rows, outputs))

    def _propose(self, rows: list[Request]) -> list[Draft]:
        gamma = self.policy.next_length(len(rows)) if self.proposer is not None else 0
        self.last_gamma = gamma
        caps = [max(0, min(row_gamma(row, gamma), row.remaining - 1)) for row in rows]
        if max(caps, default=0) <= 0:
            return [Draft.empty() for _ in rows]
        drafts = self.proposer.propose([row.ctx for row in rows], caps)
        drafts = self._check_drafts(rows, drafts, caps)
        drafts = [cut_draft(row, d) for row, d in zip(rows, drafts)]
        return self._trim(rows, drafts)

    def _trim(self, rows: list[Request], drafts: list[Draft]) -> list[Draft]:
        """The policy's cut of lookup drafts (a proposer that ``drafts_by_lookup``: chains with a ``match_length``,
        of rows that follow the policy): a prefix of a deterministic chain is verified exactly as the chain would be
        up to there."""
        if not self._policy_trims or not drafts_by_lookup(self.proposer):
            return drafts
        own = [i for i, (r, d) in enumerate(zip(rows, drafts))
               if d.num_tokens and d.match_length is not None and d.draft_probs is None and follows_policy(r)
               and d.is_chain()]
        if not own:
            return drafts
        lengths, matches = [drafts[i].num_tokens for i in own], [int(drafts[i].match_length) for i in own]
        if self._policy_trims_padded:  # the other rows' drafts pad the step to their longest anyway
            mine = set(own)
            padded = max((d.num_tokens for i, d in enumerate(drafts) if i not in mine), default=0)
            keep = self.policy.trim(lengths, matches, len(rows), padded=padded)
        else:
            keep = self.policy.trim(lengths, matches, len(rows))
        for i, n in zip(own, keep):
            drafts[i] = drafts[i].prefix(max(0, min(int(n), drafts[i].num_tokens)))
        return drafts

    def _verify(self, rows: list[Request], drafts: list[Draft]) -> tuple[list[VerifyResult], torch.Tensor]:
        """Score ``[last committed token, draft...]`` of every row in ONE target forward; verify."""
        feeds = [[row.ctx.token_ids[-1], *d.token_ids[0].tolist()] for row, d in zip(rows, drafts)]
        every = slice(0, len(rows))
        if self.trees:
            parents = [[-1, *(d.parents[0] + 1).tolist()] for d in drafts]
            logits = self.runner.forward_tree(every, feeds, parents)  # [B, N+1, V]
        else:
            logits = self.runner.forward(every, feeds)  # [B, K+1, V]
        results: list[VerifyResult | None] = [None] * len(rows)
        tree_rows = [i for i, d in enumerate(drafts) if self.trees and d.num_tokens]
        for i in tree_rows:
            results[i] = self._verify_tree(rows[i], drafts[i], logits[i : i + 1, : drafts[i].num_tokens + 1])
        chain_rows = [i for i in range(len(rows)) if results[i] is None]
        if chain_rows:
            every_row = len(chain_rows) == len(rows)  # (the usual case: a view, not a copy of [B, K+1, V])
            chained = self._verify_chains([rows[i] for i in chain_rows], [drafts[i] for i in chain_rows],
                                          logits if every_row else logits[chain_rows])
            for i, res in zip(chain_rows, chained):
                results[i] = res
        return results, logits  # type: ignore[return-value]

    def _verify_chains(self, rows: list[Request], drafts: list[Draft], logits: torch.Tensor) -> list[VerifyResult]:
        """Greedy and sampled chain rows together (``verify.verify_chains``); per-row results [1, ...].

        Every row's target distribution at verified position j is processed with the context that
        position has (``RequestSampler``: committed tokens + draft tokens before j). A coupled row is
        verified as a greedy row on the one-hot of the target's Gumbel-max choices; a row with
        block verification goes through ``verify.verify_block``."""
        b = len(rows)
        k = max(d.num_tokens for d in drafts)
        if all(r.params.greedy and not r.sampler.active for r in rows):  # plain greedy rows: raw logits, no draws
            return self._verify_greedy_chains(drafts, logits, k)
        v = logits.shape[-1]
        ids = torch.full((b, k), PAD_TOKEN_ID, dtype=torch.int64)
        counts = torch.tensor([d.num_tokens for d in drafts], dtype=torch.int64)
        exact_match = torch.tensor([r.params.greedy or r.ctx.noise is not None for r in rows])
        target = logits[:, : k + 1]  # [b, k+1, V]; plain greedy rows verify on raw logits
        q = None
        uniforms = torch.zeros(b, k + 1, dtype=torch.float64)
        if any(not r.params.greedy or r.sampler.active for r in rows):  # probabilities written in: float32 at least
            target = target.clone() if target.dtype in (torch.float32, torch.float64) else target.float()
        block = torch.zeros(b, dtype=torch.bool)
        for i, (row, d) in enumerate(zip(rows, drafts)):
            n = d.num_tokens
            ids[i, :n] = d.token_ids[0]
            paths = chain_paths(d.token_ids[0].tolist())
            if row.params.greedy:
                if row.sampler.active:
                    target[i, : n + 1] = row.sampler.process(logits[i, : n + 1], paths)
                continue
            probs = row.sampler.probs(logits[i, : n + 1], paths)
            if row.ctx.noise is not None:  # coupled: the target's own choice at each position, one-hot
                start = len(row.generated)
                choice = row.ctx.noise.choose(probs, [start + j for j in range(n + 1)])
                target[i, : n + 1] = torch.nn.functional.one_hot(choice, v).float()
                continue
            target[i, : n + 1] = probs
            uniforms[i, : n + 1] = torch.rand(n + 1, generator=row.ctx.generator, dtype=torch.float64)
            block[i] = n > 0 and self._verification(row, d) == "block"
            if d.draft_probs is not None and n:
                if q is None:
                    q = torch.zeros(b, k, v)
                q[i, :n, : d.draft_probs.shape[-1]] = d.draft_probs[0]
        if bool(block.any()):  # block rows and the others, each verified once
            res = VerifyResult(torch.zeros(b, dtype=torch.int64), torch.full((b, k + 1), PAD_TOKEN_ID),
                               torch.full((b, k + 1), -1))
            for sel, fn in ((block.nonzero().squeeze(1), "block"), ((~block).nonzero().squeeze(1), "token")):
                if not sel.numel():
                    continue
                qs = None if q is None else q[sel]
                part = (verify_block(ids[sel], counts[sel], qs, target[sel], uniforms[sel]) if fn == "block" else
                        verify_chains(ids[sel], counts[sel], qs, target[sel], exact_match[sel], uniforms[sel]))
                res.num_accepted[sel] = part.num_accepted
                res.new_token_ids[sel] = part.new_token_ids
                res.kept_nodes[sel] = part.kept_nodes
        else:
            res = verify_chains(ids, counts, q, target, exact_match, uniforms)
        return split_rows(res, [d.num_tokens for d in drafts])

    @staticmethod
    def _verify_greedy_chains(drafts: list[Draft], logits: torch.Tensor, k: int) -> list[VerifyResult]:
        """Rows that are all plain greedy (``params.greedy`` and not ``sampler.active``: no logit processing, which
        ``RequestSampler.active`` must keep saying for anything that changes a greedy row's argmax; no random draw):
        ``verify_chains``' greedy rule (``verify.greedy_chain_results``) on the raw logits [B, >= k+1, V], without the
        sampled rows' tensors (0.19 -> 0.16 ms of a 2 ms SmolLM2 step). Returns one VerifyResult [1, k_i + 1] a row."""
        ids = np.full((len(drafts), k), PAD_TOKEN_ID, dtype=np.int64)
        for i, d in enumerate(drafts):
            if d.num_tokens:
                ids[i, : d.num_tokens] = d.token_ids[0].cpu().numpy()
        counts = np.array([d.num_tokens for d in drafts], dtype=np.int64)
        return greedy_chain_results(ids, counts, logits[:, : k + 1])

    def _verification(self, row: Request, draft: Draft) -> str:
        """The verification method of a sampled chain row: the request's, else the engine's. "auto" is
        block verification for a sampling drafter (its expected accepted length is never below
        token-level verification's) and token-level for a deterministic one (one-hot q: block
        verification keeps exactly as much, at a higher cost)."""
        method = row.speculation.verification or self.config.verification
        if method == "auto":
            return "block" if draft.draft_probs is not None else "token"
        return method

    def _verify_tree(self, row: Request, draft: Draft, logits: torch.Tensor) -> VerifyResult:
        """Multi-candidate verification of one row's token tree (``specdecode.tree``), each node's
        target distribution processed with its own path's context."""
        paths = tree_paths(draft.token_ids[0].tolist(), draft.parents[0].tolist())
        if row.params.greedy:
            return verify_tree_greedy(draft.token_ids, draft.parents,
                                      row.sampler.greedy_logits(logits[0], paths).unsqueeze(0))
        target_probs = row.sampler.probs(logits[0], paths).unsqueeze(0)  # [1, N+1, V]
        if row.ctx.noise is not None:  # coupled: walk the tree along the target's own choices
            depths = [len(p) for p in paths]
            start = len(row.generated)
            choice = row.ctx.noise.choose(target_probs[0], [start + dep for dep in depths])
            one_hot = torch.nn.functional.one_hot(choice, target_probs.shape[-1]).float().unsqueeze(0)
            return verify_tree_greedy(draft.token_ids, draft.parents, one_hot)
        q = draft.draft_probs
        if q is not None and q.shape[-1] != target_probs.shape[-1]:
            q = torch.nn.functional.pad(q, (0, target_probs.shape[-1] - q.shape[-1]))
        return verify_tree_sampling(draft.token_ids, draft.parents, q, target_probs, [row.ctx.generator])

    def _commit(self, row: Request, draft: Draft, result: VerifyResult, logits: torch.Tensor,
                prefill: bool = False) -> StepOutput:
        """Append the kept tokens after the stopping rules; cut the row's cache back to them.

        The target cache holds every committed token but the last (the next step feeds it); a tree
        keeps only the accepted path. The step is recorded as verified (``RunMetrics.record_step``); its
        counters count only draft tokens that could be committed (``StepRecord.counted``).
        """
        slot = row.ctx.slot
        if row.finish_reason is not None:  # failed before verification (a broken draft): commit nothing
            if self.runner.has_pending_tree(slot):
                self.runner.keep_tree_path(slot, [])
            self.runner.rollback(slot, min(len(self.runner.ids[slot]), len(row.ctx.token_ids) - 1))
            row.metrics.wall_time_s = time.perf_counter() - row.started_at
            return StepOutput([], 0, 0, True, row.finish_reason, error=row.error)
        n_acc = int(result.num_accepted[0])
        proposed = result.new_token_ids[0, : n_acc + 1].tolist()
        kept = result.kept_nodes[0, :n_acc].tolist()
        tokens, reason = apply_stopping_rules(proposed, row.params, len(row.generated))
        row.finish_reason = row.finish_reason or reason
        row.generated.extend(tokens)
        row.ctx.token_ids.extend(tokens)
        row.sampler.commit(tokens)
        if row.ctx.noise is not None:
            row.ctx.noise.forget_before(len(row.generated))
        if self.runner.has_pending_tree(slot):
            self.runner.keep_tree_path(slot, [0, *(i + 1 for i in kept)])
        self.runner.rollback(slot, min(len(self.runner.ids[slot]), len(row.ctx.token_ids) - 1))
        depth = tree_depth(draft.parents[0]) if self.trees and draft.num_tokens else None
        start = len(row.generated) - len(tokens)
        if not prefill:
            row.metrics.record_step(draft.num_tokens, n_acc, len(tokens), depth=depth, start=start)
        # what the step counts (an EOS or the token cap inside the accepted block: no draft after it)
        counted = StepRecord(start, draft.num_tokens, n_acc, len(tokens), depth).counted(len(row.generated)) \
            or StepRecord(start, 0, 0, 0)
        drafted = counted.nodes if counted.depth is None else counted.depth
        row.metrics.num_generated_tokens = len(row.generated)
        row.metrics.wall_time_s = time.perf_counter() - row.started_at
        lp, top = self._logprobs(row, logits, tokens, kept)
        return StepOutput(tokens, drafted, counted.accepted, row.finish_reason is not None, row.finish_reason, lp, top)

    def _adapt(self, rows, drafts, results, outputs, draft_s: float, verify_s: float) -> None:
        """The proposer observes; the policy learns from what was verified (the draft depth and the
        tokens verification kept, before stopping rules cut them: a stop is not a rejection) and from
        the step's times without one-off catch-up (a joining row's prompt fed to a draft model)."""
        b = len(rows)
        catch_up = sum(d.catch_up_s for d in drafts)
        shared = max(0.0, draft_s - catch_up) / b
        for row, d in zip(rows, drafts):
            row.metrics.draft_time_s += shared + d.catch_up_s
            row.metrics.verify_time_s += verify_s / b
        if self.proposer is not None and (any(d.num_tokens for d in drafts)
                                          or getattr(self.proposer, "observes_every_step", False)):
            self.proposer.observe([r.ctx for r in rows], results)
        # The policy learns only from rows that followed it (not those with their own gamma or speculation off).
        own = [i for i, r in enumerate(rows) if follows_policy(r)]
        if not own:
            return
        depths = [(tree_depth(drafts[i].parents[0]) if self.trees else drafts[i].num_tokens)
                  if drafts[i].num_tokens else 0 for i in own]
        whole = len(own) == len(rows)  # the step's times belong to the whole batch: learn them only from one
        times = dict(draft_time_s=max(0.0, draft_s - catch_up) if whole else None,
                     verify_time_s=verify_s if whole else None)
        if self._policy_learns_matches:  # (a policy that rates lookup drafts by their match also learns from it)
            times["match_lengths"] = [drafts[i].match_length if drafts[i].num_tokens else None for i in own]
        self.policy.update(depths, [int(results[i].num_accepted[0]) for i in own], **times)

    def _logprobs(self, row: Request, logits: torch.Tensor, tokens: list[int], kept: list[int]):
        """log_softmax of the target's raw logits at the committed tokens (and the top n), when asked."""
        n_top = row.logprobs
        if n_top is None or not tokens:
            return None, None
        at = [0, *(i + 1 for i in kept)][: len(tokens)] if self.trees else list(range(len(tokens)))
        lsm = torch.log_softmax(logits[at].float(), dim=-1)  # [n, V]
        chosen = lsm.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1).tolist()
        if n_top <= 0:
            return chosen, [[] for _ in tokens]
        vals, idx = lsm.topk(n_top, dim=-1)
        return chosen, [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]

    def _score_prompt(self, slot: int, prompt: list[int], n_top: int):
        """log_softmax of the target's raw logits at every prompt token given the tokens before it: (logprob,
        rank, top ``n_top``) per token, (None, None, []) for the first. The prompt is fed in chunks of
        PROMPT_SCORE_CHUNK positions (a [chunk, V] logits block at a time) with every position's logits, then
        the slot is cleared: the request's own prefill (last position only) runs as for any request, so its
        cache and first token do not depend on whether prompt logprobs were asked."""
        if not 0 <= n_top <= self.vocab_size:
            raise SpecDecodeError(f"prompt_logprobs must be in [0, {self.vocab_size}], got {n_top}")
        out: list[tuple[float | None, int | None, list[tuple[int, float]]]] = [(None, None, [])]
        self.runner.clear(slot)
        feed = prompt[:-1]  # position i scores token i + 1
        for start in range(0, len(feed), PROMPT_SCORE_CHUNK):
            chunk = feed[start : start + PROMPT_SCORE_CHUNK]
            lsm = torch.log_softmax(self.runner.forward(slice(slot, slot + 1), [chunk])[0].float(), dim=-1)  # [c, V]
            nxt = torch.tensor(prompt[start + 1 : start + 1 + len(chunk)]).unsqueeze(1)
            chosen = lsm.gather(1, nxt)  # [c, 1]
            ranks = ((lsm > chosen).sum(-1) + 1).tolist()
            if n_top > 0:
                vals, idx = lsm.topk(n_top, dim=-1)
                tops = [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
            else:
                tops = [[] for _ in chunk]
            out.extend(zip(chosen.squeeze(1).tolist(), ranks, tops))
        return out

    def _check_drafts(self, rows: list[Request], drafts: list[Draft], caps: list[int]) -> list[Draft]:
        """The proposer contract, at the engine's door: one draft per row, [1, N] int64 ids in [0, V),
        parents of a tree (or a chain when the proposer makes no trees), depth within the cap, and
        draft_probs (when given) a law per node: finite, >= 0, summing to 1, each drafted token possible
        (``_draft_probs_problem``). A row whose draft breaks it fails alone with a message naming the proposer; the others go on."""
        name = getattr(self.proposer, "name", type(self.proposer).__name__)
        if not isinstance(drafts, (list, tuple)) or len(drafts) != len(rows):
            raise ProposerContractError(f"proposer {name!r} returned {type(drafts).__name__} of "
                                        f"{len(drafts) if hasattr(drafts, '__len__') else '?'} drafts for {len(rows)} rows")
        out = []
        for row, d, cap in zip(rows, drafts, caps):
            problem = draft_problem(d, cap, self.vocab_size, self.trees)
            if problem is not None:
                row.finish_reason, row.error = "error", f"proposer {name!r} broke its contract: {problem}"
                d = Draft.empty()
            out.append(d)
        return out

    def _fail(self, rows: list[Request], exc: BaseException, started: bool = True) -> None:
        """``rows`` leave the batch because ``exc`` cut their admission or step short: finish reason "error"
        (or "cancelled" for an interrupt that is not an Exception) unless they had one, the error named.
        Removed from the last slot down, so no cache is moved."""
        reason = "error" if isinstance(exc, Exception) else "cancelled"
        for i in range(len(self.rows) - 1, -1, -1):
            row = self.rows[i]
            if not any(row is r for r in rows):
                continue
            if row.finish_reason is None:
                row.finish_reason, row.error = reason, f"{type(exc).__name__}: {exc}".rstrip(": ")
            try:
                self._remove(i, started=started)
            except Exception:  # noqa: BLE001 - the row has left (``_remove`` frees it first); ``exc`` is raised
                pass

    def _remove(self, index: int, started: bool = True) -> None:
        """Free row ``index``'s slot; the last row moves into it, so rows stay in slots 0..B-1. The row leaves
        even if the proposer's ``finish`` raises; that error is raised afterwards."""
        row = self.rows[index]
        cleanup_error = None
        if started and self.proposer is not None:
            try:
                self.proposer.finish(row.ctx)
            except Exception as exc:  # noqa: BLE001 - raised below, once the slot is free
                cleanup_error = exc
        last = len(self.rows) - 1
        if index != last:
            self.runner.move(last, index)
            if self.proposer is not None:
                self.proposer.move(last, index)
            self.rows[index] = self.rows[last]
            self.rows[index].ctx.slot = index
        else:
            self.runner.clear(last)
        self.rows.pop()
        if cleanup_error is not None:
            raise cleanup_error

    # Convenience: one request at a time ----------------------------------------------------

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> GenerationOutput:
        """Generate for one prompt (other rows in the batch, if any, step along).

        Args:
            prompt_ids: [L] int64 token ids, L >= 1. params: SamplingParams.

        Returns:
            GenerationOutput with the generated ids, finish reason and RunMetrics.

        Raises:
            EmptyPromptError, PromptTooLongError, SpecDecodeError, EngineFullError.
        """
        with self.running(prompt_ids, params) as (req, _):
            while req.finish_reason is None:
                self.step()
        return self.output(req)

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[StepOutput]:
        """Like :meth:`generate`, yielding each step's committed tokens. The final GenerationOutput is
        ``engine.last_output`` afterwards, also when the caller stops early (``close()``: finish reason
        "stop"). However the stream ends, its row is freed (:meth:`running`); a stream the caller leaves
        unclosed is closed when it is garbage-collected (``contextlib.closing`` closes it at once)."""
        req = None
        try:
            with self.running(prompt_ids, params) as (req, first):
                yield first
                while req.finish_reason is None:
                    for r, out in self.step():
                        if r is req:
                            yield out
        finally:
            if req is not None:
                self.last_output = self.output(req)

    def generate_batch(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
                       ) -> list[GenerationOutput]:
        """Generate for many prompts, up to ``max_batch_size`` at once (continuous batching).

        Raises:
            as :meth:`add`, before anything runs (every prompt is checked first).
        """
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        for p, sp in zip(prompts, params_list):
            self.check_prompt(p, sp)
        waiting = list(range(len(prompts)))
        requests: dict[int, Request] = {}
        with ExitStack() as running:  # however this ends, no request of it keeps a row
            while waiting or any(r.finish_reason is None for r in requests.values()):
                while waiting and len(self.rows) < self.runner.num_slots:
                    i = waiting.pop(0)
                    requests[i], _ = running.enter_context(self.running(prompts[i], params_list[i]))
                self.step()
        return [self.output(requests[i]) for i in range(len(prompts))]

    def output(self, req: Request) -> GenerationOutput:
        """The GenerationOutput of a request (so far: a running request's output grows)."""
        return GenerationOutput(token_ids=list(req.generated), finish_reason=req.finish_reason or "length",
                                metrics=req.metrics, prompt_token_ids=req.ctx.token_ids[: req.ctx.num_prompt_tokens])


#: Prompt positions scored per forward for prompt logprobs (bounds the [positions, V] logits held at once).
PROMPT_SCORE_CHUNK = 128
