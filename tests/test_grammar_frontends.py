"""Structured output through the front ends: ``SpecDecoder.generate(json_schema=, regex=, response_format=)``,
``specdecode generate --json-schema FILE / --regex PATTERN`` and the server's ``response_format`` on both endpoints.

The model directory is a tiny random Llama with SmolLM2-135M's tokenizer (llguidance reads its BPE), so every
run takes seconds; outputs are checked to parse and validate, and greedy speculative output to equal
constrained plain decoding.
"""

from __future__ import annotations

import contextlib
import json
import re

import jsonschema
import openai
import pytest
import torch
from starlette.testclient import TestClient

from specdecode import cli
from specdecode.errors import SpecDecodeError
from specdecode.generator import SpecDecoder
from specdecode.models import load_model
from specdecode.proposers import NgramProposer
from specdecode.server import build_state, create_app

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "size": {"enum": ["S", "M", "L"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "size", "count"], "additionalProperties": False}
REGEX = r"[A-Z][a-z]{1,6} [0-9]{2}"


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory):
    """A loadable model directory: a tiny random Llama (vocabulary 49,152) with SmolLM2's tokenizer files."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from specdecode.models import default_cache_dir

    src = default_cache_dir() / "converted" / "smollm2-135m"
    if not (src / "tokenizer.json").exists():
        load_model("smollm2-135m", progress=False)
    tok = AutoTokenizer.from_pretrained(src)
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=256,
                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    path = tmp_path_factory.mktemp("smol-tiny") / "model"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def smol64(smol_dir):
    loaded = load_model(str(smol_dir), progress=False)
    loaded.model.to(torch.float64)
    return loaded


def _valid(text: str) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    return value


# --------------------------------------------------------------------------- the library


def test_generate_with_a_json_schema_equals_constrained_plain_decoding(smol64):
    spec = SpecDecoder(smol64, NgramProposer(), num_speculative_tokens=4)
    plain = spec.plain()
    for prompt in ("Describe a shirt as JSON:", "size and count"):
        for kw in (dict(json_schema=SCHEMA), dict(json_schema=json.dumps(SCHEMA)),
                   dict(response_format={"type": "json_schema", "json_schema": {"name": "shirt", "schema": SCHEMA}})):
            out = spec.generate(prompt, max_new_tokens=96, **kw)
            assert out.finish_reason == "stop" and out.token_ids[-1] in smol64.eos_token_ids
            _valid(out.text)
            assert out.token_ids == plain.generate(prompt, max_new_tokens=96, **kw).token_ids


def test_generate_with_a_regex_and_sampling(smol64):
    spec = SpecDecoder(smol64, NgramProposer(), num_speculative_tokens=4)
    for seed in range(3):
        out = spec.generate("Name and age:", max_new_tokens=32, regex=REGEX, temperature=1.0, seed=seed)
        assert out.finish_reason == "stop" and re.fullmatch(REGEX, out.text), out.text
    out = spec.generate("Any JSON:", max_new_tokens=24, response_format={"type": "json_object"})
    assert out.text.startswith("{")


def test_generate_refuses_bad_structured_requests(smol64):
    spec = SpecDecoder(smol64, None)
    with pytest.raises(SpecDecodeError, match="at most one") as info:
        spec.generate("x", json_schema=SCHEMA, regex="a")
    assert info.value.field == "regex"
    with pytest.raises(SpecDecodeError, match="unclosed group") as info:
        spec.generate("x", regex="(ab")
    assert info.value.field == "regex"
    with pytest.raises(SpecDecodeError, match="Invalid type") as info:
        spec.generate("x", json_schema={"type": "foo"})
    assert info.value.field == "json_schema"
    with pytest.raises(SpecDecodeError, match="response_format.type") as info:
        spec.generate("x", response_format={"type": "yaml"})
    assert info.value.field == "response_format"
    assert spec.compile_structured() is None
    assert spec.compile_structured(json_schema=SCHEMA) is spec.compile_structured(json_schema=json.dumps(SCHEMA))


# --------------------------------------------------------------------------- the command line


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_parses_the_structured_output_flags(tmp_path):
    parser = cli.build_parser()
    args = parser.parse_args(["generate", "--json-schema", "s.json"])
    assert args.json_schema == "s.json" and args.regex is None
    assert parser.parse_args(["generate", "--regex", "[a-z]+"]).regex == "[a-z]+"
    with pytest.raises(SpecDecodeError, match="not allowed with argument --json-schema"):
        parser.parse_args(["generate", "--json-schema", "s.json", "--regex", "a"])
    help_text = parser._subparsers._group_actions[0].choices["generate"].format_help()
    assert "--json-schema FILE" in help_text and "--regex PATTERN" in help_text


@pytest.mark.slow
def test_cli_generates_valid_json_and_regex_matches(capsys, smol_dir, tmp_path):
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    base = ["generate", "--target", str(smol_dir), "--weights", "fp32", "--prompt", "A shirt:", "--json",
            "--no-warmup", "--max-new-tokens", "96"]
    code, out, err = _run(capsys, *base, "--json-schema", str(schema_file), "--compare-baseline")
    assert code == 0, err
    rec = json.loads(out.splitlines()[-1])
    assert rec["finish_reason"] == "stop" and rec["matches_baseline"]
    _valid(rec["text"])
    code, out, err = _run(capsys, *base, "--regex", REGEX, "--temperature", "1", "--seed", "3")
    assert code == 0, err
    assert re.fullmatch(REGEX, json.loads(out.splitlines()[-1])["text"])


@pytest.mark.parametrize("content, flag_args, needle", [
    ('{"type": "object",', None, "is not valid JSON"),
    ("[1, 2]", None, "not a schema object"),
    ('{"type": "foo"}', None, "--json-schema: invalid JSON schema: Invalid type: foo"),
    (None, ["--regex", "(ab"], "--regex: invalid regular expression"),
    (None, ["--json-schema", "/nonexistent/schema.json"], "cannot read"),
])
def test_cli_refuses_bad_schemas_and_regexes_in_one_line(capsys, smol_dir, tmp_path, content, flag_args, needle):
    if content is not None:
        path = tmp_path / "bad.json"
        path.write_text(content)
        flag_args = ["--json-schema", str(path)]
    code, out, err = _run(capsys, "generate", "--target", str(smol_dir), "--weights", "fp32", "--prompt", "x",
                          "--no-warmup", *flag_args)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and out == "" and len(errors) == 1 and needle in errors[0], err


# --------------------------------------------------------------------------- the server


@contextlib.contextmanager
def _serving(loaded, **kw):
    state = build_state(loaded, kw.pop("draft", "ngram"), model_name="tiny", policy="fixed", **kw)
    with TestClient(create_app(state)) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0), http


@pytest.fixture(scope="module")
def served(smol64):
    with _serving(smol64, max_batch_size=4, num_speculative_tokens=4) as server:
        yield server


RF = {"type": "json_schema", "json_schema": {"name": "shirt", "schema": SCHEMA, "strict": True}}


def test_chat_with_a_json_schema_response_format(served, smol64):
    client, _ = served
    msgs = [{"role": "user", "content": "Describe a shirt."}]
    resp = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=96, temperature=0,
                                          response_format=RF)
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    _valid(choice.message.content)
    plain = SpecDecoder(smol64, None)
    want = plain.generate(plain.encode_chat(msgs), max_new_tokens=96, response_format=RF)
    assert choice.message.content == want.text
    sampled = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=96, temperature=1.0, n=3,
                                             seed=5, response_format=RF)
    for c in sampled.choices:
        assert c.finish_reason == "stop"
        _valid(c.message.content)


def test_completions_with_response_format_and_streaming(served):
    client, _ = served
    resp = client.completions.create(model="tiny", prompt="A shirt:", max_tokens=96, temperature=0,
                                     extra_body={"response_format": RF})
    _valid(resp.choices[0].text)
    stream = client.completions.create(model="tiny", prompt="A shirt:", max_tokens=96, temperature=0, stream=True,
                                       extra_body={"response_format": RF})
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == resp.choices[0].text
    obj = client.completions.create(model="tiny", prompt="{", max_tokens=16, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert obj.choices[0].text.startswith("{")
    text = client.completions.create(model="tiny", prompt="x", max_tokens=4, temperature=0,
                                     extra_body={"response_format": {"type": "text"}})
    assert text.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("rf, needle", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}, "Invalid type: foo"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema is missing"),
    ({"type": "yaml"}, "response_format.type"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "(["}}}, "unclosed"),
])
def test_a_bad_response_format_gets_a_400_naming_it(served, rf, needle):
    _, http = served
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        r = http.post(path, json={"model": "tiny", "max_tokens": 8, "response_format": rf, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "response_format" and needle in err["message"], err


def _text(path: str, resp: dict) -> str:
    choice = resp["choices"][0]
    return choice["text"] if path == "/v1/completions" else choice["message"]["content"]


ENDPOINTS = (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Describe a shirt."}]}),
             ("/v1/completions", {"prompt": "A shirt:"}))
CHOICES = ["yes", "no", "a.b (c)|d", "1+1=2?", "-~#&^$ \\ [x]{y}*", "two\nlines"]


@pytest.mark.parametrize("path, body", ENDPOINTS)
def test_vllm_guided_fields_on_both_endpoints(served, path, body):
    """guided_json (an object or its JSON text) = response_format's json_schema, guided_regex matches whole,
    guided_choice returns one of the strings exactly (regex syntax in them is literal)."""
    _, http = served

    def post(**kw):
        r = http.post(path, json={"model": "tiny", "max_tokens": 96, "temperature": 0, **body, **kw})
        assert r.status_code == 200, r.text
        return r.json()

    want = _text(path, post(response_format=RF))
    _valid(want)
    assert _text(path, post(guided_json=SCHEMA)) == want == _text(path, post(guided_json=json.dumps(SCHEMA)))
    assert re.fullmatch(REGEX, _text(path, post(guided_regex=REGEX)))
    assert _text(path, post(guided_choice=CHOICES)) in CHOICES
    sampled = post(guided_choice=CHOICES, temperature=1.0, seed=3, n=6)
    assert all((c.get("text") if "text" in c else c["message"]["content"]) in CHOICES for c in sampled["choices"])
    for only in CHOICES[2:]:  # the one choice, syntax characters and all, comes out exactly
        assert _text(path, post(guided_choice=[only])) == only


def test_choice_regex_escapes_the_syntax_characters():
    from specdecode.grammar import StructuredOutput, escape_regex

    assert escape_regex("a.b (c)|d") == r"a\.b \(c\)\|d"
    assert StructuredOutput.choice(["x", "y.z"], "guided_choice") == StructuredOutput.regex(r"(x|y\.z)")
    for bad in ([], "yes", ["a", 1]):
        with pytest.raises(SpecDecodeError, match="non-empty list of strings") as info:
            StructuredOutput.choice(bad, "guided_choice")
        assert info.value.field == "guided_choice"


@pytest.mark.parametrize("fields, param, needle", [
    ({"guided_json": {"type": "foo"}}, "guided_json", "Invalid type: foo"),
    ({"guided_json": "{\"type\": "}, "guided_json", "not valid JSON"),
    ({"guided_json": "[1]"}, "guided_json", "must be a JSON object"),
    ({"guided_regex": "(ab"}, "guided_regex", "unclosed"),
    ({"guided_regex": ""}, "guided_regex", "non-empty"),
    ({"guided_choice": []}, "guided_choice", "at least one"),
    ({"guided_json": SCHEMA, "response_format": RF}, "guided_json", "cannot be combined with response_format"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "cannot be combined with guided_regex"),
])
def test_a_bad_guided_field_gets_a_400_naming_it(served, fields, param, needle):
    _, http = served
    for path, body in ENDPOINTS:
        r = http.post(path, json={"model": "tiny", "max_tokens": 8, **body, **fields})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and needle in err["message"], err
    ok = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 4,
                                            "response_format": {"type": "text"}, "guided_regex": "[a-z]{4}"})
    assert ok.status_code == 200 and re.fullmatch("[a-z]{4}", ok.json()["choices"][0]["text"])


@pytest.mark.parametrize("flag, value, needle", [
    ("--regex", "[a-z", "--regex: invalid regular expression: unclosed character class"),
    ("--json-schema", '{"type": "objekt"}', "--json-schema: invalid JSON schema: Invalid type: objekt"),
])
def test_cli_refuses_a_bad_regex_or_schema_before_the_model_loads(capsys, monkeypatch, tmp_path, flag, value, needle):
    """llguidance checks a pattern's syntax and a schema's keywords without a tokenizer: refused at the door,
    nothing loaded."""
    import specdecode.generator as generator

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the regex was checked")

    monkeypatch.setattr(generator.SpecDecoder, "from_pretrained", classmethod(no_load))
    if flag == "--json-schema":
        (tmp_path / "s.json").write_text(value)
        value = str(tmp_path / "s.json")
    code, out, err = _run(capsys, "generate", "--prompt", "x", flag, value)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and out == "" and len(errors) == 1, err
    assert needle in errors[0], errors[0]
