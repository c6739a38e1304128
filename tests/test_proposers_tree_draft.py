"""Token trees from a draft model (``specdecode.proposers.tree_draft``): the static shape, the candidates each
node gets (top-k, or draws without replacement with their exact laws), budgets and depth, and the engine with
tree drafts (lossless, caches, shorter draft contexts)."""

from __future__ import annotations

import pytest
import torch

from specdecode import tree
from specdecode.engine import EngineConfig, SpeculativeEngine
from specdecode.proposers import DraftModelProposer
from specdecode.proposers.tree_draft import TreeDraftConfig, TreeDraftProposer, static_shape
from specdecode.sampling import logits_to_probs
from specdecode.types import SamplingParams, SpecDecodeError
from tiny import engine_of as _engine, assert_cache_is_fresh_prefill, step_of, tiny_llama

PROMPTS = [[1], [5, 9, 2], [3, 4, 5, 3, 4, 5, 3, 4], list(range(10, 30)), [40, 2, 40, 2, 40]]


def _bound(draft, target, config, prompt, params):
    """A tree proposer bound to an engine holding one prefilled request: (proposer, its context)."""
    proposer = TreeDraftProposer(draft, config)
    req, _ = _engine(target, proposer).add(prompt, params)
    return proposer, req.ctx


@torch.inference_mode()
def _draft_q(draft, ids, params):
    """The draft's candidate distribution after ``ids``: softmax greedily, else the request's processing."""
    logits = draft(input_ids=torch.tensor([ids])).logits[0, -1]
    return torch.softmax(logits.float(), -1) if params.greedy else logits_to_probs(logits, params)


def _path_ids(ctx, d, node):
    return list(ctx.token_ids) + [int(d.token_ids[0, j]) for j in tree.path_to(d.parents[0].tolist(), node)]


# --------------------------------------------------------------------------- shapes and config


def test_static_shape_prefers_likely_paths():
    shape = static_shape((3, 2, 1), 7)
    assert shape == [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (1, 1)]
    big = static_shape((4, 2, 2, 1), 20)
    assert len(big) == 20 and all(not p[:-1] or p[:-1] in big[:i] for i, p in enumerate(big))


@pytest.mark.parametrize("kwargs, needle", [
    (dict(kind="beam"), "tree kind"), (dict(num_nodes=0), "tree nodes"), (dict(num_nodes=65), "tree nodes"),
    (dict(branching=()), "branching"), (dict(branching=(2, 0)), "branching"), (dict(top_k=0), "top_k"),
    (dict(top_k=17), "top_k"), (dict(max_depth=0), "max_depth"), (dict(forward="fast"), "forward"),
])
def test_tree_config_is_validated(kwargs, needle):
    with pytest.raises(SpecDecodeError, match=needle):
        TreeDraftConfig(**kwargs)


# --------------------------------------------------------------------------- candidates


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_greedy_candidates_are_the_drafts_top_k_at_each_node(target, draft, kind):
    """Every node's children are the most likely tokens of the draft at that node's path (ranked), the tree
    is breadth-first, within the node budget and the asked depth."""
    config = (TreeDraftConfig(kind="static", num_nodes=12, branching=(3, 2, 1, 1)) if kind == "static"
              else TreeDraftConfig(kind="dynamic", num_nodes=12, top_k=3))
    params = SamplingParams(max_new_tokens=40)
    proposer, ctx = _bound(draft, target, config, [5, 9, 2, 7], params)
    d = proposer.propose([ctx], [3])[0]
    parents = d.parents[0].tolist()
    assert 1 < d.num_tokens <= 12 and d.draft_probs is None  # greedy: deterministic candidates
    assert tree.as_parent_list(parents) == parents and tree.tree_depth(parents) <= 3
    kids = tree.children_of(parents)
    for node in [-1, *range(d.num_tokens)]:
        children = kids.get(node, [])
        if not children:
            continue
        prefix = list(ctx.token_ids) if node < 0 else _path_ids(ctx, d, node)
        ranked = torch.argsort(_draft_q(draft, prefix, params), descending=True).tolist()
        got = [int(d.token_ids[0, c]) for c in children]
        if kind == "static":
            assert got == ranked[: len(got)], node
        else:  # dynamic: the kept children are among the node's top_k (reranking may drop some)
            assert set(got) <= set(ranked[:3]) and got[0] == ranked[0], node


def test_sampled_static_children_are_draws_without_replacement_with_their_exact_laws(target, draft):
    """Child i of a node carries q without its earlier siblings, renormalised (recursive rejection sampling)."""
    params = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=40, seed=4)
    config = TreeDraftConfig(kind="static", num_nodes=7, branching=(3, 2))
    proposer, ctx = _bound(draft, target, config, [5, 9, 2, 7], params)
    d = proposer.propose([ctx], [4])[0]
    assert d.draft_probs is not None and d.draft_probs.shape == (1, d.num_tokens, 64)
    parents = d.parents[0].tolist()
    for node, children in tree.children_of(parents).items():
        prefix = list(ctx.token_ids) if node < 0 else _path_ids(ctx, d, node)
        rest = _draft_q(draft, prefix, params)
        toks = [int(d.token_ids[0, c]) for c in children]
        assert len(set(toks)) == len(toks)  # without replacement
        for c, tok in zip(children, toks):
            torch.testing.assert_close(d.draft_probs[0, c], rest / rest.sum(), atol=1e-5, rtol=1e-4)
            assert d.draft_probs[0, c, tok] > 0
            rest = rest.clone()
            rest[tok] = 0.0
    static_topk = TreeDraftConfig(kind="static", num_nodes=7, branching=(3, 2), sampled_candidates=False)
    proposer, ctx = _bound(draft, target, static_topk, [5, 9, 2, 7], params)
    assert proposer.propose([ctx], [4])[0].draft_probs is None  # top-k candidates: verified as one-hot q


def test_sampled_dynamic_trees_do_not_depend_on_the_generator(target, draft):
    """A dynamic tree's shape and tokens are a deterministic function of the context (no draft_probs):
    keeping best-scored sampled nodes would bias them."""
    trees = []
    params = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=40, seed=1)
    for draws in (0, 7):
        proposer, ctx = _bound(draft, target, TreeDraftConfig(kind="dynamic", num_nodes=10, top_k=3),
                               [5, 9, 2, 7], params)  # the same context (the prefill samples the same token)
        torch.rand(draws, generator=ctx.generator)  # but another generator state
        d = proposer.propose([ctx], [4])[0]
        assert d.draft_probs is None and d.num_tokens == 10
        trees.append((ctx.token_ids, d.token_ids.tolist(), d.parents.tolist()))
    assert trees[0] == trees[1]


# --------------------------------------------------------------------------- the engine with tree drafts


def test_self_draft_tree_accepts_its_top_path(target):
    out = _engine(target, TreeDraftProposer(target, TreeDraftConfig(kind="dynamic", num_nodes=8, top_k=1))).generate(
        [3, 1, 4], SamplingParams(max_new_tokens=41))
    m = out.metrics  # top_k=1 grows the draft's greedy chain: the target accepts all of it
    assert m.mean_accepted_depth == m.mean_tree_depth == 4.0 and m.mean_accepted_length == 5.0


def test_one_node_tree_is_a_one_token_chain(target, draft):
    params = SamplingParams(max_new_tokens=30)
    chain = _engine(target, DraftModelProposer(draft), 1).generate(PROMPTS[2], params)
    for kind in ("static", "dynamic"):
        one = _engine(target, TreeDraftProposer(draft, TreeDraftConfig(kind=kind, num_nodes=1)), 4)
        out = one.generate(PROMPTS[2], params)
        assert out.token_ids == chain.token_ids
        assert out.metrics.mean_tree_size == 1.0
        assert out.metrics.num_target_forwards == chain.metrics.num_target_forwards


@pytest.mark.parametrize("kind", ["static", "dynamic"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_caches_after_tree_commits_equal_fresh_prefill(target, draft, kind, temperature):
    proposer = TreeDraftProposer(draft, TreeDraftConfig(kind=kind, num_nodes=10))
    engine = _engine(target, proposer)
    req, _ = engine.add(PROMPTS[3], SamplingParams(max_new_tokens=60, temperature=temperature, seed=1))
    for _ in range(8):
        step_of(engine, req)
        assert engine.target.ids[0] == req.ctx.token_ids[:-1]
        assert_cache_is_fresh_prefill(engine.target, 0)
        assert_cache_is_fresh_prefill(proposer.runner, 0)  # the draft kept its accepted path
        assert proposer.runner.ids[0] == req.ctx.token_ids[: len(proposer.runner.ids[0])]


def test_sampled_static_tree_self_draft_accepts_almost_everything(target):
    out = _engine(target, TreeDraftProposer(target, TreeDraftConfig(kind="static", num_nodes=6, branching=(2, 1, 1)))
                  ).generate([3, 1, 4], SamplingParams(max_new_tokens=60, temperature=1.0, seed=0))
    assert out.metrics.mean_accepted_depth > 0.95 * out.metrics.mean_tree_depth  # q == p: the first child is kept


@pytest.mark.parametrize("backend", ["hf", "owned"])
def test_tree_greedy_equals_plain_on_both_forwards(target, draft, backend):
    config = EngineConfig(num_speculative_tokens=4, forward=backend)
    plain = SpeculativeEngine(target, None, config)
    spec = SpeculativeEngine(target, TreeDraftProposer(draft, TreeDraftConfig(num_nodes=10, forward=backend)), config)
    assert type(spec.target).__name__ == ("HFRunner" if backend == "hf" else "OwnedRunner")
    for prompt in PROMPTS[:3]:
        params = SamplingParams(max_new_tokens=30)
        assert spec.generate(prompt, params).token_ids == plain.generate(prompt, params).token_ids


@pytest.mark.parametrize("kind", ["static", "dynamic"])
@pytest.mark.parametrize("backend", ["hf", "owned"])
def test_tree_draft_with_a_shorter_context_stops_drafting_where_it_ends(target, kind, backend):
    """A 16-position tree draft under a 256-position target: no tree once the context passes the draft's,
    and the output still equals plain decoding."""
    short = tiny_llama(vocab_size=64, seed=1, layers=1, hidden=32, scale=3.0, max_positions=16)
    cfg = (TreeDraftConfig(kind="static", num_nodes=10, forward=backend) if kind == "static"
           else TreeDraftConfig(kind="dynamic", num_nodes=12, top_k=3, forward=backend))
    config = EngineConfig(num_speculative_tokens=4, forward=backend)
    engine = SpeculativeEngine(target, TreeDraftProposer(short, cfg), config)
    params = SamplingParams(max_new_tokens=30)
    req, _ = engine.add([5, 9, 2], params)
    while req.finish_reason is None:
        beyond = len(req.ctx.token_ids) > 16
        step = step_of(engine, req)
        assert not (beyond and step.num_drafted)
    out = engine.output(req)
    assert out.metrics.num_tree_steps > 0 and out.metrics.draft_lengths[-5:] == [0] * 5
    assert out.token_ids == SpeculativeEngine(target, None, config).generate([5, 9, 2], params).token_ids
