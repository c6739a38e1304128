#!/usr/bin/env python
"""Load test of ``specdecode serve`` on loopback: correctness under concurrency, memory, throughput.

Two phases, each against a server started here as a subprocess on 127.0.0.1
(nothing else is contacted; everything is bounded in count and time):

1. **stress**: ``--requests`` streaming requests (default 500) from ``--concurrency``
   clients (default 8) with mixed prompts (Spec-Bench chat questions and HumanEval
   completions), lengths, temperatures, top-p / top-k, seeds and stop strings.
   Checks: no HTTP or stream errors; every stream ends with a finish reason and
   ``[DONE]``; the token ids streamed equal ``usage.completion_tokens`` (nothing lost
   or duplicated) and "length" streams carry exactly ``max_tokens`` tokens; each
   greedy request is re-run without streaming afterwards and must give the same ids
   and the same text as its concatenated deltas (so the deltas lost and duplicated
   nothing, and batching changed nothing). Reports the server's resident memory
   after warm-up, at the end, and its peak.
2. **throughput**: greedy chat requests (default: Spec-Bench summarization articles,
   where prompt lookup has text to copy) at concurrency 1, 4 and 8, against a server
   with speculation (``--draft``, draft-length ``--policy``, default the cost model), with a
   fixed gamma, and without speculation (``--draft none``); tokens/s = generated tokens / wall time of the
   level, prefill included. Greedy decoding is lossless, so all three generate the
   same tokens.

Prints tables and writes JSON (``--out``). Run the heavy part under the shared lock:

    flock /tmp/specdecode-heavy.lock python scripts/bench/load_test.py --requests 500
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

HOST = "127.0.0.1"


# --------------------------------------------------------------------------- server process


class ServerProcess:
    """``python -m specdecode.server`` on a free loopback port."""

    def __init__(self, target: str, draft: str, gamma: int, batch: int, queue: int, policy: str,
                 extra: list[str] | None = None, replicas: int | None = None) -> None:
        with socket.socket() as s:
            s.bind((HOST, 0))
            self.port = s.getsockname()[1]
        self.args = [sys.executable, "-m", "specdecode.server", "--target", target, "--draft", draft,
                     "-k", str(gamma), "--max-batch-size", str(batch), "--max-queue", str(queue),
                     "--host", HOST, "--port", str(self.port), "--log-level", "warning",
                     "--served-model-name", "model", "--policy", policy, *(extra or [])]
        self.desc = f"draft={draft} gamma={gamma} policy={policy} batch={batch}"
        self.replicas = replicas
        if replicas is not None:  # Ray Serve: N replicas behind one endpoint
            self.args += ["--replicas", str(replicas)]
            self.desc += f" replicas={replicas}"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def __enter__(self) -> "ServerProcess":
        self.log = open(f"/tmp/load_test_server_{self.port}.log", "w")  # noqa: SIM115 - Ray logs a lot: a file, not a pipe
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=self.log, text=True)
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {Path(self.log.name).read_text()[-2000:]}")
            try:
                r = httpx.get(f"{self.url}/health", timeout=2)
                if r.status_code == 200 and (self.replicas is None or len(r.json()["replicas"]) == self.replicas):
                    return self
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.5)
        raise RuntimeError("server did not become healthy in 600 s")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # --replicas: SIGTERM stops the replicas and the local Ray cluster
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()

    def rss_mb(self) -> float:
        return psutil.Process(self.proc.pid).memory_info().rss / 2**20

    def metrics(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        out = {}
        for fam in text_string_to_metric_families(httpx.get(f"{self.url}/metrics").text):
            for s in fam.samples:
                key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}"
                                if s.labels else "")
                out[key] = s.value
        return out


# --------------------------------------------------------------------------- requests


@dataclass
class Job:
    """One request of the load: endpoint, body, and what came back."""

    endpoint: str
    body: dict
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None
    error: str | None = None
    seconds: float = 0.0
    done_marker: bool = False
    chunks: int = 0
    first_token_s: float | None = None  # request start to its first streamed token


async def stream_job(client: httpx.AsyncClient, url: str, job: Job, timeout: float) -> None:
    """POST with stream=true, parse the SSE chunks, collect text, ids, finish reason and usage."""
    body = {**job.body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}{job.endpoint}", json=body, timeout=timeout) as resp:
            if resp.status_code != 200:
                job.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    job.done_marker = True
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    job.error = f"stream error: {chunk['error']}"
                    continue
                if chunk.get("usage"):
                    job.usage = chunk["usage"]
                for c in chunk.get("choices", []):
                    if c.get("token_ids") and job.first_token_s is None:
                        job.first_token_s = time.perf_counter() - t0
                    job.chunks += 1
                    job.text += c.get("text") if "text" in c else (c.get("delta", {}).get("content") or "")
                    job.token_ids += c.get("token_ids", [])
                    if c.get("finish_reason"):
                        job.finish_reason = c["finish_reason"]
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        job.error = f"{type(exc).__name__}: {exc}"
    finally:
        job.seconds = time.perf_counter() - t0


async def run_jobs(url: str, jobs: list[Job], concurrency: int, time_limit: float, timeout: float) -> float:
    """Run ``jobs`` from ``concurrency`` workers; stop taking new ones after ``time_limit`` s. Returns wall s."""
    queue: asyncio.Queue = asyncio.Queue()
    for j in jobs:
        queue.put_nowait(j)
    start = time.perf_counter()
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(limits=limits) as client:
        async def worker():
            while not queue.empty() and time.perf_counter() - start < time_limit:
                await stream_job(client, url, queue.get_nowait(), timeout)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - start


def check_jobs(url: str, jobs: list[Job], recheck_greedy: int) -> dict:
    """Count problems: errors, missing [DONE] / finish reason, ids vs usage, length, greedy re-runs."""
    ran = [j for j in jobs if j.seconds > 0]
    problems: list[str] = []
    for i, j in enumerate(ran):
        tag = f"job {i} ({j.endpoint}, max_tokens {j.body['max_tokens']}, T {j.body.get('temperature')})"
        if j.error:
            problems.append(f"{tag}: {j.error}")
            continue
        if not j.done_marker or j.finish_reason is None or j.usage is None:
            problems.append(f"{tag}: stream ended without finish_reason / usage / [DONE]")
            continue
        if len(j.token_ids) != j.usage["completion_tokens"]:
            problems.append(f"{tag}: streamed {len(j.token_ids)} ids, usage says {j.usage['completion_tokens']}")
        if j.finish_reason == "length" and len(j.token_ids) != j.body["max_tokens"]:
            problems.append(f"{tag}: finish 'length' after {len(j.token_ids)} of {j.body['max_tokens']} tokens")
    greedy = [j for j in ran if not j.error and j.body.get("temperature") == 0][:recheck_greedy]
    mismatches = 0
    with httpx.Client(timeout=600) as client:
        for j in greedy:
            r = client.post(f"{url}{j.endpoint}", json={**j.body, "stream": False})
            if r.status_code != 200:
                problems.append(f"re-run HTTP {r.status_code}")
                continue
            c = r.json()["choices"][0]
            text = c["text"] if "text" in c else c["message"]["content"]
            if c["token_ids"] != j.token_ids or text != j.text:
                mismatches += 1
                problems.append(f"greedy re-run differs{near_tie(client, url, j, c['token_ids'])}: streamed "
                                f"{j.text[:60]!r} vs {text[:60]!r}")
    return {"ran": len(ran), "not_run": len(jobs) - len(ran), "errors": sum(1 for j in ran if j.error),
            "greedy_rechecked": len(greedy), "greedy_mismatches": mismatches, "problems": problems[:20],
            "num_problems": len(problems)}


def near_tie(client: httpx.Client, url: str, job: Job, rerun_ids: list[int]) -> str:
    """Where a batched greedy stream and its solo re-run part, and the target's top-2 logprob gap there.

    A float32 target can flip a greedy near-tie between batch shapes (a different summation order);
    a gap of ~1e-5 nats says that is what happened, a large gap would be a bug.
    """
    a, b = job.token_ids, rerun_ids
    i = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
    body = {**job.body, "stream": False, "max_tokens": i + 1, "logprobs": 2}
    if job.endpoint.endswith("chat/completions"):
        body.update(logprobs=True, top_logprobs=2)
    r = client.post(f"{url}{job.endpoint}", json=body)
    try:
        lp = r.json()["choices"][0]["logprobs"]
        tops = lp["content"][i]["top_logprobs"] if "content" in lp else list(lp["top_logprobs"][i].values())
        vals = [t["logprob"] if isinstance(t, dict) else t for t in tops]
        return f" at token {i} (top-2 logprob gap {abs(vals[0] - vals[1]):.2e} nats)"
    except (KeyError, IndexError, TypeError, ValueError):
        return f" at token {i}"


# --------------------------------------------------------------------------- workloads


def load_texts(max_chars: int) -> tuple[list[str], list[str]]:
    """Chat questions (Spec-Bench, all categories) and completion prompts (HumanEval), cut to max_chars."""
    from specdecode.data import load_prompts

    chat = [p.turns[0][:max_chars] for p in load_prompts("spec-bench")]
    code = [p.turns[0][:max_chars] for p in load_prompts("humaneval")]
    return chat, code


def stress_jobs(n: int, chat: list[str], code: list[str], seed: int) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        temperature = rng.choice([0.0, 0.0, 0.7, 1.0])
        body = {"model": "model", "max_tokens": rng.choice([4, 8, 16, 32, 48, 64, 96]), "temperature": temperature,
                "seed": rng.randrange(10**6)}
        if temperature:
            body.update(top_p=rng.choice([1.0, 0.9, 0.8]), top_k=rng.choice([0, 0, 20, 50]))
        if rng.random() < 0.15:
            body["stop"] = rng.choice([["\n\n"], [". "], ["return"], ["\n", "def "]])
        if rng.random() < 0.5:
            jobs.append(Job("/v1/chat/completions", {**body, "messages": [{"role": "user", "content": rng.choice(chat)}]}))
        else:
            jobs.append(Job("/v1/completions", {**body, "prompt": rng.choice(code)}))
    return jobs


def throughput_jobs(n: int, prompts: list[str], max_tokens: int, ignore_eos: bool) -> list[Job]:
    """Greedy chat requests over ``prompts`` in order. Greedy speculative decoding commits the same tokens
    as plain decoding, so every configuration generates the same text and the tokens/s compare like with like."""
    body = {"model": "model", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": ignore_eos}
    return [Job("/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompts[i % len(prompts)]}]})
            for i in range(n)]


# --------------------------------------------------------------------------- phases


def phase_stress(args, chat, code) -> dict:
    jobs = stress_jobs(args.requests, chat, code, args.seed)
    with ServerProcess(args.target, args.draft, args.gamma, args.max_batch_size, args.max_queue, args.policy,
                       args.server_args) as srv:
        warm = [Job(j.endpoint, {**j.body, "max_tokens": 4}) for j in jobs[:4]]
        asyncio.run(run_jobs(srv.url, warm, 4, 300, 300))
        rss_start = srv.rss_mb()
        peak = rss_start
        stop = False

        async def watch():
            nonlocal peak
            while not stop:
                peak = max(peak, srv.rss_mb())
                await asyncio.sleep(1.0)

        rss_waves = []

        async def main():
            nonlocal stop
            w = asyncio.create_task(watch())
            wall, t0 = 0.0, time.perf_counter()
            for start in range(0, len(jobs), args.rss_every):  # waves, to see whether memory keeps growing
                left = args.time_limit - (time.perf_counter() - t0)
                if left <= 0:
                    break
                wall += await run_jobs(srv.url, jobs[start: start + args.rss_every], args.concurrency, left,
                                       args.request_timeout)
                rss_waves.append(round(srv.rss_mb(), 1))
                print(f"  {min(len(jobs), start + args.rss_every)} requests: server RSS {rss_waves[-1]:.0f} MB",
                      flush=True)
            stop = True
            await w
            return wall

        wall = asyncio.run(main())
        rss_end = srv.rss_mb()
        checks = check_jobs(srv.url, jobs, args.recheck_greedy)
        m = srv.metrics()
    ran = [j for j in jobs if j.seconds > 0 and not j.error]
    tokens = sum(len(j.token_ids) for j in ran)
    return {
        "server": srv.desc, "requests": args.requests, "rss_every": args.rss_every, "concurrency": args.concurrency, "wall_s": wall,
        "tokens": tokens, "tokens_per_s": tokens / wall if wall else 0.0,
        "latency_p50_s": statistics.median(j.seconds for j in ran) if ran else None,
        "rss_mb_after_warmup": rss_start, "rss_mb_end": rss_end, "rss_mb_peak": peak, "rss_mb_waves": rss_waves,
        "acceptance_rate": _ratio(m, "specdecode_accepted_tokens_total", "specdecode_draft_tokens_total"),
        "mean_batch_size": _ratio(m, "specdecode_batch_size_sum", "specdecode_batch_size_count"),
        "mean_gamma": _ratio(m, "specdecode_draft_length_sum", "specdecode_draft_length_count"),
        **checks,
    }


def phase_throughput(args) -> list[dict]:
    """Every configuration's server up at once (one serving at a time); levels x configs interleaved,
    ``--repeats`` rounds; a cell reports its fastest round (on a shared machine noise only adds time)."""
    from specdecode.data import load_prompts

    prompts = [p.turns[0][: args.throughput_chars] for p in load_prompts(args.throughput_prompts)]
    configs = [(f"{args.draft}, policy {args.policy}", args.draft, args.policy),
               (f"{args.draft}, fixed gamma {args.gamma}", args.draft, "fixed"),
               ("none (plain decoding)", "none", "fixed")]
    runs: dict[tuple[str, int], list[dict]] = {}
    with contextlib.ExitStack() as stack:
        servers = []
        for name, draft, policy in configs:
            srv = stack.enter_context(ServerProcess(args.target, draft, args.gamma, max(args.levels), args.max_queue,
                                                    policy, args.server_args))
            asyncio.run(run_jobs(srv.url, throughput_jobs(2, prompts[-2:], 8, False), 2, 300, 300))  # warm-up
            servers.append((name, srv))
        for rep in range(args.repeats):
            for c in args.levels:
                for name, srv in servers:
                    before = srv.metrics()
                    jobs = throughput_jobs(args.throughput_requests_per_client * c, prompts, args.throughput_tokens,
                                           args.ignore_eos)
                    wall = asyncio.run(run_jobs(srv.url, jobs, c, args.time_limit, args.request_timeout))
                    after = srv.metrics()
                    ok = [j for j in jobs if j.seconds > 0 and not j.error]
                    tokens = sum(len(j.token_ids) for j in ok)
                    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
                    row = {"config": name, "concurrency": c, "round": rep, "requests": len(ok),
                           "errors": len(jobs) - len(ok), "tokens": tokens, "wall_s": wall,
                           "tokens_per_s": tokens / wall if wall else 0.0,
                           "acceptance_rate": _ratio(d, "specdecode_accepted_tokens_total",
                                                     "specdecode_draft_tokens_total"),
                           "tau": _ratio(d, "specdecode_generation_tokens_total", "specdecode_verify_steps_total"),
                           "mean_gamma": _ratio(d, "specdecode_draft_length_sum", "specdecode_draft_length_count"),
                           "mean_batch_size": _ratio(d, "specdecode_batch_size_sum", "specdecode_batch_size_count"),
                           "load_avg_1m": os.getloadavg()[0]}
                    runs.setdefault((name, c), []).append(row)
                    print(f"  round {rep} {name:28s} c={c}: {row['tokens_per_s']:6.1f} tok/s ({tokens} tokens, "
                          f"{wall:.1f} s, acceptance {row['acceptance_rate']:.2f}, gamma {row['mean_gamma']:.2f}, "
                          f"batch {row['mean_batch_size']:.2f}, load {row['load_avg_1m']:.1f})", flush=True)
    best = []
    for rows in runs.values():
        top = max(rows, key=lambda r: r["tokens_per_s"])
        best.append({**top, "all_tokens_per_s": [round(r["tokens_per_s"], 2) for r in rows]})
    return best


def phase_replicas(args) -> list[dict]:
    """1 and 2 replicas on Ray Serve (``--replica-threads`` torch threads each), speculation on (``--draft``)
    and off, and one process with ``--single-threads`` threads for comparison: one server up at a time,
    configurations alternating round by round, ``--repeats`` rounds, the fastest round per cell. Greedy
    chat requests (every configuration must generate the same texts)."""
    from specdecode.data import load_prompts

    prompts = [p.turns[0][: args.throughput_chars] for p in load_prompts(args.throughput_prompts)]
    threads = ["--threads", str(args.replica_threads)]
    configs = []
    for n in args.replica_counts:
        for draft in (args.draft, "none"):
            configs.append((f"{n} replica{'s' if n > 1 else ''} x {args.replica_threads} thread, {draft}", draft,
                            n, threads))
    if args.single_threads:
        for draft in (args.draft, "none"):
            configs.append((f"1 process x {args.single_threads} threads, {draft}", draft, None,
                            ["--threads", str(args.single_threads)]))
    runs: dict[tuple[str, int], list[dict]] = {}
    # One server at a time: an idle local Ray cluster keeps ~0.15-0.2 of a core busy here, so servers left up
    # side by side would slow each other. Configurations alternate round by round instead.
    for rep in range(args.repeats):
        for name, draft, n, extra in configs:
            print(f"  round {rep}: starting {name} ...", flush=True)
            with ServerProcess(args.target, draft, args.gamma, args.max_batch_size, args.max_queue, "fixed",
                               [*args.server_args, *extra], replicas=n) as srv:
                asyncio.run(run_jobs(srv.url, throughput_jobs(4, prompts[-4:], 8, False), 4, 300, 300))  # warm-up
                for c in args.levels:
                    jobs = throughput_jobs(args.throughput_requests_per_client * c, prompts, args.throughput_tokens,
                                           args.ignore_eos)
                    wall = asyncio.run(run_jobs(srv.url, jobs, c, args.time_limit, args.request_timeout))
                    ok = [j for j in jobs if j.seconds > 0 and not j.error]
                    tokens = sum(len(j.token_ids) for j in ok)
                    lat = sorted(j.seconds for j in ok)
                    ttft = sorted(j.first_token_s for j in ok if j.first_token_s is not None)
                    row = {"config": name, "replicas": n, "concurrency": c, "round": rep, "requests": len(ok),
                           "errors": len(jobs) - len(ok), "tokens": tokens, "wall_s": wall,
                           "tokens_per_s": tokens / wall if wall else 0.0,
                           "latency_p50_s": statistics.median(lat) if lat else None,
                           "latency_p95_s": lat[min(len(lat) - 1, int(0.95 * len(lat)))] if lat else None,
                           "ttft_p50_s": statistics.median(ttft) if ttft else None,
                           "load_avg_1m": os.getloadavg()[0],
                           "texts": [j.text for j in ok]}
                    runs.setdefault((name, c), []).append(row)
                    print(f"  round {rep} {name:34s} c={c}: {row['tokens_per_s']:6.1f} tok/s, p50 latency "
                          f"{row['latency_p50_s'] or 0:.2f} s, p50 TTFT {row['ttft_p50_s'] or 0:.2f} s, errors "
                          f"{row['errors']}, load {row['load_avg_1m']:.1f}", flush=True)
    best = []
    for (name, c), rows in runs.items():
        top = max(rows, key=lambda r: r["tokens_per_s"])
        best.append({**{k: v for k, v in top.items() if k != "texts"},
                     "all_tokens_per_s": [round(r["tokens_per_s"], 2) for r in rows]})
    # greedy: configurations at the same torch thread count must generate the same texts, level by level
    # (a different thread count may flip a near-tie: the prefill's matrix products block by thread count)
    threads_of = {name: extra[-1] for name, _, _, extra in configs}
    reference: dict[tuple[str, int], list[str]] = {}
    for (name, c), rows in runs.items():
        reference.setdefault((threads_of[name], c), rows[0]["texts"])
    unequal = sorted({name for (name, c), rows in runs.items() if rows[0]["texts"] != reference[(threads_of[name], c)]})
    for row in best:
        row["greedy_texts_equal_at_equal_threads"] = not unequal
        row["configs_differing_from_their_thread_group"] = unequal
    return best


def print_replicas(rows: list[dict]) -> None:
    levels = sorted({r["concurrency"] for r in rows})
    print("\nreplicas (greedy chat, tokens/s of generated tokens, fastest round; p50 latency s):")
    print(f"  {'config':40s}" + "".join(f"{'c=' + str(c):>16s}" for c in levels))
    for name in dict.fromkeys(r["config"] for r in rows):
        cells = {r["concurrency"]: r for r in rows if r["config"] == name}
        print(f"  {name:40s}" + "".join(f"{cells[c]['tokens_per_s']:8.1f} ({cells[c]['latency_p50_s'] or 0:4.1f}s)"
                                         if c in cells else f"{'':16s}" for c in levels))
    print(f"  greedy texts equal at equal thread counts: {rows[0]['greedy_texts_equal_at_equal_threads']}"
          + (f" (differ: {rows[0]['configs_differing_from_their_thread_group']})"
             if rows[0]['configs_differing_from_their_thread_group'] else ""))


def _ratio(m: dict, num: str, den: str) -> float:
    d = m.get(den, 0.0)
    return m.get(num, 0.0) / d if d else 0.0


def print_report(result: dict) -> None:
    s = result.get("stress")
    if s:
        print(f"\nstress: {s['ran']} of {s['requests']} requests run, concurrency {s['concurrency']}, "
              f"{s['wall_s']:.0f} s, {s['tokens']} tokens ({s['tokens_per_s']:.1f} tok/s), p50 latency "
              f"{s['latency_p50_s']:.2f} s")
        print(f"  errors {s['errors']}, problems {s['num_problems']}, greedy re-runs {s['greedy_rechecked']} "
              f"(mismatches {s['greedy_mismatches']}); acceptance {s['acceptance_rate']:.1%}, mean batch "
              f"{s['mean_batch_size']:.2f}, mean gamma {s['mean_gamma']:.2f}")
        print(f"  server RSS: {s['rss_mb_after_warmup']:.0f} MB after warm-up, {s['rss_mb_end']:.0f} MB at the end, "
              f"peak {s['rss_mb_peak']:.0f} MB; after each {s.get('rss_every', '')} requests: {s['rss_mb_waves']}")
        for p in s["problems"]:
            print(f"  ! {p}")
    rows = result.get("throughput")
    if rows:
        levels = sorted({r["concurrency"] for r in rows})
        print("\nthroughput (greedy, ignore_eos, tokens/s of generated tokens):")
        print(f"  {'config':30s}" + "".join(f"{'c=' + str(c):>10s}" for c in levels))
        for name in dict.fromkeys(r["config"] for r in rows):
            cells = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["config"] == name}
            print(f"  {name:30s}" + "".join(f"{cells.get(c, 0):10.1f}" for c in levels))


def _cpu_flags() -> str:
    """The model name and the vector flags of lscpu (which kernels this CPU runs)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "")
    flags = next((ln.split(":", 1)[1].split() for ln in out.splitlines() if ln.startswith("Flags")), [])
    keep = [f for f in flags if f.startswith(("avx512", "amx", "avx2", "fma"))]
    return f"{model}; {' '.join(keep)}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default="ngram",
                    help="--draft of the server: ngram, suffix, suffix:ngram, layer-skip, a draft model spec, ...")
    ap.add_argument("-k", "--gamma", type=int, default=5)
    ap.add_argument("--policy", default="cost-model", choices=("fixed", "heuristic", "confidence", "cost-model"),
                    help="draft-length policy of the speculative server (default %(default)s)")
    ap.add_argument("--server-args", type=lambda s: s.split(), default=[],
                    help="more flags for every server, as one string: --server-args='--weights int8 --tree-nodes 8'")
    ap.add_argument("--requests", type=int, default=500, help="stress requests (default %(default)s)")
    ap.add_argument("--concurrency", type=int, default=8, help="stress clients (default %(default)s)")
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--max-queue", type=int, default=64)
    ap.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8])
    ap.add_argument("--throughput-requests-per-client", type=int, default=2)
    ap.add_argument("--throughput-tokens", type=int, default=96, help="max_tokens (default %(default)s)")
    ap.add_argument("--throughput-prompts", default="spec-bench:summarization",
                    help="prompt set of the throughput phase, as chat messages (default %(default)s: articles to "
                         "summarize, where prompt lookup finds text to copy)")
    ap.add_argument("--throughput-chars", type=int, default=2000, help="prompt cut (default %(default)s)")
    ap.add_argument("--ignore-eos", action="store_true", help="throughput requests run to max_tokens")
    ap.add_argument("--rss-every", type=int, default=100, help="stress requests per memory sample")
    ap.add_argument("--repeats", type=int, default=2, help="throughput rounds; the fastest counts")
    ap.add_argument("--recheck-greedy", type=int, default=100, help="greedy stress requests re-run without streaming")
    ap.add_argument("--max-prompt-chars", type=int, default=1200)
    ap.add_argument("--time-limit", type=float, default=1800, help="seconds per phase before no new requests start")
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--phases", default="stress,throughput",
                    help="comma-separated: stress, throughput, replicas (Ray Serve: 1 and 2 replicas)")
    ap.add_argument("--replica-counts", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2],
                    help="replicas phase: replica counts (default 1,2)")
    ap.add_argument("--replica-threads", type=int, default=1, help="replicas phase: torch threads per replica")
    ap.add_argument("--single-threads", type=int, default=2,
                    help="replicas phase: also one process without Ray at this many threads (0: not)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="load_test.json")
    args = ap.parse_args()
    chat, code = load_texts(args.max_prompt_chars)
    result = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                          "cpu_flags": _cpu_flags()},
              "args": vars(args)}
    phases = args.phases.split(",")
    if "stress" in phases:
        print(f"stress: {args.requests} requests, {args.concurrency} streaming clients ...", flush=True)
        result["stress"] = phase_stress(args, chat, code)
    if "throughput" in phases:
        print("throughput ...", flush=True)
        result["throughput"] = phase_throughput(args)
    if "replicas" in phases:
        print("replicas (Ray Serve) ...", flush=True)
        result["replicas"] = phase_replicas(args)
    print_report(result)
    if result.get("replicas"):
        print_replicas(result["replicas"])
    result["note"] = "tokens/s include prefill, HTTP and streaming; same machine, same run"
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.out}")
    bad = result.get("stress", {}).get("num_problems", 0) or any(r["errors"] for r in result.get("throughput", [])) \
        or any(r["errors"] for r in result.get("replicas", []))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
