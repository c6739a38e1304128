"""Benchmarks of token trees and suffix decoding (a program, not a test; issue 4).

Two workloads, each printing a table and saving JSON (machine, models, data, gamma / nodes,
temperature, batch size 1):

    # SmolLM2-135M: suffix decoding vs n-gram on Spec-Bench summarization, RAG, and a
    # repeated task (the same HumanEval prompts answered twice; pass 2 may use the global tree)
    flock /tmp/specdecode-heavy.lock python scripts/research/bench_trees.py suffix --limit 5 --max-new-tokens 128

    # Qwen2.5-Coder 1.5B target + 0.5B draft: EAGLE-2 dynamic tree vs chain at equal draft forwards
    flock /tmp/specdecode-heavy.lock python scripts/research/bench_trees.py tree --limit 3 --max-new-tokens 64

Every variant runs each prompt back to back (order rotated per prompt) with the same target,
the same forward (``--kernel small-row`` computes linears of <= 16 rows as ``W @ x.T`` for all
variants, plain included), greedy unless ``--temperature``. Speedup = plain wall time / variant
wall time over the same prompts; tau = tokens committed per target forward (bonus included).
Greedy outputs are compared with plain decoding token for token.
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

from specdecode.bench.env import cpu_model, git_commit
from specdecode.data import load_prompts
from specdecode.build import build_engine
from specdecode.kv import make_runner
from specdecode.kernels import use_small_row_matmul
from specdecode.models import load_model
from specdecode.spec import DrafterSpec
from specdecode.types import SamplingParams


def encode(tokenizer, prompt) -> list[int]:
    if prompt.is_completion or not getattr(tokenizer, "chat_template", None):
        return [int(t) for t in tokenizer(prompt.turns[0])["input_ids"]]
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt.turns[0]}],
                                         add_generation_prompt=True, tokenize=False)
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


def machine() -> dict:
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "load_avg": os.getloadavg(),
            "commit": git_commit()}


class Variant:
    """A named engine built from a drafter spec (``specdecode.build``); ``fresh`` rebuilds it (a new global suffix
    tree) per workload."""

    def __init__(self, name: str, target, spec: str, draft=None) -> None:
        self.name, self.target, self.spec, self.draft = name, target, DrafterSpec.parse(spec), draft
        self.fresh()

    def fresh(self) -> None:
        self.engine = build_engine(self.target, self.spec, draft=self.draft, num_speculative_tokens=1).engine
        self.proposer = self.engine.proposer

    def run(self, ids: list[int], params: SamplingParams) -> dict:
        t0 = time.perf_counter()
        out = self.engine.generate(ids, params)
        wall = time.perf_counter() - t0
        m = out.metrics
        rec = {"tokens": out.token_ids, "wall_s": wall, "n": len(out.token_ids),
               "steps": m.num_verify_steps, "step_tokens": m.num_step_tokens, "drafted": m.num_drafted_tokens,
               "accepted": m.num_accepted_tokens, "draft_s": m.draft_time_s, "verify_s": m.verify_time_s,
               "prefill_s": m.prefill_time_s, "tree_nodes": m.num_tree_nodes, "tree_steps": m.num_tree_steps,
               "tree_depth": m.tree_depth_sum, "tree_accepted_depth": m.tree_accepted_depth_sum}
        stats = getattr(self.proposer, "stats", None)
        if stats is not None:
            rec["suffix_stats"] = {k: getattr(stats, k) for k in
                                   ("steps", "suffix_steps", "fallback_steps", "empty_steps", "propose_time_s",
                                    "index_time_s")}
        return rec


def summarize(runs: list[dict], plain: list[dict]) -> dict:
    """Figures of one variant over prompts; wall excludes nothing (prefill included, as users see it)."""
    wall = sum(r["wall_s"] for r in runs)
    base = sum(r["wall_s"] for r in plain)
    decode = sum(r["wall_s"] - r["prefill_s"] for r in runs)
    decode_base = sum(r["wall_s"] - r["prefill_s"] for r in plain)
    steps = sum(r["steps"] for r in runs)
    tree_steps = sum(r["tree_steps"] for r in runs)
    out = {
        "tokens": sum(r["n"] for r in runs),
        "tok_s": sum(r["n"] for r in runs) / wall,
        "speedup": base / wall,
        "median_speedup": statistics.median(p["wall_s"] / r["wall_s"] for r, p in zip(runs, plain)),
        "decode_speedup": decode_base / decode,
        "tau": sum(r["step_tokens"] for r in runs) / steps if steps else 0.0,
        "drafted_per_step": sum(r["drafted"] for r in runs) / steps if steps else 0.0,
        "draft_ms_per_step": 1e3 * sum(r["draft_s"] for r in runs) / steps if steps else 0.0,
        "verify_ms_per_step": 1e3 * sum(r["verify_s"] for r in runs) / steps if steps else 0.0,
        "mean_tree_size": sum(r["tree_nodes"] for r in runs) / tree_steps if tree_steps else 0.0,
        "mean_accepted_depth": sum(r["tree_accepted_depth"] for r in runs) / tree_steps if tree_steps else 0.0,
        "accepted_per_step": sum(r["accepted"] for r in runs) / steps if steps else 0.0,
        "greedy_mismatches": sum(r["tokens"] != p["tokens"] for r, p in zip(runs, plain)),
    }
    st = [r["suffix_stats"] for r in runs if "suffix_stats" in r]
    if st:
        out["suffix_propose_ms_per_step"] = 1e3 * sum(s["propose_time_s"] for s in st) / max(1, sum(s["steps"] for s in st))
        out["suffix_index_ms_per_prompt"] = 1e3 * sum(s["index_time_s"] for s in st) / len(st)
        out["fallback_share"] = sum(s["fallback_steps"] for s in st) / max(1, sum(s["steps"] for s in st))
    return out


def run_workload(name: str, variants: list[Variant], prompts: list[list[int]], params: SamplingParams,
                 log, fresh: bool = True) -> dict[str, list[dict]]:
    if fresh:  # warm up (first-call costs stay out of the timings), then start from empty proposer state
        for v in variants:
            v.engine.generate(prompts[0][:64], SamplingParams(max_new_tokens=4))
            v.fresh()
    runs: dict[str, list[dict]] = {v.name: [] for v in variants}
    for i, ids in enumerate(prompts):
        order = variants[i % len(variants):] + variants[: i % len(variants)]
        for v in order:
            runs[v.name].append(v.run(ids, params))
        log(f"{name} prompt {i + 1}/{len(prompts)} ({len(ids)} tokens): " + ", ".join(
            f"{v.name} {runs[v.name][-1]['wall_s']:.1f}s" for v in variants))
    return runs


def table(title: str, summary: dict[str, dict]) -> str:
    cols = ["variant", "tok/s", "speedup", "median speedup", "tau", "drafted/step", "accepted/step", "draft ms", "verify ms", "mismatch"]
    lines = [f"### {title}", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for name, s in summary.items():
        extra = f" (suffix {s['suffix_propose_ms_per_step']:.2f} ms)" if "suffix_propose_ms_per_step" in s else ""
        lines.append(f"| {name} | {s['tok_s']:.2f} | {s['speedup']:.2f}x | {s['median_speedup']:.2f}x | {s['tau']:.2f} | "
                     f"{s['drafted_per_step']:.1f} | {s['accepted_per_step']:.2f} | "
                     f"{s['draft_ms_per_step']:.1f}{extra} | {s['verify_ms_per_step']:.1f} | {s['greedy_mismatches']} |")
    return "\n".join(lines)


@torch.inference_mode()
def verify_cost(model, context: list[int], sizes: list[int], reps: int = 3) -> dict:
    """Least seconds of one target forward of n new tokens: a causal chain vs a tree (ancestor mask),
    through the engine's default forward (``make_runner``: the owned forward for Llama / Qwen2)."""
    runner = make_runner(model, "auto").row(0)  # one slot, the single-sequence API
    runner.reset()
    runner.forward(context, last_only=True)
    out = {}
    for n in sizes:
        chain, tree_t = [], []
        parents = [-1] + [max(0, (i - 1) // 2) for i in range(1, n)]  # a binary-ish tree
        for r in range(reps + 1):
            t = time.perf_counter()
            runner.forward(context[:n])
            chain.append(time.perf_counter() - t)
            runner.rollback(len(context))
            t = time.perf_counter()
            runner.forward_tree(context[:n], parents)
            tree_t.append(time.perf_counter() - t)
            runner.rollback(len(context))
        out[n] = {"chain_ms": 1e3 * min(chain[1:]), "tree_ms": 1e3 * min(tree_t[1:])}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", choices=("suffix", "tree"))
    ap.add_argument("--target")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--gamma", type=int, default=8, help="suffix: depth cap; tree: chain gamma = tree depth")
    ap.add_argument("--nodes", default="15", help="node budget(s), comma-separated")
    ap.add_argument("--kernel", choices=("default", "small-row"), default="small-row")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default="bench-out/trees")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    log = lambda msg: print(f"[bench_trees] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=0)
    report = {"workload": args.workload, "machine": machine(), "args": vars(args), "batch_size": 1}
    nodes = [int(n) for n in args.nodes.split(",")]
    if args.workload == "suffix":
        target_spec = args.target or "smollm2-135m"
        t0 = time.perf_counter()
        target = load_model(target_spec, progress=False)
        report["load_s"] = time.perf_counter() - t0
        if args.kernel == "small-row":
            use_small_row_matmul(target.model)
        tok = target.tokenizer
        model = target.model
        report["verify_cost"] = verify_cost(model, encode(tok, load_prompts("spec-bench:summarization:1")[0])[:200],
                                            [1, 2, 4, 8, 12, 16, 24, 32])
        log(f"verify cost: {report['verify_cost']}")
        g = args.gamma
        variants = [Variant("plain", target, "none"),
                    Variant("ngram k=5", target, "ngram:k=5"),
                    Variant(f"ngram k={g}", target, f"ngram:k={g}")]
        for n in nodes:
            variants.append(Variant(f"suffix k={g} N={n}", target, f"suffix:k={g},max_spec_nodes={n}"))
        variants.append(Variant(f"suffix:ngram k={g} N={nodes[0]}", target,
                                f"suffix:k={g},max_spec_nodes={nodes[0]},min_score=1.0,fallback=(ngram)"))
        workloads = {"spec-bench/summarization": f"spec-bench:summarization:{args.limit}",
                     "spec-bench/rag": f"spec-bench:rag:{args.limit}"}
        report["models"] = {"target": target.name, "source": str(target.source)}
        results = {}
        for wname, spec in workloads.items():
            prompts = [encode(tok, p) for p in load_prompts(spec)]
            runs = run_workload(wname, variants, prompts, params, log)
            results[wname] = {"dataset": spec, "runs": runs}
        he = [encode(tok, p) for p in load_prompts(f"humaneval:{args.limit}")]
        first = run_workload("humaneval pass 1", variants, he, params, log, fresh=True)
        second = run_workload("humaneval pass 2", variants, he, params, log, fresh=False)
        results["repeated humaneval: pass 1"] = {"dataset": f"humaneval:{args.limit}", "runs": first}
        results["repeated humaneval: pass 2"] = {"dataset": f"humaneval:{args.limit} (again)", "runs": second}
        results["repeated humaneval: both"] = {
            "dataset": f"humaneval:{args.limit} x2", "runs": {k: first[k] + second[k] for k in first}}
    else:
        target_spec = args.target or "qwen2.5-coder-1.5b"
        t0 = time.perf_counter()
        target = load_model(target_spec, progress=False)
        draft = load_model(args.draft, progress=False)
        report["load_s"] = time.perf_counter() - t0
        if args.kernel == "small-row":
            use_small_row_matmul(target.model)
            use_small_row_matmul(draft.model)
        tok = target.tokenizer
        report["models"] = {"target": target.name, "draft": draft.name}
        d = args.gamma
        variants = [Variant("plain", target, "none"),
                    Variant(f"chain k={d}", target, f"draft-model:k={d},model={args.draft}", draft)]
        for n in nodes:
            variants.append(Variant(f"dynamic depth={d} N={n}", target, f"tree-draft:k={d},model={args.draft},"
                                    f"kind=dynamic,num_nodes={n},top_k=4,max_depth={d}", draft))
        prompts = [encode(tok, p) for p in load_prompts(f"humaneval:{args.limit}")]
        results = {"humaneval": {"dataset": f"humaneval:{args.limit}",
                                 "runs": run_workload("humaneval", variants, prompts, params, log)}}
    text = []
    for wname, res in results.items():
        runs = res["runs"]
        res["summary"] = {k: summarize(v, runs["plain"]) for k, v in runs.items()}
        text.append(table(f"{wname} ({res['dataset']})", res["summary"]))
    report["results"] = results
    report["machine_after"] = {"load_avg": os.getloadavg()}
    head = (f"# {args.workload}: target {report['models']}, {args.kernel} kernel, threads {torch.get_num_threads()}, "
            f"temperature {args.temperature}, {args.max_new_tokens} new tokens, batch 1, "
            f"load avg {report['machine']['load_avg'][0]:.1f} -> {os.getloadavg()[0]:.1f}")
    print(head + "\n\n" + "\n\n".join(text))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = out_dir / f"{args.workload}-{stamp}.json"
    path.write_text(json.dumps(report, indent=1))
    (out_dir / f"{args.workload}-{stamp}.md").write_text(head + "\n\n" + "\n\n".join(text) + "\n")
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
