"""Suffix decoding (Oliaro et al. 2024, SuffixDecoding): model-free token trees from suffix tries.

Two depth-limited suffix tries (every substring of at most ``max_depth`` tokens,
with how often it occurs):

- a **per-request** trie over the prompt and the output so far, extended by one
  token per committed token;
- a **global** trie over the outputs of earlier requests, shared across requests
  (:class:`GlobalSuffixTree`), bounded to ``max_nodes`` nodes by evicting the
  oldest outputs first.

Each step matches the longest recent suffix of the context (at most ``max_match``
tokens) that occurred before with a continuation, in each trie, and grows a
candidate tree below the matched node best-first by the empirical continuation
probability (child count / sum of sibling counts, multiplied along the path),
dropping nodes whose path probability is below ``min_token_prob``. The node
budget adapts to the match: ``ceil(spec_factor * match length)`` nodes, at most
``max_spec_nodes`` (a long match predicts long continuations, a short one is
noise). The tree with the higher score (sum of its path probabilities, the
expected number of accepted tokens if the target followed the counts) is
proposed. With a ``fallback`` proposer (a draft model or n-gram: the hybrid
mode), the fallback drafts instead whenever that score is below ``min_score``.

Suffix drafts are deterministic (q one-hot), verified with the without-replacement
multi-candidate rule, so sampling stays lossless (``specdecode.tree``).

Cost: pure Python; per committed token O(max_depth) dictionary operations, per
step O(budget log budget); ``SuffixProposer.stats`` keeps the measured time.
"""

from __future__ import annotations

import collections
import heapq
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdecode.proposers.base import ProposeContext, Proposer, register, still_indexed
from specdecode.types import Draft, SpecDecodeError, VerifyResult


class SuffixTrie:
    """Depth-limited suffix trie with occurrence counts (pure Python, compact lists).

    Node 0 is the root. The node of a string s (1 <= |s| <= ``max_depth``) has
    ``counts[node]`` = number of start positions i, over the inserted documents,
    with ``doc[i : i + |s|] == s``; so a child never counts more than its parent.

    Args:
        max_depth: longest indexed substring, >= 1.
    """

    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise SpecDecodeError(f"suffix trie depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.children: list[dict[int, int] | None] = [None]  # node -> {token: child}
        self.counts: list[int] = [0]
        self._free: list[int] = []

    @property
    def num_nodes(self) -> int:
        """Live nodes, the root included (the memory bound counts these)."""
        return len(self.counts) - len(self._free)

    def _new_node(self) -> int:
        if self._free:
            return self._free.pop()
        self.children.append(None)
        self.counts.append(0)
        return len(self.counts) - 1

    def append(self, active: list[int], token: int) -> list[int]:
        """Extend a document by one token.

        Args:
            active: the nodes of the document's current suffixes by length, ``active[j]``
                = suffix of length j (``[0]`` for an empty document).
            token: the appended token id.

        Returns:
            The new active list (lengths 0 .. min(max_depth, document length)).
        """
        children, counts = self.children, self.counts
        new = [0]
        for node in active[: self.max_depth]:
            kids = children[node]
            if kids is None:
                kids = children[node] = {}
            child = kids.get(token)
            if child is None:
                child = kids[token] = self._new_node()
            counts[child] += 1
            new.append(child)
        return new

    def insert(self, tokens: Sequence[int]) -> None:
        """Index every substring (of at most ``max_depth`` tokens) of one document."""
        active = [0]
        for tok in tokens:
            active = self.append(active, int(tok))

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo :meth:`insert` of the same document; nodes whose count reaches 0 are freed.

        Raises:
            KeyError: the document was not inserted (the trie is then inconsistent).
        """
        children, counts = self.children, self.counts
        tokens = [int(t) for t in tokens]
        freed = []
        for i in range(len(tokens)):
            parent = 0
            for tok in tokens[i : i + self.max_depth]:
                node = children[parent][tok]
                counts[node] -= 1
                if counts[node] == 0:
                    del children[parent][tok]
                    freed.append(node)
                parent = node
        for node in freed:
            children[node] = None
            self._free.append(node)

    def walk(self, tokens: Sequence[int]) -> int:
        """The node of ``tokens`` (the root for none), or -1 if that string never occurred."""
        node = 0
        for tok in tokens:
            kids = self.children[node]
            node = kids.get(tok, -1) if kids else -1
            if node < 0:
                return -1
        return node


@dataclass
class CandidateTree:
    """A candidate draft tree grown below one matched trie node.

    Attributes:
        tokens, parents: breadth-first node tokens and parents (-1 = root child).
        probs: path probability of each node under the trie's counts.
        match_length: tokens of context matched.
        source: "request" or "global".
    """

    tokens: list[int]
    parents: list[int]
    probs: list[float]
    match_length: int
    source: str

    @property
    def score(self) -> float:
        """Expected accepted tokens if the target followed the counts (sum of path probabilities)."""
        return sum(self.probs)


def grow_tree(trie: SuffixTrie, node: int, budget: int, max_depth: int, min_prob: float) -> tuple[list, list, list]:
    """Best-first candidate tree below ``node``: the ``budget`` most probable continuations.

    A child's path probability is its parent's times count(child) / sum of its siblings'
    counts; nodes under ``min_prob`` are never added. Shallower nodes win ties, and a node
    never outscores its parent, so the result is a tree.

    Returns:
        (tokens, parents, probs), breadth-first, at most ``budget`` nodes of depth <= ``max_depth``.
    """
    children, counts = trie.children, trie.counts
    heap: list = []
    order = 0

    def push(trie_node: int, parent: int, prob: float, depth: int) -> None:
        nonlocal order
        kids = children[trie_node]
        if not kids or depth > max_depth:
            return
        total = sum(counts[c] for c in kids.values())
        best = heapq.nlargest(budget, kids.items(), key=lambda kv: counts[kv[1]]) if len(kids) > budget else kids.items()
        for tok, child in best:
            p = prob * counts[child] / total
            if p >= min_prob:
                heapq.heappush(heap, (-p, depth, order, tok, child, parent))
                order += 1

    tokens, parents, probs, depths = [], [], [], []
    push(node, -1, 1.0, 1)
    while heap and len(tokens) < budget:
        neg_p, depth, _, tok, child, parent = heapq.heappop(heap)
        idx = len(tokens)
        tokens.append(tok)
        parents.append(parent)
        probs.append(-neg_p)
        depths.append(depth)
        push(child, idx, -neg_p, depth + 1)
    bfs = sorted(range(len(tokens)), key=lambda i: (depths[i], i))
    where = {old: new for new, old in enumerate(bfs)}
    return ([tokens[i] for i in bfs], [where[parents[i]] if parents[i] >= 0 else -1 for i in bfs],
            [probs[i] for i in bfs])


class GlobalSuffixTree:
    """A suffix trie over earlier requests' outputs, shared by proposers (thread-safe).

    Memory is bounded: at most ``max_nodes`` live trie nodes. Adding an output that
    would exceed it evicts the oldest outputs first (their substrings are un-counted,
    nodes at count 0 freed); an output too long to fit alone keeps its last tokens.

    Args:
        max_depth: longest indexed substring (proposers sharing it use this depth).
        max_nodes: the node bound, >= max_depth + 1.
    """

    def __init__(self, max_depth: int = 32, max_nodes: int = 200_000) -> None:
        if max_nodes < max_depth + 1:
            raise SpecDecodeError(f"global suffix tree needs max_nodes >= max_depth + 1, got {max_nodes}")
        self.trie = SuffixTrie(max_depth)
        self.max_nodes = max_nodes
        self.lock = threading.Lock()
        self.version = 0  # bumped on every change (proposers then re-match from scratch)
        self._docs: collections.deque[list[int]] = collections.deque()

    @property
    def num_documents(self) -> int:
        return len(self._docs)

    def add(self, tokens: Sequence[int]) -> None:
        """Index one finished output (empty outputs are ignored)."""
        doc = [int(t) for t in tokens][-((self.max_nodes - 1) // self.trie.max_depth) :]
        if not doc:
            return
        with self.lock:
            self.trie.insert(doc)
            self._docs.append(doc)
            while self.trie.num_nodes > self.max_nodes and len(self._docs) > 1:
                self.trie.remove(self._docs.popleft())
            self.version += 1


@dataclass(frozen=True)
class SuffixConfig:
    """Suffix decoding settings (token counts unless named otherwise).

    Attributes:
        max_depth: trie depth (match + continuation), >= 2.
        max_match: longest context suffix matched, 1 <= max_match < max_depth.
        max_spec_nodes: node budget per step.
        spec_factor: alpha; the budget is ceil(alpha * match length), capped at max_spec_nodes.
        min_token_prob: nodes with a lower path probability are not proposed.
        min_score: with a fallback, draft with the fallback when the best tree scores lower.
        max_request_tokens: the per-request trie indexes at most the last this many prompt tokens.
        use_global: match the global trie of earlier outputs too.
        global_max_nodes: node bound of the proposer's own global trie.

    Raises:
        SpecDecodeError: a value out of range.
    """

    max_depth: int = 32
    max_match: int = 16
    max_spec_nodes: int = 16
    spec_factor: float = 2.0
    min_token_prob: float = 0.1
    min_score: float = 1.0
    max_request_tokens: int = 8192
    use_global: bool = True
    global_max_nodes: int = 200_000

    def __post_init__(self) -> None:
        if self.max_depth < 2 or not 1 <= self.max_match < self.max_depth:
            raise SpecDecodeError(
                f"suffix decoding needs max_depth >= 2 and 1 <= max_match < max_depth, got {self.max_depth}, "
                f"{self.max_match}"
            )
        if not 1 <= self.max_spec_nodes <= 64 or self.spec_factor <= 0:
            raise SpecDecodeError(
                f"max_spec_nodes must be in [1, 64] and spec_factor > 0, got {self.max_spec_nodes}, {self.spec_factor}"
            )
        if not 0.0 <= self.min_token_prob <= 1.0 or self.min_score < 0 or self.max_request_tokens < 1:
            raise SpecDecodeError("min_token_prob must be in [0, 1], min_score >= 0, max_request_tokens >= 1")


@dataclass
class SuffixStats:
    """What the suffix proposer did: steps by source, and its own time (seconds)."""

    steps: int = 0
    suffix_steps: int = 0
    fallback_steps: int = 0
    empty_steps: int = 0
    propose_time_s: float = 0.0
    index_time_s: float = 0.0

    @property
    def mean_propose_ms(self) -> float:
        return 1e3 * self.propose_time_s / self.steps if self.steps else 0.0


@dataclass
class _SuffixRow:
    """One request's suffix-decoding state: its own trie and the matched suffixes."""

    seen: list[int]  # a copy of the context's tokens this state indexed (a changed context is re-indexed)
    trie: SuffixTrie
    active: list[int]
    indexed: int
    global_active: list[int]
    reads_global: bool = True  # False for a seeded standard-mode request (``_reads_global``)
    global_version: int = -1
    last_fallback: bool = False


@register("suffix")
class SuffixProposer(Proposer):
    """Suffix decoding over every row, optionally hybrid with a fallback drafter.

    Args:
        config: SuffixConfig.
        global_tree: a :class:`GlobalSuffixTree` shared with other proposers; by default
            the proposer makes its own, shared by every request it serves.
        fallback: a proposer used for the rows whose suffix tree scores below ``min_score``
            (hybrid mode), called once per step for all of them; None = propose nothing then.

    The global tree learns a request's output when it leaves the batch (:meth:`finish`). A seeded sampled
    request in the standard mode does not draft from it (``_reads_global``): its text then repeats for its
    seed whatever was served before it.
    """

    produces_trees = True

    def __init__(self, config: SuffixConfig | None = None, global_tree: GlobalSuffixTree | None = None,
                 fallback: Proposer | None = None) -> None:
        self.config = config or SuffixConfig()
        depth = self.config.max_depth
        if global_tree is None and self.config.use_global:
            global_tree = GlobalSuffixTree(depth, self.config.global_max_nodes)
        if global_tree is not None and global_tree.trie.max_depth != depth:
            raise SpecDecodeError(f"global suffix tree depth {global_tree.trie.max_depth} != max_depth {depth}")
        self.global_tree = global_tree if self.config.use_global else None
        self.fallback = fallback
        self.stats = SuffixStats()
        self.remembers_requests = self.global_tree is not None or (fallback is not None and fallback.remembers_requests)

    # Request lifecycle -------------------------------------------------------------

    def bind(self, target, num_slots: int) -> None:
        if self.fallback is not None:
            self.fallback.bind(target, num_slots)

    def start(self, ctx: ProposeContext) -> None:
        """Index the prompt (and first token) of a new request."""
        self._index(ctx)
        if self.fallback is not None:
            self.fallback.start(ctx)

    def finish(self, ctx: ProposeContext) -> None:
        """Add the request's output to the global tree (once)."""
        row = ctx.state.pop("suffix", None)
        if row is not None and self.global_tree is not None:
            self.global_tree.add(ctx.token_ids[ctx.num_prompt_tokens :])
        if self.fallback is not None:
            self.fallback.finish(ctx)

    def move(self, src: int, dst: int) -> None:
        if self.fallback is not None:
            self.fallback.move(src, dst)

    def release(self) -> None:
        if self.fallback is not None:
            self.fallback.release()

    @property
    def nbytes(self) -> int:
        return 0 if self.fallback is None else self.fallback.nbytes

    # Proposing -------------------------------------------------------------------

    def propose(self, batch: Sequence[ProposeContext], max_tokens: Sequence[int]) -> list[Draft]:
        """Per row a suffix-tree draft of depth <= ``max_tokens[i]`` (or the fallback's draft, or empty).

        Returns:
            per row Draft [1, N] token_ids / parents, draft_probs None (deterministic candidates).
        """
        drafts: list[Draft] = [Draft.empty() for _ in batch]
        need: list[int] = []
        for i, (ctx, k) in enumerate(zip(batch, max_tokens)):
            if k <= 0:
                continue
            t0 = time.perf_counter()
            row = self._sync(ctx)
            best = self._best_tree(row, k)
            self.stats.steps += 1
            self.stats.propose_time_s += time.perf_counter() - t0
            row.last_fallback = False
            if best is None or (self.fallback is not None and best.score < self.config.min_score):
                if self.fallback is not None:
                    self.stats.fallback_steps += 1
                    row.last_fallback = True
                    need.append(i)
                else:
                    self.stats.empty_steps += 1
                continue
            self.stats.suffix_steps += 1
            drafts[i] = Draft(token_ids=torch.tensor([best.tokens], dtype=torch.int64),
                              parents=torch.tensor([best.parents], dtype=torch.int64),
                              match_length=best.match_length)
        if need:
            # the fallback sees every row (batched drafters keep slot order), asked for tokens only where needed
            wanted = set(need)
            out = self.fallback.propose(batch, [k if i in wanted else 0 for i, k in enumerate(max_tokens)])
            for i in need:
                drafts[i] = out[i]
        return drafts

    def observe(self, batch: Sequence[ProposeContext], results: Sequence[VerifyResult]) -> None:
        if self.fallback is not None:
            self.fallback.observe(batch, results)

    # Parts -----------------------------------------------------------------------

    def _index(self, ctx: ProposeContext) -> _SuffixRow:
        t0 = time.perf_counter()
        skip = max(0, len(ctx.token_ids) - self.config.max_request_tokens)
        row = _SuffixRow(list(ctx.token_ids[:skip]), SuffixTrie(self.config.max_depth), [0], skip, [0],
                         reads_global=_reads_global(ctx))
        ctx.state["suffix"] = row
        self._sync(ctx)
        self.stats.index_time_s += time.perf_counter() - t0
        return row

    def _sync(self, ctx: ProposeContext) -> _SuffixRow:
        """Index committed tokens not yet in the row's trie; advance the global match. A context that
        changed (replaced, cut, or rewritten in place: ``base.still_indexed``) is indexed afresh, never
        appended to."""
        row = ctx.state.get("suffix")
        tokens = ctx.token_ids
        if row is None or not still_indexed(row.seen, tokens):
            return self._index(ctx)
        new = tokens[row.indexed :]
        for tok in new:
            row.active = row.trie.append(row.active, tok)
        row.seen.extend(new)
        row.indexed = len(tokens)
        g = self.global_tree if row.reads_global else None
        if g is None:
            return row
        with g.lock:
            if g.version != row.global_version:  # the global trie changed: re-match from scratch
                row.global_version = g.version
                row.global_active = _suffix_nodes(g.trie, tokens, self.config.max_match)
            else:
                for tok in new:
                    row.global_active = _advance(g.trie, row.global_active, tok, self.config.max_match)
        return row

    def _best_tree(self, row: _SuffixRow, max_tokens: int) -> CandidateTree | None:
        found = [self._grow(row.trie, row.active, max_tokens, "request")]
        if self.global_tree is not None and row.reads_global:
            with self.global_tree.lock:
                found.append(self._grow(self.global_tree.trie, row.global_active, max_tokens, "global"))
        found = [t for t in found if t is not None and t.tokens]
        return max(found, key=lambda t: t.score, default=None) if found else None

    def _grow(self, trie: SuffixTrie, active: list[int], max_tokens: int, source: str) -> CandidateTree | None:
        """Tree below the longest matched suffix (length >= 1) that has a continuation."""
        cfg = self.config
        for length in range(min(cfg.max_match, len(active) - 1), 0, -1):
            node = active[length]
            if trie.children[node]:
                budget = min(cfg.max_spec_nodes, max(1, math.ceil(cfg.spec_factor * length)))
                depth = min(max_tokens, trie.max_depth - length)
                tokens, parents, probs = grow_tree(trie, node, budget, depth, cfg.min_token_prob)
                return CandidateTree(tokens, parents, probs, length, source)
        return None


def _reads_global(ctx: ProposeContext) -> bool:
    """Whether a row drafts from the global tree: every row but a seeded sampled request in the standard mode.

    Such a request's draft decides how many of its generator's random numbers it draws and where, so its text
    repeats for its seed only if its drafts depend on nothing but its own context (with the fixed policy); the
    global tree holds what the requests served before it generated. Coupled rows (their text is plain
    decoding's whatever the draft), greedy rows and unseeded ones read it.
    """
    params = ctx.params
    return params.greedy or params.seed is None or params.uses_coupled


def _advance(trie: SuffixTrie, active: list[int], token: int, max_match: int) -> list[int]:
    """Matched suffix nodes after appending ``token`` (only strings the trie holds; lengths 0..max_match)."""
    new = [0]
    for node in active[:max_match]:
        kids = trie.children[node]
        child = kids.get(token) if kids else None
        if child is None:
            break  # a longer suffix cannot occur if this one does not
        new.append(child)
    return new


def _suffix_nodes(trie: SuffixTrie, tokens: Sequence[int], max_match: int) -> list[int]:
    """Matched suffix nodes of ``tokens`` from scratch: [root, node of last 1 token, last 2, ...]."""
    nodes = [0]
    for length in range(1, min(max_match, len(tokens)) + 1):
        node = trie.walk(tokens[len(tokens) - length :])
        if node < 0:
            break
        nodes.append(node)
    return nodes


__all__ = ["CandidateTree", "GlobalSuffixTree", "SuffixConfig", "SuffixProposer", "SuffixTrie", "grow_tree"]
