"""The measured inputs of the scaling cost model (docs/scaling.md), on this machine (a program, not a test).

Three parts (``--parts``), each timing a median of ``--repeats`` runs after a warm-up:

- ``contention`` (pipeline speculation: draft and target on different cores, sharing memory
  bandwidth). At one torch thread: the target's decoding step (one token after ``--context``
  cached tokens) and its verification of k + 1 tokens for each of ``--verify-rows``, and the draft's
  decoding step; then the target's step while a second process (this script in ``--worker`` mode,
  pinned to another core) runs the draft's decoding steps without pause, the draft's step while the
  second process runs the target's, and the target's step while it runs another copy of the target
  (two replicas); the slowdown is contended / alone. Last, the target's step alone at two threads.
- ``allreduce`` (tensor parallelism): two processes on this machine, gloo over TCP on 127.0.0.1, one
  thread each; the latency of one ``all_reduce`` of n float32 and bfloat16 elements for n in
  ``--allreduce-sizes`` (hidden size x rows), each preceded by a barrier so both ranks start together.
- ``batch`` (replicas against batch size): the target's decoding step for each batch size in
  ``--batches`` through the batched slot runner the engine uses (one ``runner.forward`` over B rows),
  at each thread count in ``--threads``.

Without ``--draft`` the draft's rows are skipped. The Markdown report goes to stdout, progress to
stderr; ``--json FILE`` writes every figure. The 1-minute load average is recorded before and after:
a busy machine inflates every figure.

    python scripts/bench/scaling_inputs.py --target smollm2-135m --json docs/results/scaling/inputs_smollm2.json
    python scripts/bench/scaling_inputs.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \\
        --json docs/results/scaling/inputs_qwen_coder.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

PARTS = ("contention", "allreduce", "batch")
DEFAULT_ALLREDUCE_SIZES = "896,5376,1536,9216,13824,21504"  # 896x1, 896x6, 1536x1, 1536x6, 1536x9, 3584x6
SIMD_PREFIXES = ("avx512", "amx", "avx_vnni", "avx2")
#: Warm-up steps the worker runs before it says it is running.
WORKER_WARMUP = 3


def say(message: str) -> None:
    """A progress line on stderr, at once."""
    print(message, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Timing:
    """Seconds: the median and the fastest of the timed runs (the warm-up excluded)."""

    median_s: float
    min_s: float
    runs: int


def time_runs(fn: Callable[[], None], repeats: int, warmup: int = 1) -> Timing:
    """Run ``fn`` ``warmup`` times, then time ``repeats`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return Timing(statistics.median(times), min(times), len(times))


# Machine ---------------------------------------------------------------------------


def machine_info() -> dict:
    """CPU model and SIMD flags (``lscpu``), CPUs usable here, torch and Python versions."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        text = ""
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = fields.get("Flags", "").split()
    return {
        "cpu": fields.get("Model name", platform.processor() or "unknown"),
        "simd": sorted(f for f in flags if f.startswith(SIMD_PREFIXES)),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def load_average() -> float:
    return os.getloadavg()[0]


@contextlib.contextmanager
def pinned(cpu: int | None):
    """Run the calling thread on ``cpu`` inside the block (None: leave it), then restore its CPU set."""
    if cpu is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def two_cpus() -> tuple[int | None, int | None]:
    """(this process's CPU, the worker's) for the contended timings; (None, None) with one CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    return (cpus[0], cpus[1]) if len(cpus) >= 2 else (None, None)


# Steps -----------------------------------------------------------------------------


def load(spec: str, weights: str):
    from specdecode.lowbit import load_in_precision

    return load_in_precision(spec, weights, progress=False)


class Stepper:
    """A model bound to a slot runner of ``slots`` rows, each holding ``context`` random cached tokens.

    A step feeds ``rows`` tokens to each of the first ``batch`` rows in one batched forward (what the
    engine runs), then rolls them back, so every step sees the same context.
    """

    def __init__(self, model: torch.nn.Module, context: int, slots: int = 1, seed: int = 0) -> None:
        from specdecode.kv import make_runner

        self.runner = make_runner(model, "auto", num_slots=slots)
        self.context = context
        gen = torch.Generator().manual_seed(seed)
        vocab = self.runner.vocab_size
        self.feed = torch.randint(0, vocab, (slots, 64), generator=gen).tolist()
        for s in range(slots):
            prompt = torch.randint(0, vocab, (context,), generator=gen).tolist()
            self.runner.forward(slice(s, s + 1), [prompt], last_only=True)

    def step(self, batch: int = 1, rows: int = 1) -> None:
        self.runner.forward(slice(0, batch), [f[:rows] for f in self.feed[:batch]])
        for s in range(batch):
            self.runner.rollback(s, self.context)

    def time(self, repeats: int, batch: int = 1, rows: int = 1) -> Timing:
        return time_runs(lambda: self.step(batch, rows), repeats)

    def release(self) -> None:
        self.runner.release()


def run_worker(args) -> None:
    """``--worker``: decoding steps of one model at one thread, without pause, until SIGTERM; then one
    JSON line on stdout with the steps run and their median time."""
    torch.set_num_threads(1)
    if args.worker_cpu is not None:
        os.sched_setaffinity(0, {args.worker_cpu})
    stepper = Stepper(load(args.worker, args.worker_weights).model, args.context)
    for _ in range(WORKER_WARMUP):
        stepper.step()
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    print("ready", flush=True)
    times = []
    with torch.inference_mode():
        while not stop:
            start = time.perf_counter()
            stepper.step()
            times.append(time.perf_counter() - start)
    print(json.dumps({"steps": len(times), "median_s": statistics.median(times) if times else None}), flush=True)


@contextlib.contextmanager
def worker(spec: str, weights: str, context: int, cpu: int | None):
    """A second process running ``spec``'s decoding steps (``--worker``) for the block's duration.

    Yields a dict that holds, after the block, the worker's own step count and median step time.
    """
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", spec, "--worker-weights", weights,
           "--context", str(context)]
    if cpu is not None:
        cmd += ["--worker-cpu", str(cpu)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    report: dict = {}
    try:
        line = proc.stdout.readline()
        if line.strip() != "ready":
            proc.wait()
            raise RuntimeError(f"the worker running {spec} stopped before it ran (exit status {proc.returncode})")
        yield report
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    lines = [x for x in out.splitlines() if x.startswith("{")]
    if lines:
        report.update(json.loads(lines[-1]))


def measure_contention(args, target, draft) -> dict:
    """Step times alone and while a second process on another core runs the other model's steps."""
    torch.set_num_threads(1)
    verify_rows = [int(r) for r in args.verify_rows.split(",")]
    here, there = two_cpus()
    out: dict = {"threads": 1, "context": args.context, "pinned_cpus": [here, there]}
    say(f"contention: {args.target} alone, 1 thread")
    tgt = Stepper(target.model, args.context)
    out["target_decode"] = asdict(tgt.time(args.repeats))
    out["target_verify"] = {str(r): asdict(tgt.time(args.repeats, rows=r)) for r in verify_rows}
    drf = None
    if draft is not None:
        say(f"contention: {args.draft} alone, 1 thread")
        drf = Stepper(draft.model, args.context)
        out["draft_decode"] = asdict(drf.time(args.repeats))
        say(f"contention: {args.target} while a second process runs {args.draft}")
        with worker(args.draft, args.draft_weights, args.context, there) as w, pinned(here):
            out["target_decode_with_draft_running"] = asdict(tgt.time(args.repeats))
        out["draft_worker_while_target_timed"] = w
    say(f"contention: {args.draft or args.target} while a second process runs {args.target}")
    with worker(args.target, args.weights, args.context, there) as w, pinned(here):
        if drf is not None:
            out["draft_decode_with_target_running"] = asdict(drf.time(args.repeats))
        out["target_decode_with_target_running"] = asdict(tgt.time(args.repeats))
    out["target_worker"] = w
    say(f"contention: {args.target} alone, 2 threads")
    torch.set_num_threads(2)
    out["target_decode_2_threads"] = asdict(tgt.time(args.repeats))
    torch.set_num_threads(1)
    pairs = {"target_with_draft": ("target_decode_with_draft_running", "target_decode"),
             "draft_with_target": ("draft_decode_with_target_running", "draft_decode"),
             "target_with_target": ("target_decode_with_target_running", "target_decode")}
    out["slowdown"] = {name: out[a]["median_s"] / out[b]["median_s"] for name, (a, b) in pairs.items() if a in out}
    out["two_threads_speedup"] = out["target_decode"]["median_s"] / out["target_decode_2_threads"]["median_s"]
    tgt.release()
    if drf is not None:
        drf.release()
    return out


# All-reduce ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def allreduce_rank(rank: int, port: int, sizes: Sequence[int], repeats: int) -> list[dict]:
    """One rank of the two-process gloo group: the all-reduce latency per dtype and size."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    rows = []
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for n in sizes:
                x = torch.zeros(n, dtype=dtype)  # zeros: the sum stays finite however often it runs
                row = {"dtype": str(dtype).removeprefix("torch."), "elements": n, "bytes": n * x.element_size()}
                try:
                    dist.all_reduce(x)
                except RuntimeError as e:  # a dtype gloo cannot reduce: both ranks fail alike, before sending
                    row["error"] = str(e).splitlines()[0]
                    rows.append(row)
                    continue

                times: list[float] = []

                def once():
                    dist.barrier()
                    start = time.perf_counter()
                    dist.all_reduce(x)
                    times.append(time.perf_counter() - start)

                for _ in range(5):
                    once()
                times.clear()
                for _ in range(repeats):
                    once()
                row.update(median_us=1e6 * statistics.median(times), min_us=1e6 * min(times), runs=len(times))
                rows.append(row)
    finally:
        dist.destroy_process_group()
    return rows


def measure_allreduce(args) -> dict:
    """Rank 0 here, rank 1 in a spawned process; rank 0's timings are reported."""
    torch.set_num_threads(1)
    sizes = [int(n) for n in args.allreduce_sizes.split(",")]
    port = free_port()
    say(f"allreduce: gloo, 2 processes, port {port}, {len(sizes)} sizes x float32 / bfloat16")
    peer = multiprocessing.get_context("spawn").Process(target=allreduce_rank,
                                                        args=(1, port, sizes, args.allreduce_repeats))
    peer.start()
    try:
        rows = allreduce_rank(0, port, sizes, args.allreduce_repeats)
    finally:
        peer.join(timeout=120)
        if peer.is_alive():
            peer.terminate()
    return {"backend": "gloo", "world_size": 2, "threads": 1, "rows": rows}


# Batch -----------------------------------------------------------------------------


def measure_batch(args, target) -> dict:
    """The target's decoding step per batch size, through one batched forward over B rows."""
    batches = [int(b) for b in args.batches.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    stepper = Stepper(target.model, args.context, slots=max(batches))
    rows = []
    for t in threads:
        torch.set_num_threads(t)
        for b in batches:
            say(f"batch: {args.target}, batch {b}, {t} thread(s)")
            timing = stepper.time(args.repeats, batch=b)
            rows.append({"threads": t, "batch": b, **asdict(timing),
                         "tokens_per_s": b / timing.median_s})
    torch.set_num_threads(1)
    stepper.release()
    return {"context": args.context, "rows": rows}


# Report ----------------------------------------------------------------------------


def ms(t: dict) -> str:
    return f"{1e3 * t['median_s']:.2f}"


def report(result: dict) -> str:
    m, s = result["machine"], result["settings"]
    lines = [f"# Scaling inputs: {s['target']} ({s['weights']})"
             + (f", draft {s['draft']} ({s['draft_weights']})" if s["draft"] else ""), "",
             f"CPU: {m['cpu']}; {m['cpus_usable']} CPUs usable; SIMD: {' '.join(m['simd']) or 'none listed'}; "
             f"torch {m['torch']}; Python {m['python']}.", "",
             f"1-minute load average: {result['load_before']:.2f} before, {result['load_after']:.2f} after. "
             f"Context {s['context']} tokens; medians of {s['repeats']} runs after a warm-up.", ""]
    c = result.get("contention")
    if c:
        pin = c["pinned_cpus"]
        where = f"this process on CPU {pin[0]}, the worker on CPU {pin[1]}" if pin[0] is not None else "not pinned"
        lines += ["## Step times alone and under contention (1 thread each)", "",
                  f"Contended: a second process runs the named model's decoding steps without pause ({where}).", "",
                  "| step | alone ms | contended ms | with | slowdown |", "| --- | ---: | ---: | --- | ---: |"]
        if "target_decode_with_draft_running" in c:
            lines.append(f"| target decode | {ms(c['target_decode'])} | {ms(c['target_decode_with_draft_running'])} | "
                         f"draft | {c['slowdown']['target_with_draft']:.2f}x |")
        if "draft_decode_with_target_running" in c:
            lines.append(f"| draft decode | {ms(c['draft_decode'])} | {ms(c['draft_decode_with_target_running'])} | "
                         f"target | {c['slowdown']['draft_with_target']:.2f}x |")
        lines.append(f"| target decode | {ms(c['target_decode'])} | {ms(c['target_decode_with_target_running'])} | "
                     f"target (2 replicas) | {c['slowdown']['target_with_target']:.2f}x |")
        lines += ["", "| target step alone | ms | x decode |", "| --- | ---: | ---: |",
                  f"| decode (1 row), 1 thread | {ms(c['target_decode'])} | 1.00 |"]
        for r, t in c["target_verify"].items():
            lines.append(f"| verify {r} rows, 1 thread | {ms(t)} | {t['median_s'] / c['target_decode']['median_s']:.2f} |")
        lines.append(f"| decode (1 row), 2 threads | {ms(c['target_decode_2_threads'])} | "
                     f"{c['target_decode_2_threads']['median_s'] / c['target_decode']['median_s']:.2f} |")
        if "draft_decode" in c:
            lines.append(f"| draft decode (1 row), 1 thread | {ms(c['draft_decode'])} | "
                         f"{c['draft_decode']['median_s'] / c['target_decode']['median_s']:.2f} |")
        lines.append("")
    a = result.get("allreduce")
    if a:
        lines += ["## All-reduce latency (gloo, 2 processes on this machine, 1 thread each)", "",
                  "| dtype | elements | bytes | median us | min us |", "| --- | ---: | ---: | ---: | ---: |"]
        for r in a["rows"]:
            if "error" in r:
                lines.append(f"| {r['dtype']} | {r['elements']} | {r['bytes']} | unsupported: {r['error']} | |")
            else:
                lines.append(f"| {r['dtype']} | {r['elements']} | {r['bytes']} | {r['median_us']:.1f} | "
                             f"{r['min_us']:.1f} |")
        lines.append("")
    b = result.get("batch")
    if b:
        base = {r["threads"]: r["median_s"] for r in b["rows"] if r["batch"] == 1}
        lines += ["## Batched decoding step (one forward over B rows)", "",
                  "| threads | batch | step ms | x batch 1 | tokens/s |", "| ---: | ---: | ---: | ---: | ---: |"]
        for r in b["rows"]:
            ratio = f"{r['median_s'] / base[r['threads']]:.2f}" if r["threads"] in base else ""
            lines.append(f"| {r['threads']} | {r['batch']} | {ms(r)} | {ratio} | {r['tokens_per_s']:.1f} |")
        lines.append("")
    return "\n".join(lines)


# Main ------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m", help="model spec (catalog name, directory, hub id, GGUF)")
    ap.add_argument("--draft", default=None, help="draft model spec (none: skip the draft's rows)")
    ap.add_argument("--weights", default="int4", help="the target's weight precision (fp32, bf16, int8, int4)")
    ap.add_argument("--draft-weights", default=None, help="the draft's precision (default: --weights)")
    ap.add_argument("--context", type=int, default=64, help="cached tokens before each timed step")
    ap.add_argument("--repeats", type=int, default=20, help="timed runs per step figure")
    ap.add_argument("--verify-rows", default="2,4,6,8", help="verification sizes k + 1 of the target")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--threads", default="1,2", help="torch threads of the batch part")
    ap.add_argument("--allreduce-sizes", default=DEFAULT_ALLREDUCE_SIZES, help="elements per all-reduce")
    ap.add_argument("--allreduce-repeats", type=int, default=50)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    ap.add_argument("--json", help="write every figure to this file")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run this model's steps until SIGTERM
    ap.add_argument("--worker-weights", default="int4", help=argparse.SUPPRESS)
    ap.add_argument("--worker-cpu", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.draft_weights = args.draft_weights or args.weights
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        ap.error(f"unknown part(s) {', '.join(sorted(unknown))}; choose from {', '.join(PARTS)}")
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        run_worker(args)
        return
    torch.set_num_threads(1)
    result = {"machine": machine_info(), "load_before": load_average(),
              "settings": {k: getattr(args, k) for k in ("target", "draft", "weights", "draft_weights", "context",
                                                          "repeats", "verify_rows", "batches", "threads",
                                                          "allreduce_sizes", "allreduce_repeats", "parts")}}
    say(f"{result['machine']['cpu']}; load average {result['load_before']:.2f}")
    target = draft = None
    if "contention" in args.parts or "batch" in args.parts:
        say(f"loading {args.target} ({args.weights})")
        target = load(args.target, args.weights)
    if args.draft and "contention" in args.parts:
        say(f"loading {args.draft} ({args.draft_weights})")
        draft = load(args.draft, args.draft_weights)
    with torch.inference_mode():
        if "contention" in args.parts:
            result["contention"] = measure_contention(args, target, draft)
        if "batch" in args.parts:
            result["batch"] = measure_batch(args, target)
    if "allreduce" in args.parts:
        result["allreduce"] = measure_allreduce(args)
    result["load_after"] = load_average()
    text = report(result)
    result["report"] = text
    print(text, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        say(f"wrote {args.json}")


if __name__ == "__main__":
    main()
