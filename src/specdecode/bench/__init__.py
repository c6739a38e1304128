"""``specdecode bench``: a Spec-Bench-style benchmark of every method against plain decoding and the HF peer.

Modules: ``runner`` (the matrix, resume), ``records`` (records.jsonl), ``peer`` (transformers'
generate), ``llamacpp`` (llama.cpp peer), ``openvino`` / ``llamaserver`` (external peers, set up by
``peers``), ``summary`` (figures from records, with :mod:`specdecode.costmodel`'s Leviathan et al. 2023
predictions), ``report`` (Markdown / JSON / PNG), ``env`` (machine facts), ``roofline`` (bytes per step, read bandwidth, byte limit), ``smoke`` (tiny models for CI).

This module stays light (argparse only): the CLI builds its parser without importing torch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specdecode.cliargs import check_precision_flags
from specdecode.errors import SpecDecodeError
from specdecode.options import POLICY_NAMES, VERIFICATION_METHODS, WEIGHT_CHOICES, WEIGHT_PRECISIONS
from specdecode.paths import check_output_dir, removed_if_left_empty
from specdecode.validate import check_threads

PRESETS = ("full", "quick", "smoke")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``specdecode bench`` flags. Unset flags (None) take the preset's value."""
    presets = p.add_mutually_exclusive_group()  # --quick --smoke: one preset or the other
    presets.add_argument("--quick", action="store_const", dest="preset", const="quick",
                         help="preset: 10-15 minutes on 2 cores, SmolLM2-135M (n-gram, gamma 2 and 4, 2 prompts of 3 "
                              "Spec-Bench categories, 48 new tokens, 2 repeats)")
    presets.add_argument("--smoke", action="store_const", dest="preset", const="smoke",
                         help="preset: seconds on tiny random models built in code (what CI runs)")
    p.add_argument("--target", metavar="SPEC", help="target model spec (default: smollm2-135m)")
    p.add_argument("--draft", metavar="SPEC",
                   help="draft model for methods that take one (draft-model); without it they are skipped "
                        "unless named with model=SPEC")
    p.add_argument("--methods", metavar="LIST",
                   help="method specs separated by ';' (options use commas), e.g. "
                        "'ngram:k=5,max_ngram=4;draft-model:k=4'; default: every registered proposer. A method is "
                        "NAME[:k=GAMMA,OPTION=VALUE,...]: NAME from the proposer registry, OPTION a field of its config")
    p.add_argument("--method", action="append", metavar="SPEC", dest="method_list",
                   help="one method spec (repeatable), e.g. --method ngram:k=5 --method draft-model:k=4")
    p.add_argument("--dataset", action="append", metavar="SET", dest="datasets",
                   help="prompt set (repeatable or comma-separated): spec-bench, spec-bench:CATEGORY, humaneval, "
                        "mt-bench, gsm8k (default: all four)")
    p.add_argument("--limit", type=int, metavar="N", help="prompts per category (default: 5)")
    p.add_argument("--max-new-tokens", type=int, metavar="N", help="new tokens per prompt (default: 128)")
    p.add_argument("--temperature", type=float, metavar="T",
                   help="0 = greedy (default; outputs are checked against plain decoding and HF); > 0 samples")
    p.add_argument("--verification", choices=VERIFICATION_METHODS,
                   help="how our engine verifies sampled drafts (with --temperature > 0): token-wise rejection "
                        "sampling, block verification, or auto, as 'specdecode generate --verification' (default: "
                        "auto)")
    p.add_argument("--policy", choices=POLICY_NAMES,
                   help="draft-length policy of every method, as 'specdecode generate --policy': auto = cost-model "
                        "for ngram (drafts cut per step to what their match length pays for, at most k), fixed k "
                        "for the others (default: auto)")
    p.add_argument("--seed", type=int, metavar="N", help="base seed; prompt i uses seed + i (default: 0)")
    p.add_argument("--gamma", type=int, metavar="G", help="draft length of methods without k= (default: 4)")
    p.add_argument("--gammas", metavar="LIST",
                   help="gamma sweep, e.g. 1,2,4,8: every method also runs at each (tau / speedup against gamma, "
                        "best gamma measured and predicted)")
    p.add_argument("--peer", action=argparse.BooleanOptionalAction, default=None,
                   help="also run Hugging Face generate: plain, assisted (draft-model), prompt lookup (ngram) "
                        "(default: on)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="chat template on chat prompts when the model has one (default: on; HumanEval never)")
    p.add_argument("--probe", action=argparse.BooleanOptionalAction, default=None,
                   help="time target forwards of k+1 tokens, T_verify(k), for the cost model (default: on)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="one unrecorded short run per variant first (default: on)")
    p.add_argument("--repeats", type=int, metavar="N",
                   help="run every (prompt, variant) N times, interleaved, and keep the fastest: noise on a shared "
                        "machine only adds time (default: 1; --quick: 2)")
    p.add_argument("--dtype", metavar="DTYPE", choices=("float32", "bfloat16", "float16"),
                   help="float32 (default), bfloat16, float16")
    p.add_argument("--kernel", choices=("default", "small-row"),
                   help="linear-layer execution: default (HF as shipped) or small-row (W @ x.T for few rows, "
                        "specdecode.kernels; applied to target and drafts, so the HF peer gets it too); float "
                        "weights only: the low-bit kernels' instruction-set variant is SPECDECODE_KERNEL_ISA")
    p.add_argument("--weights", choices=WEIGHT_CHOICES,
                   help="precision the target's weights execute in (auto: what generate / serve pick, measured "
                        "once per machine; int8: weight-only int8 groups; int4: the GGUF file's own 4-bit blocks; plain decoding, "
                        "every method and the HF peer run the same target object, so outputs are compared like "
                        "for like) (default: auto, what generate / serve run; fp32 is the float reference)")
    p.add_argument("--llama-cpp", action="store_true", default=None,
                   help="also run llama.cpp (llama-cpp-python) on the target's GGUF file: plain decoding and its "
                        "prompt lookup as the n-gram method's peer, timed the same way (optional dependency)")
    p.add_argument("--openvino", action="store_true", default=None,
                   help="also run OpenVINO GenAI (its own venv, int8 exports of target and draft): plain, "
                        "draft-model assisted generation and prompt lookup as peers of draft-model / ngram "
                        "(set up first with --setup-peers openvino)")
    p.add_argument("--openvino-weights", choices=("int8", "int4", "fp16"),
                   help="weight format of the OpenVINO exports, for --openvino and --setup-peers (default: int8)")
    p.add_argument("--llama-server", action="store_true", default=None,
                   help="also run llama.cpp's C++ llama-server on the catalog's GGUF files: plain, a draft model "
                        "(-md) and ngram-simple lookup as peers of draft-model / ngram (build it first with "
                        "--setup-peers llama-server)")
    p.add_argument("--setup-peers", nargs="?", const="all", metavar="LIST",
                   help="set up the external peers and exit: 'openvino' (venv under $SPECDECODE_CACHE/peers/openvino "
                        "and OpenVINO exports of --target and --draft), 'llama-server' (built from the "
                        "llama-cpp-python sdist with cmake into $SPECDECODE_CACHE/peers/llama.cpp), comma-separated, "
                        "or all (the default); slow, runs niced, skips what is done")
    p.add_argument("--draft-weights", choices=WEIGHT_PRECISIONS,
                   help="precision of draft models' weights (int8 / int4 as --weights: fewer bytes per draft step; "
                        "the HF peer uses the same draft objects) (default: the target's, as in generate / serve)")
    p.add_argument("--threads", type=_bench_threads, metavar="N|auto",
                   help="torch threads, 1..the cores this process may use, or auto (one per core other processes leave "
                        "idle, sampled once at the start); every engine of the run gets this count (default: torch's, "
                        "every core: unlike generate / serve, which take auto, a benchmark keeps one count run to run)")
    p.add_argument("--remeasure-bandwidth", action="store_true", default=None,
                   help="measure the memory read bandwidth of the report's roofline table again (it is measured "
                        "once per machine and thread count and cached under the specdecode cache's machine/)")
    p.add_argument("--output", metavar="DIR",
                   help="report directory; rerunning with the same directory resumes (default: bench-out/PRESET)")
    p.add_argument("--verify-table", action="store_true",
                   help="instead of the method matrix: the cost of verifying k = 1, 2, 3, 4, 6, 8, 16 tokens, T(k) / "
                        "T(1), for --target (and --draft) on the GGUF file's own blocks, beside llama-bench's on the "
                        "same file (interleaved; --no-peer: ours alone), and plain decoding against the byte limit; "
                        "writes verify_table.md / .json in --output")
    p.add_argument("--depths", metavar="LIST",
                   help="with --verify-table: tokens of context before each forward, e.g. 256,2000 (default: 256)")
    p.add_argument("--report-only", action="store_true",
                   help="rebuild report.md / report.json / plots from DIR's records without running anything")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace):
    """A BenchConfig: the preset's values, overridden by every flag the user gave.

    Raises:
        SpecDecodeError: malformed lists, out-of-range numbers.
    """
    check_precision_flags(args.dtype, args.weights, args.draft_weights)  # both given and contradictory
    # lazy: these pull in torch (start-up time)
    from specdecode.bench.runner import BenchConfig, quick_config, smoke_config
    from specdecode.types import SpecDecodeError

    preset = args.preset or "full"
    over: dict = {}
    for name in ("target", "draft", "limit", "max_new_tokens", "temperature", "verification", "policy", "seed", "gamma",
                 "peer", "chat",
                 "probe", "warmup", "repeats", "dtype", "kernel", "draft_weights", "weights", "llama_cpp", "openvino",
                 "openvino_weights", "llama_server", "threads",
                 "remeasure_bandwidth", "output"):
        value = getattr(args, name, None)
        if value is not None:
            over[name] = value
    methods = [m for m in (args.methods or "").split(";") if m.strip()] + list(args.method_list or [])
    if methods:
        over["methods"] = tuple(m.strip() for m in methods)
    if args.datasets:
        over["datasets"] = tuple(d.strip() for item in args.datasets for d in item.split(",") if d.strip())
    if args.gammas:
        try:
            over["gammas"] = tuple(int(g) for g in args.gammas.split(",") if g.strip())
        except ValueError:
            raise SpecDecodeError(f"--gammas must be integers separated by commas, got {args.gammas!r}") from None
    factory = {"quick": quick_config, "smoke": smoke_config}.get(preset)
    if factory is not None:
        return factory(**over)
    return BenchConfig(**{"output": "bench-out/full", **over})


def _bench_threads(text: str) -> int | str:
    """``bench --threads``: a whole number, or ``auto`` (resolved once, at the start of the run)."""
    value = str(text).strip().lower()
    if value == "auto":
        return "auto"
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of threads or auto, got {text!r}") from None


def resolve_auto_threads(args: argparse.Namespace, auto=None) -> None:
    """``--threads auto`` -> one count for the whole run (every engine and peer), fixed here and said on stderr.
    ``auto``: () -> (threads, note), :func:`specdecode.threads.auto_threads` by default."""
    if args.threads == "auto":
        if auto is None:
            from specdecode.threads import auto_threads as auto
        args.threads, note = auto()
        print(f"specdecode: --threads auto: {args.threads}" + (f" ({note})" if note else ""), file=sys.stderr)


def run_command(args: argparse.Namespace) -> int:
    """Entry point of ``specdecode bench`` (called by ``specdecode.cli``); returns the exit status."""
    resolve_auto_threads(args)
    check_threads(args.threads, auto="--threads auto")  # 1..the cores this process may use, whatever the mode

    if getattr(args, "setup_peers", None):
        # lazy: specdecode.bench.peers pulls in torch (start-up time)
        from specdecode.bench.peers import parse_peers, setup_peers

        names = parse_peers(args.setup_peers)
        models = [args.target or "smollm2-135m", *([args.draft] if args.draft else [])]
        setup_peers(names, models, args.openvino_weights or "int8")
        return 0
    if getattr(args, "verify_table", False):
        # lazy: the package imports its submodules only when a command runs them (start-up time)
        from specdecode.bench.verifytable import run_table

        try:
            depths = tuple(int(d) for d in (args.depths or "256").split(",") if d.strip())
        except ValueError:
            raise SpecDecodeError(f"--depths must be integers separated by commas, got {args.depths!r}") from None
        if not depths or min(depths) < 1:
            raise SpecDecodeError(f"--depths must be positive token counts, got {args.depths!r}")
        out = check_output_dir(args.output or "bench-out/verify-table", "--output", default=args.output is None)
        models = [args.target or "smollm2-135m", *([args.draft] if args.draft else [])]
        with removed_if_left_empty(out):  # a failed run (no llama-bench, a model without GGUF) leaves nothing
            run_table(models, out, depths=depths, repeats=args.repeats or 5, threads=args.threads,
                      peer=args.peer is not False)
        print((out / "verify_table.md").read_text(encoding="utf-8"))
        return 0
    if args.report_only:
        out = Path(args.output or f"bench-out/{args.preset or 'full'}")
        if out.is_dir():  # a folder without a run is said below; one that cannot take the report here
            check_output_dir(out, "--output")
        # lazy: specdecode.bench.report pulls in numpy (start-up time)
        from specdecode.bench import report

        try:
            report.rebuild(out)
        except FileNotFoundError:
            raise SpecDecodeError(f"{out} holds no benchmark run (no run.json); run the benchmark first") from None
        print((out / report.REPORT_MD).read_text(encoding="utf-8"))
        return 0
    if args.output is not None:  # before torch is imported: a named folder must exist and take files
        check_output_dir(args.output, "--output")
    config = config_from_args(args)
    if args.output is None:  # the preset's own folder (bench-out/PRESET), made with its parents
        check_output_dir(config.output, "--output", default=True)
    # lazy: these pull in numpy, torch (start-up time)
    from specdecode.bench import report
    from specdecode.bench.runner import run_bench

    with removed_if_left_empty(config.output):  # a run that fails before its first record leaves nothing
        try:
            run_bench(config, progress=not args.no_progress)
        except KeyboardInterrupt:
            if (Path(config.output) / "records.jsonl").is_file():
                print(f"specdecode bench: interrupted; the runs done are kept in {config.output}/records.jsonl and the "
                      "report there is partial: the same command resumes where this one stopped", file=sys.stderr)
            raise
    print((Path(config.output) / report.REPORT_MD).read_text(encoding="utf-8"))
    return 0


__all__ = ["PRESETS", "add_arguments", "config_from_args", "run_command"]
