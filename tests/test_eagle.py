"""The feature-level draft head (EAGLE-3 style): drafting is lossless, training learns, checkpoints round-trip."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
import torch

from specdecode.eagle import corpus, train
from specdecode.eagle.head import EagleCheckpointError, EagleConfig, EagleHead, load_head, save_head
from specdecode.engine import EngineConfig, SpeculativeEngine
from specdecode.proposers.eagle import EagleDraftConfig, EagleProposer, find_head, make_eagle
from specdecode.proposers.factory import factory_from_spec
from specdecode.spec import DrafterSpec
from specdecode.types import SamplingParams, SpecDecodeError
from tiny import chi2_pvalue, exact_joint, tiny_llama, tiny_qwen2

TREES = ["none", "dynamic", "static"]


def random_head(target, vocab=None, seed=1, std=0.3, dtype=torch.float64) -> EagleHead:
    """A head with random weights for ``target`` (draft vocabulary ``vocab``: all ids by default)."""
    n = target.get_input_embeddings().weight.shape[0]
    torch.manual_seed(seed)
    head = EagleHead(EagleConfig.for_target(target, vocab if vocab is not None else list(range(n))))
    head.attach(target, init=True).to(dtype)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, std)
    return head.requires_grad_(False)


def generate(engine, prompt, params):
    return engine.generate(prompt, params)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=64, layers=3, scale=3.0)


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("backend", ["owned", "hf"])
def test_greedy_output_equals_plain_decoding(target, tree, backend):
    head = random_head(target)
    plain = SpeculativeEngine(target, None, EngineConfig(forward=backend))
    spec = SpeculativeEngine(target, EagleProposer(head, EagleDraftConfig(tree=tree)),
                             EngineConfig(num_speculative_tokens=4, forward=backend))
    for prompt in ([3, 5, 7, 9, 11], [1], list(range(20, 50))):
        params = SamplingParams(max_new_tokens=30)
        out = generate(spec, prompt, params)
        assert out.token_ids == generate(plain, prompt, params).token_ids
        assert out.metrics.num_drafted_tokens > 0


def test_qwen2_family_and_gamma_one():
    target = tiny_qwen2(vocab_size=64)
    head = random_head(target)
    plain = SpeculativeEngine(target, None, EngineConfig())
    for gamma in (1, 3):
        spec = SpeculativeEngine(target, EagleProposer(head), EngineConfig(num_speculative_tokens=gamma))
        params = SamplingParams(max_new_tokens=25)
        assert generate(spec, [4, 5, 6], params).token_ids == generate(plain, [4, 5, 6], params).token_ids


@pytest.mark.parametrize("tree", ["none", "dynamic"])
def test_batched_rows_with_compaction_equal_plain(target, tree):
    head = random_head(target)
    spec = SpeculativeEngine(target, EagleProposer(head, EagleDraftConfig(tree=tree)),
                             EngineConfig(num_speculative_tokens=3, max_batch_size=3))
    plain = SpeculativeEngine(target, None, EngineConfig())
    jobs = [([1, 2, 3], 8), ([9, 8, 7, 6], 30), ([5] * 12, 20)]
    reqs = [spec.add(p, SamplingParams(max_new_tokens=n))[0] for p, n in jobs]
    while spec.rows:
        spec.step()
    for req, (p, n) in zip(reqs, jobs):
        assert [*req.generated] == generate(plain, p, SamplingParams(max_new_tokens=n)).token_ids


def _trained_head(target, steps_epochs=30.0, seed=0):
    """Train a head on a tiny target's own greedy continuations (a few seconds)."""
    g = torch.Generator().manual_seed(seed)
    plain = SpeculativeEngine(target, None, EngineConfig())
    recs = []
    for i in range(40):
        prompt = torch.randint(0, 64, (8,), generator=g).tolist()
        recs.append({"id": str(i), "prompt_ids": prompt,
                     "response_ids": generate(plain, prompt, SamplingParams(max_new_tokens=40)).token_ids})
    layers = (1, 2, 3)
    data = corpus.extract_features(target, recs, layers, 64)
    data["feature_layers"] = layers
    loaded = types.SimpleNamespace(model=target, eos_token_ids=(), tokenizer=None)
    cfg = train.TrainConfig(draft_vocab_size=48, epochs=steps_epochs, batch_tokens=1024, lr=3e-3, ttt_steps=3,
                            save_every=10**9, held_out_fraction=0.1, warmup_steps=5)
    return data, loaded, cfg


@pytest.mark.parametrize("tree", ["none", "dynamic"])
def test_head_cache_equals_a_fresh_computation_from_the_target_features(target, tree):
    """After steps with rejections, compaction (a row leaving) and a row with speculation off, every row's head
    cache equals the head run afresh over the target's features of its committed tokens: the features the
    proposer kept are the right ones, at the right positions."""
    from specdecode.engine import RequestSpeculation

    head = random_head(target)
    proposer = EagleProposer(head, EagleDraftConfig(tree=tree))
    engine = SpeculativeEngine(target, proposer, EngineConfig(num_speculative_tokens=3, max_batch_size=3))
    engine.add([1, 2, 3], SamplingParams(max_new_tokens=4))  # leaves early: the rows behind it move up
    engine.add([9, 8, 7, 6], SamplingParams(max_new_tokens=60))
    engine.add([5] * 7, SamplingParams(max_new_tokens=60), speculation=RequestSpeculation(enabled=False))
    for _ in range(8):
        engine.step()
    assert len(engine.rows) == 2
    layers = head.config.feature_layers
    for req in engine.rows:
        ctx = req.ctx
        row = proposer.rows[ctx.slot]
        proposer._root(ctx, row)  # feed what the last verification committed
        ids = ctx.token_ids
        data = corpus.extract_features(target, [{"id": "x", "prompt_ids": ids[:-1], "response_ids": []}], layers, 512,
                                       dtype=torch.float64)
        kv = torch.zeros(head.config.num_kv_heads, 0, head.config.head_dim, dtype=torch.float64)
        out, k, v = head.step(head.fuse(data["features"].double()), torch.tensor(ids[1:]), torch.arange(len(ids) - 1),
                              kv, kv, None)
        assert row.n == len(ids) - 1
        assert torch.allclose(row.k, k, atol=1e-8) and torch.allclose(row.v, v, atol=1e-8)
        assert torch.allclose(row.root[1], out[-1], atol=1e-8)


def test_training_time_test_unroll_equals_chained_drafting_steps(target):
    """``EagleHead.unrolled`` step j at position t equals drafting j tokens past position t - j with the true
    tokens fed (what the head computes while drafting when its earlier guesses were right).

    A float64 head computes both in float64 (its norms and softmaxes too), so they agree to rounding, on any
    CPU and for any features: the tolerance is absolute (rtol 0; ``allclose``'s default rtol of 1e-5 once
    hid a float32 softmax in ``unrolled``, whose 1e-7 errors showed only where an output was near 0)."""
    head = random_head(target)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
    root = 5  # the exact entries are positions 0..5; drafting continues at 6, 7
    for seed in range(4):
        feats = torch.randn(1, 10, 3 * 64, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        outs = head.unrolled(feats, ids, 3)
        kv = torch.zeros(2, 0, 16, dtype=torch.float64)
        o, k, v = head.step(head.fuse(feats[0, : root + 1]), ids[0, : root + 1], torch.arange(root + 1), kv, kv, None)
        torch.testing.assert_close(o[-1], outs[0][0, root], rtol=0, atol=1e-10)
        hidden, keys, values = o[-1:], k, v
        for j in (1, 2):
            t = root + j
            o, k, v = head.step(hidden, ids[0, t : t + 1], torch.tensor([t]), keys, values, None)
            torch.testing.assert_close(o[0], outs[j][0, t], rtol=0, atol=1e-10)
            hidden, keys, values = o, torch.cat([keys, k], 1), torch.cat([values, v], 1)


def test_a_float64_head_keeps_its_norms_in_float64(target):
    """A float64 head's RMS norms do not round through float32 (a bf16 or float32 head still computes them in
    float32, as before)."""
    head = random_head(target)
    x = torch.randn(3, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ms = x.pow(2).mean(-1, keepdim=True)
    torch.testing.assert_close(head.hidden_norm(x), head.hidden_norm.weight * x / torch.sqrt(ms + head.config.rms_norm_eps),
                               rtol=0, atol=1e-13)
    half = random_head(target, dtype=torch.bfloat16)
    y = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    want = half.hidden_norm.weight.float() * (y.float() * torch.rsqrt(y.float().pow(2).mean(-1, keepdim=True)
                                                                       + half.config.rms_norm_eps))
    assert torch.equal(half.hidden_norm(y), want.bfloat16())


@pytest.mark.slow
def test_training_loss_falls_and_the_trained_head_drafts_what_the_target_says(tmp_path):
    target = tiny_llama(vocab_size=64, layers=3, scale=3.0, dtype=torch.float32)
    data, loaded, cfg = _trained_head(target)
    head, record = train.train_head(loaded, data, tmp_path, cfg, target_name="tiny", target_sha256=None)
    trained = {n: p.detach().clone() for n, p in head.named_parameters()}  # drafting may cast the head (bf16 CPUs)
    losses = [h["loss"] for h in record["history"]]
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5])
    assert record["validation_accuracy_per_step"][0] > 0.3  # a random head: ~1/64
    # what it learned shows while drafting: accepted tokens, and still exactly plain decoding
    spec = SpeculativeEngine(target, EagleProposer(head), EngineConfig(num_speculative_tokens=4))
    plain = SpeculativeEngine(target, None, EngineConfig())
    accepted = 0
    for prompt in ([1, 2, 3, 4, 5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46, 47]):
        out = generate(spec, prompt, SamplingParams(max_new_tokens=40))
        assert out.token_ids == generate(plain, prompt, SamplingParams(max_new_tokens=40)).token_ids
        accepted += out.metrics.num_accepted_tokens
    assert accepted > 10
    # EOS and the token cap inside an accepted block: the same cut as plain decoding
    full = generate(plain, [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_new_tokens=40)).token_ids
    for params in (SamplingParams(max_new_tokens=40, eos_token_ids=(full[9],)),
                   *(SamplingParams(max_new_tokens=n) for n in (1, 2, 5, 11))):
        got = generate(spec, [1, 2, 3, 4, 5, 6, 7, 8], params)
        assert got.token_ids == generate(plain, [1, 2, 3, 4, 5, 6, 7, 8], params).token_ids
    # the plot and a resumed run (the state file is reused: no step is redone)
    assert train.plot_training(record, tmp_path / "t.png").stat().st_size > 1000
    work = tmp_path / "resumed"
    work.mkdir()
    _, first = train.train_head(loaded, data, work, cfg, target_name="tiny", target_sha256=None, max_seconds=0.0)
    assert first["steps"] == 1 < first["total_steps"]
    again, rec = train.train_head(loaded, data, work, cfg, target_name="tiny", target_sha256=None)
    assert rec["steps"] == rec["total_steps"] and len(rec["history"]) == rec["total_steps"]
    for name, p in trained.items():  # interrupted and resumed = one uninterrupted run
        assert torch.allclose(p, dict(again.named_parameters())[name], atol=1e-6), name
    # a resumption with other settings is refused, not mixed in
    with pytest.raises(SpecDecodeError, match="other settings"):
        train.train_head(loaded, data, work, dataclasses.replace(cfg, lr=1e-2), target_name="tiny",
                         target_sha256=None)
    # trees from the trained head are lossless too
    tree = SpeculativeEngine(target, EagleProposer(head, EagleDraftConfig(tree="dynamic")),
                             EngineConfig(num_speculative_tokens=4))
    out = generate(tree, [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_new_tokens=40))
    assert out.token_ids == full and out.metrics.num_accepted_tokens > 5


@pytest.mark.parametrize("tree", ["none", pytest.param("dynamic", marks=pytest.mark.slow)])
def test_sampled_output_follows_the_target_distribution(tree):
    """First three sampled tokens (gamma 2) against the target's exact joint; the head's draft vocabulary
    leaves out tokens 2 and 4, which the target must still produce."""
    vocab = 5
    tgt = tiny_llama(vocab_size=vocab, seed=3, layers=2, hidden=32, scale=4.0)
    head = random_head(tgt, vocab=[0, 1, 3], std=0.2)
    # 2,000 seeded requests decoded 64 at a time (a request's tokens do not depend on the rest of the batch)
    engine = SpeculativeEngine(tgt, EagleProposer(head, EagleDraftConfig(tree=tree, num_nodes=6, top_k=2)),
                               EngineConfig(num_speculative_tokens=2, max_batch_size=64))
    prompt = [1, 2]
    counts = np.zeros(vocab**3)
    drafted = 0
    params = [SamplingParams(temperature=1.0, max_new_tokens=3, seed=s) for s in range(2000)]
    for out in engine.generate_batch([prompt] * 2000, params):
        counts[np.ravel_multi_index(out.token_ids, (vocab,) * 3)] += 1
        drafted += out.metrics.num_drafted_tokens
    assert drafted > 1000
    assert chi2_pvalue(counts, exact_joint(tgt, prompt, 3, backend="owned")) > 1e-3


def test_reduced_vocabulary_maps_back_and_outside_tokens_come_from_the_target(target):
    plain = SpeculativeEngine(target, None, EngineConfig())
    params = SamplingParams(max_new_tokens=30)
    expected = generate(plain, [3, 5, 7], params).token_ids
    vocab = [t for t in range(64) if t not in set(expected[::2])]  # half of what the target says is outside
    head = random_head(target, vocab=vocab)
    proposer = EagleProposer(head)
    spec = SpeculativeEngine(target, proposer, EngineConfig(num_speculative_tokens=4))
    out = generate(spec, [3, 5, 7], params)
    assert out.token_ids == expected
    # the head's q (what drafting samples from) is zero outside the draft vocabulary, and sums to 1 inside
    req, _ = spec.add([3, 5, 7], SamplingParams(temperature=1.0, max_new_tokens=8, seed=0))
    row = proposer.rows[req.ctx.slot]
    q = req.ctx.draft_dist(proposer._root(req.ctx, row), [])
    outside = sorted(set(range(64)) - set(vocab))
    assert float(q[outside].abs().max()) == 0.0 and abs(float(q[vocab].sum()) - 1.0) < 1e-5
    assert all(t in vocab for t in proposer.propose([req.ctx], [4])[0].token_ids[0].tolist())
    spec.abort(req)


def test_checkpoint_round_trip(target, tmp_path):
    head = random_head(target, dtype=torch.float32)
    save_head(head, tmp_path / "h", dtype=torch.float32)
    back = load_head(tmp_path / "h").attach(target)
    assert back.config == head.config
    for name, p in head.named_parameters():
        assert torch.equal(p, dict(back.named_parameters())[name])
    x = torch.randn(3, 3 * 64)
    ids = torch.tensor([1, 2, 3])
    kv = torch.zeros(2, 0, 16)
    a = head.step(head.fuse(x), ids, torch.arange(3), kv, kv, None)[0]
    b = back.step(back.fuse(x), ids, torch.arange(3), kv, kv, None)[0]
    assert torch.allclose(a, b)
    assert find_head(target, tmp_path / "h") == tmp_path / "h"


def test_bad_checkpoints_and_wrong_targets_are_refused(target, tmp_path):
    with pytest.raises(EagleCheckpointError, match="not a draft-head checkpoint"):
        load_head(tmp_path / "missing")
    with pytest.raises(EagleCheckpointError, match="train-drafter"):
        find_head(target, tmp_path / "missing")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"")
    with pytest.raises(EagleCheckpointError, match="malformed|format version"):
        load_head(tmp_path / "bad")
    head = random_head(target, dtype=torch.float32)
    save_head(head, tmp_path / "h")
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "config.json").write_text((tmp_path / "h" / "config.json").read_text())
    (tmp_path / "corrupt" / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(EagleCheckpointError, match="cannot be read"):
        load_head(tmp_path / "corrupt")
    other = tiny_llama(vocab_size=32, layers=3)
    with pytest.raises(EagleCheckpointError, match="vocabulary"):
        load_head(tmp_path / "h").attach(other)
    with pytest.raises(EagleCheckpointError, match="no draft head for this target"):
        find_head(other, None, cache_dir=tmp_path / "empty-cache")


def test_the_drafter_choice_builds_through_the_factory(target, tmp_path):
    save_head(random_head(target, dtype=torch.float32), tmp_path / "h")
    choice = DrafterSpec.from_settings({"draft": f"eagle:{tmp_path / 'h'}", "tree": "dynamic", "tree_nodes": 8})
    assert choice.kind == "eagle" and choice.head_path == str(tmp_path / "h")
    assert DrafterSpec.parse("EAGLE").kind == "eagle" and DrafterSpec.parse("eagle").head_path is None
    factory = factory_from_spec(choice.check(), target=target)
    proposer = factory()
    assert isinstance(proposer, EagleProposer) and proposer.produces_trees
    assert not make_eagle(target, EagleDraftConfig(head=str(tmp_path / "h"))).produces_trees
    with pytest.raises(SpecDecodeError):
        EagleDraftConfig(tree="bushy")
    with pytest.raises(SpecDecodeError, match="fallback"):
        factory_from_spec(DrafterSpec.from_settings({"draft": "suffix:eagle"}), target=target)


@pytest.mark.slow
@pytest.mark.shared_data
def test_training_prompts_do_not_overlap_the_held_out_set():
    prompts = train.corpus.training_prompts({"sharegpt": 60, "gsm8k": 300, "templates": 100, "stdlib": 60,
                                             "stdlib-code": 60})
    assert len(prompts) > 500 and {p.source for p in prompts} == set(corpus.SOURCES)
    assert corpus.held_out_overlap(prompts) == []
    # the check does catch a benchmark prompt
    from specdecode.data import load_prompts

    bench = load_prompts("spec-bench:math_reasoning:1")[0].turns[0]
    leak = [corpus.TrainPrompt("leak", "gsm8k", bench), corpus.TrainPrompt("leak2", "stdlib", "Please: " + bench)]
    assert [h[0] for h in corpus.held_out_overlap(leak)] == ["leak", "leak2"]


def test_draft_vocabulary_keeps_the_special_tokens_and_the_most_frequent():
    labels = torch.tensor([5, 5, 5, 7, 7, 9])
    tokens = torch.tensor([1, 2, 3])
    vocab = corpus.draft_vocabulary(labels, tokens, 3, 16, always=[0])
    assert vocab == [0, 5, 7]


def test_a_head_trained_in_another_precision_is_warned_about_once(capsys):
    """tune builds a proposer per candidate: the precision warning is one line per head and precision."""
    from types import SimpleNamespace

    from specdecode.proposers.eagle import _warn_precision

    head = SimpleNamespace(config=SimpleNamespace(training={"weights": "torch.bfloat16"}))
    model = SimpleNamespace(config=SimpleNamespace(specdecode_weights="int4"))
    for _ in range(3):
        _warn_precision(head, model)
    _warn_precision(head, SimpleNamespace(config=SimpleNamespace(specdecode_weights="bf16")))  # trained so
    err = capsys.readouterr().err
    assert err.count("trained on the target in bf16, and the target runs in int4") == 1 and err.count("\n") == 1
