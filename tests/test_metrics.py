"""Counters of one run (``specdecode.metrics.RunMetrics``): what a step records, the derived rates (chains
and token trees), and the counters of real engine runs adding up."""

from __future__ import annotations

import json

import pytest

from specdecode.engine import EngineConfig, SpeculativeEngine
from specdecode.metrics import RunMetrics
from specdecode.proposers import DraftModelProposer, NgramConfig, NgramProposer, TreeDraftConfig, TreeDraftProposer
from specdecode.types import SamplingParams
from tiny import tiny_llama

DERIVED = ("acceptance_rate", "mean_accepted_length", "acceptance_by_position", "mean_draft_length",
           "draft_length_histogram", "mean_tree_size", "mean_tree_depth", "mean_accepted_depth", "other_time_s",
           "tokens_per_s")


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=64, seed=0, scale=3.0)


# --------------------------------------------------------------------------- counters by hand


def test_chain_steps_count_positions_and_derive_the_rates():
    m = RunMetrics()
    m.record_step(4, 4, 5)  # all kept + bonus
    m.record_step(4, 1, 2)  # position 1 rejected, recovered token
    m.record_step(0, 0, 1)  # a plain decoding step (gamma 0)
    m.record_step(2, 0, 1)
    assert (m.num_verify_steps, m.num_target_forwards) == (4, 4)
    assert (m.num_drafted_tokens, m.num_accepted_tokens, m.num_step_tokens) == (10, 5, 9)
    assert m.drafted_by_position == [3, 3, 2, 2] and m.accepted_by_position == [2, 1, 1, 1]
    assert m.acceptance_by_position == [2 / 3, 1 / 3, 0.5, 0.5]
    assert m.acceptance_rate == 0.5 and m.mean_accepted_length == 9 / 4
    assert m.draft_lengths == [4, 4, 0, 2] and m.mean_draft_length == 2.5
    assert m.draft_length_histogram == {0: 1, 2: 1, 4: 2} and list(m.draft_length_histogram) == [0, 2, 4]
    assert m.num_tree_steps == 0 and m.mean_tree_size == m.mean_tree_depth == m.mean_accepted_depth == 0.0


def test_tree_steps_count_nodes_as_drafted_and_depths_as_positions():
    m = RunMetrics()
    m.record_step(10, 2, 3, depth=4)  # 10 nodes, 4 levels, accepted path of 2
    m.record_step(6, 3, 4, depth=3)
    assert m.num_tree_steps == 2 and m.num_tree_nodes == 16 and m.num_drafted_tokens == 16
    assert m.tree_depth_sum == 7 and m.tree_accepted_depth_sum == 5 == m.num_accepted_tokens
    assert m.drafted_by_position == [2, 2, 2, 1]  # depth i + 1 reached, not nodes
    assert m.accepted_by_position == [2, 2, 1, 0]
    assert m.mean_tree_size == 8.0 and m.mean_tree_depth == 3.5 and m.mean_accepted_depth == 2.5
    assert m.acceptance_rate == 5 / 16 and m.mean_accepted_length == 3.5


def test_a_cut_counts_every_counter_to_the_committed_end():
    """``cut(end)``: steps are recounted from their records by one rule, also what an EOS inside a block does
    at record time: a step ending inside its accepted block counts its kept tokens as drafted and accepted;
    a step wholly past the end is no forward at all; the prefill's forward stays."""
    m = RunMetrics(num_generated_tokens=14)
    m.num_target_forwards = 1  # the prefill: token 0
    m.record_step(4, 4, 5)  # tokens 1..5
    m.record_step(4, 1, 2)  # tokens 6, 7 (position 1 rejected)
    m.record_step(4, 4, 3)  # tokens 8..10: an EOS at the third accepted token
    m.record_step(5, 2, 3, depth=3)  # a token tree: 5 nodes, 3 levels, accepted depth 2; tokens 11..13
    assert (m.num_drafted_tokens, m.num_accepted_tokens, m.num_step_tokens) == (4 + 4 + 3 + 5, 4 + 1 + 3 + 2, 13)
    assert m.draft_lengths == [4, 4, 3, 5] and m.num_target_forwards == 5 and m.num_tree_steps == 1
    tree = m.copy()
    tree.cut(13)  # a cut inside the tree's accepted path: its nodes and depth count the kept tokens
    assert (tree.num_tree_steps, tree.num_tree_nodes, tree.tree_depth_sum, tree.tree_accepted_depth_sum) == (1, 2, 2, 2)
    assert tree.num_generated_tokens == 13 and m.num_generated_tokens == 14 and m.num_tree_nodes == 5
    m.cut(9)  # a stop string keeps tokens 0..8: one token of the third step
    assert m.num_generated_tokens == 9 and m.num_target_forwards == 4 == m.num_verify_steps + 1
    assert (m.num_drafted_tokens, m.num_accepted_tokens, m.num_step_tokens) == (4 + 4 + 1, 4 + 1 + 1, 8)
    assert m.drafted_by_position == [3, 2, 2, 2] and m.accepted_by_position == [3, 1, 1, 1]
    assert m.draft_lengths == [4, 4, 1] and m.num_tree_steps == 0 and m.mean_accepted_length == 8 / 3
    m.cut(6)  # a cut at a step boundary drops the steps after it
    assert (m.num_verify_steps, m.num_drafted_tokens, m.num_accepted_tokens, m.num_step_tokens) == (1, 4, 4, 5)
    m.cut(0)  # nothing delivered: only the prefill's forward
    assert (m.num_target_forwards, m.num_verify_steps, m.num_drafted_tokens, m.drafted_by_position) == (1, 0, 0, [])
    assert "steps" not in m.to_dict() and m.copy().steps == m.steps and m.copy().steps is not m.steps


def test_rates_of_an_empty_run_are_zero_not_errors():
    m = RunMetrics()
    assert m.acceptance_rate == m.mean_accepted_length == m.mean_draft_length == m.tokens_per_s == 0.0
    assert m.acceptance_by_position == [] and m.draft_length_histogram == {}
    m.wall_time_s, m.prefill_time_s, m.draft_time_s, m.verify_time_s = 1.0, 0.5, 0.4, 0.3
    assert m.other_time_s == 0.0  # never negative (timers overlap by rounding)
    m.wall_time_s, m.num_generated_tokens = 2.0, 10
    assert m.other_time_s == pytest.approx(0.8) and m.tokens_per_s == 5.0


def test_to_dict_holds_every_counter_and_derived_figure_and_is_json():
    m = RunMetrics(num_prompt_tokens=3, num_generated_tokens=6, wall_time_s=0.5)
    m.record_step(3, 2, 3)
    m.record_step(5, 1, 2, depth=3)
    d = m.to_dict()
    for key in DERIVED:
        assert d[key] == getattr(m, key), key
    assert d["drafted_by_position"] == m.drafted_by_position and d["num_tree_nodes"] == 5
    back = json.loads(json.dumps(d))
    assert back["acceptance_rate"] == m.acceptance_rate and back["draft_length_histogram"] == {"3": 1, "5": 1}


# --------------------------------------------------------------------------- counters of engine runs


def test_metrics_by_position(target):
    out = SpeculativeEngine(target, DraftModelProposer(target), EngineConfig(num_speculative_tokens=3)).generate(
        [1, 2], SamplingParams(max_new_tokens=13))
    m = out.metrics
    assert m.drafted_by_position == [3, 3, 3] and m.accepted_by_position == [3, 3, 3]  # 1 + 3 steps x 4
    assert m.acceptance_by_position == [1.0, 1.0, 1.0]
    d = m.to_dict()
    for key in ("acceptance_rate", "mean_accepted_length", "tokens_per_s", "other_time_s"):
        assert key in d


@pytest.mark.parametrize("kind", ["ngram", "draft-model", "tree"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_counters_add_up(target, kind, temperature):
    """Per-position counters sum to the totals, committed tokens are the prefill's one plus the steps', and
    tau is tokens per verification forward, for chains and trees, greedy and sampled."""
    draft = tiny_llama(vocab_size=64, seed=1, layers=1, hidden=32, scale=3.0)
    proposer = {"ngram": lambda: NgramProposer(NgramConfig(1, 3)), "draft-model": lambda: DraftModelProposer(draft),
                "tree": lambda: TreeDraftProposer(draft, TreeDraftConfig(num_nodes=8, top_k=2))}[kind]()
    engine = SpeculativeEngine(target, proposer, EngineConfig(num_speculative_tokens=4))
    out = engine.generate([3, 4, 5, 3, 4, 5, 3], SamplingParams(temperature=temperature, max_new_tokens=40, seed=2))
    m = out.metrics
    assert m.num_prompt_tokens == 7 and m.num_generated_tokens == len(out.token_ids) == 40
    assert m.num_target_forwards == m.num_verify_steps + 1 == len(m.draft_lengths) + 1
    assert m.num_step_tokens == m.num_generated_tokens - 1
    assert m.mean_accepted_length == pytest.approx(39 / m.num_verify_steps)
    assert sum(m.accepted_by_position) == m.num_accepted_tokens
    if kind == "tree":
        assert m.num_tree_steps > 0 and sum(m.drafted_by_position) == m.tree_depth_sum
        assert m.num_drafted_tokens == m.num_tree_nodes >= m.tree_depth_sum
    else:
        assert sum(m.drafted_by_position) == m.num_drafted_tokens == sum(m.draft_lengths)
    assert m.num_drafted_tokens > 0 and 0.0 <= m.acceptance_rate <= 1.0
    assert m.wall_time_s >= m.prefill_time_s + m.verify_time_s > 0 and m.time_to_first_token_s > 0
