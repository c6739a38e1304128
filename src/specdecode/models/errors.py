"""The two errors of model loading: a model that cannot be had, a draft whose tokens mean other things."""

from __future__ import annotations

from specdecode.types import SpecDecodeError

class ModelLoadError(SpecDecodeError):
    """A model could not be found, fetched, verified or loaded; the message says what to do."""


class IncompatibleTokenizerError(SpecDecodeError):
    """A draft model does not share the target's tokenizer, so its token ids mean other things."""
