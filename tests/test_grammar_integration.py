"""Structured output on real weights (SmolLM2-135M-Instruct, bf16 target: the batch-invariant forward, so greedy
speculative output must equal constrained plain decoding token for token, near-tie or not).

CI runs 10 of the 50 JSON-schema requests of ``tests/structured_suite.py`` (two per template) with each drafter;
``scripts/bench/structured_output_bench.py`` runs all 50 and writes docs/results/structured/.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from specdecode.engine import SpeculativeEngine
from specdecode.grammar import StructuredOutput, compile_grammar
from specdecode.types import SamplingParams
from structured_suite import schema_suite

pytestmark = pytest.mark.integration

MAX_NEW_TOKENS = 160
CI_REQUESTS = 10
DRAFTERS = ("ngram", "suffix", "layer-skip", "draft-model")


def _bench():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "structured_output_bench.py"
    spec = importlib.util.spec_from_file_location("structured_output_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def setup():
    """(bench module, bf16 target, int8 draft, suite, prompt ids, constrained plain decoding's runs)."""
    bench = _bench()
    target, draft = bench.load_pair("smollm2-135m")
    suite = schema_suite(CI_REQUESTS)
    prompts = [bench.chat_ids(target.tokenizer, msg) for _, msg, _ in suite]
    plain = SpeculativeEngine(target.model, None)
    assert plain.runner.batch_invariant
    runs = [bench.run_one(plain, target, ids, schema, MAX_NEW_TOKENS) for (_, _, schema), ids in zip(suite, prompts)]
    return bench, target, draft, suite, prompts, runs


def test_constrained_plain_decoding_gives_valid_json_on_real_weights(setup):
    _, _, _, suite, _, runs = setup
    for (rid, _, schema), r in zip(suite, runs):
        assert r["finish_reason"] == "stop" and r["invalid"] is None, (rid, r["text"], r["invalid"])
        jsonschema.validate(json.loads(r["text"]), schema)


def _run_together(bench, engine, loaded, prompts: list[list[int]], schemas: list[dict]) -> list[dict]:
    """``bench.run_one`` of every request, the requests decoded together in one batch (each with its own grammar):
    the batch-invariant bf16 forward makes each row's tokens those it gets alone, so one batched pass replaces
    ten one-row passes and still meets plain decoding alone token for token."""
    reqs = []
    for ids, schema in zip(prompts, schemas):
        grammar = compile_grammar(loaded.tokenizer, engine.vocab_size, StructuredOutput.json_schema(schema),
                                  loaded.eos_token_ids)
        params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, eos_token_ids=loaded.eos_token_ids)
        reqs.append(engine.add(ids, params, constraint=grammar.new_constraint())[0])
    while any(r.finish_reason is None for r in reqs):
        engine.step()
    runs = []
    for req, schema in zip(reqs, schemas):
        m, ids = req.metrics, list(req.generated)
        text = loaded.tokenizer.decode(ids, skip_special_tokens=True)
        runs.append({"token_ids": ids, "text": text, "finish_reason": req.finish_reason,
                     "invalid": bench.validate(text, schema), "drafted": m.num_drafted_tokens,
                     "accepted": m.num_accepted_tokens, "verify_steps": m.num_verify_steps,
                     "step_tokens": m.num_step_tokens, "wall_s": 0.0})
    return runs


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_greedy_structured_output_equals_constrained_plain_with_every_drafter(setup, drafter, capsys):
    """The requests decoded together, speculatively (every row with its own grammar), against constrained plain
    decoding of each alone (the fixture's runs)."""
    bench, target, draft, suite, prompts, plain = setup
    engine = bench.engine_for(drafter, target, draft, 4, max_batch_size=len(suite))
    runs = _run_together(bench, engine, target, prompts, [schema for _, _, schema in suite])
    for (rid, _, _), r, p in zip(suite, runs, plain):
        assert r["invalid"] is None, (rid, r["text"], r["invalid"])
        assert r["token_ids"] == p["token_ids"], (rid, r["text"], p["text"])
    s = bench.summarize(runs, plain)
    with capsys.disabled():
        print(f"\nstructured output, SmolLM2-135M bf16, gamma 4, {len(runs)} JSON-schema requests, {drafter}: "
              f"tau {s['tau']:.2f}, acceptance rate {s['acceptance_rate']:.2f}")
    assert s["drafted"] > 0 and s["equal_to_plain"] == len(runs)


def test_sampled_structured_output_validates_on_real_weights(setup):
    bench, target, draft, suite, prompts, _ = setup
    engine = bench.engine_for("draft-model", target, draft, 4, max_batch_size=10)
    running = []  # the ten seeded requests decoded together, each with its own grammar
    for seed, ((rid, _, schema), ids) in enumerate(zip(suite[:5], prompts)):
        for coupled in (False, True):
            grammar = compile_grammar(target.tokenizer, engine.vocab_size, StructuredOutput.json_schema(schema),
                                      target.eos_token_ids)
            params = SamplingParams(temperature=1.0, max_new_tokens=160, eos_token_ids=target.eos_token_ids,
                                    seed=seed, coupled=coupled)
            running.append((rid, schema, engine.add(ids, params, constraint=grammar.new_constraint())[0]))
    while any(req.finish_reason is None for _, _, req in running):
        engine.step()
    for rid, schema, req in running:
        text = target.tokenizer.decode(req.generated, skip_special_tokens=True)
        assert req.finish_reason == "stop", (rid, text)
        jsonschema.validate(json.loads(text), schema)
