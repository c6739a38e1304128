"""Text in, text out: the library's front door (tokenize, generate, detokenize, stop strings).

The engine works on token ids only (DESIGN.md: text lives at the edges). This
module wraps it for callers that have text:

- :meth:`SpecDecoder.encode` turns a prompt into ids (optionally through the
  tokenizer's chat template);
- :meth:`SpecDecoder.generate` runs the engine, decodes as tokens are
  committed, streams the new text, and stops at stop strings;
- :meth:`SpecDecoder.plain` is the baseline: the same target, cache and sampling
  code with no proposer, so speed comparisons compare like with like.

Quick start::

    from specdecode.generator import SpecDecoder

    dec = SpecDecoder.from_pretrained("smollm2-135m", draft="ngram")
    out = dec.generate("Summarize: ...", chat=True, max_new_tokens=64)
    print(out.text, out.metrics.acceptance_rate)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import functools
import operator
import sys

import torch

from specdecode.build import assemble, build_factory, load_draft_for
from specdecode.engine import EngineConfig
from specdecode.grammar import compile_grammar, structured_output
from specdecode.kernels import WEIGHT_PRECISIONS
from specdecode.metrics import RunMetrics
from specdecode.models import LoadedModel
from specdecode.options import DEFAULT_GAMMA, DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN, DEFAULT_TREE_NODES
from specdecode.policy import build_policy
from specdecode.precision import PrecisionChoice, load_target
from specdecode.preflight import check_models
from specdecode.spec import DrafterSpec
from specdecode.types import EmptyPromptError, SamplingParams, SpecDecodeError
from specdecode.validate import check_stops, check_threads
from specdecode.kv import make_runner


@dataclass
class TextOutput:
    """The result of one text generation (batch size 1).

    Attributes:
        text: the generated text, cut before the first stop string;
            ``decoder.decode(token_ids) == text`` always.
        token_ids: generated token ids (prompt excluded); after a stop string, the
            longest prefix of the generated ids whose text is a prefix of the text
            before the stop string.
        finish_reason: "length" (max_new_tokens), "stop" (EOS or a stop string).
        metrics: RunMetrics of the run, every counter up to the last returned token (a stop string ends
            them where it ends the ids): ``num_generated_tokens == len(token_ids)``, drafted / accepted /
            forwards / tau / per-position acceptance count only the steps and draft tokens that led to them.
        prompt_token_ids: the prompt as the engine saw it.
        stop_string: the stop string that ended generation, None otherwise.
    """

    text: str
    token_ids: list[int]
    finish_reason: str
    metrics: RunMetrics
    prompt_token_ids: list[int] = field(default_factory=list)
    stop_string: str | None = None


class SpecDecoder:
    """A target model, an optional proposer, and the text plumbing around the engine.

    Args:
        target: the LoadedModel whose output distribution is preserved.
        proposer: a :class:`~specdecode.proposers.base.Proposer`, or None for plain decoding.
        num_speculative_tokens: gamma, draft tokens per step (1..64).
        draft: the draft LoadedModel behind ``proposer`` when it is a draft model (kept for
            reference and reuse; the proposer holds its own cache).
        policy: draft-length policy: a name for :func:`specdecode.policy.build_policy` ("auto", the
            default: cost-model for n-gram drafts, fixed otherwise; "fixed", "heuristic", "confidence",
            "cost-model") or a policy object.
        verification: how sampled draft chains are verified (``EngineConfig.verification``): "token"
            (token-wise rejection sampling), "block" (block verification, Sun et al. 2024: accepts at
            least as many tokens), "auto" (the engine's choice). Either keeps the target's distribution.

    Raises:
        SpecDecodeError: gamma out of range, an unknown verification.
    """

    def __init__(
        self,
        target: LoadedModel,
        proposer=None,
        *,
        num_speculative_tokens: int = DEFAULT_GAMMA,
        draft: LoadedModel | None = None,
        policy="auto",
        verification: str = "auto",
    ) -> None:
        self.target = target
        self.proposer = proposer
        self.draft = draft
        #: What ``from_pretrained`` ran the target's weights in, and why (None when built from modules).
        self.precision: PrecisionChoice | None = None
        #: The drafter ``from_pretrained`` built (None when built from modules).
        self.spec: DrafterSpec | None = None
        self.num_speculative_tokens = num_speculative_tokens
        self.verification = verification
        self.policy = (build_policy(policy, num_speculative_tokens, proposer=proposer) if isinstance(policy, str)
                       else policy)
        self.engine = assemble(target, proposer, num_speculative_tokens=num_speculative_tokens, policy=self.policy,
                               verification=verification)

    @classmethod
    def from_pretrained(
        cls,
        target: str,
        draft: str | DrafterSpec | None = "ngram",
        *,
        num_speculative_tokens: int = DEFAULT_GAMMA,
        ngram_min: int = DEFAULT_NGRAM_MIN,
        ngram_max: int = DEFAULT_NGRAM_MAX,
        dtype: torch.dtype | str = torch.float32,
        cache_dir=None,
        progress: bool = True,
        weights: str = "auto",
        draft_weights: str | None = None,
        policy: str = "auto",
        skip_layers: str | Sequence[int] | None = None,
        tree: str | None = None,
        tree_nodes: int = DEFAULT_TREE_NODES,
        verification: str = "auto",
        status=None,
        threads: int | str | None = None,
    ) -> "SpecDecoder":
        """Load a target (and a draft model) by spec and build the decoder.

        Args:
            target: a model spec for :func:`specdecode.models.load_model` (offline name,
                local directory, GGUF file, hub id).
            draft: the drafter: a :class:`~specdecode.spec.DrafterSpec`, or what ``--draft`` takes (None or
                "none" = plain decoding; "ngram" = prompt lookup (``ngram_min``..``ngram_max`` token matches);
                a compact spec such as ``"ngram:k=4,max_ngram=4"``; anything else = a draft model spec, loaded
                like the target and checked for a shared tokenizer). A spec's own γ and options win over the
                keyword arguments below; a DrafterSpec is taken as it is.
            num_speculative_tokens: gamma (1..64).
            dtype, cache_dir, progress: passed to ``load_model``.
            weights: precision the target's weights execute in: "auto" (default: the fastest that keeps
                the model and keeps speculation exact on this machine, measured once and cached, see
                :func:`specdecode.precision.choose_precision`; ``decoder.precision`` says what and why),
                "fp32", "bf16", "int8" or "int4" (plain decoding uses the same target, so losslessness is with
                respect to it; see ``lowbit.set_weight_precision``).
            draft_weights: the draft model's precision ("fp32", "bf16", "int8", "int4", see
                :func:`specdecode.lowbit.set_weight_precision`); None = the target's.
            status: called with one line before each slow measurement of ``weights="auto"``.
            policy: the draft-length policy's name (see :func:`specdecode.policy.build_policy`).
            skip_layers: with ``draft="layer-skip"`` (self-speculation, the target with some
                decoder layers skipped): layer indices ("3,5,7" or a list); None = the set
                cached for this model, or a search on the first prompt (``specdecode.layer_search``).
            tree: with a draft model, "static" (top-k branching per depth) or "dynamic" (EAGLE-2)
                token trees instead of chains; None / "none" = chains.
            tree_nodes: node budget N of a tree (1..64); also the node budget of ``draft="suffix"``
                (suffix decoding, model-free token trees; ``"suffix:ngram"`` / ``"suffix:MODEL"``
                fall back to that drafter when the suffix match scores low).
            verification: "auto", "token" or "block": how sampled drafts are verified (see the class).
            threads: torch threads for this process (``torch.set_num_threads``: process-wide): a count (1..the cores
                this process may use), "auto" (one per core other processes leave idle, what the command line does:
                on a shared machine a thread on a busy core stalls every parallel region of a step, 2-3x slower
                measured; the reason goes to stderr with ``progress``), or None (default: torch's setting as it is).

        Raises:
            ModelLoadError, IncompatibleTokenizerError, SpecDecodeError (bad gamma,
            n-gram sizes or threads; checked before any model is loaded).
        """
        if isinstance(draft, DrafterSpec):
            spec = draft
        else:
            spec = DrafterSpec.from_settings({
                "draft": draft, "num_speculative_tokens": num_speculative_tokens, "ngram_min": ngram_min,
                "ngram_max": ngram_max, "tree": tree, "tree_nodes": tree_nodes,
                "skip_layers": skip_layers if skip_layers is None or isinstance(skip_layers, str)
                else ",".join(map(str, skip_layers))})
        spec.check()
        num_speculative_tokens = spec.num_speculative_tokens or num_speculative_tokens
        EngineConfig(num_speculative_tokens=num_speculative_tokens, verification=verification)  # fail fast
        build_policy(policy, num_speculative_tokens)
        for precision in (weights, draft_weights or weights):
            if precision != "auto" and precision not in WEIGHT_PRECISIONS:
                raise SpecDecodeError(f"unknown weight precision {precision!r}; choose auto or one of "
                                      f"{', '.join(WEIGHT_PRECISIONS)}")
        say = (lambda line: print(f"specdecode: {line}", file=sys.stderr, flush=True)) if progress else None
        if isinstance(threads, str) and threads != "auto":
            raise SpecDecodeError(f"threads={threads!r}: give a count of torch threads, 'auto' or None")
        check_threads(None if threads == "auto" else threads, "threads", auto="threads='auto'")
        check_models(target, spec.model_spec, cache_dir=cache_dir, cross_vocab=True, tree=spec.tree,  # before weights
                     say=say)
        if threads is not None:  # applied once the models are known to load (process-wide), before the measurements
            from specdecode.threads import set_threads  # lazy: /proc reads

            set_threads(None if threads == "auto" else threads, say=say, flag="threads=")
        loaded, precision_choice = load_target(target, weights, dtype=dtype, cache_dir=cache_dir, progress=progress,
                                               status=status)
        weights = precision_choice.precision
        draft_weights = weights if draft_weights in (None, "auto") else draft_weights
        draft_model = load_draft_for(spec, loaded, target, weights=weights, draft_weights=draft_weights,
                                     dtype=dtype, cache_dir=cache_dir, progress=progress)
        factory = build_factory(spec, loaded, draft_model, cache_dir=cache_dir)
        if factory is None:  # plain decoding: no draft length to choose
            decoder = cls(loaded, None, num_speculative_tokens=num_speculative_tokens, verification=verification)
        else:
            decoder = cls(loaded, factory(), num_speculative_tokens=num_speculative_tokens, draft=draft_model,
                          policy=policy, verification=verification)
        decoder.spec = spec
        decoder.precision = precision_choice
        return decoder

    @torch.inference_mode()
    def explain_difference(self, prompt_ids: Sequence[int], token_ids: Sequence[int],
                           baseline_ids: Sequence[int]) -> str | None:
        """One line on where two outputs of the same target part (None when equal): the position, the two
        tokens and the target's logit margin between them there (scored by the decoding forward on the
        prompt + the common prefix). A margin near 0 is a near-tie, where a forward that is not
        batch-invariant can round either way."""
        i = next((j for j, (a, b) in enumerate(zip(token_ids, baseline_ids)) if a != b), None)
        if i is None:
            if len(token_ids) == len(baseline_ids):
                return None
            i = min(len(token_ids), len(baseline_ids))
            return f"one output stops at token {i}, the other goes on (an EOS or a stop string at a near-tie)"

        row = make_runner(self.target.model).row(0)
        context = [*prompt_ids, *baseline_ids[:i]]
        if len(context) > 1:
            row.forward(context[:-1], last_only=True)
        logits = row.forward(context[-1:])[0].float()
        row.reset()
        plain_tok, spec_tok = int(baseline_ids[i]), int(token_ids[i])
        margin = float(logits[plain_tok] - logits[spec_tok])
        kind = "a near-tie" if abs(margin) < 0.05 else "not a near-tie: a bug, please report it"
        text = self.tokenizer.convert_ids_to_tokens([plain_tok, spec_tok])
        return (f"first difference at generated token {i}: plain decoding chose {text[0]!r} ({plain_tok}), "
                f"speculative {text[1]!r} ({spec_tok}); their logits differ by {margin:.4f} ({kind})")

    def plain(self) -> "SpecDecoder":
        """The baseline: same target and engine code, no proposer (one token per target forward)."""
        plain = SpecDecoder(self.target, None, num_speculative_tokens=self.num_speculative_tokens,
                            verification=self.verification)
        plain.precision = self.precision
        return plain

    # Text <-> ids ----------------------------------------------------------------

    @property
    def tokenizer(self):
        return self.target.tokenizer

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, prompt: str, *, chat: bool = False) -> list[int]:
        """Prompt text -> token ids.

        Args:
            prompt: the text (with ``chat``, one user message).
            chat: apply the tokenizer's chat template with a generation prompt.
                Otherwise the tokenizer adds special tokens (e.g. BOS) as it is configured to.

        Returns:
            [L] token ids, L >= 1 (an empty text becomes [BOS]).

        Raises:
            EmptyPromptError: the text encodes to nothing and the tokenizer has no BOS.
            SpecDecodeError: ``chat`` with a tokenizer that has no chat template.
        """
        if chat:
            return self.encode_chat([{"role": "user", "content": prompt}])
        ids = list(self.tokenizer(prompt)["input_ids"])
        return ids or self._bos_only()

    def encode_chat(self, messages: Sequence[dict]) -> list[int]:
        """Chat messages (``[{"role": ..., "content": ...}, ...]``) -> ids, with a generation prompt.

        Raises:
            SpecDecodeError: the tokenizer has no chat template.
        """
        if not self.has_chat_template:
            raise SpecDecodeError(
                f"the tokenizer of {self.target.name!r} has no chat template; send plain text (no --chat)"
            )
        text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])  # the template places BOS
        return ids or self._bos_only()

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Ids -> text, special tokens (EOS, chat markers) left out unless ``skip_special_tokens`` is False.
        ``generate`` uses exactly this (with the default)."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    @functools.cached_property
    def decode_is_concatenative(self) -> bool:
        """Whether :meth:`decode` joins the tokens' texts (:func:`concatenative_decoder`): text trackers then
        decode only the new ids each step."""
        return concatenative_decoder(self.tokenizer)

    def _bos_only(self) -> list[int]:
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if bos is None:
            raise EmptyPromptError(
                f"the prompt is empty and the tokenizer of {self.target.name!r} has no BOS token to start from; "
                "give a non-empty prompt"
            )
        return [int(bos)]

    # Generation ------------------------------------------------------------------

    def compile_structured(self, *, json_schema: dict | str | None = None, regex: str | None = None,
                           response_format: dict | None = None):
        """The compiled grammar of a structured output for this target (``grammar.CompiledGrammar``), None when
        none is asked for. Compiled once per spec (``grammar.compile_grammar`` caches by tokenizer and spec).

        Raises:
            SpecDecodeError: more than one given, a malformed response_format, an invalid schema or regex
                (``field``: json_schema / regex / response_format).
        """
        structured = structured_output(json_schema=json_schema, regex=regex, response_format=response_format)
        if structured is None:
            return None
        return compile_grammar(self.tokenizer, self.engine.vocab_size, structured, self.target.eos_token_ids)

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        chat: bool = False,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
        ignore_eos: bool = False,
        on_text: Callable[[str], None] | None = None,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: Mapping[int, float] | None = None,
        allowed_token_ids: Sequence[int] | None = None,
        banned_token_ids: Sequence[int] = (),
        min_tokens: int = 0,
        stop_token_ids: Sequence[int] = (),
        coupled: bool | None = None,
        json_schema: dict | str | None = None,
        regex: str | None = None,
        response_format: dict | None = None,
    ) -> TextOutput:
        """Generate text for one prompt with lossless speculative decoding.

        Every sampling setting is applied identically to the target's and the drafter's distributions, so
        the output follows the target's distribution under it (greedy: the same tokens as plain decoding).

        Args:
            prompt: text (encoded with :meth:`encode`) or token ids (used as they are; ``chat`` ignored).
            chat: apply the chat template to a text prompt.
            max_new_tokens, temperature, top_k, top_p, seed, ignore_eos: see SamplingParams.
            min_p, repetition_penalty, presence_penalty, frequency_penalty, logit_bias (token id -> bias in
                [-100, 100]), allowed_token_ids, banned_token_ids, min_tokens, stop_token_ids: see
                :class:`~specdecode.types.SamplingParams`.
            coupled: the sampling mode: None (auto: coupled when ``seed`` is given), True (every random draw
                keyed by (seed, position, purpose), so a seeded speculative run reproduces seeded plain
                decoding token for token), False (standard rejection sampling).
            stop: strings that end generation; the returned text stops before the first one found.
            json_schema, regex, response_format: structured output (at most one): the text must be JSON valid
                under the schema (a dict or its JSON text), match the regex (whole), or follow OpenAI's
                ``response_format`` (``{"type": "json_object"}`` / ``{"type": "json_schema", ...}``). The grammar
                masks the target and the drafts alike, so the output is constrained plain decoding's (see
                :mod:`specdecode.grammar`); it ends with EOS right after the JSON.
            on_text: called with each new piece of text as tokens are committed. Text is held back
                while it could be the start of a stop string or ends in an incomplete UTF-8
                character; the pieces concatenate to ``TextOutput.text``.

        Returns:
            TextOutput.

        Raises:
            InvalidSamplingParams, EmptyPromptError, PromptTooLongError, SpecDecodeError; whatever ``on_text``
            raises (KeyboardInterrupt included), after the request left the engine: the decoder is ready for
            the next call.
        """
        stops = check_stops(stop)
        params = SamplingParams(
            temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed,
            eos_token_ids=self.target.eos_token_ids, ignore_eos=ignore_eos, min_p=min_p,
            repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, logit_bias=logit_bias,
            allowed_token_ids=None if allowed_token_ids is None else tuple(allowed_token_ids),
            banned_token_ids=tuple(banned_token_ids), min_tokens=min_tokens, stop_token_ids=tuple(stop_token_ids),
            coupled=coupled,
        )
        if isinstance(prompt, (bytes, bytearray)) or not (
                isinstance(prompt, (str, Sequence)) or hasattr(prompt, "tolist")):
            raise SpecDecodeError(f"prompt must be text or a sequence of token ids, got {type(prompt).__name__}")
        if isinstance(prompt, str):
            prompt_ids = self.encode(prompt, chat=chat)
        else:
            ids = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)
            try:
                if any(isinstance(t, bool) for t in ids):
                    raise TypeError("a bool is no token id")
                prompt_ids = [operator.index(t) for t in ids]  # ints (numpy's too), never a float or a string
            except TypeError:
                raise SpecDecodeError("prompt token ids must be integers") from None
        grammar = self.compile_structured(json_schema=json_schema, regex=regex, response_format=response_format)
        tracker = TextTracker(self.decode, stops, concatenative=self.decode_is_concatenative)
        # The engine's loop, as every front end runs it, stoppable at a stop string; its row is freed however
        # this block is left (a callback raising, Ctrl-C: ``SpeculativeEngine.running``).
        with self.engine.running(prompt_ids, params,
                                 constraint=None if grammar is None else grammar.new_constraint()) as (state, first):
            committed = first.token_ids
            while True:
                piece = tracker.add(committed)
                if piece and on_text is not None:
                    on_text(piece)
                if tracker.stop_string is not None or state.finish_reason is not None:
                    break
                committed = next((out.token_ids for r, out in self.engine.step() if r is state), [])
            # the request ends where its delivered tokens do: its ids and every counter stop there
            self.engine.abort(state, "stop", keep=len(tracker.ids))
        result = self.engine.output(state)
        piece = tracker.finish()
        if piece and on_text is not None:
            on_text(piece)
        metrics = result.metrics
        return TextOutput(
            text=tracker.text,
            token_ids=list(tracker.ids),
            finish_reason="stop" if tracker.stop_string is not None else result.finish_reason,
            metrics=metrics,
            prompt_token_ids=list(result.prompt_token_ids),
            stop_string=tracker.stop_string,
        )


_CONCATENATIVE_DECODERS = ("ByteLevel", "Fuse")  # tokens' bytes (or strings) joined; nothing crosses a token
_CONCATENATIVE_SAMPLE = "Héllo wörld,  東京 🙂\n\tdef f(x):\n    return x ** 2  # ✓ naïve 𝔘\r\n"


def concatenative_decoder(tokenizer) -> bool:
    """Whether ``tokenizer.decode`` (as :meth:`SpecDecoder.decode` calls it) joins the tokens' texts: ``decode(a +
    b) == decode(a) + decode(b)`` whenever ``decode(a)`` does not end in U+FFFD (an incomplete UTF-8 character).

    True for a Hugging Face fast tokenizer whose decoder is byte-level BPE's ``ByteLevel`` (each token's bytes,
    joined, then UTF-8: self-synchronising after a whole character) or ``Fuse``, and that passes a check on a
    sample of mixed scripts, emoji and special tokens split at every token boundary (a subclass that rewrites
    decoded text fails it). SentencePiece-style decoders (a leading space dropped at the start of the text)
    and decoders that join tokens with spaces are not: :class:`TextTracker` decodes them whole.

    Args:
        tokenizer: a transformers tokenizer.

    Returns:
        bool; False for anything it cannot inspect.
    """
    try:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if type(getattr(backend, "decoder", None)).__name__ not in _CONCATENATIVE_DECODERS:
            return False
        ids = list(tokenizer(_CONCATENATIVE_SAMPLE, add_special_tokens=False)["input_ids"])
        specials = [int(t) for t in getattr(tokenizer, "all_special_ids", [])][:4]
        ids = specials[:2] + ids[: len(ids) // 2] + specials[2:] + ids[len(ids) // 2 :] + specials[:1]
        for skip in (True, False):
            def decode(x):
                return tokenizer.decode(x, skip_special_tokens=skip, clean_up_tokenization_spaces=False)

            whole = decode(ids)
            for j in range(len(ids) + 1):
                head = decode(ids[:j])
                if not head.endswith("\ufffd") and head + decode(ids[j:]) != whole:
                    return False
        return True
    except Exception:  # a tokenizer this cannot inspect: decode whole (always exact)
        return False


class TextTracker:
    """Incremental detokenization with stop strings, for one generation.

    Feed each step's committed ids to :meth:`add`; it returns the text that is safe to show
    now. Shown text is always ``decode(ids[:j])`` for some token boundary j, and never
    includes a trailing U+FFFD (an incomplete UTF-8 character) or a tail that could be the
    start of a stop string; so a stop string found later (also one spanning two steps)
    never cuts into text already shown. After a stop string, ``ids`` is the longest prefix
    of the generated ids whose text is a prefix of the text before the stop string, and
    ``text == decode(ids)``. With ``include_stop`` (vLLM's ``include_stop_str_in_output``) the
    text ends with the stop string instead, and ``ids`` is the shortest prefix whose text holds
    it: ``text`` is ``decode(ids)`` cut right after the stop string (equal to it unless the last
    token runs past the stop string).

    Each step decodes only the ids after the shown text when ``concatenative`` is set: the text of
    ``ids[:j]`` is then the shown text followed by ``decode(ids[shown boundary:j])``, O(new tokens) a
    step. Otherwise every step decodes all ids (with SmolLM2's tokenizer a decode of 256 ids takes
    0.05 ms, of 2,000 ids 0.4 ms, against a 2.3-3.4 ms step). Only for decoders where that is exact
    (:func:`concatenative_decoder`).

    Args:
        decode: ids -> text (the decoder's own ``decode``).
        stops: non-empty stop strings.
        include_stop: keep the stop string that ended generation at the end of the text.
        concatenative: ``decode(a + b) == decode(a) + decode(b)`` whenever ``decode(a)`` ends with a whole
            character (not U+FFFD): see :func:`concatenative_decoder`. Same texts, pieces and ids either way.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str] = (),
                 include_stop: bool = False, *, concatenative: bool = False) -> None:
        self._decode = decode
        self.stops = list(stops)
        self.include_stop = include_stop
        self.concatenative = concatenative
        self.ids: list[int] = []
        self.shown = ""  # text handed out so far
        self._shown_ids = 0  # token boundary the shown text ends at
        self.stop_string: str | None = None
        self._final: str | None = None
        # concatenative decoders: the shown text's boundary and text, from which later text is decoded
        self._anchor, self._anchor_text = 0, ""

    @property
    def text(self) -> str:
        """The full text of ``ids`` (after :meth:`finish`, the final text)."""
        return self._final if self._final is not None else self._prefix_text(len(self.ids))

    def _prefix_text(self, j: int) -> str:
        """``decode(ids[:j])``; with a concatenative decoder, the anchor's text and the ids after it decoded alone."""
        if self.concatenative and j >= self._anchor:
            return self._anchor_text + self._decode(self.ids[self._anchor : j])
        return self._decode(self.ids[:j])

    def add(self, new_ids: Sequence[int]) -> str:
        """Append committed ids; return the new text to show ('' if none). Stops at a stop string."""
        if self.stop_string is not None:
            raise RuntimeError("generation already stopped at a stop string")
        self.ids.extend(int(t) for t in new_ids)
        text = self._prefix_text(len(self.ids))
        hit = self._find_stop(text)
        if hit is not None:
            pos, self.stop_string = hit
            self._cut(text[: pos + len(self.stop_string)] if self.include_stop else text[:pos])
            return self._show(self._final, len(self.ids))
        end = len(text) - self._held_back(text)
        if end == len(text):
            return self._show(text, len(self.ids))
        for j in range(len(self.ids) - 1, self._shown_ids, -1):  # a token boundary at or before `end`
            prefix = self._prefix_text(j)
            if len(prefix) <= end and text.startswith(prefix):
                return self._show(prefix, j)
        return ""

    def finish(self) -> str:
        """End of generation: fix the final text; return whatever was still held back."""
        if self._final is None:
            self._final = self._prefix_text(len(self.ids))
        return self._show(self._final, len(self.ids))

    def _show(self, text: str, boundary: int) -> str:
        if text == self.shown and boundary > self._shown_ids:  # tokens without text (skipped specials): move past
            self._shown_ids = boundary
            if self.concatenative and not text.endswith("\ufffd"):
                self._anchor, self._anchor_text = boundary, text
            return ""
        if len(text) <= len(self.shown) or not text.startswith(self.shown):
            return ""
        piece = text[len(self.shown) :]
        self.shown, self._shown_ids = text, boundary
        if self.concatenative and not text.endswith("\ufffd"):  # shown text ends with a whole character
            self._anchor, self._anchor_text = boundary, text
        return piece

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """Earliest (position, stop string) in ``text``; shown text cannot contain one, so search after it."""
        best = None
        for s in self.stops:
            pos = text.find(s, len(self.shown))
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, s)
        return best

    def _held_back(self, text: str) -> int:
        """Characters at the end of ``text`` not to show yet: trailing U+FFFD (an incomplete
        UTF-8 character), and before them the longest tail that is a proper prefix of a stop string."""
        bad = len(text) - len(text.rstrip("\ufffd"))
        base = text[: len(text) - bad]
        partial = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(base)), partial, -1):
                if base.endswith(s[:k]):
                    partial = k
                    break
        return bad + partial

    def _cut(self, before: str) -> None:
        """Keep the longest id prefix whose text is a prefix of ``before``; fix the final text. With
        ``include_stop`` (``before`` ends with the stop string): the shortest id prefix whose text starts
        with ``before``, the final text ``before``."""
        if self.include_stop:
            for j in range(self._shown_ids, len(self.ids) + 1):  # the whole text starts with it: j found
                if self._prefix_text(j).startswith(before):
                    del self.ids[j:]
                    self._final = before
                    return
        for j in range(len(self.ids), -1, -1):
            prefix = self._prefix_text(j)
            if before.startswith(prefix):
                del self.ids[j:]
                self._final = prefix
                return
