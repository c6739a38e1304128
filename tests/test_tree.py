"""Token trees: masks and positions, lossless tree verification, the engine with tree drafts.

(The tree forward and keep-path commit of the KV cache are tested in ``tests/test_kv_base.py``; the tree
draft model itself in ``tests/test_proposers_tree_draft.py``.)

The distribution tests run the whole speculative loop with tree drafts over synthetic
context-dependent target / draft distributions (vocabulary 4, 3 generated tokens: 64
outcomes) and compare the empirical distribution of generated sequences with the
target's exact one by a chi-square test at fixed seeds; negative controls show the same
test rejects verifiers that are subtly wrong.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy import stats

from specdecode import tree
from specdecode.engine import EngineConfig, SpeculativeEngine
from specdecode.proposers import DraftModelProposer, NgramProposer
from specdecode.proposers.base import Proposer
from specdecode.proposers.suffix import SuffixProposer
from specdecode.proposers.tree_draft import TreeDraftConfig, TreeDraftProposer
from specdecode.sampling import logits_to_probs
from specdecode.tree import (
    InvalidTreeError,
    ancestor_matrix,
    node_depths,
    tree_attention_mask,
    verify_tree_greedy,
    verify_tree_sampling,
)
from specdecode.types import Draft, SamplingParams
from oracles import verify_greedy, verify_sampling
from tiny import engine_of as _engine, tiny_llama


TREE = [-1, -1, 0, 0, 1, 3]  # root -> {0, 1}; 0 -> {2, 3}; 1 -> {4}; 3 -> {5}


# --------------------------------------------------------------------------- structure


def test_depths_ancestors_and_mask():
    assert node_depths(TREE) == [1, 1, 2, 2, 2, 3]
    anc = ancestor_matrix(TREE)
    assert anc[5].nonzero().flatten().tolist() == [0, 3, 5]
    assert anc[4].nonzero().flatten().tolist() == [1, 4]
    mask = tree_attention_mask(TREE, num_prefix=3)
    assert mask.shape == (6, 9) and mask[:, :3].all()
    assert mask[5, 3:].nonzero().flatten().tolist() == [0, 3, 5]
    assert tree_attention_mask(TREE, 3, num_new=2).equal(mask[-2:])
    assert tree.is_chain([-1, 0, 1]) and not tree.is_chain(TREE)
    assert tree.tree_inputs(TREE) == ([-1, 0, 0, 1, 1, 2, 4], [0, 1, 1, 2, 2, 2, 3])


@pytest.mark.parametrize("bad", [[0], [-1, 1], [-2], [-1, 0, 3]])
def test_parents_must_be_breadth_first(bad):
    with pytest.raises(InvalidTreeError):
        tree.as_parent_list(bad)


# --------------------------------------------------------------------------- greedy verification


def _logits_with_argmax(argmax: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.zeros(len(argmax), vocab)
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 5.0
    return logits.unsqueeze(0)


def test_greedy_tree_takes_the_longest_argmax_path():
    tokens = torch.tensor([[2, 3, 4, 5, 6, 7]])
    parents = torch.tensor([TREE])
    # argmax after root = 3 (node 1), after node 1 = 6 (node 4), after node 4 = 1
    r = verify_tree_greedy(tokens, parents, _logits_with_argmax([3, 0, 6, 0, 0, 1, 0]))
    assert r.num_accepted.tolist() == [2]
    assert r.new_token_ids.tolist() == [[3, 6, 1, -1]]
    assert r.kept_nodes.tolist() == [[1, 4, -1, -1]]
    none = verify_tree_greedy(tokens, parents, _logits_with_argmax([1, 0, 0, 0, 0, 0, 0]))
    assert none.num_accepted.tolist() == [0] and none.new_token_ids[0, 0] == 1


def test_greedy_tree_with_duplicate_children_keeps_the_deeper_branch():
    # root children 0 and 1 both carry token 2; only node 1's child (node 3) continues
    tokens, parents = torch.tensor([[2, 2, 4, 5]]), torch.tensor([[-1, -1, 0, 1]])
    r = verify_tree_greedy(tokens, parents, _logits_with_argmax([2, 0, 5, 0, 7]))
    assert r.kept_nodes[0, :2].tolist() == [1, 3] and r.new_token_ids.tolist() == [[2, 5, 7]]


def test_chain_trees_verify_exactly_like_chains():
    g = torch.Generator().manual_seed(0)
    for k in range(0, 6):
        for trial in range(20):
            draft = torch.randint(0, 5, (1, k), generator=g)
            logits = torch.randn(1, k + 1, 5, generator=g)
            chain = Draft.chain(draft)
            a, b = verify_greedy(draft, logits), verify_tree_greedy(draft, chain.parents, logits)
            assert a.num_accepted.equal(b.num_accepted) and a.new_token_ids.equal(b.new_token_ids)
            p = torch.softmax(logits, -1)
            q = torch.softmax(torch.randn(1, k, 5, generator=g), -1) if trial % 2 else None
            a = verify_sampling(draft, q, p, [torch.Generator().manual_seed(trial)])
            b = verify_tree_sampling(draft, chain.parents, q, p, [torch.Generator().manual_seed(trial)])
            assert a.new_token_ids.equal(b.new_token_ids), (k, trial)  # same randomness, same result


# --------------------------------------------------------------------------- exact output distribution

V, N = 4, 3  # vocabulary, generated tokens per sample (64 outcomes)
PARAMS = SamplingParams(temperature=1.0)


def _table(seed: int, sharp: float = 1.5) -> dict[tuple[int, ...], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {pre: torch.randn(V, generator=g) * sharp for n in range(N + 1) for pre in itertools.product(range(V), repeat=n)}


def _probs(table: dict[tuple[int, ...], torch.Tensor]) -> dict[tuple[int, ...], torch.Tensor]:
    """``logits_to_probs`` of every prefix's logits, computed once (the simulation asks for each thousands of times)."""
    return {pre: logits_to_probs(logits, PARAMS) for pre, logits in table.items()}


def _exact(target) -> np.ndarray:
    probs = np.ones(V**N)
    for i, seq in enumerate(itertools.product(range(V), repeat=N)):
        for t in range(N):
            probs[i] *= float(logits_to_probs(target[seq[:t]], PARAMS)[seq[t]])
    return probs


# A tree shape with a 3-way root, a 2-way second level and a leaf below.
SHAPE = [-1, -1, -1, 0, 0, 1, 3]


def _build_tree(draft, seq, mode, g, depth_cap):
    """Draft tokens / q rows over SHAPE (cut at depth_cap). Modes:
    'topk'    deterministic: top-k of q per node (verified as one-hot q);
    'dups'    deterministic with repeated siblings (top-1 twice, then top-2);
    'iid'     children sampled i.i.d. from q (SpecInfer MSS; duplicates happen): rows = q;
    'wor'     children sampled without replacement (Gumbel-top-k): rows = q minus earlier siblings;
    'topk-as-sampled'  broken: top-k tokens verified with rows = q."""
    depths = node_depths(SHAPE)
    nodes = [i for i in range(len(SHAPE)) if depths[i] <= depth_cap]
    kids = tree.children_of(SHAPE)
    tokens, rows = {}, {}

    def prefix(node):
        return tuple(seq + [tokens[j] for j in tree.path_to(SHAPE, node)]) if node >= 0 else tuple(seq)

    for parent in [-1] + nodes:
        children = [c for c in kids.get(parent, []) if c in nodes]
        if not children:
            continue
        q = draft[prefix(parent)]  # the draft's probabilities (a ``_probs`` table)
        order = torch.argsort(q, descending=True).tolist()
        if mode in ("topk", "topk-as-sampled"):
            toks = order[: len(children)]
        elif mode == "dups":
            toks = [order[0], order[0], order[1]][: len(children)]
        elif mode == "iid":
            toks = torch.multinomial(q, len(children), replacement=True, generator=g).tolist()
        else:  # wor
            toks = torch.multinomial(q, len(children), replacement=False, generator=g).tolist()
        rest = q.clone()
        for c, tok in zip(children, toks):
            tokens[c] = tok
            if mode == "wor":
                rows[c] = rest / rest.sum()
                rest[tok] = 0.0
            else:
                rows[c] = q
    parents = [SHAPE[i] for i in nodes]
    probs = None if mode in ("topk", "dups") or not nodes else torch.stack([rows[i] for i in nodes]).unsqueeze(0)
    return [tokens[i] for i in nodes], parents, probs, prefix


def _simulate(mode, samples, seed, verifier=verify_tree_sampling):
    target, draft = _table(1), _table(2)
    target_p, draft_p = _probs(target), _probs(draft)
    g = torch.Generator().manual_seed(seed)
    counts = np.zeros(V**N)
    for _ in range(samples):
        seq: list[int] = []
        while len(seq) < N:
            toks, parents, q, prefix = _build_tree(draft_p, seq, mode, g, N - len(seq) - 1)
            rows = [prefix(-1)] + [prefix(i) for i in range(len(toks))]
            p = torch.stack([target_p[r] for r in rows]).unsqueeze(0)
            r = verifier(torch.tensor([toks], dtype=torch.int64).reshape(1, -1),
                         torch.tensor([parents], dtype=torch.int64).reshape(1, -1), q, p, [g])
            n = int(r.num_accepted[0])
            seq.extend(r.new_token_ids[0, : n + 1].tolist())
        counts[int(np.ravel_multi_index(seq[:N], (V,) * N))] += 1
    return counts, _exact(target)


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


@pytest.mark.parametrize("mode", ["topk", pytest.param("dups", marks=pytest.mark.slow),
                                  pytest.param("iid", marks=pytest.mark.slow), "wor"])  # the tree drafter's two
def test_tree_sampling_matches_target_distribution(mode):
    counts, exact = _simulate(mode, samples=6000, seed=7)
    assert _chi2_pvalue(counts, exact) > 1e-3


def _same_residual_for_every_sibling(token_ids, parents, draft_probs, target_probs, generators):
    """Broken: every sibling is tried against p itself instead of the residual of earlier rejections."""
    orig = tree.residual_distribution
    tree.residual_distribution = lambda p, q, tok: p
    try:
        return verify_tree_sampling(token_ids, parents, draft_probs, target_probs, generators)
    finally:
        tree.residual_distribution = orig


@pytest.mark.slow  # negative controls of the test above (kept in the slow lane)
@pytest.mark.parametrize("case", ["topk-as-sampled", "no-residual-update"])
def test_distribution_test_catches_broken_tree_verifiers(case):
    """Negative controls at the same sample size: top-k candidates treated as samples from q
    (the shortcut that is not lossless), and siblings all tried against p."""
    if case == "topk-as-sampled":
        counts, exact = _simulate("topk-as-sampled", samples=6000, seed=7)
    else:
        counts, exact = _simulate("iid", samples=6000, seed=7, verifier=_same_residual_for_every_sibling)
    assert _chi2_pvalue(counts, exact) < 1e-3


# --------------------------------------------------------------------------- the engine with trees

PROMPTS = [[1], [5, 9, 2], [3, 4, 5, 3, 4, 5, 3, 4], list(range(10, 30)), [40, 2, 40, 2, 40]]


TREE_PROPOSERS = {
    "static": lambda d: TreeDraftProposer(d, TreeDraftConfig(kind="static", num_nodes=10)),
    "dynamic": lambda d: TreeDraftProposer(d, TreeDraftConfig(kind="dynamic", num_nodes=12, top_k=3)),
    "suffix": lambda d: SuffixProposer(),
    "suffix:ngram": lambda d: SuffixProposer(fallback=NgramProposer()),
    "suffix:draft": lambda d: SuffixProposer(fallback=TreeDraftProposer(d, TreeDraftConfig(num_nodes=6))),
}


@pytest.mark.parametrize("kind", list(TREE_PROPOSERS))
def test_tree_greedy_equals_plain_greedy(target, draft, kind):
    plain = _engine(target, None)
    spec = _engine(target, TREE_PROPOSERS[kind](draft))
    for prompt in PROMPTS:
        params = SamplingParams(max_new_tokens=30)
        out = spec.generate(prompt, params)
        assert out.token_ids == plain.generate(prompt, params).token_ids, (kind, prompt)
    m = out.metrics
    assert m.num_tree_steps > 0 and m.mean_tree_size >= 1 and m.num_accepted_tokens == m.tree_accepted_depth_sum


class _AsTree(Proposer):
    """A chain proposer flagged as a tree proposer: forces the engine's tree path."""

    produces_trees = True

    def __init__(self, inner):
        self.inner = inner

    def bind(self, target, num_slots):
        self.inner.bind(target, num_slots)

    def start(self, ctx):
        self.inner.start(ctx)

    def propose(self, batch, max_tokens):
        return self.inner.propose(batch, max_tokens)

    def observe(self, batch, results):
        self.inner.observe(batch, results)

    def finish(self, ctx):
        self.inner.finish(ctx)

    def move(self, src, dst):
        self.inner.move(src, dst)


def test_chain_through_the_tree_path_is_identical_greedily(target, draft):
    """A chain (and a one-node tree) through the tree path: same tokens, same counts. (Sampled rows differ
    draw by draw: the tree verifier and the vectorised chain verifier use their uniforms differently;
    each is exact, see the distribution tests here and in ``test_verify.py``.)"""
    params = SamplingParams(max_new_tokens=40)
    for gamma in (1, 3):
        a = _engine(target, DraftModelProposer(draft), gamma).generate(PROMPTS[3], params)
        b = _engine(target, _AsTree(DraftModelProposer(draft)), gamma).generate(PROMPTS[3], params)
        assert a.token_ids == b.token_ids
        assert a.metrics.num_target_forwards == b.metrics.num_target_forwards
