"""Benchmark: block verification (Sun et al. 2024) against token-level verification (a program, not a test).

Run it alone on the machine (it times things):

    flock /tmp/specdecode-heavy.lock python scripts/research/bench_verification.py \\
        --target smollm2-135m --draft smollm2-135m --draft-weights int8 \\
        --prompts spec-bench:writing:4 --temperatures 1.0,0.7 --gamma 4 --output bench-out/verification.json

Two engines over the same target and the same drafter choice, ``EngineConfig(verification="token")`` and
``"block"``, batch size 1, fixed gamma, sampled with ``coupled=False`` (the coupled mode verifies every row
as a greedy one, so block verification never runs in it) and no end-of-sequence token (fixed length).
For every temperature, prompt and seed both engines run back to back with the same seed (which one runs
first alternates), so both consume the same randomness stream and see the same machine load.

Prints per temperature: tau (tokens per target forward, bonus / recovered included) and acceptance of
each method, the block / token ratios of tau and of tokens/s, and the paired per-run tau difference
(mean +- standard error). Writes JSON: machine, models, data, gamma, temperatures, batch size, every run.

``--target tiny`` (with ``--draft tiny``) runs a pair of seeded random Llamas on random prompts: a
smoke run in seconds, not a measurement of anything real.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
from pathlib import Path

import torch

from specdecode.engine import EngineConfig, SpeculativeEngine
from specdecode.types import SamplingParams

METHODS = ("token", "block")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m", help="model spec (specdecode.models), or 'tiny'")
    p.add_argument("--draft", default="smollm2-135m",
                   help="drafter choice (specdecode.proposers.factory: a model spec, ngram, layer-skip, ...), "
                        "or 'tiny'")
    p.add_argument("--dtype", default="float32", help="load dtype of the target and a draft model")
    p.add_argument("--weights", default="fp32", choices=("fp32", "bf16", "int8"), help="target weight precision")
    p.add_argument("--draft-weights", default="int8", choices=("fp32", "bf16", "int8"),
                   help="draft-model weight precision (a draft of the target's spec in another precision is a "
                        "second, cheaper copy)")
    p.add_argument("--prompts", default="spec-bench:writing:4",
                   help="prompt set (specdecode.data.load_prompts spec); 'random:N' with --target tiny")
    p.add_argument("--no-chat", action="store_true", help="encode prompts raw, without the chat template")
    p.add_argument("--temperatures", default="1.0,0.7")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--gamma", type=int, default=4, help="draft length per step (fixed)")
    p.add_argument("--seeds", type=int, default=2, help="seeds per prompt and temperature")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output", default="bench-out/verification.json")
    return p.parse_args(argv)


def machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version()}


def tiny_pair(vocab: int = 256):
    """A seeded random Llama target (LM head x 8) and as its draft the same Llama with the head x 5 (float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def make(scale: float):
        torch.manual_seed(0)
        cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=512,
                          tie_word_embeddings=False)
        model = LlamaForCausalLM(cfg).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(scale)
        return model

    return make(8.0), make(5.0)  # the draft: the same weights with a flatter head (a hotter copy)


def build(args):
    """(target module, proposer factory, encoded prompts [(id, ids)], description)."""
    if args.target == "tiny":
        from specdecode.proposers import DraftModelProposer, NgramProposer

        target, draft = tiny_pair()
        n = int(args.prompts.partition(":")[2] or 8) if args.prompts.startswith("random") else 8
        g = torch.Generator().manual_seed(0)
        prompts = [(f"random-{i}", torch.randint(0, 256, (16,), generator=g).tolist()) for i in range(n)]
        factory = (lambda: NgramProposer()) if args.draft == "ngram" else (lambda: DraftModelProposer(draft))
        return target, factory, prompts, {"target": "tiny random Llama (2 layers, vocab 256)",
                                          "draft": "ngram" if args.draft == "ngram"
                                          else "the tiny target, LM head x 5/8",
                                          "data": f"random:{n} (16 tokens each)"}
    from specdecode.data import load_prompts
    from specdecode.lowbit import set_weight_precision
    from specdecode.models import load_model
    from specdecode.build import build_factory, load_draft_for
    from specdecode.spec import DrafterSpec

    loaded = load_model(args.target, dtype=args.dtype)
    set_weight_precision(loaded.model, args.weights)
    spec = DrafterSpec.parse(args.draft)
    draft = load_draft_for(spec, loaded, args.target, weights=args.weights, draft_weights=args.draft_weights,
                           dtype=args.dtype)
    factory = build_factory(spec, loaded, draft)
    if factory is None:
        sys.exit("--draft none: nothing to verify")
    tok = loaded.tokenizer
    prompts = []
    for p in load_prompts(args.prompts):
        text = p.turns[0]
        if args.no_chat or tok.chat_template is None:
            ids = tok(text)["input_ids"]
        else:
            chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=False)
            ids = tok(chat, add_special_tokens=False)["input_ids"]
        prompts.append((p.id, list(ids)))
    return loaded.model, factory, prompts, {"target": args.target, "weights": args.weights, "draft": args.draft,
                                            "draft_weights": args.draft_weights, "data": args.prompts}


def run(engine: SpeculativeEngine, ids: list[int], params: SamplingParams) -> dict:
    out = engine.generate(ids, params)
    m = out.metrics
    return {"tokens": m.num_generated_tokens, "step_tokens": m.num_step_tokens, "verify_steps": m.num_verify_steps,
            "drafted": m.num_drafted_tokens, "accepted": m.num_accepted_tokens, "tau": m.mean_accepted_length,
            "wall_s": m.wall_time_s, "tokens_per_s": m.tokens_per_s, "verify_s": m.verify_time_s}


def summarise(runs: list[dict]) -> dict:
    steps = sum(r["verify_steps"] for r in runs)
    drafted = sum(r["drafted"] for r in runs)
    return {"tau": sum(r["step_tokens"] for r in runs) / steps if steps else 0.0,
            "acceptance_rate": sum(r["accepted"] for r in runs) / drafted if drafted else 0.0,
            "tokens_per_s": sum(r["tokens"] for r in runs) / sum(r["wall_s"] for r in runs),
            "runs": len(runs)}


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    target, factory, prompts, described = build(args)
    engines = {m: SpeculativeEngine(target, factory(), EngineConfig(num_speculative_tokens=args.gamma,
                                                                      verification=m)) for m in METHODS}
    temps = [float(t) for t in args.temperatures.split(",")]
    record = {"machine": machine(), **described, "gamma": args.gamma, "temperatures": temps, "top_p": args.top_p,
              "batch_size": 1, "max_new_tokens": args.max_new_tokens, "seeds": args.seeds, "coupled": False,
              "results": []}
    print(f"target {described['target']}  draft {described['draft']}  data {described['data']}  gamma {args.gamma}  "
          f"batch 1  {args.max_new_tokens} tokens  {args.seeds} seed(s) x {len(prompts)} prompt(s)  "
          f"threads {torch.get_num_threads()}", flush=True)
    rows = []
    for temp in temps:
        runs: dict[str, list[dict]] = {m: [] for m in METHODS}
        for i, (pid, ids) in enumerate(prompts):
            for s in range(args.seeds):
                params = SamplingParams(temperature=temp, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                                        seed=1000 * i + s, coupled=False)
                order = METHODS if (i + s) % 2 == 0 else METHODS[::-1]
                for m in order:
                    r = run(engines[m], ids, params)
                    r.update(prompt_id=pid, seed=params.seed)
                    runs[m].append(r)
                print(f"  T={temp} {pid} seed {params.seed}: tau token {runs['token'][-1]['tau']:.2f} "
                      f"block {runs['block'][-1]['tau']:.2f}", flush=True)
        summary = {m: summarise(runs[m]) for m in METHODS}
        diffs = [b["tau"] - t["tau"] for t, b in zip(runs["token"], runs["block"])]
        se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
        result = {"temperature": temp, "summary": summary,
                  "tau_ratio": summary["block"]["tau"] / summary["token"]["tau"],
                  "tokens_per_s_ratio": summary["block"]["tokens_per_s"] / summary["token"]["tokens_per_s"],
                  "paired_tau_diff_mean": statistics.mean(diffs), "paired_tau_diff_se": se, "runs": runs}
        record["results"].append(result)
        rows.append(result)
    print(f"\n{'T':>5} {'tau token':>10} {'tau block':>10} {'acc token':>10} {'acc block':>10} {'tau ratio':>10} "
          f"{'tok/s ratio':>12} {'paired dtau':>16}")
    for r in rows:
        s = r["summary"]
        print(f"{r['temperature']:>5} {s['token']['tau']:>10.3f} {s['block']['tau']:>10.3f} "
              f"{s['token']['acceptance_rate']:>10.3f} {s['block']['acceptance_rate']:>10.3f} {r['tau_ratio']:>10.3f} "
              f"{r['tokens_per_s_ratio']:>12.3f} {r['paired_tau_diff_mean']:>+8.3f} +- {r['paired_tau_diff_se']:.3f}")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
