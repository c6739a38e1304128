"""Per-precision decode time and T_verify(k) / T_decode(1), next to the memory-bandwidth floor
(a program, not a test; run it alone on the machine, it times things).

    python scripts/bench/verify_cost.py --target qwen2.5-coder-1.5b --precisions fp32,bf16,int8 --threads 1

For each weight precision the target is loaded and run with the forward backend given
(default: owned), after a context of --context tokens: one cached forward of k + 1 new tokens
(a verification of k draft tokens; k = 0 is a decoding step), the least of --repeats timings.
Next to it: the bytes of weights one step reads (every linear layer, the LM head included,
and the norms; one embedding row) and the floor bytes / copy bandwidth, with the copy
bandwidth measured here (STREAM-style copy of a 512 MiB buffer: read + write bytes / time).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from specdecode.kv import make_runner
from specdecode.lowbit import set_weight_precision
from specdecode.lowbit import LOWBIT_TYPES
from specdecode.models import load_model

DTYPE_OF = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.float32}


def copy_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """STREAM-style copy bandwidth in bytes/s (read + write) with torch's current threads."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best


def step_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decoding step reads: linear layers (low-bit: values + scales), norms."""
    total, seen = 0, set()
    for module in model.modules():
        if isinstance(module, LOWBIT_TYPES):
            total += module.weight_nbytes()
            continue
        if isinstance(module, torch.nn.Embedding):
            continue  # one row per token
        for p in module.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
    return total  # a tied LM head is counted once (through the head; embeddings are skipped)


def measure(runner, context: list[int], ks: list[int], repeats: int) -> dict[int, float]:
    runner.reset()
    runner.forward(context, last_only=True)
    out = {}
    for k in ks:
        best = float("inf")
        for r in range(repeats + 1):
            t = time.perf_counter()
            runner.forward(list(range(100, 100 + k + 1)))
            dt = time.perf_counter() - t
            runner.rollback(len(context))
            if r:
                best = min(best, dt)
        out[k] = best
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m", help="model spec (default: %(default)s)")
    ap.add_argument("--precisions", default="fp32,bf16,int8", help="comma-separated (default: %(default)s)")
    ap.add_argument("--backend", default="owned", choices=("owned", "hf"),
                    help="forward: the project's own or Hugging Face's (default: %(default)s)")
    ap.add_argument("--context", type=int, default=200, help="tokens cached before timing (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=7, help="timings per k; the least counts (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", help="also write every figure to this JSON file")
    args = ap.parse_args()
    unknown = [x for x in args.precisions.split(",") if x not in DTYPE_OF]
    if unknown:
        ap.error(f"unknown precision(s) {unknown}; choose from {', '.join(DTYPE_OF)}, e.g. --precisions fp32,bf16,int8")
    if args.threads:
        torch.set_num_threads(args.threads)
    bw = copy_bandwidth()
    context = list(range(1000, 1000 + args.context))
    ks = list(range(0, 9))
    rows = {}
    for precision in args.precisions.split(","):
        lm = load_model(args.target, dtype=DTYPE_OF[precision], progress=False)
        if precision == "int8":
            set_weight_precision(lm.model, "int8")
        runner = make_runner(lm.model, args.backend).row(0)
        times = measure(runner, context, ks, args.repeats)
        nbytes = step_bytes(lm.model)
        rows[precision] = {"times_s": times, "step_bytes": nbytes, "floor_s": nbytes / bw}
        del runner, lm
    print(f"# {args.target}, {args.backend} forward, context {args.context}, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, {platform.processor() or platform.machine()}; least of {args.repeats}; "
          f"copy bandwidth {bw / 1e9:.1f} GB/s")
    print("| precision | weights read / step | floor (bytes / bandwidth) | T_decode(1) | tok/s | T/floor | "
          + " | ".join(f"k={k}" for k in ks[1:]) + " |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in ks[1:]) + " |")
    for name, r in rows.items():
        t = r["times_s"]
        print(f"| {name} | {r['step_bytes'] / 1e6:.0f} MB | {r['floor_s'] * 1e3:.1f} ms | {t[0] * 1e3:.1f} ms | "
              f"{1 / t[0]:.1f} | {t[0] / r['floor_s']:.2f} | " + " | ".join(f"{t[k] / t[0]:.2f}" for k in ks[1:]) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": args.target, "backend": args.backend, "context": args.context,
                       "threads": torch.get_num_threads(), "copy_bandwidth_bytes_per_s": bw, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    from specdecode.types import SpecDecodeError

    try:
        main()
    except SpecDecodeError as exc:  # a wrong model name or path: one line, like the CLI
        raise SystemExit(f"error: {exc}") from None
