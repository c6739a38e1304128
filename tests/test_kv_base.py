"""The slot KV cache contract (``specdecode.kv.base.SlotRunner``), on both forwards: chunks, ragged rows,
rollback, sync, token trees and their kept paths, the context limit, and the rollback contract (DESIGN.md
rule 8: each slot equals a fresh prefill of its ids) after random sequences of operations; and the helper
functions of the module.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from specdecode import tree
from specdecode.kv import UnsupportedCacheError, make_runner
from specdecode.kv.base import (
    RowView,
    check_rollback_support,
    checked_tree_path,
    common_prefix_length,
    model_context,
    rollback_problem,
    sliding_window,
)
from specdecode.types import PromptTooLongError
from tiny import assert_cache_is_fresh_prefill, close, reference, tiny_llama, tiny_qwen2

BACKENDS = ["hf", "owned"]
TREE = [-1, -1, 0, 0, 1, 3]  # root -> {0, 1}; 0 -> {2, 3}; 1 -> {4}; 3 -> {5}
MODELS = {"llama": lambda dtype=torch.float64: tiny_llama(vocab_size=64, seed=0, dtype=dtype),
          "qwen2": lambda dtype=torch.float64: tiny_qwen2(seed=3, layers=2, scale=1.0, dtype=dtype)}


# --------------------------------------------------------------------------- forwards


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", list(MODELS))
def test_forward_in_chunks_and_after_rollback_matches_the_model(family, backend):
    model = MODELS[family]()
    row = make_runner(model, backend).row(0)
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    ref = reference(model, ids)
    at = 0
    for chunk in ([1, 2, 3, 4, 5], [6], [7, 8, 9]):
        close(row.forward(chunk), ref[at : at + len(chunk)])
        at += len(chunk)
    assert row.cached_ids == ids and row.num_cached == 9
    row.rollback(6)
    assert row.cached_ids == ids[:6]
    close(row.forward([10, 11]), reference(model, ids[:6] + [10, 11])[6:])
    close(row.forward([12], last_only=True), reference(model, ids[:6] + [10, 11, 12])[-1:])
    assert_cache_is_fresh_prefill(row)
    row.sync(ids[:6] + [10, 99])  # the longest agreeing prefix
    assert row.cached_ids == ids[:6] + [10]
    assert_cache_is_fresh_prefill(row)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ragged_rows_in_one_forward_equal_each_row_alone(backend):
    """Rows of different lengths in one forward: each row's logits are its own sequence's; a row with
    nothing to feed only pads (its cache is untouched)."""
    model = tiny_llama(seed=0)
    runner = make_runner(model, backend, num_slots=4)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15]]
    out = runner.forward(slice(0, 4), prompts)  # [4, 7, V]
    assert out.shape == (4, 7, 64)
    for i, p in enumerate(prompts):
        close(out[i, : len(p)], reference(model, p))
    feeds = [[20], [21, 22, 23], [], [24, 25]]
    last = runner.forward(slice(0, 4), feeds, last_only=True)  # [4, 1, V]
    assert last.shape == (4, 1, 64)
    for i, (p, f) in enumerate(zip(prompts, feeds)):
        assert runner.ids[i] == p + f
        if f:
            close(last[i, 0], reference(model, p + f)[-1])
        assert_cache_is_fresh_prefill(runner, i)
    sub = runner.forward(slice(1, 3), [[30], [31]])  # a slice that does not start at slot 0
    close(sub[0, 0], reference(model, prompts[1] + feeds[1] + [30])[-1])
    close(sub[1, 0], reference(model, prompts[2] + [31])[-1])
    with pytest.raises(ValueError):
        runner.forward(slice(0, 2), [[1]])  # one feed per row
    with pytest.raises(ValueError):
        runner.forward(slice(0, 2), [[], []])  # nothing to run


def test_context_limit_is_enforced():
    runner = make_runner(tiny_llama(seed=0), "owned", max_context=16)
    assert runner.max_context == 16
    runner.forward(slice(0, 1), [list(range(1, 17))])
    with pytest.raises(PromptTooLongError):
        runner.forward(slice(0, 1), [[1]])
    assert make_runner(tiny_llama(seed=0), max_context=10_000).max_context == 256  # never past the model's


# --------------------------------------------------------------------------- token trees


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", list(MODELS))
def test_forward_tree_scores_every_node_as_its_own_path(family, backend):
    model = MODELS[family]()
    prefixes, tokens = [[3, 4, 5, 6], [7, 8]], [10, 11, 12, 13, 14, 15]
    trees = [TREE, [-1, 0, 1, -1, 3, 4]]  # the second row: two chains
    runner = make_runner(model, backend, num_slots=2)
    runner.forward(slice(0, 2), prefixes)
    logits = runner.forward_tree(slice(0, 2), [tokens, tokens], trees)
    for r in range(2):
        for i in range(len(tokens)):
            path = [tokens[j] for j in tree.path_to(trees[r], i)]
            close(logits[r, i], reference(model, prefixes[r] + path)[-1])
    # the same tree fed level by level (as the draft builders do)
    row = make_runner(model, backend).row(0)
    row.forward(prefixes[0])
    parts = [row.forward_tree(tokens[:2], TREE[:2]), row.forward_tree(tokens[2:5], TREE[2:5]),
             row.forward_tree(tokens[5:], TREE[5:])]
    close(torch.cat(parts), logits[0])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("path", [[], [0], [1, 4], [0, 3, 5], [0, 2]])
def test_keep_tree_path_equals_fresh_prefill(family, backend, path):
    model = MODELS[family]()
    prefix, tokens = [3, 4, 5, 6], [10, 11, 12, 13, 14, 15]
    row = make_runner(model, backend).row(0)
    row.forward(prefix)
    row.forward_tree(tokens, TREE)
    assert row.has_pending_tree
    with pytest.raises(ValueError):
        row.forward([1])  # nothing runs on a pending tree
    row.keep_tree_path(path)
    kept = prefix + [tokens[i] for i in path]
    assert row.cached_ids == kept and not row.has_pending_tree
    assert_cache_is_fresh_prefill(row)
    close(row.forward([7, 8]), reference(model, kept + [7, 8])[-2:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_keep_tree_path_rejects_non_paths_and_rollback_into_prefix_drops_tree(backend):
    row = make_runner(tiny_llama(vocab_size=64, seed=0), backend).row(0)
    row.forward([3, 4, 5])
    row.forward_tree([10, 11, 12], [-1, -1, 0])
    for bad in ([2], [1, 2], [0, 0]):
        with pytest.raises(ValueError):
            row.keep_tree_path(bad)
    with pytest.raises(ValueError):
        row.rollback(4)  # into the tree region
    row.rollback(2)
    assert not row.has_pending_tree and row.cached_ids == [3, 4]
    with pytest.raises(ValueError):
        row.keep_tree_path([])  # no tree pending
    assert_cache_is_fresh_prefill(row)


# --------------------------------------------------------------------------- the rollback contract


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_operations_keep_every_slot_a_fresh_prefill(backend):
    """Seeded random forwards, trees, keeps, rollbacks, moves and clears over 4 slots: after each,
    every slot equals a fresh prefill of its ids (the contract the engine relies on)."""
    model = tiny_llama(seed=0)
    runner = make_runner(model, backend, num_slots=4)
    rng = random.Random(0)
    ops = {"forward": 0, "tree": 0, "rollback": 0, "move": 0, "clear": 0}
    runner.forward(slice(0, 4), [[rng.randrange(64) for _ in range(rng.randint(1, 6))] for _ in range(4)])
    for step in range(60):
        b = rng.randint(1, 4)
        op = rng.choice(["forward", "forward", "tree", "tree", "rollback", "move", "clear"])
        if op == "forward":
            feeds = [[rng.randrange(64) for _ in range(rng.randint(0, 4))] for _ in range(b)]
            feeds[rng.randrange(b)].append(rng.randrange(64))
            runner.forward(slice(0, b), feeds)
        elif op == "tree":
            trees = []
            for _ in range(b):
                n = rng.randint(0, 6)
                trees.append([rng.randint(-1, i - 1) for i in range(n)])
            if not any(trees):
                continue
            runner.forward_tree(slice(0, b), [[rng.randrange(64) for _ in t] for t in trees], trees)
            for s, parents in zip(range(b), trees):
                if not parents:
                    continue
                leaf = rng.randrange(len(parents))
                path = tree.path_to(parents, leaf)[: rng.randint(0, 3)]
                runner.keep_tree_path(s, path)
        elif op == "rollback":
            s = rng.randrange(4)
            runner.rollback(s, rng.randint(0, len(runner.ids[s])))
        elif op == "move":
            runner.move(rng.randrange(4), rng.randrange(4))
        elif op == "clear":
            runner.clear(rng.randrange(4))
        ops[op] += 1
        for s in range(4):
            assert_cache_is_fresh_prefill(runner, s)
        for s in range(4):
            if not runner.ids[s]:
                runner.forward(slice(s, s + 1), [[rng.randrange(64)]])  # keep rows non-empty
    assert min(ops.values()) > 0, ops
    runner.release()
    assert runner.nbytes == 0 and runner.ids == [[], [], [], []]


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_move_clear_and_release(backend):
    runner = make_runner(tiny_llama(seed=0), backend, num_slots=3)
    runner.forward(slice(0, 3), [[1, 2, 3], [4, 5], [6]])
    assert [runner.length(s) for s in range(3)] == [3, 2, 1] and runner.nbytes > 0
    runner.move(0, 2)
    assert runner.ids[2] == [1, 2, 3] and runner.ids[0] == []  # moved, source emptied
    assert_cache_is_fresh_prefill(runner, 2)
    runner.clear(1)
    assert runner.ids[1] == [] and runner.length(1) == 0
    runner.move(2, 2)  # onto itself: nothing changes
    assert runner.ids[2] == [1, 2, 3]
    assert_cache_is_fresh_prefill(runner, 2)
    row = runner.row(2)
    assert isinstance(row, RowView) and row.num_cached == 3 and row.cached_ids == [1, 2, 3]
    runner.release()
    assert runner.nbytes == 0 and runner.ids == [[], [], []]
    runner.forward(slice(0, 1), [[7, 8]])  # usable again after a release
    assert_cache_is_fresh_prefill(runner, 0)


# --------------------------------------------------------------------------- helpers


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix_length([1, 2, 3], [1, 2]) == 2
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length([5, 2], [1, 2]) == 0
    long = list(range(1000))
    for cut in (0, 1, 499, 998, 999):
        other = long[:cut] + [-1] + long[cut + 1:]
        assert common_prefix_length(long, other) == cut
    assert common_prefix_length((1, 2, 4), [1, 2, 3]) == 2  # any sequences


def test_checked_tree_path_accepts_root_paths_only():
    parents = [-1, -1, 0, 0, 1, 3]
    assert checked_tree_path([0, 3, 5], 4, parents) == [0, 3, 5]
    assert checked_tree_path(torch.tensor([1, 4]), 4, parents) == [1, 4]
    assert checked_tree_path([], 4, parents) == []
    for bad in ([3], [0, 4], [1, 0], [0, 6], [-1]):
        with pytest.raises(ValueError, match="not a root path"):
            checked_tree_path(bad, 4, parents)
    with pytest.raises(ValueError, match="no token tree is pending"):
        checked_tree_path([0], None, parents)


def _cfg(**kw):
    return SimpleNamespace(config=SimpleNamespace(**kw))


def test_model_context_and_sliding_window():
    assert model_context(tiny_llama(max_positions=96)) == 96
    assert model_context(_cfg()) == 2048 and model_context(torch.nn.Linear(2, 2)) == 2048
    assert sliding_window(_cfg(max_position_embeddings=256)) is None
    assert sliding_window(_cfg(max_position_embeddings=256, sliding_window=8)) == 8
    assert sliding_window(_cfg(max_position_embeddings=256, sliding_window=8, use_sliding_window=False)) is None
    assert sliding_window(_cfg(max_position_embeddings=256, sliding_window=512)) is None  # longer than the context
    assert sliding_window(_cfg(max_position_embeddings=256, sliding_window=8,
                               layer_types=["full_attention"] * 2)) is None
    assert sliding_window(tiny_qwen2(seed=3, layers=2, sliding=True)) == 8


def test_rollback_problems_name_the_layer_kind():
    assert rollback_problem(tiny_llama()) is None and rollback_problem(torch.nn.Linear(2, 2)) is None
    assert "['linear_attention']" in rollback_problem(_cfg(layer_types=["full_attention", "linear_attention"]))
    assert "state_size" in rollback_problem(_cfg(state_size=16))
    assert rollback_problem(tiny_qwen2(seed=3, layers=2, sliding=True)) is None  # its forward takes a mask per type
    with pytest.raises(UnsupportedCacheError, match="'mamba'.*cut back"):
        check_rollback_support(SimpleNamespace(config=SimpleNamespace(model_type="mamba", state_size=16)))
    check_rollback_support(tiny_llama())  # no error
