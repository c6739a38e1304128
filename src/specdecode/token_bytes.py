"""Each token's own bytes and display string, for logprobs (the server's ``bytes`` / ``token`` fields).

Decoding one token id alone (``tokenizer.decode([id])``) is wrong for logprobs in three ways: a token
holding part of a multi-byte UTF-8 character decodes to U+FFFD, a special token decodes to "" when
specials are skipped, and SentencePiece-style decoders strip a leading space. This module reads the
token's bytes from the vocabulary itself:

- byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM2): the token string through the GPT-2 byte decoder
  (the inverse of ``bytes_to_unicode``), so a character split across tokens gives each token its real
  partial bytes;
- SentencePiece-style vocabularies (Llama 2, Mistral): ``<0xNN>`` byte-fallback tokens are the byte NN,
  ``▁`` is a space;
- special and added tokens: their own text (``<|im_end|>``);
- anything else: the token decoded alone.

The display string (``token``) is the bytes decoded as UTF-8 when they are valid UTF-8; a token that
holds only part of a character is shown as ``bytes:\\xe4\\xb8`` (the form of OpenAI's legacy completions
logprobs and of vLLM), while ``bytes`` always carries the truth.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache

from transformers.convert_slow_tokenizer import bytes_to_unicode


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """The GPT-2 byte-level alphabet, inverted: the printable character standing for each byte -> the byte
    (the inverse of Radford et al. 2019's ``bytes_to_unicode``, which every byte-level BPE vocabulary uses;
    transformers' copy)."""
    return {ch: b for b, ch in bytes_to_unicode().items()}


def display(data: bytes) -> str:
    """A token's display string: its UTF-8 text, or ``bytes:\\xNN...`` when it is not valid UTF-8 alone."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def _decoder_types(tokenizer) -> set[str]:
    """The types of the fast tokenizer's decoder (a Sequence's members too); empty when unknown."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    try:
        dec = json.loads(backend.to_str()).get("decoder") or {}
    except Exception:  # noqa: BLE001 - a tokenizer that cannot serialise: fall back to decoding
        return set()
    members = dec.get("decoders") or [dec]
    return {m.get("type") for m in members if isinstance(m, dict)}


class TokenBytes:
    """Token id -> (bytes, display string) for one tokenizer (cached per id).

    Args:
        tokenizer: a Hugging Face tokenizer.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        kinds = _decoder_types(tokenizer)
        self.kind = "byte-level" if "ByteLevel" in kinds else ("sentencepiece" if "ByteFallback" in kinds or
                                                                "Metaspace" in kinds else "decode")
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._added = {int(i): str(getattr(t, "content", t)) for i, t in added.items()}
        self._special = {int(i) for i in getattr(tokenizer, "all_special_ids", ()) or ()}
        self._cache: dict[int, tuple[bytes, str]] = {}

    def is_special(self, token_id: int) -> bool:
        return int(token_id) in self._special

    def bytes_of(self, token_id: int) -> bytes:
        return self.entry(token_id)[0]

    def text_of(self, token_id: int) -> str:
        return self.entry(token_id)[1]

    def entry(self, token_id: int) -> tuple[bytes, str]:
        """(the token's bytes, its display string)."""
        t = int(token_id)
        hit = self._cache.get(t)
        if hit is None:
            data = self._bytes(t)
            hit = self._cache[t] = (data, display(data))
        return hit

    def __call__(self, ids: Sequence[int]) -> list[tuple[bytes, str]]:
        return [self.entry(t) for t in ids]

    def _bytes(self, t: int) -> bytes:
        if t in self._added:  # special and added tokens are stored as their own text
            return self._added[t].encode("utf-8")
        piece = None
        if self.kind != "decode":
            try:
                piece = self.tokenizer.convert_ids_to_tokens(t)
            except Exception:  # noqa: BLE001 - an id past the tokenizer (a padded vocabulary)
                piece = None
        if isinstance(piece, str):
            if self.kind == "byte-level":
                table = byte_decoder()
                if all(ch in table for ch in piece):
                    return bytes(table[ch] for ch in piece)
            elif self.kind == "sentencepiece":
                if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                    try:
                        return bytes([int(piece[3:5], 16)])
                    except ValueError:
                        pass
                return piece.replace("\u2581", " ").encode("utf-8")
            return piece.encode("utf-8")
        try:
            return self.tokenizer.decode([t], skip_special_tokens=False, clean_up_tokenization_spaces=False).encode(
                "utf-8")
        except Exception:  # noqa: BLE001 - an id the tokenizer does not know (a padded vocabulary)
            return b""
