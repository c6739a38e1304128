"""A helper for tests that start ``specdecode serve`` in its own process and need the port it announced."""

from __future__ import annotations

import re
import subprocess
import sys
import threading


def serve_announcing(argv: list[str], timeout: float = 120.0) -> tuple[subprocess.Popen, int, str]:
    """Start ``specdecode serve ARGV`` in its own process and read stderr until the 'serving ... at URL' line:
    (the process, the announced port, that line). The process is killed after ``timeout`` seconds."""
    cmd = [sys.executable, "-m", "specdecode.cli", "serve", *argv]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        seen = []
        for line in proc.stderr:
            seen.append(line)
            found = re.search(r"specdecode: serving .* at http://\S+:(\d+)/v1", line)
            if found:  # keep reading stderr, so the server never blocks on a full pipe
                threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
                return proc, int(found.group(1)), line
        raise AssertionError("no 'serving ... at' line: " + "".join(seen))
    finally:
        timer.cancel()
