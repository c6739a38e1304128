"""The first ten minutes: refusals before any weight file is read, an unreachable hub without retries, and
loads without Hugging Face's own bars and warnings (specdecode.preflight, specdecode.models)."""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import time
from pathlib import Path

import pytest
from conftest import make_tiny_model, make_tiny_tokenizer, save_tiny_model_dir
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from specdecode import cli
from specdecode import models as M
from specdecode.models import convert, fetch, hub, loaded
from specdecode import preflight as P
from specdecode.models import OFFLINE_MODELS, IncompatibleTokenizerError, ModelLoadError, load_model
from specdecode.types import PromptTooLongError

HUB_ID = "HuggingFaceTB/SmolLM2-360M"


def other_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose ids mean other things than the tiny character tokenizer's."""
    vocab = {tok: i for i, tok in enumerate(["<unk>", "<s>", "</s>", "<pad>", "def", "return", "x", "y"])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory) -> Path:
    """A loadable tiny model directory with :func:`other_tokenizer`."""
    path = tmp_path_factory.mktemp("other") / "other-llama"
    tokenizer = other_tokenizer()
    make_tiny_model(len(tokenizer), seed=1).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


class _NoWeights:
    """Stands in for AutoModelForCausalLM in specdecode.models: any weight load fails the test."""

    calls = 0

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        cls.calls += 1
        raise AssertionError(f"a weight file was read: from_pretrained{args}")


@pytest.fixture
def no_weights(monkeypatch):
    """Every model load through specdecode.models (target, draft, conversion) fails; safetensors reads too."""
    import safetensors.torch

    def refuse(*args, **kwargs):
        raise AssertionError("a safetensors file was read")

    for module in (loaded, convert):  # every module of the package that loads weights through it
        monkeypatch.setattr(module, "AutoModelForCausalLM", _NoWeights)
    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    monkeypatch.setattr(safetensors, "safe_open", refuse)
    P._INFOS.clear()
    yield
    P._INFOS.clear()


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --------------------------------------------------------------------------- tokenizer compatibility


def test_mismatch_refused_from_small_files(tiny_model_dir, other_dir, no_weights):
    start = time.perf_counter()
    with pytest.raises(IncompatibleTokenizerError) as info:
        P.check_models(str(tiny_model_dir), str(other_dir))
    message = str(info.value)
    assert f"target vocab {len(make_tiny_tokenizer())} tokens, draft 8" in message
    assert "first differing token: id 0 is '<pad>' in the target, '<unk>' in the draft" in message
    assert str(tiny_model_dir) in message and str(other_dir) in message and "--draft ngram" in message
    assert time.perf_counter() - start < 10
    assert P.check_models(str(tiny_model_dir), str(tiny_model_dir)).max_context == 256  # the same spec: no pair


def test_preflight_refusal_is_the_loaders(tiny_model_dir, other_dir):
    """The same sentence the check after loading gives (models.check_compatible)."""
    P._INFOS.clear()
    with pytest.raises(IncompatibleTokenizerError) as early:
        P.check_models(str(tiny_model_dir), str(other_dir))
    with pytest.raises(IncompatibleTokenizerError) as late:
        M.check_compatible(load_model(str(tiny_model_dir), progress=False), load_model(str(other_dir), progress=False))
    assert str(early.value) == str(late.value)


def test_same_tokenizer_passes_and_a_short_embedding_is_refused(tiny_model_dir, tmp_path, no_weights):
    twin = save_tiny_model_dir(tmp_path / "twin", seed=3)
    assert P.check_models(str(tiny_model_dir), str(twin)).name == str(tiny_model_dir)
    config = json.loads((twin / "config.json").read_text())
    (twin / "config.json").write_text(json.dumps({**config, "vocab_size": 40}))
    with pytest.raises(IncompatibleTokenizerError, match="the draft's embedding has 40 rows"):
        P.check_models(str(tiny_model_dir), str(twin))  # re-read: the files changed


def test_cross_vocab_is_said_from_small_files(tiny_model_dir, other_dir, no_weights):
    """Chains: a draft with another tokenizer passes the check and one line says how it drafts."""
    lines = []
    info = P.check_models(str(tiny_model_dir), str(other_dir), cross_vocab=True, say=lines.append)
    assert info.max_context == 256 and len(lines) == 1
    assert "drafting across vocabularies" in lines[0] and "tokens in both" in lines[0]


def test_token_trees_with_another_tokenizer_are_refused_before_weights(capsys, tiny_model_dir, other_dir, no_weights):
    from specdecode.generator import SpecDecoder
    from specdecode.server import ServeOptions, load_state

    """The real reason: the same pair drafts chains across vocabularies, so the refusal names token trees."""
    reason = "token trees are not available across vocabularies"
    with pytest.raises(IncompatibleTokenizerError, match=reason):
        SpecDecoder.from_pretrained(str(tiny_model_dir), str(other_dir), tree="dynamic", progress=False)
    with pytest.raises(IncompatibleTokenizerError, match=reason):
        load_state(ServeOptions(target=str(tiny_model_dir), draft=str(other_dir), tree="dynamic"), progress=False)
    code, out, err = _run(capsys, "generate", "--target", str(tiny_model_dir), "--draft", str(other_dir),
                          "--tree", "dynamic", "--prompt", "the cat")
    assert code == 2 and out == ""
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: --tree dynamic:") and reason in line and "Drop --tree" in line
    assert "cannot be used with target" not in err and "loading target" not in err
    assert _NoWeights.calls == 0
    assert P.check_models(str(tiny_model_dir), str(other_dir), cross_vocab=True) is not None  # chains: fine


def test_the_factory_gives_the_same_reason_for_loaded_models():
    """Models already loaded (the library's build_state / factory_from_spec path): the same sentence."""
    from specdecode.proposers.factory import factory_from_spec
    from specdecode.spec import DrafterSpec

    tiny, other = make_tiny_tokenizer(), other_tokenizer()
    with pytest.raises(IncompatibleTokenizerError, match="--tree static: token trees are not available across "
                                                         "vocabularies: draft 'other' has another tokenizer than the "
                                                         "target"):
        factory_from_spec(DrafterSpec.from_settings({"draft": "other", "tree": "static"}),
                          target=make_tiny_model(len(tiny)), draft=make_tiny_model(len(other), seed=1),
                          target_tokenizer=tiny, draft_tokenizer=other)


# --------------------------------------------------------------------------- prompts, datasets, files


def test_too_long_prompt_refused_before_weights(capsys, tiny_model_dir, no_weights):
    code, out, err = _run(capsys, "generate", "--target", str(tiny_model_dir), "--prompt", "a" * 250,
                          "--max-new-tokens", "8")
    assert code == 2 and out == ""
    assert "prompt 'prompt' has 250 tokens; with --max-new-tokens 8 it exceeds the model's context of 256" in err
    code, _, err = _run(capsys, "generate", "--target", str(tiny_model_dir), "--prompt", "hi", "--chat",
                        "--max-new-tokens", "250")  # the chat template's tokens count too
    assert code == 2 and "exceeds the model's context of 256 tokens" in err


def test_prompt_fits_up_to_the_last_token(tiny_model_dir, no_weights):
    info = P.check_models(str(tiny_model_dir))
    n = P.prompt_length(info.tokenizer, "the cat and the dog", False)
    P.check_prompts(info, [("p", "the cat and the dog", False)], 256 - n)
    with pytest.raises(PromptTooLongError):
        P.check_prompts(info, [("ok", "hi", None), ("p", "the cat and the dog", False)], 257 - n)
    P.check_prompts(P.ModelInfo("gguf", "x.gguf", P.HeaderVocab(["a"], {})), [("p", "a" * 10_000, None)], 8)


@pytest.mark.parametrize("text", ["", "the cat and the dog", "Once upon a time, (in 1999)!"])
@pytest.mark.parametrize("chat", [False, True])
def test_prompt_length_is_what_the_decoder_encodes(tiny_loaded, text, chat):
    from specdecode.generator import SpecDecoder

    decoder = SpecDecoder(tiny_loaded, None)
    assert P.prompt_length(tiny_loaded.tokenizer, text, chat) == len(decoder.encode(text, chat=chat))


@pytest.mark.parametrize(("argv", "needle"), [
    (["--draft", "/no/such/draft"], "no such file or directory: '/no/such/draft'"),
    (["--draft", "missing-draft.gguf"], "no such file or directory: 'missing-draft.gguf'"),
    (["--draft", "suffix:./nope"], "no such file or directory: './nope'"),
    (["--dataset", "no-such-set:3"], "unknown dataset 'no-such-set'"),
    (["--dataset", "humaneval:0"], "must be a positive integer"),
    (["--prompt-file", "/no/such/prompt.txt"], "prompt file not found"),
])
def test_bad_names_and_files_fail_before_any_load(capsys, tiny_model_dir, no_weights, argv, needle):
    argv = argv if "--dataset" in argv or "--prompt-file" in argv else [*argv, "--prompt", "hi"]
    code, out, err = _run(capsys, "generate", "--target", str(tiny_model_dir), *argv)
    assert code == 2 and out == "" and needle in err, err
    assert "loading target" not in err


def test_a_missing_path_says_whether_it_is_the_target_or_the_draft(tiny_model_dir):
    with pytest.raises(ModelLoadError, match="^the draft model: no such file or directory: './missing/draft'"):
        P.check_models(str(tiny_model_dir), "./missing/draft")
    with pytest.raises(ModelLoadError, match="^the target model: no such file or directory: './missing/target'"):
        P.check_models("./missing/target", str(tiny_model_dir))


def test_a_bare_draft_word_that_is_no_model_names_the_drafters_too(monkeypatch, tiny_model_dir):
    """``--draft nosuchdrafter`` (no near miss of a drafter, so read as a model): the model error also lists the
    model-free drafters; a path does not get that hint."""
    import contextlib

    @contextlib.contextmanager
    def no_hub(spec):  # what an unreachable Hub gives, without the 1 s wait
        raise ModelLoadError(f"could not load {spec!r}: the Hugging Face Hub cannot be reached")
        yield

    monkeypatch.setattr(P.M, "hub_access", no_hub)
    with pytest.raises(ModelLoadError, match=r"^the draft model: .* --draft also takes a model-free drafter \(") as err:
        P.check_models(str(tiny_model_dir), "nosuchdrafter")
    free = str(err.value).split("model-free drafter (")[1].split(")")[0]
    assert "ngram" in free and "draft-model" not in free  # a drafter with a model is not listed as model-free
    assert "draft-model:model=MODEL" in str(err.value) or "KIND:model=MODEL" in str(err.value)
    with pytest.raises(ModelLoadError) as err:
        P.check_models(str(tiny_model_dir), "./missing/draft")
    assert "model-free drafter" not in str(err.value)


def test_missing_target_path_fails_before_the_draft_is_read(monkeypatch, tiny_model_dir):
    monkeypatch.setattr(P, "inspect_model", lambda *a, **k: pytest.fail("nothing is read before every path exists"))
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        P.check_models(str(tiny_model_dir), "./missing/draft")


# --------------------------------------------------------------------------- GGUF headers


def write_gguf(path: Path, tokens: list[str], *, bos: int = 1, eos: int = 2, context: int = 512) -> Path:
    """A small GGUF: llama metadata, a token list with scores / types / merges, one F32 tensor."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(context)
    w.add_block_count(1)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types([1] * len(tokens))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_pad_token_id(0)
    w.add_tensor("token_embd.weight", np.arange(4096, dtype=np.float32).reshape(64, 64))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


TINY_TOKENS = sorted(make_tiny_tokenizer().get_vocab(), key=make_tiny_tokenizer().get_vocab().get)  # by id


def test_gguf_header_reader(tmp_path):
    tokens = ["<pad>", "<s>", "</s>", "héllo", "▁world", *(f"t{i}" for i in range(100))]
    path = write_gguf(tmp_path / "m.gguf", tokens, context=4096)
    meta = P.read_gguf_metadata(path)
    assert meta["general.architecture"] == "llama" and meta["llama.context_length"] == 4096
    assert meta["tokenizer.ggml.tokens"] == tokens
    assert (meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]) == (1, 2)
    assert "tokenizer.ggml.merges" not in meta and "tokenizer.ggml.scores" not in meta  # skipped
    blob = path.read_bytes()
    first_part = tmp_path / "part01.bin"  # a GGUF split into raw chunks: the header is in the first
    first_part.write_bytes(blob[: len(blob) - 4096 * 4 + 8])
    assert P.read_gguf_metadata(first_part) == meta
    (tmp_path / "cut.gguf").write_bytes(blob[:200])
    with pytest.raises(ValueError, match="cut short"):
        P.read_gguf_metadata(tmp_path / "cut.gguf")
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match="not a GGUF"):
        P.read_gguf_metadata(tmp_path / "not.gguf")


def test_gguf_file_compared_by_its_header(tmp_path, tiny_model_dir, no_weights):
    same = write_gguf(tmp_path / "same.gguf", TINY_TOKENS)
    info = P.check_models(str(same), str(tiny_model_dir))
    assert info.tokenizer is None and info.max_context == 512
    P.check_models(str(tiny_model_dir), str(same))
    other = write_gguf(tmp_path / "other.gguf", TINY_TOKENS, eos=3)
    with pytest.raises(IncompatibleTokenizerError, match="eos token id differs: target 2, draft 3"):
        P.check_models(str(tiny_model_dir), str(other))
    (tmp_path / "broken.gguf").write_bytes(b"GGUF")  # unreadable header: left to the loader, not refused here
    assert P.check_models(str(tmp_path / "broken.gguf"), str(tiny_model_dir)) is None


def _fake_packages(root: Path, prefix: str, chunks: list[bytes]) -> None:
    for i, chunk in enumerate(chunks, 1):
        data = root / f"{prefix}_part{i}" / "data"
        data.mkdir(parents=True)
        (data.parent / "__init__.py").write_text("raise ImportError('must not be imported')\n")
        (data / f"part{i:02d}.bin").write_bytes(chunk)


def test_unconverted_catalog_model_read_from_its_first_part(tmp_path, monkeypatch, tiny_model_dir, no_weights):
    """Not converted yet: the header in the first part's file decides; the missing part 1 alone is installed."""
    blob = write_gguf(tmp_path / "joined.gguf", [t.upper() for t in TINY_TOKENS]).read_bytes()
    chunks = [blob[: len(blob) // 2], blob[len(blob) // 2:]]
    entry = M._chunked("fake-pre", "fake", "fakepre", "0.0", 2, "fake-pre.gguf", len(blob),
                       hashlib.sha256(blob).hexdigest())
    monkeypatch.setitem(OFFLINE_MODELS, entry.name, entry)
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    installs = []

    def fake_install(requirements, name, *args, **kwargs):
        installs.append(requirements)
        _fake_packages(site, "fakepre", chunks[:1])

    for module in (M, fetch):  # preflight calls it through the package, the load through fetch
        monkeypatch.setattr(module, "_pip_install", fake_install)
    with pytest.raises(IncompatibleTokenizerError, match="first differing token: id 0 is '<pad>' in the target, "
                                                         "'<PAD>' in the draft"):
        P.check_models(str(tiny_model_dir), "fake-pre", cache_dir=tmp_path / "cache")
    assert installs == [["fakepre-part1==0.0"]]
    info = P.inspect_model("fake-pre", cache_dir=tmp_path / "cache")
    assert info.source.endswith("fakepre_part1/data/part01.bin") and len(info.vocab) == len(TINY_TOKENS)


@pytest.mark.integration
def test_catalog_headers_match_their_converted_tokenizers(tmp_path):
    """On the real catalog models: the first part's GGUF header says what the converted tokenizer says."""
    P._INFOS.clear()
    for name in OFFLINE_MODELS:
        converted = M.default_cache_dir() / "converted" / name
        if not M._converted_ok(converted, OFFLINE_MODELS[name].sha256) or M._module_dir(
                OFFLINE_MODELS[name].parts[0][0]) is None:
            continue
        header = P.inspect_model(name, cache_dir=tmp_path)  # an empty cache: the packages' first part
        full = P.inspect_model(name)
        assert header.tokenizer is None and full.tokenizer is not None
        assert P.tokenizer_difference(full, header) is None and header.max_context == full.max_context


# --------------------------------------------------------------------------- an unreachable hub


@pytest.fixture
def unreachable_hub(monkeypatch, tmp_path):
    """No HF_HUB_OFFLINE, the reachability check answers "no", an empty HF cache, and any network call fails."""
    from huggingface_hub import constants, file_download, hf_api

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(hub, "_REACHABLE", {})
    checks = []
    monkeypatch.setattr(hub, "_can_connect", lambda address, timeout: checks.append(address) or False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # as imported without the variable
    network = []

    def no_network(*args, **kwargs):
        network.append(args[:2])
        raise AssertionError(f"a network call was made: {args[:2]}")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(file_download, "get_hf_file_metadata", no_network)
    monkeypatch.setattr(hf_api.HfApi, "model_info", no_network)
    P._INFOS.clear()
    yield {"checks": checks, "network": network, "cache": tmp_path / "hf-cache"}
    P._INFOS.clear()


def test_unknown_hub_id_fails_at_once_when_the_hub_is_unreachable(unreachable_hub):
    for attempt in (lambda: load_model(HUB_ID), lambda: P.check_models(HUB_ID)):
        start = time.perf_counter()
        with pytest.raises(ModelLoadError) as info:
            attempt()
        assert time.perf_counter() - start < 2
        message = str(info.value)
        assert "the Hugging Face Hub cannot be reached (https://huggingface.co did not answer within 1 s)" in message
        assert f"'{HUB_ID}' is not in the local Hugging Face cache" in message
        assert "a local model directory, a .gguf file or a named offline model" in message and "smollm2-135m" in message
    assert unreachable_hub["network"] == []
    assert len(unreachable_hub["checks"]) == 1  # asked once per process


def test_generate_with_an_unreachable_hub_draft_fails_before_any_load(capsys, unreachable_hub, tiny_model_dir,
                                                                      no_weights):
    start = time.perf_counter()
    code, out, err = _run(capsys, "generate", "--target", str(tiny_model_dir), "--draft", HUB_ID, "--prompt", "hi")
    assert time.perf_counter() - start < 2
    assert code == 2 and "cannot be reached" in err and "Retrying" not in err and "loading target" not in err
    assert unreachable_hub["network"] == []


def test_an_unreachable_hub_draft_fails_before_the_target_is_read(unreachable_hub, monkeypatch, tiny_model_dir):
    monkeypatch.setattr(P, "inspect_model", lambda *a, **k: pytest.fail("read the target's files first"))
    with pytest.raises(ModelLoadError, match="cannot be reached"):
        P.check_models(str(tiny_model_dir), HUB_ID)


def _put_in_hf_cache(cache: Path, repo_id: str, model_dir: Path) -> None:
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<commit>/files}."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 40
    shutil.copytree(model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def test_cached_hub_model_still_loads_when_the_hub_is_unreachable(unreachable_hub, tiny_model_dir):
    from huggingface_hub import constants

    _put_in_hf_cache(unreachable_hub["cache"], "someorg/tiny", tiny_model_dir)
    info = P.check_models("someorg/tiny")
    assert info.max_context == 256 and len(info.vocab) == len(make_tiny_tokenizer())
    loaded = load_model("someorg/tiny", progress=False)
    assert loaded.source == "someorg/tiny" and loaded.max_context == 256
    assert unreachable_hub["network"] == [] and constants.HF_HUB_OFFLINE is False  # offline only inside the load


def test_hub_reachability_is_one_short_connect(monkeypatch):
    for var in ("http_proxy", "https_proxy", "all_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY",
                "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(hub, "_REACHABLE", {})
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}/")
        assert M._hub_address() == ("127.0.0.1", port)
        assert M.hub_reachable() is True
    assert M.hub_reachable() is True  # cached: not asked again
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        free = closed.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free}")
    start = time.perf_counter()
    assert M.hub_reachable() is False and time.perf_counter() - start < 1.5
    monkeypatch.setenv("HF_ENDPOINT", "https://huggingface.co")
    monkeypatch.setenv("https_proxy", "http://proxy.local:3128")
    assert M._hub_address() == ("proxy.local", 3128)
    monkeypatch.setenv("no_proxy", "huggingface.co")
    assert M._hub_address() == ("huggingface.co", 443)


def test_a_hanging_connect_counts_as_unreachable(monkeypatch):
    def hang(*args, **kwargs):  # a DNS lookup that takes its time
        time.sleep(2)
        raise OSError("timed out")

    monkeypatch.setattr(socket, "create_connection", hang)
    start = time.perf_counter()
    assert M._can_connect(("hub.invalid", 443), 0.2) is False
    assert time.perf_counter() - start < 1


def test_offline_flag_needs_no_network_check(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "hub_reachable", lambda *a, **k: pytest.fail("HF_HUB_OFFLINE decides alone"))
    assert M.hub_offline_reason() == "the Hugging Face Hub is switched off (HF_HUB_OFFLINE is set)"


# --------------------------------------------------------------------------- Hugging Face's own output


def test_loads_show_no_hf_bars_or_warnings(tmp_path, capfd):
    import transformers

    path = save_tiny_model_dir(tmp_path / "flags")
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.7, "do_sample": False}))
    hf_logging = transformers.utils.logging
    before = (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled())
    capfd.readouterr()
    load_model(str(path), progress=True)
    err = capfd.readouterr().err
    assert "generation flags" not in err and "Loading weights" not in err and err.strip() == "", err
    assert (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()) == before


def test_status_line_without_a_terminal_has_no_blank_line(capsys):
    with M._status("checking something", True):
        pass
    assert capsys.readouterr().err == "specdecode: checking something: done in 0.0 s\n"


def test_quiet_output_is_restored_after_an_error():
    import transformers

    hf_logging = transformers.utils.logging
    before = hf_logging.get_verbosity()
    with pytest.raises(RuntimeError), M.quiet_hf_output():
        assert hf_logging.get_verbosity() == hf_logging.ERROR
        raise RuntimeError("boom")
    assert hf_logging.get_verbosity() == before


def test_a_cache_folder_that_cannot_be_had_is_refused_before_any_work(tmp_path, monkeypatch):
    """--cache-dir / SPECDECODE_CACHE: a file, or a place nothing can be made, is refused in one line naming the
    setting, before hashing, converting or compiling; an existing folder (read-only and full, perhaps) and one that
    can be made pass, and the check leaves nothing behind."""
    from specdecode.paths import OutputPathError

    afile = tmp_path / "afile"
    afile.write_text("x")
    from specdecode.paths import check_cache_dir

    monkeypatch.delenv("SPECDECODE_CACHE", raising=False)
    with pytest.raises(OutputPathError, match=r"^the cache folder \(cache_dir / --cache-dir\) .*afile: is a file"):
        check_cache_dir(afile)
    with pytest.raises(OutputPathError, match=r"--cache-dir\) /proc/nope: cannot write there"):
        check_cache_dir("/proc/nope")
    with pytest.raises(OutputPathError, match=r"is empty"):
        check_cache_dir("")
    monkeypatch.setenv("SPECDECODE_CACHE", "/proc/nope")
    with pytest.raises(OutputPathError, match=r"^SPECDECODE_CACHE /proc/nope"):
        P.check_models("smollm2-135m")
    check_cache_dir(tmp_path / "new" / "cache")
    assert not (tmp_path / "new").exists()
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    check_cache_dir()
    monkeypatch.delenv("SPECDECODE_CACHE")
    check_cache_dir()  # the default place is not checked


def test_a_prompt_that_does_not_fit_gets_the_advice_that_can_work():
    """request.too_long, the one line of every front end: room left -> lower the cap to the room; no room and a cap
    below the context -> shorten the prompt to what the cap leaves; a cap that fills the context alone -> both.
    '1 token', not '1 tokens'."""
    from specdecode.request import too_long

    fits = too_long(250, 8, 256, "--max-new-tokens", "prompt 'p'")
    assert fits.startswith("prompt 'p' has 250 tokens; with --max-new-tokens 8") and "to at most 6" in fits
    for n in (256, 300):  # the prompt fills or passes the context: only shortening it can help
        line = too_long(n, 8, 256, "--max-new-tokens")
        assert "shorten the prompt to at most 248 tokens" in line and "lower" not in line
    both = too_long(300, 300, 256, "--max-new-tokens")
    assert "lower --max-new-tokens below 256 and shorten the prompt" in both
    assert too_long(1, 300, 256).startswith("the prompt has 1 token;") and "max_new_tokens to at most 255" in too_long(1, 300, 256)
