"""``specdecode bench --verify-table``: what verifying k tokens costs, ours beside llama.cpp's, same GGUF file.

For each model and each k in ``ks``: the time of one forward of k new tokens after ``depth`` tokens of
context, ours (the owned forward on the file's own blocks, ``--weights int4``: fastest of ``repeats``)
and ``llama-bench -p k -d depth`` (built beside llama-server by ``--setup-peers llama-server``),
interleaved k by k so that both see the same machine. T(k) / T(1) is the verification cost in decoding
steps: speculation of gamma tokens pays off when tau exceeds T(gamma + 1) / T(1). Plain decoding (k = 1)
is also set against the byte limit (bytes per step / read bandwidth). Writes ``verify_table.md`` and
``verify_table.json`` in the output directory, with the CPU flags, the kernel variant and the load.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from specdecode.bench.env import environment
from specdecode.bench.roofline import READ_BYTES
from specdecode.threads import set_threads
from specdecode.errors import SpecDecodeError
from specdecode.paths import check_output_dir

#: Token counts of the table (the issue's k = 1, 2, 3, 4, 6, 8, 16).
KS = (1, 2, 3, 4, 6, 8, 16)


def llama_bench_times(binary: Path, gguf: Path, ks: Sequence[int], depth: int, threads: int,
                      repetitions: int) -> dict[int, float]:
    """Seconds per forward of k tokens after ``depth`` cached tokens, from ``llama-bench -o json``.

    Raises:
        SpecDecodeError: the binary failed or printed no result.
    """
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-d", str(depth), "-p", ",".join(map(str, ks)),
           "-n", "0", "-r", str(repetitions), "-o", "json"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        raise SpecDecodeError(f"llama-bench failed ({run.returncode}): {run.stderr.strip()[-300:]}")
    try:
        rows = json.loads(run.stdout)
    except ValueError:
        raise SpecDecodeError(f"llama-bench printed no JSON: {run.stdout[-200:]!r}") from None
    out = {}
    for row in rows:
        k = int(row.get("n_prompt", 0))
        if k and row.get("avg_ts"):
            out[k] = k / max(float(t) for t in row.get("samples_ts") or [row["avg_ts"]])  # the fastest repeat
    return out


def llama_bench_decode(binary: Path, gguf: Path, depth: int, threads: int, repetitions: int,
                       tokens: int = 32) -> float:
    """Seconds per decoded token (``llama-bench -n tokens -d depth``, fastest repeat)."""
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-d", str(depth), "-p", "0", "-n", str(tokens),
           "-r", str(repetitions), "-o", "json"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        raise SpecDecodeError(f"llama-bench failed ({run.returncode}): {run.stderr.strip()[-300:]}")
    rows = [r for r in json.loads(run.stdout) if int(r.get("n_gen", 0))]
    return 1.0 / max(float(t) for t in rows[0].get("samples_ts") or [rows[0]["avg_ts"]])


class OurForward:
    """One row of the owned forward on a model's GGUF blocks, for timing forwards of k tokens."""

    def __init__(self, spec: str, depth: int) -> None:
        # lazy: these pull in torch (start-up time)
        from specdecode.kv import make_runner
        from specdecode.lowbit import load_in_precision

        self.loaded = load_in_precision(spec, "int4", progress=False)
        self.runner = make_runner(self.loaded.model, "owned", max_context=depth + 64).row(0)
        vocab = self.runner.runner.vocab_size
        self.context = [(7919 * i + 13) % vocab for i in range(depth)]
        self.runner.forward(self.context, last_only=True)

    def time(self, k: int, repeats: int) -> float:
        """Seconds of one forward of k new tokens after the context: the fastest of ``repeats``."""
        best = float("inf")
        feed = [(31 * i + 5) % 1000 for i in range(k)]
        for _ in range(repeats + 1):  # one untimed
            start = time.perf_counter()
            self.runner.forward(feed)
            best = min(best, time.perf_counter() - start)
            self.runner.rollback(len(self.context))
        return best


def _load() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:
        return (float("nan"),) * 3


def run_table(models: Sequence[str], output: Path, *, ks: Sequence[int] = KS, depths: Sequence[int] = (256,),
              repeats: int = 5, threads: int | None = None, peer: bool = True,
              say: Callable[[str], None] = print) -> dict:
    """Measure the table for ``models`` (catalog names or .gguf paths); write it under ``output``.

    Raises:
        SpecDecodeError: an unwritable output, a model without a GGUF file, a failed llama-bench.
    """
    # lazy: these pull in torch, numpy (start-up time)
    import torch

    from specdecode.bench.llamaserver import binary as peer_binary
    from specdecode.bench.roofline import measure_read_bandwidth, weight_bytes_per_step
    from specdecode.lowbit import kernel_status, variant_table
    from specdecode.models import gguf_file


    check_output_dir(output, "--output", default=True)  # probed before anything loads; nothing left behind
    output.mkdir(parents=True, exist_ok=True)

    threads = set_threads(threads, say=say)  # None: one per core other processes leave idle
    bench_bin = peer_binary(name="llama-bench")
    if peer and not bench_bin.exists():
        raise SpecDecodeError(f"{bench_bin} is missing: run 'specdecode bench --setup-peers llama-server' first "
                              "(it builds llama-bench beside llama-server), or pass --no-peer")
    variant_table()  # choose (and name) the kernel variant before timing
    env = environment()
    bandwidth = measure_read_bandwidth(threads=threads, remeasure=True)
    result = {"environment": env, "kernel": kernel_status(), "threads": threads, "bandwidth_bytes_s": bandwidth,
              "load_at_start": _load(), "repeats": repeats, "models": []}
    for spec in models:
        gguf = gguf_file(spec, progress=False)
        for depth in depths:
            say(f"{spec}: depth {depth}: loading our forward")
            ours = OurForward(spec, depth)
            step_bytes = weight_bytes_per_step(ours.loaded.model)
            # the byte limit from a bandwidth measured now, beside the timings it divides (this VM's sum of 512 MiB
            # read 31-47 GB/s on one afternoon: a cached figure from another hour misstates the fraction)
            row = {"model": spec, "gguf": str(gguf), "depth": depth, "step_bytes": step_bytes, "ours_s": {},
                   "llama_s": {}, "bandwidth_bytes_s": measure_read_bandwidth(threads=threads, remeasure=True)}
            for k in ks:  # interleaved: ours, then llama.cpp, for each k
                row["ours_s"][k] = ours.time(k, repeats)
                if peer:
                    row["llama_s"].update(llama_bench_times(bench_bin, gguf, [k], depth, threads, repeats))
                say(f"  k={k}: ours {1e3 * row['ours_s'][k]:.1f} ms"
                    + (f", llama.cpp {1e3 * row['llama_s'].get(k, float('nan')):.1f} ms" if peer else ""))
            if peer:
                row["llama_decode_s"] = llama_bench_decode(bench_bin, gguf, depth, threads, repeats)
            result["models"].append(row)
            del ours
    result["load_at_end"] = _load()
    (output / "verify_table.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    (output / "verify_table.md").write_text(render(result), encoding="utf-8")
    return result


def render(result: dict) -> str:
    """The Markdown report of :func:`run_table`'s result."""
    env = result["environment"]
    peer = any(row["llama_s"] for row in result["models"])
    flags = " ".join(f for f in env["cpu_flags"] if re.match(r"(avx|fma|f16c|amx|sse4)", f))
    lines = [
        "# Verification cost: T(k) / T(1)" + (", ours beside llama.cpp (same GGUF file)" if peer else ", ours"),
        "",
        f"{env['cpu_model']}, {result['threads']} thread{'s' if result['threads'] != 1 else ''}; SIMD flags: {flags}",
        f"Kernel: {result['kernel']}; read bandwidth at the start (a sum of {READ_BYTES / 2**20:g} MiB) "
        f"{result['bandwidth_bytes_s'] / 1e9:.1f} GB/s; "
        f"load average at start {result['load_at_start'][0]:.2f}, at end {result['load_at_end'][0]:.2f}; "
        f"fastest of {result['repeats']} per figure"
        + (", ours and llama-bench interleaved k by k" if peer else "") + f"; {env['date']}",
        "",
    ]
    for row in result["models"]:
        ks = sorted(int(k) for k in row["ours_s"])
        ours = {int(k): v for k, v in row["ours_s"].items()}
        llama = {int(k): v for k, v in row["llama_s"].items()}
        bandwidth = row.get("bandwidth_bytes_s", result["bandwidth_bytes_s"])  # reports before 2026-12-05: the cached one
        limit = row["step_bytes"] / bandwidth
        lines += [f"## {row['model']} at {row['depth']} tokens of context", "",
                  "| | " + " | ".join(f"k={k}" for k in ks) + " |",
                  "| --- | " + " | ".join("---:" for _ in ks) + " |",
                  "| ours T(k) ms | " + " | ".join(f"{1e3 * ours[k]:.1f}" for k in ks) + " |",
                  "| ours T(k)/T(1) | " + " | ".join(f"{ours[k] / ours[1]:.2f}" for k in ks) + " |"]
        if llama:
            lines += ["| llama.cpp T(k) ms | " + " | ".join(f"{1e3 * llama[k]:.1f}" if k in llama else "-" for k in ks) + " |",
                      "| llama.cpp T(k)/T(1) | " + " | ".join(f"{llama[k] / llama[1]:.2f}" if k in llama and 1 in llama
                                                             else "-" for k in ks) + " |",
                      "| llama.cpp / ours (time) | " + " | ".join(f"{llama[k] / ours[k]:.2f}" if k in llama else "-"
                                                                for k in ks) + " |"]
        lines += ["", f"Plain decoding: ours {1 / ours[1]:.1f} tok/s (one forward of 1 token), "
                      f"{100 * limit / ours[1]:.0f}% of the byte limit ({row['step_bytes'] / 1e6:.0f} MB a step, "
                      f"{1e3 * limit:.1f} ms at {bandwidth / 1e9:.1f} GB/s, read just before these timings"
                      + ("; above 100%: the step read its weights faster than the sum did, so this bandwidth figure "
                         "is low, not the step impossible" if limit > ours[1] else "") + ")"
                  + (f"; llama.cpp {1 / row['llama_decode_s']:.1f} tok/s (llama-bench tg32)" if row.get("llama_decode_s")
                     else "") + ".", ""]
    return "\n".join(lines)
