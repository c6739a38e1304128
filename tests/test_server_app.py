"""The app (``specdecode.server.app``), the real server on loopback: official ``openai`` client, raw HTTP
errors, batching, cancellation, metrics. (Building and launching it: ``tests/test_server_launch.py``.)

The server (the scheduler over the one engine) runs in a thread (uvicorn on a
free port) over the tiny random Llama with its character tokenizer and chat
template (tests/conftest.py), cast to float64 so greedy outputs cannot flip
between batch shapes. Every drafter ``specdecode generate`` takes is served
and checked against plain decoding.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from specdecode.engine import EngineConfig, SpeculativeEngine
from tiny import load_float64
from specdecode.server import build_state, create_app
from specdecode.types import SamplingParams

MODEL = "tiny"
PROMPT = "the cat and the dog and the cat and the"


class LiveServer:
    """uvicorn serving ``app`` on 127.0.0.1:<free port> in a daemon thread."""

    def __init__(self, state) -> None:
        import uvicorn

        self.state = state
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = uvicorn.Config(create_app(state), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics as {'name{labels}': value}."""
        text = httpx.get(f"{self.url}/metrics").text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out


@pytest.fixture(scope="module")
def tiny64(tiny_model_dir):
    return load_float64(tiny_model_dir)


@pytest.fixture(scope="module")
def noisy_draft(tiny_model_dir):
    """The target's weights with noise on the LM head: a draft that agrees often, not always."""
    draft = load_float64(tiny_model_dir)
    gen = torch.Generator().manual_seed(0)
    head = draft.model.lm_head.weight
    head.add_(torch.randn(head.shape, generator=gen, dtype=head.dtype) * 0.6 * head.std())
    return draft


@contextlib.contextmanager
def serving(loaded, **kw) -> Iterator[LiveServer]:
    kw.setdefault("model_name", MODEL)
    kw.setdefault("policy", "fixed")  # fixed gamma: seeded sampling is also batch-independent
    with LiveServer(build_state(loaded, kw.pop("draft", "ngram"), **kw)) as live:
        yield live


@pytest.fixture(scope="module")
def live(tiny64):
    with serving(tiny64, max_batch_size=4, max_queue=64, num_speculative_tokens=4) as server:
        yield server


def _plain_greedy(loaded, prompt_ids, n) -> list[int]:
    engine = SpeculativeEngine(loaded.model, None, EngineConfig(max_context=loaded.max_context))
    return engine.generate(prompt_ids, SamplingParams(max_new_tokens=n, eos_token_ids=loaded.eos_token_ids)).token_ids


# --------------------------------------------------------------------------- the OpenAI client


def test_models_and_health(live):
    models = live.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    health = httpx.get(f"{live.url}/health").json()
    assert health["status"] == "ok" and health["active"] == 0


def test_completion_matches_plain_decoding_and_its_stream(live, tiny64):
    client = live.client()
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0)
    choice = out.choices[0]
    prompt_ids = tiny64.tokenizer(PROMPT)["input_ids"]
    assert choice.token_ids == _plain_greedy(tiny64, prompt_ids, 40)  # lossless end to end
    assert choice.text == tiny64.tokenizer.decode(choice.token_ids, skip_special_tokens=True)
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == len(choice.token_ids)
    spec = out.usage.speculative
    assert spec["num_drafted_tokens"] > 0 and spec["mean_accepted_length"] >= 1.0
    assert spec["num_target_forwards"] < out.usage.completion_tokens + 1  # drafts were accepted

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    ids = [t for c in chunks if c.choices for t in c.choices[0].token_ids]
    assert text == choice.text and ids == choice.token_ids
    assert max(len(c.choices[0].token_ids) for c in chunks if c.choices) > 1  # a step's tokens travel together
    assert chunks[-1].usage.completion_tokens == len(ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason


def test_chat_applies_the_template_and_streams(live, tiny64):
    client = live.client()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    templated = tiny64.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tiny64.tokenizer(templated, add_special_tokens=False)["input_ids"]
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].token_ids == _plain_greedy(tiny64, prompt_ids, 30)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == out.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == out.choices[0].finish_reason


def test_seed_stop_n_and_logprobs(live, tiny64):
    client = live.client()
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=1.0, top_p=0.95, extra_body={"top_k": 20})
    a = client.completions.create(seed=5, **kw).choices[0].text
    assert client.completions.create(seed=5, **kw).choices[0].text == a
    many = client.completions.create(seed=5, n=3, **kw)
    assert [c.index for c in many.choices] == [0, 1, 2] and many.choices[0].text == a  # choice i uses seed + i
    assert many.usage.prompt_tokens == len(tiny64.tokenizer(PROMPT)["input_ids"])

    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0).choices[0].text
    stop = full[5:7]
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop])
    before = full[: full.index(stop)]
    # the text ends at a token boundary at or before the stop string (TextTracker keeps text == decode(ids))
    assert before.startswith(cut.choices[0].text) and len(before) - len(cut.choices[0].text) < 3
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text

    lp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2).choices[0]
    assert len(lp.logprobs.token_logprobs) == len(lp.token_ids) == 8
    assert all(x <= 0 for x in lp.logprobs.token_logprobs) and all(len(t) == 2 for t in lp.logprobs.top_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=3).choices[0]
    assert len(chat.logprobs.content) == len(chat.token_ids)
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.logprob - 1e-9
               for e in chat.logprobs.content)


def test_draft_model_server_is_lossless(tiny64, tiny_model_dir):
    """A draft model (here the target's own weights in a second copy) drafts for the batch in batched forwards."""
    draft = load_float64(tiny_model_dir)
    with serving(tiny64, draft=draft, max_batch_size=2, num_speculative_tokens=3) as server:
        out = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0)
        prompt_ids = tiny64.tokenizer(PROMPT)["input_ids"]
        assert out.choices[0].token_ids == _plain_greedy(tiny64, prompt_ids, 30)
        spec = out.usage.speculative
        assert spec["acceptance_rate"] == 1.0 and spec["mean_accepted_length"] > 3  # draft == target
        assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["draft"] == str(tiny_model_dir)


#: Every drafter ``specdecode generate`` takes: (--draft, build_state options); "MODEL" = the noisy draft.
DRAFTERS = {
    "ngram": ("ngram", {}),
    "suffix": ("suffix", {}),
    "suffix:ngram": ("suffix:ngram", {}),
    "layer-skip": ("layer-skip", {"skip_layers": "1"}),
    "draft-model": ("MODEL", {}),
    "tree-dynamic": ("MODEL", {"tree": "dynamic", "tree_nodes": 8}),
}


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_each_drafter_serves_losslessly(tiny64, noisy_draft, kind):
    """Each drafter through the app and the official client: greedy tokens equal plain decoding
    (``SpeculativeEngine.generate``), streamed deltas concatenate to the non-streamed text, and
    concurrent requests (batched together) give the same tokens as alone."""
    draft, kw = DRAFTERS[kind]
    if draft == "MODEL":
        draft = noisy_draft
    with serving(tiny64, draft=draft, max_batch_size=4, num_speculative_tokens=4, **kw) as server:
        client = server.client()
        prompts = [PROMPT, "and the dog and the cat and", "hello hello hello"]
        outs = [client.completions.create(model=MODEL, prompt=p, max_tokens=40, temperature=0) for p in prompts]
        for p, out in zip(prompts, outs):
            ids = tiny64.tokenizer(p)["input_ids"]
            assert out.choices[0].token_ids == _plain_greedy(tiny64, ids, 40), p
            assert out.choices[0].text == tiny64.tokenizer.decode(out.choices[0].token_ids, skip_special_tokens=True)
        assert sum(o.usage.speculative["num_drafted_tokens"] for o in outs) > 0
        assert sum(o.usage.speculative["num_accepted_tokens"] for o in outs) > 0

        chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                                stream=True))
        assert "".join(c.choices[0].text for c in chunks) == outs[0].choices[0].text
        assert [t for c in chunks for t in c.choices[0].token_ids] == outs[0].choices[0].token_ids

        messages = [{"role": "user", "content": "the cat and the cat and the"}]
        chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
        streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                                  stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == chat.choices[0].message.content

        with ThreadPoolExecutor(3) as pool:  # decoded together
            together = list(pool.map(lambda p: client.completions.create(model=MODEL, prompt=p, max_tokens=40,
                                                                         temperature=0), prompts))
        assert [o.choices[0].token_ids for o in together] == [o.choices[0].token_ids for o in outs]


def test_several_prompts_and_choices_stream_per_index(live, tiny64):
    client = live.client()
    kw = dict(model=MODEL, prompt=["the cat", "and the dog"], n=2, max_tokens=12, temperature=0.9, seed=11)
    full = client.completions.create(**kw)
    assert [c.index for c in full.choices] == [0, 1, 2, 3]
    assert full.usage.prompt_tokens == sum(len(tiny64.tokenizer(p)["input_ids"]) for p in kw["prompt"])
    texts = {}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {c.index: c.text for c in full.choices}


# --------------------------------------------------------------------------- batching


def test_batch_isolation_through_the_server(live):
    """A greedy request gives the same tokens alone and inside a batch of mixed requests."""
    client = live.client()
    probe = dict(model=MODEL, prompt=PROMPT, max_tokens=60, temperature=0, extra_body={"ignore_eos": True})
    sampled = dict(model=MODEL, prompt="and the dog", max_tokens=60, temperature=0.8, seed=3,
                   extra_body={"ignore_eos": True, "top_k": 10})
    alone = client.completions.create(**probe).choices[0].token_ids
    alone_sampled = client.completions.create(**sampled).choices[0].token_ids
    seen: list[int] = []
    scheduler = live.state.scheduler
    previous = scheduler.on_step
    scheduler.on_step = _chain(previous, lambda s: seen.append(s.batch_size))
    others = [dict(model=MODEL, prompt=p, max_tokens=m, temperature=t, top_p=tp, seed=i)
              for i, (p, m, t, tp) in enumerate([("hello", 50, 1.2, 0.9), ("the the the", 30, 0.0, 1.0),
                                                 ("dog", 70, 0.5, 1.0)])]
    try:
        with ThreadPoolExecutor(5) as pool:
            futures = [pool.submit(client.completions.create, **kw) for kw in (probe, sampled, *others)]
            results = [f.result() for f in futures]
    finally:
        scheduler.on_step = previous
    assert max(seen) >= 3  # they really were decoded together
    assert results[0].choices[0].token_ids == alone
    assert results[1].choices[0].token_ids == alone_sampled  # fixed gamma: same random draws as alone


def _chain(first, second):
    def both(stats):
        first(stats)
        second(stats)
    return both


def _cancelled(live, endpoint: str = "completions") -> float:
    return live.metrics().get(f"specdecode_requests_total{{endpoint={endpoint},outcome=cancelled}}", 0.0)


def test_client_disconnect_cancels_and_frees_the_cache(live):
    scheduler, engine = live.state.scheduler, live.state.engine
    before = _cancelled(live)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}
    with _slow_steps(scheduler, 0.02):
        with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=30) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(4)]
            assert any(line.startswith("data: {") for line in got)
            assert scheduler.num_active == 1 and engine.runner.nbytes > 0
        # the connection is closed here, mid-generation: dropped within a step or two
        _wait(lambda: scheduler.num_active == 0 and engine.runner.nbytes == 0, timeout=2.0)
    _wait(lambda: _cancelled(live) > before)


def test_non_streaming_disconnect_cancels_within_a_step(live):
    scheduler = live.state.scheduler
    before = _cancelled(live)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    with _slow_steps(scheduler, 0.02):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{live.url}/v1/completions", json=body, timeout=httpx.Timeout(5.0, read=0.3))
        left = time.perf_counter()
        _wait(lambda: scheduler.num_active == 0, timeout=2.0)
        assert time.perf_counter() - left < 1.0
    _wait(lambda: _cancelled(live) > before)


def test_client_leaving_before_its_body_was_read_counts_as_cancelled(live):
    """A body cut short by the client closing its socket: counted ``cancelled``, not an internal error."""
    before = _cancelled(live)
    errors = live.metrics().get("specdecode_requests_total{endpoint=completions,outcome=invalid}", 0.0)
    with socket.create_connection(("127.0.0.1", live.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"model\": ")
    _wait(lambda: _cancelled(live) == before + 1)
    assert live.metrics().get("specdecode_requests_total{endpoint=completions,outcome=invalid}", 0.0) == errors
    assert live.client().completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text is not None


@pytest.mark.slow
def test_many_clients_disconnecting_leave_nothing_running(live):
    """30 streaming and 10 non-streaming clients leave mid-generation (most while still queued)."""
    scheduler, engine = live.state.scheduler, live.state.engine
    before = {e: _cancelled(live, e) for e in ("completions", "chat_completions")}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 200,
            "temperature": 0.8, "ignore_eos": True, "stream": True}
    plain = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True}

    def streaming(i):
        seen = 0
        try:
            with httpx.stream("POST", f"{live.url}/v1/chat/completions", json={**chat, "seed": i},
                              timeout=httpx.Timeout(10.0, read=3.0)) as resp:
                for line in resp.iter_lines():
                    seen += line.startswith("data: ")
                    if seen >= 2 + i % 3:
                        break
        except httpx.ReadTimeout:
            pass
        return seen

    def non_streaming(i):
        with contextlib.suppress(httpx.ReadTimeout):
            httpx.post(f"{live.url}/v1/completions", json=plain, timeout=httpx.Timeout(10.0, read=0.3 + 0.1 * i))

    # k = 4: at most 5 tokens a step, so 200 tokens take >= 40 steps >= 1.6 s: longer than any client waits
    # (1.2 s at most), so none can finish
    with _slow_steps(scheduler, 0.04):
        with ThreadPoolExecutor(40) as pool:
            futures = [pool.submit(streaming, i) for i in range(30)] + [pool.submit(non_streaming, i)
                                                                        for i in range(10)]
            seen = [f.result() for f in futures]
        assert all(n >= 1 for n in seen[:30])  # every stream had started (the role chunk comes first)
        _wait(lambda: scheduler.num_active == 0 and scheduler.num_pending == 0, timeout=10.0)
    _wait(lambda: engine.runner.nbytes == 0)
    try:
        _wait(lambda: _cancelled(live, "chat_completions") - before["chat_completions"] == 30
              and _cancelled(live, "completions") - before["completions"] == 10)
    except AssertionError:
        counts = {k: v for k, v in live.metrics().items() if k.startswith("specdecode_requests_total")}
        raise AssertionError(f"outcomes: {counts}; before: {before}") from None
    ok = live.client().completions.create(model=MODEL, prompt="x", max_tokens=3)
    assert ok.choices[0].finish_reason in ("length", "stop")


@pytest.mark.slow
def test_oversized_body_gets_413_while_another_stream_flows(live):
    """413 from Content-Length and from a chunked upload; a big allowed body is parsed and tokenized off
    the event loop; a running stream keeps its pace meanwhile."""
    limit = live.state.config.max_request_bytes
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 150, "temperature": 0, "stream": True, "ignore_eos": True}
    stamps: list[float] = []
    started = threading.Event()

    def stream():
        with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    stamps.append(time.perf_counter())
                    started.set()

    with _slow_steps(live.state.scheduler, 0.01):
        with ThreadPoolExecutor(1) as pool:
            flowing = pool.submit(stream)
            assert started.wait(30)
            t0 = time.perf_counter()
            huge = json.dumps({"model": MODEL, "prompt": "a" * (limit + 10)})
            resp = httpx.post(f"{live.url}/v1/completions", content=huge, headers={"content-type": "application/json"})
            assert resp.status_code == 413, resp.text
            err = resp.json()["error"]
            assert err["code"] == "request_too_large" and str(limit) in err["message"] and "max-request-bytes" in \
                err["message"]

            def chunks():  # no Content-Length: counted while reading
                yield b'{"model": "tiny", "prompt": "'
                for _ in range(limit // 65536 + 2):
                    yield b"a" * 65536
                yield b'"}'

            resp = httpx.post(f"{live.url}/v1/completions", content=chunks(),
                              headers={"content-type": "application/json"})
            assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
            # under the limit: parsed and tokenized in the thread pool (then too long for the context)
            big = json.dumps({"model": MODEL, "prompt": "the cat and the dog " * (limit // 25)})
            with ThreadPoolExecutor(3) as senders:
                replies = list(senders.map(lambda _: httpx.post(
                    f"{live.url}/v1/completions", content=big, headers={"content-type": "application/json"},
                    timeout=60), range(3)))
            assert [r.status_code for r in replies] == [400] * 3
            assert all(r.json()["error"]["code"] == "context_length_exceeded" for r in replies)
            t1 = time.perf_counter()
            flowing.result(60)
    during = [s for s in stamps if t0 <= s <= t1]
    gaps = [b - a for a, b in zip(stamps, stamps[1:]) if t0 <= b <= t1 + 0.5]
    # 0.9 s: a stall of the event loop by parsing or tokenizing these bodies lasts seconds; a busy 2-core CI
    # machine adds tenths
    assert len(during) >= 3 and max(gaps) < 0.9, (len(during), max(gaps, default=None))
    assert len(stamps) >= 50  # the stream went on to its end
    assert httpx.post(f"{live.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}).status_code \
        == 200


@contextlib.contextmanager
def _slow_steps(scheduler, seconds: float):
    """Make every scheduler step take at least ``seconds`` (so a client can leave mid-generation)."""
    real = scheduler.step

    def slow():
        out = real()
        time.sleep(seconds)
        return out

    scheduler.step = slow
    try:
        yield
    finally:
        scheduler.step = real


def _wait(cond, timeout: float = 15.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "condition not reached"
        time.sleep(0.02)


def test_full_queue_answers_429_and_recovers(tiny64):
    with serving(tiny64, max_batch_size=1, max_queue=1) as server:
        gate = threading.Event()
        scheduler = server.state.scheduler
        real = scheduler.step
        scheduler.step = lambda: (gate.wait(30), real())[1]
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 5, "temperature": 0}
        with ThreadPoolExecutor(2) as pool:
            waiting = [pool.submit(httpx.post, f"{server.url}/v1/completions", json=body, timeout=30) for _ in range(2)]
            _wait(lambda: scheduler.num_pending == 2)
            rejected = httpx.post(f"{server.url}/v1/completions", json=body)
            gate.set()
            assert [f.result().status_code for f in waiting] == [200, 200]
        assert rejected.status_code == 429 and rejected.headers["retry-after"] == "1"
        err = rejected.json()["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "queue_full" and "max-queue" in err["message"]
        assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 200


# --------------------------------------------------------------------------- errors


BAD_REQUESTS = [
    ("/v1/completions", "{not json", 400, None, "not valid JSON"),
    ("/v1/completions", "[1, 2]", 400, None, "JSON object"),
    ("/v1/completions", "", 400, None, "body is empty"),
    ("/v1/completions", {"prompt": "x"}, 400, "model", "missing required field 'model'"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt", "missing required field 'prompt'"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model", "serves 'tiny'"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -3}, 400, "max_tokens", ">= 1"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**9}, 400, "max_tokens", "at most"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "integer"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -0.5}, 400, "temperature", "[0, 2]"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p", "(0, 1]"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 1.5}, 400, "top_p", "(0, 1]"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_k": -2}, 400, "top_k", ">= 0"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n", "n must be"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream", "boolean"),
    ("/v1/completions", {"model": MODEL, "prompt": 42}, 400, "prompt", "must be a string"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt", "empty list"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 99999]}, 400, "prompt", "token ids must be in"),
    ("/v1/completions", {"model": MODEL, "prompt": "x " * 300}, 400, "prompt", "context"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1000}, 400, "max_tokens",
     "; with max_tokens 1000 it exceeds the model's context"),  # request.too_long's line, the wire field's name
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": ["a", ""]}, 400, "stop", "non-empty"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "suffix": "y"}, 400, "suffix", "suffix is not supported"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 50}, 400, "logprobs", "[0, 20]"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "presence_penalty": 3}, 400, "presence_penalty", "[-2, 2]"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temprature": 1}, 400, "temprature", "unknown field"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages", "at least one message"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages", "missing required field 'messages'"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages", "list"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role", "role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}, 400, "messages", "no content"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 0}, 400, "max_completion_tokens", ">= 1"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function"}]}, 400, "tools", "tools"),
]


@pytest.mark.parametrize("path,body,status,param,message", BAD_REQUESTS,
                         ids=[f"{i}-{case[4][:20]}" for i, case in enumerate(BAD_REQUESTS)])
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(live, path, body, status, param, message):
    content = body if isinstance(body, str) else json.dumps(body)
    resp = httpx.post(f"{live.url}{path}", content=content, headers={"content-type": "application/json"})
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert message in err["message"], err
    if param is not None:
        assert err["param"] == param
    ok = httpx.post(f"{live.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200


def test_openai_client_raises_on_errors(live):
    client = live.client()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=-1)


def test_unknown_route_is_json(live):
    resp = httpx.get(f"{live.url}/v2/nothing")
    assert resp.status_code == 404 and "no such endpoint" in resp.json()["error"]["message"]


def test_api_key_guards_everything_but_health(tiny64):
    with serving(tiny64, max_batch_size=2, api_key="s3cret") as server:
        assert httpx.get(f"{server.url}/health").status_code == 200
        for path in ("/v1/models", "/metrics"):
            resp = httpx.get(f"{server.url}{path}")
            assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            server.client(api_key="wrong").models.list()
        out = server.client(api_key="s3cret").completions.create(model=MODEL, prompt="x", max_tokens=3)
        assert len(out.choices[0].token_ids) <= 3


# --------------------------------------------------------------------------- metrics


def test_metrics_parse_and_move(live):
    before = live.metrics()
    client = live.client()
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0)
    list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=10,
                                        temperature=0, stream=True))
    after = live.metrics()

    def moved(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert moved("specdecode_requests_total{endpoint=completions,outcome=ok}") == 1
    assert moved("specdecode_requests_total{endpoint=chat_completions,outcome=ok}") == 1
    assert moved("specdecode_generation_tokens_total") >= 11
    assert moved("specdecode_prompt_tokens_total") > 0
    assert moved("specdecode_draft_tokens_total") > 0
    assert moved("specdecode_accepted_tokens_total") >= 0
    assert moved("specdecode_draft_tokens_by_position_total{position=0}") > 0
    assert moved("specdecode_time_to_first_token_seconds_count") == 2
    assert moved("specdecode_inter_token_latency_seconds_count") > 0
    assert moved("specdecode_mean_accepted_length_count") == 2
    assert moved("specdecode_batch_size_count") > 0
    for gauge in ("specdecode_queue_length", "specdecode_running_requests", "specdecode_kv_cache_bytes"):
        assert gauge in after


def test_metrics_totals_equal_the_summed_usage(tiny64):
    """Prompt, completion, drafted and accepted totals are the sums of the usage bodies served: n > 1,
    several prompts, a stop string (its tail is not counted), streams with usage, chat."""
    with serving(tiny64, max_batch_size=3, num_speculative_tokens=4) as server:
        client = server.client()
        usages = []
        usages.append(client.completions.create(model=MODEL, prompt=["the cat", "and the dog and the"], n=2,
                                                max_tokens=20, temperature=0.9, seed=1).usage)
        full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0)
        usages.append(full.usage)
        stop = full.choices[0].text[6:8]
        cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop])
        assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens < full.usage.completion_tokens
        usages.append(cut.usage)
        for stream in (client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0,
                                                 stop=[stop], stream=True, stream_options={"include_usage": True}),
                       client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=25, temperature=0, stream=True,
                                                      stream_options={"include_usage": True})):
            usages.append(list(stream)[-1].usage)
        with ThreadPoolExecutor(4) as pool:  # batched together
            usages += [r.usage for r in pool.map(lambda i: client.completions.create(
                model=MODEL, prompt=PROMPT[i:], max_tokens=15 + i, temperature=0.5 * (i % 2), seed=i), range(4))]
        m = server.metrics()
    assert m["specdecode_prompt_tokens_total"] == sum(u.prompt_tokens for u in usages)
    assert m["specdecode_generation_tokens_total"] == sum(u.completion_tokens for u in usages)
    assert m["specdecode_draft_tokens_total"] == sum(u.speculative["num_drafted_tokens"] for u in usages)
    assert m["specdecode_accepted_tokens_total"] == sum(u.speculative["num_accepted_tokens"] for u in usages)
    assert m["specdecode_draft_tokens_total"] > 0
    assert m["specdecode_requests_total{endpoint=completions,outcome=ok}"] == len(usages) - 1


def test_usage_and_metrics_count_to_the_committed_end(tiny64, tiny_model_dir):
    """Issue 28, item 3: a stop string, a stop token (EOS) and the token cap inside an accepted block, n > 1,
    streams: each request's ``usage.speculative`` equals the library's counters of the same run (draft ==
    target with gamma 4: every step keeps its draft, so any count past the delivered tokens shows), and the
    /metrics totals, by-position counters and verify steps are the sums of what the usage bodies say."""
    from specdecode.generator import SpecDecoder
    from specdecode.proposers import DraftModelProposer

    draft = load_float64(tiny_model_dir)
    library = SpecDecoder(tiny64, DraftModelProposer(draft.model), num_speculative_tokens=4)
    prompt = "the cat and the dog"
    cases = [dict(stop=["and!"]), dict(stop=["nand"]), dict(stop_token_ids=[library.encode("!")[-1]]),
             dict(max_tokens=13), dict(stop=["6thx"], n=2)]
    with serving(tiny64, draft=draft, max_batch_size=2, num_speculative_tokens=4) as server:
        client = server.client()
        before = server.metrics()
        usages, choices = [], 0
        for case in cases:
            n = case.get("n", 1)
            kw = dict(model=MODEL, prompt=prompt, max_tokens=case.get("max_tokens", 30), temperature=0, n=n,
                      stop=case.get("stop"), extra_body={"stop_token_ids": case.get("stop_token_ids")})
            want = library.generate(prompt, max_new_tokens=kw["max_tokens"], stop=case.get("stop"),
                                     stop_token_ids=case.get("stop_token_ids", ())).metrics
            out = client.completions.create(**kw)
            streamed = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
            for usage in (out.usage, streamed[-1].usage):
                spec = usage.speculative
                assert usage.completion_tokens == n * want.num_generated_tokens, case
                assert (spec["num_drafted_tokens"], spec["num_accepted_tokens"], spec["num_target_forwards"]) == (
                    n * want.num_drafted_tokens, n * want.num_accepted_tokens, n * want.num_target_forwards), case
                assert spec["mean_accepted_length"] == pytest.approx(want.mean_accepted_length), case
                usages.append(usage)
                choices += n
            assert want.num_step_tokens == want.num_generated_tokens - 1 < 29, case
        after = server.metrics()

    def moved(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    drafted = sum(u.speculative["num_drafted_tokens"] for u in usages)
    accepted = sum(u.speculative["num_accepted_tokens"] for u in usages)
    assert moved("specdecode_generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert moved("specdecode_draft_tokens_total") == drafted and moved("specdecode_accepted_tokens_total") == accepted
    assert moved("specdecode_verify_steps_total") == sum(u.speculative["num_target_forwards"] for u in usages) - choices
    by_position = [moved(f"specdecode_{k}_by_position_total{{position={i}}}") for k in ("draft_tokens",
                                                                                         "accepted_tokens")
                   for i in range(4)]
    assert sum(by_position[:4]) == drafted and sum(by_position[4:]) == accepted


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_failing_inside_the_server_frees_its_rows(live, monkeypatch, stream):
    """Issue 28, item 1, the server's path: the server's own code failing mid-request (here: taking an engine
    event) answers an error, cancels the request's rows within a step or two, and the server serves on."""
    from specdecode.server import choices as choices_module

    scheduler = live.state.scheduler
    real, calls = choices_module.Choice.feed, []

    def feed(self, ev):
        calls.append(ev)
        if len(calls) == 3:
            raise RuntimeError("server bug")
        return real(self, ev)

    monkeypatch.setattr(choices_module.Choice, "feed", feed)
    engine, aborted = scheduler.engine, []
    real_abort = engine.abort

    def abort(request, *args, **kwargs):
        aborted.append((request.finish_reason, len(request.generated)))
        return real_abort(request, *args, **kwargs)

    monkeypatch.setattr(engine, "abort", abort)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True, "n": 2,
            "stream": stream}
    with _slow_steps(scheduler, 0.2):  # 200 tokens take at least 40 steps = 8 s: longer than the wait below
        with contextlib.suppress(httpx.HTTPError):
            resp = httpx.post(f"{live.url}/v1/completions", json=body, timeout=30)
            assert resp.status_code == 500 or "[DONE]" not in resp.text
        _wait(lambda: scheduler.num_active == 0 and scheduler.num_pending == 0, timeout=5.0)
    # both rows were cancelled by the server, far from their 200 tokens (not left to finish on their own)
    assert len(aborted) >= 2 and all(n < 100 for _, n in aborted), aborted
    monkeypatch.setattr(engine, "abort", real_abort)
    monkeypatch.setattr(choices_module.Choice, "feed", real)
    out = live.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    assert len(out.choices[0].token_ids) == 5
