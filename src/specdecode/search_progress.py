"""Where a layer-skip search stands (:class:`SearchProgress`) and its default display: a bar on a terminal,
lines elsewhere."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class SearchProgress:
    """Where a search stands; the ``progress`` callback of :func:`search_skip_layers` gets one after every step.

    Attributes:
        stage: ``"contexts"`` (plain decoding of the calibration prompts), ``"timing"`` (the proxy's prefill
            and timing model), ``"proxy"`` (scoring candidates), ``"measure"`` (timed runs), ``"done"``.
        done: steps finished: prompts decoded + candidates scored + timed runs.
        total: steps planned so far (revised as measured costs come in; never below ``done``).
        elapsed_s: seconds since the search began.
        eta_s: seconds left, from the measured mean cost of each kind of step (None until one is known).
        message: a line for people, when there is news (the time estimate once the first candidate is scored).
    """

    stage: str
    done: int
    total: int
    elapsed_s: float
    eta_s: float | None
    message: str = ""


def progress_reporter(progress: Callable[[SearchProgress], None] | bool | None) -> Callable[[SearchProgress], None]:
    if progress is False:
        return lambda p: None
    if progress is None or progress is True:
        return _StderrProgress()
    return progress


class _StderrProgress:
    """The default display: on a terminal a bar over the steps with the estimated time left; elsewhere the
    estimate line and a last line with the time taken."""

    LABELS = {"contexts": "decoding the calibration prompts", "timing": "timing the forward passes",
              "proxy": "scoring candidate skip sets", "measure": "timing layer-skip decoding", "done": "done"}

    def __init__(self) -> None:
        self.bar = self.task = None

    def __call__(self, p: SearchProgress) -> None:
        if self.bar is None and sys.stderr.isatty() and p.stage != "done":
            self.bar = _search_bar()
            self.bar.start()
            self.task = self.bar.add_task("", total=1, until=None)
        if p.message:
            line = f"specdecode: layer-skip search: {p.message}"
            if self.bar is not None:
                self.bar.console.print(line, markup=False, highlight=False, soft_wrap=True)
            else:
                print(line, file=sys.stderr, flush=True)
        if self.bar is not None:
            until = None if p.eta_s is None else time.monotonic() + p.eta_s  # counts down between steps
            self.bar.update(self.task, description=self.LABELS.get(p.stage, p.stage), completed=p.done,
                            total=max(1, p.total), until=until)
        if p.stage == "done":
            if self.bar is not None:
                self.bar.stop()
                self.bar = None
            print(f"specdecode: layer-skip search: {p.done} steps in {p.elapsed_s:.0f} s", file=sys.stderr,
                  flush=True)


def _search_bar():
    """A transient rich bar on stderr: stage, steps done / planned, the ETA counting down, elapsed time."""
    # lazy: rich (start-up time)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
    from rich.text import Text

    class Countdown(ProgressColumn):
        def render(self, task) -> Text:
            until = task.fields.get("until")
            return Text("ETA ?" if until is None else f"ETA {max(0.0, until - time.monotonic()):.0f} s")

    return Progress(TextColumn("layer-skip search: {task.description}"), BarColumn(bar_width=24),
                    MofNCompleteColumn(), TextColumn("steps,"), Countdown(), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=True)
