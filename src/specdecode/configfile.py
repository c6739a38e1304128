"""The settings file: ``--config FILE`` of ``generate``, ``bench`` and ``serve``, and what ``specdecode tune`` writes.

A TOML file (read with the standard library's ``tomllib``):

- top-level keys: settings of ``specdecode generate`` and ``specdecode serve`` (their shared drafter and
  precision flags: ``target``, ``draft``, ``num_speculative_tokens``, ``policy``, ``weights``, ``threads``, ...;
  a top-level key only one of them takes, such as ``port``, is that command's and the other skips it);
- a ``[generate]``, ``[serve]`` or ``[bench]`` table: settings of that command only (they override the
  top level). ``bench`` reads only its own table: its ``--draft`` names a draft model and its
  ``--methods`` are method specs, so the top-level drafter keys would mean something else there;
- a ``[tune]`` table: what ``specdecode tune`` measured (read by no command).

A key is a flag's name without the leading dashes, with ``-`` or ``_`` (``max-new-tokens`` =
``max_new_tokens``; ``num_speculative_tokens`` is ``-k``). The file's settings become the command's
defaults, so every flag given on the command line overrides them (argparse ``set_defaults`` before
the parse). Values are checked as the flag checks its text: the type, the choices; a switch takes
``true`` / ``false``. An unknown key or a bad value is refused in one line naming the key and the file.

This module stays light (argparse and tomllib only): the command line applies it before importing torch.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import re
import sys
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path

from specdecode.errors import SpecDecodeError

#: Commands that take ``--config FILE``.
CONFIG_COMMANDS = ("generate", "bench", "serve")
#: Commands that read the file's top-level keys (``bench`` reads only its ``[bench]`` table).
TOP_LEVEL_COMMANDS = ("generate", "serve")
#: The table of measurements ``specdecode tune`` writes; no command reads it.
METADATA_TABLE = "tune"
#: Destinations no file may set.
_RESERVED = {"help", "version", "func", "command", "config"}


def add_config_argument(p: argparse.ArgumentParser) -> None:
    """Add ``--config FILE`` to a subcommand's parser (applied by :func:`apply_config` before the parse)."""
    p.add_argument("--config", metavar="FILE",
                   help="a TOML settings file (what 'specdecode tune' writes): its settings become the defaults and "
                        "flags given here override them. Top-level keys are generate / serve settings, a "
                        "[generate] / [serve] / [bench] table holds one command's own; keys are flag names "
                        "(num_speculative_tokens, weights, threads, ...)")


def read_config(path: str | Path) -> dict:
    """The parsed TOML file.

    Raises:
        SpecDecodeError: no such file, unreadable, or not valid TOML (line and column said).
    """
    file = Path(path).expanduser()
    if file.is_dir():
        raise SpecDecodeError(f"--config {path}: is a folder; give the TOML file (e.g. what 'specdecode tune' wrote)")
    if not file.is_file():
        raise SpecDecodeError(f"--config {path}: no such file")
    try:
        with file.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise SpecDecodeError(f"--config {path}: not valid TOML: {exc}") from None
    except OSError as exc:
        raise SpecDecodeError(f"--config {path}: cannot read it: {exc}") from None


def command_settings(data: Mapping, command: str, path: str | Path = "FILE") -> dict:
    """The raw settings a command takes from a parsed file: the top-level keys (generate, serve), then its table.

    Raises:
        SpecDecodeError: a table that is not a table, or a table of another kind than the known ones.
    """
    out: dict = {}
    for key, value in data.items():
        if isinstance(value, dict):
            if key not in (*CONFIG_COMMANDS, METADATA_TABLE):
                raise SpecDecodeError(f"--config {path}: unknown table [{key}]; the file may hold "
                                      f"[{'], ['.join(CONFIG_COMMANDS)}] and [{METADATA_TABLE}]")
            continue
        if command in TOP_LEVEL_COMMANDS:
            out[key] = value
    table = data.get(command, {})
    if not isinstance(table, dict):
        raise SpecDecodeError(f"--config {path}: {command!r} must be a table ([{command}])")
    out.update(table)
    return out


class Settings(dict):
    """{dest: value} for ``parser.set_defaults``, with ``written``: {dest: the key as the file wrote it} (``gamma``
    for ``num_speculative_tokens``), so that a message about a setting names it as the user wrote it."""

    def __init__(self) -> None:
        super().__init__()
        self.written: dict[str, str] = {}

    def merge(self, other: "Settings") -> "Settings":
        """``other``'s settings over these, setting by setting (a command's table over the top level, whatever
        name each gave a setting)."""
        self.update(other)
        self.written.update(other.written)
        return self


def check_settings(parser: argparse.ArgumentParser, settings: Mapping, command: str,
                   path: str | Path = "FILE") -> Settings:
    """Settings checked against a subcommand's flags, as {dest: value} for ``parser.set_defaults`` (a
    :class:`Settings`: also the key each came from).

    Raises:
        SpecDecodeError: an unknown key (close names suggested), two keys for one setting (``gamma`` and
            ``num_speculative_tokens``), or a value of the wrong type or outside the flag's choices; the message
            names the key, the command and the file.
    """
    actions: dict[str, argparse.Action] = {}
    for a in parser._actions:  # per destination, the flag that takes a value (serve: --policy, not --adaptive)
        if a.dest in _RESERVED or a.dest == argparse.SUPPRESS:
            continue
        if a.dest not in actions or (isinstance(actions[a.dest], argparse._StoreConstAction)
                                     and not isinstance(a, argparse._StoreConstAction)):
            actions[a.dest] = a
    flags: dict[str, argparse.Action] = {}
    for a in parser._actions:
        if a.dest in actions:
            for opt in a.option_strings:
                if opt.startswith("--"):
                    flags[opt[2:].replace("-", "_")] = a
    out = Settings()

    def put(action: argparse.Action, key, value) -> None:
        if action.dest in out.written:
            raise SpecDecodeError(f"--config {path}: keys {out.written[action.dest]!r} and {key!r} both set "
                                  f"{'/'.join(action.option_strings)} for 'specdecode {command}'; keep one")
        out[action.dest] = value
        out.written[action.dest] = str(key)

    for key, value in settings.items():
        name = str(key).replace("-", "_")
        action = actions.get(name) or flags.get(name)
        if action is None:
            known = sorted(actions)
            close = difflib.get_close_matches(name, sorted(set(actions) | set(flags)), n=3)
            hint = f"; did you mean {' or '.join(close)}?" if close else f"; known keys: {', '.join(known)}"
            raise SpecDecodeError(f"--config {path}: unknown key {key!r} for 'specdecode {command}'{hint}")
        where = f"--config {path}: key {key!r} of 'specdecode {command}'"
        by_flag = name not in actions
        if by_flag and isinstance(action, argparse._StoreConstAction) and not isinstance(
                action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if not isinstance(value, bool):  # a flag like bench's --quick: true gives it
                raise SpecDecodeError(f"{where} is a switch: write true or false, not {_show(value)}")
            if value:
                put(action, key, action.const)
            continue
        if by_flag and isinstance(action, argparse.BooleanOptionalAction) and name.startswith("no_"):
            if not isinstance(value, bool):
                raise SpecDecodeError(f"{where} is a switch: write true or false, not {_show(value)}")
            put(action, key, not value)  # no-chat = true is chat = false
            continue
        put(action, key, _check_value(parser, action, value, where))
    return out


def _check_value(parser: argparse.ArgumentParser, action: argparse.Action, value, where: str):
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)):
        if not isinstance(value, bool):
            raise SpecDecodeError(f"{where} is a switch: write true or false, not {_show(value)}")
        return value
    if isinstance(action, argparse._StoreConstAction):  # the destination of flags like --quick / --smoke
        consts = [a.const for a in parser._actions if a.dest == action.dest and
                  isinstance(a, argparse._StoreConstAction)]
        if value not in consts:
            raise SpecDecodeError(f"{where} must be one of {', '.join(map(repr, consts))}, got {_show(value)}")
        return value
    if isinstance(action, argparse._AppendAction) or action.nargs in ("*", "+"):
        items = value if isinstance(value, list) else [value]
        return [_one(action, v, where) for v in items]
    if isinstance(value, (list, dict)):
        raise SpecDecodeError(f"{where} takes one value, got {_show(value)}")
    return _one(action, value, where)


def _one(action: argparse.Action, value, where: str):
    """One value as the flag's ``type`` makes it from text, then checked against its ``choices``."""
    kind = action.type
    if isinstance(value, bool) and kind in (int, float, None, str):
        raise SpecDecodeError(f"{where} must be {_kind_name(kind)}, not {_show(value)}")
    if kind is int:
        if not isinstance(value, int):
            raise SpecDecodeError(f"{where} must be an integer, got {_show(value)}")
    elif kind is float:
        if not isinstance(value, (int, float)) or math.isnan(float(value)):
            raise SpecDecodeError(f"{where} must be a number, got {_show(value)}")
        value = float(value)
    elif kind is None or kind is str:
        if not isinstance(value, str):
            raise SpecDecodeError(f"{where} must be a string, got {_show(value)}")
    else:  # a custom type (e.g. --logit-bias TOKEN=BIAS): it reads the text the flag would get
        try:
            value = kind(str(value))
        except (argparse.ArgumentTypeError, TypeError, ValueError) as exc:
            raise SpecDecodeError(f"{where}: {exc}") from None
    if action.choices is not None and value not in action.choices:
        raise SpecDecodeError(f"{where} must be one of {', '.join(map(str, action.choices))}, got {_show(value)}")
    return value


def _kind_name(kind) -> str:
    return {int: "an integer", float: "a number"}.get(kind, "a string")


def _show(value) -> str:
    return json.dumps(value) if isinstance(value, (str, bool, list, dict)) else repr(value)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def config_path_in(argv: Sequence[str]) -> str | None:
    """The FILE of ``--config FILE`` / ``--config=FILE`` in an argument list (the last one given), else None.

    Raises:
        SpecDecodeError: ``--config`` last, with no file after it.
    """
    found = None
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == "--config":
            if i + 1 >= len(argv):
                raise SpecDecodeError("--config needs a FILE")
            found = argv[i + 1]
        elif arg.startswith("--config="):
            found = arg.partition("=")[2]
    return found


def apply_config(parser: argparse.ArgumentParser, argv: Sequence[str]) -> dict:
    """When ``argv`` runs a command with ``--config FILE``: that command's parser gets the file's settings as
    defaults (so the flags of ``argv`` override them). Returns the settings applied ({} without a file).

    Raises:
        SpecDecodeError: as :func:`read_config`, :func:`command_settings`, :func:`check_settings`.
    """
    commands = _subparsers(parser)
    command = next((a for a in argv if not a.startswith("-")), None)
    if command not in commands or command not in CONFIG_COMMANDS:
        return {}
    rest = list(argv[list(argv).index(command) + 1:])
    path = config_path_in(rest)
    if path is None:
        return {}
    sub = commands[command]
    data = read_config(path)
    command_settings(data, command, path)  # (the tables' checks)
    own = data.get(command, {})
    top = {k: v for k, v in data.items() if not isinstance(v, dict)} if command in TOP_LEVEL_COMMANDS else {}
    others = [commands[c] for c in TOP_LEVEL_COMMANDS if c != command and c in commands]
    mine = _key_names(sub)
    skipped = []
    for key in list(top):  # a top-level key only the other command takes is the other's
        name = str(key).replace("-", "_")
        if name not in mine and any(name in _key_names(o) for o in others):
            del top[key]
            skipped.append(str(key))
    # the top level, then the command's table over it setting by setting (gamma at the top, num_speculative_tokens
    # in [generate]: the table's)
    settings = check_settings(sub, top, command, path).merge(check_settings(sub, own, command, path))
    if skipped:  # said, not silent: a key meant for this command under another name would otherwise go unnoticed
        other = " / ".join(c for c in TOP_LEVEL_COMMANDS if c != command)
        print(f"specdecode: --config {path}: top-level {', '.join(skipped)}: 'specdecode {other}' settings, skipped "
              f"by 'specdecode {command}' (see its --help for its own names)", file=sys.stderr)
    sub.set_defaults(**settings)
    return settings


def config_origin(parser: argparse.ArgumentParser, argv: Sequence[str], args: argparse.Namespace | None,
                  settings: Mapping, message: str) -> str:
    """Where an error came from when its subject is a setting ``--config`` gave: " (set by --config FILE: key =
    value)" when the first flag ``message`` names is one the file set and no flag of ``argv`` gave (in whatever
    form argparse reads: ``-k0``, ``--num-spec 0``, ``--gamma=0``), else "".

    Args:
        parser: the command line's parser; argv: the command line; args: what it parsed (None: parsing failed,
        nothing is said); settings: what :func:`apply_config` applied; message: the error's text.
    """
    if not settings or args is None:
        return ""
    command = getattr(args, "command", None)
    sub = _subparsers(parser).get(command)
    if sub is None:
        return ""
    by_flag = {opt: a for a in sub._actions for opt in a.option_strings if opt.startswith("--")}
    subject = next((by_flag[f] for f in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*(?![\w-])", message) if f in by_flag),
                   None)
    if subject is None or subject.dest not in settings or subject.dest in _given(sub, argv, command):
        return ""
    key = getattr(settings, "written", {}).get(subject.dest, subject.dest)
    return f" (set by --config {getattr(args, 'config', None)}: {key} = {_show(settings[subject.dest])})"


def _given(sub: argparse.ArgumentParser, argv: Sequence[str], command: str) -> set[str]:
    """The destinations a command's flags in ``argv`` set (argparse parses them again with every default a marker);
    every destination when that parse fails (nothing is then blamed on a file)."""
    rest = list(argv)[list(argv).index(command) + 1:] if command in argv else list(argv)
    marker = object()
    saved = [(a, a.default) for a in sub._actions]
    defaults = dict(sub._defaults)
    try:
        for a in sub._actions:
            a.default = marker
        sub._defaults.clear()
        ns, _ = sub.parse_known_args(rest)
        return {d for d, v in vars(ns).items() if v is not marker}
    except (Exception, SystemExit):
        return {a.dest for a in sub._actions}
    finally:
        for a, d in saved:
            a.default = d
        sub._defaults.update(defaults)


def _key_names(parser: argparse.ArgumentParser) -> set[str]:
    """The keys a settings file may give ``parser``'s command: its destinations and long flag names (- as _)."""
    names = {a.dest for a in parser._actions if a.dest not in _RESERVED and a.dest != argparse.SUPPRESS}
    for a in parser._actions:
        if a.dest in names:
            names.update(opt[2:].replace("-", "_") for opt in a.option_strings if opt.startswith("--"))
    return names


def parse_with_config(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)`` after :func:`apply_config`: what a command runs with (tests use it)."""
    apply_config(parser, argv)
    return parser.parse_args(list(argv))


# --------------------------------------------------------------------------- writing (specdecode tune)


def toml_value(value) -> str:
    """One TOML value: strings (JSON escapes are TOML escapes), booleans, integers, finite floats, arrays
    of those, inline tables.

    Raises:
        ValueError: a value TOML cannot hold (None, NaN, another type).
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"TOML has no value for {value!r}")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {toml_value(v)}" for k, v in value.items() if v is not None) + "}"
    raise ValueError(f"TOML has no value for {value!r} ({type(value).__name__})")


def _toml_key(key: str) -> str:
    bare = key.replace("_", "").replace("-", "").isalnum() and key.isascii()
    return key if bare else json.dumps(key)


def write_toml(path: str | Path, settings: Mapping, tables: Mapping[str, Mapping] = (), *,
               comments: Sequence[str] = (), arrays: Mapping[str, Sequence[Mapping]] = ()) -> Path:
    """Write a settings file: ``comments`` (one ``#`` line each) first, then the top-level ``settings``, then each
    table, then arrays of tables (``[[name]]``). Keys whose value is None are left out.

    Returns:
        the path written.
    """
    lines = [f"# {c}" if c else "#" for c in comments]
    if lines:
        lines.append("")
    lines += [f"{_toml_key(k)} = {toml_value(v)}" for k, v in settings.items() if v is not None]
    for name, table in dict(tables).items():
        lines += ["", f"[{name}]"] + [f"{_toml_key(k)} = {toml_value(v)}" for k, v in table.items() if v is not None]
    for name, rows in dict(arrays).items():
        for row in rows:
            lines += ["", f"[[{name}]]"] + [f"{_toml_key(k)} = {toml_value(v)}" for k, v in row.items()
                                            if v is not None]
    file = Path(path).expanduser()
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return file


__all__ = ["CONFIG_COMMANDS", "METADATA_TABLE", "TOP_LEVEL_COMMANDS", "add_config_argument", "apply_config",
           "config_origin",
           "check_settings", "command_settings", "config_path_in", "parse_with_config", "read_config",
           "toml_value", "write_toml"]
