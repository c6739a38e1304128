"""Replicas on Ray Serve (``specdecode.server.replicas``): the routing, event and metrics logic without Ray, the
in-process ASGI driver on a tiny model, the options, and (integration) two SmolLM2-135M replicas on a local
Ray cluster behind one endpoint: 100 requests from 8 clients, equality with one process, both replicas used,
prefix affinity, and a replica killed mid-run."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdecode.server import build_state, create_app
from specdecode.server.relay import asgi_request, carries_output, merge_metrics, split_events
from specdecode.server.replicas import (
    ReplicaOptions,
    check_replica_options,
    rank_replicas,
    read_ray_config,
    routing_key,
    split_args,
)
from specdecode.types import SpecDecodeError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_CONFIG = ROOT / "docs" / "ray" / "serve_config.yaml"


# --------------------------------------------------------------------------- routing keys and ranks (no Ray)


def _chat(*messages: tuple[str, str], model: str = "m") -> bytes:
    return json.dumps({"model": model, "messages": [{"role": r, "content": c} for r, c in messages]}).encode()


def test_a_conversations_turns_share_one_key_and_conversations_differ():
    turn1 = _chat(("system", "be brief"), ("user", "name a prime"))
    turn2 = _chat(("system", "be brief"), ("user", "name a prime"), ("assistant", "7"), ("user", "another"))
    other = _chat(("system", "be brief"), ("user", "name a colour"))
    path = "/v1/chat/completions"
    assert routing_key(path, turn1) == routing_key(path, turn2) is not None
    assert routing_key(path, other) != routing_key(path, turn1)
    assert routing_key(path, _chat(("user", "x"), model="a")) != routing_key(path, _chat(("user", "x"), model="b"))


def test_completion_keys_use_the_prompt_prefix():
    path = "/v1/completions"
    long = "def f(x):\n" + "    y = x\n" * 100
    key = routing_key(path, json.dumps({"model": "m", "prompt": long}).encode(), prefix_chars=64)
    same_prefix = routing_key(path, json.dumps({"model": "m", "prompt": long + "more"}).encode(), prefix_chars=64)
    assert key == same_prefix is not None
    assert routing_key(path, json.dumps({"model": "m", "prompt": [long, "x"]}).encode(), prefix_chars=64) == key
    ids = routing_key(path, json.dumps({"model": "m", "prompt": [1, 2, 3]}).encode())
    assert ids is not None and ids != key


@pytest.mark.parametrize("path,body", [
    ("/v1/models", b""), ("/v1/completions", b"not json"), ("/v1/completions", b"[1, 2]"),
    ("/v1/chat/completions", b'{"messages": "hi"}'), ("/v1/completions", b'{"prompt": 5}'),
])
def test_no_key_when_there_is_no_prompt(path, body):
    assert routing_key(path, body) is None


def test_rank_replicas_keeps_a_keys_home_and_spreads_keys():
    replicas = ["a", "b", "c"]
    homes = {}
    for i in range(600):
        ranks = rank_replicas(f"k{i}", replicas, {})
        assert all(len(r) == 1 for r in ranks) and sorted(r[0] for r in ranks) == replicas
        homes[f"k{i}"] = ranks[0][0]
    counts = {r: list(homes.values()).count(r) for r in replicas}
    assert all(150 < n < 250 for n in counts.values()), counts  # rendezvous hashing spreads keys evenly
    # a replica leaving moves only its own keys
    for key, home in homes.items():
        new_home = rank_replicas(key, ["a", "b"], {})[0][0]
        assert new_home == home or home == "c"


def test_rank_replicas_lets_load_win_past_the_imbalance():
    key = "k1"
    home = rank_replicas(key, ["a", "b"], {})[0][0]
    other = "b" if home == "a" else "a"
    assert rank_replicas(key, ["a", "b"], {home: 7, other: 0}, imbalance=8) == [[home], [other]]
    assert rank_replicas(key, ["a", "b"], {home: 8, other: 0}, imbalance=8) == [[other, home]]
    assert rank_replicas(None, ["a", "b"], {}) == [["a", "b"]]
    assert rank_replicas("k", [], {}) == []


def test_events_that_carry_output():
    role = b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]}\n\n'
    assert not carries_output(role)
    assert carries_output(b'data: {"choices": [{"delta": {"content": "Hi"}, "token_ids": [5]}]}\n\n')
    assert carries_output(b'data: {"choices": [{"text": "x", "finish_reason": null}]}\n\n')
    assert not carries_output(b'data: {"choices": [{"text": "", "finish_reason": null, "token_ids": []}]}\n\n')
    assert carries_output(b'data: {"choices": [{"delta": {}, "finish_reason": "stop"}]}\n\n')
    assert carries_output(b'data: {"error": {"message": "x"}}\n\n')
    assert carries_output(b"data: [DONE]\n\n")
    assert not carries_output(b": keep-alive\n\n")
    events, rest = split_events(role + b"data: [DONE]\n\ndata: {\"cho")
    assert events == [role, b"data: [DONE]\n\n"] and rest == b'data: {"cho'


def test_merged_metrics_label_each_replica_once_per_family():
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    texts = {}
    for name, n in (("r1", 3), ("r2", 5)):
        reg = CollectorRegistry()
        c = Counter("specdecode_requests", "Requests", ["endpoint"], registry=reg)
        c.labels("chat").inc(n)
        texts[name] = generate_latest(reg).decode()
    own = CollectorRegistry()
    Counter("specdecode_replica_retries", "Retries", registry=own).inc(2)
    text = merge_metrics(texts, generate_latest(own).decode())
    assert text.count("# TYPE specdecode_requests_total counter") == 1
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples[("specdecode_requests_total", (("endpoint", "chat"), ("replica", "r1")))] == 3
    assert samples[("specdecode_requests_total", (("endpoint", "chat"), ("replica", "r2")))] == 5
    assert samples[("specdecode_replica_retries_total", ())] == 2


# --------------------------------------------------------------------------- options (no Ray)


@pytest.mark.parametrize("kw,flag", [
    ({"replicas": 0}, "--replicas"), ({"replicas": 2000}, "absurd"), ({"min_replicas": 3, "max_replicas": 2}, "above"),
    ({"replicas": 5, "max_replicas": 4}, "within"), ({"target_ongoing_requests": 0}, "--target-ongoing-requests"),
    ({"router": "random"}, "--router"), ({"retries": -1}, "--replica-retries"), ({"prefix_chars": 0}, "--prefix-chars"),
    ({"ray_config": "/no/such.yaml"}, "no such file"), ({"cpus_per_replica": -1.0}, "--cpus-per-replica"),
])
def test_bad_replica_options_are_refused(kw, flag):
    with pytest.raises(SpecDecodeError, match=flag):
        check_replica_options(ReplicaOptions(**kw))


def test_builder_arguments_are_typed_and_unknown_ones_named():
    serve_args, replica_args = split_args({"target": "smollm2-135m", "num_speculative_tokens": "3", "replicas": "2",
                                           "router": "prefix", "threads": "1", "target-ongoing-requests": "2.5"})
    assert serve_args == {"target": "smollm2-135m", "num_speculative_tokens": 3, "threads": 1}
    assert replica_args == {"replicas": 2, "router": "prefix", "target_ongoing_requests": 2.5}
    with pytest.raises(SpecDecodeError, match="unknown argument 'replics'"):
        split_args({"replics": 2})
    with pytest.raises(SpecDecodeError, match="expected int"):
        split_args({"replicas": "two"})
    with pytest.raises(SpecDecodeError, match="Ray Serve's"):
        split_args({"port": 9000})


def test_replicas_without_ray_say_what_to_install(monkeypatch):
    from specdecode.server import replicas

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(SpecDecodeError, match=r'pip install -e "\.\[ray\]"'):
        replicas.require_ray()


def test_serve_replicas_without_ray_says_what_to_install_before_loading():
    import subprocess

    script = ("import sys; sys.modules['ray'] = None\n"
              "from specdecode.cli import main\n"
              "code = main(['serve', '--replicas', '2', '--threads', '1'])\n"
              "print('torch' in sys.modules); sys.exit(code)")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert 'pip install -e ".[ray]"' in run.stderr and run.stdout.strip() == "False", (run.stdout, run.stderr)


def test_an_unreachable_ray_address_is_refused_at_once():
    from specdecode.server.replicas import _check_reachable

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
    t0 = time.time()
    with pytest.raises(SpecDecodeError, match="no Ray cluster answers there"):
        _check_reachable(f"127.0.0.1:{port}", timeout=5)
    assert time.time() - t0 < 6
    _check_reachable("auto")  # left to Ray


def test_target_ongoing_requests_needs_autoscaling():
    with pytest.raises(SpecDecodeError, match="--min-replicas and/or --max-replicas"):
        check_replica_options(ReplicaOptions(replicas=2, target_ongoing_requests=4))
    check_replica_options(ReplicaOptions(replicas=2, max_replicas=3, target_ongoing_requests=4))


def test_hop_by_hop_headers_are_not_forwarded():
    from specdecode.server.deployments import forwarded_headers

    given = [("Host", "x"), ("Connection", "keep-alive"), ("Transfer-Encoding", "chunked"), ("content-length", "5"),
             ("Authorization", "Bearer k"), ("set-cookie", "a=1"), ("set-cookie", "b=2"), ("X-Request-Id", "r")]
    assert forwarded_headers(given) == [("Authorization", "Bearer k"), ("set-cookie", "a=1"), ("set-cookie", "b=2"),
                                        ("X-Request-Id", "r")]


def test_app_builder_binds_the_three_deployments_without_a_cluster():
    pytest.importorskip("ray.serve")
    from ray.serve import Application

    from specdecode.server.replicas import ENGINE, INGRESS, app_builder

    app = app_builder({"target": "smollm2-135m", "replicas": "3", "router": "prefix", "threads": "1",
                       "min_replicas": "1", "max_replicas": "4"})
    assert isinstance(app, Application)
    ingress = app._bound_deployment
    assert ingress.name == INGRESS
    engine = ingress.init_args[0]._bound_deployment
    assert engine.name == ENGINE and engine.ray_actor_options["num_cpus"] == 1
    auto = engine._deployment_config.autoscaling_config
    assert (auto.min_replicas, auto.initial_replicas, auto.max_replicas) == (1, 3, 4)
    with pytest.raises(SpecDecodeError, match="--replicas 3 \\(the initial count\\) must lie within"):
        app_builder({"replicas": 3, "max_replicas": 2})


def test_the_example_ray_config_reads_and_a_wrong_one_is_refused(tmp_path):
    pytest.importorskip("ray.serve")
    config = read_ray_config(EXAMPLE_CONFIG)
    assert set(config["deployments"]) <= {"SpecdecodeEngine", "SpecdecodeIngress"}
    assert config["deployments"]["SpecdecodeEngine"]["autoscaling_config"]["max_replicas"] >= 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("applications:\n  - name: specdecode\n    import_path: x:y\n    deployments:\n"
                   "      - name: Other\n        num_replicas: 2\n")
    with pytest.raises(SpecDecodeError, match="'Other' is not one of specdecode's"):
        read_ray_config(bad)
    bad.write_text("applications: 5\n")
    with pytest.raises(SpecDecodeError, match="not a Ray Serve config"):
        read_ray_config(bad)


# --------------------------------------------------------------------------- the in-process driver (tiny model)


@pytest.fixture(scope="module")
def tiny_app(tiny_loaded):
    state = build_state(tiny_loaded, "ngram", model_name="tiny", policy="fixed")
    app = create_app(state)
    state.scheduler.start()
    yield state, app
    state.scheduler.close()


async def _run(app, method, path, body=b"", headers=()):
    status, hdrs, chunks = None, None, []
    async for m in asgi_request(app, method, path, headers=list(headers), body=body):
        if m[0] == "start":
            status, hdrs = m[1], m[2]
        else:
            chunks.append(m[1])
    return status, dict(hdrs), chunks


def test_the_driver_answers_as_the_app_does(tiny_app):
    state, app = tiny_app
    body = {"model": "tiny", "prompt": "the cat and the", "max_tokens": 12, "temperature": 0}
    raw = json.dumps(body).encode()
    hdrs = [("content-type", "application/json"), ("content-length", str(len(raw)))]
    status, _, chunks = asyncio.run(_run(app, "POST", "/v1/completions", raw, hdrs))
    assert status == 200
    text = json.loads(b"".join(chunks))["choices"][0]["text"]
    stream_raw = json.dumps({**body, "stream": True}).encode()
    s_status, s_headers, s_chunks = asyncio.run(_run(app, "POST", "/v1/completions", stream_raw,
                                                     [("content-type", "application/json")]))
    assert s_status == 200 and s_headers["content-type"].startswith("text/event-stream")
    events, _ = split_events(b"".join(s_chunks))
    assert events[-1] == b"data: [DONE]\n\n" and len(s_chunks) > 2  # streamed as it came, not buffered
    streamed = "".join(json.loads(e[5:])["choices"][0]["text"] for e in events[:-1])
    assert streamed == text
    status, _, chunks = asyncio.run(_run(app, "GET", "/v1/nothing"))
    assert status == 404 and "no such endpoint" in json.loads(b"".join(chunks))["error"]["message"]


def test_closing_the_driver_mid_stream_cancels_the_request(tiny_app):
    state, app = tiny_app
    raw = json.dumps({"model": "tiny", "prompt": "the cat", "max_tokens": 200, "temperature": 0, "stream": True,
                      "ignore_eos": True}).encode()

    async def leave_early():
        gen = asgi_request(app, "POST", "/v1/completions", headers=[("content-type", "application/json")], body=raw)
        seen = 0
        async for m in gen:
            seen += m[0] == "body"
            if seen == 3:
                break
        await gen.aclose()

    def cancelled() -> float:
        return state.metrics.requests.labels("completions", "cancelled")._value.get()

    before = cancelled()
    asyncio.run(leave_early())
    deadline = time.time() + 10
    while time.time() < deadline and (state.scheduler.stats()["active"] or state.scheduler.stats()["pending"]):
        time.sleep(0.05)
    assert state.scheduler.stats()["active"] == 0 and state.scheduler.stats()["pending"] == 0
    assert cancelled() == before + 1  # the request was cancelled, not run to its 200 tokens


# --------------------------------------------------------------------------- two SmolLM2 replicas on local Ray

PROMPTS = [f"Write one sentence about the number {i}." for i in range(25)]
MAX_TOKENS = 24


def _opts():
    from specdecode.server.launch import ServeOptions

    # int4: exact by construction, so batching on the replicas cannot flip a near-tie (greedy = one process)
    return ServeOptions(target="smollm2-135m", draft="ngram", weights="int4", threads=1, max_batch_size=4,
                        num_speculative_tokens=3, policy="fixed")


OPTS = _opts()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Deployment:
    """A local Ray cluster serving ``specdecode`` (2 SmolLM2-135M int4 replicas, 1 thread each)."""

    def __init__(self, port: int, router: str, api_key: str | None = None) -> None:
        import dataclasses

        from ray import serve

        from specdecode.server.replicas import APP_NAME, build_app

        self.api_key = api_key
        opts = dataclasses.replace(OPTS, api_key=api_key)
        serve.run(build_app(opts, ReplicaOptions(replicas=2, router=router)), name=APP_NAME, route_prefix="/")
        self.url = f"http://127.0.0.1:{port}"

    def client(self):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "unused", max_retries=0, timeout=300)

    def metrics(self) -> dict:
        """Every sample of the endpoint's /metrics: {(name, sorted labels): value}."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        text = httpx.get(f"{self.url}/metrics", headers=headers, timeout=30).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def total(self, name: str, **labels) -> float:
        return sum(v for (n, lab), v in self.metrics().items()
                   if n == name and all(dict(lab).get(k) == w for k, w in labels.items()))

    def replicas(self) -> list[dict]:
        return httpx.get(f"{self.url}/health", timeout=30).json()["replicas"]

    def wait_for(self, n: int, timeout: float = 180, without: set | None = None) -> list[dict]:
        deadline = time.time() + timeout
        while time.time() < deadline:
            with_engine = [r for r in self._safe_replicas() if r.get("engine_alive") and r["pid"] not in (without or ())
                           and r["report_age_s"] < 3]
            if len(with_engine) == n:
                return with_engine
            time.sleep(0.5)
        raise AssertionError(f"not {n} replicas after {timeout} s: {self._safe_replicas()}")

    def _safe_replicas(self) -> list[dict]:
        try:
            return self.replicas()
        except (httpx.HTTPError, ValueError, KeyError):
            return []


@pytest.fixture(scope="module")
def ray_port():
    """A local Ray cluster (2 CPUs, no dashboard) with Serve's proxy on a free loopback port."""
    pytest.importorskip("ray.serve")
    import ray
    from ray import serve

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 2 ** 20, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield port
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def reference():
    """The same prompts through one process (``load_state`` as ``specdecode serve`` builds it), greedy."""
    from fastapi.testclient import TestClient

    from specdecode.server.launch import load_state

    state = load_state(OPTS, progress=False)
    out = {}
    with TestClient(create_app(state)) as c:
        for p in PROMPTS:
            r = c.post("/v1/chat/completions", json={"model": "smollm2-135m", "max_tokens": MAX_TOKENS,
                                                     "temperature": 0, "messages": [{"role": "user", "content": p}]})
            assert r.status_code == 200, r.text
            out[p] = r.json()["choices"][0]["message"]["content"]
            r = c.post("/v1/completions", json={"model": "smollm2-135m", "max_tokens": MAX_TOKENS, "temperature": 0,
                                                "prompt": p})
            assert r.status_code == 200, r.text
            out[("completion", p)] = r.json()["choices"][0]["text"]
    return out


@pytest.fixture(scope="module")
def pow2(ray_port):
    return Deployment(ray_port, "power-of-two")


def _completion(client, prompt: str, stream: bool) -> dict:
    if not stream:
        raw = client.completions.with_raw_response.create(model="smollm2-135m", prompt=prompt, max_tokens=MAX_TOKENS,
                                                          temperature=0)
        r = raw.parse()
        return {"text": r.choices[0].text, "replica": raw.headers.get("x-specdecode-replica"),
                "tokens": r.usage.completion_tokens, "ids": len(r.choices[0].model_extra.get("token_ids") or [])}
    text, ids, usage = [], 0, None
    for chunk in client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for c in chunk.choices:
            text.append(c.text)
            ids += len(c.model_extra.get("token_ids") or [])
    return {"text": "".join(text), "replica": None, "tokens": usage, "ids": ids}


def _one(client, prompt: str, stream: bool) -> dict:
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        raw = client.chat.completions.with_raw_response.create(model="smollm2-135m", messages=messages,
                                                              max_tokens=MAX_TOKENS, temperature=0)
        r = raw.parse()
        return {"text": r.choices[0].message.content, "replica": raw.headers.get("x-specdecode-replica"),
                "tokens": r.usage.completion_tokens, "ids": len(r.choices[0].model_extra.get("token_ids") or [])}
    text, ids, usage = [], 0, None
    for chunk in client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for c in chunk.choices:
            text.append(c.delta.content or "")
            ids += len(c.model_extra.get("token_ids") or [])
    return {"text": "".join(text), "replica": None, "tokens": usage, "ids": ids}


@pytest.mark.integration
def test_two_replicas_serve_100_requests_from_8_clients_as_one_process(pow2, reference):
    client = pow2.client()
    # chat and completions, streamed and not, in turn
    jobs = [(PROMPTS[i % len(PROMPTS)], i % 2 == 1, i % 4 >= 2) for i in range(100)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda job: (_completion if job[2] else _one)(client, job[0], job[1]), jobs))
    for (prompt, stream, completion), r in zip(jobs, results):
        expected = reference[("completion", prompt) if completion else prompt]
        assert r["text"] == expected, (prompt, stream, completion)  # greedy: equal to one process
        assert r["ids"] == r["tokens"] and 0 < r["tokens"] <= MAX_TOKENS  # nothing lost or duplicated
    used = {r["replica"] for r in results if r["replica"]}
    assert len(used) == 2, used  # the default router used both replicas
    time.sleep(2.5)  # a push period: the hub holds every replica's latest figures
    ok = {}
    for (name, labels), value in pow2.metrics().items():
        labels = dict(labels)
        if name == "specdecode_requests_total" and labels.get("outcome") == "ok":
            ok[labels["replica"]] = ok.get(labels["replica"], 0) + value
    assert len(ok) == 2 and sum(ok.values()) >= 100 and min(ok.values()) > 0, ok


@pytest.mark.integration
def test_the_ingress_refuses_a_big_body_and_cancels_a_stream_whose_client_left(pow2):
    r = httpx.post(f"{pow2.url}/v1/completions", content=b"x" * (OPTS.max_request_bytes + 1),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.get(f"{pow2.url}/v1/nothing", timeout=60)
    assert r.status_code == 404 and "no such endpoint" in r.json()["error"]["message"]  # the replica's own answer
    before = pow2.total("specdecode_requests_total", outcome="cancelled", endpoint="completions")
    body = {"model": "smollm2-135m", "prompt": "Count from one to a thousand:", "max_tokens": 2000, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{pow2.url}/v1/completions", json=body, timeout=60) as resp:
        for n, _ in enumerate(resp.iter_lines()):
            if n >= 6:
                break  # leave mid-stream
    deadline = time.time() + 30
    while time.time() < deadline:
        time.sleep(1.5)
        if pow2.total("specdecode_requests_total", outcome="cancelled", endpoint="completions") > before:
            break
    assert pow2.total("specdecode_requests_total", outcome="cancelled", endpoint="completions") == before + 1


@pytest.mark.integration
def test_a_killed_replica_loses_no_request_that_had_not_streamed(pow2, reference):
    """SIGKILL one replica's process while 48 requests run; non-streamed requests all finish (retried on the
    other replica); a streamed one may fail only after it had received output, with the retryable
    ``replica_failed`` error; then Ray restarts the replica and both serve again."""
    import openai

    client = pow2.client()
    victim = pow2.wait_for(2)[0]
    affected_before = (pow2.total("specdecode_replica_retries_total")
                       + pow2.total("specdecode_replica_failed_requests_total"))
    # 48 requests (3 per prompt): enough queued work that the kill lands while the victim still has some, however
    # fast this CPU decodes (16 requests of 24 tokens finished within the former half-second wait on a fast one)
    jobs = [(PROMPTS[i % 16], i % 2 == 1) for i in range(48)]
    outcomes: list = [None] * len(jobs)

    def run(i: int) -> None:
        prompt, stream = jobs[i]
        got_output = False
        try:
            if stream:
                text = []
                for chunk in client.chat.completions.create(
                        model="smollm2-135m", messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS,
                        temperature=0, stream=True):
                    for c in chunk.choices:
                        if c.delta.content:
                            got_output = True
                            text.append(c.delta.content)
                outcomes[i] = ("ok", "".join(text))
            else:
                outcomes[i] = ("ok", _one(client, prompt, False)["text"])
        except openai.APIError as exc:
            outcomes[i] = ("error", got_output, getattr(exc, "code", None), str(exc))

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(run, i) for i in range(len(jobs))]
        deadline = time.time() + 60  # kill it while it runs requests
        while time.time() < deadline and not any(r["pid"] == victim["pid"] and r["active"] > 0
                                                 for r in pow2._safe_replicas()):
            time.sleep(0.2)
        time.sleep(0.1)
        os.kill(victim["pid"], signal.SIGKILL)
        for f in futures:
            f.result(timeout=300)
    for (prompt, stream), outcome in zip(jobs, outcomes):
        if outcome[0] == "ok":
            assert outcome[1] == reference[prompt]
        else:
            assert stream, f"a non-streamed request failed: {outcome}"
            assert outcome[1], f"a request failed before any output reached it: {outcome}"
            assert outcome[2] == "replica_failed", outcome
    print("after the kill:", [o[0] if o[0] == "ok" else o[2] for o in outcomes])
    assert sum(o[0] == "ok" for o in outcomes) >= len(jobs) // 2
    recovered = pow2.wait_for(2, without={victim["pid"]})
    assert victim["pid"] not in {r["pid"] for r in recovered}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        after = list(pool.map(lambda p: _one(client, p, False), PROMPTS[:8]))
    assert [a["text"] for a in after] == [reference[p] for p in PROMPTS[:8]]
    affected = (pow2.total("specdecode_replica_retries_total") + pow2.total("specdecode_replica_failed_requests_total")
                - affected_before)
    assert affected >= 1  # the kill did hit requests: retried, or failed after output


@pytest.mark.integration
def test_prefix_affinity_sends_a_conversations_turns_to_one_replica(ray_port, pow2):
    """Redeploys with ``--router prefix`` and an API key: every turn of a conversation goes to the replica
    rendezvous hashing names for its first messages, and conversations homed on each replica are served
    there; the key is required as on one server (/health open)."""
    deployment = Deployment(ray_port, "prefix", api_key="sk-test")
    ids = sorted(r["replica"] for r in deployment.wait_for(2))
    for path in ("/v1/models", "/metrics", "/docs"):
        r = httpx.get(f"{deployment.url}{path}", timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
    assert httpx.get(f"{deployment.url}/v1/models", headers={"Authorization": "Bearer sk-test"}).status_code == 200
    assert len(ids) == 2
    client = deployment.client()
    conversations, homes = [], {}
    for n in range(200):  # four conversations homed on each replica
        messages = [{"role": "system", "content": "Answer in five words."},
                    {"role": "user", "content": f"Tell me about the city number {n}."}]
        key = routing_key("/v1/chat/completions", json.dumps({"model": "smollm2-135m", "messages": messages}).encode())
        home = rank_replicas(key, ids, {})[0][0]
        if sum(h == home for h in homes.values()) < 4:
            homes[len(conversations)] = home
            conversations.append(messages)
        if len(conversations) == 8:
            break
    for i, messages in enumerate(conversations):
        for turn in range(3):
            raw = client.chat.completions.with_raw_response.create(model="smollm2-135m", messages=messages,
                                                                  max_tokens=8, temperature=0)
            assert raw.headers["x-specdecode-replica"] == homes[i], (i, turn)
            messages = [*messages, {"role": "assistant", "content": raw.parse().choices[0].message.content},
                        {"role": "user", "content": "And then?"}]
