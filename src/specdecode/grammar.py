"""Structured output (a JSON schema, any JSON object, a regular expression) under speculative decoding.

A grammar, compiled once by llguidance (https://github.com/guidance-ai/llguidance) against the
target's tokenizer, turns each context into a *mask*: the tokens that may come next. Constrained
plain decoding samples every token from ``p~ = norm(p * mask)``, the target's processed
distribution with the forbidden tokens set to -inf and the rest renormalised. Speculative decoding
keeps exactly that distribution:

1. **The mask at every draft position.** A request's :class:`GrammarConstraint` sits in its
   ``sampling.RequestSampler``. When the engine verifies a draft, the target's logits at verified
   position j are masked with the grammar's mask after *committed tokens + draft tokens 1..j-1*
   (``masks(paths)``; a chain's paths are prefixes of each other, a tree's are its root-to-node
   paths). That is the mask plain decoding would use if those draft tokens had been committed, so
   the target distribution at every position is plain decoding's p~.
2. **The same mask on the draft.** Model drafters compute q with the same ``RequestSampler`` along
   the same path (``ProposeContext.draft_dist``), so q~ is masked and renormalised exactly like p~:
   a drafter never proposes a forbidden token, and verification with target p~ and any proposal
   q~ returns samples of p~ (token-wise rejection sampling, Leviathan et al. 2023, theorem 1; block
   verification, Sun et al. 2024; the coupled mode's exact match): position by position the output
   follows constrained plain decoding, hence so does the whole sequence. Greedy requests take the
   argmax of the masked logits, plain decoding's constrained argmax.
3. **Deterministic drafts cut before verification.** Deterministic drafters (n-gram, suffix) know
   no grammar. ``valid_prefix`` reports how many leading draft tokens the masks allow, and the
   engine ends such a chain before the first forbidden one (``engine.cut_draft``). Its q is a
   point mass on the drafted token x; verification would reject x (p~(x) = 0) and sample from
   ``norm(max(0, p~ - q)) = p~``: what the shortened chain's next position does (the bonus). Put
   otherwise, the cut draft is still a deterministic function of the context, and any such draft
   is verified losslessly; the cut saves the wasted target positions. A sampling drafter's chain is
   never cut: a cut would depend on its draw, which is lossy for a q that gave a forbidden token
   mass (the residual is not p~ then). Such a q (a drafter that skipped the mask) is still verified
   exactly, only less efficiently; ``tests/test_grammar.py`` checks both, and that a q masked but
   not renormalised (not the law the token was drawn from) fails the distribution test. Token
   trees are not cut; the tree verifier rejects forbidden nodes (p~ = 0) like any other.

``valid_prefix`` is defined by the masks themselves (a token is valid where the mask at its path
allows it), so the cut happens exactly where p~ is zero. A path the grammar rejects gets an
all-True row from ``masks``: it follows a token verification rejects, and its row is never sampled
from. When the grammar is complete, only EOS is allowed (llguidance's end of grammar): generation
ends with EOS right after the JSON. After an EOS the constraint has nothing more to say (all
tokens allowed), which only matters with ``ignore_eos``. JSON is laid out on one line as ``json.dumps``
writes it (:data:`JSON_LAYOUT`).

Use::

    structured = StructuredOutput.from_response_format({"type": "json_schema", "json_schema": {"schema": s}})
    grammar = compile_grammar(tokenizer, engine.vocab_size, structured)
    engine.add(prompt_ids, params, constraint=grammar.new_constraint())
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import llguidance
import torch

from specdecode.errors import SpecDecodeError, json_problem

StructuredKind = Literal["json_schema", "json_object", "regex"]

#: The field an error names for each kind when the caller said nothing else.
_DEFAULT_FIELD = {"json_schema": "json_schema", "json_object": "response_format", "regex": "regex"}


def _error(message: str, field_name: str) -> SpecDecodeError:
    err = SpecDecodeError(message)
    err.field = field_name
    return err


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must be: JSON valid under a schema, any JSON object, or a regex match.

    Attributes:
        kind: "json_schema" (``spec``: the schema, a dict), "json_object" (``spec`` None) or "regex"
            (``spec``: the pattern, Rust ``regex`` syntax, matched against the whole output).
        spec: see ``kind``.
        field: the request field it came from, named by errors ("json_schema", "regex",
            "response_format"); empty = the kind's own name.

    Raises:
        SpecDecodeError: a spec of the wrong type for its kind, or a regular expression llguidance's syntax
            (Rust ``regex``) refuses: an unclosed group, a backreference, a lookaround (``field`` set).
    """

    kind: StructuredKind
    spec: str | dict | None = None
    field: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        where = self.error_field
        if self.kind not in _DEFAULT_FIELD:
            raise _error(f"unknown structured output kind {self.kind!r}; choose json_schema, json_object or regex",
                         where if self.field else "response_format")
        if self.kind == "json_schema" and not isinstance(self.spec, dict):
            raise _error(f"a JSON schema must be a JSON object, got {type(self.spec).__name__}", where)
        if self.kind == "json_schema":
            try:
                json.dumps(self.spec)
            except (TypeError, ValueError) as e:
                raise _error(f"the JSON schema holds a value JSON cannot represent ({e})", where) from None
        if self.kind == "regex" and (not isinstance(self.spec, str) or not self.spec):
            raise _error("a regular expression must be a non-empty string", where)
        if self.kind in ("regex", "json_schema"):  # llguidance's own check, at the door (no tokenizer, no model)
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(_grammar_of(self), None)
            if is_error:
                raise _error(f"invalid {_WHAT[self.kind]}: {_problem(self.kind, messages)}", where)
        if self.kind == "json_object" and self.spec is not None:
            raise _error("json_object takes no spec", where)

    def __hash__(self) -> int:
        return hash(self.key)

    @property
    def error_field(self) -> str:
        return self.field or _DEFAULT_FIELD.get(self.kind, "response_format")

    @property
    def key(self) -> str:
        """kind + the spec's JSON text (the compiled-grammar cache key). Keys keep their order: the order of a
        schema's properties is the order the output writes them in."""
        return f"{self.kind}:{json.dumps(self.spec)}"

    # Constructors ------------------------------------------------------------------------------

    @classmethod
    def json_schema(cls, schema: dict | str, field_name: str = "json_schema") -> "StructuredOutput":
        """From a schema (a dict, or its JSON text: the contents of ``--json-schema FILE``).

        Raises:
            SpecDecodeError: text that is not JSON, or JSON that is not an object.
        """
        if isinstance(schema, (str, bytes)):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise _error(f"the JSON schema is not valid JSON ({json_problem(e)})",
                             field_name) from None
        return cls("json_schema", schema, field_name)

    @classmethod
    def regex(cls, pattern: str, field_name: str = "regex") -> "StructuredOutput":
        """From a regular expression the whole output must match (Rust ``regex`` syntax, checked here).

        Raises:
            SpecDecodeError: an empty pattern or one llguidance refuses, saying what is wrong.
        """
        return cls("regex", pattern, field_name)

    @classmethod
    def choice(cls, choices: Sequence[str], field_name: str = "choice") -> "StructuredOutput":
        """Exactly one of ``choices`` (vLLM's ``guided_choice``): the regex of the escaped alternatives.

        Raises:
            SpecDecodeError: no choices, or one that is not a string.
        """
        if isinstance(choices, str) or not choices or not all(isinstance(c, str) for c in choices):
            raise _error("the choices must be a non-empty list of strings", field_name)
        return cls.regex("(" + "|".join(escape_regex(c) for c in choices) + ")", field_name)

    @classmethod
    def json_object(cls, field_name: str = "response_format") -> "StructuredOutput":
        """Any JSON object (OpenAI's ``{"type": "json_object"}``)."""
        return cls("json_object", None, field_name)

    @classmethod
    def from_response_format(cls, response_format: dict | None) -> "StructuredOutput | None":
        """From OpenAI's ``response_format``: ``{"type": "text"}`` (None: no constraint),
        ``{"type": "json_object"}``, or ``{"type": "json_schema", "json_schema": {"name": ..., "schema":
        {...}, "strict": ...}}``. Unknown keys (``description``) are ignored.

        Raises:
            SpecDecodeError: (``field = "response_format"``) anything else, saying what is wrong.
        """
        f = "response_format"
        if response_format is None:
            return None
        if not isinstance(response_format, dict):
            raise _error(f"response_format must be an object like {{\"type\": \"json_schema\", ...}}, got "
                         f"{type(response_format).__name__}", f)
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.json_object(f)
        if kind != "json_schema":
            raise _error(f"response_format.type must be \"text\", \"json_object\" or \"json_schema\", got {kind!r}", f)
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise _error("response_format.json_schema must be an object {\"name\": ..., \"schema\": {...}}, got "
                         f"{'nothing' if spec is None else type(spec).__name__}", f)
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise _error(f"response_format.json_schema.name must be a string, got {type(name).__name__}", f)
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _error(f"response_format.json_schema.strict must be true or false, got {strict!r}", f)
        if "schema" not in spec:
            raise _error("response_format.json_schema.schema is missing: give the JSON schema the output must follow "
                         "(or use {\"type\": \"json_object\"} for any JSON object)", f)
        schema = spec["schema"]
        if not isinstance(schema, dict):
            raise _error(f"response_format.json_schema.schema must be a JSON object, got {type(schema).__name__}", f)
        return cls("json_schema", schema, f)


#: The characters llguidance's regex syntax (Rust's ``regex``) reads as syntax (``regex_syntax::is_meta_character``).
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


def escape_regex(text: str) -> str:
    """A regex that matches exactly ``text``: its syntax characters backslash-escaped, the rest literal
    (Rust ``regex_syntax::escape``'s rule)."""
    return "".join("\\" + ch if ch in _REGEX_META else ch for ch in text)


def structured_output(json_schema: dict | str | None = None, regex: str | None = None,
                      response_format: dict | None = None) -> StructuredOutput | None:
    """The one structured output of a front end's three ways to ask (at most one may be given).

    Raises:
        SpecDecodeError: more than one given (``field``: the second), or a malformed one.
    """
    given = [name for name, v in (("json_schema", json_schema), ("regex", regex),
                                  ("response_format", response_format)) if v is not None]
    if len(given) > 1:
        raise _error(f"give at most one of json_schema, regex and response_format (got {' and '.join(given)})",
                     given[1])
    if json_schema is not None:
        return StructuredOutput.json_schema(json_schema)
    if regex is not None:
        return StructuredOutput.regex(regex)
    return StructuredOutput.from_response_format(response_format)


# --------------------------------------------------------------------------- compilation


#: How JSON is laid out: on one line as ``json.dumps`` writes it (", " and ": ", no other whitespace). Free
#: whitespace lets a model (a small one above all) loop on spaces and newlines until max_new_tokens; a
#: schema's own ``"x-guidance"`` options (llguidance's) override this.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_lock = threading.Lock()
#: id(tokenizer) -> (weak reference to it, {(eos ids): LLTokenizer}); building one takes ~0.3 s (SmolLM2) .. 1 s.
_TOKENIZERS: dict[int, tuple[Any, dict[tuple[int, ...] | None, Any]]] = {}
#: (id(LLTokenizer), vocab_size, structured.key) -> CompiledGrammar, least recently used last out.
_GRAMMARS: OrderedDict[tuple, "CompiledGrammar"] = OrderedDict()
MAX_CACHED_GRAMMARS = 128


def ll_tokenizer(tokenizer, eos_token_ids: Sequence[int] | None = None):
    """The llguidance tokenizer of a Hugging Face fast tokenizer (cached per tokenizer object and EOS set).

    Args:
        tokenizer: a ``transformers`` fast tokenizer, or an ``llguidance.LLTokenizer`` (returned as it is).
        eos_token_ids: the tokens that end generation (the grammar allows them, and only them, once it is
            complete); None = the tokenizer's EOS.

    Raises:
        SpecDecodeError: a tokenizer llguidance cannot read (a slow, Python-only tokenizer).
    """
    if isinstance(tokenizer, llguidance.LLTokenizer):
        return tokenizer
    eos = tuple(int(t) for t in eos_token_ids) if eos_token_ids else None
    with _lock:
        entry = _TOKENIZERS.get(id(tokenizer))
        if entry is None or entry[0]() is not tokenizer:
            try:
                ref = weakref.ref(tokenizer)
            except TypeError:
                ref = lambda t=tokenizer: t  # noqa: E731 - no weak references: keep it
            entry = _TOKENIZERS[id(tokenizer)] = (ref, {})
            for key in [k for k, (r, _) in _TOKENIZERS.items() if r() is None]:
                del _TOKENIZERS[key]
        built = entry[1].get(eos)
        if built is None:
            from llguidance.hf import from_tokenizer  # imports transformers: only when a grammar is compiled

            try:
                built = from_tokenizer(tokenizer, eos_token=list(eos) if eos else None)
            except (ValueError, TypeError) as e:
                raise _error(f"structured output needs a fast (Rust) Hugging Face tokenizer that llguidance can "
                             f"read; this one cannot be used ({e})", "response_format") from None
            entry[1][eos] = built
        return built


def compile_grammar(tokenizer, vocab_size: int, structured: StructuredOutput,
                    eos_token_ids: Sequence[int] | None = None) -> "CompiledGrammar":
    """Compile a structured output for a target (cached by tokenizer, vocabulary and spec).

    Args:
        tokenizer: the target's Hugging Face fast tokenizer (or an ``llguidance.LLTokenizer``).
        vocab_size: V, the width of the target's logits (may exceed the tokenizer's vocabulary; the
            extra ids are never allowed).
        structured: what the output must be.
        eos_token_ids: the request's EOS ids (``LoadedModel.eos_token_ids``); None = the tokenizer's.

    Returns:
        a CompiledGrammar; ``new_constraint()`` gives each request its own matcher.

    Raises:
        SpecDecodeError: an invalid schema or regex (``field``: ``structured.error_field``), saying what
            is wrong; a tokenizer llguidance cannot read.
    """
    ll_tok = ll_tokenizer(tokenizer, eos_token_ids)
    key = (id(ll_tok), int(vocab_size), structured.key)
    with _lock:
        hit = _GRAMMARS.get(key)
        if hit is not None and hit.ll_tokenizer is ll_tok:
            _GRAMMARS.move_to_end(key)
            return hit
    where = structured.error_field
    grammar = _grammar_of(structured)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, ll_tok)
    if is_error:
        raise _error(f"invalid {_WHAT[structured.kind]}: {_problem(structured.kind, messages)}", where)
    matcher = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
    if matcher.is_error():
        raise _error(f"invalid {_WHAT[structured.kind]}: {_first_line([matcher.get_error()])}", where)
    compiled = CompiledGrammar(structured, int(vocab_size), ll_tok, matcher, tuple(messages))
    with _lock:
        _GRAMMARS[key] = compiled
        while len(_GRAMMARS) > MAX_CACHED_GRAMMARS:
            _GRAMMARS.popitem(last=False)
    return compiled


_WHAT = {"json_schema": "JSON schema", "json_object": "JSON object grammar", "regex": "regular expression"}


def _grammar_of(structured: StructuredOutput) -> str:
    """llguidance's grammar for a structured output (no tokenizer needed).

    Raises:
        SpecDecodeError: llguidance refuses the spec outright (``field``: ``structured.error_field``).
    """
    try:
        if structured.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(structured.spec)
        schema = structured.spec if structured.kind == "json_schema" else {"type": "object"}
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_LAYOUT)
    except (ValueError, TypeError) as e:
        raise _error(f"invalid {_WHAT[structured.kind]}: {_problem(structured.kind, [str(e)])}",
                     structured.error_field) from None


def _problem(kind: str, messages: Sequence[str]) -> str:
    return _regex_problem(messages) if kind == "regex" else _first_line(messages)


def _regex_problem(messages: Sequence[str]) -> str:
    """What llguidance says is wrong with a regular expression, without its grammar-internal position, the
    pattern repeated and the caret lines: "unclosed group", "backreferences are not supported", ..."""
    text = " ".join(m for m in messages if m)
    errors = [line.strip()[len("error:"):].strip() for line in text.splitlines() if line.strip().startswith("error:")]
    if errors:
        return errors[-1]
    text = text.split("\n   1 |")[0]
    text = re.sub(r'^at \d+\(\d+\): invalid regex ".*?" \(in regex\): ', "", text.strip(), flags=re.S)
    return " ".join(text.split()) or "rejected by the grammar compiler"


def _first_line(messages: Sequence[str]) -> str:
    text = " ".join(m for m in messages if m).strip()
    text = text.split("\n   1 |")[0]  # llguidance appends the lark source; the message says enough
    return " ".join(text.split()) or "rejected by the grammar compiler"


@dataclass(eq=False)
class CompiledGrammar:
    """A grammar compiled for one tokenizer and vocabulary width; shared by every request that uses it.

    Attributes:
        structured: what it constrains to. vocab_size: V of the masks.
        ll_tokenizer: the llguidance tokenizer. warnings: the compiler's warnings (unsupported keywords).
    """

    structured: StructuredOutput
    vocab_size: int
    ll_tokenizer: Any
    _prototype: Any = field(repr=False)
    warnings: tuple[str, ...] = ()

    def new_constraint(self) -> "GrammarConstraint":
        """A fresh per-request constraint (its own matcher at the start of the grammar)."""
        return GrammarConstraint(self._prototype.deep_copy(), self.vocab_size, self.ll_tokenizer.vocab_size,
                                 frozenset(self.ll_tokenizer.eos_tokens))


# --------------------------------------------------------------------------- the per-request constraint

_BITS = torch.arange(32, dtype=torch.int32)


class GrammarConstraint:
    """One request's grammar state: the protocol ``sampling.RequestSampler`` uses.

    The matcher stands at *committed tokens + ``_at``* (tokens consumed for draft paths, never an
    EOS); a path is reached by rolling back to the common prefix and consuming the rest. Masks are
    cached per path until the next commit: the drafter's q, the engine's cut and the target's p
    along one draft all ask for the same paths.

    Args:
        matcher: an ``llguidance.LLMatcher`` at the start of the grammar.
        vocab_size: V of the returned masks. num_tokens: the tokenizer's vocabulary (<= or > V).
        eos: the EOS ids the grammar ends with.

    Attributes:
        ended: an EOS was committed (or a commit broke the grammar, see ``error``): nothing is
            constrained any more.
        error: why the grammar stopped constraining before its end (a committed token it forbids:
            only when other settings forbade every token the grammar allowed), else None.
    """

    def __init__(self, matcher, vocab_size: int, num_tokens: int, eos: frozenset[int]) -> None:
        self._m = matcher
        self.vocab_size = vocab_size
        self._n = num_tokens
        self._words = (num_tokens + 31) // 32
        self._eos = eos
        self._at: list[int] = []
        self._rows: dict[tuple[int, ...], torch.Tensor] = {}
        self.ended = False
        self.error: str | None = None

    # The protocol ---------------------------------------------------------------------------

    def masks(self, paths: Sequence[Sequence[int]]) -> torch.Tensor:
        """[N, V] bool: the tokens the grammar allows after committed tokens + each path. A path the
        grammar rejects (or that passed an EOS) gets an all-True row."""
        out = torch.ones(len(paths), self.vocab_size, dtype=torch.bool)
        if self.ended:
            return out
        rows, packed = [], []
        for j, path in enumerate(paths):
            path = tuple(int(t) for t in path)
            n, ended = self._walk(path)
            if n == len(path) and not ended:
                rows.append(j)
                packed.append(self._rows[path])
        if rows:
            bits = ((torch.stack(packed).unsqueeze(-1) >> _BITS) & 1).bool().reshape(len(rows), -1)
            w = min(self._n, self.vocab_size)
            block = torch.zeros(len(rows), self.vocab_size, dtype=torch.bool)
            block[:, :w] = bits[:, :w]
            out[rows] = block
        return out

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the grammar allows, each after the ones before it (all of them
        after an allowed EOS: the grammar is over)."""
        if self.ended:
            return len(tokens)
        return self._walk(tuple(int(t) for t in tokens))[0]

    def commit(self, tokens: Sequence[int]) -> None:
        """Advance over committed tokens (allowed ones: the engine samples from masked distributions)."""
        toks = tuple(int(t) for t in tokens)
        if self.ended or not toks:
            return
        n, ended = self._walk(toks, last_mask=False)
        if n == len(toks) and not ended and not self._goto(toks):
            n = len(toks) - 1
        if n < len(toks):
            self.error = (f"committed token {toks[n]} is not allowed by the grammar (other sampling settings "
                          f"forbade every token it allows); the rest of the output is unconstrained")
            self.ended = True
        elif ended:
            self.ended = True
        else:
            self._at = []  # the matcher's committed state now includes them
            if toks in self._rows:  # the mask after them is the next step's first one
                self._rows = {(): self._rows[toks]}
                return
        self._rows.clear()

    # Internals ------------------------------------------------------------------------------

    def _walk(self, path: tuple[int, ...], last_mask: bool = True) -> tuple[int, bool]:
        """(how many leading tokens of ``path`` the masks allow, whether one of them is an EOS that ends
        the grammar; tokens after it count as allowed). Computes and caches the masks on the way (the
        one after the whole path too, unless ``last_mask`` is False)."""
        for i, tok in enumerate(path):
            row = self._row(path[:i])
            if row is None or not (0 <= tok < self._n) or not (int(row[tok >> 5]) >> (tok & 31)) & 1:
                return i, False
            if tok in self._eos:
                return len(path), True
        if (last_mask or not path) and self._row(path) is None:
            return max(0, len(path) - 1), False
        return len(path), False

    def _row(self, path: tuple[int, ...]) -> torch.Tensor | None:
        """[W] int32 packed mask after committed + ``path`` (its tokens already checked), None if the
        matcher cannot get there."""
        row = self._rows.get(path)
        if row is None:
            if not self._goto(path):
                return None
            row = torch.empty(self._words, dtype=torch.int32)
            self._m.unsafe_compute_mask_ptr(row.data_ptr(), self._words * 4)
            self._rows[path] = row
        return row

    def _goto(self, path: tuple[int, ...]) -> bool:
        """Move the matcher to committed + ``path`` (EOS-free); False if it refuses a token."""
        at = self._at
        lcp = 0
        for a, b in zip(at, path):
            if a != b:
                break
            lcp += 1
        if lcp < len(at):
            self._m.rollback(len(at) - lcp)
            del at[lcp:]
        rest = list(path[lcp:])
        if rest:
            done = self._m.try_consume_tokens(rest)
            at.extend(rest[:done])
            if done < len(rest):
                return False
        return True
