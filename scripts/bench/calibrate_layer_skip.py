"""Choose and cache a layer-skip set for a target before benchmarking it (a program, not a test).

The search (``specdecode.layer_search``, SWIFT-style) runs on calibration prompts that are not
benchmark prompts: prompt number ``--offset`` (0-based) of each Spec-Bench category given, so a
benchmark with ``--limit`` <= offset never sees them. The chosen set is stored in the per-model
cache (keyed by model, dtype and weights), where ``--draft layer-skip`` and ``specdecode bench``
find it.

    python scripts/bench/calibrate_layer_skip.py --target smollm2-135m --dtype bfloat16 --threads 1
"""

from __future__ import annotations

import argparse

import torch

from specdecode.data import load_prompts
from specdecode.lowbit import set_weight_precision
from specdecode.layer_search import SearchConfig, choose_skip_layers
from specdecode.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--weights", default=None, choices=("fp32", "bf16", "int8"),
                    help="target weight precision after loading (the cache keys it)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--categories", default="writing,coding,math_reasoning,summarization")
    ap.add_argument("--offset", type=int, default=6, help="0-based prompt index used per category")
    ap.add_argument("--budget", type=float, default=150.0, help="search time budget (seconds)")
    ap.add_argument("--refresh", action="store_true", help="search even if a set is cached")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(args.target, dtype=args.dtype)
    if args.weights:
        set_weight_precision(lm.model, args.weights)
    prompts = []
    for cat in args.categories.split(","):
        p = load_prompts(f"spec-bench:{cat}")[args.offset]
        text = p.turns[0]
        if lm.tokenizer.chat_template:
            text = lm.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                    add_generation_prompt=True)
        prompts.append(lm.tokenizer(text, add_special_tokens=False)["input_ids"])
    result = choose_skip_layers(lm.model, prompts, SearchConfig(time_budget_s=args.budget), refresh=args.refresh)
    print(f"{args.target} {args.weights or args.dtype}: skip {list(result.skip_layers)} of {result.num_layers} layers, "
          f"gamma {result.gamma}, {result.tokens_per_s:.1f} tok/s vs plain {result.plain_tokens_per_s:.1f}, "
          f"acceptance {result.acceptance:.2f}")
    if result.loses:
        print(result.line())


if __name__ == "__main__":
    main()
