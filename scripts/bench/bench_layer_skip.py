"""Benchmark: layer-skip self-speculation and the draft-length policies (a program, not a test).

Run it alone on the machine (it times things):

    flock /tmp/specdecode-heavy.lock python scripts/bench/bench_layer_skip.py --output bench-out/layer_skip.json

Three parts, every run greedy unless stated, batch size 1, ``ignore_eos`` (fixed length):

1. **Skip set.** The layer-skip set of the target: ``--skip-layers``, or the one cached
   for the model, or a search (``specdecode.layer_search``) on calibration prompts that
   are not benchmark prompts (the prompt after the benchmark ones in each category).
2. **Categories.** For each Spec-Bench category, ``--prompts`` prompts: plain decoding
   (before and after the others on each prompt), then for each method (``layer-skip``;
   ``draft-model`` = ``--draft``, by default an int8 copy of the target) a fixed
   gamma sweep and the adaptive policies. ``--repeats`` rounds, each with fresh engines
   (one policy state per category and configuration, reused across its prompts); per
   (configuration, prompt) the best round is kept, plain included.
3. **Adversarial.** Prompts asking for random strings, sampled at temperature 1 (seeded):
   plain vs every method x policy; the claim checked is that every policy except
   ``fixed`` stays at or above 0.95x plain.

Prints tables and writes JSON (machine, model, data, gamma, temperature, every run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from specdecode.build import build_engine
from specdecode.data import load_prompts
from specdecode.engine import SpeculativeEngine
from specdecode.kernels import use_small_row_matmul
from specdecode.lowbit import set_weight_precision
from specdecode.layer_search import SearchConfig, choose_skip_layers
from specdecode.models import load_model
from specdecode.proposers.layer_skip import parse_skip_layers
from specdecode.spec import DrafterSpec
from specdecode.types import SamplingParams

ADVERSARIAL = (
    "Write a random string of 400 characters made of uppercase letters, lowercase letters and digits. "
    "Output only the string, nothing else.",
    "Generate 60 random hexadecimal numbers of 8 digits each, separated by spaces. Output only the numbers.",
    "Produce a random password list: 30 passwords, each 14 random characters mixing letters, digits and symbols. "
    "Only the list.",
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16", help="target load dtype (bfloat16: flat few-row cost on "
                                                         "AVX512-BF16 CPUs)")
    p.add_argument("--weights", default=None, choices=("fp32", "bf16", "int8"),
                   help="target weight precision after loading (default: as loaded)")
    p.add_argument("--draft", default=None, help="draft model of the draft-model method (default: the target)")
    p.add_argument("--draft-weights", default="int8", choices=("fp32", "bf16", "int8"))
    p.add_argument("--categories", default="writing,coding,summarization")
    p.add_argument("--prompts", type=int, default=2, help="prompts per category")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--gammas", default="1,2,3,4", help="fixed gamma sweep")
    p.add_argument("--policies", default="heuristic,confidence,cost-model")
    p.add_argument("--start-gamma", type=int, default=4, help="starting gamma of the adaptive policies")
    p.add_argument("--methods", default="layer-skip,draft-model", help="methods of the category sweeps")
    p.add_argument("--adversarial-methods", default="layer-skip,draft-model,ngram")
    p.add_argument("--repeats", type=int, default=2,
                   help="rounds per category, each with fresh engines (fresh policy state); best round per run kept")
    p.add_argument("--skip-layers", default=None, help="fixed skip set; default: cached or searched")
    p.add_argument("--min-confidence", type=float, default=0.5, help="layer-skip chain confidence stop")
    p.add_argument("--search-budget", type=float, default=150.0)
    p.add_argument("--refresh-search", action="store_true", help="search again even if a skip set is cached")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared 2-core machine one thread is about as fast for these "
                        "memory-bound models and far less sensitive to other processes)")
    p.add_argument("--adversarial", type=int, default=3, help="adversarial prompts (0 = skip)")
    p.add_argument("--adversarial-tokens", type=int, default=96)
    p.add_argument("--output", default="bench-out/layer_skip.json")
    return p.parse_args(argv)


def encode(tokenizer, text: str) -> list[int]:
    chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=False)
    return list(tokenizer(chat, add_special_tokens=False)["input_ids"])


def machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version()}


def run(engine: SpeculativeEngine, ids: list[int], params: SamplingParams) -> dict:
    out = engine.generate(ids, params)
    m = out.metrics
    decode_s = m.wall_time_s - m.prefill_time_s
    return {"token_ids": out.token_ids, "tokens": m.num_generated_tokens, "wall_s": m.wall_time_s,
            "tokens_per_s": m.tokens_per_s, "prefill_s": m.prefill_time_s,
            "decode_tokens_per_s": (m.num_generated_tokens - 1) / decode_s if decode_s > 0 else 0.0, "acceptance_rate": m.acceptance_rate, "tau": m.mean_accepted_length,
            "mean_gamma": m.mean_draft_length, "gamma_histogram": m.draft_length_histogram,
            "draft_s": m.draft_time_s, "verify_s": m.verify_time_s}


class Methods:
    """Builds (method, policy) engines over one target (LoadedModels), each from a drafter spec
    (``specdecode.build``)."""

    def __init__(self, args, target, draft_int8, skip_layers):
        self.args, self.target, self.draft, self.skip_layers = args, target, draft_int8, skip_layers

    def spec(self, method: str | None) -> DrafterSpec:
        if method is None:
            return DrafterSpec()
        if method == "layer-skip":
            skip = "/".join(map(str, self.skip_layers or ()))
            return DrafterSpec.parse(f"layer-skip:skip_layers={skip},min_confidence={self.args.min_confidence}")
        if method == "draft-model":
            return DrafterSpec.parse(f"draft-model:model={self.args.draft or self.args.target}")
        if method == "ngram":
            return DrafterSpec.parse("ngram")
        raise ValueError(method)

    def engine(self, method: str | None, policy: str, gamma: int) -> SpeculativeEngine:
        return build_engine(self.target, self.spec(method).with_gamma(gamma), draft=self.draft,
                            policy=policy).engine

    def configs(self, methods: str) -> list[tuple[str, str, int]]:
        out = []
        for method in methods.split(","):
            out += [(method, "fixed", g) for g in map(int, self.args.gammas.split(","))]
            out += [(method, p, self.args.start_gamma) for p in self.args.policies.split(",")]
        return out


def best_of(runs: list[dict]) -> dict:
    """The fastest of repeated runs of one configuration on one prompt (other load only ever slows a run)."""
    return max(runs, key=lambda r: r["tokens_per_s"])


def bench_category(methods: Methods, tokenizer, category: str, n: int, params: SamplingParams, repeats: int) -> dict:
    prompts = load_prompts(f"spec-bench:{category}:{n}")
    configs = methods.configs(methods.args.methods)
    encoded = [encode(tokenizer, p.turns[0]) for p in prompts]
    rows = {c: [[] for _ in prompts] for c in configs}
    plain_runs = [[] for _ in prompts]
    for r in range(repeats):
        engines = {c: methods.engine(*c) for c in configs}  # fresh policy state each round
        plain_engine = methods.engine(None, "fixed", 1)
        for i, (p, ids) in enumerate(zip(prompts, encoded)):
            before = run(plain_engine, ids, params)
            plain_runs[i].append(before)
            for c in configs:
                out = run(engines[c], ids, params)
                out["matches_plain"] = out["token_ids"] == before["token_ids"]
                rows[c][i].append(out)
                print(f"  [{r}] {category}/{p.id} {c[0]:<11} {c[1]:<10} k={c[2]}: {out['tokens_per_s']:6.1f} tok/s  "
                      f"acc {out['acceptance_rate']:.2f} tau {out['tau']:.2f} mean gamma {out['mean_gamma']:.2f}",
                      flush=True)
            after = run(plain_engine, ids, params)
            plain_runs[i].append(after)
            print(f"  [{r}] {category}/{p.id} plain: {before['tokens_per_s']:.1f} / {after['tokens_per_s']:.1f} tok/s",
                  flush=True)
    plain = []
    for p, ids, runs in zip(prompts, encoded, plain_runs):
        b = best_of(runs)
        plain.append({"prompt_id": p.id, "num_prompt_tokens": len(ids), "tokens_per_s": b["tokens_per_s"],
                      "decode_tokens_per_s": b["decode_tokens_per_s"], "runs": [x["tokens_per_s"] for x in runs]})
    configs_out = []
    for c in configs:
        summary = summarise(c, [best_of(runs) for runs in rows[c]], plain)
        summary["all_match_plain"] = all(x["matches_plain"] for runs in rows[c] for x in runs)
        summary["all_runs_tokens_per_s"] = [[x["tokens_per_s"] for x in runs] for runs in rows[c]]
        configs_out.append(summary)
    return {"category": category, "plain": plain, "configs": configs_out}


def summarise(config, runs: list[dict], plain: list[dict]) -> dict:
    method, policy, gamma = config
    speedups = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(runs, plain)]
    decode_speedups = [r["decode_tokens_per_s"] / b["decode_tokens_per_s"] for r, b in zip(runs, plain)]
    hist: dict[int, int] = {}
    for r in runs:
        for g, c in r["gamma_histogram"].items():
            hist[g] = hist.get(g, 0) + c
    return {
        "method": method, "policy": policy, "gamma": gamma,
        "tokens_per_s": sum(r["tokens"] for r in runs) / sum(r["wall_s"] for r in runs),
        "speedup_mean": statistics.mean(speedups), "speedups": speedups,
        "decode_speedup_mean": statistics.mean(decode_speedups),
        "acceptance_rate": statistics.mean(r["acceptance_rate"] for r in runs),
        "tau": statistics.mean(r["tau"] for r in runs),
        "mean_gamma": statistics.mean(r["mean_gamma"] for r in runs), "gamma_histogram": dict(sorted(hist.items())),
        "all_match_plain": all(r.get("matches_plain", True) for r in runs),
        "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in runs],
    }


def print_category(res: dict) -> None:
    plain = statistics.mean(b["tokens_per_s"] for b in res["plain"])
    print(f"\n== {res['category']}: plain {plain:.1f} tok/s (mean over prompts)")
    print(f"{'method':<12}{'policy':<11}{'k':>3}{'tok/s':>8}{'speedup':>9}{'decode':>8}{'accept':>8}{'tau':>6}"
          f"{'mean g':>8}  match  gamma histogram")
    for c in res["configs"]:
        hist = " ".join(f"{g}:{n}" for g, n in c["gamma_histogram"].items())
        print(f"{c['method']:<12}{c['policy']:<11}{c['gamma']:>3}{c['tokens_per_s']:>8.1f}{c['speedup_mean']:>8.2f}x"
              f"{c['decode_speedup_mean']:>7.2f}x{c['acceptance_rate']:>8.2f}{c['tau']:>6.2f}{c['mean_gamma']:>8.2f}"
              f"  {'yes' if c['all_match_plain'] else 'NO':<5}  {hist}")
    for method in sorted({c["method"] for c in res["configs"]}):
        fixed = [c for c in res["configs"] if c["method"] == method and c["policy"] == "fixed"]
        best = max(fixed, key=lambda c: c["speedup_mean"])
        for c in res["configs"]:
            if c["method"] == method and c["policy"] != "fixed":
                ratio = c["speedup_mean"] / best["speedup_mean"]
                print(f"  {method}: {c['policy']} / best fixed (k={best['gamma']}) = {ratio:.3f}")


def bench_adversarial(methods: Methods, tokenizer, n: int, tokens: int, repeats: int) -> dict:
    policies = ["fixed", *methods.args.policies.split(",")]
    configs = [(m, p, methods.args.start_gamma) for m in methods.args.adversarial_methods.split(",") for p in policies]
    texts = ADVERSARIAL[:n]
    rows = {c: [[] for _ in texts] for c in configs}
    plain_runs = [[] for _ in texts]
    for r in range(repeats):
        engines = {c: methods.engine(*c) for c in configs}
        plain_engine = methods.engine(None, "fixed", 1)
        for i, text in enumerate(texts):
            ids = encode(tokenizer, text)
            params = SamplingParams(temperature=1.0, max_new_tokens=tokens, seed=1000 + i, ignore_eos=True)
            plain_runs[i].append(run(plain_engine, ids, params))
            for c in configs:
                rows[c][i].append(run(engines[c], ids, params))
            plain_runs[i].append(run(plain_engine, ids, params))
            print(f"  [{r}] adversarial {i}: plain {plain_runs[i][-2]['tokens_per_s']:.1f} / "
                  f"{plain_runs[i][-1]['tokens_per_s']:.1f}", flush=True)
    plain = [{"prompt": t, "tokens_per_s": best_of(runs)["tokens_per_s"],
              "decode_tokens_per_s": best_of(runs)["decode_tokens_per_s"], "runs": [x["tokens_per_s"] for x in runs]}
             for t, runs in zip(texts, plain_runs)]
    res = {"category": "adversarial (random strings, temperature 1)", "plain": plain,
           "configs": [summarise(c, [best_of(runs) for runs in rows[c]], plain) for c in configs]}
    print_category(res)
    for c in res["configs"]:
        if c["policy"] != "fixed":
            ok = c["speedup_mean"] >= 0.95
            print(f"  {c['method']}/{c['policy']}: {c['speedup_mean']:.2f}x plain -> {'OK' if ok else 'BELOW 0.95x'}")
    return res


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    loaded = load_model(args.target, dtype=args.dtype, progress=False)
    target = loaded.model
    if args.weights:
        set_weight_precision(target, args.weights)
    if args.dtype == "float32" and args.weights in (None, "fp32"):
        use_small_row_matmul(target)
    draft = None
    if "draft-model" in args.methods + args.adversarial_methods:
        draft = load_model(args.draft or args.target, progress=False)
        set_weight_precision(draft.model, args.draft_weights)
    print(f"loaded in {time.perf_counter() - t0:.1f} s; {machine()}", flush=True)
    categories = args.categories.split(",")
    skip_layers = parse_skip_layers(args.skip_layers)
    search = None
    if skip_layers is None and "layer-skip" in args.methods:
        calib = [encode(loaded.tokenizer, load_prompts(f"spec-bench:{c}:{args.prompts + 1}")[-1].turns[0])
                 for c in categories]
        search = choose_skip_layers(target, calib, SearchConfig(time_budget_s=args.search_budget),
                                    refresh=args.refresh_search)
        skip_layers = search.skip_layers
        print(f"skip set {list(skip_layers)} ({'cached' if search.from_cache else f'searched in {search.seconds:.0f} s'})"
              f": proxy acceptance {search.acceptance:.2f}, measured {search.tokens_per_s:.1f} vs plain "
              f"{search.plain_tokens_per_s:.1f} tok/s", flush=True)
    methods = Methods(args, loaded, draft, skip_layers)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    results = []
    for cat in categories:
        res = bench_category(methods, loaded.tokenizer, cat, args.prompts, params, args.repeats)
        print_category(res)
        results.append(res)
    adversarial = bench_adversarial(methods, loaded.tokenizer, args.adversarial, args.adversarial_tokens,
                                    args.repeats) if args.adversarial else None
    report = {
        "benchmark": "layer-skip self-speculation and draft-length policies",
        "machine": machine(), "target": args.target, "target_source": loaded.source,
        "target_dtype": args.dtype, "target_weights": args.weights or "as loaded",
        "draft_model": f"{args.draft or args.target}, {args.draft_weights} weights" if draft is not None else None,
        "dataset": f"spec-bench categories {categories}, first {args.prompts} prompts each, chat template",
        "max_new_tokens": args.max_new_tokens, "temperature": 0.0, "batch_size": 1, "ignore_eos": True,
        "gammas_fixed": args.gammas, "adaptive_start_gamma": args.start_gamma, "repeats": args.repeats,
        "torch_threads": args.threads, "aggregation": "best of repeats per (configuration, prompt); speedup = "
                                                      "tokens/s over plain's best on the same prompt, wall incl. prefill",
        "layer_skip": {"skip_layers": list(skip_layers or ()), "min_confidence": args.min_confidence,
                       "search": None if search is None else {k: v for k, v in search.__dict__.items()
                                                              if k != "candidates"}},
        "categories": results, "adversarial": adversarial, "seconds": time.perf_counter() - t0,
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {out} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
