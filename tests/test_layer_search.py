"""The layer-skip search (``specdecode.layer_search``): the skipping forward, the one-pass proxy, a search on
tiny models with tiny budgets, and the per-model cache file."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache

from specdecode import layer_search
from specdecode.engine import SpeculativeEngine
from specdecode.layer_search import (
    CACHE_FILE,
    SearchConfig,
    SearchResult,
    cache_path,
    choose_skip_layers,
    load_cached,
    model_key,
    search_skip_layers,
    store,
)
from specdecode.skip_forward import ProxyScorer, SkipForward, remove_last
from specdecode.proposers import LayerSkipConfig, LayerSkipProposer
from specdecode.types import SamplingParams
from tiny import tiny_llama, tiny_qwen2


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=64, seed=0, layers=4, scale=3.0)


def _result(skip=(1, 2), layers=4, **kw) -> SearchResult:
    return SearchResult(skip_layers=skip, gamma=3, tokens_per_s=10.0, plain_tokens_per_s=8.0, acceptance=0.5,
                        num_layers=layers, **kw)


# --------------------------------------------------------------------------- the skipping forward


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_forward_with_nothing_skipped_matches_the_model(target, family):
    model = target if family == "llama" else tiny_qwen2()
    skip = SkipForward(model)
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    with torch.inference_mode():
        expected = model(input_ids=ids.reshape(1, -1)).logits[0]
        torch.testing.assert_close(skip.forward(ids, 0, range(skip.num_layers)), expected.float())
        cache = DynamicCache(config=model.config)  # incremental, on a cache: prefill 5 then one token at a time
        model(input_ids=ids[:5].reshape(1, -1), cache=cache, use_cache=True)
        for j in range(5, 8):
            out = skip.forward(ids[j : j + 1], j, range(skip.num_layers), cache)
            torch.testing.assert_close(out[0], expected[j].float())


def test_skipping_layers_changes_the_logits_and_remove_last_undoes_cache_entries(target):
    skip = SkipForward(target)
    ids = torch.tensor([3, 1, 4, 1, 5])
    with torch.inference_mode():
        full = skip.forward(ids, 0, range(4))
        kept = skip.forward(ids, 0, [0, 3])
        assert kept.shape == full.shape == (5, 64) and kept.dtype == torch.float32
        assert not torch.allclose(kept, full, atol=1e-3)
        assert torch.equal(skip.forward(ids, 0, [0, 3], last_only=True), kept[-1:])
        cache = DynamicCache(config=target.config)
        target(input_ids=ids[:4].reshape(1, -1), cache=cache, use_cache=True)
        skip.forward(ids[4:], 4, [0, 3], cache)
        assert [cache.get_seq_length(i) for i in range(4)] == [5, 4, 4, 5]  # only the kept layers grew
        remove_last(cache, [0, 3], 1)
        assert [cache.get_seq_length(i) for i in range(4)] == [4] * 4
        remove_last(cache, [0, 3], 0)  # nothing to remove
        assert cache.get_seq_length(0) == 4


# --------------------------------------------------------------------------- the proxy and the search


def test_search_proxy_scores_the_first_draft_token_exactly(target):
    """The one-pass proxy equals drafting one token from each position on a cache of the tokens before it."""
    context = [(5 * i + 3) % 64 for i in range(40)]
    skip = SkipForward(target)
    scorer = ProxyScorer(skip, [context], [20], max_gamma=4)
    kept = [0, 3]
    with torch.inference_mode():
        hits = 0
        rows = range(1, len(context) - 1)  # prompt of 20 tokens: scoring starts at max(1, 20 - 32)
        for j in rows:
            full = target(input_ids=torch.tensor([context[: j + 1]])).logits[0, -1].argmax()
            cache = DynamicCache(config=target.config)
            target(input_ids=torch.tensor([context[:j]]), cache=cache, use_cache=True)
            draft = skip.forward(torch.tensor([context[j]]), j, kept, cache)[-1].argmax()
            hits += int(draft == full)
    assert scorer.acceptance(kept) == pytest.approx(hits / len(rows))
    assert scorer.acceptance(list(range(4))) == 1.0  # nothing skipped: the draft is the target
    prefix = scorer.items[0][0]
    assert [prefix.cache.get_seq_length(i) for i in range(4)] == [40] * 4  # scoring left no entries


def test_search_finds_a_valid_set_and_caches_it(tmp_path, monkeypatch):
    monkeypatch.setattr(layer_search, "_measure", _timed(1e9))  # a set that wins (a losing one is not cached)
    model = tiny_llama(vocab_size=64, seed=0, layers=6, scale=3.0)
    config = SearchConfig(new_tokens=8, proxy_evaluations=10, measured_candidates=2, time_budget_s=60)
    result = choose_skip_layers(model, [[1, 2, 3, 4, 5, 6]], config, cache_dir=tmp_path)
    assert result.skip_layers and all(1 <= i <= 4 for i in result.skip_layers)  # ends protected
    assert result.tokens_per_s > 0 and result.plain_tokens_per_s > 0 and not result.from_cache
    assert sum(c["tokens_per_s"] is not None for c in result.candidates) >= 1
    data = json.loads((tmp_path / "layer_skip.json").read_text())
    assert data["models"][result.key]["skip_layers"] == list(result.skip_layers)

    def no_search(*a, **k):
        raise AssertionError("searched again")

    monkeypatch.setattr(layer_search, "search_skip_layers", no_search)
    again = choose_skip_layers(model, [[9, 9]], config, cache_dir=tmp_path)
    assert again.from_cache and again.skip_layers == result.skip_layers
    # the auto mode of the proposer uses the cached set, and stays lossless
    auto = LayerSkipProposer(model, LayerSkipConfig(cache_dir=str(tmp_path)), searcher=layer_search)
    out = SpeculativeEngine(model, auto).generate([1, 2, 3], SamplingParams(max_new_tokens=20))
    assert auto.skip_layers == result.skip_layers
    assert out.token_ids == SpeculativeEngine(model, None).generate([1, 2, 3], SamplingParams(
        max_new_tokens=20)).token_ids
    # another model has its own entry
    assert load_cached(tiny_llama(vocab_size=64, seed=5, layers=6), tmp_path) is None


def test_a_search_on_a_tiny_model_with_a_tiny_budget_still_measures_one_candidate(target):
    config = SearchConfig(new_tokens=6, proxy_evaluations=4, measured_candidates=2, time_budget_s=0.01)
    result = search_skip_layers(target, [[5, 6, 7, 8, 9]], config)
    assert result.skip_layers and set(result.skip_layers) <= {1, 2}  # layers 0 and 3 protected
    assert result.num_layers == 4 and result.key == model_key(target) and not result.from_cache
    assert result.tokens_per_s > 0 and result.plain_tokens_per_s > 0 and result.speedup is not None
    assert 1 <= result.gamma <= config.max_gamma and 0.0 <= result.acceptance <= 0.999
    assert len(result.candidates) >= 1
    for c in result.candidates:
        assert set(c["skip_layers"]) <= {1, 2} and len(c["skip_layers"]) < 4
    measured = [c for c in result.candidates if c["tokens_per_s"] is not None]
    assert measured and max(c["tokens_per_s"] for c in measured) == result.tokens_per_s
    ranks = [c["predicted_speedup"] for c in result.candidates]
    assert ranks == sorted(ranks, reverse=True)


def test_a_search_needs_a_prompt(target):
    with pytest.raises(ValueError, match="non-empty calibration prompt"):
        search_skip_layers(target, [[], []], SearchConfig(time_budget_s=0.01))


# --------------------------------------------------------------------------- the cache file


def test_model_key_names_the_weights():
    a, same = tiny_llama(seed=0, layers=4), tiny_llama(seed=0, layers=4)
    assert model_key(a) == model_key(same)
    assert model_key(a) != model_key(tiny_llama(seed=1, layers=4))  # other weights
    assert "|L4|" in model_key(a) and "|L3|" in model_key(tiny_llama(seed=0, layers=3))
    assert "|float64|" in model_key(a) and "|float32|" in model_key(tiny_llama(seed=0, layers=4, dtype=torch.float32))
    same.config.specdecode_weights = "int8"  # int8 execution of the same weights runs at other speeds
    assert "|int8|" in model_key(same) and model_key(same) != model_key(a)


def test_cache_path_defaults_to_the_model_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(layer_search, "default_cache_dir", lambda: tmp_path / "models")
    assert cache_path() == tmp_path / "models" / CACHE_FILE
    assert cache_path(tmp_path / "x") == tmp_path / "x" / CACHE_FILE


def test_store_and_load_round_trip_keeping_other_models(tmp_path):
    a, b = tiny_llama(seed=0, layers=4), tiny_llama(seed=3, layers=5)
    assert load_cached(a, tmp_path) is None  # no file yet
    path = store(a, _result((1, 2), 4, candidates=[{"skip_layers": [1, 2]}], seconds=1.5), tmp_path)
    store(b, _result((2,), 5), tmp_path)
    assert path == tmp_path / CACHE_FILE and not list(tmp_path.glob(".layer_skip.*"))  # no temporary left
    data = json.loads(path.read_text())
    assert data["format"] == layer_search.CACHE_FORMAT and set(data["models"]) == {model_key(a), model_key(b)}
    assert "from_cache" not in data["models"][model_key(a)] and data["models"][model_key(a)]["created"]
    got = load_cached(a, tmp_path)
    assert got.from_cache and got.skip_layers == (1, 2) and isinstance(got.skip_layers, tuple)
    assert (got.gamma, got.tokens_per_s, got.plain_tokens_per_s, got.seconds) == (3, 10.0, 8.0, 1.5)
    assert got.key == model_key(a) and got.candidates == [{"skip_layers": [1, 2]}]
    assert load_cached(b, tmp_path).skip_layers == (2,)
    store(a, _result((2,), 4), tmp_path)  # a new choice replaces the old one
    assert load_cached(a, tmp_path).skip_layers == (2,) and load_cached(b, tmp_path).skip_layers == (2,)


def test_unusable_cache_files_read_as_no_entry(tmp_path):
    model = tiny_llama(seed=0, layers=4)
    path = tmp_path / CACHE_FILE
    path.write_text("{not json")
    assert load_cached(model, tmp_path) is None
    store(model, _result(), tmp_path)  # an unreadable file is replaced
    assert load_cached(model, tmp_path).skip_layers == (1, 2)
    data = json.loads(path.read_text())
    data["models"][model_key(model)]["num_layers"] = 6  # an entry for another layer count
    path.write_text(json.dumps(data))
    assert load_cached(model, tmp_path) is None
    path.write_text(json.dumps({"format": 99, "models": {model_key(model): {"bogus": 1}}}))
    assert load_cached(model, tmp_path) is None
    store(model, _result((1,)), tmp_path)  # another format: started afresh
    assert json.loads(path.read_text())["format"] == layer_search.CACHE_FORMAT
    assert load_cached(model, tmp_path).skip_layers == (1,)


def test_choose_uses_the_cache_unless_refreshed_and_takes_a_budget(tmp_path, monkeypatch, target):
    calls = []

    def fake_search(model, prompts, config=None):
        calls.append(config)
        return _result((2,), 4, key=model_key(model))

    monkeypatch.setattr(layer_search, "search_skip_layers", fake_search)
    first = choose_skip_layers(target, [[1, 2, 3]], 7.5, cache_dir=tmp_path)
    assert first.skip_layers == (2,) and calls[0] == SearchConfig(time_budget_s=7.5)
    assert choose_skip_layers(target, [[1, 2, 3]], cache_dir=tmp_path).from_cache and len(calls) == 1
    again = choose_skip_layers(target, [[1, 2, 3]], SearchConfig(seed=4), cache_dir=tmp_path, refresh=True)
    assert len(calls) == 2 and calls[1].seed == 4 and not again.from_cache


# --------------------------------------------------------------------------- progress and the budget


def test_a_search_reports_progress_with_an_estimate(target):
    events = []
    config = SearchConfig(new_tokens=6, proxy_evaluations=6, measured_candidates=2, time_budget_s=30)
    result = search_skip_layers(target, [[5, 6, 7, 8, 9], [1, 2, 3, 4]], config, progress=events.append)
    order = ["contexts", "timing", "proxy", "measure", "done"]
    stages = [order.index(e.stage) for e in events]
    assert stages == sorted(stages) and set(stages) == set(range(5))  # every stage, in order
    done = [e.done for e in events]
    assert done == sorted(done) and all(e.done <= e.total for e in events)
    (first,) = [i for i, e in enumerate(events) if e.message]  # the estimate, once: after the first candidate
    announced = events[first].message
    assert events[first].stage == "proxy" and all(e.eta_s is not None and e.eta_s >= 0 for e in events[first:])
    assert "tokens/s here" in announced and "s in all (budget 30 s)" in announced
    final = events[-1]
    assert final.eta_s == 0.0 and final.done == final.total and final.elapsed_s == pytest.approx(result.seconds,
                                                                                                  abs=0.5)


def test_a_search_reports_each_step_once(target, monkeypatch):
    real, runs = layer_search._measure, []
    monkeypatch.setattr(layer_search, "_measure", lambda *a: runs.append(a) or real(*a))
    events = []
    config = SearchConfig(new_tokens=4, proxy_evaluations=5, measured_candidates=1, time_budget_s=30)
    result = search_skip_layers(target, [[5, 6, 7, 8, 9]], config, progress=events.append)
    dones = [0] + [e.done for e in events]
    steps = [(e.stage, now - before) for e, before, now in zip(events, dones, dones[1:]) if now != before]
    assert all(d == 1 for _, d in steps) and len(steps) == events[-1].done
    assert [stage for stage, _ in steps] == ["contexts"] + ["proxy"] * len(result.candidates) + ["measure"] * len(runs)


def test_a_slow_search_stays_near_its_budget(monkeypatch):
    """A budget far below one timed run: one candidate per skip ratio, one timed run, on one prompt."""
    model = tiny_llama(vocab_size=64, seed=0, layers=8, scale=3.0)
    real, runs = layer_search._measure, []
    monkeypatch.setattr(layer_search, "_measure", lambda m, p, skip, *a: runs.append((skip, len(p))) or real(
        m, p, skip, *a))
    config = SearchConfig(new_tokens=6, proxy_evaluations=40, measured_candidates=3, time_budget_s=0.05)
    result = search_skip_layers(model, [[5, 6, 7, 8, 9], [1, 2, 3], [4, 4, 4]], config, progress=False)
    assert len(runs) == 1 and runs[0][0] is not None  # no second plain run, no second candidate
    assert runs[0][1] == 1  # the run that always happens: on as many prompts as fit, one
    assert len(result.candidates) == len(config.skip_ratios)  # one set per ratio, then the budget stopped it
    assert len({len(c["skip_layers"]) for c in result.candidates}) > 1  # ... of several sizes


def test_the_default_display_prints_the_estimate_and_the_total_off_a_terminal(target, capsys):
    search_skip_layers(target, [[5, 6, 7, 8, 9]], SearchConfig(new_tokens=4, proxy_evaluations=4,
                                                                 measured_candidates=1, time_budget_s=30))
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "tokens/s here" in err[0] and err[1].startswith("specdecode: layer-skip search: ")


# --------------------------------------------------------------------------- a set slower than plain decoding


def _timed(skip_speed: float):
    """A stand-in for the timed runs: every skip set decodes at ``skip_speed`` tokens/s; plain decoding is timed
    for real (a tiny model: hundreds of tokens/s), so 1.0 always loses and 1e9 always wins."""
    real = layer_search._measure

    def measure(model, prompts, skip_layers, gamma, new_tokens):
        return real(model, prompts, None, gamma, new_tokens) if skip_layers is None else skip_speed

    return measure


def test_a_set_measured_slower_than_plain_decoding_is_not_used_nor_cached(tmp_path, monkeypatch):
    """The search measured its best set at 1.0 tokens/s against plain decoding's hundreds: the proposer drafts
    nothing (plain decoding), and the set is not stored in the machine-wide cache for the next run."""
    monkeypatch.setattr(layer_search, "_measure", _timed(1.0))
    model = tiny_llama(vocab_size=64, seed=0, layers=6, scale=3.0)
    config = SearchConfig(new_tokens=8, proxy_evaluations=4, measured_candidates=1, time_budget_s=30)
    result = choose_skip_layers(model, [[1, 2, 3, 4, 5, 6]], config, cache_dir=tmp_path)
    assert result.loses and result.speedup < 1.0
    assert "no skip set was faster than plain decoding" in result.line() and "not cached" in result.line()
    assert load_cached(model, tmp_path) is None and not (tmp_path / CACHE_FILE).exists()
    proposer = LayerSkipProposer(model, LayerSkipConfig(cache_dir=str(tmp_path), min_confidence=0.0),
                                 searcher=layer_search)
    proposer.calibrate([[1, 2, 3, 4, 5, 6]])
    out = SpeculativeEngine(model, proposer).generate([1, 2, 3], SamplingParams(max_new_tokens=12))
    plain = SpeculativeEngine(model, None).generate([1, 2, 3], SamplingParams(max_new_tokens=12))
    assert out.metrics.num_drafted_tokens == 0 and out.token_ids == plain.token_ids
    proposer.set_skip_layers(result.skip_layers)  # a set given explicitly is used, whatever it measured
    out = SpeculativeEngine(model, proposer).generate([1, 2, 3], SamplingParams(max_new_tokens=12))
    assert out.metrics.num_drafted_tokens > 0 and out.token_ids == plain.token_ids


def test_a_losing_set_cached_by_an_older_version_is_ignored(tmp_path, target):
    store(target, SearchResult(skip_layers=(1, 2), gamma=3, tokens_per_s=1.0, plain_tokens_per_s=1.4,
                               acceptance=0.5, num_layers=4), tmp_path)
    assert load_cached(target, tmp_path) is None
    store(target, _result((1, 2)), tmp_path)  # 10 vs 8 tokens/s: kept
    assert load_cached(target, tmp_path).skip_layers == (1, 2)


def test_a_set_faster_than_plain_decoding_is_used_and_cached(tmp_path, monkeypatch):
    monkeypatch.setattr(layer_search, "_measure", _timed(1e9))
    model = tiny_llama(vocab_size=64, seed=0, layers=6, scale=3.0)
    config = SearchConfig(new_tokens=8, proxy_evaluations=4, measured_candidates=1, time_budget_s=30)
    result = choose_skip_layers(model, [[1, 2, 3, 4, 5, 6]], config, cache_dir=tmp_path)
    assert not result.loses and load_cached(model, tmp_path).skip_layers == result.skip_layers
    assert result.line().startswith(f"skipping layers {','.join(map(str, result.skip_layers))} of 6")


def test_cli_says_a_losing_set_is_not_used(capsys, tiny_model_dir, tmp_path, monkeypatch):
    from specdecode import cli

    monkeypatch.setattr(layer_search, "_measure", _timed(1.0))
    code = cli.main(["generate", "--target", str(tiny_model_dir), "--draft", "layer-skip", "--cache-dir",
                     str(tmp_path), "--prompt", "the quick brown fox jumps over the lazy dog, then the dog sleeps",
                     "--max-new-tokens", "12", "--ignore-eos", "--json", "--no-warmup"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "no skip set was faster than plain decoding" in captured.err and "skipping layers" not in captured.err
    assert json.loads(captured.out.splitlines()[-1])["num_drafted_tokens"] == 0
    assert not (tmp_path / CACHE_FILE).exists()
