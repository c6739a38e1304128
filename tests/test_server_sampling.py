"""Every sampling parameter through the server, with the official ``openai`` client on the app in-process
(``http_client=`` a Starlette TestClient): each one accepted and honoured, each out-of-range value and each
unknown field refused with a 400 that names it, and logprobs right (the target's, every token's own bytes,
exactly N alternatives, text offsets into the returned text, prompt logprobs with echo).

The target is the tiny random Llama of tests/conftest.py in float64 (greedy outputs cannot flip between
batch shapes) with its character tokenizer, and a second one with a byte-level BPE tokenizer whose
multi-byte characters are split into one token per byte.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import openai
import pytest
import torch
from starlette.testclient import TestClient

from specdecode.engine import EngineConfig, SpeculativeEngine
from tiny import load_float64
from specdecode.server import build_state, create_app
from specdecode.server.responses import _top_dict
from conftest import make_byte_level_tokenizer
from specdecode.token_bytes import TokenBytes, display
from specdecode.types import SamplingParams

MODEL = "tiny"
PROMPT = "the cat and the dog and the cat and the"


@contextlib.contextmanager
def serving(loaded, **kw):
    """(openai client, raw httpx client, ServingState) over the app in-process."""
    kw.setdefault("model_name", MODEL)
    kw.setdefault("policy", "fixed")
    state = build_state(loaded, kw.pop("draft", "ngram"), **kw)
    with TestClient(create_app(state)) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0), \
            http, state


@pytest.fixture(scope="module")
def tiny64(tiny_model_dir):
    return load_float64(tiny_model_dir)


@pytest.fixture(scope="module")
def live(tiny64):
    with serving(tiny64, max_batch_size=4, num_speculative_tokens=4) as server:
        yield server


def _plain(loaded, prompt_ids, n, **kw) -> list[int]:
    engine = SpeculativeEngine(loaded.model, None, EngineConfig(max_context=loaded.max_context))
    params = SamplingParams(max_new_tokens=n, eos_token_ids=loaded.eos_token_ids, **kw)
    return engine.generate(prompt_ids, params).token_ids


def _ids(loaded, text) -> list[int]:
    return loaded.tokenizer(text)["input_ids"]


def _greedy(client, **kw):
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 20, "temperature": 0, **kw}
    return client.completions.create(**kw)


# --------------------------------------------------------------------------- each parameter honoured


def test_logit_bias_forces_and_bans_tokens(live, tiny64):
    client = live[0]
    plain = _greedy(client).choices[0].token_ids
    forced = tiny64.tokenizer.convert_tokens_to_ids("z")
    out = _greedy(client, logit_bias={str(forced): 100}, max_tokens=8).choices[0]
    assert out.token_ids == [forced] * 8 and out.text == "z" * 8
    banned = plain[0]
    out = _greedy(client, logit_bias={str(banned): -100}).choices[0]
    assert banned not in out.token_ids and out.token_ids != plain
    assert out.token_ids == _plain(tiny64, _ids(tiny64, PROMPT), 20, banned_token_ids=(banned,))
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                          temperature=0, logit_bias={str(forced): 100})
    assert chat.choices[0].message.content == "zzzzz"


def test_min_tokens_delays_eos_and_stop_token_ids_stop(live, tiny64):
    client = live[0]
    eos = str(tiny64.eos_token_ids[0])
    early = _greedy(client, logit_bias={eos: 100}).choices[0]
    assert early.token_ids == [int(eos)] and early.finish_reason == "stop" and early.text == ""
    held = _greedy(client, logit_bias={eos: 100}, extra_body={"min_tokens": 5}).choices[0]
    assert len(held.token_ids) == 6 and held.token_ids[-1] == int(eos) and held.finish_reason == "stop"
    plain = _greedy(client, max_tokens=30, extra_body={"ignore_eos": True}).choices[0].token_ids
    stop_tok = plain[4]
    cut = _greedy(client, max_tokens=30, extra_body={"stop_token_ids": [stop_tok], "ignore_eos": True}).choices[0]
    first = plain.index(stop_tok)
    assert cut.token_ids == plain[: first + 1] and cut.finish_reason == "stop"
    later = _greedy(client, max_tokens=30, extra_body={"stop_token_ids": [stop_tok], "min_tokens": first + 1,
                                                       "ignore_eos": True}).choices[0]
    assert len(later.token_ids) > first + 1 and later.token_ids[first] != stop_tok  # masked until min_tokens


@pytest.mark.parametrize("field, value", [("frequency_penalty", 2.0), ("presence_penalty", 2.0),
                                          ("repetition_penalty", 3.0)])
def test_penalties_change_greedy_output_as_the_library_does(live, tiny64, field, value):
    client = live[0]
    prompt_ids = _ids(tiny64, PROMPT)
    plain = _greedy(client, max_tokens=30).choices[0].token_ids
    kw = {field: value} if field != "repetition_penalty" else {"extra_body": {field: value}}
    out = _greedy(client, max_tokens=30, **kw).choices[0].token_ids
    assert out != plain
    assert out == _plain(tiny64, prompt_ids, 30, **{field: value})  # lossless under penalties too


def test_min_p_top_k_and_allowed_token_ids(live, tiny64):
    client = live[0]
    greedy = _greedy(client).choices[0].token_ids
    # min_p 1 keeps only the most likely token; top_k 1 too: sampling them is greedy decoding
    assert _greedy(client, temperature=1.0, seed=3, extra_body={"min_p": 1.0}).choices[0].token_ids == greedy
    assert _greedy(client, temperature=1.0, seed=3, extra_body={"top_k": 1}).choices[0].token_ids == greedy
    allowed = [tiny64.tokenizer.convert_tokens_to_ids(c) for c in "abc "]
    out = _greedy(client, temperature=1.0, seed=4, extra_body={"allowed_token_ids": allowed}).choices[0]
    assert out.token_ids and set(out.token_ids) <= set(allowed) and set(out.text) <= set("abc ")


def test_a_tiny_temperature_samples_the_argmax(live):
    client = live[0]
    greedy = _greedy(client).choices[0].token_ids
    for seed in (None, 1):  # standard rejection sampling and the coupled mode
        out = _greedy(client, temperature=1e-40, seed=seed).choices[0]
        assert out.token_ids == greedy


def test_speculative_extension_switches_and_caps_speculation(live, tiny64):
    client = live[0]
    base = _greedy(client, max_tokens=30)
    assert base.usage.speculative["num_drafted_tokens"] > 0
    off = _greedy(client, max_tokens=30, extra_body={"speculative": {"enabled": False}})
    spec = off.usage.speculative
    assert off.choices[0].token_ids == base.choices[0].token_ids
    assert spec["num_drafted_tokens"] == spec["num_accepted_tokens"] == 0 and spec["acceptance_rate"] == 0.0
    assert spec["num_target_forwards"] == len(off.choices[0].token_ids)  # one token per forward
    one = _greedy(client, max_tokens=30, extra_body={"speculative": {"num_speculative_tokens": 1}})
    spec = one.usage.speculative
    assert one.choices[0].token_ids == base.choices[0].token_ids
    assert 0 < spec["num_drafted_tokens"] <= spec["num_target_forwards"] - 1  # at most one per step
    assert set(spec) == {"num_drafted_tokens", "num_accepted_tokens", "acceptance_rate", "mean_accepted_length",
                         "num_target_forwards"}
    for method in ("token", "block"):  # seeded sampling reproduces itself under either verification
        kw = dict(max_tokens=30, temperature=1.0, seed=9, extra_body={"speculative": {"verification": method}})
        assert _greedy(client, **kw).choices[0].text == _greedy(client, **kw).choices[0].text


@contextlib.contextmanager
def _submitted(state):
    """The BatchRequests the server submits meanwhile."""
    submitted, submit = [], state.scheduler.submit

    def spy(req):
        submitted.append(req)
        return submit(req)

    state.scheduler.submit = spy
    try:
        yield submitted
    finally:
        del state.scheduler.submit  # the method again


def test_sampling_mode_sets_the_coupled_mode(live):
    client, _, state = live
    kw = dict(max_tokens=30, temperature=1.0, seed=11)

    def run(mode, enabled=True):
        spec = {"enabled": enabled} if mode is None else {"enabled": enabled, "sampling_mode": mode}
        with _submitted(state) as submitted:
            out = _greedy(client, **kw, extra_body={"speculative": spec}).choices[0]
        assert out.finish_reason in ("length", "stop")
        return out.token_ids, submitted[0].params.coupled

    plain, coupled = run("coupled", enabled=False)
    assert coupled is True
    assert run("coupled") == (plain, True)  # seeded speculative = seeded plain decoding, token for token
    assert run("auto") == (plain, None) == run(None)  # auto: coupled, since a seed is given
    assert run("standard")[1] is False and run("standard", enabled=False)[1] is False
    with _submitted(state) as submitted:
        _greedy(client, max_tokens=5, temperature=1.0, extra_body={"speculative": {"sampling_mode": "coupled"}})
    assert submitted[0].params.coupled is True and submitted[0].params.seed is None  # unseeded: allowed


def test_include_stop_str_in_output(live, tiny64):
    client = live[0]
    plain = _greedy(client, max_tokens=30, extra_body={"ignore_eos": True}).choices[0]
    stop = plain.text[6:9]
    at = plain.text.index(stop)
    for stream in (False, True):
        kw = dict(max_tokens=30, stop=[stop], stream=stream)
        out = [_greedy(client, **kw, extra_body={"ignore_eos": True, **extra}) for extra in
               ({}, {"include_stop_str_in_output": False}, {"include_stop_str_in_output": True})]
        if stream:
            texts = ["".join(c.choices[0].text for c in chunks) for chunks in out]
        else:
            texts = [o.choices[0].text for o in out]
            ids = out[2].choices[0].token_ids
            decode = tiny64.tokenizer.decode
            # the ids up to the token that completed the stop string
            assert decode(ids).startswith(texts[2]) and not decode(ids[:-1]).startswith(texts[2])
            assert ids == plain.token_ids[: len(ids)] and out[2].choices[0].finish_reason == "stop"
        assert texts == [plain.text[:at], plain.text[:at], plain.text[: at + len(stop)]]
    messages = [{"role": "user", "content": "the cat"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].message.content
    stop = chat[4:6]
    cut = [client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0, stop=[stop],
                                          extra_body={"ignore_eos": True, **extra}).choices[0].message.content
           for extra in ({}, {"include_stop_str_in_output": True})]
    at = chat.index(stop)
    assert cut == [chat[:at], chat[: at + len(stop)]]


def test_skip_special_tokens_false_keeps_their_text(live, tiny64):
    client = live[0]
    eos = tiny64.eos_token_ids[0]
    kw = dict(max_tokens=6, logprobs=1, logit_bias={str(eos): 100})
    skipped = _greedy(client, **kw, extra_body={"min_tokens": 3}).choices[0]
    kept = _greedy(client, **kw, extra_body={"min_tokens": 3, "skip_special_tokens": False}).choices[0]
    assert kept.token_ids == skipped.token_ids and kept.token_ids[-1] == eos
    assert kept.text == tiny64.tokenizer.decode(kept.token_ids, skip_special_tokens=False) == skipped.text + "<eos>"
    lp = kept.logprobs
    for k, tok in enumerate(lp.tokens):  # the offsets point into the text with the special token in it
        assert kept.text[lp.text_offset[k] : lp.text_offset[k] + len(tok)] == tok
    prompt_ids = _ids(tiny64, "the cat")
    echoed = _greedy(client, prompt="the cat", max_tokens=2, echo=True,
                     extra_body={"skip_special_tokens": False}).choices[0]
    assert echoed.text.startswith(tiny64.tokenizer.decode(prompt_ids, skip_special_tokens=False))
    streamed = _greedy(client, **kw, stream=True, extra_body={"min_tokens": 3, "skip_special_tokens": False})
    assert "".join(c.choices[0].text for c in streamed) == kept.text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logit_bias={str(eos): 100},
                                          extra_body={"min_tokens": 2, "skip_special_tokens": False})
    assert chat.choices[0].message.content.endswith("<eos>")


def test_the_prompt_is_scored_once_per_prompt(live):
    """n > 1 and best_of: the prompt's first choice alone asks the engine for prompt logprobs; every choice of
    that prompt returns them, equal to a single choice's."""
    _, http, state = live
    prompts = ["the cat and", "the dog"]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 3, "temperature": 1.0, "seed": 2, "prompt_logprobs": 2,
            "echo": True, "logprobs": 1}
    single = [http.post("/v1/completions", json={**body, "prompt": p}).json()["choices"][0] for p in prompts]
    for extra, per_prompt in (({"n": 3}, 3), ({"n": 2, "best_of": 3}, 3)):
        with _submitted(state) as submitted:
            resp = http.post("/v1/completions", json={**body, **extra})
        assert resp.status_code == 200, resp.text
        assert [r.prompt_logprobs for r in submitted] == ([2] + [None] * (per_prompt - 1)) * 2
        choices = resp.json()["choices"]
        n = extra["n"]
        for i, c in enumerate(choices):
            one = single[i // n]
            assert c["prompt_logprobs"] == one["prompt_logprobs"]
            count = len(one["prompt_token_ids"])
            assert c["logprobs"]["token_logprobs"][:count] == one["logprobs"]["token_logprobs"][:count]
            assert c["logprobs"]["text_offset"][:count] == one["logprobs"]["text_offset"][:count]
    with _submitted(state) as submitted:
        resp = http.post("/v1/completions", json={**body, "n": 2, "stream": True})
    firsts = {}
    for line in resp.text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                firsts.setdefault(c["index"], c.get("prompt_logprobs"))
    assert [r.prompt_logprobs for r in submitted] == [2, None, 2, None]
    assert [firsts[i] for i in range(4)] == [single[0]["prompt_logprobs"]] * 2 + [single[1]["prompt_logprobs"]] * 2


def test_text_offsets_are_the_whole_prefixes_lengths(tiny64):
    """The server's one-pass offsets (_TextOffsets) equal len(decode(ids[:j]).rstrip(U+FFFD)) for every j, on a
    character vocabulary, a byte-level BPE one (characters split across tokens) and SmolLM2's, specials too."""
    import random

    from specdecode.server.choices import _TextOffsets

    rng = random.Random(0)
    from specdecode.models import default_cache_dir

    tokenizers = [tiny64.tokenizer, make_byte_level_tokenizer()]
    smol = default_cache_dir() / "converted" / "smollm2-135m"  # SmolLM2's tokenizer, when it is in the cache
    if (smol / "tokenizer.json").exists():
        from transformers import AutoTokenizer

        tokenizers.append(AutoTokenizer.from_pretrained(smol))
    for tok in tokenizers:
        text = "the cat 中文 naïve \u00b2 <|im_end|> and\n\tmore 🙂!"
        ids = tok(text)["input_ids"] + [rng.randrange(len(tok)) for _ in range(60)]
        for skip in (True, False):
            def decode(x, skip=skip):
                return tok.decode(list(x), skip_special_tokens=skip, clean_up_tokenization_spaces=False)

            growing: list[int] = []
            offsets = _TextOffsets(decode, growing)
            got = []
            for t in ids:  # asked for as the ids grow, as a streamed choice does
                growing.append(t)
                got.append(offsets.at(len(growing) - 1))
            want = [len(decode(ids[:j]).rstrip("\ufffd")) for j in range(len(ids))]
            assert got == want, (type(tok).__name__, skip)


def test_streamed_ids_keep_up_with_the_text_across_split_characters():
    """A streamed choice hands out each token's id with its text: a character split across tokens sends its ids
    together once it is shown, and the ids after it are not held back to the end (they were, before); decoding
    only the new ids (concatenative) gives the same chunks."""
    from specdecode.server.choices import Choice
    from specdecode.scheduler import RowEvent

    tok = make_byte_level_tokenizer()

    def decode(x):
        return tok.decode(list(x), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    ids = tok("ab 中文 é 🙂 cd", add_special_tokens=False)["input_ids"]
    runs = []
    for concatenative in (False, True):
        choice = Choice(0, [1], SamplingParams(max_new_tokens=99), [], decode, None, concatenative=concatenative)
        chunks = []
        for i, t in enumerate(ids):
            last = i == len(ids) - 1
            chunks.append(choice.feed(RowEvent(token_ids=[t], finished=last, finish_reason="length" if last else None)))
        runs.append(chunks)
        assert "".join(p for p, _, _ in chunks) == decode(ids)
        assert [t for _, got, _ in chunks for t in got] == ids
        for piece, got, start in chunks:  # every chunk's ids are its text's, sent as soon as it is shown
            assert decode(got) == piece and start == sum(len(g) for _, g, _ in chunks[: chunks.index((piece, got, start))])
    assert runs[0] == runs[1]
    assert max(len(g) for _, g, _ in runs[0]) == len(tok("🙂", add_special_tokens=False)["input_ids"])


def test_seeded_choices_differ_and_reproduce(live):
    client = live[0]
    kw = dict(max_tokens=25, temperature=1.0, seed=21, n=2)
    a = _greedy(client, **kw)
    b = _greedy(client, **kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text
    chat = [client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "the cat"}],
                                           max_tokens=20, temperature=1.0, seed=21, n=2) for _ in range(2)]
    assert [c.message.content for c in chat[0].choices] == [c.message.content for c in chat[1].choices]
    assert chat[0].choices[0].message.content != chat[0].choices[1].message.content


def test_best_of_returns_the_n_most_likely_candidates(live):
    client = live[0]
    kw = dict(max_tokens=12, temperature=1.0, seed=5, prompt=["the cat", "and the dog"])
    every = _greedy(client, n=4, logprobs=0, **kw)
    best = _greedy(client, n=2, best_of=4, **kw)
    assert [c.index for c in best.choices] == [0, 1, 2, 3]
    for p in range(2):
        group = every.choices[4 * p : 4 * p + 4]
        ranked = sorted(group, key=lambda c: -sum(c.logprobs.token_logprobs))[:2]
        assert [c.text for c in best.choices[2 * p : 2 * p + 2]] == [c.text for c in ranked]
    assert all(c.logprobs is None for c in best.choices)  # not asked for: ranked by, not returned
    assert best.usage.completion_tokens == every.usage.completion_tokens  # every candidate counts
    with_lp = _greedy(client, n=1, best_of=3, logprobs=2, **kw)
    assert all(len(t) == 2 for c in with_lp.choices for t in c.logprobs.top_logprobs)


# --------------------------------------------------------------------------- refused, with the field named


BAD = [
    ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
    ({"frequency_penalty": -2.5}, "frequency_penalty", "[-2, 2]"),
    ({"repetition_penalty": 0}, "repetition_penalty", "(0, 100]"),
    ({"repetition_penalty": 101.5}, "repetition_penalty", "(0, 100]"),
    ({"min_p": -0.1}, "min_p", "[0, 1]"),
    ({"min_p": 1.5}, "min_p", "[0, 1]"),
    ({"top_k": -5}, "top_k", ">= 0"),
    ({"temperature": 2.1}, "temperature", "[0, 2]"),
    ({"top_p": 0}, "top_p", "(0, 1]"),
    ({"top_p": 1.5}, "top_p", "(0, 1]"),
    ({"seed": -1}, "seed", "2**63"),
    ({"n": 65}, "n", "[1, 64]"),
    ({"n": 2, "best_of": 1}, "best_of", ">= n"),
    ({"best_of": 2, "stream": True}, "best_of", "stream"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"logit_bias": {"5": 150}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"x5": 1}}, "logit_bias", "token ids as strings"),
    ({"logit_bias": {"\u00b2": 1}}, "logit_bias", "token ids as strings"),  # a digit to str.isdigit, not to int()
    ({"logit_bias": {"5": -100.5}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"99999": 1}}, "logit_bias", "outside the vocabulary"),
    ({"stop_token_ids": [99999]}, "stop_token_ids", "outside the vocabulary"),
    ({"allowed_token_ids": [99999]}, "allowed_token_ids", "outside the vocabulary"),
    ({"allowed_token_ids": [5], "logit_bias": {"5": -100}}, "allowed_token_ids", "no token"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "at least one"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", ">= 0"),
    ({"min_tokens": 50, "max_tokens": 10}, "min_tokens", "max_new_tokens = 10"),
    ({"min_tokens": -1}, "min_tokens", "[0, max_new_tokens = 5]"),
    ({"prompt_logprobs": 30}, "prompt_logprobs", "[0, 20]"),
    ({"logprobs": 21}, "logprobs", "[0, 20]"),
    ({"speculative": {"num_speculative_tokens": 0}}, "speculative.num_speculative_tokens", "[1, 64]"),
    ({"speculative": {"num_speculative_tokens": 65}}, "speculative.num_speculative_tokens", "[1, 64]"),
    ({"speculative": {"verification": "tree"}}, "speculative.verification", "token"),
    ({"speculative": {"sampling_mode": "always"}}, "speculative.sampling_mode", "coupled"),
    ({"speculative": {"enabled": "no"}}, "speculative.enabled", "boolean"),
    ({"speculative": {"gamma": 3}}, "speculative.gamma", "unknown field"),
    ({"store": True}, "store", "not supported"),
    ({"service_tier": "priority"}, "service_tier", "not supported"),
    ({"suffix": "x"}, "suffix", "not supported"),
    ({"temprature": 0.5}, "temprature", "unknown field"),
    ({"bad_words": ["cat"]}, "bad_words", "not supported"),
    ({"use_beam_search": True}, "use_beam_search", "not supported"),
    ({"guided_grammar": "root ::= x"}, "guided_grammar", "not supported"),
    ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens", "not supported"),
    ({"tools": [{"type": "function"}]}, "tools", "not supported"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "cannot be combined with guided_regex"),
    ({"stream_options": {"include_usage": True, "extra": 1}, "stream": True}, "stream_options.extra",
     "unknown field"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream: true"),
]


@pytest.mark.parametrize("body, param, needle", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_completions_refuse_each_bad_value_naming_the_field(live, body, param, needle):
    http = live[1]
    resp = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 5, **body})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and needle in err["message"], err


CHAT_BAD = [
    ({"audio": {"voice": "x"}}, "audio", "not supported"),
    ({"modalities": ["text"]}, "modalities", "not supported"),
    ({"prediction": {"type": "content"}}, "prediction", "not supported"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls", "not supported"),
    ({"tools": [{"type": "function"}]}, "tools", "not supported"),
    ({"tool_choice": "auto"}, "tool_choice", "not supported"),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
    ({"echo": True}, "echo", "unknown field"),
    ({"best_of": 2}, "best_of", "unknown field"),
    ({"messages": [{"role": "user", "content": "x", "refusal": "no"}]}, "messages[0].refusal", "unknown field"),
    ({"messages": [{"role": "user", "content": "x", "colour": None}]}, "messages[0].colour", "unknown field"),
    ({"top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    ({"logit_bias": {"5": -101}}, "logit_bias", "[-100, 100]"),
    ({"presence_penalty": 9}, "presence_penalty", "[-2, 2]"),
    ({"min_tokens": 10, "max_completion_tokens": 3}, "min_tokens", "max_new_tokens = 3"),
    ({"speculative": {"num_speculative_tokens": 65}}, "speculative.num_speculative_tokens", "[1, 64]"),
]


@pytest.mark.parametrize("body, param, needle", CHAT_BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(CHAT_BAD)])
def test_chat_refuses_each_bad_value_naming_the_field(live, body, param, needle):
    http = live[1]
    req = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 5, **body}
    resp = http.post("/v1/chat/completions", json=req)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and needle in err["message"], err


def test_the_openai_client_gets_a_bad_request_naming_the_field(live):
    client = live[0]
    with pytest.raises(openai.BadRequestError, match="frequency_penalty") as info:
        client.completions.create(model=MODEL, prompt="x", frequency_penalty=5)
    assert info.value.param == "frequency_penalty"
    with pytest.raises(openai.BadRequestError, match="unknown field") as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       extra_body={"mystery": 1})
    assert info.value.param == "mystery"
    ok = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                        user="u1", metadata={"k": "v"}, store=False, service_tier="auto")
    assert ok.choices[0].finish_reason in ("length", "stop")
    nothing = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                             tool_choice="none", extra_body={"tools": [], "functions": None})
    assert nothing.choices[0].finish_reason in ("length", "stop")  # values that ask for nothing are accepted


# --------------------------------------------------------------------------- logprobs


def test_completion_logprobs_are_the_targets_with_offsets_into_the_text(live, tiny64):
    client = live[0]
    prompt_ids = _ids(tiny64, PROMPT)
    out = _greedy(client, max_tokens=15, logprobs=5, stop=[" dog"]).choices[0]
    lp = out.logprobs
    ids = out.token_ids
    assert len(lp.tokens) == len(ids) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    ref = torch.log_softmax(tiny64.model(input_ids=torch.tensor([prompt_ids + ids])).logits[0].double(), -1)
    for k, t in enumerate(ids):
        row = ref[len(prompt_ids) + k - 1]
        assert lp.token_logprobs[k] == pytest.approx(float(row[t]), abs=1e-6)
        assert len(lp.top_logprobs[k]) == 5
        assert sorted(lp.top_logprobs[k].values(), reverse=True) == pytest.approx(row.topk(5).values.tolist(),
                                                                                   abs=1e-6)
    assert "".join(lp.tokens) == out.text  # the character tokenizer: each token's text, in order
    for k, tok in enumerate(lp.tokens):
        assert out.text[lp.text_offset[k] : lp.text_offset[k] + len(tok)] == tok
    streamed = list(_greedy(client, max_tokens=15, logprobs=5, stop=[" dog"], stream=True))
    assert [o for c in streamed for o in c.choices[0].logprobs.text_offset] == lp.text_offset
    assert [t for c in streamed for t in c.choices[0].logprobs.tokens] == lp.tokens


def test_echo_returns_the_prompt_and_its_logprobs(live, tiny64):
    client = live[0]
    prompt = "the cat and the"
    prompt_ids = _ids(tiny64, prompt)
    plain = _greedy(client, prompt=prompt, max_tokens=6).choices[0]
    out = _greedy(client, prompt=prompt, max_tokens=6, echo=True, logprobs=3).choices[0]
    prompt_text = tiny64.tokenizer.decode(prompt_ids, skip_special_tokens=True)
    assert out.text == prompt_text + plain.text and out.token_ids == plain.token_ids
    lp = out.logprobs
    n = len(prompt_ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[:n] == tiny64.tokenizer.convert_ids_to_tokens(prompt_ids)
    assert len(lp.tokens) == n + len(plain.token_ids)
    ref = torch.log_softmax(tiny64.model(input_ids=torch.tensor([prompt_ids])).logits[0].double(), -1)
    for i in range(1, n):
        assert lp.token_logprobs[i] == pytest.approx(float(ref[i - 1, prompt_ids[i]]), abs=1e-6)
        assert len(lp.top_logprobs[i]) == 3
    for k, tok in enumerate(lp.tokens):  # offsets into the echoed text
        assert out.text[lp.text_offset[k] : lp.text_offset[k] + len(tok)] == tok
    echoed = list(_greedy(client, prompt=prompt, max_tokens=6, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in echoed) == out.text
    assert _greedy(client, prompt=prompt, max_tokens=6, echo=True).choices[0].logprobs is None


def test_prompt_logprobs_extension_in_vllms_shape(live, tiny64):
    client, http, _ = live
    prompt_ids = _ids(tiny64, PROMPT)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "prompt_logprobs": 2}
    got = http.post("/v1/completions", json=body).json()["choices"][0]["prompt_logprobs"]
    assert len(got) == len(prompt_ids) and got[0] is None
    ref = torch.log_softmax(tiny64.model(input_ids=torch.tensor([prompt_ids])).logits[0].double(), -1)
    for i, entry in enumerate(got[1:], start=1):
        mine = entry[str(prompt_ids[i])]
        assert mine["logprob"] == pytest.approx(float(ref[i - 1, prompt_ids[i]]), abs=1e-6)
        assert mine["rank"] == int((ref[i - 1] > ref[i - 1, prompt_ids[i]]).sum()) + 1
        top = ref[i - 1].topk(2).indices.tolist()
        assert set(entry) == {str(prompt_ids[i]), *map(str, top)}
        assert mine["decoded_token"] == tiny64.tokenizer.convert_ids_to_tokens(prompt_ids[i])
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    assert chat.choices[0].prompt_logprobs[0] is None and len(chat.choices[0].prompt_logprobs) > 3
    stream = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, stream=True,
                                            extra_body={"prompt_logprobs": 1}))
    firsts = [c.choices[0].model_extra.get("prompt_logprobs") for c in stream]
    assert firsts[0] is not None and len(firsts[0]) == len(prompt_ids) and all(f is None for f in firsts[1:])


def test_chat_logprobs_have_n_alternatives_and_special_tokens_by_name(live, tiny64):
    client = live[0]
    eos = tiny64.eos_token_ids[0]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=4,
                                          extra_body={"min_tokens": 3, "logit_bias": {str(eos): 100}}).choices[0]
    content = chat.logprobs.content
    assert len(content) == len(chat.token_ids) == 4 and chat.token_ids[-1] == eos
    assert content[-1].token == "<eos>" and bytes(content[-1].bytes) == b"<eos>"
    assert all(len(e.top_logprobs) == 4 for e in content)
    assert "".join(e.token for e in content[:-1]) == chat.message.content  # EOS is not in the text


def test_top_logprobs_keep_alternatives_whose_strings_collide():
    class Same:
        def text_of(self, t):
            return "a"

    assert _top_dict(Same(), [(5, -0.1), (7, -0.2), (9, -0.3)]) == {"a": -0.1, "token_id:7": -0.2, "token_id:9": -0.3}


# --------------------------------------------------------------------------- byte-level tokens


def test_token_bytes_of_a_byte_level_vocabulary():
    tok = make_byte_level_tokenizer()
    tb = TokenBytes(tok)
    ids = tok("中 th")["input_ids"]
    assert tb.kind == "byte-level"
    assert [tb.bytes_of(t) for t in ids] == [b"\xe4", b"\xb8", b"\xad", b" th"]
    assert [tb.text_of(t) for t in ids] == ["bytes:\\xe4", "bytes:\\xb8", "bytes:\\xad", " th"]
    assert tb.entry(2) == (b"<|im_end|>", "<|im_end|>") and tb.is_special(2)
    assert display("é".encode()) == "é" and display(b"\xc3") == "bytes:\\xc3"


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    from conftest import make_tiny_model

    tok = make_byte_level_tokenizer()
    path = Path(tmp_path_factory.mktemp("bytes")) / "byte-llama"
    model = make_tiny_model(len(tok), seed=3)
    model.config.eos_token_id = 2
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return load_float64(path)


def test_split_characters_give_each_token_its_real_bytes(byte_model):
    prompt = "中文 the"
    with serving(byte_model, draft="none", max_batch_size=1) as (client, http, _):
        pieces = [tuple(t.encode()) for t in "中文"]
        allowed = sorted({b + 4 for p in pieces for b in p})  # byte b is token b + 4
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                              max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
                                              extra_body={"allowed_token_ids": allowed}).choices[0]
        for e, t in zip(chat.logprobs.content, chat.token_ids):
            assert bytes(e.bytes) == bytes([t - 4]) and "\ufffd" not in e.token
            assert e.token == display(bytes([t - 4]))
            assert all(a.token == display(bytes(a.bytes)) and "\ufffd" not in a.token for a in e.top_logprobs)
        assert b"".join(bytes(e.bytes) for e in chat.logprobs.content).decode("utf-8", "replace") == \
            chat.message.content
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, echo=True,
                                        logprobs=1).choices[0]
        lp = out.logprobs
        assert lp.tokens[:6] == ["bytes:\\xe4", "bytes:\\xb8", "bytes:\\xad", "bytes:\\xe6", "bytes:\\x96",
                                 "bytes:\\x87"]
        assert lp.text_offset[:8] == [0, 0, 0, 1, 1, 1, 2, 5]  # a continuation byte starts where its character does
        assert out.text.startswith(prompt)
        raw = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "logprobs": 2,
                                                 "echo": True}).content
        assert "\\ufffd" not in json.dumps(json.loads(raw)["choices"][0]["logprobs"]["tokens"])
