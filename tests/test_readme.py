"""README snippets run as written: every fenced code block of README.md is run or checked, by one visible rule.

The rules, in order (each block's test id names its line and what is done with it):

1. **python, a server on 127.0.0.1:8000**: run against ``specdecode serve --target smollm2-135m --port 0``,
   started here; the URL's port becomes the one the server announced.
2. **python**: run for real, in this process. A block naming a catalog model larger than SmolLM2-135M
   (Qwen2.5-Coder 0.5B / 1.5B, Gemma-3-270m) runs with ``smollm2-135m`` in its place (the text otherwise as
   written: a name left undefined, a wrong keyword or a wrong call still fails).
3. **bash**: every ``specdecode`` command in it (``\\`` continuations joined, comments and a trailing ``&``
   dropped, each ``&&`` part on its own) is parsed by the command line's own parser (``--config`` files
   applied when they exist) and checked by the drafter flags' no-model checks, but not run: they download
   models, run for minutes (bench, tune, train-drafter) or serve until stopped. Other programs (pip, python
   scripts, ray, curl) are listed as skipped.
4. Anything else: a failure, so that a new kind of block gets a rule.

Marked integration: the python blocks load SmolLM2-135M (a minute or so on 2 cores, most of it generating).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
#: Catalog models larger than SmolLM2-135M, replaced by it in python blocks (rule 2).
LARGER = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "gemma-3-270m")
SMALL = "smollm2-135m"
SERVER_URL = "http://127.0.0.1:8000"


def code_blocks(text: str) -> list[tuple[int, str, str]]:
    """(line of the opening fence, language, code) of every fenced block."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if fence:
            start, body = i + 1, []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            blocks.append((start, fence.group(1), "\n".join(body) + "\n"))
        i += 1
    return blocks


def shell_commands(code: str) -> list[list[str]]:
    """The commands of a bash block: continuations joined, comments dropped, split at ``&&``; as argv lists."""
    joined = re.sub(r"\\\n", " ", code)
    out = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            part, words = words[:cut], words[cut + 1:]
            if part and part[-1] == "&":
                part = part[:-1]
            if part:
                out.append(part)
    return out


BLOCKS = code_blocks(README.read_text(encoding="utf-8"))
PYTHON = [(line, code) for line, lang, code in BLOCKS if lang == "python"]
COMMANDS = [(line, argv) for line, lang, code in BLOCKS if lang == "bash" for argv in shell_commands(code)]


def test_every_block_has_a_rule():
    assert {lang for _, lang, _ in BLOCKS} <= {"python", "bash"}, "a README block of a new kind needs a rule here"
    assert len(PYTHON) >= 3 and len(COMMANDS) >= 20


def test_the_parser_sees_what_the_readme_says():
    """Sanity of the block reader on the README's shapes: continuations, comments, '&&', '&'."""
    cmds = shell_commands('a --x 1 \\\n    --y "two words"   # note\nb && specdecode serve --port 8 &\n')
    assert cmds == [["a", "--x", "1", "--y", "two words"], ["b"], ["specdecode", "serve", "--port", "8"]]


@pytest.mark.parametrize("line, argv", COMMANDS, ids=[f"README.md:{line} {' '.join(a)[:60]}" for line, a in COMMANDS])
def test_shell_commands_parse(line, argv):
    """Rule 3: a specdecode command parses with the flags it shows; other programs are listed as skipped."""
    from specdecode.cli import build_parser
    from specdecode.cliargs import check_drafter_flags
    from specdecode.configfile import apply_config

    if argv[0] != "specdecode":
        pytest.skip(f"rule 3: {argv[0]!r} is not a specdecode command (not run here)")
    parser = build_parser()
    rest = argv[1:]
    config = next((rest[i + 1] for i, a in enumerate(rest[:-1]) if a == "--config"), None)
    if config is not None and Path(config).is_file():
        apply_config(parser, rest)
    try:
        args = parser.parse_args(rest)
    except SystemExit as exc:  # --help
        assert exc.code == 0, f"README.md:{line}: {' '.join(argv)}"
        return
    if hasattr(args, "skip_layers") and hasattr(args, "draft_weights") and hasattr(args, "dtype"):
        check_drafter_flags(args)


# --------------------------------------------------------------------------- python blocks, run for real


def _standing_in(code: str) -> str:
    for name in LARGER:
        code = code.replace(f'"{name}"', f'"{SMALL}"')
    return code


@pytest.fixture(scope="module")
def smollm2_server():
    """``specdecode serve`` on SmolLM2-135M at a port the system chose (rule 1)."""
    from serving import serve_announcing

    proc, port, _ = serve_announcing(["--target", SMALL, "--port", "0", "--max-batch-size", "2", "--log-level",
                                      "warning"], timeout=600)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.integration
@pytest.mark.parametrize("line, code", PYTHON, ids=[f"README.md:{line}" for line, _ in PYTHON])
def test_python_blocks_run(line, code, request):
    if SERVER_URL in code:  # rule 1
        code = code.replace(SERVER_URL, request.getfixturevalue("smollm2_server"))
    code = _standing_in(code)  # rule 2
    assert not any(name in code for name in LARGER), f"README.md:{line} names a larger model another way"
    namespace: dict = {"__name__": f"readme_{line}"}
    exec(compile(code, f"README.md:{line}", "exec"), namespace)  # noqa: S102 - the README's own code
