"""Output paths checked before the work: one rule for every command that writes files.

``audit --output``, ``bench --output``, ``tune --output`` and ``train-drafter --out`` / ``--work-dir`` run
for minutes to an hour before they write; a path that cannot be written must be refused before any of
that, in one line, not met as a traceback at the end. The rule, the same everywhere:

- the place is **probed for real**, not judged from permission bits (``os.access`` says yes to root on a
  read-only mount, under ``/proc``, ...): the folder is made if missing, a probe file is created in it
  (a file output: the file itself) and removed, and whatever the probe made is removed again, so a refused
  run (or a checked one) leaves nothing behind;
- a path the user names may be new, but **its parent folder must exist**: a typo in a parent is refused,
  not silently created (``mkdir -p``). A default path of the program's own (under the cache, or
  ``bench-out/PRESET``) may create its missing parents (``default=True``);
- an output folder must not be a file, an output file must not be a folder, and an empty path is no path
  (``Path("")`` would be the current folder).

Only the standard library is imported here (the command line checks before importing torch).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import tempfile
from pathlib import Path

from specdecode.errors import SpecDecodeError


class OutputPathError(SpecDecodeError):
    """An output path that cannot be written; the message names the flag, the path and what to do."""


def check_output_dir(path: str | os.PathLike, flag: str, *, default: bool = False) -> Path:
    """Refuse an output folder that cannot be written, before any work (nothing is left behind).

    Args:
        path: the folder (it may exist, or be made by the command).
        flag: the option that named it, for the message (``"--output"``).
        default: the program chose the path (its missing parents may be made); False: the user named it
            (its parent folder must exist).

    Returns:
        the folder, ``~`` expanded.

    Raises:
        OutputPathError: it is empty; it is a file; its parent does not exist (``default`` False) or is a file; writing a
            file in it fails (read-only file system, no permission, a name too long, ``/proc``, ...).
    """
    folder = Path(_not_empty(path, flag)).expanduser()
    try:
        if folder.exists() and not folder.is_dir():
            raise OutputPathError(f"{flag} {path}: is a file, not a folder; give a folder")
        _check_parent(folder, path, flag, default)
        with _made(folder):
            fd, probe = tempfile.mkstemp(dir=folder, prefix=".specdecode-probe-")
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        raise OutputPathError(f"{flag} {path}: cannot write there ({_why(exc)}); choose a writable folder") from None
    return folder


def check_cache_dir(cache_dir: str | os.PathLike | None = None) -> None:
    """A cache folder the user named (``cache_dir`` / ``--cache-dir``, or ``SPECDECODE_CACHE``) can be had, before
    any slow work: it exists (it may be read-only and hold everything already), or it can be made (missing parents
    too, as the cache makes them). A file there, an empty name, or a place nothing can be made (``/proc``) is
    refused here instead of after hashing and compiling. The default ``~/.cache/specdecode`` is not checked (a run
    that writes nothing there needs none).

    Raises:
        OutputPathError: as above; the message names the setting.
    """
    env = os.environ.get("SPECDECODE_CACHE")
    given = cache_dir if cache_dir is not None else env
    if given is None:
        return
    flag = "the cache folder (cache_dir / --cache-dir)" if cache_dir is not None else "SPECDECODE_CACHE"
    folder = Path(_not_empty(given, flag)).expanduser()
    if folder.is_dir():
        return
    check_output_dir(folder, flag, default=True)


def check_output_file(path: str | os.PathLike, flag: str, *, default: bool = False) -> Path:
    """Refuse an output file that cannot be written, before any work (an existing file is left as it is).

    Args:
        path: the file (it may exist: it will be replaced).
        flag: the option that named it. default: as :func:`check_output_dir`.

    Returns:
        the file, ``~`` expanded.

    Raises:
        OutputPathError: it is empty; it is a folder; its folder does not exist (``default`` False) or is a file; it cannot
            be created or opened for writing.
    """
    file = Path(_not_empty(path, flag)).expanduser()
    try:
        if file.is_dir():
            raise OutputPathError(f"{flag} {path}: is a folder; give a file name, e.g. "
                                  f"{file / 'specdecode-tune.toml'}")
        _check_parent(file, path, flag, default)
        if file.exists():
            with open(file, "ab"):  # opened for writing, nothing written: contents and times stay
                pass
        else:
            with _made(file.parent):
                fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                os.close(fd)
                os.unlink(file)
    except OSError as exc:
        raise OutputPathError(f"{flag} {path}: cannot write it ({_why(exc)}); choose a writable place") from None
    return file


def _not_empty(path, flag: str):
    """``path`` unless it is empty (``Path("")`` is the current folder: an empty flag would write there)."""
    if not str(path).strip():
        raise OutputPathError(f"{flag} is empty; give a path (for the current folder: .)")
    return path


def _check_parent(path: Path, given, flag: str, default: bool) -> None:
    """The nearest existing ancestor of ``path`` is a folder; a user's path has its parent already."""
    parent = path.parent
    existing = parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise OutputPathError(f"{flag} {given}: {existing} is a file, not a folder; choose another place")
    if not default and not parent.exists():
        raise OutputPathError(f"{flag} {given}: the folder {parent} does not exist; create it first, or choose "
                              "another place")


@contextlib.contextmanager
def _made(folder: Path):
    """Make ``folder`` and its missing parents for the duration of the block, then remove what was made."""
    made = []
    missing, p = [], folder
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    try:
        for d in reversed(missing):
            d.mkdir()
            made.append(d)
        yield folder
    finally:
        for d in reversed(made):
            with contextlib.suppress(OSError):
                d.rmdir()


@contextlib.contextmanager
def removed_if_left_empty(folder: str | os.PathLike):
    """Run the block; if it raises, remove ``folder`` and those of its parents that did not exist before it,
    where they are still empty: a command that fails leaves no empty output folder behind (one that wrote a
    file keeps it, with what was written)."""
    missing, p = [], Path(folder).expanduser()
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    try:
        yield
    except BaseException:
        for d in missing:  # the folder first, then its parents
            with contextlib.suppress(OSError):
                d.rmdir()
        raise


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc)


def installed_package_dir(module: str) -> Path | None:
    """Folder of an installed top-level package, found without importing (running) it; None if not installed."""
    importlib.invalidate_caches()
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


__all__ = ["OutputPathError", "check_output_dir", "check_output_file", "installed_package_dir"]
