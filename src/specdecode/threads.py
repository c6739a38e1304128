"""Torch threads on a machine other processes may share: one per core they leave idle (the command line's
default, ``SpecDecoder.from_pretrained(threads="auto")``, the server, ``tune`` and ``bench``)."""

from __future__ import annotations

import os
import time

from specdecode.validate import check_threads, usable_cores


def busy_cores(seconds: float = 0.2) -> float | None:
    """Cores other processes keep busy right now: /proc/stat sampled ``seconds`` apart (None off Linux).

    Measured before our own work starts, so it counts the others only (the 1-minute load average, by
    contrast, still counts a run that has just ended)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return idle, sum(fields)

    try:
        idle0, total0 = sample()
        time.sleep(seconds)
        idle1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    if total1 <= total0:
        return None

    cpus = os.cpu_count() or 1
    return cpus * (1.0 - (idle1 - idle0) / (total1 - total0))


def auto_threads(cores: int | None = None, busy: float | None = None, flag: str = "--threads") -> tuple[int, str | None]:
    """Threads for a machine that may be shared: one per core other processes leave idle, at least one.

    ``busy``: cores in use by others (default :func:`busy_cores`, the lower of two looks when the first finds half
    a core or more busy; else the 1-minute load average). Why:
    with a thread per core and another busy process on one of them, every parallel region waits for the
    descheduled thread, and a decoding step of hundreds of regions runs 2-20x slower (measured on 2 cores: 10-20x
    with a CPU-bound neighbour, 2-3x beside a test run). Returns (threads, a one-line note when fewer than the cores,
    else None; ``flag``: how the note names the setting, ``--threads`` or the library's ``threads=``).
    """

    if cores is None:
        cores = usable_cores()
    if busy is None:
        busy = busy_cores()
        if busy is not None and busy >= 0.5:  # busy now: a neighbour that stays, or a spike that passes (a process
            again = busy_cores(0.3)  # just ending): only what a second look still finds counts
            busy = busy if again is None else min(busy, again)
    if busy is None:
        try:
            busy = os.getloadavg()[0]
        except (AttributeError, OSError):
            busy = 0.0
    threads = max(1, min(cores, int(cores - busy + 0.5)))
    if threads == cores:
        return threads, None
    return threads, (f"{threads} torch thread{'s' if threads > 1 else ''} of {cores} cores: other processes keep "
                     f"{busy:.1f} cores busy, and threads on busy cores wait on each other ({flag}"
                     f"{'' if flag.endswith('=') else ' '}{cores} to use every core)")


def set_threads(threads: int | None, say=None, flag: str = "--threads") -> int:
    """Apply ``--threads`` (``flag``: how errors and notes name it, ``--threads`` or ``threads=``); None:
    :func:`auto_threads` (``say`` gets its note). Returns the thread count.

    Raises:
        SpecDecodeError: not a positive integer, or more than this machine's cores (:func:`check_threads`).
    """
    library = flag.endswith("=")  # threads=: SpecDecoder.from_pretrained's keyword, where None keeps torch's count
    check_threads(threads, flag.rstrip("="), auto="threads='auto'" if library else None)
    if threads is None:
        threads, note = auto_threads(flag=flag)
        if note and say is not None:
            say(note)
    import torch  # lazy: --help and argument errors answer without loading torch

    torch.set_num_threads(threads)
    return threads
