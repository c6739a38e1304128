"""The ``specdecode`` command line.

Subcommands (one function each, so more can join: ``bench``, ``serve``):

- ``specdecode generate``: generate text for a prompt, a prompt file or a prompt set,
  streaming the text, then the speculative-decoding metrics; ``--compare-baseline``
  also runs plain decoding of the same target through the same engine.
- ``specdecode audit``: test that an OpenAI-compatible endpoint (or this engine in-process) samples the
  target's exact distribution (``specdecode.audit``); exit status 0 PASS, 1 FAIL.

Status and progress go to stderr, results to stdout (``--json``: one object per
prompt per line). User errors print one ``error: ...`` line and exit with status 2.

This module holds the parser, ``serve`` and ``bench`` and the entry point; ``cli_generate`` holds ``generate``
(and the prompt reading ``audit`` shares), ``cli_commands`` the flags and runs of ``audit``, ``train-drafter``
and ``tune``. Building the parser and every check that needs no model import neither torch nor the
server stack (``cliargs``, ``options``, ``errors`` and ``bench/__init__`` are light): a
command imports what it runs when it runs.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from collections.abc import Sequence

from specdecode import __version__
from specdecode.cli_commands import add_audit, add_train_drafter, add_tune
from specdecode.cli_generate import (  # noqa: F401 - re-exported: generate's command and its prompt reading
    DEFAULT_DATASET,
    FALLBACK_DATASET,
    cmd_generate,
    naming_flags,
    read_jobs,
    read_prompt_file,
)
from specdecode.cliargs import HelpFormatter as _HelpFormatter
from specdecode.cliargs import UsageError
from specdecode.cliargs import (
    add_drafter_arguments,
    add_sampling_arguments,
    add_serve_arguments,
    check_drafter_flags,
    check_threads,
)
from specdecode.configfile import add_config_argument, apply_config, config_origin
from specdecode.errors import SpecDecodeError
from specdecode.options import CATALOG_MODELS, DEFAULT_TARGET
from specdecode.spec import DrafterSpec
from specdecode.validate import check_serve_options  # the library's own check, without torch
from specdecode.bench import add_arguments
from specdecode.bench import run_command

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting, so ``main`` prints one line."""

    def error(self, message: str):  # noqa: D401 - argparse API
        if "not allowed with argument" in message:  # mutually exclusive flags
            message += ": give one of the two"
        raise UsageError(f"{message} (see '{self.prog} --help')")


# --------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    """The full ``specdecode`` parser (subcommands set ``func``)."""
    parser = _Parser(
        prog="specdecode",
        usage="%(prog)s [-h] [--version] COMMAND ...",
        formatter_class=_HelpFormatter,
        description=(
            "Lossless speculative decoding: a cheap proposer drafts tokens, the target model verifies\n"
            "them in one forward pass, and the output follows the target's own distribution exactly\n"
            "(greedy: the same tokens as plain decoding)."
        ),
        epilog=(
            "commands:\n"
            "  generate   generate text for a prompt or a prompt set and report the metrics\n"
            "  bench      benchmark every method against plain decoding and Hugging Face (Spec-Bench style)\n"
            "  serve      OpenAI-compatible HTTP server with batched speculative decoding\n"
            "  train-drafter  train a feature-level draft head (EAGLE-3 style) for a target, on this CPU\n"
            "  tune       measure which drafter, gamma and policy is fastest for your prompts; writes a --config file\n"
            "  audit      is an endpoint (or this engine) lossless? its samples against the target's exact law\n\n"
            "Run 'specdecode generate' with no flags for a demo on SmolLM2-135M-Instruct with the\n"
            "n-gram (prompt lookup) drafter on five Spec-Bench extraction prompts. 'specdecode COMMAND --help'\n"
            "explains each command."
        ),
    )
    parser.add_argument("--version", action="version", version=f"specdecode {__version__}")
    # the epilog lists the commands once, in its own words: argparse's own list is hidden
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser, prog="specdecode",
                                     help=argparse.SUPPRESS)
    _add_generate(commands)
    _add_bench(commands)
    _add_serve(commands)
    add_train_drafter(commands)
    add_tune(commands)
    add_audit(commands)
    return parser


def _add_generate(commands) -> None:
    p = commands.add_parser(
        "generate",
        help="generate text and report speculative-decoding metrics",
        formatter_class=_HelpFormatter,
        description=(
            "Generate text with speculative decoding, streaming it as tokens are committed, then print\n"
            "the metrics: tokens, drafted, accepted, acceptance rate, tau (tokens per target forward),\n"
            "acceptance by draft position, target forwards, time split and tokens/s.\n\n"
            f"With no prompt flag it uses Spec-Bench's first five extraction questions with the chat\n"
            f"template (facts to pull out of a text in the prompt: prompt lookup finds text to copy), on\n"
            f"--target (default {DEFAULT_TARGET}, SmolLM2-135M-Instruct, converted from GGUF on first use)."
        ),
        epilog=(
            "examples:\n"
            "  specdecode generate\n"
            "  specdecode generate --prompt 'def fib(n):' --max-new-tokens 64\n"
            "  specdecode generate --dataset humaneval:5 --compare-baseline --json\n"
            "  specdecode generate --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b -k 4 \\\n"
            "      --dataset mt-bench:coding:2\n\n"
            f"models (--target, --draft): the offline names {', '.join(CATALOG_MODELS)};\n"
            "a local Hugging Face model directory; a .gguf file; or a hub id.\n"
            "environment: SPECDECODE_CACHE (models, converted copies, compiled kernels; default\n"
            "~/.cache/specdecode); SPECDECODE_KERNEL_ISA=amx|avx512vnni|avx512|avxvnni|avx2|reference forces the\n"
            "low-bit kernel variant (default: the fastest this CPU runs, measured at start).\n"
            "exit status: 0 on success, 2 on a usage or input error (one 'error: ...' line on stderr)."
        ),
    )
    p.set_defaults(func=cmd_generate)
    add_config_argument(p)

    models = p.add_argument_group("models")
    models.add_argument("--target", default=DEFAULT_TARGET, metavar="SPEC",
                        help="the model whose output distribution is preserved (default: %(default)s)")
    add_drafter_arguments(models)

    prompts = p.add_argument_group("prompts (at most one of --prompt, --prompt-file, --dataset)")
    source = prompts.add_mutually_exclusive_group()
    source.add_argument("--prompt", metavar="TEXT", help="the prompt text")
    source.add_argument("--prompt-file", metavar="PATH",
                        help="read the prompt text from a file ('-' reads standard input)")
    source.add_argument("--dataset", metavar="SPEC",
                        help="a prompt set: humaneval[:N], mt-bench[:CATEGORY][:N], spec-bench[:CATEGORY][:N] "
                             "or gsm8k[:N] (N = first N prompts); multi-turn prompts use their first turn. "
                             f"Default when no prompt flag is given: {DEFAULT_DATASET}")
    prompts.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                         help="apply the target tokenizer's chat template to each prompt (one user message). "
                              "Default: on for chat prompt sets (and the prompts used without a prompt flag) when the tokenizer has a "
                              "template; off for HumanEval completion prompts and for --prompt / --prompt-file")

    sampling = p.add_argument_group("sampling")
    sampling.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                          help="most tokens to generate per prompt (default: %(default)s)")
    sampling.add_argument("--temperature", type=float, default=0.0, metavar="T",
                          help="0 = greedy (the same tokens as plain decoding); > 0 samples, and speculative "
                               "sampling keeps the target's distribution exactly (default: %(default)s)")
    sampling.add_argument("--top-k", type=int, default=0, metavar="K",
                          help="sample among the K most likely tokens; 0 disables (default: %(default)s)")
    sampling.add_argument("--top-p", type=float, default=1.0, metavar="P",
                          help="nucleus sampling mass in (0, 1]; 1 disables (default: %(default)s)")
    sampling.add_argument("--seed", type=int, default=None, metavar="N",
                          help="seed of the request's random generator (default: random)")
    sampling.add_argument("--stop", action="append", default=None, metavar="TEXT",
                          help="stop when this text appears; the output ends before it. Repeatable")
    sampling.add_argument("--ignore-eos", action="store_true",
                          help="keep generating past the end-of-sequence token (fixed-length runs)")
    add_sampling_arguments(sampling)
    structured = sampling.add_mutually_exclusive_group()
    structured.add_argument("--json-schema", metavar="FILE",
                            help="structured output: the text is JSON valid under the JSON schema in FILE ('-' reads "
                                 "standard input), written on one line, then end-of-sequence. The grammar masks the "
                                 "target and the drafts alike, so the output is constrained plain decoding's")
    structured.add_argument("--regex", metavar="PATTERN",
                            help="structured output: the whole text matches PATTERN (Rust regex syntax: no "
                                 "lookarounds or backreferences), then end-of-sequence")

    output = p.add_argument_group("output and measurement")
    output.add_argument("--compare-baseline", action="store_true",
                        help="also run plain decoding of the same target (same engine, same process, before the "
                             "speculative run of each prompt) and report its tokens/s, the speedup, and whether "
                             "the outputs match (they must, greedily). Greedy or seeded runs go twice each, "
                             "interleaved, and the faster of each is timed (a short run varies by 10-20%%; an "
                             "adaptive --policy starts the repeat from the state it started the first run in). "
                             "Timed once instead (the summary says 'timed once'; --json: timed_runs 1): unseeded "
                             "sampling, suffix decoding, whose global tree would remember the first answer, and "
                             "seeded --sampling-mode standard runs under an adaptive --policy, whose draws follow "
                             "the draft lengths it chooses from measured times")
    output.add_argument("--json", action="store_true",
                        help="print one JSON object per prompt on stdout (text, token_ids, counts, rates, times, "
                             "finish_reason, prompt_id; with --compare-baseline also baseline, speedup, "
                             "matches_baseline) instead of streaming text and tables")
    output.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="first run a 2-token generation (not reported) so one-time start-up costs do not land "
                             "in the first prompt's timings (default: on)")


def _add_bench(commands) -> None:

    p = commands.add_parser(
        "bench",
        help="benchmark methods x prompt sets against plain decoding and Hugging Face generate",
        formatter_class=_HelpFormatter,
        description=(
            "Spec-Bench-style benchmark: every method (each proposer at its gamma) on every prompt, interleaved\n"
            "with plain decoding and Hugging Face's assisted / prompt-lookup generate, with the cost model's\n"
            "predictions. Writes report.md, report.json and plots under --output; a rerun resumes."
        ),
        epilog=(
            "examples:\n"
            "  specdecode bench --quick          # a short report (10-15 minutes on 2 cores)\n"
            "  specdecode bench --setup-peers    # build llama.cpp's llama-server and llama-bench\n"
            "  specdecode bench --target smollm2-135m --weights int4 --dataset spec-bench --limit 1 \\\n"
            "      --methods 'ngram:k=2;suffix:k=8' --no-peer --llama-server\n"
            "  specdecode bench --verify-table --target qwen2.5-coder-1.5b   # T(k)/T(1) beside llama-bench\n"
            "\n"
            "environment: SPECDECODE_CACHE (converted models, compiled kernels), SPECDECODE_KERNEL_ISA (force a\n"
            "kernel variant: amx, avx512vnni, avx512, avxvnni, avx2, reference), SPECDECODE_NATIVE_STEP=0 (the Python\n"
            "layer loop instead of the C++ one)"
        ),
    )
    add_arguments(p)
    add_config_argument(p)
    p.set_defaults(func=cmd_bench)


def _add_serve(commands) -> None:
    p = commands.add_parser(
        "serve",
        help="OpenAI-compatible server (completions, chat, streaming) with batched speculative decoding",
        formatter_class=_HelpFormatter,
        description=(
            "Serve --target over an OpenAI-compatible API on 127.0.0.1 (GET /v1/models, POST /v1/completions,\n"
            "POST /v1/chat/completions with stream: true, GET /health, GET /metrics for Prometheus).\n"
            "Concurrent requests are decoded together in one batched target forward per step, each with\n"
            "its own sampling parameters and seed, through the same engine as generate (every drafter and\n"
            "precision); the draft length follows --policy (default: a cost model measured online per batch size)."
        ),
        epilog=(
            "examples:\n"
            "  specdecode serve\n"
            "  specdecode serve --target smollm2-135m --draft ngram -k 4 --max-batch-size 8 --port 8000\n"
            "  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\\n"
            "      -d '{\"model\": \"smollm2-135m\", \"prompt\": \"def fib(n):\", \"max_tokens\": 32}'"
        ),
    )
    add_serve_arguments(p)
    add_config_argument(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    """``specdecode serve``: load the models and serve until interrupted (specdecode.server)."""
    check_drafter_flags(args)  # before the server stack and torch are imported
    with naming_flags():
        check_serve_options(args)  # launch.check_options' checks: a refusal never imports torch
        DrafterSpec.from_settings(vars(args)).check()
    check_threads(args.threads, bound=not args.ray_address)  # a cluster's replicas bound their own, where they run
    from specdecode.scaleout import check_replica_options, replica_options_from_args, require_ray  # lazy: the replica options only for serve

    replicas = replica_options_from_args(args)  # refuses replica flags without --replicas
    if replicas is not None:
        check_replica_options(replicas)  # before Ray, torch or a model
        require_ray()
    from specdecode.server.entry import run_from_args  # lazy: the server stack and torch only for serve

    return run_from_args(args)


def cmd_bench(args: argparse.Namespace) -> int:
    """``specdecode bench``: run (or resume) the benchmark and print the Markdown report (specdecode.bench)."""

    return run_command(args)


# --------------------------------------------------------------------------- entry point


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 2 usage / input error, 130 interrupted)."""
    parser = build_parser()
    settings: dict = {}
    args = None
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        settings = apply_config(parser, argv)  # --config FILE: its settings become the command's defaults, flags override
        args, extra = parser.parse_known_args(argv)
        if extra:  # name the subcommand's help, which lists the flags it takes
            where = " ".join(filter(None, ("specdecode", getattr(args, "command", None))))
            raise UsageError(f"unrecognized arguments: {' '.join(extra)} (see '{where} --help')")
        if getattr(args, "func", None) is None:
            parser.print_help(sys.stderr)
            raise UsageError("choose a command, e.g. 'specdecode generate'")
        return args.func(args)
    except SystemExit as exc:  # --help / --version
        return exc.code if isinstance(exc.code, int) else 0
    except SpecDecodeError as exc:
        message = str(exc)
        print(f"error: {_one_line(message + config_origin(parser, argv, args, settings, message))}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("\nerror: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (| head): stop quietly, as Unix tools do
        _quiet_stdout()
        return 0
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EIO, errno.EDQUOT):
            raise
        _quiet_stdout()  # where it was standard output that failed, the exit's own flush would fail again
        where = f" {exc.filename}" if exc.filename else ""
        print(f"error: cannot write{where}: {exc.strerror or exc}; free space or write elsewhere", file=sys.stderr)
        return 1


def _quiet_stdout() -> None:
    """Point standard output at /dev/null, so the interpreter's own flush at exit does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # a standard output with no file behind it
        pass


def _one_line(message: str) -> str:
    return " ".join(message.split())


if __name__ == "__main__":
    sys.exit(main())
