"""The project's own Llama / Qwen2 forward (``specdecode.kv.owned``): what it supports, its logits and cache
against the Hugging Face forward (float32, int8, bfloat16, trees), and layer-skip forwards."""

from __future__ import annotations

import pytest
import torch

from specdecode.lowbit import set_weight_precision
from specdecode.kv import make_runner
from specdecode.kv.owned import OwnedRunner, supports
from specdecode.types import SpecDecodeError
from tiny import assert_cache_is_fresh_prefill, close, reference, tiny_llama, tiny_mistral, tiny_qwen2

TREE = [-1, -1, 0, 0, 1, 3]  # root -> {0, 1}; 0 -> {2, 3}; 1 -> {4}; 3 -> {5}
MODELS = {"llama": lambda dtype=torch.float64: tiny_llama(vocab_size=64, seed=0, dtype=dtype),
          "qwen2": lambda dtype=torch.float64: tiny_qwen2(seed=3, layers=2, scale=1.0, dtype=dtype)}


def test_supported_models():
    assert supports(tiny_llama()) and supports(tiny_qwen2(seed=3, layers=2))
    assert supports(set_weight_precision(tiny_llama(dtype=torch.float32), "int8"))
    assert not supports(tiny_mistral(None))  # another family
    assert not supports(tiny_qwen2(seed=3, layers=2, sliding=True))  # sliding-window layers
    biased = tiny_llama()
    biased.config.attention_bias = True
    assert not supports(biased)
    scaled = tiny_llama()
    scaled.config.rope_parameters = {"rope_type": "linear", "factor": 2.0}
    assert not supports(scaled)
    assert not supports(torch.nn.Linear(2, 2))


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
    for chunk in ([1, 2, 3, 4], [5], [6, 7]):  # the owned forward keeps keys / values in float16
        got, want = owned.forward(chunk), hf.forward(chunk)
        assert (got - want).abs().max() < 0.02 * want.abs().max()
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_owned_forward_in_bfloat16_matches_hf():
    model = tiny_llama(seed=0, dtype=torch.bfloat16)
    hf, owned = make_runner(model, "hf").row(0), make_runner(model, "owned").row(0)
    for chunk in ([1, 2, 3, 4], [5], [6, 7]):
        torch.testing.assert_close(owned.forward(chunk), hf.forward(chunk), atol=3e-2, rtol=3e-2)


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


def test_forward_skipping_writes_only_past_the_committed_length():
    model = tiny_llama(seed=0, layers=4)
    runner = make_runner(model, "owned", num_slots=2)
    runner.forward(slice(0, 2), [[1, 2, 3, 4], [5, 6]])
    before = [[(k.clone(), v.clone()) for k, v in runner.layer_tensors(s)] for s in range(2)]
    everything = runner.forward_skipping(slice(0, 2), [[7, 8], [9]], [4, 2], range(4))  # nothing skipped
    close(everything[0, :2], reference(model, [1, 2, 3, 4, 7, 8])[-2:])
    close(everything[1, :1], reference(model, [5, 6, 9])[-1:])
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



# ----------------------------------------------------------------------------- the batch-invariance contract
# A token's logits are bitwise equal whether it is verified alone or among k + 1 tokens, in one row or a batch,
# in a chain or a token tree: then speculative output equals plain decoding token for token.

#: How each contract test builds its runner: weights, and the product kernel ("measured": what this CPU measured).
INVARIANT_CONFIGS = {
    "bf16": (torch.bfloat16, "padded"),
    "fp32-invariant": (torch.float32, "padded"),  # float32 opted in: plain float32 F.linear is not invariant here
    "int8": ("int8", None),
}
CONTRACT_KS = (*range(1, 9), 16, 17)  # 17 and 18 tokens: past one ROW_BLOCK
CONTRACT_PREFIX = 20


def _invariant_runner(family: str, config: str, slots: int = 1):
    from specdecode.kv.owned import OwnedRunner

    weights, kernel = INVARIANT_CONFIGS[config]
    if weights == "int8":
        model = set_weight_precision(MODELS[family](torch.float32), "int8")
    else:
        model = MODELS[family](weights)
    runner = OwnedRunner(model, slots, batch_invariant=True)
    # low-bit: float16 keys / values (attention row by row in C); float weights: a float64 cache
    assert runner.batch_invariant and runner.cache_dtype == (torch.float16 if runner.lowbit else torch.float64)
    # int8 modules: integer sums, row-invariant by construction; float weights: zero-padded 16-row blocks
    assert runner.row_kernel == kernel
    return runner


def _first_difference(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None when ``got`` and ``want`` ([n, V] logits) are bitwise equal; else where and by how much they differ."""
    assert got.shape == want.shape, (got.shape, want.shape)
    if torch.equal(got, want):
        return None
    diff = (got.double() - want.double()).abs().amax(-1)  # [n]
    row = int((diff != 0).nonzero()[0]) if bool((diff != 0).any()) else -1  # -1: NaN somewhere
    return f"token {row} of {got.shape[0]} differs by {float(diff[row]):.3g}"


def _random_ids(n: int, seed: int, vocab: int = 64) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _chain_differences(row, feed: list[int], ks=CONTRACT_KS) -> dict[int, str]:
    """For each k: feed[:k + 1] in one forward against the same tokens fed one by one (after the row's cache)."""
    base = row.num_cached
    alone = torch.stack([row.forward([t])[0] for t in feed])  # [len(feed), V]
    row.rollback(base)
    found = {}
    for k in ks:
        diff = _first_difference(row.forward(feed[: k + 1]), alone[: k + 1])
        row.rollback(base)
        if diff is not None:
            found[k] = diff
    return found


@pytest.mark.parametrize("config", list(INVARIANT_CONFIGS))
@pytest.mark.parametrize("family", list(MODELS))
def test_k_plus_1_tokens_in_one_forward_equal_them_fed_one_by_one_bitwise(family, config):
    row = _invariant_runner(family, config).row(0)
    row.forward(_random_ids(CONTRACT_PREFIX, 0), last_only=True)  # a prompt prefill (fast kernels)
    assert _chain_differences(row, _random_ids(max(CONTRACT_KS) + 1, 1)) == {}
    # a longer context, past the first cache allocation (64 columns)
    row.forward(_random_ids(50, 2))
    assert _chain_differences(row, _random_ids(10, 3), ks=(1, 4, 9)) == {}




@pytest.mark.parametrize("config", list(INVARIANT_CONFIGS))
@pytest.mark.parametrize("family", list(MODELS))
def test_the_contract_holds_over_many_contexts(family, config):
    """Differences are rare (a few outputs in 10^4): 32 random contexts (5..222 tokens), each verified as one
    block of 17 tokens and as 18 (past a block), against the same tokens fed one by one."""
    row = _invariant_runner(family, config).row(0)
    found = {}
    for seed in range(32):
        row.reset()
        row.forward(_random_ids(5 + 7 * seed, 100 + seed), last_only=True)
        for k, diff in _chain_differences(row, _random_ids(18, 200 + seed), ks=(16, 17)).items():
            found[(5 + 7 * seed, k)] = diff
    assert found == {}, f"(context, k): difference: {found}"


@pytest.mark.parametrize("config", list(INVARIANT_CONFIGS))
@pytest.mark.parametrize("family", list(MODELS))
def test_rows_verified_together_equal_each_row_verified_alone_bitwise(family, config):
    runner = _invariant_runner(family, config, slots=2)
    prompts = [_random_ids(CONTRACT_PREFIX, 4), _random_ids(13, 5)]  # ragged: different cached lengths
    for slot, prompt in enumerate(prompts):
        runner.forward(slice(slot, slot + 1), [prompt], last_only=True)
    for n0, n1 in ((1, 1), (5, 5), (9, 3), (2, 17), (18, 18)):  # equal and ragged feeds (padding rows)
        feeds = [_random_ids(n0, 10 + n0), _random_ids(n1, 20 + n1)]
        both = runner.forward(slice(0, 2), feeds)
        for slot in range(2):
            runner.rollback(slot, len(prompts[slot]))
        for slot, n in ((0, n0), (1, n1)):
            alone = runner.forward(slice(slot, slot + 1), [feeds[slot]])[0]
            runner.rollback(slot, len(prompts[slot]))
            assert _first_difference(both[slot, :n], alone) is None, (n0, n1, slot)


def _tree_paths(parents: list[int]) -> list[list[int]]:
    """Every root-to-leaf path of a parent list (node indices)."""
    leaves = [i for i in range(len(parents)) if i not in parents]
    paths = []
    for leaf in leaves:
        path = [leaf]
        while parents[path[-1]] != -1:
            path.append(parents[path[-1]])
        paths.append(path[::-1])
    return paths


@pytest.mark.parametrize("config", list(INVARIANT_CONFIGS))
@pytest.mark.parametrize("family", list(MODELS))
def test_a_token_tree_scores_each_path_like_the_chain_bitwise(family, config):
    runner = _invariant_runner(family, config, slots=2)
    row = runner.row(0)
    prefix, tokens = _random_ids(CONTRACT_PREFIX, 6), [10, 11, 12, 13, 14, 15]
    row.forward(prefix, last_only=True)
    tree = row.forward_tree(tokens, TREE)  # [6, V]
    paths = _tree_paths(TREE)
    assert sorted(map(tuple, paths)) == [(0, 2), (0, 3, 5), (1, 4)]
    for path in paths:  # each node's logits are those of plain decoding along its path (one token a forward)
        row.rollback(len(prefix))  # drops the pending tree
        chain = torch.stack([row.forward([tokens[i]])[0] for i in path])
        assert _first_difference(tree[path], chain) is None, path
    # level by level (as tree drafters add nodes) equals the whole tree in one call
    row.rollback(len(prefix))
    levels = torch.cat([row.forward_tree(tokens[:2], TREE[:2]), row.forward_tree(tokens[2:], TREE[2:])])
    assert _first_difference(levels, tree) is None
    # keeping a path leaves the cache a chain would: the next token's logits are the chain's
    row.keep_tree_path([0, 3, 5])
    after_tree = row.forward([7, 8])
    row.rollback(len(prefix))
    for t in (10, 13, 15, 7):
        row.forward([t])
    after_chain = torch.stack([row.forward([8])[0]])
    assert _first_difference(after_tree[1:], after_chain) is None
    # two rows of trees in one forward equal each row's tree alone
    runner.rollback(0, len(prefix))
    other = _random_ids(9, 7)
    runner.forward(slice(1, 2), [other], last_only=True)
    parents2 = [-1, 0, 0, 1]
    both = runner.forward_tree(slice(0, 2), [tokens, [3, 4, 5, 6]], [TREE, parents2])
    runner.rollback(1, len(other))
    second = runner.row(1).forward_tree([3, 4, 5, 6], parents2)
    assert _first_difference(both[0], tree) is None
    assert _first_difference(both[1, :4], second) is None


def test_the_contract_comparison_detects_a_forward_that_is_not_batch_invariant():
    """A contract test that cannot fail is worthless: the same comparison, on the forward without the
    invariant kernels (bf16 ``F.linear`` and bf16 attention; float32 few-row products), finds differences
    on this CPU, or at least catches a 1-ulp change injected into one logit."""
    from specdecode.kv.owned import OwnedRunner

    found = {}
    for name, make in (("llama bf16", lambda: MODELS["llama"](torch.bfloat16)),
                       ("qwen2 bf16", lambda: MODELS["qwen2"](torch.bfloat16)),
                       ("llama fp32", lambda: MODELS["llama"](torch.float32))):
        runner = OwnedRunner(make(), 1, batch_invariant=False)
        assert runner.row_kernel is None and runner.cache_dtype != torch.float64
        row = runner.row(0)
        row.forward(_random_ids(CONTRACT_PREFIX, 0), last_only=True)
        found.update({(name, k): d for k, d in _chain_differences(row, _random_ids(max(CONTRACT_KS) + 1, 1)).items()})
    print("differences without the invariant forward:", found or "none on this CPU")
    # the comparison itself sees one ulp in one logit of one token
    row = _invariant_runner("llama", "bf16").row(0)
    row.forward(_random_ids(CONTRACT_PREFIX, 0), last_only=True)
    logits = row.forward(_random_ids(5, 1))
    nudged = logits.clone()
    nudged[3, 17] = torch.nextafter(nudged[3, 17], torch.tensor(float("inf")))
    assert _first_difference(logits.clone(), logits) is None
    assert _first_difference(nudged, logits) == f"token 3 of 5 differs by {float(nudged[3, 17] - logits[3, 17]):.3g}"


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8", "int4"])
def test_the_c_plus_plus_layer_loop_equals_the_python_loop_bit_for_bit(monkeypatch, precision):
    """Float weights: csrc/step.cpp's ``run`` runs the same ATen operations as OwnedRunner._run's loop: one
    row, a verification, a ragged batch of two rows and a prompt-sized prefill give the same bits either
    way. Low-bit weights: ``run_fused`` is its own arithmetic (8-bit activations, float16 cache, C
    attention) and the Python loop the fallback without a compiler: the same model up to rounding."""
    model = set_weight_precision(tiny_llama(seed=0, dtype=torch.float32, hidden=64), precision)

    def run(native: str):
        monkeypatch.setenv("SPECDECODE_NATIVE_STEP", native)
        r = OwnedRunner(model, 2, 256)
        out = [r.forward(slice(0, 1), [[1, 2, 3, 4, 5]], last_only=True), r.forward(slice(0, 1), [[7]]),
               r.forward(slice(0, 1), [[8, 9, 10]]), r.forward(slice(0, 2), [[11, 12], [3, 4, 5]]),
               r.forward(slice(0, 2), [list(range(20, 60)), [6]], last_only=True)]
        return out, r._native_stack() is not None

    fast, used = run("1")
    slow, unused = run("0")
    if not used:
        pytest.skip("the C++ extension is not available here (the Python loop runs)")
    assert not unused
    for a, b in zip(fast, slow):
        if precision in ("int8", "int4"):
            assert (a - b).abs().max() < 0.02 * b.abs().max() and torch.equal(a.argmax(-1), b.argmax(-1))
        else:
            assert torch.equal(a, b)


@pytest.mark.parametrize("family", ["llama-q4_1", "qwen2-bias", "mixed-gguf"])
def test_the_fused_layer_loop_gives_the_same_bits_at_any_thread_count(family):
    """``run_fused`` runs the whole forward in one parallel region (rows, tiles and queries split over the
    threads, spin barriers between phases): 1-4 threads, each twice, give the same logits and captured features
    for one row, a verification, a ragged batch of two rows (fewer rows than threads, and more), a token tree, a
    layer-skipping draft and a prompt; q / k / v biases (qwen2) and products mixing K-quant and 32-weight blocks
    (mixed-gguf: both activation layouts in one fused product) included."""
    from tiny import tiny_gguf_llama

    make = {"llama-q4_1": lambda: set_weight_precision(tiny_llama(seed=0, dtype=torch.float32, hidden=256), "int4"),
            "qwen2-bias": lambda: set_weight_precision(tiny_qwen2(seed=0, dtype=torch.float32), "int4"),
            "mixed-gguf": lambda: tiny_gguf_llama()[0]}
    model = make[family]()

    def run(threads: int):
        torch.set_num_threads(threads)
        r = OwnedRunner(model, 2, 256)
        if r._native_stack() is None:
            pytest.skip("the C++ extension is not available here (the Python loop runs)")
        r.capture_layers = (0, 1, r.num_layers)
        out = []
        for rows, feed, last in ((slice(0, 1), [[1, 2, 3, 4, 5]], True), (slice(0, 1), [[7]], False),
                                 (slice(0, 1), [[8, 9, 10, 11, 12]], False),
                                 (slice(0, 2), [[13, 14], [3, 4, 5]], False), (slice(1, 2), [[9]], False)):
            out += [r.forward(rows, feed, last_only=last), r.last_features.clone()]
        out += [r.forward_tree(slice(0, 1), [[4, 5, 6, 7]], [[-1, 0, 0, 1]]), r.last_features.clone()]
        r.keep_tree_path(0, [0, 1, 3])
        out.append(r.forward_skipping(slice(0, 1), [[2, 3]], [len(r.ids[0])], [0]))
        out += [r.forward(slice(0, 2), [list(range(20, 45)), [6]], last_only=True), r.last_features.clone()]
        return out

    before = torch.get_num_threads()
    try:
        want = run(1)
        for threads in (2, 3, 4, 2, 3, 4):
            got = run(threads)
            bad = [i for i, (a, b) in enumerate(zip(got, want)) if not torch.equal(a, b)]
            assert not bad, f"{threads} threads differ from 1 at outputs {bad}"
    finally:
        torch.set_num_threads(before)


def test_the_output_layer_inside_the_fused_region_matches_the_python_head(monkeypatch):
    """Decoding and verification run the final norm and the output layer inside ``run_fused``'s region: the same
    logits as the Python norm and product up to the norm's float order (the same next tokens), the same bits
    alone as among other rows, and a reduced draft vocabulary (:meth:`limit_vocabulary`) handed to it."""
    from tiny import tiny_gguf_llama

    model = tiny_gguf_llama()[0]
    fused = OwnedRunner(model, 1, 128)
    if fused._native_stack() is None:
        pytest.skip("the C++ extension is not available here (the Python loop runs)")
    python = OwnedRunner(model, 1, 128)
    monkeypatch.setattr(python, "_native_head_ready", lambda native: False)
    for r in (fused, python):
        r.forward(slice(0, 1), [[1, 2, 3, 4, 5]], last_only=True)
    got = fused.forward(slice(0, 1), [[7, 8, 9]])
    want = python.forward(slice(0, 1), [[7, 8, 9]])
    assert fused._native_head_ok and fused._native_head[1] is fused.lm_head
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4) and torch.equal(got.argmax(-1), want.argmax(-1))
    for r in (fused, python):
        r.rollback(0, 5)
    alone = [fused.forward(slice(0, 1), [[t]]) for t in (7, 8, 9)]
    assert torch.equal(torch.cat(alone, dim=1), got)  # a verification's rows carry the bits of one-token steps
    for tokens in (40, 37):  # whole tiles of 8 columns (the packed head sliced), a cut tile (repacked)
        fused.rollback(0, 5)
        fused.limit_vocabulary(tokens)
        small = fused.forward(slice(0, 1), [[7, 8, 9]])
        assert fused._native_head_ok and fused._native_head[1] is fused.lm_head
        assert fused.lm_head.out_features == tokens and small.shape == got.shape
        assert torch.equal(small[..., :tokens], got[..., :tokens])


def test_a_long_prompt_fed_in_pieces_gives_the_bits_of_one_piece():
    """``prefill_chunk``: a low-bit prompt longer than the chunk runs the exact kernel piece by piece, row by
    row: the same last logits and the same cache (the next step's logits) as fed whole, in a batch of
    ragged rows too."""
    from specdecode.lowbit import set_weight_precision

    model = set_weight_precision(tiny_llama(seed=0, dtype=torch.float32, hidden=256), "int4")
    whole, pieces = (make_runner(model, "owned", num_slots=2) for _ in range(2))
    for runner in (whole, pieces):
        runner.prefill_rows = 10_000  # the kernel for every prompt (as real models, up to 512 tokens)
    pieces.prefill_chunk = 7
    feeds = [[(5 * i + 3) % 60 for i in range(30)], [(7 * i + 1) % 60 for i in range(12)]]
    want = whole.forward(slice(0, 2), feeds, last_only=True)
    got = pieces.forward(slice(0, 2), feeds, last_only=True)
    assert torch.equal(got, want) and [len(pieces.ids[s]) for s in (0, 1)] == [30, 12]
    step = [[4], [9]]
    assert torch.equal(pieces.forward(slice(0, 2), step), whole.forward(slice(0, 2), step))


def test_pieces_at_the_real_setting_and_all_or_nothing():
    """``prefill_chunk`` equal to ``prefill_rows`` (what real models run): a batch of a long row, one an exact
    multiple of the chunk and an empty one gives the bits of the rows fed alone; a feed past the context
    raises and leaves no row with the pieces it got."""
    from specdecode.types import PromptTooLongError

    model = set_weight_precision(tiny_llama(seed=0, dtype=torch.float32, hidden=256, max_positions=64), "int4")
    alone, pieces = make_runner(model, "owned", num_slots=3), make_runner(model, "owned", num_slots=3)
    alone.prefill_rows, alone.prefill_chunk = 10_000, None
    pieces.prefill_rows = pieces.prefill_chunk = 7
    feeds = [[(5 * i + 3) % 60 for i in range(30)], [(7 * i + 1) % 60 for i in range(14)], []]
    got = pieces.forward(slice(0, 3), feeds, last_only=True)
    for i in (0, 1):
        assert torch.equal(got[i], alone.forward(slice(i, i + 1), [feeds[i]], last_only=True)[0])
    with pytest.raises(PromptTooLongError):
        pieces.forward(slice(0, 2), [[1] * 20, [2] * 60], last_only=True)
    assert [len(pieces.ids[s]) for s in range(3)] == [30, 14, 0]
