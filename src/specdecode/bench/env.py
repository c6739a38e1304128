"""Facts about the machine and software a benchmark ran on (DESIGN.md rule 10: state the machine)."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
import sys
from pathlib import Path

from specdecode import __version__
from specdecode.validate import usable_cores  # (re-exported: bench.env.usable_cores)


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``, else ``platform.processor()``), or 'unknown'."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> list[str]:
    """The SIMD flags that decide CPU matmul speed (avx2, avx512f, amx...), as /proc/cpuinfo lists them."""
    wanted = ("avx2", "avx_vnni", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "fma", "f16c")
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in wanted if f in have]
    except OSError:
        pass
    return []


def memory_gib() -> float | None:
    """Total RAM in GiB from ``/proc/meminfo``, None where unavailable."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError):
        pass
    return None


def git_commit(start: Path | None = None) -> str | None:
    """The project's git commit (with ``+dirty`` when the tree has changes), None outside a checkout."""
    where = start or Path(__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=5)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                               capture_output=True, text=True, timeout=5)
        return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict:
    """Machine, software and thread facts as a JSON-ready dict (date in UTC, ISO 8601)."""
    # lazy: these pull in torch, transformers (start-up time)
    import torch
    import transformers

    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cpu_count": os.cpu_count(),
        "usable_cores": usable_cores(),
        "memory_gib": memory_gib(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "specdecode": __version__,
        "git_commit": git_commit(),
        "lowbit_kernel": _lowbit_kernel(),
    }


def _lowbit_kernel() -> str:
    """Which low-bit kernel variant ran (``lowbit.kernel_status``), or that none was loaded."""
    # lazy: specdecode.lowbit pulls in torch (start-up time)
    from specdecode.lowbit import kernel_status

    return kernel_status()


def describe(env: dict) -> str:
    """One line for report headers: 'AMD EPYC, 2 cores (2 torch threads), 24 GiB; torch 2.x, transformers 5.x'."""
    mem = f", {env['memory_gib']:g} GiB" if env.get("memory_gib") else ""
    kernel = env.get("lowbit_kernel") or ""
    kernel = f"; low-bit products: {kernel}" if kernel and kernel != "not loaded yet" else ""
    return (f"{env['cpu_model']}, {env['usable_cores']} cores ({env['torch_threads']} torch threads){mem}; "
            f"torch {env['torch']}, transformers {env['transformers']}, Python {env['python']}{kernel}")
