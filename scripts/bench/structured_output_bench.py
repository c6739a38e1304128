"""Structured output on real weights: 50 JSON-schema requests, greedy, with each drafter against constrained plain
decoding (a program, not a test; ``tests/test_grammar_integration.py`` runs a subset in CI).

    python scripts/bench/structured_output_bench.py --threads 1 --output docs/results/structured/smollm2_bf16.json

For every request of ``tests/structured_suite.py`` (nested objects, enums, arrays, numbers, strings with
maxLength / pattern, booleans; chat prompts) it runs constrained plain decoding, then each drafter through the
same engine code, bf16 target (the batch-invariant forward: greedy speculative output must equal plain decoding
token for token), and checks that every output parses, validates (jsonschema) and ends with EOS. Prints and
writes per drafter: tau (tokens committed per target forward after the prefill, bonus included), acceptance rate
(accepted / drafted), outputs equal to plain decoding, valid outputs, tokens/s (on a shared machine: indicative).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from structured_suite import schema_suite  # noqa: E402

from specdecode.build import build_engine  # noqa: E402
from specdecode.engine import SpeculativeEngine  # noqa: E402
from specdecode.grammar import StructuredOutput, compile_grammar  # noqa: E402
from specdecode.models import load_model  # noqa: E402
from specdecode.spec import DrafterSpec  # noqa: E402
from specdecode.types import SamplingParams  # noqa: E402

#: The drafters, as specs (``specdecode.spec``); draft-model drafts with the int8 copy ``load_pair`` loads.
DRAFTERS = {"ngram": "ngram", "suffix": "suffix", "layer-skip": "layer-skip:skip_layers=2/3/4,min_confidence=0.0",
            "draft-model": "draft-model"}


def engine_for(name: str, target, draft, gamma: int, max_batch_size: int = 1) -> SpeculativeEngine:
    """The engine of drafter ``name`` ("plain": none) over the loaded target and draft, built from its spec."""
    spec = DrafterSpec() if name == "plain" else DrafterSpec.parse(DRAFTERS[name])
    return build_engine(target, spec, draft=draft, num_speculative_tokens=gamma, max_batch_size=max_batch_size).engine


def load_pair(target_spec: str = "smollm2-135m"):
    """The bf16 target and an int8 copy of the same model (from float32 weights) as the draft model (LoadedModels)."""
    from specdecode.lowbit import set_weight_precision

    target = load_model(target_spec, dtype=torch.bfloat16, progress=False)
    draft = load_model(target_spec, progress=False)
    set_weight_precision(draft.model, "int8")
    return target, draft


def chat_ids(tokenizer, message: str) -> list[int]:
    """One user message through the chat template (as ``SpecDecoder.encode_chat`` does)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                         tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def validate(text: str, schema: dict) -> str | None:
    """None when ``text`` is JSON valid under ``schema``, else why not."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return None


def run_one(engine, loaded, prompt_ids: list[int], schema: dict, max_new_tokens: int) -> dict:
    grammar = compile_grammar(loaded.tokenizer, engine.vocab_size, StructuredOutput.json_schema(schema),
                              loaded.eos_token_ids)
    params = SamplingParams(max_new_tokens=max_new_tokens, eos_token_ids=loaded.eos_token_ids)
    t0 = time.perf_counter()
    req, _ = engine.add(prompt_ids, params, constraint=grammar.new_constraint())
    while req.finish_reason is None:
        engine.step()
    wall = time.perf_counter() - t0
    m = req.metrics
    ids = list(req.generated)
    text = loaded.tokenizer.decode(ids, skip_special_tokens=True)
    return {"token_ids": ids, "text": text, "finish_reason": req.finish_reason, "invalid": validate(text, schema),
            "drafted": m.num_drafted_tokens, "accepted": m.num_accepted_tokens, "verify_steps": m.num_verify_steps,
            "step_tokens": m.num_step_tokens, "wall_s": wall}


def summarize(runs: list[dict], plain: list[dict] | None) -> dict:
    drafted = sum(r["drafted"] for r in runs)
    steps = sum(r["verify_steps"] for r in runs)
    tokens = sum(len(r["token_ids"]) for r in runs)
    wall = sum(r["wall_s"] for r in runs)
    out = {"requests": len(runs), "valid": sum(r["invalid"] is None for r in runs),
           "ended_with_eos": sum(r["finish_reason"] == "stop" for r in runs),
           "tokens": tokens, "tau": sum(r["step_tokens"] for r in runs) / steps if steps else 0.0,
           "acceptance_rate": sum(r["accepted"] for r in runs) / drafted if drafted else 0.0,
           "drafted": drafted, "tokens_per_s": tokens / wall if wall else 0.0}
    if plain is not None:
        out["equal_to_plain"] = sum(r["token_ids"] == p["token_ids"] for r, p in zip(runs, plain))
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--limit", type=int, default=50, help="requests of the suite (1..50)")
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=160,
                   help="a cap no request of the suite needs (its strings and arrays are bounded)")
    p.add_argument("--drafters", default=",".join(DRAFTERS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output", type=Path, default=Path("docs/results/structured/smollm2_bf16.json"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    target, draft = load_pair(args.target)
    suite = schema_suite(args.limit)
    prompts = [chat_ids(target.tokenizer, msg) for _, msg, _ in suite]
    env = {"platform": platform.platform(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "torch": torch.__version__, "python": platform.python_version()}
    print(f"{len(suite)} requests, gamma {args.gamma}, max_new_tokens {args.max_new_tokens}, {env}", flush=True)
    results: dict[str, list[dict]] = {}
    for name in ["plain", *args.drafters.split(",")]:
        engine = engine_for(name, target, draft, args.gamma)
        runs = []
        for (rid, _, schema), ids in zip(suite, prompts):
            r = run_one(engine, target, ids, schema, args.max_new_tokens)
            r["id"] = rid
            runs.append(r)
            if r["invalid"] or (name != "plain" and r["token_ids"] != results["plain"][len(runs) - 1]["token_ids"]):
                print(f"  {name} {rid}: invalid={r['invalid']} equal={name == 'plain' or r['token_ids'] == results['plain'][len(runs) - 1]['token_ids']} {r['text']!r}", flush=True)
        results[name] = runs
        s = summarize(runs, None if name == "plain" else results["plain"])
        print(f"{name:12s} tau {s['tau']:.2f}  acceptance {s['acceptance_rate']:.2f}  valid {s['valid']}/{s['requests']}"
              f"  EOS {s['ended_with_eos']}  equal {s.get('equal_to_plain', '-')}  {s['tokens_per_s']:.1f} tok/s",
              flush=True)
    report = {"target": f"{args.target} bf16 (batch-invariant forward)", "draft_model": f"{args.target} int8",
              "layer_skip": [2, 3, 4], "gamma": args.gamma, "max_new_tokens": args.max_new_tokens,
              "policy": "fixed", "environment": env,
              "note": "tau and acceptance do not depend on machine load; tokens_per_s does (read it as a "
                      "measurement only from a run alone on the machine)",
              "summary": {name: summarize(runs, None if name == "plain" else results["plain"])
                          for name, runs in results.items()},
              "requests": [{"id": rid, "prompt": msg, "schema": schema,
                            "plain_text": results["plain"][i]["text"]} for i, (rid, msg, schema) in enumerate(suite)],
              "runs": {name: [{k: r[k] for k in ("id", "finish_reason", "invalid", "drafted", "accepted",
                                                  "verify_steps", "step_tokens", "wall_s")}
                              | {"tokens": len(r["token_ids"]),
                                 "equal_to_plain": r["token_ids"] == results["plain"][i]["token_ids"]}
                              for i, r in enumerate(runs)] for name, runs in results.items()}}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.output}")
    bad = [name for name, runs in results.items() if any(r["invalid"] for r in runs)]
    unequal = [name for name, runs in results.items() if name != "plain" and
               any(r["token_ids"] != p["token_ids"] for r, p in zip(runs, results["plain"]))]
    return 1 if bad or unequal else 0


if __name__ == "__main__":
    sys.exit(main())
