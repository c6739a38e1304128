"""Where a decoding step stands against the machine's limits, per precision (a program, not a test).

For one model and each precision: the weight bytes one step reads (``bench.roofline``), the
machine's measured read bandwidth (cached), and the median time of a plain decoding step (one
token) and of a verification (k + 1 tokens) at a short and a long context, as the fraction of
the byte limit (weight bytes / bandwidth) they reach; the time the matrix products alone take
(every linear layer once, the kernel in isolation) beside it; and prefill throughput as a fraction
of the machine's measured matrix-product throughput for that precision (float32 / bfloat16 GEMM of
the model's own shapes). The target runs the project's own batch-invariant forward, as
``specdecode generate`` runs it.

    python scripts/bench/step_roofline.py --target smollm2-135m --precisions fp32,bf16,int8,int4 \\
        --contexts 14,2000 --json docs/results/lowbit/step_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time

import torch

from specdecode.bench.roofline import measure_read_bandwidth, weight_bytes_per_step
from specdecode.kv.owned import OwnedRunner
from specdecode.lowbit import kernel_status, load_in_precision


def _median(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _products_time(runner: OwnedRunner, rows: int, repeats: int) -> float:
    """Seconds for every linear layer and the LM head once on ``rows`` rows (the products alone)."""
    mods = [m for layer in runner.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [runner.lm_head]

    def width(m):
        if isinstance(m, torch.Tensor):
            return m.shape[1]
        return getattr(m, "in_features", None) or m.parts[0].in_features

    xs = [torch.randn(rows, width(m), dtype=runner.dtype if isinstance(m, torch.Tensor) else torch.float32) for m in mods]
    kernel = runner.row_kernel

    def run():
        from specdecode.kv.owned import _mm

        for m, x in zip(mods, xs):
            _mm(m, x, kernel)

    return _median(run, repeats)


def _gemm_flops(dtype: torch.dtype, repeats: int = 5) -> float:
    """The machine's matrix-product throughput for ``dtype`` (FLOP/s): 512 x 2048 @ 2048 x 2048."""
    a, b = torch.randn(512, 2048).to(dtype), torch.randn(2048, 2048).to(dtype)
    t = _median(lambda: a @ b, repeats)
    return 2 * 512 * 2048 * 2048 / t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--precisions", default="fp32,bf16,int8,int4")
    ap.add_argument("--contexts", default="14,2000", help="context lengths (tokens) at which steps are timed")
    ap.add_argument("--k", type=int, default=4, help="draft tokens of the timed verification (k + 1 rows)")
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens of the timed prefill")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    bandwidth = measure_read_bandwidth(threads=args.threads)
    flops = {"fp32": _gemm_flops(torch.float32), "bf16": _gemm_flops(torch.bfloat16)}
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu = next((line.split(":", 1)[1].strip() for line in flags.splitlines() if line.startswith("Model name")), "?")
    simd = sorted({f for f in flags.split() if f.startswith(("avx512", "amx", "avx_vnni", "avx2"))})
    rows = []
    for precision in args.precisions.split(","):
        loaded = load_in_precision(args.target, precision, progress=False)
        model = loaded.model
        nbytes = weight_bytes_per_step(model)
        limit_s = nbytes / bandwidth
        runner = OwnedRunner(model, 1, max(contexts) + args.k + args.prefill + 8)
        row = runner.row(0)
        ids = [1 + (i * 7919) % (runner.vocab_size - 2) for i in range(max(contexts))]
        out = {"precision": precision, "weight_bytes": nbytes, "byte_limit_tok_s": 1 / limit_s,
               "kv_dtype": str(runner.cache_dtype).removeprefix("torch."), "contexts": {}}
        for ctx in contexts:
            row.reset()
            row.forward(ids[:ctx], last_only=True)
            base = row.num_cached

            def step(n):
                row.forward(ids[:n])
                row.rollback(base)

            decode = _median(lambda: step(1), args.repeats)
            verify = _median(lambda: step(args.k + 1), args.repeats)
            out["contexts"][ctx] = {"decode_s": decode, "verify_s": verify, "decode_fraction": limit_s / decode,
                                    "verify_fraction": limit_s / verify, "verify_over_decode": verify / decode}
        out["products_1_s"] = _products_time(runner, 1, args.repeats)
        out["products_k1_s"] = _products_time(runner, args.k + 1, args.repeats)
        prompt = ids[: args.prefill]

        def prefill():
            row.reset()
            row.forward(prompt, last_only=True)

        t = _median(prefill, 3)
        def weights(m):  # of one product
            if isinstance(m, torch.Tensor):
                return m.numel()
            return sum(weights(p) for p in m.parts) if hasattr(m, "parts") else m.in_features * m.out_features

        params = sum(weights(m) for layer in runner.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down))
        gemm = flops["bf16" if precision == "bf16" else "fp32"]
        out.update(prefill_tok_s=args.prefill / t, prefill_fraction=2 * params * args.prefill / t / gemm,
                   gemm_flops=gemm)
        rows.append(out)
        runner.release()
        del loaded, model, runner
    lines = [f"# {args.target}: one step against the byte limit ({cpu}; {args.threads} threads; "
             f"read bandwidth {bandwidth / 1e9:.1f} GB/s; GEMM fp32 {flops['fp32'] / 1e9:.0f} / bf16 "
             f"{flops['bf16'] / 1e9:.0f} GFLOP/s; low-bit kernel: {kernel_status()})", "",
             f"SIMD flags: {' '.join(simd)}; torch {torch.__version__}; {platform.python_version()}", "",
             "| precision | weights MB / step | byte limit tok/s | " + " | ".join(
                 f"ctx {c}: decode ms (tok/s, % of limit) | ctx {c}: verify {args.k + 1} ms (× decode)" for c in contexts)
             + f" | products alone: 1 row / {args.k + 1} rows ms | prefill {args.prefill} tok/s (% of GEMM peak) |",
             "| --- | ---: | ---: | " + " | ".join("---: | ---:" for _ in contexts) + " | ---: | ---: |"]
    for r in rows:
        cells = []
        for c in contexts:
            x = r["contexts"][c]
            cells.append(f"{1e3 * x['decode_s']:.1f} ({1 / x['decode_s']:.0f}, {100 * x['decode_fraction']:.0f}%)")
            cells.append(f"{1e3 * x['verify_s']:.1f} ({x['verify_over_decode']:.2f}×)")
        lines.append(f"| {r['precision']} | {r['weight_bytes'] / 1e6:.0f} | {r['byte_limit_tok_s']:.0f} | "
                     + " | ".join(cells) + f" | {1e3 * r['products_1_s']:.1f} / {1e3 * r['products_k1_s']:.1f} | "
                     f"{r['prefill_tok_s']:.0f} ({100 * r['prefill_fraction']:.0f}%) |")
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": args.target, "cpu": cpu, "simd": simd, "threads": args.threads,
                       "bandwidth_bytes_s": bandwidth, "gemm_flops": flops, "kernel": kernel_status(),
                       "rows": rows, "table": lines}, f, indent=1)


if __name__ == "__main__":
    main()
