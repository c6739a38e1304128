"""Hugging Face Hub access: whether the hub can be used, its local cache when not, and loading a hub id.

The code that downloads from the hub: a hub id is fetched with ``from_pretrained`` when the hub answers,
else read from the local Hugging Face cache with every HTTP call refused.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import urllib.request
from collections.abc import Iterator
from urllib.parse import urlsplit

import torch
from huggingface_hub import constants as hub_constants
from huggingface_hub import try_to_load_from_cache
from transformers import AutoTokenizer

from specdecode.models.catalog import _catalog_hint, _guess
from specdecode.models.errors import ModelLoadError
from specdecode.models.loaded import LoadedModel, _finish, _from_pretrained
from specdecode.models.progress import _hub_download_bars

logger = logging.getLogger(__name__)

#: Seconds a TCP connect to the hub endpoint may take before the hub counts as unreachable.
HUB_CHECK_TIMEOUT_S = 1.0
_REACHABLE: dict[tuple[str, int], bool] = {}  # (host, port) -> answered; asked once per process


def hub_endpoint() -> str:
    """The Hugging Face Hub's address: ``$HF_ENDPOINT``, else https://huggingface.co."""
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def hub_reachable(timeout: float = HUB_CHECK_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the hub endpoint (or to the proxy in front of it) opens within ``timeout`` s.

    Asked once per process and address; a DNS lookup that hangs counts as unreachable after the timeout.
    """
    address = _hub_address()
    if address not in _REACHABLE:
        _REACHABLE[address] = _can_connect(address, timeout)
        logger.info("hub %s:%d reachable: %s", *address, _REACHABLE[address])
    return _REACHABLE[address]


def hub_offline_reason() -> str | None:
    """Why hub ids must be read from the local cache only (a clause for messages), or None when the hub can be used.

    ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` (read at call time) decide without a network call;
    otherwise :func:`hub_reachable` does.
    """
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"the Hugging Face Hub is switched off ({var} is set)"
    if not hub_reachable():
        return (f"the Hugging Face Hub cannot be reached ({hub_endpoint()} did not answer within "
                f"{HUB_CHECK_TIMEOUT_S:g} s)")
    return None


@contextlib.contextmanager
def hub_access(spec: str) -> Iterator[bool]:
    """How a hub id is read; yields ``local_files_only`` for ``from_pretrained``.

    Online: yields False (downloads allowed). Offline or unreachable (:func:`hub_offline_reason`): an id
    missing from the local Hugging Face cache fails at once; a cached one is read with huggingface_hub in
    offline mode (every HTTP call refused), so nothing waits on network retries.

    Raises:
        ModelLoadError: the hub cannot be used and ``spec`` is not in the local Hugging Face cache; the message
            says why and what to pass instead.
    """
    reason = hub_offline_reason()
    if reason is None:
        yield False
        return
    if not _in_hf_cache(spec):
        raise ModelLoadError(_hub_missing_message(spec, reason))

    was = hub_constants.HF_HUB_OFFLINE
    hub_constants.HF_HUB_OFFLINE = True
    try:
        yield True
    finally:
        hub_constants.HF_HUB_OFFLINE = was


def _hub_address() -> tuple[str, int]:
    """(host, port) a hub request connects to first: the endpoint's, or its proxy's (``https_proxy`` ...)."""
    url = urlsplit(hub_endpoint())
    proxies = urllib.request.getproxies()
    proxy = proxies.get(url.scheme) or proxies.get("all")
    if proxy and not urllib.request.proxy_bypass(url.hostname or ""):
        url = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    return url.hostname or "", url.port or (443 if url.scheme == "https" else 80)


def _can_connect(address: tuple[str, int], timeout: float) -> bool:
    """One TCP connect in a daemon thread (so a hanging DNS lookup is bounded too); True when it opened."""
    opened: list[bool] = []

    def attempt() -> None:
        try:
            socket.create_connection(address, timeout=timeout).close()
            opened.append(True)
        except OSError:
            opened.append(False)

    worker = threading.Thread(target=attempt, name="specdecode-hub-check", daemon=True)
    worker.start()
    worker.join(timeout + 0.25)
    return bool(opened) and opened[0]


def _in_hf_cache(spec: str) -> bool:
    """True when the local Hugging Face cache holds ``spec``'s config.json (no network call)."""
    try:
        return isinstance(try_to_load_from_cache(spec, "config.json"), str)
    except Exception:  # noqa: BLE001 - an id the hub would refuse (bad characters) is not cached either
        return False


def _hub_missing_message(spec: str, reason: str) -> str:
    return (
        f"could not load {spec!r}: it is not a named offline model or an existing local path; {reason}, "
        f"and {spec!r} is not in the local Hugging Face cache ({hub_constants.HF_HUB_CACHE}).{_guess(spec)} "
        f"Pass a local model directory, a .gguf file or a named offline model instead. {_catalog_hint()}"
    )


def _load_hub(spec: str, dtype: torch.dtype, progress: bool) -> LoadedModel:
    """``from_pretrained`` from the Hugging Face Hub, or from its local cache when the hub is off or unreachable
    (:func:`hub_access`: then an id that is not cached fails at once, with no network retries)."""
    with hub_access(spec) as offline:
        logger.info("loading %r from the Hugging Face Hub (offline=%s)", spec, offline)
        if progress and not offline:
            print(f"specdecode: fetching {spec!r} from {hub_endpoint()} (or the local Hugging Face cache)",
                  file=sys.stderr, flush=True)
        try:
            with _hub_download_bars(progress and not offline):
                model = _from_pretrained(spec, spec, dtype=dtype, local_files_only=offline)
                tokenizer = AutoTokenizer.from_pretrained(spec, local_files_only=offline)
        except Exception as exc:  # noqa: BLE001
            raise ModelLoadError(_hub_failure_message(spec, exc)) from exc
    return LoadedModel(_finish(model, dtype), tokenizer, spec, spec)


def _hub_failure_message(spec: str, exc: Exception) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (
        f"could not load {spec!r}: it is not a named offline model or an existing local path, and "
        f"the Hugging Face Hub cannot be reached or has no such model id ({type(exc).__name__}: {first})."
        f"{_guess(spec)} {_catalog_hint()}"
    )
