"""``specdecode bench --setup-peers``: install and prepare the external peers that live outside our venv.

- ``openvino``: a virtual environment with openvino-genai and optimum-intel (``bench.openvino.setup``), and
  OpenVINO exports of the target and draft;
- ``llama-server``: llama.cpp's C++ server built from the llama-cpp-python sdist (``bench.llamaserver.setup``).

Both live under ``$SPECDECODE_CACHE/peers/``; every step runs at low priority (``nice -n 19``) and is skipped
when its result is already there, so the command can be rerun to add models.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from specdecode.bench import llamaserver, openvino
from specdecode.types import SpecDecodeError

PEERS = ("openvino", "llama-server")


def parse_peers(text: str | None) -> tuple[str, ...]:
    """'openvino,llama-server' (or 'all' / None) -> the peer names.

    Raises:
        SpecDecodeError: an unknown name.
    """
    names = tuple(n.strip() for n in (text or "all").split(",") if n.strip())
    if names in ((), ("all",)):
        return PEERS
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise SpecDecodeError(f"unknown peer(s) {', '.join(unknown)}; --setup-peers takes {', '.join(PEERS)} or all")
    return names


def setup_peers(names: Sequence[str], models: Sequence[str], openvino_weights: str = "int8", status=None) -> None:
    """Set up each named peer; OpenVINO exports ``models`` (catalog names or HF directories) too.

    Raises:
        SpecDecodeError: a step failed (the command is in the message).
    """
    say = status or (lambda msg: print(f"specdecode bench --setup-peers: {msg}", file=sys.stderr, flush=True))
    if "llama-server" in names:
        say(f"llama-server ready: {llamaserver.setup(status=say)}")
    if "openvino" in names:
        dirs = openvino.setup(list(dict.fromkeys(models)), openvino_weights, status=say)
        say(f"OpenVINO peer ready: {', '.join(str(d) for d in dirs)}")
