#!/usr/bin/env python
"""The scaling cost model of docs/scaling.md, evaluated on the measured inputs (a program, not a test).

Reads the JSON of ``scripts/bench/scaling_inputs.py`` (the Qwen pair's and SmolLM2's) and prints the three
analyses as Markdown, every figure from ``specdecode.costmodel``:

1. pipeline speculation (draft on one core, target on the other, overlapped) against serial
   speculation and plain decoding on both cores, per gamma, for an i.i.d. acceptance ``--alpha``;
2. tensor parallelism + speculation for the Qwen pair at TP 2 / 4 / 8: all-reduces and bytes per
   verification step, the head split, the time with this machine's gloo latency and with a GPU-class
   latency and bandwidth given as parameters (not measured here), and whether the draft is replicated;
3. replicas against a larger batch: tokens/s of one process at batch B on both cores against two
   replicas at B / 2 on one core each (decoding steps only; the load test has the whole requests).

    python scripts/bench/scaling_model.py --qwen docs/results/scaling/inputs_qwen_coder.json \\
        --smollm2 docs/results/scaling/inputs_smollm2.json > docs/results/scaling/model.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdecode.costmodel import (
    expected_tokens,
    pipelined_step_time,
    replicate_draft,
    survival_iid,
    tensor_parallel_forward_seconds,
)

#: The Qwen2.5-Coder pair's shapes (the converted config.json) and weight bytes per step.
QWEN_15B = {"layers": 28, "hidden": 1536, "heads": 12, "kv_heads": 2, "bf16_bytes": 3.09e9, "int4_bytes": 1.12e9}
QWEN_05B = {"layers": 24, "hidden": 896, "heads": 14, "kv_heads": 2, "bf16_bytes": 0.99e9, "int4_bytes": 0.49e9}


def _median(d: dict, *path: str) -> float:
    for p in path:
        d = d[p]
    return d["median_s"]


def verify_seconds(contention: dict, rows: int) -> float:
    """T_verify(rows) at one thread, linear between the measured row counts (decode = 1 row)."""
    points = {1: _median(contention, "target_decode")}
    points.update({int(k): v["median_s"] for k, v in contention["target_verify"].items()})
    xs = sorted(points)
    if rows in points:
        return points[rows]
    lo = max(x for x in xs if x < rows) if rows > xs[0] else xs[0]
    hi = min((x for x in xs if x > rows), default=xs[-1])
    if hi == lo:
        return points[lo] * rows / lo
    return points[lo] + (points[hi] - points[lo]) * (rows - lo) / (hi - lo)


def pipeline_table(q: dict, alpha: float, max_gamma: int) -> list[str]:
    c = q["contention"]
    t_plain_2 = _median(c, "target_decode_2_threads")
    speedup_2 = c["two_threads_speedup"]  # the target's 1 -> 2 thread speedup, applied to the draft and verify
    t_draft_1 = _median(c, "draft_decode")
    t_draft_1c = _median(c, "draft_decode_with_target_running")
    slow_target = max(1.0, c["slowdown"]["target_with_draft"])  # contended verify: the decode's slowdown, >= 1
    out = [f"Inputs (1 thread unless said): T_plain = target decode at 2 threads {t_plain_2 * 1e3:.1f} ms; draft "
           f"decode {t_draft_1 * 1e3:.1f} ms alone, {t_draft_1c * 1e3:.1f} ms beside the target; the target's "
           f"verification from the measured rows (2 / 4 / 6 / 8), times {slow_target:.2f} beside the draft; serial "
           f"speculation on 2 threads divides the 1-thread times by the target's measured 2-thread speedup "
           f"{speedup_2:.2f}. Acceptance i.i.d. alpha = {alpha}.", "",
           "| gamma | E[tokens] | P(all kept) | serial step ms (2 threads) | serial speedup | pipelined step ms (1 + 1 "
           "thread) | pipelined speedup |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for g in range(1, max_gamma + 1):
        s = survival_iid(alpha, g)
        e = expected_tokens(s, g)
        t_verify_1 = verify_seconds(c, g + 1)
        serial = (g * t_draft_1 + t_verify_1) / speedup_2
        piped = pipelined_step_time(s, g, t_draft_1c, t_verify_1 * slow_target)
        out.append(f"| {g} | {e:.2f} | {s[-1]:.2f} | {serial * 1e3:.0f} | {e * t_plain_2 / serial:.2f}x | "
                   f"{piped * 1e3:.0f} | {e * t_plain_2 / piped:.2f}x |")
    return out


def tp_table(smol: dict, gamma: int, gpu_latency: float, gpu_bandwidth: float, gpu_link: float) -> list[str]:
    ar = [r for r in smol["allreduce"]["rows"] if r["dtype"] == "bfloat16"]
    cpu_latency = sorted(r["median_us"] for r in ar)[len(ar) // 2] * 1e-6
    rows = gamma + 1
    t, d = QWEN_15B, QWEN_05B
    out = [f"Verification of gamma + 1 = {rows} rows, bf16 activations (2 bytes), 2 all-reduces per layer "
           f"(attention output, MLP output). Latency per all-reduce: this machine's gloo, median of the bf16 sizes "
           f"{cpu_latency * 1e6:.0f} us (measured); GPU-class NVLink {gpu_latency * 1e6:.0f} us, HBM "
           f"{gpu_bandwidth / 1e12:.1f} TB/s, link {gpu_link / 1e9:.0f} GB/s (parameters, not measured here).", "",
           "| TP | query heads / device (1.5B, 0.5B) | KV heads / device | all-reduces per target step | bytes per "
           "all-reduce | bytes sent per device per step | comm. at gloo latency | 1.5B bf16 step on GPU | "
           "draft token: replicated / sharded (GPU) |", "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for p in (1, 2, 4, 8):
        heads = f"{t['heads'] / p:g}, {d['heads'] / p:g}"
        kv = f"{max(1, t['kv_heads'] // p)}" + (" (replicated)" if p > t["kv_heads"] else "")
        n_ar = 2 * t["layers"] if p > 1 else 0
        message = rows * t["hidden"] * 2
        per_device = n_ar * 2 * (p - 1) / p * message
        comm_cpu = n_ar * cpu_latency
        gpu_step = tensor_parallel_forward_seconds(t["bf16_bytes"], gpu_bandwidth, p, t["layers"], rows, t["hidden"],
                                                   2, gpu_latency, gpu_link)
        keep, rep, shard = replicate_draft(d["bf16_bytes"], gpu_bandwidth, p, d["layers"], d["hidden"], 2,
                                           gpu_latency, gpu_link)
        draft = "-" if p == 1 else f"{rep * 1e6:.0f} / {shard * 1e6:.0f} us: {'replicate' if keep else 'shard'}"
        out.append(f"| {p} | {heads} | {kv} | {n_ar} | {message:,} | {per_device / 1e6:.2f} MB | "
                   f"{comm_cpu * 1e3:.1f} ms | {gpu_step * 1e3:.2f} ms | {draft} |")
    return out


def batch_table(name: str, inputs: dict) -> list[str]:
    b = {(r["threads"], r["batch"]): r["median_s"] for r in inputs["batch"]["rows"]}
    slow = inputs["contention"]["slowdown"].get("target_with_target", 1.0)
    out = [f"**{name}**: one process at 2 threads, batch B, against two replicas at 1 thread each, batch B / 2 "
           f"each, their steps times {slow:.2f} (one replica's step beside another's, measured).", "",
           "| B | one process tok/s | two replicas tok/s | replicas / one |", "| ---: | ---: | ---: | ---: |"]
    for batch in (2, 4, 8):
        one = batch / b[(2, batch)]
        two = 2 * (batch // 2) / (b[(1, batch // 2)] * slow)
        out.append(f"| {batch} | {one:.1f} | {two:.1f} | {two / one:.2f} |")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--qwen", default="docs/results/scaling/inputs_qwen_coder.json")
    ap.add_argument("--smollm2", default="docs/results/scaling/inputs_smollm2.json")
    ap.add_argument("--alpha", type=float, default=0.86,
                    help="i.i.d. acceptance of the 0.5B draft (its greedy top-1 agreement with the 1.5B: 86%%)")
    ap.add_argument("--max-gamma", type=int, default=6)
    ap.add_argument("--gamma", type=int, default=5, help="TP table: draft length (rows = gamma + 1)")
    ap.add_argument("--gpu-latency", type=float, default=8e-6, help="seconds per small all-reduce (NVLink class)")
    ap.add_argument("--gpu-bandwidth", type=float, default=4.8e12, help="HBM bytes/s per device (H200 class)")
    ap.add_argument("--gpu-link", type=float, default=450e9, help="all-reduce bytes/s per device (NVLink class)")
    args = ap.parse_args()
    q = json.loads(Path(args.qwen).read_text())
    smol = json.loads(Path(args.smollm2).read_text())
    lines = ["## 1. Pipeline speculation: Qwen2.5-Coder 1.5B int4 + 0.5B int4, this machine", "",
             *pipeline_table(q, args.alpha, args.max_gamma), "",
             "## 2. Tensor parallelism + speculation: the Qwen pair", "",
             *tp_table(smol, args.gamma, args.gpu_latency, args.gpu_bandwidth, args.gpu_link), "",
             "## 3. Replicas against a larger batch (decoding steps)", "",
             *batch_table("SmolLM2-135M int4", smol), "", *batch_table("Qwen2.5-Coder 1.5B int4", q)]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
