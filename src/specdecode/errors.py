"""The user-facing errors that checks needing no model raise, in a module that imports nothing.

``specdecode.types`` re-exports them (``from specdecode.types import SpecDecodeError,
InvalidSamplingParams`` keeps working, as does ``proposers.layer_skip.LayerSkipError``); the command
line and :mod:`specdecode.validate` import them from here, so an argument error is reported without
importing torch.
"""

from __future__ import annotations


class SpecDecodeError(ValueError):
    """Base class for user-facing errors: the message says what is wrong and what to do.

    Attributes:
        field: the setting the error is about (``"top_p"``), when it is about one: a front end names
            its own flag for it (``--top-p``); None otherwise.
    """

    field: str | None = None


class InvalidSamplingParams(SpecDecodeError):
    """A sampling value is out of range (negative temperature, top_p outside (0, 1], ...)."""


class LayerSkipError(SpecDecodeError):
    """Layer skipping is impossible for this model, or a skip set is invalid."""


__all__ = ["InvalidSamplingParams", "LayerSkipError", "SpecDecodeError", "json_problem"]


def json_problem(exc) -> str:
    """What a ``json.JSONDecodeError`` found and where: "Expecting ',' delimiter at line 1 column 9" (Python's
    message for some errors already ends in "at": that word is not repeated)."""
    return f"{exc.msg.removesuffix(' at')} at line {exc.lineno} column {exc.colno}"
