"""The flags and the runs of ``specdecode audit``, ``train-drafter`` and ``tune`` (``specdecode.cli`` puts them in
its parser)."""

from __future__ import annotations

import argparse
import re
import sys

from specdecode.audit.config import (
    MAX_SAMPLES,
    MAX_TOKENS,
    MIN_SAMPLES,
    AuditConfig,
    AuditSetup,
    check_concurrency,
    check_temperature,
)
from specdecode.cli_generate import naming_flags, read_jobs, sampling_kwargs
from specdecode.cliargs import HelpFormatter as _HelpFormatter
from specdecode.cliargs import UsageError
from specdecode.cliargs import (
    add_drafter_arguments,
    add_sampling_arguments,
    add_tune_arguments,
    check_drafter_flags,
    check_threads,
    set_threads,
)
from specdecode.cliargs import status as _status
from specdecode.data import SharedDataMissing, load_prompts
from specdecode.options import DEFAULT_TARGET
from specdecode.paths import check_output_dir
from specdecode.spec import DrafterSpec
from specdecode.tune import DRAFTER_KINDS, TuneConfig, check_output
from specdecode.validate import check_engine, check_sampling  # the library's own checks, without torch


def add_train_drafter(commands) -> None:
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


def add_audit(commands) -> None:

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

    check_drafter_flags(args)
    if args.endpoint is not None and not args.model:
        raise UsageError("--endpoint needs --model NAME, the model id the server serves (see its GET /v1/models)")
    if args.local and args.model:
        raise UsageError("--model names an endpoint's model; with --local give the model with --target")
    if args.timeout <= 0:
        raise UsageError(f"--timeout must be > 0 seconds, got {args.timeout}")
    with naming_flags():
        check_temperature(args.temperature)
        check_concurrency(args.concurrency)
        check_sampling(args.temperature, args.top_k, args.top_p, args.max_new_tokens, None, **sampling_kwargs(args))
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
    jobs = read_jobs(args)
    chat = [args.chat if args.chat is not None else (None if job.chat_default else False) for job in jobs]
    sampling = {k: v for k, v in sampling_kwargs(args).items() if k != "coupled"}
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
    from specdecode.audit.runner import run_audit  # lazy: torch and the model stack load only when the command runs

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
        import torch  # lazy: torch and the model stack load only when the command runs

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is available to this torch build; use --device cpu")
    from specdecode.eagle.train import TrainConfig, run  # lazy: torch and the model stack load only when the command runs

    cfg = TrainConfig(num_prompts=args.prompts, mix=args.mix, max_new_tokens=args.max_new_tokens,
                      max_length=args.max_length, temperature=args.temperature, draft_vocab_size=args.draft_vocab,
                      ttt_steps=args.ttt_steps, epochs=args.epochs, lr=args.lr, batch_tokens=args.batch_tokens,
                      train_lm_head=args.train_lm_head, device=args.device, threads=args.threads, seed=args.seed,
                      intermediate_size=args.head_intermediate)
    run(args.target, cfg, out=args.out, work_dir=args.work_dir, weights=args.weights, cache_dir=args.cache_dir,
        estimate_prompts=None if args.no_estimate else "spec-bench",
        max_train_seconds=None if args.max_train_minutes is None else 60 * args.max_train_minutes)
    return 0


def add_tune(commands) -> None:

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
    datasets = tuple(d.strip() for item in (args.datasets or ()) for d in item.split(",") if d.strip())
    drafters = (DRAFTER_KINDS if args.drafters is None  # --drafters '': refused as empty, not taken for all
                else tuple(d.strip() for d in args.drafters.split(",") if d.strip()))
    check_threads(args.threads)
    check_output(args.output, default=False)  # the settings file and its .json, before anything is measured
    with naming_flags():  # "--max-new-tokens: max_new_tokens must be ...", as generate says it
        config = _tune_config(args, datasets, drafters)
    from specdecode.tune.measure import run_tune  # lazy: torch and the model stack only to run the tune

    run_tune(config, progress=not args.no_progress)
    return 0


def _tune_config(args: argparse.Namespace, datasets: tuple[str, ...], drafters: tuple[str, ...]):
    return TuneConfig(target=args.target, drafts=tuple(args.drafts or ()), datasets=datasets,
                      prompts_file=args.prompts_file, budget_s=args.budget_s, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, threads=args.threads, weights=args.weights,
                      draft_weights=args.draft_weights, dtype=args.dtype, max_gamma=args.max_gamma,
                      drafters=drafters, top=args.top, repeats=args.repeats, sample_prompts=args.sample_prompts,
                      confirm_prompts=args.confirm_prompts, min_gain=args.min_gain, tree_nodes=args.tree_nodes,
                      layer_search_s=args.layer_search_s, chat=args.chat, seed=args.seed,
                      cache_dir=args.cache_dir, output=args.output)
