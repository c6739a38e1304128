"""Speculative vs plain decoding under the whole sampling surface, side by side (a program, not a test).

For each *setting* (temperature, penalties, min_p, a JSON schema, block or token verification,
coupled or standard sampling) every prompt is decoded by plain decoding and by speculative decoding
with the same settings and the same seed, back to back, order rotated per prompt, each ``--repeats``
times with the fastest kept. Reported per setting: tau (tokens committed per target forward, bonus
included), acceptance rate, the median over prompts of plain time / speculative time (the speedup),
and whether greedy outputs equal plain decoding. Machine, threads, load average, lscpu flags and
the commit are printed and saved.

    python scripts/bench/bench_sampling_surface.py --target smollm2-135m --draft ngram --limit 5
    python scripts/bench/bench_sampling_surface.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \\
        --dtype bf16 --dataset humaneval:5 --settings t1-token,t1-block,t07-token,t07-block
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from specdecode.bench.env import cpu_flags, describe, environment
from specdecode.data import load_prompts
from specdecode.engine import RequestSpeculation, SpeculativeEngine
from specdecode.models import load_model
from specdecode.build import assemble, build_factory, load_draft_for
from specdecode.spec import DrafterSpec
from specdecode.types import SamplingParams

#: A small nested JSON schema for the structured-output settings.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "language": {"enum": ["python", "c", "rust", "go"]},
        "tests": {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
        "score": {"type": "number"},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "language", "tests", "score", "ok"],
    "additionalProperties": False,
}

PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1}

#: name -> (SamplingParams keywords, verification, structured output or None)
SETTINGS = {
    "greedy": ({}, None, None),
    "t1-token": ({"temperature": 1.0, "coupled": False}, "token", None),
    "t1-block": ({"temperature": 1.0, "coupled": False}, "block", None),
    "t1-coupled": ({"temperature": 1.0, "coupled": True}, None, None),
    "t07-token": ({"temperature": 0.7, "coupled": False}, "token", None),
    "t07-block": ({"temperature": 0.7, "coupled": False}, "block", None),
    "t07-coupled": ({"temperature": 0.7, "coupled": True}, None, None),
    "penalties-greedy": (dict(PENALTIES), None, None),
    "penalties-t07": ({"temperature": 0.7, "coupled": False, "min_p": 0.05, **PENALTIES}, None, None),
    "json-greedy": ({}, None, "schema"),
    "json-t07": ({"temperature": 0.7, "coupled": False}, None, "schema"),
}


def encode(tokenizer, prompt, structured: bool) -> list[int]:
    text = prompt.turns[0]
    if structured:
        text = ("Describe this task as a JSON object with fields name, language, tests, score, ok.\n\n" + text)
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
        return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
    return [int(t) for t in tokenizer(text)["input_ids"]]


def run_one(engine: SpeculativeEngine, ids: list[int], params: SamplingParams, verification, constraint):
    """(seconds, output) of one request alone on ``engine``."""
    t0 = time.perf_counter()
    req, _ = engine.add(ids, params, constraint=constraint,
                        speculation=RequestSpeculation(verification=verification) if verification else None)
    while req.finish_reason is None:
        engine.step()
    return time.perf_counter() - t0, engine.output(req)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default="ngram", help="a --draft choice: ngram, suffix, layer-skip, a model spec")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--dataset", default="spec-bench", help="a prompt set spec (specdecode.data.load_prompts)")
    ap.add_argument("--limit", type=int, default=5, help="prompts used")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=5)
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, from {list(SETTINGS)}")
    ap.add_argument("--repeats", type=int, default=2, help="runs per prompt and variant; the fastest is kept")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write records and the summary here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    names = [s for s in args.settings.split(",") if s]
    unknown = [s for s in names if s not in SETTINGS]
    if unknown:
        ap.error(f"unknown settings {unknown}; choose from {list(SETTINGS)}")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    target = load_model(args.target, dtype=dtype, progress=False)
    drafter = DrafterSpec.parse(args.draft)
    weights = "bf16" if args.dtype == "bf16" else "fp32"
    draft = load_draft_for(drafter, target, args.target, weights=weights, dtype=dtype, progress=False)
    make = build_factory(drafter, target, draft)
    plain = assemble(target, None, num_speculative_tokens=args.num_speculative_tokens, forward="owned")
    spec = assemble(target, make(), num_speculative_tokens=args.num_speculative_tokens, forward="owned")
    prompts = load_prompts(args.dataset)[: args.limit]
    eos = target.eos_token_ids
    compiled = None
    if any(SETTINGS[n][2] for n in names):
        from specdecode.grammar import StructuredOutput, compile_grammar

        compiled = compile_grammar(target.tokenizer, plain.vocab_size, StructuredOutput("json_schema", SCHEMA))
    env = environment()
    print(f"# {args.target} ({args.dtype}) + {args.draft}, gamma {args.num_speculative_tokens}, "
          f"{len(prompts)} prompts of {args.dataset}, {args.max_new_tokens} new tokens, batch 1, "
          f"{args.repeats} repeats (fastest kept), threads {args.threads}, load {os.getloadavg()[0]:.2f}")
    print(f"# {describe(env)}")
    print(f"# flags: {' '.join(f for f in cpu_flags() if f.startswith(('avx', 'amx')))}")
    for e in (plain, spec):  # warm-up
        run_one(e, encode(target.tokenizer, prompts[0], False), SamplingParams(max_new_tokens=4), None, None)
    records, summary = [], {}
    for name in names:
        kw, verification, structured = SETTINGS[name]
        ratios, taus, accs, same = [], [], [], []
        for i, prompt in enumerate(prompts):
            ids = encode(target.tokenizer, prompt, structured is not None)
            params = SamplingParams(max_new_tokens=args.max_new_tokens, seed=args.seed + i, eos_token_ids=eos, **kw)
            best = {}
            order = [("plain", plain), ("spec", spec)] if i % 2 == 0 else [("spec", spec), ("plain", plain)]
            for _ in range(args.repeats):
                for label, engine in order:
                    constraint = compiled.new_constraint() if structured else None
                    t, out = run_one(engine, ids, params, verification, constraint)
                    if label not in best or t < best[label][0]:
                        best[label] = (t, out)
            (tp, op), (ts, os_) = best["plain"], best["spec"]
            m = os_.metrics
            tau = len(os_.token_ids) / max(1, m.num_target_forwards)
            acc = m.num_accepted_tokens / max(1, m.num_drafted_tokens)
            ratio = (tp / max(1, len(op.token_ids))) / (ts / max(1, len(os_.token_ids)))  # per-token time ratio
            ratios.append(ratio)
            taus.append(tau)
            accs.append(acc)
            same.append(op.token_ids == os_.token_ids)
            records.append({"setting": name, "prompt": i, "plain_s": tp, "spec_s": ts, "plain_tokens": len(op.token_ids),
                            "spec_tokens": len(os_.token_ids), "tau": tau, "acceptance": acc,
                            "identical": op.token_ids == os_.token_ids})
        summary[name] = {"speedup_median": statistics.median(ratios), "tau_mean": statistics.fmean(taus),
                         "acceptance_mean": statistics.fmean(accs), "identical": sum(same), "prompts": len(same)}
        s = summary[name]
        print(f"| {name} | tau {s['tau_mean']:.2f} | acceptance {s['acceptance_mean']:.2f} | speedup (median) "
              f"{s['speedup_median']:.2f}x | identical to plain {s['identical']}/{s['prompts']} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "env": env, "load_avg_end": os.getloadavg(), "summary": summary,
                       "records": records}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
