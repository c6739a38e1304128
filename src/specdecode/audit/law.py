"""The target's exact law over its first n generated tokens, with the request's whole processing.

The law of n tokens is the product of the processed next-token distributions along each prefix (plain
decoding's chain rule), and each of those is what :class:`specdecode.sampling.RequestSampler` gives at that
prefix: logit_bias and banned / allowed ids, min_tokens, the penalties (which see the prefix), then
temperature, min_p, top-k and top-p. Only the support that carries mass is enumerated: a prefix's token whose
probability (prefix and token together) is at least ``min_cell_mass`` is its own outcome (or, before the n-th
token, a prefix expanded in turn); the remaining mass of each prefix is one "other" outcome. The partition is
exact (the probabilities sum to 1); it is only coarser where the mass is too small for N samples to see.

Stop tokens (EOS unless ``ignore_eos``, ``stop_token_ids``) end a completion early: all stop tokens after a
prefix are one outcome, "stopped here" (a server may or may not put EOS into its returned ids and text).

Every scored prefix keeps the support of its processed distribution (probability > 0), and the support of a
*relaxed* processing (top-p + 1e-4, min-p x (1 - 1e-4)): a sampled token outside the first is impossible
under the requested processing; outside both, it is an *impossible output* (an immediate fail), inside
the relaxed one only, a *boundary* token (a filter's cut-off rounded another way), reported but not failed.

The logits come from the decoding forward (``kv.make_runner``: what the engine runs, which matters for
int8 / bf16 weights): the prompt is prefilled once, and the prefixes of a level are scored as token trees
(ancestor masks, one forward per up to 192 nodes), or one by one where the model takes no tree mask.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from specdecode.kv import TreeAttentionUnsupported, make_runner
from specdecode.sampling import RequestSampler, logits_to_probs
from specdecode.types import SamplingParams

#: Outcome markers at the end of a cell's key: a stop token ended the completion here / the rest of a prefix.
STOP, OTHER = -1, -2
#: What :meth:`ExactLaw.classify` returns for a sample that is in no cell.
IMPOSSIBLE, BOUNDARY, UNMAPPED = -1, -2, -3
#: Slack of the relaxed processing that tells a boundary token from an impossible one.
BOUNDARY_SLACK = 1e-4
#: Tree nodes scored per forward (the slot cache keeps 257 scratch columns past the context).
TREE_CHUNK = 192


@dataclass
class Node:
    """One scored prefix.

    Attributes:
        prefix: the generated tokens before it (() is the prompt's end).
        mass: P(prefix) under the law, float64.
        kept: token -> conditional probability, for the tokens that are their own cell or an expanded prefix.
        leaf_cells: token -> cell index, for kept tokens that complete n tokens.
        stop_cell / other_cell: cell indices (None when that outcome has no mass or is merged into "other").
        support, relaxed: [ceil(V / 8)] uint8 packed bits: tokens of probability > 0 under the processing,
            and under the relaxed processing.
    """

    prefix: tuple[int, ...]
    mass: float
    kept: dict[int, float] = field(default_factory=dict)
    leaf_cells: dict[int, int] = field(default_factory=dict)
    stop_cell: int | None = None
    other_cell: int | None = None
    support: np.ndarray | None = None
    relaxed: np.ndarray | None = None

    def allows(self, token: int, relaxed: bool = False) -> bool:
        bits = self.relaxed if relaxed else self.support
        return bool(bits[token >> 3] & (0x80 >> (token & 7)))


@dataclass
class ExactLaw:
    """The partition of the first-n-token outcomes and its exact probabilities.

    Attributes:
        cells: [C] outcome keys: n tokens; or a prefix then STOP (a stop token came next) or OTHER (any
            token of that prefix's unenumerated rest, and whatever followed it).
        probs: [C] float64, summing to 1.
        nodes: prefix -> Node, every scored prefix.
        num_tokens: n. vocab_size: V. stop_ids: the tokens that end a completion.
    """

    cells: list[tuple[int, ...]]
    probs: np.ndarray
    nodes: dict[tuple[int, ...], Node]
    num_tokens: int
    vocab_size: int
    stop_ids: frozenset[int]

    def classify(self, tokens: Sequence[int], stopped: bool = False) -> int:
        """The cell of one sampled completion, or IMPOSSIBLE / BOUNDARY / UNMAPPED.

        Args:
            tokens: the completion's first tokens (ids), a stop token included or not.
            stopped: the source said a stop token ended it (``finish_reason == "stop"``): a completion of
                fewer than n tokens without a stop token among them then stopped right after them.

        Returns:
            a cell index >= 0; IMPOSSIBLE (-1): a token of probability 0 under the processing after its
            prefix; BOUNDARY (-2): such a token that the relaxed processing allows; UNMAPPED (-3): an id
            outside the vocabulary, or fewer than n tokens with no stop.
        """
        node = self.nodes[()]
        toks = [int(t) for t in tokens[: self.num_tokens]]
        for i, tok in enumerate(toks):
            if not 0 <= tok < self.vocab_size:
                return UNMAPPED
            if tok in self.stop_ids:
                return self._rest(node, tok, stop=True)
            if tok in node.kept:
                if i + 1 == self.num_tokens:
                    return node.leaf_cells[tok]
                node = self.nodes[node.prefix + (tok,)]
                continue
            return self._rest(node, tok)
        if stopped:  # the stop token itself was left out of the ids (a server that drops EOS)
            return node.stop_cell if node.stop_cell is not None else (
                node.other_cell if node.other_cell is not None else IMPOSSIBLE)
        return UNMAPPED

    def _rest(self, node: Node, tok: int, stop: bool = False) -> int:
        if stop and node.stop_cell is not None:
            return node.stop_cell
        if node.allows(tok):
            return node.other_cell if node.other_cell is not None else IMPOSSIBLE
        return BOUNDARY if node.allows(tok, relaxed=True) else IMPOSSIBLE

    def cell_tokens(self, cell: int) -> tuple[tuple[int, ...], bool]:
        """(the real tokens of a leaf or stop cell, whether it ended with a stop token); an "other" cell's
        prefix, False."""
        key = self.cells[cell]
        if key and key[-1] in (STOP, OTHER):
            return key[:-1], key[-1] == STOP
        return key, False

    def is_other(self, cell: int) -> bool:
        key = self.cells[cell]
        return bool(key) and key[-1] == OTHER


# --------------------------------------------------------------------------- scoring prefixes


class PrefixScorer:
    """Raw next-token logits after ``prompt + prefix`` for many prefixes, through the decoding forward.

    Args:
        model: the target ``nn.Module`` (in the precision it decodes in).
        prompt_ids: [L] int token ids.
        forward: ``kv.make_runner`` backend ("auto", "owned", "hf").

    Raises:
        PromptTooLongError: the prompt does not fit the model's context.
    """

    def __init__(self, model: torch.nn.Module, prompt_ids: Sequence[int], forward: str = "auto") -> None:
        self.runner = make_runner(model, forward, num_slots=1)
        self.prompt = [int(t) for t in prompt_ids]
        self.root = self.runner.forward(slice(0, 1), [self.prompt], last_only=True)[0, -1].float()  # [V]
        self.trees = True

    def score(self, paths: Sequence[tuple[int, ...]]) -> Iterator[tuple[list[int], torch.Tensor]]:
        """Yield (indices into ``paths``, [len(indices), V] float32 raw logits after each), chunk by chunk.

        Paths are scored as token trees (one forward per chunk of up to TREE_CHUNK nodes), or one by one
        where the forward takes no tree mask; the prompt's cache is kept between chunks.
        """
        if not paths:
            return
        if self.trees:
            try:
                yield from self._score_trees(paths)
                return
            except TreeAttentionUnsupported:
                self.trees = False
                self.runner.rollback(0, len(self.prompt))
        for i, path in enumerate(paths):
            logits = self.runner.forward(slice(0, 1), [list(path)])[0, -1:].float()
            self.runner.rollback(0, len(self.prompt))
            yield [i], logits

    def _score_trees(self, paths: Sequence[tuple[int, ...]]) -> Iterator[tuple[list[int], torch.Tensor]]:
        order = sorted(range(len(paths)), key=lambda i: paths[i])  # siblings together: their ancestors are shared
        nodes: dict[tuple[int, ...], int] = {}
        pending: list[tuple[int, int]] = []

        def flush():
            keys = sorted(nodes, key=nodes.get)
            tokens = [k[-1] for k in keys]
            parents = [nodes[k[:-1]] if len(k) > 1 else -1 for k in keys]
            logits = self.runner.forward_tree(slice(0, 1), [tokens], [parents])[0].float()  # [q, V]
            self.runner.rollback(0, len(self.prompt))
            return [i for i, _ in pending], logits[[j for _, j in pending]]

        for i in order:
            path = tuple(paths[i])
            new = [path[:d] for d in range(1, len(path) + 1) if path[:d] not in nodes]
            if pending and len(nodes) + len(new) > TREE_CHUNK:
                yield flush()
                nodes, pending = {}, []
                new = [path[:d] for d in range(1, len(path) + 1)]
            for key in new:
                nodes[key] = len(nodes)
            pending.append((i, nodes[path]))
        if pending:
            yield flush()


# --------------------------------------------------------------------------- the law


def relaxed_params(params: SamplingParams) -> SamplingParams:
    """The processing with its cut-offs loosened by BOUNDARY_SLACK (top-p up, min-p down): what tells a
    boundary token (a cut-off rounded the other way) from an impossible one."""
    return dataclasses.replace(params, top_p=min(1.0, params.top_p + BOUNDARY_SLACK) if params.top_p < 1.0 else 1.0,
                               min_p=params.min_p * (1.0 - BOUNDARY_SLACK))


@torch.inference_mode()
def exact_law(model: torch.nn.Module, prompt_ids: Sequence[int], params: SamplingParams, num_tokens: int,
              min_cell_mass: float, forward: str = "auto") -> ExactLaw:
    """Enumerate the exact law of the first ``num_tokens`` tokens of plain decoding of ``prompt_ids``.

    Args:
        model: the target (its weights in the precision the audited source decodes in).
        prompt_ids: [L] int token ids.
        params: a sampled request (temperature > 0): its processing is the law's.
        num_tokens: n, 1..3.
        min_cell_mass: an outcome (prefix + token) of at least this probability is its own cell; the rest
            of each prefix is one "other" cell.
        forward: the runner backend (``kv.make_runner``).

    Returns:
        ExactLaw with probabilities summing to 1 (float64).

    Raises:
        ValueError: a greedy ``params`` (greedy mode compares tokens, it has no law to enumerate).
        PromptTooLongError: the prompt does not fit the context.
    """
    if params.greedy:
        raise ValueError("exact_law: a greedy request has no distribution to enumerate (use greedy mode)")
    scorer = PrefixScorer(model, prompt_ids, forward)
    vocab = int(scorer.root.shape[-1])
    sampler = RequestSampler(params, scorer.prompt, vocab)
    loose = relaxed_params(params)
    stops = frozenset(int(t) for t in params.stop_ids if 0 <= t < vocab)
    stop_index = torch.tensor(sorted(stops), dtype=torch.int64)
    law = ExactLaw(cells=[], probs=np.zeros(0), nodes={}, num_tokens=num_tokens, vocab_size=vocab, stop_ids=stops)
    masses: list[float] = []

    def add_cell(key: tuple[int, ...], mass: float) -> int:
        law.cells.append(key)
        masses.append(mass)
        return len(law.cells) - 1

    frontier = [Node((), 1.0)]
    for depth in range(num_tokens):
        next_frontier: list[Node] = []
        chunks = [([0], scorer.root.unsqueeze(0))] if depth == 0 else scorer.score([n.prefix for n in frontier])
        for indices, logits in chunks:
            nodes = [frontier[i] for i in indices]
            paths = [list(n.prefix) for n in nodes]
            processed = sampler.process(logits, paths)  # [M, V] float32
            probs = logits_to_probs(processed, params).double()
            relaxed = logits_to_probs(processed, loose) > 0
            for node, p, r in zip(nodes, probs, relaxed):
                next_frontier += _split(law, node, p, r, stop_index, depth + 1 == num_tokens, min_cell_mass, add_cell)
        frontier = next_frontier
    law.probs = np.asarray(masses, dtype=np.float64)
    law.probs /= law.probs.sum()
    return law


def _split(law: ExactLaw, node: Node, p: torch.Tensor, relaxed: torch.Tensor, stop_index: torch.Tensor,
           last: bool, min_cell_mass: float, add_cell) -> list[Node]:
    """Record ``node``'s distribution [V] float64: its cells, and the children to expand (returned)."""
    p = p / p.sum()
    law.nodes[node.prefix] = node
    node.support = np.packbits((p > 0).numpy())
    node.relaxed = np.packbits((relaxed | (p > 0)).numpy())
    rest = p.clone()
    if stop_index.numel():
        stop_mass = float(p[stop_index].sum())
        rest[stop_index] = 0.0
        if stop_mass > 0 and node.mass * stop_mass >= min_cell_mass:
            node.stop_cell = add_cell(node.prefix + (STOP,), node.mass * stop_mass)
            p_other = 0.0
        else:
            p_other = stop_mass
    else:
        p_other = 0.0
    keep = torch.nonzero(rest * node.mass >= min_cell_mass).squeeze(1)
    values = rest[keep]
    rest[keep] = 0.0
    p_other += float(rest.sum())
    children = []
    for tok, q in zip(keep.tolist(), values.tolist()):
        node.kept[tok] = q
        if last:
            node.leaf_cells[tok] = add_cell(node.prefix + (tok,), node.mass * q)
        else:
            children.append(Node(node.prefix + (tok,), node.mass * q))
    if p_other > 0:
        node.other_cell = add_cell(node.prefix + (OTHER,), node.mass * p_other)
    return children


__all__ = ["BOUNDARY", "ExactLaw", "IMPOSSIBLE", "Node", "OTHER", "PrefixScorer", "STOP", "UNMAPPED", "exact_law",
           "relaxed_params"]
