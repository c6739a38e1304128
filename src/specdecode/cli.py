"""The ``specdecode`` command line.

Subcommands (one function each, so more can join: ``bench``, ``serve``):

- ``specdecode generate``: generate text for a prompt, a prompt file or a prompt set,
  streaming the text, then the speculative-decoding metrics; ``--compare-baseline``
  also runs plain decoding of the same target through the same engine.
- ``specdecode audit``: test that an OpenAI-compatible endpoint (or this engine in-process) samples the
  target's exact distribution (``specdecode.audit``); exit status 0 PASS, 1 FAIL.

Status and progress go to stderr, results to stdout (``--json``: one object per
prompt per line). User errors print one ``error: ...`` line and exit with status 2.

Building the parser and every check that needs no model import neither torch nor the
server stack (``cliargs``, ``options``, ``errors`` and ``bench/__init__`` are light): a
command imports what it runs when it runs.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from specdecode import __version__
from specdecode.cliargs import (  # noqa: F401 - DRAFT_CHOICES_HELP re-exported
    DRAFT_CHOICES_HELP,
    SAMPLING_MODES,
    add_drafter_arguments,
    add_sampling_arguments,
    add_serve_arguments,
    check_drafter_flags,
    check_threads,
    set_threads,
)
from specdecode.configfile import add_config_argument, apply_config
from specdecode.errors import SpecDecodeError
from specdecode.options import CATALOG_MODELS, DEFAULT_TARGET
from specdecode.paths import check_output_dir
from specdecode.spec import DrafterSpec
from specdecode.validate import (  # the library's own checks, without torch
    check_engine,
    check_sampling,
    check_serve_options,
    check_stops,
    check_token_ids,
)

EXIT_USAGE = 2

#: The embedded default prompt: a long news article to summarize, where prompt lookup pays off.
DEFAULT_DATASET = "spec-bench:summarization:1"
#: Used instead when ../shared/data is not beside the project: HumanEval ships in a registry package.
FALLBACK_DATASET = "humaneval:1"


class UsageError(SpecDecodeError):
    """A command-line mistake found by argparse (unknown flag, bad number, ...)."""


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting, so ``main`` prints one line."""

    def error(self, message: str):  # noqa: D401 - argparse API
        if "not allowed with argument" in message:  # mutually exclusive flags
            message += ": give one of the two"
        raise UsageError(f"{message} (see '{self.prog} --help')")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32)


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
            "n-gram (prompt lookup) drafter. 'specdecode COMMAND --help' explains each command."
        ),
    )
    parser.add_argument("--version", action="version", version=f"specdecode {__version__}")
    # the epilog lists the commands once, in its own words: argparse's own list is hidden
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser, prog="specdecode",
                                     help=argparse.SUPPRESS)
    _add_generate(commands)
    _add_bench(commands)
    _add_serve(commands)
    _add_train_drafter(commands)
    _add_tune(commands)
    _add_audit(commands)
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
            f"With no prompt flag it uses the first Spec-Bench summarization question with the chat\n"
            f"template (a news article to summarize: prompt lookup finds text to copy), on --target\n"
            f"(default {DEFAULT_TARGET}, SmolLM2-135M-Instruct, converted from GGUF on first use, ~1 min)."
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
                              "Default: on for chat prompt sets (and the built-in prompt) when the tokenizer has a "
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
                             "the outputs match (they must, greedily)")
    output.add_argument("--json", action="store_true",
                        help="print one JSON object per prompt on stdout (text, token_ids, counts, rates, times, "
                             "finish_reason, prompt_id; with --compare-baseline also baseline, speedup, "
                             "matches_baseline) instead of streaming text and tables")
    output.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="first run a 2-token generation (not reported) so one-time start-up costs do not land "
                             "in the first prompt's timings (default: on)")


def _add_bench(commands) -> None:
    from specdecode.bench import add_arguments

    p = commands.add_parser(
        "bench",
        help="benchmark methods x prompt sets against plain decoding and Hugging Face generate",
        formatter_class=_HelpFormatter,
        description=(
            "Spec-Bench-style benchmark: every method (each proposer at its gamma) on every prompt, interleaved\n"
            "with plain decoding and Hugging Face's assisted / prompt-lookup generate, with the cost model's\n"
            "predictions. Writes report.md, report.json and plots under --output; a rerun resumes."
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


def _add_train_drafter(commands) -> None:
    p = commands.add_parser(
        "train-drafter",
        help="train a feature-level draft head (EAGLE-3 style) for --target on this machine",
        formatter_class=_HelpFormatter,
        description=(
            "Self-distillation, then training, all resumable from the work directory:\n"
            "  1. training prompts that are not benchmark prompts (ShareGPT-style conversations of the MT-Bench\n"
            "     package, GSM8K minus Spec-Bench's questions, instructions and code from the Python standard\n"
            "     library, everyday instruction templates); the overlap with Spec-Bench and HumanEval is checked empty;\n"
            "  2. the target answers them itself (batched plain decoding);\n"
            "  3. one target forward per sequence reads its hidden states (a low, a middle and a high layer)\n"
            "     and its prediction at every position;\n"
            "  4. the head (those features fused by a linear layer, the token embedding, one decoder layer, the\n"
            "     target's final norm and a reduced vocabulary) is trained with the training-time test: unrolled\n"
            "     on its own outputs for --ttt-steps draft positions;\n"
            "  5. the checkpoint (safetensors + config.json), a loss / accuracy plot, and an acceptance estimate\n"
            "     on held-out Spec-Bench prompts (the first of each category). Draft with it: --draft eagle\n"
            "     (or eagle:PATH)."
        ),
        epilog=(
            "examples:\n"
            "  specdecode train-drafter                              # SmolLM2-135M, about 50 minutes on 2 cores\n"
            "  specdecode train-drafter --target qwen2.5-coder-1.5b --mix code --weights int8 --prompts 1200\n"
            "  specdecode generate --draft eagle --tree dynamic"
        ),
    )
    from specdecode.options import DEFAULT_TARGET

    p.add_argument("--target", default=DEFAULT_TARGET, help="the model the head drafts for (default: %(default)s)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="checkpoint directory (default: <work-dir>/head, where --draft eagle finds it)")
    p.add_argument("--work-dir", default=None, metavar="DIR",
                   help="where the stages keep their files; a rerun resumes there (default: <cache>/eagle/<target>)")
    p.add_argument("--cache-dir", default=None, metavar="DIR", help="model cache (default: $SPECDECODE_CACHE or "
                   "~/.cache/specdecode)")
    p.add_argument("--weights", default="bf16", choices=("fp32", "bf16", "int8", "int4"),
                   help="precision the target runs in while answering and while its features are read: use the "
                        "one you decode with (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=1500, metavar="N", help="training prompts (default: %(default)s)")
    p.add_argument("--mix", default="chat", choices=("chat", "code"),
                   help="prompt mix: 'code' adds raw code completions for code models (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                   help="tokens the target answers per prompt (default: %(default)s)")
    p.add_argument("--max-length", type=int, default=512, metavar="N",
                   help="tokens per training sequence, prompt + answer (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="temperature of the self-distilled answers; 0 = greedy (default: %(default)s)")
    p.add_argument("--draft-vocab", type=int, default=16384, metavar="N",
                   help="the head's reduced vocabulary: the N most frequent target tokens (default: %(default)s)")
    p.add_argument("--ttt-steps", type=int, default=4, metavar="K",
                   help="draft positions unrolled in the training-time test (default: %(default)s)")
    p.add_argument("--epochs", type=float, default=4.0, help="passes over the corpus (default: %(default)s)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate, cosine decay (default: %(default)s)")
    p.add_argument("--batch-tokens", type=int, default=2048, metavar="N",
                   help="tokens per training batch, padding included (default: %(default)s)")
    p.add_argument("--head-intermediate", type=int, default=None, metavar="N",
                   help="the head's MLP width (default: the target's; smaller trains and drafts faster)")
    p.add_argument("--train-lm-head", action="store_true",
                   help="train (and store) the LM head rows instead of using the target's (a bigger checkpoint)")
    p.add_argument("--device", default="cpu", help="'cpu' or 'cuda' (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch CPU threads, 1..the cores this process may use (default: torch's)")
    p.add_argument("--max-train-minutes", type=float, default=None, metavar="M",
                   help="stop training after M minutes (resumable: run the command again to go on)")
    p.add_argument("--no-estimate", action="store_true", help="skip the held-out acceptance estimate at the end")
    p.add_argument("--seed", type=int, default=0, help="prompt order, initialisation and batches (default: 0)")
    p.set_defaults(func=cmd_train_drafter)


#: The prompts ``specdecode audit`` uses when none is given (HumanEval when ../shared/data is missing).
AUDIT_DATASET, AUDIT_FALLBACK_DATASET = "spec-bench:writing:2", "humaneval:2"


def _add_audit(commands) -> None:
    from specdecode.audit.config import MAX_SAMPLES, MAX_TOKENS, MIN_SAMPLES

    p = commands.add_parser(
        "audit",
        help="test that an endpoint (or this engine) samples exactly the target's distribution",
        formatter_class=_HelpFormatter,
        description=(
            "The losslessness test as a command. Sampled mode (--temperature > 0): for each prompt, the target's\n"
            "exact law over its first --tokens generated tokens is enumerated here from the same weights, with\n"
            "the request's processing (temperature, top-k, top-p, min-p, penalties, biases); N completions are\n"
            "drawn from the source and compared with it: chi-square (Holm across prompts, plus a pooled test),\n"
            "total variation against its null spread (N multinomial draws from the exact law), impossible\n"
            "outputs (a token the processing gives probability 0: an immediate FAIL), and the power (the\n"
            "smallest TV error N samples detect with probability --power).\n"
            "Greedy mode (--temperature 0): the source's output must equal plain greedy decoding here, token\n"
            "for token for --max-new-tokens tokens; at a divergence it prints the position and the target's\n"
            "top-1 minus top-2 logit margin there, so a near-tie flip is told apart from a bug.\n\n"
            "Sources: --endpoint URL --model NAME, any OpenAI-compatible server's /v1/completions (specdecode\n"
            "serve, vLLM, llama.cpp's server; token ids are used where the server returns them, else the text is\n"
            "mapped back to tokens), or --local: this project's batched speculative engine in-process, with any\n"
            "--draft. The reference is the local --target in --weights: give the precision the server runs."
        ),
        epilog=(
            "examples:\n"
            "  specdecode serve --target smollm2-135m --port 8000 &\n"
            "  specdecode audit --endpoint http://127.0.0.1:8000 --model smollm2-135m --temperature 0.8 -N 2000\n"
            "  specdecode audit --local --draft ngram --temperature 1 --top-p 0.9 --dataset spec-bench:writing:2\n"
            "  specdecode audit --local --draft layer-skip --temperature 0 --max-new-tokens 64\n\n"
            "exit status: 0 PASS, 1 FAIL, 2 a usage or input error (one 'error: ...' line on stderr: an\n"
            "unreachable endpoint, a model it does not serve, another tokenizer, a value out of range)."
        ),
    )
    p.set_defaults(func=cmd_audit)
    src = p.add_argument_group("source (one of --endpoint, --local)")
    where = src.add_mutually_exclusive_group(required=True)
    where.add_argument("--endpoint", metavar="URL",
                       help="base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000 (a trailing /v1 is "
                            "fine); samples come from its POST /v1/completions")
    where.add_argument("--local", action="store_true",
                       help="sample from specdecode's own speculative engine in-process (batched, --batch-size rows) "
                            "with --draft; the reference is plain decoding of the same loaded target")
    src.add_argument("--model", metavar="NAME",
                     help="with --endpoint: the model id the server serves (checked against GET /v1/models)")
    src.add_argument("--api-key", metavar="KEY", help="with --endpoint: sent as 'Authorization: Bearer KEY'")
    src.add_argument("--concurrency", type=int, default=8, metavar="N",
                     help="with --endpoint: requests in flight, 1..256 (default: %(default)s)")
    src.add_argument("--timeout", type=float, default=120.0, metavar="S",
                     help="with --endpoint: seconds to wait for one answer (default: %(default)s)")
    src.add_argument("--prompt-format", default="ids", choices=("ids", "text"),
                     help="with --endpoint: send each prompt as the target's token ids (ids: the server does not "
                          "re-tokenize, so both sides score the same prompt) or as text (chat template applied "
                          "here) (default: %(default)s)")
    src.add_argument("--batch-size", type=int, default=32, metavar="N",
                     help="with --local: requests the engine decodes together, 1..256 (default: %(default)s)")

    models = p.add_argument_group("models (the reference; with --local also the drafter)")
    models.add_argument("--target", default=None, metavar="SPEC",
                        help="the local model whose exact law is the reference: the weights the server runs "
                             f"(default: --model with --endpoint, {DEFAULT_TARGET} with --local)")
    add_drafter_arguments(models, gamma_help="with --local: gamma, tokens drafted per step, 1..64")
    models.add_argument("--forward", default="auto", choices=("auto", "owned", "hf"),
                        help="the target forward used here (and by --local's engine) (default: %(default)s)")

    prompts = p.add_argument_group("prompts (at most one of --prompt, --prompt-file, --dataset)")
    source = prompts.add_mutually_exclusive_group()
    source.add_argument("--prompt", metavar="TEXT", help="the prompt text")
    source.add_argument("--prompt-file", metavar="PATH", help="read the prompt text from a file ('-': standard input)")
    source.add_argument("--dataset", metavar="SPEC",
                        help="a prompt set as 'specdecode generate' takes it: humaneval[:N], mt-bench[:CATEGORY][:N], "
                             "spec-bench[:CATEGORY][:N], gsm8k[:N] (default: "
                             f"{AUDIT_DATASET}, else {AUDIT_FALLBACK_DATASET} without ../shared/data)")
    prompts.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                         help="apply the target tokenizer's chat template (default: on for chat prompt sets when the "
                              "tokenizer has one, off for HumanEval and --prompt / --prompt-file)")

    sampling = p.add_argument_group("sampling (what each request asks; the exact law applies the same processing)")
    sampling.add_argument("--temperature", type=float, default=1.0, metavar="T",
                          help="0 = greedy mode (token equality); in (0, 2] = sampled mode (default: %(default)s)")
    sampling.add_argument("--top-k", type=int, default=0, metavar="K", help="0 disables (default: %(default)s)")
    sampling.add_argument("--top-p", type=float, default=1.0, metavar="P",
                          help="nucleus mass in (0, 1]; 1 disables (default: %(default)s)")
    sampling.add_argument("--ignore-eos", action="store_true", help="generate past end-of-sequence")
    add_sampling_arguments(sampling)
    p.set_defaults(sampling_mode="standard")

    test = p.add_argument_group("the test")
    test.add_argument("-N", "--num-samples", type=int, default=2000, metavar="N",
                      help=f"sampled mode: completions drawn per prompt, {MIN_SAMPLES}..{MAX_SAMPLES:,} "
                           "(default: %(default)s)")
    test.add_argument("--tokens", type=int, default=3, metavar="n",
                      help=f"sampled mode: generated tokens per completion whose joint law is tested, 1..{MAX_TOKENS}; "
                           "the first comes from the prefill, the others from verified drafts (default: %(default)s)")
    test.add_argument("--alpha", type=float, default=0.01,
                      help="family-wise significance level of the verdict (Holm over prompts and the pooled test) "
                           "(default: %(default)s)")
    test.add_argument("--power", type=float, default=0.8,
                      help="the detection probability the stated power refers to (default: %(default)s)")
    test.add_argument("--min-cell-mass", type=float, default=None, metavar="M",
                      help="outcomes down to this probability are their own cells, the rest of each prefix one "
                           "'other' cell (exact, coarser) (default: min(1e-3, max(1e-5, 0.5 / N)))")
    test.add_argument("--null-simulations", type=int, default=2000, metavar="M",
                      help="multinomial draws of N from the exact law for the TV null spread (default: %(default)s)")
    test.add_argument("--seed", type=int, default=0,
                      help="the audit's seed: every request gets its own seed from it (default: %(default)s)")
    test.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                      help="greedy mode: tokens compared with plain greedy decoding (default: %(default)s)")
    test.add_argument("--tie-margin", type=float, default=0.05, metavar="LOGITS",
                      help="greedy mode: a divergence where the target's top-1 minus top-2 logit is below this is a "
                           "near-tie (reported, not failed) (default: %(default)s)")
    p.add_argument("--output", metavar="DIR", help="write report.json, report.md and worst_prompt.png there")


def cmd_audit(args: argparse.Namespace) -> int:
    """``specdecode audit``: check every flag (no torch), read the prompts, run ``specdecode.audit.runner``;
    0 on PASS, 1 on FAIL."""
    from specdecode.audit.config import AuditConfig, AuditSetup, check_concurrency, check_temperature
    from specdecode.data import SharedDataMissing, load_prompts

    check_drafter_flags(args)
    if args.endpoint is not None and not args.model:
        raise UsageError("--endpoint needs --model NAME, the model id the server serves (see its GET /v1/models)")
    if args.local and args.model:
        raise UsageError("--model names an endpoint's model; with --local give the model with --target")
    if args.timeout <= 0:
        raise UsageError(f"--timeout must be > 0 seconds, got {args.timeout}")
    with _naming_flags():
        check_temperature(args.temperature)
        check_concurrency(args.concurrency)
        check_sampling(args.temperature, args.top_k, args.top_p, args.max_new_tokens, None, **_sampling_kwargs(args))
        check_engine(num_speculative_tokens=args.num_speculative_tokens, max_batch_size=args.batch_size,
                     verification=args.verification)
        DrafterSpec.from_settings(vars(args)).check()
        cfg = AuditConfig(num_samples=args.num_samples, num_tokens=args.tokens, alpha=args.alpha, power=args.power,
                          min_cell_mass=args.min_cell_mass, null_simulations=args.null_simulations, seed=args.seed,
                          max_new_tokens=args.max_new_tokens, tie_margin=args.tie_margin)
    check_threads(args.threads)
    if args.output is not None:  # before the audit runs: its report is what the run is for
        check_output_dir(args.output, "--output")
    if args.prompt is None and args.prompt_file is None and args.dataset is None:
        try:
            load_prompts(AUDIT_DATASET)
            args.dataset = AUDIT_DATASET
        except SharedDataMissing:
            args.dataset = AUDIT_FALLBACK_DATASET
    jobs = _read_jobs(args)
    chat = [args.chat if args.chat is not None else (None if job.chat_default else False) for job in jobs]
    sampling = {k: v for k, v in _sampling_kwargs(args).items() if k != "coupled"}
    sampling.update(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, ignore_eos=args.ignore_eos)
    setup = AuditSetup(
        target=args.target or (args.model if args.endpoint is not None else DEFAULT_TARGET),
        prompts=tuple((job.id, job.text, c) for job, c in zip(jobs, chat)), sampling=sampling, config=cfg,
        endpoint=args.endpoint, model=args.model, api_key=args.api_key, concurrency=args.concurrency,
        timeout=args.timeout, prompt_format=args.prompt_format, sampling_mode=args.sampling_mode, draft=args.draft,
        num_speculative_tokens=args.num_speculative_tokens, ngram_min=args.ngram_min, ngram_max=args.ngram_max,
        skip_layers=args.skip_layers, tree=args.tree, tree_nodes=args.tree_nodes, policy=args.policy,
        verification=args.verification, batch_size=args.batch_size, weights=args.weights, dtype=args.dtype,
        draft_weights=args.draft_weights, cache_dir=args.cache_dir, forward=args.forward, output=args.output,
        command="specdecode audit " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["audit"] else None)
    set_threads(args.threads, say=_status)
    from specdecode.audit.runner import run_audit

    return 0 if run_audit(setup, say=_status).passed else 1


def cmd_train_drafter(args: argparse.Namespace) -> int:
    """``specdecode train-drafter``: build the training set and train a draft head (specdecode.eagle.train)."""
    check_threads(args.threads)
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        raise UsageError(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    if not 0 <= args.temperature <= 2:
        raise UsageError(f"--temperature must be in [0, 2], got {args.temperature}")
    for flag, value in (("--prompts", args.prompts), ("--max-new-tokens", args.max_new_tokens),
                        ("--max-length", args.max_length), ("--draft-vocab", args.draft_vocab),
                        ("--ttt-steps", args.ttt_steps), ("--batch-tokens", args.batch_tokens)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if args.head_intermediate is not None and args.head_intermediate < 1:
        raise UsageError(f"--head-intermediate must be >= 1, got {args.head_intermediate}")
    if not 0 < args.epochs <= 1000:
        raise UsageError(f"--epochs must be in (0, 1000], got {args.epochs}")
    if not 0 < args.lr < 1:
        raise UsageError(f"--lr must be in (0, 1), got {args.lr}")
    if args.max_train_minutes is not None and not args.max_train_minutes > 0:
        raise UsageError(f"--max-train-minutes must be > 0, got {args.max_train_minutes}")
    for flag, path in (("--work-dir", args.work_dir), ("--out", args.out)):  # before torch, hours before the end
        if path is not None:
            check_output_dir(path, flag)
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is available to this torch build; use --device cpu")
    from specdecode.eagle.train import TrainConfig, run

    cfg = TrainConfig(num_prompts=args.prompts, mix=args.mix, max_new_tokens=args.max_new_tokens,
                      max_length=args.max_length, temperature=args.temperature, draft_vocab_size=args.draft_vocab,
                      ttt_steps=args.ttt_steps, epochs=args.epochs, lr=args.lr, batch_tokens=args.batch_tokens,
                      train_lm_head=args.train_lm_head, device=args.device, threads=args.threads, seed=args.seed,
                      intermediate_size=args.head_intermediate)
    run(args.target, cfg, out=args.out, work_dir=args.work_dir, weights=args.weights, cache_dir=args.cache_dir,
        estimate_prompts=None if args.no_estimate else "spec-bench",
        max_train_seconds=None if args.max_train_minutes is None else 60 * args.max_train_minutes)
    return 0


def _add_tune(commands) -> None:
    from specdecode.cliargs import add_tune_arguments

    p = commands.add_parser(
        "tune",
        help="measure which drafter, gamma and policy is fastest on your prompts and machine; write the settings",
        formatter_class=_HelpFormatter,
        description=(
            "On your prompts and machine: time the target's steps (T_decode, T_verify(k)), run every drafter\n"
            "(none, n-gram, suffix, layer-skip, each --draft model and its token trees, a trained head) at a\n"
            "generous gamma on a sample of the prompts to measure acceptance per draft position, predict the\n"
            "speedup of each drafter x gamma (and the cost-model policy) with the cost model, confirm the best\n"
            "ones against plain decoding on held-out prompts, and print the ranked table with the decision.\n"
            "The chosen settings go to --output as a TOML file that generate, bench and serve read with --config."
        ),
        epilog=(
            "examples:\n"
            "  specdecode tune --target smollm2-135m --dataset spec-bench:summarization:2,spec-bench:coding:2 \\\n"
            "      --budget 600\n"
            "  specdecode tune --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --weights int4 \\\n"
            "      --draft-weights int4 --dataset humaneval:8 --output qwen.toml\n"
            "  specdecode generate --config qwen.toml --prompt 'def fib(n):'"
        ),
    )
    add_tune_arguments(p)
    p.set_defaults(func=cmd_tune)


def cmd_tune(args: argparse.Namespace) -> int:
    """``specdecode tune``: measure, predict, confirm, decide; write the settings file (specdecode.tune)."""
    from specdecode.tune import DRAFTER_KINDS, check_output, run_tune

    datasets = tuple(d.strip() for item in (args.datasets or ()) for d in item.split(",") if d.strip())
    drafters = (DRAFTER_KINDS if args.drafters is None  # --drafters '': refused as empty, not taken for all
                else tuple(d.strip() for d in args.drafters.split(",") if d.strip()))
    check_threads(args.threads)
    check_output(args.output, default=False)  # the settings file and its .json, before anything is measured
    with _naming_flags():  # "--max-new-tokens: max_new_tokens must be ...", as generate says it
        config = _tune_config(args, datasets, drafters)
    run_tune(config, progress=not args.no_progress)
    return 0


def _tune_config(args: argparse.Namespace, datasets: tuple[str, ...], drafters: tuple[str, ...]):
    from specdecode.tune import TuneConfig

    return TuneConfig(target=args.target, drafts=tuple(args.drafts or ()), datasets=datasets,
                      prompts_file=args.prompts_file, budget_s=args.budget_s, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, threads=args.threads, weights=args.weights,
                      draft_weights=args.draft_weights, dtype=args.dtype, max_gamma=args.max_gamma,
                      drafters=drafters, top=args.top, repeats=args.repeats, sample_prompts=args.sample_prompts,
                      confirm_prompts=args.confirm_prompts, min_gain=args.min_gain, tree_nodes=args.tree_nodes,
                      layer_search_s=args.layer_search_s, chat=args.chat, seed=args.seed,
                      cache_dir=args.cache_dir, output=args.output)


def cmd_serve(args: argparse.Namespace) -> int:
    """``specdecode serve``: load the models and serve until interrupted (specdecode.server)."""
    check_drafter_flags(args)  # before the server stack and torch are imported
    with _naming_flags():
        check_serve_options(args)  # launch.check_options' checks: a refusal never imports torch
        DrafterSpec.from_settings(vars(args)).check()
    check_threads(args.threads, bound=not args.ray_address)  # a cluster's replicas bound their own, where they run
    from specdecode.scaleout import check_replica_options, replica_options_from_args, require_ray

    replicas = replica_options_from_args(args)  # refuses replica flags without --replicas
    if replicas is not None:
        check_replica_options(replicas)  # before Ray, torch or a model
        require_ray()
    from specdecode.server.entry import run_from_args

    return run_from_args(args)


def cmd_bench(args: argparse.Namespace) -> int:
    """``specdecode bench``: run (or resume) the benchmark and print the Markdown report (specdecode.bench)."""
    from specdecode.bench import run_command

    return run_command(args)


# --------------------------------------------------------------------------- entry point


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 2 usage / input error, 130 interrupted)."""
    parser = build_parser()
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        apply_config(parser, argv)  # --config FILE: its settings become the command's defaults, flags override
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
        print(f"error: {_one_line(str(exc))}", file=sys.stderr)
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


def _status(message: str) -> None:
    print(f"specdecode: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- generate


@dataclass(frozen=True)
class _Job:
    """One prompt to run: its text, where it came from, and whether to use the chat template."""

    id: str
    text: str
    chat_default: bool  # before --chat / --no-chat and the tokenizer's template are considered
    dataset: str | None = None
    category: str | None = None


def cmd_generate(args: argparse.Namespace) -> int:
    """``specdecode generate``: validate, read prompts, load models, run each prompt, report."""
    check_drafter_flags(args)  # contradictions first: they need not even torch
    _check_generate_args(args)  # nor do the range checks
    check_threads(args.threads)
    jobs = _read_jobs(args)  # a bad dataset or prompt file: refused before torch is imported
    from specdecode.build import choose_skip_layers  # lazy, as every import of torch here: --help answers at once
    from specdecode.generator import SpecDecoder

    set_threads(args.threads, say=_status)
    _preflight(args, jobs)
    _status(f"loading target {args.target!r}" + ("" if args.draft.lower() in ("none", "ngram") else
                                                  f" and draft {args.draft!r}"))
    t0 = time.perf_counter()
    decoder = SpecDecoder.from_pretrained(
        args.target, DrafterSpec.from_settings(vars(args)), num_speculative_tokens=args.num_speculative_tokens,
        dtype=args.dtype, cache_dir=args.cache_dir, weights=args.weights, draft_weights=args.draft_weights,
        policy=args.policy, verification=args.verification, status=_status,
    )
    _status(f"loaded in {time.perf_counter() - t0:.1f} s: target {decoder.target.source}, {_draft_label(args)}, "
            f"gamma {args.num_speculative_tokens}, context {decoder.target.max_context} tokens")
    if decoder.precision is not None:
        p = decoder.precision
        _status(f"weights {p.reason}" + (f" (measured once on this machine, cached in {p.cache_file}: delete it to "
                                         "measure again)" if p.cached and p.cache_file else ""))
    _check_token_ids(args, decoder.engine.vocab_size)
    with _naming_flags():  # an invalid schema or regex: refused before any output
        decoder.compile_structured(json_schema=args.json_schema_text, regex=args.regex)
    baseline = decoder.plain() if args.compare_baseline else None
    if args.warmup:
        _warm_up(decoder, baseline)
    encoded = [_encode_job(args, decoder, job) for job in jobs]  # every input error before any output
    choose_skip_layers(decoder.proposer, [ids for _, _, ids in encoded], say=_status)
    records = []
    for i, (job, chat, prompt_ids) in enumerate(encoded):
        records.append(_run_job(args, decoder, baseline, job, chat, prompt_ids, i, len(jobs)))
    if not args.json and len(records) > 1:
        _print_aggregate(records, baseline is not None)
    return 0


def _check_generate_args(args: argparse.Namespace) -> None:
    """Range-check every number before anything heavy is imported or loaded (SpecDecodeError on the first bad
    one): the checks of SamplingParams, EngineConfig and the drafter factory (``specdecode.validate``)."""
    with _naming_flags():
        check_sampling(args.temperature, args.top_k, args.top_p, args.max_new_tokens, args.seed,
                       **_sampling_kwargs(args))
        check_engine(num_speculative_tokens=args.num_speculative_tokens, verification=args.verification)
        DrafterSpec.from_settings(vars(args)).check()
        check_stops(args.stop)
    args.json_schema_text = _read_json_schema(args.json_schema)
    if args.regex is not None and not args.regex:
        raise SpecDecodeError("--regex: the pattern is empty")


def _read_json_schema(path: str | None) -> str | None:
    """The text of --json-schema FILE, checked to be a JSON object (the schema itself is checked when the
    target's tokenizer compiles it, before any output)."""
    if path is None:
        return None
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecDecodeError(f"--json-schema: cannot read {path!r}: {exc}") from None
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecDecodeError(f"--json-schema: {path!r} is not valid JSON ({exc.msg} at line {exc.lineno} column "
                              f"{exc.colno})") from None
    if not isinstance(schema, dict):
        raise SpecDecodeError(f"--json-schema: {path!r} holds a JSON {type(schema).__name__}, not a schema object")
    return text


def _sampling_kwargs(args: argparse.Namespace) -> dict:
    """The sampling flags beyond temperature / top-k / top-p / seed, as the keywords of ``SpecDecoder.generate``
    and ``validate.check_sampling`` (the same names: ``SamplingParams``' fields)."""
    bias = args.logit_bias
    return dict(min_p=args.min_p, repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty, logit_bias=dict(bias) if bias else None,
                min_tokens=args.min_tokens, stop_token_ids=tuple(args.stop_token_ids or ()),
                coupled=SAMPLING_MODES[args.sampling_mode])


def _check_token_ids(args: argparse.Namespace, vocab_size: int) -> None:
    """--logit-bias and --stop-token-id name tokens of the target's vocabulary (checked once it is loaded,
    before any output; ``validate.check_token_ids``, the flag named)."""
    bias = args.logit_bias
    with _naming_flags():
        check_token_ids(vocab_size, logit_bias=dict(bias) if bias else None,
                        stop_token_ids=tuple(args.stop_token_ids or ()))


#: The flag of each setting the library's errors name (``SpecDecodeError.field``), so a refusal names both.
_FLAG_OF = {
    "num_speculative_tokens": "-k/--num-speculative-tokens", "temperature": "--temperature", "top_k": "--top-k",
    "top_p": "--top-p", "max_new_tokens": "--max-new-tokens", "seed": "--seed", "stop": "--stop", "tree": "--tree",
    "tree_nodes": "--tree-nodes", "ngram": "--ngram-min/--ngram-max", "max_batch_size": "--max-batch-size",
    "forward": "--forward", "policy": "--policy", "verification": "--verification", "min_p": "--min-p",
    "repetition_penalty": "--repetition-penalty", "presence_penalty": "--presence-penalty",
    "frequency_penalty": "--frequency-penalty", "logit_bias": "--logit-bias", "min_tokens": "--min-tokens",
    "stop_token_ids": "--stop-token-id", "coupled": "--sampling-mode", "json_schema": "--json-schema",
    "regex": "--regex",
    # specdecode audit
    "num_samples": "-N/--num-samples", "num_tokens": "--tokens", "alpha": "--alpha", "power": "--power",
    "min_cell_mass": "--min-cell-mass", "null_simulations": "--null-simulations", "tie_margin": "--tie-margin",
    "concurrency": "--concurrency",
}


@contextlib.contextmanager
def _naming_flags():
    """Put the flag in front of a library error about one setting: ``--top-p: top_p must be in (0, 1] ...``."""
    try:
        yield
    except SpecDecodeError as exc:
        flag = _FLAG_OF.get(exc.field)
        if flag is not None:
            exc.args = (f"{flag}: {exc}",)
        raise


def _preflight(args: argparse.Namespace, jobs: list[_Job]) -> None:
    """Before any weight file is read: the models resolve, a draft model shares the target's tokenizer, and
    every prompt fits the target's context (``specdecode.preflight``, from tokenizer files and config.json)."""
    from specdecode.preflight import check_models, check_prompts

    target = check_models(args.target, DrafterSpec.from_settings(vars(args)).model_spec, cache_dir=args.cache_dir,
                          cross_vocab=True, tree=args.tree)  # the cross-vocabulary line is said at load
    chat = [args.chat if args.chat is not None else (None if job.chat_default else False) for job in jobs]
    check_prompts(target, [(job.id, job.text, c) for job, c in zip(jobs, chat)], args.max_new_tokens)


def _read_jobs(args: argparse.Namespace) -> list[_Job]:
    from specdecode.data import SharedDataMissing, load_prompts

    if args.prompt is not None:
        if not args.prompt.strip():
            raise SpecDecodeError("the prompt is empty: give some text with --prompt (or use --dataset)")
        return [_Job("prompt", args.prompt, chat_default=False)]
    if args.prompt_file is not None:
        return [_Job(args.prompt_file, _read_prompt_file(args.prompt_file), chat_default=False)]
    spec = args.dataset or DEFAULT_DATASET
    try:
        prompts = load_prompts(spec)
    except SharedDataMissing as err:
        if args.dataset is not None:
            raise
        spec = FALLBACK_DATASET  # ships in a registry package, so the default runs anywhere
        _status(f"{err}; using {spec} instead")
        prompts = load_prompts(spec)
    if not prompts:
        raise SpecDecodeError(f"the prompt set {spec!r} is empty")
    if args.dataset is None:
        p = prompts[0]
        _status(f"no prompt given: using the default prompt, {p.dataset} question {p.id} ({p.category}), "
                f"{len(p.turns[0])} characters: {_preview(p.turns[0])}")
    return [
        _Job(f"{p.dataset}/{p.id}" if "/" not in p.id else p.id, p.turns[0], chat_default=not p.is_completion,
             dataset=p.dataset, category=p.category)
        for p in prompts
    ]


def _read_prompt_file(path: str) -> str:
    if path == "-":
        text = sys.stdin.read()
        if not text.strip():
            raise SpecDecodeError("--prompt-file -: standard input was empty; pipe the prompt in (as --prompt "
                                  "refuses '')")
        return text
    file = Path(path).expanduser()
    if file.is_dir():
        raise SpecDecodeError(f"--prompt-file {path!r} is a directory; give a text file (or - for stdin)")
    if not file.is_file():
        raise SpecDecodeError(f"prompt file not found: {path!r}")
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecDecodeError(f"cannot read prompt file {path!r}: {exc}") from exc
    if not text.strip():
        raise SpecDecodeError(f"prompt file {path!r} is empty; write the prompt in it (as --prompt refuses '')")
    return text


def _preview(text: str, width: int = 90) -> str:
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= width else flat[: width - 3] + "...")


def _draft_label(args: argparse.Namespace) -> str:
    kind = args.draft.strip().lower()
    if kind == "none":
        return "no draft (plain decoding)"
    if kind == "ngram":
        return f"ngram drafter (n = {args.ngram_max}..{args.ngram_min})"
    if kind == "layer-skip":
        return f"layer-skip self-speculation (skip {args.skip_layers or 'auto'}), policy {args.policy}"
    tree = f", {args.tree} trees of {args.tree_nodes} nodes" if args.tree != "none" else ""
    if kind.partition(":")[0] == "suffix":
        fallback = args.draft.strip().partition(":")[2]
        return f"suffix decoding ({args.tree_nodes} nodes)" + (f", fallback {fallback}{tree}" if fallback else "")
    return f"draft model {args.draft}{tree}"


def _warm_up(decoder, baseline) -> None:
    """A 2-token generation per decoder on a short prompt, so start-up costs leave the timings."""
    ids = decoder.encode("Hello, world. Hello, world.")[:16]
    for d in (baseline, decoder):
        if d is not None:
            d.generate(ids, max_new_tokens=2, seed=0, ignore_eos=True)


def _encode_job(args, decoder, job: _Job) -> tuple[_Job, bool, list[int]]:
    """(job, chat template used, prompt ids); PromptTooLongError when it cannot fit the context."""
    from specdecode.types import PromptTooLongError

    chat = args.chat if args.chat is not None else (job.chat_default and decoder.has_chat_template)
    prompt_ids = decoder.encode(job.text, chat=chat)
    context = decoder.target.max_context
    if len(prompt_ids) + args.max_new_tokens > context:
        raise PromptTooLongError(
            f"prompt {job.id!r} has {len(prompt_ids)} tokens; with --max-new-tokens {args.max_new_tokens} it "
            f"exceeds the model's context of {context} tokens: shorten the prompt or lower --max-new-tokens"
        )
    return job, chat, prompt_ids


def _run_job(args, decoder, baseline, job: _Job, chat: bool, prompt_ids: list[int], index: int, total: int) -> dict:
    """Baseline first (when asked), then the speculative run (streamed unless --json); print; return the record."""
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
                  json_schema=args.json_schema_text, regex=args.regex, **_sampling_kwargs(args))
    if not args.json:
        where = f" ({job.dataset}, {job.category})" if job.dataset else ""
        _rule(f"prompt {index + 1}/{total}: {job.id}{where}, {len(prompt_ids)} tokens, "
              f"chat template: {'yes' if chat else 'no'}")
    base_out = baseline.generate(prompt_ids, **kwargs) if baseline is not None else None
    on_text = None if args.json else _write_stdout
    out = decoder.generate(prompt_ids, on_text=on_text, **kwargs)
    record = _record(job, chat, out, base_out)
    record["sampled"] = args.temperature > 0
    record["weights"] = None if decoder.precision is None else decoder.precision.precision
    if base_out is not None and not record["matches_baseline"] and not record["sampled"]:
        record["difference"] = decoder.explain_difference(prompt_ids, out.token_ids, base_out.token_ids)
    if args.json:
        print(json.dumps(record, ensure_ascii=False), flush=True)
    else:
        _write_stdout("\n")
        _print_summary(record)
    return record


def _write_stdout(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


def _record(job: _Job, chat: bool, out, base_out) -> dict:
    """The JSON record of one prompt (also what the tables read)."""
    m = out.metrics
    rec = {
        "prompt_id": job.id,
        "dataset": job.dataset,
        "category": job.category,
        "chat": chat,
        "num_prompt_tokens": len(out.prompt_token_ids),
        "text": out.text,
        "token_ids": out.token_ids,
        "finish_reason": out.finish_reason,
        "num_generated_tokens": m.num_generated_tokens,
        "num_drafted_tokens": m.num_drafted_tokens,
        "num_accepted_tokens": m.num_accepted_tokens,
        "acceptance_rate": m.acceptance_rate,
        "mean_accepted_length": m.mean_accepted_length,
        "acceptance_by_position": m.acceptance_by_position,
        "num_target_forwards": m.num_target_forwards,
        "num_tree_steps": m.num_tree_steps,
        "mean_tree_size": m.mean_tree_size,
        "mean_accepted_depth": m.mean_accepted_depth,
        "prefill_time_s": m.prefill_time_s,
        "draft_time_s": m.draft_time_s,
        "verify_time_s": m.verify_time_s,
        "other_time_s": m.other_time_s,
        "wall_time_s": m.wall_time_s,
        "tokens_per_s": m.tokens_per_s,
        "mean_draft_length": m.mean_draft_length,
        "draft_length_histogram": m.draft_length_histogram,
    }
    if base_out is not None:
        b = base_out.metrics
        rec["baseline"] = {
            "token_ids": base_out.token_ids,
            "text": base_out.text,
            "num_generated_tokens": b.num_generated_tokens,
            "tokens_per_s": b.tokens_per_s,
            "wall_time_s": b.wall_time_s,
        }
        rec["speedup"] = m.tokens_per_s / b.tokens_per_s if b.tokens_per_s > 0 else None
        rec["matches_baseline"] = out.token_ids == base_out.token_ids
    return rec


# --------------------------------------------------------------------------- terminal reports


def _console():
    from rich.console import Console

    out = sys.stdout
    width = None if out.isatty() else 160  # files and pipes: wide enough for the tables
    return Console(file=out, highlight=False, soft_wrap=True, width=width)


def _rule(title: str) -> None:
    _console().print(f"── {title} ──", style="bold", markup=False)


def _print_summary(r: dict) -> None:
    """A few plain lines of one prompt's metrics."""
    positions = " ".join(f"{a:.2f}" for a in r["acceptance_by_position"]) or "-"
    lines = [
        f"tokens {r['num_generated_tokens']} (finish: {r['finish_reason']}) | drafted {r['num_drafted_tokens']} | "
        f"accepted {r['num_accepted_tokens']} | acceptance rate {r['acceptance_rate']:.1%} | "
        f"tau {r['mean_accepted_length']:.2f} tokens/forward",
        f"acceptance by position: {positions}",
        f"draft length per step (gamma): mean {r['mean_draft_length']:.2f}, histogram "
        + (" ".join(f"{g}:{n}" for g, n in r["draft_length_histogram"].items()) or "-"),
        *([f"token trees: {r['num_tree_steps']} steps, {r['mean_tree_size']:.1f} nodes per tree, accepted depth "
           f"{r['mean_accepted_depth']:.2f}"] if r.get("num_tree_steps") else []),
        f"target forwards {r['num_target_forwards']} | time: prefill {r['prefill_time_s']:.2f} s, "
        f"draft {r['draft_time_s']:.2f} s, verify {r['verify_time_s']:.2f} s, other {r['other_time_s']:.2f} s, "
        f"wall {r['wall_time_s']:.2f} s | {r['tokens_per_s']:.1f} tokens/s",
    ]
    if "baseline" in r:
        speedup = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
        lines.append(
            f"baseline (plain decoding, same engine): {r['baseline']['tokens_per_s']:.1f} tokens/s | "
            f"speedup {speedup} | output matches baseline: {'yes' if r['matches_baseline'] else 'NO'}"
            + ("" if r["matches_baseline"] or not r.get("sampled") else
               " (expected when sampling: the distribution is preserved, not the individual sample)")
        )
        if r.get("difference"):
            lines.append(r["difference"])
    console = _console()
    for line in lines:
        console.print(line, markup=False)


def _print_aggregate(records: list[dict], with_baseline: bool) -> None:
    """One table row per prompt and a median row."""
    from rich.table import Table

    table = Table(title=f"{len(records)} prompts", title_justify="left")
    columns = ["prompt", "tokens", "drafted", "accepted", "accept", "tau", "fwd", "tok/s"]
    if with_baseline:
        columns += ["base tok/s", "speedup", "match"]
    for c in columns:
        table.add_column(c, justify="left" if c == "prompt" else "right", no_wrap=c != "prompt",
                         overflow="fold")

    def row(name, tokens, drafted, accepted, rate, tau, fwd, tps, base=None, speedup=None, match=None):
        cells = [name, str(tokens), str(drafted), str(accepted), f"{rate:.1%}", f"{tau:.2f}", str(fwd), f"{tps:.1f}"]
        if with_baseline:
            cells += [f"{base:.1f}", "-" if speedup is None else f"{speedup:.2f}x", match]
        table.add_row(*cells)

    for r in records:
        row(r["prompt_id"], r["num_generated_tokens"], r["num_drafted_tokens"], r["num_accepted_tokens"],
            r["acceptance_rate"], r["mean_accepted_length"], r["num_target_forwards"], r["tokens_per_s"],
            *((r["baseline"]["tokens_per_s"], r["speedup"], "yes" if r["matches_baseline"] else "NO")
              if with_baseline else ()))

    def med(key, sub=None):
        vals = [(r[sub][key] if sub else r[key]) for r in records]
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None

    table.add_section()
    row("median", med("num_generated_tokens"), med("num_drafted_tokens"), med("num_accepted_tokens"),
        med("acceptance_rate"), med("mean_accepted_length"), med("num_target_forwards"), med("tokens_per_s"),
        *((med("tokens_per_s", "baseline"), med("speedup"),
           f"{sum(r['matches_baseline'] for r in records)}/{len(records)}") if with_baseline else ()))
    _console().print(table)


if __name__ == "__main__":
    sys.exit(main())
