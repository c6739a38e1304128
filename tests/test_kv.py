"""The slot KV cache and its two forwards (``specdecode.kv``): logits, ragged batches, trees, rollback.

Every forward is checked against the model's own Hugging Face forward without a cache, and the
rollback contract (DESIGN.md rule 8: each slot equals a fresh prefill of its ids) after every
kind of operation, on both the owned (Llama / Qwen2) and the Hugging Face forward.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from specdecode import tree
from specdecode.engine import EngineConfig, SpeculativeEngine
from specdecode.kernels import set_weight_precision, use_small_row_matmul
from specdecode.kv import (
    HFRunner,
    OwnedRunner,
    TreeAttentionUnsupported,
    UnsupportedCacheError,
    make_runner,
)
from specdecode.proposers import NgramProposer
from specdecode.proposers.suffix import SuffixProposer
from specdecode.types import PromptTooLongError, SpecDecodeError
from tiny import assert_cache_is_fresh_prefill, tiny_llama

BACKENDS = ["hf", "owned"]
TREE = [-1, -1, 0, 0, 1, 3]  # root -> {0, 1}; 0 -> {2, 3}; 1 -> {4}; 3 -> {5}


def tiny_qwen2(sliding: bool = False, dtype=torch.float64, seed: int = 3) -> Qwen2ForCausalLM:
    """A tiny Qwen2 (q/k/v biases); ``sliding`` gives it a sliding-window layer."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=256, use_sliding_window=sliding, sliding_window=8,
        max_window_layers=1,
    )
    return Qwen2ForCausalLM(cfg).eval().to(dtype)


MODELS = {"llama": lambda dtype=torch.float64: tiny_llama(vocab_size=64, seed=0, dtype=dtype),
          "qwen2": lambda dtype=torch.float64: tiny_qwen2(dtype=dtype)}


@torch.inference_mode()
def reference(model, ids: list[int]) -> torch.Tensor:
    """[n, V] logits of the model's own forward over ``ids`` (no cache)."""
    return model(input_ids=torch.tensor([ids])).logits[0]


def _close(got, want, atol=1e-6):
    """Runners return float32 logits: compare with a float64 reference at float32 resolution."""
    torch.testing.assert_close(got.double(), want.double(), atol=atol, rtol=1e-6)


# --------------------------------------------------------------------------- choosing a runner


def test_make_runner_picks_the_backend():
    llama = tiny_llama(seed=0)
    assert isinstance(make_runner(llama), OwnedRunner)
    assert isinstance(make_runner(llama, "hf"), HFRunner)
    assert isinstance(make_runner(llama, "owned", num_slots=3), OwnedRunner)
    torch.manual_seed(0)
    mistral = MistralForCausalLM(MistralConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=32,
                                               max_position_embeddings=64, sliding_window=None)).eval()
    assert isinstance(make_runner(mistral), HFRunner)  # auto: an unsupported family runs on Hugging Face
    with pytest.raises(SpecDecodeError, match="owned forward supports"):
        make_runner(mistral, "owned")
    with pytest.raises(SpecDecodeError, match="unknown forward backend"):
        make_runner(llama, "fast")
    with pytest.raises(SpecDecodeError, match="num_slots"):
        make_runner(llama, num_slots=0)


def tiny_mistral(window: int | None = 4) -> MistralForCausalLM:
    torch.manual_seed(0)
    cfg = MistralConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=32, max_position_embeddings=256, sliding_window=window)
    model = MistralForCausalLM(cfg).eval().to(torch.float64)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model


@pytest.mark.parametrize("kind", ["mistral", "qwen2-hybrid"])
def test_sliding_window_attention_runs_with_the_window_in_the_mask(kind):
    """A window shorter than the context: the slot cache keeps every entry and the mask applies the
    window, so chunks, rollback and trees equal the model's own (windowed) forward."""
    model = tiny_mistral(4) if kind == "mistral" else tiny_qwen2(sliding=True)
    runner = make_runner(model)
    assert isinstance(runner, HFRunner)
    row = runner.row(0)
    ids = [(5 * i + 1) % 30 for i in range(14)]
    ref = reference(model, ids)
    _close(torch.cat([row.forward(ids[:7]), row.forward(ids[7:8]), row.forward(ids[8:])]), ref, atol=1e-6)
    row.rollback(9)
    _close(row.forward([3, 4]), reference(model, ids[:9] + [3, 4])[-2:], atol=1e-6)
    row.rollback(10)
    prefix = list(row.cached_ids)
    logits = row.forward_tree([7, 8, 9], [-1, -1, 0])
    for i, path in enumerate([[7], [8], [7, 9]]):
        _close(logits[i], reference(model, prefix + path)[-1], atol=1e-6)
    row.keep_tree_path([0, 2])
    assert_cache_is_fresh_prefill(row, atol=1e-8)
    if kind == "mistral":  # the window matters here: a model without one gives other logits
        unwindowed = tiny_mistral(None)
        assert not torch.allclose(reference(unwindowed, ids), ref, atol=1e-3)


def test_sliding_window_model_through_the_engine_equals_its_greedy_decoding():
    model = tiny_mistral(4)
    prompt, ids = [1, 2, 3], [1, 2, 3]
    for _ in range(20):
        ids.append(int(reference(model, ids)[-1].argmax()))
    from specdecode.types import SamplingParams

    out = SpeculativeEngine(model, NgramProposer(), EngineConfig(num_speculative_tokens=3)).generate(
        prompt, SamplingParams(max_new_tokens=20))
    assert out.token_ids == ids[3:]


def test_recurrent_models_are_refused_before_any_generation():
    from transformers import MambaConfig, MambaForCausalLM

    mamba = MambaForCausalLM(MambaConfig(vocab_size=32, hidden_size=16, state_size=4, num_hidden_layers=1)).eval()
    for backend in ("auto", "hf"):
        with pytest.raises(UnsupportedCacheError, match="cannot be cut back"):
            make_runner(mamba, backend)
    with pytest.raises(UnsupportedCacheError, match="linear_attention"):
        SpeculativeEngine(mamba, NgramProposer())


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
        _close(row.forward(chunk), ref[at : at + len(chunk)])
        at += len(chunk)
    assert row.cached_ids == ids and row.num_cached == 9
    row.rollback(6)
    assert row.cached_ids == ids[:6]
    _close(row.forward([10, 11]), reference(model, ids[:6] + [10, 11])[6:])
    _close(row.forward([12], last_only=True), reference(model, ids[:6] + [10, 11, 12])[-1:])
    assert_cache_is_fresh_prefill(row)
    row.sync(ids[:6] + [10, 99])  # the longest agreeing prefix
    assert row.cached_ids == ids[:6] + [10]
    assert_cache_is_fresh_prefill(row)


@pytest.mark.parametrize("family", list(MODELS))
def test_owned_forward_matches_hugging_face_in_float32_across_cache_growth(family):
    model = MODELS[family](torch.float32)
    hf, owned = make_runner(model, "hf").row(0), make_runner(model, "owned").row(0)
    prefix = [(7 * i) % 60 + 1 for i in range(70)]  # past the first 64-column allocation
    for chunk in (prefix, [6], [7, 8, 9]):
        torch.testing.assert_close(owned.forward(chunk), hf.forward(chunk), atol=1e-5, rtol=1e-4)
    hf.rollback(71)
    owned.rollback(71)
    torch.testing.assert_close(owned.forward([10, 11]), hf.forward([10, 11]), atol=1e-5, rtol=1e-4)
    for (k1, v1), (k2, v2) in zip(owned.layer_tensors(), hf.layer_tensors()):
        torch.testing.assert_close(k1.float(), k2, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(v1.float(), v2, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", list(MODELS))
def test_owned_forward_runs_an_int8_model_like_the_hf_forward(family):
    model = set_weight_precision(MODELS[family](torch.float32), "int8")  # Qwen2: q/k/v biases inside the int8 modules
    hf, owned = make_runner(model, "hf").row(0), make_runner(model, "owned").row(0)  # owned fuses q/k/v (shared)
    for chunk in ([1, 2, 3, 4], [5], [6, 7]):
        torch.testing.assert_close(owned.forward(chunk), hf.forward(chunk), atol=1e-4, rtol=1e-4)


def test_owned_forward_in_bfloat16_matches_hf():
    model = tiny_llama(seed=0, dtype=torch.bfloat16)
    hf, owned = make_runner(model, "hf").row(0), make_runner(model, "owned").row(0)
    for chunk in ([1, 2, 3, 4], [5], [6, 7]):
        torch.testing.assert_close(owned.forward(chunk), hf.forward(chunk), atol=3e-2, rtol=3e-2)


def test_small_row_matmul_keeps_the_hf_forward():
    model = tiny_llama(seed=0, dtype=torch.float64)
    expected = make_runner(model, "hf").row(0).forward([1, 2, 3, 4])
    assert use_small_row_matmul(model) > 0
    assert use_small_row_matmul(model) == 0  # idempotent
    torch.testing.assert_close(make_runner(model, "hf").row(0).forward([1, 2, 3, 4]), expected)


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
        _close(out[i, : len(p)], reference(model, p))
    feeds = [[20], [21, 22, 23], [], [24, 25]]
    last = runner.forward(slice(0, 4), feeds, last_only=True)  # [4, 1, V]
    assert last.shape == (4, 1, 64)
    for i, (p, f) in enumerate(zip(prompts, feeds)):
        assert runner.ids[i] == p + f
        if f:
            _close(last[i, 0], reference(model, p + f)[-1])
        assert_cache_is_fresh_prefill(runner, i)
    sub = runner.forward(slice(1, 3), [[30], [31]])  # a slice that does not start at slot 0
    _close(sub[0, 0], reference(model, prompts[1] + feeds[1] + [30])[-1])
    _close(sub[1, 0], reference(model, prompts[2] + [31])[-1])
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
            _close(logits[r, i], reference(model, prefixes[r] + path)[-1])
    # the same tree fed level by level (as the draft builders do)
    row = make_runner(model, backend).row(0)
    row.forward(prefixes[0])
    parts = [row.forward_tree(tokens[:2], TREE[:2]), row.forward_tree(tokens[2:5], TREE[2:5]),
             row.forward_tree(tokens[5:], TREE[5:])]
    _close(torch.cat(parts), logits[0])


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
    _close(row.forward([7, 8]), reference(model, kept + [7, 8])[-2:])


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


@pytest.mark.parametrize("family", list(MODELS))
def test_owned_forward_scores_and_commits_trees_like_the_hf_forward(family):
    model = MODELS[family](torch.float32)
    prefix, tokens = [3, 4, 5, 6], [10, 11, 12, 13, 14, 15]
    hf, owned = make_runner(model, "hf").row(0), make_runner(model, "owned").row(0)
    hf.forward(prefix)
    owned.forward(prefix)
    ref = hf.forward_tree(tokens, TREE)
    got = torch.cat([owned.forward_tree(tokens[:2], TREE[:2]), owned.forward_tree(tokens[2:], TREE[2:])])
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)  # both return float32 logits
    hf.keep_tree_path([0, 3, 5])
    owned.keep_tree_path([0, 3, 5])
    assert owned.cached_ids == hf.cached_ids == prefix + [10, 13, 15]
    assert_cache_is_fresh_prefill(owned, atol=1e-6)
    for (ko, vo), (kh, vh) in zip(owned.layer_tensors(), hf.layer_tensors()):
        torch.testing.assert_close(ko, kh, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(owned.forward([7, 8]), hf.forward([7, 8]), atol=1e-5, rtol=1e-4)


class _NoPositions(torch.nn.Module):
    """A causal LM whose forward cannot take position ids."""

    def __init__(self, model):
        super().__init__()
        self.inner = model
        self.config = model.config

    def forward(self, input_ids, past_key_values=None, use_cache=True):
        return self.inner(input_ids=input_ids, past_key_values=past_key_values, use_cache=use_cache)

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()


def test_models_that_cannot_take_a_tree_mask_fail_clearly():
    with pytest.raises(TreeAttentionUnsupported, match="position_ids"):
        make_runner(_NoPositions(tiny_llama(vocab_size=64)), "hf")
    flash = tiny_llama(vocab_size=64)
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(TreeAttentionUnsupported, match="flash_attention_2"):
        # refused when the engine is built (the Hugging Face forward; the owned one always takes masks)
        SpeculativeEngine(flash, SuffixProposer(), EngineConfig(forward="hf"))
    make_runner(flash, "owned").check_tree_support()


# --------------------------------------------------------------------------- layer skipping


def test_forward_skipping_writes_only_past_the_committed_length():
    model = tiny_llama(seed=0, layers=4)
    runner = make_runner(model, "owned", num_slots=2)
    runner.forward(slice(0, 2), [[1, 2, 3, 4], [5, 6]])
    before = [[(k.clone(), v.clone()) for k, v in runner.layer_tensors(s)] for s in range(2)]
    everything = runner.forward_skipping(slice(0, 2), [[7, 8], [9]], [4, 2], range(4))  # nothing skipped
    _close(everything[0, :2], reference(model, [1, 2, 3, 4, 7, 8])[-2:])
    _close(everything[1, :1], reference(model, [5, 6, 9])[-1:])
    skipped = runner.forward_skipping(slice(0, 2), [[7], [9]], [4, 2], [0, 3], last_only=True)
    assert skipped.shape == (2, 1, 64) and not torch.allclose(skipped[0, 0], everything[0, 0].float())
    assert runner.ids == [[1, 2, 3, 4], [5, 6]]
    for s in range(2):
        for (k0, v0), (k1, v1) in zip(before[s], runner.layer_tensors(s)):
            assert torch.equal(k0, k1) and torch.equal(v0, v1)
    with pytest.raises(ValueError):
        runner.forward_skipping(slice(0, 1), [[7]], [3], [0])  # inside the committed cache
    hf = make_runner(model, "hf")
    hf.forward(slice(0, 1), [[1, 2]])
    with pytest.raises(SpecDecodeError, match="cannot skip layers"):
        hf.forward_skipping(slice(0, 1), [[3]], [2], [0])


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
