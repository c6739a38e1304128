"""Measure T_verify(k) / T_decode(1) for each forward backend on a real model (a program, not a test).

Usage: python scripts/verify_cost.py --target smollm2-135m [--context 200] [--repeats 7] [--json out.json]
Prints, per backend and k = 1..9, the median time of one forward of k new tokens
after a context of --context tokens, and its ratio to k = 1.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from specdecode.cache import CachedModel
from specdecode.fastforward import OwnedCachedModel, supports
from specdecode.kernels import use_small_row_matmul
from specdecode.models import load_model


def measure(runner, context: list[int], ks: list[int], repeats: int) -> dict[int, float]:
    runner.reset()
    runner.forward(context, last_only=True)
    out = {}
    for k in ks:
        times = []
        for r in range(repeats + 1):
            t = time.perf_counter()
            runner.forward(list(range(100, 100 + k)))
            dt = time.perf_counter() - t
            runner.rollback(len(context))
            if r:
                times.append(dt)
        out[k] = statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args()
    lm = load_model(args.target)
    context = list(range(1000, 1000 + args.context))
    ks = list(range(1, 10))
    results = {}
    results["hf"] = measure(CachedModel(lm.model), context, ks, args.repeats)
    if supports(lm.model):
        results["owned"] = measure(OwnedCachedModel(lm.model), context, ks, args.repeats)
    use_small_row_matmul(lm.model)
    results["hf+small-row-matmul"] = measure(CachedModel(lm.model), context, ks, args.repeats)
    print(f"# {args.target}, context {args.context}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"{platform.processor() or platform.machine()}; median of {args.repeats}")
    print("backend".ljust(22) + "T(1) ms".rjust(9) + "".join(f"{f'k={k}':>7}" for k in ks))
    for name, r in results.items():
        print(name.ljust(22) + f"{r[1] * 1000:9.1f}" + "".join(f"{r[k] / r[1]:7.2f}" for k in ks))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": args.target, "context": args.context, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
