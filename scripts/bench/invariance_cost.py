"""What the batch-invariant forward costs per step (a program, not a test; it times things).

    python scripts/bench/invariance_cost.py --target smollm2-135m --precision bf16 --context 800

The same loaded model, two owned runners side by side: the batch-invariant one (products as
zero-padded 16-row blocks, float64 attention on a float64 cache: what makes speculative output
equal plain decoding) and the fast one (torch's own kernels, the model's dtype). After --context
cached tokens, each times a forward of k + 1 new tokens (k = 0: a decoding step; k >= 1: a
verification of k draft tokens), the modes interleaved round by round, the least of --rounds
timings kept. Prints milliseconds per forward and invariant / fast per k, with the machine.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specdecode.bench.env import cpu_flags, cpu_model
from specdecode.lowbit import set_weight_precision
from specdecode.kv.owned import OwnedRunner
from specdecode.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--context", type=int, default=800, help="cached tokens before timing (default: %(default)s)")
    ap.add_argument("--ks", default="0,1,2,4,5,8", help="draft tokens per verification (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=7, help="timings per mode and k; the least counts")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(args.target, progress=False)
    set_weight_precision(lm.model, args.precision)
    ks = [int(k) for k in args.ks.split(",")]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, lm.model.config.vocab_size, (args.context + max(ks) + 1,), generator=gen).tolist()
    rows = {}
    for mode in ("invariant", "fast"):
        row = OwnedRunner(lm.model, 1, batch_invariant=mode == "invariant").row(0)
        row.forward(ids[: args.context], last_only=True)
        rows[mode] = row
    best = {(mode, k): float("inf") for mode in rows for k in ks}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for k in ks:
                for mode, row in rows.items():
                    t0 = time.perf_counter()
                    row.forward(ids[args.context : args.context + k + 1])
                    best[mode, k] = min(best[mode, k], time.perf_counter() - t0)
                    row.rollback(args.context)
    load = open("/proc/loadavg").read().split()[0]
    print(f"# {args.target} {args.precision}, context {args.context}, {args.threads} threads, best of {args.rounds}; "
          f"{cpu_model()} [{' '.join(cpu_flags())}], torch {torch.__version__}, 1-min load {load}")
    print("| k (draft tokens) | invariant ms | fast ms | invariant / fast | invariant T(k) / fast T(0) |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for k in ks:
        inv, fast = best["invariant", k], best["fast", k]
        print(f"| {k} | {1e3 * inv:.1f} | {1e3 * fast:.1f} | {inv / fast:.2f} | {inv / best['fast', ks[0]]:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": args.target, "precision": args.precision, "context": args.context,
                       "threads": args.threads, "load": load, "cpu": cpu_model(), "flags": cpu_flags(),
                       "ms": {f"{m}:{k}": 1e3 * v for (m, k), v in best.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
