"""Progress on stderr while models load: spinners, byte bars with an ETA, and Hugging Face's own output off."""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import time
from collections.abc import Callable, Iterator

import transformers
from huggingface_hub import constants as hub_constants
from huggingface_hub import utils as hub_utils
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    SpinnerColumn,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

logger = logging.getLogger(__name__)

@contextlib.contextmanager
def _status(message: str, enabled: bool) -> Iterator[None]:
    """A spinner with elapsed seconds on stderr while a slow step runs (on a terminal only: elsewhere rich
    would leave a blank line); logs the duration."""
    start = time.perf_counter()
    if enabled and sys.stderr.isatty():
        columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
        with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
            bar.add_task(message, total=None)
            yield
    else:
        yield
    elapsed = time.perf_counter() - start
    logger.info("%s: %.1f s", message, elapsed)
    if enabled:
        print(f"specdecode: {message}: done in {elapsed:.1f} s", file=sys.stderr)


#: A progress callback: the cumulative count (bytes) done so far, called with non-decreasing values.
ProgressFn = Callable[[int], None]


def _rich_progress(kind: str = "bytes"):
    """A transient rich ``Progress`` on stderr: ``"bytes"`` columns (done / total, speed, ETA) or ``"percent"``."""
    amount = (DownloadColumn(), TransferSpeedColumn()) if kind == "bytes" else (TaskProgressColumn(),)
    columns = (TextColumn("{task.description}"), BarColumn(bar_width=30), *amount, TextColumn("ETA"),
               TimeRemainingColumn(), TimeElapsedColumn(), TextColumn("{task.fields[detail]}"))
    return Progress(*columns, console=Console(stderr=True), transient=True)


@contextlib.contextmanager
def _bar(message: str, total: int, enabled: bool, report: ProgressFn | None = None) -> Iterator[Callable[..., None]]:
    """A bar with bytes done / ``total``, speed and ETA on stderr while a step moving ``total`` bytes runs.

    Yields ``update(done, detail="")`` (cumulative bytes, a short note such as the tensor name), which also
    calls ``report(done)``; logs the duration and, when ``enabled``, prints it with the throughput.
    """
    start = time.perf_counter()
    bar = task = None

    def update(done: int, detail: str = "") -> None:
        if report is not None:
            report(done)
        if bar is not None:
            bar.update(task, completed=done, detail=detail)

    if enabled and sys.stderr.isatty():  # as _status: elsewhere rich would leave blank lines
        with _rich_progress() as bar:
            task = bar.add_task(message, total=max(1, total), detail="")
            yield update
    else:
        yield update
    elapsed = time.perf_counter() - start
    rate = f", {total / elapsed / 1e6:.0f} MB/s" if elapsed > 0 else ""
    logger.info("%s: %.1f s%s", message, elapsed, rate)
    if enabled:
        print(f"specdecode: {message}: done in {elapsed:.1f} s{rate}", file=sys.stderr)


@contextlib.contextmanager
def _hf_bars(enabled: bool) -> Iterator[None]:
    """Turn transformers' own progress bars ("Loading weights") off while loading when ``enabled`` is False."""
    hf_logging = transformers.utils.logging
    was_enabled = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled and not enabled:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def quiet_hf_output() -> Iterator[None]:
    """Hugging Face's own output off while we read models; the previous settings come back after.

    transformers: logging at ERROR (no "generation flags are not valid", tokenizer or loading warnings;
    errors still show) and no progress bars ("Loading weights"); huggingface_hub: no progress bars (a hub
    download turns its bars back on: :func:`_hub_download_bars`). Our own status lines say what happens.
    """
    hf_logging = transformers.utils.logging
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hub_bars_off = hub_utils.are_progress_bars_disabled() or hub_constants.HF_HUB_DISABLE_PROGRESS_BARS is False
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if not hub_bars_off:  # HF_HUB_DISABLE_PROGRESS_BARS=0: the user asked for them
        hub_utils.disable_progress_bars()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
        if not hub_bars_off:
            hub_utils.enable_progress_bars()


@contextlib.contextmanager
def _hub_download_bars(enabled: bool) -> Iterator[None]:
    """huggingface_hub's download bars on inside :func:`quiet_hf_output` while a hub model downloads (a real
    download of gigabytes needs its bytes shown), unless ``HF_HUB_DISABLE_PROGRESS_BARS`` says otherwise."""
    turn_on = enabled and hub_utils.are_progress_bars_disabled() and not hub_constants.HF_HUB_DISABLE_PROGRESS_BARS
    if turn_on:
        hub_utils.enable_progress_bars()
    try:
        yield
    finally:
        if turn_on:
            hub_utils.disable_progress_bars()


@contextlib.contextmanager
def _quiet_gguf_tqdm() -> Iterator[None]:
    """Silence transformers' own GGUF tqdm bar (it would garble the spinner line)."""
    module = sys.modules.get("transformers.modeling_gguf_pytorch_utils")
    if module is None:
        with contextlib.suppress(ImportError):
            module = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    original = getattr(module, "tqdm", None)
    if original is None:
        yield
        return

    def quiet(*args, **kwargs):
        kwargs["disable"] = True
        return original(*args, **kwargs)

    module.tqdm = quiet
    try:
        yield
    finally:
        module.tqdm = original
