"""The text-level API: encoding, greedy equality with plain decoding, stop strings, streaming.

Runs on the tiny random Llama of ``conftest.py`` (float64, so greedy ties cannot flip
between a batched verification pass and one-token decoding).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import make_byte_level_tokenizer, make_tiny_tokenizer, save_tiny_model_dir
from specdecode.generator import SpecDecoder, TextTracker
from specdecode.models import IncompatibleTokenizerError, LoadedModel, load_model
from specdecode.proposers import DraftModelProposer, NgramConfig, NgramProposer, TreeDraftConfig, TreeDraftProposer
from specdecode.types import EmptyPromptError, InvalidSamplingParams, PromptTooLongError, SpecDecodeError

PROMPTS = ["the cat and the dog", "once upon a time, in a land far away", "def f(x): return x"]


@pytest.fixture
def ngram(tiny_loaded) -> SpecDecoder:
    return SpecDecoder(tiny_loaded, NgramProposer(NgramConfig(1, 3)), num_speculative_tokens=4)


def _reference(decoder: SpecDecoder, prompt: str, n: int = 60):
    """Greedy plain-decoding output with EOS ignored: the text every other run is checked against."""
    return decoder.plain().generate(prompt, max_new_tokens=n, ignore_eos=True)


# Encoding -------------------------------------------------------------------------


def test_encode_plain_chat_and_empty(ngram):
    assert ngram.decode(ngram.encode("the cat")) == "the cat"
    chat = ngram.encode("hi", chat=True)
    assert chat[0] == ngram.tokenizer.bos_token_id
    assert ngram.decode(chat) == "user: hi\nassistant: "  # BOS is special: not in the text
    assert ngram.encode("") == [ngram.tokenizer.bos_token_id]
    out = ngram.generate("", max_new_tokens=5, ignore_eos=True)
    assert out.prompt_token_ids == [ngram.tokenizer.bos_token_id] and len(out.token_ids) == 5


def test_a_prompt_that_is_neither_text_nor_token_ids_is_refused_in_one_line(tiny_loaded):
    dec = SpecDecoder(tiny_loaded, None)
    for bad, match in ((None, "text or a sequence of token ids, got NoneType"), (123, "got int"),
                       (b"hi", "got bytes"), (["a", "b"], "token ids must be integers"),
                       ([1.7], "token ids must be integers"), ([True], "token ids must be integers")):
        with pytest.raises(SpecDecodeError, match=match):
            dec.generate(bad, max_new_tokens=2)
    assert dec.generate([3, 4, 5], max_new_tokens=2).token_ids  # the decoder is still fine


def test_empty_prompt_without_bos_is_a_clear_error(tiny_loaded):
    no_bos = LoadedModel(tiny_loaded.model, make_tiny_tokenizer(with_bos=False, chat_template=None), "no-bos", "mem")
    dec = SpecDecoder(no_bos)
    with pytest.raises(EmptyPromptError, match="empty"):
        dec.generate("")
    with pytest.raises(SpecDecodeError, match="no chat template"):
        dec.encode("hi", chat=True)


def test_bad_inputs_raise_specdecode_errors(ngram):
    with pytest.raises(InvalidSamplingParams):
        ngram.generate("a", temperature=-1)
    with pytest.raises(InvalidSamplingParams):
        ngram.generate("a", top_p=1.5)
    with pytest.raises(InvalidSamplingParams):
        ngram.generate("a", stop=[""])
    with pytest.raises(PromptTooLongError):
        ngram.generate("a" * 300)
    with pytest.raises(SpecDecodeError):
        SpecDecoder(ngram.target, None, num_speculative_tokens=-1)


# Losslessness through the text API -------------------------------------------------


@pytest.mark.parametrize("prompt", PROMPTS)
def test_plain_equals_speculative_greedily(tiny_loaded, prompt):
    ref = _reference(SpecDecoder(tiny_loaded), prompt)
    for proposer in (NgramProposer(NgramConfig(1, 3)), DraftModelProposer(tiny_loaded.model)):
        dec = SpecDecoder(tiny_loaded, proposer, num_speculative_tokens=3)
        out = dec.generate(prompt, max_new_tokens=60, ignore_eos=True)
        assert out.token_ids == ref.token_ids
        assert out.text == ref.text == dec.decode(out.token_ids)
        assert out.finish_reason == "length" and out.metrics.num_generated_tokens == 60


def test_draft_equal_to_target_accepts_everything(tiny_loaded):
    dec = SpecDecoder(tiny_loaded, DraftModelProposer(tiny_loaded.model), num_speculative_tokens=4)
    m = dec.generate(PROMPTS[0], max_new_tokens=41, ignore_eos=True).metrics
    assert m.acceptance_rate == 1.0 and m.mean_accepted_length == 5.0


def test_sampling_is_reproducible_with_a_seed(ngram):
    a = ngram.generate(PROMPTS[1], max_new_tokens=30, temperature=0.8, top_p=0.9, seed=7)
    b = ngram.generate(PROMPTS[1], max_new_tokens=30, temperature=0.8, top_p=0.9, seed=7)
    assert a.token_ids == b.token_ids and a.text == b.text


def test_eos_ends_generation_with_finish_reason_stop(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir), progress=False)
    loaded.model.to(torch.float64)
    ref = _reference(SpecDecoder(loaded), PROMPTS[0], 30)
    eos = ref.token_ids[7]
    loaded.model.generation_config.eos_token_id = eos
    out = SpecDecoder(loaded, NgramProposer()).generate(PROMPTS[0], max_new_tokens=30)
    first = ref.token_ids.index(eos)
    assert out.finish_reason == "stop" and out.token_ids == ref.token_ids[: first + 1]


# Stop strings ----------------------------------------------------------------------


def _check_stopped(dec: SpecDecoder, ref, stop: str, pieces: list[str], out) -> None:
    """The contract of a stop: cut before it, ids consistent with the text, stream == text."""
    cut = ref.text.find(stop)
    assert cut >= 0
    assert out.finish_reason == "stop" and out.stop_string == stop
    assert dec.decode(out.token_ids) == out.text
    assert ref.text[:cut].startswith(out.text)
    assert out.token_ids == ref.token_ids[: len(out.token_ids)]
    # the longest such prefix: one more token's text would no longer be a prefix of the text before the stop
    longer = dec.decode(ref.token_ids[: len(out.token_ids) + 1])
    assert len(out.token_ids) == len(ref.token_ids) or not ref.text[:cut].startswith(longer)
    assert stop not in out.text
    assert "".join(pieces) == out.text
    assert out.metrics.num_generated_tokens == len(out.token_ids)


def test_stop_string_cuts_text_and_tokens(ngram):
    ref = _reference(ngram, PROMPTS[1])
    for start, length in ((12, 3), (25, 1), (3, 5)):
        stop = ref.text[start : start + length]
        pieces: list[str] = []
        out = ngram.generate(PROMPTS[1], max_new_tokens=60, ignore_eos=True, stop=[stop], on_text=pieces.append)
        _check_stopped(ngram, ref, stop, pieces, out)


def test_earliest_of_several_stop_strings_wins(ngram):
    ref = _reference(ngram, PROMPTS[0])
    late, early = ref.text[30:33], ref.text[10:12]
    out = ngram.generate(PROMPTS[0], max_new_tokens=60, ignore_eos=True, stop=[late, early])
    assert out.stop_string == min((late, early), key=ref.text.find)


def test_stop_string_spanning_two_engine_steps(ngram):
    prompt = PROMPTS[0]
    ids = ngram.encode(prompt)
    from specdecode.types import SamplingParams

    params = SamplingParams(max_new_tokens=60, ignore_eos=True, eos_token_ids=ngram.target.eos_token_ids)
    steps = [s.token_ids for s in ngram.engine.stream(ids, params)]
    generated = [t for s in steps for t in s]
    text = ngram.decode(generated)
    boundaries, n = [], 0  # character offsets where a step that committed several tokens begins
    for prev, nxt in zip(steps, steps[1:]):
        n += len(prev)
        if len(nxt) > 1:
            boundaries.append(len(ngram.decode(generated[:n])))
    assert len(boundaries) >= 3, "the n-gram drafter should commit several tokens per step"
    stop = next(  # 2 characters before such a boundary, 2..4 after; its first occurrence in the text
        text[c - 2 : c + w]
        for c in boundaries for w in (2, 3, 4)
        if c >= 2 and c + w <= len(text) and text.find(text[c - 2 : c + w]) == c - 2
    )
    ref = _reference(ngram, prompt)
    assert ref.token_ids == generated
    pieces: list[str] = []
    out = ngram.generate(prompt, max_new_tokens=60, ignore_eos=True, stop=[stop], on_text=pieces.append)
    _check_stopped(ngram, ref, stop, pieces, out)
    assert out.metrics.num_drafted_tokens > 0


def test_streaming_pieces_concatenate_to_the_text(ngram):
    for stop in (None, ["\n"], ["and", "x"]):
        pieces: list[str] = []
        out = ngram.generate(PROMPTS[2], max_new_tokens=50, ignore_eos=True, stop=stop, on_text=pieces.append)
        assert "".join(pieces) == out.text
        assert all(pieces)


# The tracker on its own (fake decoders) ---------------------------------------------


def _bytes_decode(ids) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def test_tracker_holds_back_incomplete_utf8():
    tracker = TextTracker(_bytes_decode)
    e_acute = list("é".encode())
    assert tracker.add(list(b"caf")) == "caf"
    assert tracker.add(e_acute[:1]) == ""  # half a character: "\ufffd" is not shown
    assert tracker.add(e_acute[1:]) == "é"
    assert tracker.finish() == ""
    assert tracker.text == "café"


def test_tracker_holds_back_a_partial_stop_string_then_releases_it():
    tracker = TextTracker(_bytes_decode, ["END"])
    assert tracker.add(list(b"abcE")) == "abc"
    assert tracker.add(list(b"N")) == ""
    assert tracker.add(list(b"o")) == "ENo"
    assert tracker.stop_string is None


def test_tracker_stop_spanning_adds_cuts_ids():
    tracker = TextTracker(_bytes_decode, ["END"])
    shown = tracker.add(list(b"abcEN")) + tracker.add(list(b"Dxyz"))
    assert tracker.stop_string == "END"
    assert tracker.ids == list(b"abc") and tracker.text == "abc" == shown


def test_tracker_stop_inside_a_token_drops_the_whole_token():
    vocab = ["ab", "cd", "ef"]

    def decode(ids):
        return "".join(vocab[i] for i in ids)

    tracker = TextTracker(decode, ["bc"])
    shown = tracker.add([0])  # "ab": "b" could start the stop string; "a" is mid-token, so nothing shows
    shown += tracker.add([1, 2])
    assert tracker.stop_string == "bc"
    assert tracker.ids == [] and tracker.text == "" == shown


def test_tracker_can_keep_the_stop_string():
    """include_stop (vLLM's include_stop_str_in_output): the text ends with the stop string, the ids run to the
    token that completed it (a token running past it keeps its id, not its text beyond the stop)."""
    vocab = ["ab", "c.", "\nd", "e"]

    def decode(ids):
        return "".join(vocab[i] for i in ids)

    for stop, text, ids in ((".", "abc.", [0, 1]), (".\n", "abc.\n", [0, 1, 2]), ("c.\nd", "abc.\nd", [0, 1, 2])):
        tracker = TextTracker(decode, [stop], include_stop=True)
        shown = tracker.add([0]) + tracker.add([1, 2, 3]) + tracker.finish()
        assert tracker.stop_string == stop
        assert (tracker.text, tracker.ids, shown) == (text, ids, text), stop
        cut = TextTracker(decode, [stop])  # the default: before it, the token that starts it dropped
        cut.add([0, 1, 2, 3])
        assert (cut.text, cut.ids) == ("ab", [0])
    spanning = TextTracker(_bytes_decode, ["END"], include_stop=True)
    shown = spanning.add(list(b"abcEN")) + spanning.add(list(b"Dxyz"))
    assert spanning.ids == list(b"abcEND") and spanning.text == "abcEND" == shown


# Concatenative decoders: the tracker decodes only the new ids, with the same results -------------------


@pytest.fixture(scope="module")
def byte_level():
    return make_byte_level_tokenizer()


def test_concatenative_decoder_recognises_byte_level_and_refuses_the_rest(byte_level):
    from tokenizers import decoders

    from specdecode.generator import concatenative_decoder

    assert concatenative_decoder(byte_level)
    assert concatenative_decoder(make_tiny_tokenizer())  # Fuse: the tokens' strings joined
    metaspace = make_byte_level_tokenizer()
    metaspace.backend_tokenizer.decoder = decoders.Metaspace()  # SentencePiece: a leading space dropped
    assert not concatenative_decoder(metaspace)
    spaced = make_byte_level_tokenizer()
    spaced.backend_tokenizer.decoder = None  # tokens joined with spaces
    assert not concatenative_decoder(spaced)

    class Rewrites(type(byte_level)):  # a subclass that rewrites decoded text fails the sample check
        def decode(self, ids, **kw):
            return super().decode(ids, **kw).strip()

    rewrites = make_byte_level_tokenizer()
    rewrites.__class__ = Rewrites
    assert not concatenative_decoder(rewrites)
    assert not concatenative_decoder(object())


def _run_tracker(decode, ids, cuts, stops, include_stop, concatenative):
    tracker = TextTracker(decode, stops, include_stop, concatenative=concatenative)
    pieces, start = [], 0
    for cut in [*cuts, len(ids)]:
        pieces.append(tracker.add(ids[start:cut]))
        start = cut
        if tracker.stop_string is not None:
            break
    pieces.append(tracker.finish())
    return pieces, tracker.text, tracker.ids, tracker.stop_string


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_concatenative_tracker_equals_whole_decoding(byte_level, data):
    """Random ids of the byte-level tokenizer (characters split across tokens, invalid byte runs), added in random
    steps, with stop strings taken from the text (also spanning steps), include_stop and special tokens kept or
    skipped: every piece shown, the final text, the kept ids and the stop found are those of decoding the whole ids
    every step."""
    vocab = len(byte_level)
    ids = data.draw(st.lists(st.integers(0, vocab - 1), min_size=0, max_size=60))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=8)))

    skip = data.draw(st.booleans())  # the server's skip_special_tokens=false too

    def decode(x):
        return byte_level.decode(x, skip_special_tokens=skip, clean_up_tokenization_spaces=False)

    text = decode(ids)
    stops = []
    if text and data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(text) - 1))
        stops.append(text[i : i + data.draw(st.integers(1, 4))])
    include_stop = data.draw(st.booleans())
    whole = _run_tracker(decode, ids, cuts, stops, include_stop, False)
    assert _run_tracker(decode, ids, cuts, stops, include_stop, True) == whole
    assert "".join(whole[0]) == whole[1]


def test_concatenative_tracker_comparison_fails_for_a_sentencepiece_decoder():
    """Negative control of the comparison above: forced onto a decoder that drops the text's leading space
    (SentencePiece's Metaspace), the new-ids-only tracker loses the spaces at its anchors."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"▁the": 0, "▁cat": 1, "▁sat": 2, "<unk>": 3}, unk_token="<unk>"))
    tok.decoder = decoders.Metaspace()
    sp = PreTrainedTokenizerFast(tokenizer_object=tok)
    ids = [0, 1, 2, 0, 1]

    def decode(x):
        return sp.decode(x, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    assert decode(ids) == "the cat sat the cat"
    cuts = list(range(1, len(ids)))
    assert _run_tracker(decode, ids, cuts, [], False, True) != _run_tracker(decode, ids, cuts, [], False, False)


def test_generate_uses_the_concatenative_tracker_with_the_same_text(ngram, monkeypatch):
    """The tiny model's tokenizer (Fuse) is concatenative: generate decodes new ids only, and streams and returns
    exactly what whole decoding does."""
    assert ngram.decode_is_concatenative
    runs, seen = [], []
    init = TextTracker.__init__

    def spy(self, *a, concatenative=False, **kw):
        seen.append(concatenative)
        init(self, *a, concatenative=concatenative, **kw)

    monkeypatch.setattr(TextTracker, "__init__", spy)
    for concatenative in (True, False):
        monkeypatch.setattr(ngram, "decode_is_concatenative", concatenative)  # (the instance's cached value)
        pieces: list[str] = []
        out = ngram.generate(PROMPTS[2], max_new_tokens=50, ignore_eos=True, stop=["and"], on_text=pieces.append)
        runs.append((pieces, out.text, out.token_ids, out.stop_string))
    assert seen == [True, False] and runs[0] == runs[1]


# from_pretrained ---------------------------------------------------------------------


def test_from_pretrained_sets_threads_as_the_command_line_does(tiny_model_dir, monkeypatch):
    """threads=N sets torch's thread count, "auto" takes one per idle core (the command line's rule), None leaves
    it; a bad value is refused before any model loads and named as the keyword (not --threads); a model that does
    not load leaves the count as it was."""
    from specdecode import threads as T

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        SpecDecoder.from_pretrained(str(tiny_model_dir), "none", progress=False, threads=1)
        assert torch.get_num_threads() == 1
        monkeypatch.setattr(T, "auto_threads", lambda flag="--threads": (2, None))
        SpecDecoder.from_pretrained(str(tiny_model_dir), "none", progress=False, threads="auto")
        assert torch.get_num_threads() == 2
        torch.set_num_threads(1)
        SpecDecoder.from_pretrained(str(tiny_model_dir), "none", progress=False)
        assert torch.get_num_threads() == 1
        for bad in (0, -1, True, 2.0, "many", 10_000):
            with pytest.raises(SpecDecodeError, match=r"^threads\b") as err:  # not the missing model: threads first
                SpecDecoder.from_pretrained("/nonexistent/model", "none", progress=False, threads=bad)
            assert "--threads" not in str(err.value)
        with pytest.raises(SpecDecodeError):  # a valid count with a model that does not load: nothing applied
            SpecDecoder.from_pretrained("/nonexistent/model", "none", progress=False, threads=2)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_from_pretrained_draft_kinds(tiny_model_dir):
    spec = str(tiny_model_dir)
    plain = SpecDecoder.from_pretrained(spec, None, progress=False)
    assert plain.proposer is None
    assert SpecDecoder.from_pretrained(spec, "none", progress=False).proposer is None
    ngram = SpecDecoder.from_pretrained(spec, "ngram", ngram_min=2, ngram_max=4, progress=False)
    assert isinstance(ngram.proposer, NgramProposer) and ngram.proposer.config == NgramConfig(2, 4)
    self_draft = SpecDecoder.from_pretrained(spec, spec, num_speculative_tokens=3, progress=False)
    assert isinstance(self_draft.proposer, DraftModelProposer) and self_draft.draft is not None
    assert self_draft.plain().proposer is None
    with pytest.raises(SpecDecodeError):
        SpecDecoder.from_pretrained(spec, "ngram", ngram_min=3, ngram_max=1, progress=False)


def test_from_pretrained_drafts_across_vocabularies_with_another_tokenizer(tiny_model_dir, tmp_path):
    """A draft whose tokenizer has a token more: the cross-vocabulary proposer, greedy output = plain."""
    from specdecode.proposers import CrossVocabProposer

    other = save_tiny_model_dir(tmp_path / "other", seed=1)
    tok = make_tiny_tokenizer()
    tok.add_tokens(["zzz"])
    tok.save_pretrained(other)
    spec = SpecDecoder.from_pretrained(str(tiny_model_dir), str(other), progress=False, weights="fp32")
    plain = SpecDecoder.from_pretrained(str(tiny_model_dir), "none", progress=False, weights="fp32")
    assert isinstance(spec.proposer, CrossVocabProposer)
    a = spec.generate("the cat and the", max_new_tokens=16, temperature=0)
    b = plain.generate("the cat and the", max_new_tokens=16, temperature=0)
    assert a.token_ids == b.token_ids and a.metrics.num_drafted_tokens > 0


# What ran and why, and where outputs part ----------------------------------------------


def test_from_pretrained_says_which_precision_auto_chose_and_why(tiny_model_dir, tmp_path):
    lines = []
    dec = SpecDecoder.from_pretrained(str(tiny_model_dir), "ngram", progress=False, cache_dir=tmp_path,
                                      status=lines.append)
    choice = dec.precision
    assert choice is not None and choice.precision in ("fp32", "bf16", "int8") and not choice.cached
    assert choice.reason.startswith(choice.precision + ":") and lines  # measured on first load, said so
    assert dec.plain().precision is choice
    again = SpecDecoder.from_pretrained(str(tiny_model_dir), "ngram", progress=False, cache_dir=tmp_path)
    assert again.precision.cached and again.precision.precision == choice.precision
    explicit = SpecDecoder.from_pretrained(str(tiny_model_dir), "ngram", progress=False, cache_dir=tmp_path,
                                           weights="fp32")
    assert explicit.precision.precision == "fp32" and "--weights" in explicit.precision.reason


def test_explain_difference_names_the_position_the_tokens_and_their_margin(ngram):
    prompt = ngram.encode("the cat and the dog")
    same = ngram.plain().generate(prompt, max_new_tokens=6, ignore_eos=True).token_ids
    assert ngram.explain_difference(prompt, same, same) is None
    other = [*same[:3], (same[3] + 1) % ngram.target.model.config.vocab_size, *same[4:]]
    line = ngram.explain_difference(prompt, other, same)
    assert line.startswith("first difference at generated token 3: plain decoding chose ")
    # greedy plain decoding took the argmax, so the other token's logit is lower: a positive margin
    margin = float(line.split("differ by ")[1].split()[0])
    assert margin > 0
    assert "stops at token 4" in ngram.explain_difference(prompt, same[:4], same)


# The whole sampling surface through the text API -------------------------------------------------


def test_generate_takes_every_sampling_setting(tiny_loaded):
    """Penalties, logit bias, allowed / banned / stop ids and min_tokens reach the engine, greedy speculative
    output equals greedy plain output under each, and seeded coupled sampling reproduces plain decoding."""
    # (fixed: a seeded request that opts out of the coupled mode repeats its text only under a fixed gamma)
    dec = SpecDecoder(tiny_loaded, NgramProposer(NgramConfig(1, 3)), num_speculative_tokens=4, policy="fixed")
    plain = dec.plain()
    prompt = "the cat and the dog and the cat and the"
    base = plain.generate(prompt, max_new_tokens=30, ignore_eos=True).token_ids
    z = dec.tokenizer.convert_tokens_to_ids("z")
    eos = tiny_loaded.eos_token_ids[0]
    settings = [
        dict(frequency_penalty=2.0), dict(presence_penalty=1.5), dict(repetition_penalty=2.0),
        dict(logit_bias={base[0]: -100}), dict(banned_token_ids=[base[0], base[1]]),
        dict(allowed_token_ids=[z, base[2], base[3]]), dict(stop_token_ids=[base[5]]),
    ]
    for kw in settings:
        want = plain.generate(prompt, max_new_tokens=30, ignore_eos=True, **kw)
        got = dec.generate(prompt, max_new_tokens=30, ignore_eos=True, **kw)
        assert got.token_ids == want.token_ids and got.text == want.text, kw
        assert got.token_ids != base or "stop_token_ids" in kw, kw
    stopped = dec.generate(prompt, max_new_tokens=30, ignore_eos=True, stop_token_ids=[base[5]])
    assert stopped.token_ids == base[: base.index(base[5]) + 1] and stopped.finish_reason == "stop"
    assert dec.generate(prompt, max_new_tokens=5, logit_bias={z: 100}).text == "zzzzz"
    held = dec.generate(prompt, max_new_tokens=10, logit_bias={eos: 100}, min_tokens=4)
    assert len(held.token_ids) == 5 and held.token_ids[-1] == eos and held.finish_reason == "stop"
    sampled = dict(max_new_tokens=30, temperature=1.0, seed=7, ignore_eos=True, min_p=0.05)
    coupled = dec.generate(prompt, coupled=True, **sampled)
    assert coupled.token_ids == plain.generate(prompt, coupled=True, **sampled).token_ids  # coupled: token for token
    assert dec.generate(prompt, coupled=False, **sampled).token_ids == dec.generate(prompt, coupled=False,
                                                                                   **sampled).token_ids
    with pytest.raises(InvalidSamplingParams, match="presence_penalty"):
        dec.generate(prompt, presence_penalty=3.0)
    with pytest.raises(SpecDecodeError, match="outside the vocabulary"):
        dec.generate(prompt, stop_token_ids=[10**6])


def test_verification_reaches_the_engine(tiny_loaded):
    for method in ("token", "block"):
        dec = SpecDecoder(tiny_loaded, NgramProposer(NgramConfig(1, 3)), num_speculative_tokens=4,
                          verification=method)
        assert dec.engine.config.verification == method and dec.plain().engine.config.verification == method
        out = dec.generate("the cat and the cat and the", max_new_tokens=20, temperature=0.8, seed=2, coupled=False)
        assert len(out.token_ids) <= 20
    with pytest.raises(SpecDecodeError, match="verification"):
        SpecDecoder(tiny_loaded, None, verification="tree")


# Every way out of a generation frees its row (issue 28, item 1) ------------------------------------


class _FailOnce(NgramProposer):
    """An n-gram drafter that raises ``error`` once: in ``start`` (the request's admission) or in its second
    ``propose`` (the middle of a step)."""

    def __init__(self, where: str | None = None, error: BaseException | None = None) -> None:
        super().__init__(NgramConfig(1, 3))
        self.where, self.error, self.proposals = where, error, 0

    def _maybe_fail(self, where: str) -> None:
        if self.where == where:
            self.where = None
            raise self.error

    def start(self, ctx) -> None:
        self._maybe_fail("start")
        super().start(ctx)

    def propose(self, batch, max_tokens):
        self.proposals += 1
        if self.proposals == 2:
            self._maybe_fail("propose")
        return super().propose(batch, max_tokens)


def _raising_on_second_piece(error: BaseException):
    pieces = []

    def on_text(piece: str) -> None:
        pieces.append(piece)
        if len(pieces) == 2:
            raise error

    return on_text


@pytest.mark.parametrize("way, error", [
    ("on_text", ZeroDivisionError()),  # a callback that fails
    ("on_text", KeyboardInterrupt()),  # Ctrl-C while the caller handles text
    ("propose", KeyboardInterrupt()),  # Ctrl-C inside a step
    ("propose", RuntimeError("drafter bug")),  # a step that fails
    ("start", KeyboardInterrupt()),  # Ctrl-C inside the admission (a drafter's prefill, a layer search)
])
def test_every_way_out_of_a_generation_frees_its_row(tiny_loaded, way, error):
    ref = _reference(SpecDecoder(tiny_loaded), PROMPTS[1], 24)
    proposer = _FailOnce(None if way == "on_text" else way, error)
    dec = SpecDecoder(tiny_loaded, proposer, num_speculative_tokens=4)
    on_text = _raising_on_second_piece(error) if way == "on_text" else None
    with pytest.raises(type(error)):
        dec.generate(PROMPTS[1], max_new_tokens=24, ignore_eos=True, on_text=on_text)
    assert dec.engine.rows == []
    again = dec.generate(PROMPTS[1], max_new_tokens=24, ignore_eos=True)  # the same decoder: the row was freed
    assert again.token_ids == ref.token_ids[:24] and dec.engine.rows == []


# Counters stop at the committed end (issue 28, item 3) ---------------------------------------------


def _check_counted_to_the_end(m, num_tokens: int) -> None:
    """Every counter of a chain run covers the ``num_tokens`` delivered tokens and nothing after them: the
    prefill's token, then steps that each kept at least one token, each kept token either an accepted draft
    token or the step's last (recovered / bonus) token."""
    assert m.num_generated_tokens == num_tokens
    assert m.num_step_tokens == max(0, num_tokens - 1)
    assert m.num_target_forwards == m.num_verify_steps + 1 == len(m.draft_lengths) + 1
    assert m.num_verify_steps <= m.num_step_tokens
    assert m.num_step_tokens - m.num_verify_steps <= m.num_accepted_tokens <= m.num_step_tokens
    assert sum(m.accepted_by_position) == m.num_accepted_tokens
    assert m.num_drafted_tokens == sum(m.draft_lengths)
    if m.num_tree_steps:  # a token tree: drafted counts nodes, positions count depths
        assert sum(m.drafted_by_position) == m.tree_depth_sum and m.num_tree_nodes == m.num_drafted_tokens
        assert m.tree_accepted_depth_sum == m.num_accepted_tokens
    else:
        assert sum(m.drafted_by_position) == m.num_drafted_tokens


@pytest.mark.parametrize("stop", ["and!", "nand"])
def test_counters_stop_at_a_stop_string(tiny_loaded, stop):
    """Draft == target with gamma 4: every step keeps its 4 draft tokens and a bonus, so the counters of a
    run cut at E tokens are exact: (E - 1) // 5 whole steps, and a step keeping r = (E - 1) % 5 tokens counts
    r drafted and r accepted ("and!" ends inside the third step; "nand" ends where the third step begins,
    inside a token, so that step counts nothing)."""
    dec = SpecDecoder(tiny_loaded, DraftModelProposer(tiny_loaded.model), num_speculative_tokens=4)
    out = dec.generate("the cat and the dog", max_new_tokens=30, ignore_eos=True, stop=[stop])
    end = len(out.token_ids)
    whole, r = divmod(end - 1, 5)
    assert out.stop_string == stop and (end, r) == ({"and!": 12, "nand": 11}[stop], {"and!": 1, "nand": 0}[stop])
    m = out.metrics
    assert (m.num_drafted_tokens, m.num_accepted_tokens) == (4 * whole + r, 4 * whole + r)
    assert (m.num_verify_steps, m.num_step_tokens, m.num_target_forwards) == (whole + (r > 0), end - 1,
                                                                              whole + (r > 0) + 1)
    assert m.mean_accepted_length == (end - 1) / (whole + (r > 0)) and m.acceptance_rate == 1.0
    _check_counted_to_the_end(m, end)


@pytest.mark.parametrize("kind, temperature", [  # sampled n-gram and tree rows run long: the slow lane
    pytest.param(k, t, marks=pytest.mark.slow if (k, t) in (("ngram", 1.0), ("tree", 1.0)) else ())
    for k in ("ngram", "draft-model", "tree") for t in (0.0, 1.0)])
def test_counters_stop_at_the_committed_end_whatever_ended_the_request(tiny_loaded, kind, temperature):
    """Stop strings at many places, EOS (a stop token), the token cap: the counters cover what was delivered."""
    def decoder():
        proposer = {"ngram": lambda: NgramProposer(NgramConfig(1, 3)),
                    "draft-model": lambda: DraftModelProposer(tiny_loaded.model),
                    "tree": lambda: TreeDraftProposer(tiny_loaded.model, TreeDraftConfig(num_nodes=8, top_k=2))}[kind]()
        return SpecDecoder(tiny_loaded, proposer, num_speculative_tokens=4)

    kw = dict(max_new_tokens=40, ignore_eos=True, temperature=temperature, seed=3)
    full = decoder().generate(PROMPTS[1], **kw)
    _check_counted_to_the_end(full.metrics, len(full.token_ids))
    ends = set()
    for start in range(2, len(full.text) - 3, 3):
        for stop in (full.text[start : start + 2], full.text[start : start + 3]):
            out = decoder().generate(PROMPTS[1], stop=[stop], **kw)
            assert out.stop_string == stop
            _check_counted_to_the_end(out.metrics, len(out.token_ids))
            ends.add(len(out.token_ids))
    assert len(ends) > 5
    eos = decoder().generate(PROMPTS[1], stop_token_ids=[full.token_ids[9]], **kw)
    _check_counted_to_the_end(eos.metrics, len(eos.token_ids))
    capped = decoder().generate(PROMPTS[1], **{**kw, "max_new_tokens": 13})
    _check_counted_to_the_end(capped.metrics, 13)
