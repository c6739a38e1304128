"""Structured output (``specdecode.grammar``): the constraint protocol, errors, and losslessness under speculation.

Units and engine tests run on SmolLM2-135M's tokenizer (real BPE, 49,152 tokens) with tiny random Llamas of
that vocabulary, so they take seconds; the distribution test uses a hand-made 8-token vocabulary where every
constrained output can be enumerated. Real-weights runs are in ``test_grammar_integration.py``.
"""

from __future__ import annotations

import itertools
import json
import weakref
from collections import Counter

import jsonschema
import llguidance
import pytest
import torch

from specdecode.engine import EngineConfig, SpeculativeEngine
from specdecode.errors import SpecDecodeError
from specdecode.grammar import StructuredOutput, compile_grammar
from specdecode.proposers import (DraftModelProposer, LayerSkipConfig, LayerSkipProposer, NgramConfig, NgramProposer,
                                  SuffixConfig, SuffixProposer, TreeDraftConfig, TreeDraftProposer)
from specdecode.proposers.base import RowProposer
from specdecode.types import Draft, SamplingParams
from tiny import chi2_pvalue, tiny_llama


@pytest.fixture(scope="module")
def tok():
    """SmolLM2-135M's tokenizer, from the converted model directory (converted once if it is missing)."""
    from transformers import AutoTokenizer

    from specdecode.models import default_cache_dir, load_model

    path = default_cache_dir() / "converted" / "smollm2-135m"
    if not (path / "tokenizer.json").exists():
        load_model("smollm2-135m", progress=False)
    return AutoTokenizer.from_pretrained(path)


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
         "required": ["color", "ok"], "additionalProperties": False}
TAGS = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 3},
                                                  "minItems": 1, "maxItems": 3}},
        "required": ["tags"], "additionalProperties": False}
POINT = {"type": "object", "properties": {
    "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                               "y": {"type": "integer", "minimum": -9, "maximum": 9}},
              "required": ["x", "y"], "additionalProperties": False},
    "label": {"type": "string", "maxLength": 4}}, "required": ["point", "label"], "additionalProperties": False}
SCHEMAS = {"person": PERSON, "color": COLOR, "tags": TAGS, "point": POINT}
REGEX = r"[a-z]{2,5}-[0-9]{1,3}"


def _encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


# --------------------------------------------------------------------------- units: the constraint protocol


def test_chain_masks_equal_masks_of_step_by_step_commits(tok):
    grammar = compile_grammar(tok, len(tok), StructuredOutput.json_schema(PERSON))
    ids = _encode(tok, '{"name": "Ann", "age": 42}') + [tok.eos_token_id]
    spec = grammar.new_constraint()
    chain = spec.masks([ids[:j] for j in range(len(ids))])  # [k, V]: one row per prefix
    step = grammar.new_constraint()
    for j, t in enumerate(ids):
        assert torch.equal(step.masks([[]])[0], chain[j]), f"position {j}"
        assert chain[j, t]
        step.commit([t])
    assert step.ended


def test_tree_paths_masks_equal_a_fresh_matcher_per_path(tok):
    """General (non-prefix) paths in any order: siblings, cousins, back to the root."""
    grammar = compile_grammar(tok, len(tok), StructuredOutput.json_schema(COLOR))
    a = _encode(tok, '{"color": "red", "ok": true}')
    b = _encode(tok, '{"color": "blue", "ok": false}')
    paths = [a[:3], b[:5], [], a[:6], b[:8], a[:2], b[:8] + [tok.eos_token_id]]
    got = grammar.new_constraint().masks(paths)
    for j, path in enumerate(paths):
        fresh = grammar.new_constraint()
        fresh.commit(path)
        assert torch.equal(got[j], fresh.masks([[]])[0]), f"path {j}"


def test_valid_prefix_cuts_at_the_first_forbidden_token(tok):
    grammar = compile_grammar(tok, len(tok), StructuredOutput.json_schema(PERSON))
    ids = _encode(tok, '{"name": "Ann", "age": 42}')
    c = grammar.new_constraint()
    assert c.valid_prefix(ids) == len(ids)
    assert c.valid_prefix(ids + [tok.eos_token_id]) == len(ids) + 1
    bad = _encode(tok, "x")[0]
    for at in (0, 3, len(ids) - 1):
        assert c.valid_prefix(ids[:at] + [bad] + ids[at:]) == at
    assert c.valid_prefix([]) == 0
    over = _encode(tok, '{"name": "Ann", "age": 121}')  # past the maximum: cut at the digit that leaves the range
    assert c.valid_prefix(over) == len(over) - 2 and tok.decode(over[len(over) - 2]) == "1"
    long = _encode(tok, '{"name": "Annabel1", "age": 1}')  # past maxLength 6
    assert c.valid_prefix(long) == long.index(_encode(tok, "Ann")[0]) + 1


def test_masks_and_valid_prefix_leave_no_trace(tok):
    """Asking about draft paths (valid, rejected, past EOS) changes nothing a later commit or mask sees."""
    grammar = compile_grammar(tok, len(tok), StructuredOutput.json_schema(TAGS))
    ids = _encode(tok, '{"tags": ["ab", "c"]}') + [tok.eos_token_id]
    bad = _encode(tok, "zzz")
    busy, quiet = grammar.new_constraint(), grammar.new_constraint()
    for j in range(len(ids)):
        busy.masks([ids[j:j + 4], ids[j:j + 1] + bad, bad, ids[j:]])
        busy.valid_prefix(ids[j:j + 3] + bad)
        busy.valid_prefix(bad)
        assert torch.equal(busy.masks([[], ids[j:j + 1]]), quiet.masks([[], ids[j:j + 1]])), f"position {j}"
        busy.commit([ids[j]])
        quiet.commit([ids[j]])
    assert busy.ended and quiet.ended and busy.error is None


def test_a_rejected_path_gets_an_all_true_row_and_the_rest_are_exact(tok):
    grammar = compile_grammar(tok, len(tok), StructuredOutput.json_schema(PERSON))
    ids = _encode(tok, '{"name":')
    bad = _encode(tok, "x")[0]
    c = grammar.new_constraint()
    assert c.valid_prefix(ids) == len(ids)
    rows = c.masks([ids, ids + [bad], ids + [bad, bad], [bad]])
    assert rows[1:].all() and not rows[0].all()


def test_a_complete_grammar_allows_only_eos_and_nothing_after_eos(tok):
    grammar = compile_grammar(tok, len(tok), StructuredOutput.json_schema(COLOR))
    ids = _encode(tok, '{"color": "red", "ok": true}')
    c = grammar.new_constraint()
    c.commit(ids)
    assert c.masks([[]])[0].nonzero().flatten().tolist() == [tok.eos_token_id]
    assert c.masks([[tok.eos_token_id]])[0].all()  # past the end: nothing to constrain (ignore_eos)
    c.commit([tok.eos_token_id])
    assert c.ended and c.valid_prefix([5, 6, 7]) == 3 and c.masks([[], [5]]).all()


def test_regex_masks_and_the_eos_set_of_the_request(tok):
    eos = (tok.eos_token_id, 0)
    grammar = compile_grammar(tok, len(tok), StructuredOutput.regex(REGEX), eos_token_ids=eos)
    ids = _encode(tok, "abc-42")
    c = grammar.new_constraint()
    assert c.valid_prefix(ids + [0]) == len(ids) + 1
    c.commit(ids)
    allowed = c.masks([[]])[0]
    assert allowed[0] and allowed[tok.eos_token_id] and allowed[_encode(tok, "7")[0]]


def test_the_mask_is_padded_with_false_beyond_the_tokenizer(tok):
    v = len(tok) + 64  # a model whose logits are wider than its tokenizer (Qwen2: 151,936 vs 151,665)
    c = compile_grammar(tok, v, StructuredOutput.json_object()).new_constraint()
    m = c.masks([[], _encode(tok, "{")])
    assert m.shape == (2, v) and not m[:, len(tok):].any() and m[:, : len(tok)].any(1).all()
    assert c.valid_prefix([len(tok) + 3]) == 0


def test_compiled_grammars_and_tokenizers_are_cached(tok):
    a = compile_grammar(tok, len(tok), StructuredOutput.json_schema(PERSON))
    b = compile_grammar(tok, len(tok), StructuredOutput.json_schema(json.dumps(PERSON)))
    assert a is b and a.new_constraint() is not b.new_constraint()
    assert compile_grammar(tok, len(tok) + 1, StructuredOutput.json_schema(PERSON)) is not a


def test_property_order_is_part_of_the_grammar(tok):
    """The output writes properties in the schema's order: a reordered schema is another grammar."""
    flipped = {**PERSON, "properties": dict(reversed(list(PERSON["properties"].items())))}
    a = compile_grammar(tok, len(tok), StructuredOutput.json_schema(PERSON)).new_constraint()
    b = compile_grammar(tok, len(tok), StructuredOutput.json_schema(flipped)).new_constraint()
    name_first = _encode(tok, '{"name": "A", "age": 1}')
    assert a.valid_prefix(name_first) == len(name_first) and b.valid_prefix(name_first) < len(name_first)


# --------------------------------------------------------------------------- units: errors


@pytest.mark.parametrize("schema, words", [
    ({"type": "foo"}, "foo"),
    ({"type": "object", "properties": {"a": {"$ref": "#/nope"}}}, "nope"),
    ({"type": "string", "pattern": "(["}, "unclosed"),
    ({"oneOf": 3}, "oneOf"),
])
def test_an_invalid_schema_names_the_field_and_the_problem(tok, schema, words):
    with pytest.raises(SpecDecodeError, match=words) as info:
        compile_grammar(tok, len(tok), StructuredOutput.json_schema(schema))
    assert info.value.field == "json_schema" and "invalid JSON schema" in str(info.value)
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with pytest.raises(SpecDecodeError, match=words) as info:
        compile_grammar(tok, len(tok), StructuredOutput.from_response_format(rf))
    assert info.value.field == "response_format"


@pytest.mark.parametrize("pattern, words", [("(ab", "unclosed group"), ("a{2,1}", "repetition"),
                                            (r"(a)\1", "backreferences"), (r"\bfoo", "lookarounds")])
def test_an_invalid_regex_names_the_field_and_the_problem(tok, pattern, words):
    with pytest.raises(SpecDecodeError, match=words) as info:
        compile_grammar(tok, len(tok), StructuredOutput.regex(pattern))
    assert info.value.field == "regex" and "invalid regular expression" in str(info.value)


def test_schema_text_that_is_not_json_is_refused():
    with pytest.raises(SpecDecodeError, match="not valid JSON") as info:
        StructuredOutput.json_schema('{"type": "object",')
    assert info.value.field == "json_schema"
    with pytest.raises(SpecDecodeError, match="JSON object") as info:
        StructuredOutput.json_schema("[1, 2]")
    with pytest.raises(SpecDecodeError, match="non-empty"):
        StructuredOutput.regex("")
    with pytest.raises(SpecDecodeError, match="JSON cannot represent"):
        StructuredOutput.json_schema({"type": "object", "default": {1, 2}})


def test_response_format_forms():
    assert StructuredOutput.from_response_format(None) is None
    assert StructuredOutput.from_response_format({"type": "text"}) is None
    assert StructuredOutput.from_response_format({"type": "json_object"}) == StructuredOutput("json_object")
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True, "description": "d"}}
    got = StructuredOutput.from_response_format(rf)
    assert got.kind == "json_schema" and got.spec == PERSON and got.field == "response_format"
    assert got == StructuredOutput.json_schema(PERSON) and hash(got) == hash(StructuredOutput.json_schema(PERSON))


@pytest.mark.parametrize("rf, words", [
    ("json", "must be an object"),
    ({"type": "xml"}, "response_format.type"),
    ({}, "response_format.type"),
    ({"type": "json_schema"}, "json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema is missing"),
    ({"type": "json_schema", "json_schema": {"schema": [1]}}, "schema must be a JSON object"),
    ({"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}, "name must be a string"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "strict must be true or false"),
])
def test_a_malformed_response_format_is_refused_clearly(rf, words):
    with pytest.raises(SpecDecodeError, match=words) as info:
        StructuredOutput.from_response_format(rf)
    assert info.value.field == "response_format"


def test_a_slow_tokenizer_is_refused_clearly():
    class NotFast:
        eos_token_id = 0

    with pytest.raises(SpecDecodeError, match="fast"):
        compile_grammar(NotFast(), 8, StructuredOutput.json_object())


# --------------------------------------------------------------------------- the engine: greedy equals constrained plain


@pytest.fixture(scope="module")
def models(tok):
    """A 4-layer target (layer-skip drafts with layers 1, 2 skipped) and a 1-layer draft, vocabulary = SmolLM2's."""
    v = len(tok)
    return tiny_llama(vocab_size=v, seed=0, layers=4, scale=3.0), tiny_llama(vocab_size=v, seed=1, layers=1,
                                                                             hidden=32, scale=3.0)


DRAFTERS = {
    "ngram": lambda t, d: NgramProposer(NgramConfig(1, 3)),
    "suffix": lambda t, d: SuffixProposer(SuffixConfig(use_global=False)),
    "draft-model": lambda t, d: DraftModelProposer(d),
    "self-draft": lambda t, d: DraftModelProposer(t),  # every draft token kept: long chains through the mask
    "layer-skip": lambda t, d: LayerSkipProposer(t, LayerSkipConfig(skip_layers=(1, 2), min_confidence=0.0)),
    "tree-static": lambda t, d: TreeDraftProposer(d, TreeDraftConfig(kind="static", num_nodes=8)),
    "tree-dynamic": lambda t, d: TreeDraftProposer(d, TreeDraftConfig(kind="dynamic", num_nodes=8, top_k=3)),
}
SPECS = {**{k: StructuredOutput.json_schema(s) for k, s in SCHEMAS.items()}, "regex": StructuredOutput.regex(REGEX),
         "json_object": StructuredOutput.json_object()}
PROMPTS = [[1, 504, 2112, 314], [9690, 28, 2185, 30, 327, 327, 327]]


def _run(engine, grammar, prompt, params):
    req, _ = engine.add(prompt, params, constraint=grammar.new_constraint())
    while req.finish_reason is None:
        engine.step()
    return engine.output(req)


def _check_text(tok, spec: StructuredOutput, ids: list[int]) -> None:
    assert ids and ids[-1] == tok.eos_token_id, f"did not end with EOS: {tok.decode(ids)!r}"
    text = tok.decode(ids[:-1])
    if spec.kind == "regex":
        import re

        assert re.fullmatch(spec.spec, text), text
        return
    value = json.loads(text)
    if spec.kind == "json_object":
        assert isinstance(value, dict)
    else:
        jsonschema.validate(value, spec.spec)


@pytest.fixture(scope="module")
def plain_outputs(tok, models):  # half a minute on 2 cores: the tests that read it are slow
    """Constrained plain decoding (no proposer) of every spec and prompt, greedy."""
    target, _ = models
    plain = SpeculativeEngine(target, None)
    params = SamplingParams(max_new_tokens=96, eos_token_ids=(tok.eos_token_id,))
    out = {}
    for name, spec in SPECS.items():
        grammar = compile_grammar(tok, len(tok), spec)
        for i, prompt in enumerate(PROMPTS):
            out[name, i] = _run(plain, grammar, prompt, params).token_ids
    return out


@pytest.mark.slow
def test_constrained_plain_decoding_is_valid(tok, plain_outputs):
    """Bounded specs end in EOS and validate; any JSON object (unbounded: a random model writes keys until
    max_new_tokens) is checked token for token against speculation only."""
    for (name, _), ids in plain_outputs.items():
        if name != "json_object":
            _check_text(tok, SPECS[name], ids)


@pytest.mark.slow
@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_greedy_speculative_equals_constrained_plain_decoding(tok, models, plain_outputs, drafter):
    target, draft = models
    engine = SpeculativeEngine(target, DRAFTERS[drafter](target, draft), EngineConfig(num_speculative_tokens=4))
    params = SamplingParams(max_new_tokens=96, eos_token_ids=(tok.eos_token_id,))
    drafted = 0
    for name, spec in SPECS.items():
        grammar = compile_grammar(tok, len(tok), spec)
        for i, prompt in enumerate(PROMPTS):
            out = _run(engine, grammar, prompt, params)
            assert out.token_ids == plain_outputs[name, i], f"{name} prompt {i}: {tok.decode(out.token_ids)!r}"
            drafted += out.metrics.num_drafted_tokens
    assert drafted > 0


@pytest.mark.slow
def test_a_batch_of_constrained_and_free_rows_keeps_each_row_exact(tok, models, plain_outputs):
    """Rows with different grammars (and one without) in one batch: each equals its constrained plain run."""
    target, draft = models
    engine = SpeculativeEngine(target, DraftModelProposer(draft), EngineConfig(num_speculative_tokens=3,
                                                                                max_batch_size=4))
    params = SamplingParams(max_new_tokens=96, eos_token_ids=(tok.eos_token_id,))
    names = ["person", "regex", "tags"]
    reqs = [engine.add(PROMPTS[0], params, constraint=compile_grammar(tok, len(tok), SPECS[n]).new_constraint())[0]
            for n in names]
    free = engine.add(PROMPTS[0], SamplingParams(max_new_tokens=20))[0]
    while any(r.finish_reason is None for r in [*reqs, free]):
        engine.step()
    for n, r in zip(names, reqs):
        assert r.generated == plain_outputs[n, 0], n
    assert free.generated == SpeculativeEngine(target, None).generate(PROMPTS[0], SamplingParams(max_new_tokens=20)).token_ids


@pytest.mark.parametrize("drafter", ["draft-model", "ngram", pytest.param("tree-dynamic", marks=pytest.mark.slow),
                                     "suffix"])
@pytest.mark.parametrize("coupled", [pytest.param(False, marks=pytest.mark.slow), True])
def test_sampled_outputs_always_validate(tok, models, drafter, coupled):
    target, draft = models
    engine = SpeculativeEngine(target, DRAFTERS[drafter](target, draft), EngineConfig(num_speculative_tokens=4))
    for name in ("person", "point", "regex"):
        grammar = compile_grammar(tok, len(tok), SPECS[name])
        for seed in range(3):
            params = SamplingParams(temperature=1.0, max_new_tokens=96, eos_token_ids=(tok.eos_token_id,), seed=seed,
                                    coupled=coupled)
            _check_text(tok, SPECS[name], _run(engine, grammar, PROMPTS[seed % 2], params).token_ids)


# --------------------------------------------------------------------------- the distribution, exactly


class _ByteTokens:
    """A hand-made vocabulary for llguidance: id 0 = EOS, then a few byte strings."""

    eos_token_id = 0
    bos_token_id = None
    tokens = [b"\xff<eos>", b"a", b"b", b"c", b"ab", b"bc", b"abc", b"x"]
    special_token_ids = [0]

    def __call__(self, text):
        data = text.encode() if isinstance(text, str) else text
        out, i = [], 0
        while i < len(data):  # greedy longest match; unknown bytes are skipped
            for n in (3, 2, 1):
                if data[i:i + n] in self.tokens[1:]:
                    out.append(self.tokens.index(data[i:i + n]))
                    i += n
                    break
            else:
                i += 1
        return out


# Texts xabc, xac, xbc; after the forced x (sampled at prefill) the drafts choose among the token paths
# abc | ab c | a bc | a b c | a c | bc | b c, then EOS.
DIST_REGEX = "x(ab|a|b)c"
DIST_PROMPT = [7, 1, 2, 7]
DIST_SAMPLES = 2500


@pytest.fixture(scope="module")
def dist_setup():
    ll_tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens()))
    grammar = compile_grammar(ll_tok, 8, StructuredOutput.regex(DIST_REGEX))
    target = tiny_llama(vocab_size=8, seed=3, layers=2, scale=2.0)
    draft = tiny_llama(vocab_size=8, seed=4, layers=1, hidden=32, scale=2.0)
    return grammar, target, draft, _exact(grammar, target)


@torch.inference_mode()
def _exact(grammar, target) -> dict[tuple[int, ...], float]:
    """Every constrained output (ending with EOS) and its probability: the target's softmax masked by the
    grammar and renormalised, token by token (constrained plain decoding, enumerated)."""
    out: dict[tuple[int, ...], float] = {}

    def walk(prefix: tuple[int, ...], prob: float) -> None:
        logits = target(input_ids=torch.tensor([DIST_PROMPT + list(prefix)])).logits[0, -1]
        allowed = grammar.new_constraint().masks([list(prefix)])[0]
        p = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1)
        for t in allowed.nonzero().flatten().tolist():
            if t == 0:
                out[prefix + (0,)] = prob * float(p[t])
            else:
                walk(prefix + (t,), prob * float(p[t]))

    walk((), 1.0)
    assert abs(sum(out.values()) - 1) < 1e-9 and len(out) == 7
    return out


class _FixedChain(RowProposer):
    """A deterministic drafter that always proposes a b c x (often forbidden: the engine cuts it)."""

    name = "fixed"

    def propose_row(self, ctx, max_tokens):
        return Draft.chain(torch.tensor([[1, 2, 3, 7][:max_tokens]]))


#: draft model -> {context ids: q before the grammar} (see ``_MaskedDraft._softmax``).
_DRAFT_SOFTMAX: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


class _MaskedDraft(RowProposer):
    """A draft model (no cache) with q built three ways from its softmax: ``"renormalised"`` (masked by the
    grammar and renormalised: right), ``"unmasked"`` (the grammar ignored: forbidden tokens are drafted and
    must be rejected by verification, the chain is not cut) and ``"unnormalised"`` (masked, not renormalised:
    not the law the tokens were drawn from, the negative control). Its logits lean to "x", which the grammar
    forbids after the first token, and to "abc": much of q's mass is masked away, and what is left has another
    shape than the target's."""

    name = "masked-draft"
    BIAS = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0, 4.0])

    def __init__(self, model, mode: str) -> None:
        self.model, self.mode = model, mode

    @torch.inference_mode()
    def _softmax(self, ids: list[int]) -> torch.Tensor:
        """[V] float32 softmax of the biased logits after ``ids``: one forward per distinct context (the few
        contexts the grammar allows recur thousands of times; a forward of the same ids gives the same q)."""
        memo = _DRAFT_SOFTMAX.setdefault(self.model, {})
        key = tuple(ids)
        if key not in memo:
            logits = self.model(input_ids=torch.tensor([ids])).logits[0, -1].float() + self.BIAS
            memo[key] = torch.softmax(logits, -1)
        return memo[key]

    @torch.inference_mode()
    def propose_row(self, ctx, max_tokens):
        path, probs = [], []
        for _ in range(max_tokens):
            q = self._softmax(ctx.token_ids + path)
            if self.mode != "unmasked":
                q = q * ctx.sampler.constraint.masks([path])[0]
            if self.mode == "renormalised":
                q = q / q.sum()
            tok = int(torch.multinomial(q, 1, generator=ctx.generator))
            path.append(tok)
            probs.append(q)
            if tok == 0:
                break
        return Draft.chain(torch.tensor([path]), torch.stack(probs).unsqueeze(0))


def _sample_counts(grammar, target, proposer, coupled: bool, n: int = DIST_SAMPLES) -> Counter:
    engine = SpeculativeEngine(target, proposer, EngineConfig(num_speculative_tokens=3, max_batch_size=50))
    prompts = [DIST_PROMPT] * n
    params = [SamplingParams(temperature=1.0, max_new_tokens=6, eos_token_ids=(0,), seed=10_000 + i, coupled=coupled)
              for i in range(n)]
    counts: Counter = Counter()
    waiting = list(range(n))
    live = []
    while waiting or live:
        while waiting and len(engine.rows) < engine.max_batch_size:
            i = waiting.pop()
            live.append(engine.add(prompts[i], params[i], constraint=grammar.new_constraint())[0])
        engine.step()
        for r in [r for r in live if r.finish_reason is not None]:
            counts[tuple(r.generated)] += 1
            live.remove(r)
    return counts


def _pvalue(counts: Counter, exact: dict) -> float:
    assert set(counts) <= set(exact), f"outputs outside the grammar: {set(counts) - set(exact)}"
    keys = sorted(exact)
    return chi2_pvalue([counts[k] for k in keys], [exact[k] for k in keys])


@pytest.mark.parametrize("drafter, coupled", [  # the fast lane keeps the draft model, standard mode; 5-25 s each
    pytest.param(d, c, marks=() if (d, c) == ("draft-model", False) else pytest.mark.slow)
    for d in ("draft-model", "fixed-chain", "tree-dynamic", "renormalised", "unmasked") for c in (False, True)])
def test_sampled_speculative_distribution_equals_constrained_plain(dist_setup, drafter, coupled):
    grammar, target, draft, exact = dist_setup
    proposer = {"draft-model": lambda: DraftModelProposer(draft),
                "fixed-chain": _FixedChain,
                "tree-dynamic": lambda: TreeDraftProposer(draft, TreeDraftConfig(kind="dynamic", num_nodes=6, top_k=2)),
                "renormalised": lambda: _MaskedDraft(draft, "renormalised"),
                "unmasked": lambda: _MaskedDraft(draft, "unmasked")}[drafter]()
    counts = _sample_counts(grammar, target, proposer, coupled)
    assert _pvalue(counts, exact) > 1e-3, (counts, exact)


@pytest.mark.slow
def test_negative_control_an_unnormalised_draft_breaks_the_distribution(dist_setup, monkeypatch):
    """q masked but not renormalised: not the law the draft tokens were drawn from. The engine's door refuses it
    (the row fails, naming the proposer); let through, verification's min(1, p/q) and residual would read the
    wrong law, and the chi-square test must see it. The same drafter with q renormalised, or not masked at all,
    passes above."""
    import specdecode.drafts as drafts_module

    grammar, target, draft, exact = dist_setup
    engine = SpeculativeEngine(target, _MaskedDraft(draft, "unnormalised"), EngineConfig(num_speculative_tokens=3))
    req, _ = engine.add(DIST_PROMPT, SamplingParams(temperature=1.0, max_new_tokens=6, eos_token_ids=(0,), seed=1),
                        constraint=grammar.new_constraint())
    while req.finish_reason is None:
        engine.step()
    assert req.finish_reason == "error" and "masked-draft" in req.error and "sum to 1" in req.error
    monkeypatch.setattr(drafts_module, "_draft_probs_problem", lambda q, ids, vocab: None)  # the door's q check off
    counts = _sample_counts(grammar, target, _MaskedDraft(draft, "unnormalised"), coupled=False)
    assert _pvalue(counts, exact) < 1e-6, (counts, exact)


@pytest.mark.slow
def test_the_enumeration_matches_constrained_plain_sampling(dist_setup):
    """The reference itself: plain decoding (no proposer) samples the enumerated distribution."""
    grammar, target, _, exact = dist_setup
    counts = _sample_counts(grammar, target, None, coupled=False, n=1500)
    assert _pvalue(counts, exact) > 1e-3, (counts, exact)
    assert list(itertools.islice(sorted(exact, key=exact.get, reverse=True), 1))  # a non-trivial law


def test_a_json_error_names_what_and_where_once():
    """Python's message for a control character ends in "at": the location is not preceded by "at at"."""
    from specdecode.errors import json_problem

    try:
        json.loads('{"a": "x\ty"}')
    except json.JSONDecodeError as exc:
        text = json_problem(exc)
    assert text == "Invalid control character at line 1 column 9" and "at at" not in text
