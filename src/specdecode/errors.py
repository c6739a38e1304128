"""The base of every user-facing error, in a module that imports nothing.

``specdecode.types`` re-exports it (``from specdecode.types import SpecDecodeError`` keeps
working); the command line imports it from here, so an argument error is reported without
importing torch.
"""

from __future__ import annotations


class SpecDecodeError(ValueError):
    """Base class for user-facing errors: the message says what is wrong and what to do."""


__all__ = ["SpecDecodeError"]
