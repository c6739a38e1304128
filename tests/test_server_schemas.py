"""Wire schemas of the OpenAI-compatible API (``specdecode.server.schemas``): strict types, the range checks
with messages naming the field, fields this server cannot honour refused, and the helpers the routes use.
(The HTTP errors these become: ``tests/test_server_app.py``.)"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from specdecode.server.schemas import (
    MAX_CHOICES,
    MAX_STOP,
    MAX_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    SpeculativeOptions,
)

USER = [{"role": "user", "content": "hi"}]


def _error(cls, **body) -> str:
    with pytest.raises(ValidationError) as info:
        cls(**body)
    return str(info.value)


def test_a_minimal_completion_and_its_defaults():
    req = CompletionRequest(model="m", prompt="x")
    assert (req.max_tokens, req.temperature, req.top_p, req.top_k, req.n, req.seed) == (None, None, None, None, 1,
                                                                                        None)
    assert req.stops == [] and not req.include_usage and not req.stream and req.prompts() == ["x"]
    req = CompletionRequest(model="m", prompt="x", stop="\n", stream=True, stream_options={"include_usage": True},
                            user="someone", metadata={"a": "1"}, store=False, service_tier="auto")  # harmless
    assert req.stops == ["\n"] and req.include_usage


@pytest.mark.parametrize("prompt, prompts", [
    ("one", ["one"]), (["a", "b"], ["a", "b"]), ([5, 6, 7], [[5, 6, 7]]), ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_prompt_forms(prompt, prompts):
    assert CompletionRequest(model="m", prompt=prompt).prompts() == prompts


@pytest.mark.parametrize("body, field, needle", [
    (dict(max_tokens=0), "max_tokens", "max_tokens must be >= 1"),
    (dict(max_tokens="5"), "max_tokens", "integer"),  # strict: no coercion from strings
    (dict(temperature=2.5), "temperature", "[0, 2]"),
    (dict(temperature=float("nan")), "temperature", "[0, 2]"),
    (dict(top_k=-2), "top_k", ">= 0"),
    (dict(n=0), "n", f"[1, {MAX_CHOICES}]"),
    (dict(n=MAX_CHOICES + 1), "n", f"[1, {MAX_CHOICES}]"),
    (dict(seed=-1), "seed", "2**63"),
    (dict(stop=["a"] * (MAX_STOP + 1)), "stop", f"at most {MAX_STOP}"),
    (dict(stop=""), "stop", "non-empty"),
    (dict(stream=1), "stream", "boolean"),
    (dict(logprobs=MAX_TOP_LOGPROBS + 1), "logprobs", f"[0, {MAX_TOP_LOGPROBS}]"),
    (dict(prompt=[]), "prompt", "empty list"),
    (dict(prompt=[[1], []]), "prompt", "at least one token"),
])
def test_completion_values_out_of_range_name_the_field(body, field, needle):
    message = _error(CompletionRequest, **{"model": "m", "prompt": "x", **body})
    assert field in message and needle in message


@pytest.mark.parametrize("body, field, needle", [
    (dict(logit_bias={"five": 1}), "logit_bias", "token ids as strings"),
    (dict(logit_bias={"\u00b2": 1}), "logit_bias", "token ids as strings"),  # "²".isdigit(), not int()'s
    (dict(logit_bias={"-5": 1}), "logit_bias", "token ids as strings"),
    (dict(logit_bias={"5": "1"}), "logit_bias", "number"),
    (dict(stop_token_ids=list(range(MAX_TOKEN_IDS + 1))), "stop_token_ids", f"at most {MAX_TOKEN_IDS}"),
    (dict(prompt_logprobs=21), "prompt_logprobs", "[0, 20]"),
    (dict(best_of=0), "best_of", "[1, 64]"),
    (dict(best_of=1, n=2), "best_of", "must be >= n"),
    (dict(best_of=3, stream=True), "best_of", "cannot stream"),
    (dict(speculative={"verification": "magic"}), "verification", "token"),
    (dict(speculative={"sampling_mode": "always"}), "sampling_mode", "coupled"),
    (dict(speculative={"enabled": 1}), "enabled", "boolean"),
    (dict(guided_json={}, guided_regex="a"), "guided_regex", "cannot be combined with guided_json"),
    (dict(response_format={"type": "json_object"}, guided_choice=["a"]), "guided_choice",
     "cannot be combined with response_format"),
    (dict(guided_choice=[]), "guided_choice", "at least one"),
    (dict(guided_choice=["a", 1]), "guided_choice", "string"),
    (dict(guided_json=5), "guided_json", "guided_json"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output", "boolean"),
    (dict(store=True), "store", "not supported"),
    (dict(service_tier="priority"), "service_tier", "not supported"),
    (dict(suffix="tail"), "suffix", "not supported"),
])
def test_sampling_fields_out_of_range_name_the_field(body, field, needle):
    message = _error(CompletionRequest, **{"model": "m", "prompt": "x", **body})
    assert field in message and needle in message, message


@pytest.mark.parametrize("cls, extra", [
    (CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest, {"messages": USER}),
])
@pytest.mark.parametrize("field", ["bogus_field", "tools_choice", "audio", "bad_words", "modalities"])
def test_unknown_and_unsupported_fields_are_refused(cls, extra, field):
    with pytest.raises(ValidationError) as info:
        cls.model_validate({"model": "m", **extra, field: 1})
    err = info.value.errors()[0]
    assert err["type"] == "extra_forbidden" and err["loc"] == (field,)


def test_the_library_checks_its_own_ranges():
    """Values the library range-checks (``validate.check_sampling``, ``check_request_speculation``) pass the
    schema: one copy of each rule; the server answers them with a 400 naming the field (test_server_sampling)."""
    req = CompletionRequest(model="m", prompt="x", top_p=0.0, min_p=1.5, presence_penalty=2.5, frequency_penalty=-3.0,
                            repetition_penalty=0.0, logit_bias={"5": 101}, min_tokens=-1, stop_token_ids=[-1],
                            allowed_token_ids=[], speculative={"num_speculative_tokens": 0})
    assert req.min_p == 1.5 and req.speculative.num_speculative_tokens == 0


def test_null_values_of_refused_openai_fields_ask_for_nothing():
    req = ChatCompletionRequest.model_validate({"model": "m", "parallel_tool_calls": None, "audio": None,
                                                "messages": [{"role": "assistant", "content": "a", "refusal": None,
                                                              "tool_calls": None}, *USER]})
    assert len(req.messages) == 2
    for body in ({"tools": None}, {"tools": []}, {"tool_choice": "none"}, {"functions": []}):
        ChatCompletionRequest.model_validate({"model": "m", "messages": USER, **body})
    for body in ({"bogus": None}, {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}):
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate({"model": "m", "messages": USER, **body})


def test_the_whole_sampling_surface_is_accepted():
    req = CompletionRequest(model="m", prompt="x", presence_penalty=0.5, frequency_penalty=-1.0,
                            repetition_penalty=1.2, min_p=0.1, logit_bias={"5": 10, "7": -100}, echo=True,
                            best_of=3, n=2, top_k=-1, min_tokens=3, stop_token_ids=[4], allowed_token_ids=[4, 5],
                            prompt_logprobs=2, seed=1, ignore_eos=True, include_stop_str_in_output=True,
                            skip_special_tokens=False, guided_choice=["yes", "no"],
                            speculative={"enabled": False, "num_speculative_tokens": 2, "verification": "block",
                                         "sampling_mode": "standard"})
    assert req.candidates == 3 and req.speculative.verification == "block" and req.logit_bias == {"5": 10.0,
                                                                                                  "7": -100.0}
    assert req.speculative.coupled is False and req.include_stop_str_in_output and not req.skip_special_tokens
    assert [SpeculativeOptions(sampling_mode=m).coupled for m in ("auto", "standard", "coupled")] == [None, False,
                                                                                                      True]
    assert CompletionRequest(model="m", prompt="x").speculative is None
    for guided in (dict(guided_json={"type": "object"}), dict(guided_json='{"type": "object"}'),
                   dict(guided_regex="[a-z]+"), dict(guided_json={}, response_format={"type": "text"})):
        CompletionRequest(model="m", prompt="x", **guided)
    assert CompletionRequest(model="m", prompt="x", n=2).candidates == 2
    ChatCompletionRequest(model="m", messages=USER, presence_penalty=1, logit_bias={"3": 1.5}, min_p=0.0,
                          speculative={}, prompt_logprobs=0)


def test_chat_messages_roles_parts_and_developer_as_system():
    req = ChatCompletionRequest(model="m", messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "one "}, {"type": "text", "text": "two"}]},
        {"role": "assistant", "content": None},
    ])
    assert req.chat_messages() == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "one two"},
                                   {"role": "assistant", "content": ""}]


def test_chat_max_completion_tokens_wins_over_max_tokens():
    assert ChatCompletionRequest(model="m", messages=USER, max_tokens=5).max_new_tokens == 5
    assert ChatCompletionRequest(model="m", messages=USER, max_tokens=5, max_completion_tokens=9).max_new_tokens == 9
    assert ChatCompletionRequest(model="m", messages=USER).max_new_tokens is None


@pytest.mark.parametrize("body, needle", [
    (dict(messages=[]), "at least one message"),
    (dict(messages=[{"role": "wizard", "content": "x"}]), "role"),
    (dict(messages=[{"role": "user"}]), "messages[0] (user) has no content"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "text": "x"}]}]), "text"),
    (dict(messages=[{"role": "user", "content": "x", "tool_calls": []}]), "tool_calls"),
    (dict(messages=USER, tools=[{"type": "function"}]), "tools\n  Extra inputs are not permitted"),
    (dict(messages=USER, tool_choice="auto"), "tool_choice\n  Extra inputs are not permitted"),
    (dict(messages=USER, top_logprobs=3), "top_logprobs needs logprobs: true"),
    (dict(messages=USER, top_logprobs=21, logprobs=True), "[0, 20]"),
    (dict(messages=USER, max_completion_tokens=0), "max_completion_tokens must be >= 1"),
])
def test_chat_errors(body, needle):
    assert needle in _error(ChatCompletionRequest, model="m", **body)


def test_chat_accepts_text_response_format_and_no_tools():
    req = ChatCompletionRequest(model="m", messages=USER, response_format={"type": "text"}, tool_choice="none",
                                logprobs=True, top_logprobs=2)
    assert req.top_logprobs == 2


def test_model_list_shape():
    card = ModelCard(id="tiny", created=1, max_model_len=256, draft="ngram", num_speculative_tokens=4)
    body = ModelList(data=[card]).model_dump()
    assert body["object"] == "list" and body["data"][0]["object"] == "model"
    assert body["data"][0]["owned_by"] == "specdecode"
