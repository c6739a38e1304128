"""The drafter and precision flags shared by ``specdecode generate`` and ``specdecode serve`` (one copy),
and the rest of ``specdecode serve``'s flags.

Both front ends run the same engine with the same drafters, so they take the same flags with the same
meaning; only their defaults may differ (``policy_default``). argparse lives at the edges (DESIGN.md
rule 5): this module, ``cli.py`` / ``cli_generate.py`` / ``cli_commands.py`` and ``server/launch.py`` are its only users. It stays light (only
:mod:`specdecode.options`, no torch, no server stack), so ``--help`` and argument errors answer at once.
"""

from __future__ import annotations

import argparse
import sys

from specdecode.errors import SpecDecodeError
from specdecode.spec import FLAG_DEFAULTS, MODEL_KINDS, DrafterSpec
from specdecode.threads import auto_threads, busy_cores, set_threads  # noqa: F401 - the command line's, re-exported
from specdecode.validate import check_threads, usable_cores  # noqa: F401 - check_threads re-exported (the CLI's)
from specdecode.options import (
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_TARGET,
    DEFAULT_TREE_NODES,
    DTYPES,
    FORWARD_BACKENDS,
    POLICY_NAMES,
    SAMPLING_MODES,
    TREE_KINDS,
    VERIFICATION_METHODS,
    WEIGHT_CHOICES,
    WEIGHT_PRECISIONS,
)

#: What ``--draft`` takes, for help texts.
DRAFT_CHOICES_HELP = ("'ngram' (prompt lookup, no model), 'none' (plain decoding), 'layer-skip' (self-speculation: "
                      "the target drafts with some decoder layers skipped, no second model), 'suffix' (suffix decoding, "
                      "no model), 'suffix:ngram' or 'suffix:MODEL' (suffix decoding, falling back to that drafter "
                      "when the suffix match is weak), 'eagle' (a trained feature-level head on the target's hidden "
                      "states: the one 'specdecode train-drafter' left in the cache for a target of this shape, "
                      "else the one shipped in the package), "
                      "'eagle:DIR' (a head checkpoint), or a draft model spec")


class UsageError(SpecDecodeError):
    """A command-line mistake found by argparse (unknown flag, bad number, ...)."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The subcommands' help: descriptions as written, flags in a column 32 wide."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32)



def threads_arg(text: str) -> int | None:
    """``--threads`` as given: a whole number (checked against the cores later), or ``auto`` (None: one per idle core,
    as without the flag; the library's ``threads='auto'``)."""
    value = str(text).strip().lower()
    if value == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of threads or auto, got {text!r}") from None

def status(message: str) -> None:
    """One status line of the command line, on standard error."""
    print(f"specdecode: {message}", file=sys.stderr, flush=True)


#: What each explicit --weights does to the weights --dtype loaded, for the refusal of a contradiction.
_WEIGHTS_DO = {"fp32": "runs float32 weights", "bf16": "runs bfloat16 weights",
               "int8": "quantizes float32 weights to int8", "int4": "runs the GGUF file's 4-bit blocks"}


def _draft_kind(draft: str | None) -> str:
    """The drafter a --draft value runs, read as the drafter spec reads it (suffix decoding: its fallback's
    kind): "model" when it loads a draft model (or cannot be read: the spec refuses it later, in its own words),
    else the kind ("none", "ngram", "layer-skip", "eagle", "suffix")."""
    try:
        spec = DrafterSpec.parse(draft or "none")
    except SpecDecodeError:
        return "model"
    inner = spec.fallback if spec.kind == "suffix" and spec.fallback is not None else spec
    return "model" if spec.model_spec is not None or inner.kind in MODEL_KINDS else inner.kind


def check_precision_flags(dtype: str | None, weights: str | None, draft_weights: str | None) -> None:
    """Refuse an explicit precision that contradicts --dtype (None / "auto" = not given, always fine).

    --dtype loads the weights; an explicit --weights / --draft-weights then sets what they run in. A
    non-float32 load under fp32, int8 or another half type would be silently rounded first (or not be
    float32 at all), so only --dtype float32 (the default) or --dtype bfloat16 with bf16 go with one.

    Raises:
        SpecDecodeError: one line that says which flag to drop.
    """
    for flag, value in (("--weights", weights), ("--draft-weights", draft_weights)):
        if dtype in (None, "float32") or value in (None, "auto") or (dtype, value) == ("bfloat16", "bf16"):
            continue
        instead = f" (or use {flag} bf16)" if dtype == "bfloat16" and value == "fp32" else ""
        raise SpecDecodeError(f"{flag} {value} {_WEIGHTS_DO.get(value, 'sets the precision')}, but --dtype {dtype} "
                              f"loads them in {dtype}: drop --dtype{instead}")


def check_drafter_flags(args: argparse.Namespace) -> None:
    """Refuse drafter / precision flags that contradict each other, before anything is imported or loaded.

    Raises:
        SpecDecodeError: --skip-layers without --draft layer-skip, --draft-weights with a drafter that
            loads no draft model, a precision that contradicts --dtype (:func:`check_precision_flags`).
    """
    kind = _draft_kind(args.draft)
    if args.skip_layers is not None and kind != "layer-skip":
        raise SpecDecodeError(f"--skip-layers chooses the layers --draft layer-skip skips, but --draft is "
                              f"{args.draft!r}: add --draft layer-skip, or drop --skip-layers")
    if args.draft_weights is not None and kind != "model":
        raise SpecDecodeError(f"--draft-weights sets a draft model's precision, but --draft {args.draft!r} loads no "
                              "draft model: drop --draft-weights (--weights sets the target's)")
    check_precision_flags(args.dtype, args.weights, args.draft_weights)



def logit_bias_entry(text: str) -> tuple[int, float]:
    """One ``--logit-bias ID=BIAS`` value: (token id, bias); the ranges are checked with the others.

    Raises:
        argparse.ArgumentTypeError: not ``INTEGER=NUMBER``.
    """
    tok, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(tok), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS like 50256=-100, got {text!r}") from None


def add_sampling_arguments(group: argparse._ArgumentGroup) -> None:
    """The sampling flags of ``specdecode generate`` beyond temperature / top-k / top-p / seed: min-p, the
    penalties, logit biases, min tokens, stop token ids and the sampling mode (``SamplingParams``' fields;
    all applied identically to the target's and the drafter's distributions, so nothing is lost)."""
    group.add_argument("--min-p", type=float, default=0.0, metavar="P",
                       help="drop tokens less likely than P times the most likely one, in [0, 1]; 0 disables "
                            "(default: %(default)s)")
    group.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                       help="divide the (positive) logit of every token already in the prompt or the output by R, "
                            "in (0, 100]; > 1 discourages repeats, 1 disables (default: %(default)s)")
    group.add_argument("--presence-penalty", type=float, default=0.0, metavar="X",
                       help="subtract X from the logit of every token already generated, in [-2, 2] (OpenAI's); "
                            "0 disables (default: %(default)s)")
    group.add_argument("--frequency-penalty", type=float, default=0.0, metavar="X",
                       help="subtract X times its count so far from each generated token's logit, in [-2, 2] "
                            "(OpenAI's); 0 disables (default: %(default)s)")
    group.add_argument("--logit-bias", type=logit_bias_entry, action="append", default=None, metavar="ID=BIAS",
                       help="add BIAS in [-100, 100] to token ID's logit; -100 bans it, +100 all but forces it. "
                            "Repeatable")
    group.add_argument("--min-tokens", type=int, default=0, metavar="N",
                       help="hold back the end-of-sequence token (and --stop-token-id ones) until N tokens were "
                            "generated (default: %(default)s)")
    group.add_argument("--stop-token-id", type=int, action="append", default=None, metavar="ID", dest="stop_token_ids",
                       help="also stop at this token id, like end-of-sequence (the token is kept). Repeatable")
    group.add_argument("--sampling-mode", default="auto", choices=tuple(SAMPLING_MODES),
                       help="how sampled drafts are accepted (the output distribution is the target's in every "
                            "mode): standard = rejection sampling with the request's own random generator; "
                            "coupled = every random draw keyed by (seed, position, purpose), so a seeded "
                            "speculative run reproduces seeded plain decoding token for token, whatever the "
                            "drafter or gamma; auto = coupled when --seed is given, standard otherwise "
                            "(default: %(default)s)")


def add_drafter_arguments(group: argparse._ArgumentGroup, *, policy_default: str = "auto",
                          gamma_help: str = "gamma: tokens drafted per step, 1..64",
                          policy_group: argparse._ActionsContainer | None = None) -> None:
    """Add --draft, -k, --ngram-min/max, --skip-layers, --policy, --tree, --tree-nodes, --verification, --dtype,
    --weights, --draft-weights and --cache-dir to ``group`` (--policy to ``policy_group`` when given: serve's
    mutually exclusive group with --adaptive / --no-adaptive)."""
    group.add_argument("--draft", default=FLAG_DEFAULTS["draft"], metavar="SPEC",
                       help=f"the proposer: {DRAFT_CHOICES_HELP}; a draft model with another tokenizer "
                            "drafts across vocabularies (said at start-up) (default: %(default)s)")
    group.add_argument("-k", "--num-speculative-tokens", "--gamma", type=int,
                       default=FLAG_DEFAULTS["num_speculative_tokens"], metavar="N",
                       help=f"{gamma_help}; --gamma is the same flag (the status line and bench say gamma) "
                            "(default: %(default)s)")
    group.add_argument("--ngram-min", type=int, default=FLAG_DEFAULTS["ngram_min"], metavar="N",
                       help="shortest n-gram the ngram drafter matches (default: %(default)s)")
    group.add_argument("--ngram-max", type=int, default=FLAG_DEFAULTS["ngram_max"], metavar="N",
                       help="longest n-gram the ngram drafter matches, tried first (default: %(default)s)")
    group.add_argument("--skip-layers", default=None, metavar="LIST",
                       help="with --draft layer-skip: decoder layers to skip, e.g. 3,5,7 (default: the set cached for "
                            "the model, else a search on the first prompts, cached in the --cache-dir)")
    policies = policy_group or group
    policies.add_argument("--policy", default=policy_default, choices=POLICY_NAMES, type=str.lower,
                          help="draft-length policy: fixed gamma (-k); heuristic (+2 after a fully accepted step, -1 "
                               "otherwise); confidence (draft up to max(2k, 8) while the draft is sure); cost-model "
                               "(gamma maximising tokens/s measured online per batch size, 0 = plain decoding when "
                               "speculation loses; ngram drafts cut per step to the prefix their "
                               "match length's acceptance pays for, at most -k, a batch's rows together); auto: "
                               "cost-model for ngram, fixed "
                               "for the others (default: %(default)s)")
    group.add_argument("--tree", default=FLAG_DEFAULTS["tree"], choices=TREE_KINDS,
                       help="token trees from the draft model or head, verified in one target pass: 'static' (top-k "
                            "branching per depth) or 'dynamic' (EAGLE-2: expand the most probable nodes, keep the "
                            "best N); -k caps the depth (default: %(default)s = chains)")
    group.add_argument("--tree-nodes", type=int, default=FLAG_DEFAULTS["tree_nodes"], metavar="N",
                       help="node budget N of --tree and of suffix decoding, 1..64; 15 nodes and the root fill one "
                            "16-row verification block, 16 would cost two (default: %(default)s)")
    group.add_argument("--verification", default="auto", choices=VERIFICATION_METHODS,
                       help="how sampled draft chains are verified, both keeping the target's distribution: token "
                            "(token-wise rejection sampling, Leviathan et al. 2023), block (block verification, "
                            "Sun et al. 2024: the draft judged as a whole, at least as many tokens accepted), or "
                            "auto (block for drafters that sample, token-wise for deterministic ones, where block "
                            "keeps no more); greedy decoding is unaffected (default: %(default)s)")
    group.add_argument("--dtype", default="float32", choices=DTYPES,
                       help="dtype the weights are loaded in; bfloat16 halves the bytes and verifies k tokens at "
                            "about one step's cost on AVX512-BF16 CPUs (see also --weights) (default: %(default)s)")
    group.add_argument("--weights", default="auto", choices=WEIGHT_CHOICES,
                       help="precision the target's weights execute in. auto (default): for a GGUF model (the "
                            "catalog's, or a .gguf path) on an x86 CPU with AVX2, int4 at once; otherwise the fastest "
                            "precision that keeps the model (next-token agreement with float32 >= 97%%, perplexity "
                            "within 1%%) and keeps speculative output equal to plain decoding, measured at first load "
                            "and cached per machine; fp32: float32 as converted (the reference, slow few-row products "
                            "on most CPUs); bf16: half the bytes, batch-invariant forward; int4: the GGUF file's own "
                            "blocks as stored (Q4_K, Q6_K, Q4_0, Q4_1, Q5_0, Q8_0: 4.5 to 8.5 bits per weight, the "
                            "model itself), run by the project's kernel with 8-bit activations per row, as llama.cpp "
                            "runs the file; int8: Q8_0 blocks quantized from the float weights (8.5 bits per weight); "
                            "a model without a GGUF file is quantized from its float weights for int4 too (Q4_1), "
                            "which changes it. int4 / int8 are cached next to the converted copy after the first "
                            "load and keep speculative output equal to plain decoding by construction "
                            "(SPECDECODE_KERNEL_ISA=reference runs int4 on the slow torch reference: auto then "
                            "measures and may pick bf16)")
    group.add_argument("--draft-weights", default=None, choices=WEIGHT_PRECISIONS,
                       help="precision of the draft model's weights (default: the target's, i.e. what --weights "
                            "auto picked). int8 / int4: as --weights, fewer bytes per draft step; a "
                            "draft's precision changes speed only, never the output distribution")
    group.add_argument("--cache-dir", metavar="DIR",
                       help="where converted GGUF models (and layer-skip sets) are cached (default: "
                            "$SPECDECODE_CACHE or ~/.cache/specdecode)")
    group.add_argument("--threads", type=threads_arg, default=None, metavar="N",
                       help="torch threads, 1..the cores this process may use, or auto (the default: one per core that other "
                            "processes leave idle, sampled at start: threads on busy cores wait on each other and a step can run 10x slower; "
                            "--weights auto measures, and caches, per thread count)")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``specdecode serve`` (also ``python -m specdecode.server``); the drafter and precision
    flags are those of ``specdecode generate``. The defaults are ``server.launch.ServeOptions``' (a test
    keeps the two in step)."""
    models = p.add_argument_group("models and drafting")
    models.add_argument("--target", default=DEFAULT_TARGET, metavar="SPEC",
                        help="the model served; its output distribution is preserved (default: %(default)s)")
    policy = models.add_mutually_exclusive_group()  # --policy heuristic --adaptive: which one? refused
    add_drafter_arguments(models, policy_default="cost-model", policy_group=policy,
                          gamma_help="gamma: tokens drafted per request per step with --policy fixed, the starting "
                                     "gamma of the others, 1..64")
    policy.add_argument("--adaptive", dest="policy", action="store_const", const="cost-model",
                        help="the same as --policy cost-model")
    policy.add_argument("--no-adaptive", dest="policy", action="store_const", const="fixed",
                        help="the same as --policy fixed")
    models.add_argument("--forward", default="auto", choices=FORWARD_BACKENDS,
                        help="target forward: the project's own Llama / Qwen2 forward where supported (auto, "
                             "owned) or Hugging Face's (hf) (default: %(default)s)")
    models.add_argument("--served-model-name", metavar="NAME",
                        help="the model id clients send (default: the --target spec)")
    srv = p.add_argument_group("server")
    srv.add_argument("--host", default="127.0.0.1",
                     help="address to bind (default: %(default)s, loopback only; 0.0.0.0 exposes it)")
    srv.add_argument("--port", type=int, default=8000, help="default: %(default)s")
    srv.add_argument("--api-key", metavar="KEY",
                     help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    srv.add_argument("--max-batch-size", type=int, default=8, metavar="N",
                     help="requests decoded together in one batched forward, 1..256 (default: %(default)s)")
    srv.add_argument("--max-queue", type=int, default=64, metavar="N",
                     help="requests waiting for a batch slot; more get HTTP 429 (default: %(default)s)")
    srv.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="N",
                     help="largest request body; larger ones get HTTP 413 (default: %(default)s = 1 MiB)")
    srv.add_argument("--default-max-tokens", type=int, default=256, metavar="N",
                     help="max_tokens of a chat request that gives none (default: %(default)s)")
    srv.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                     help="server log level (default: %(default)s)")
    rep = p.add_argument_group("replicas (Ray Serve; pip install -e \".[ray]\")",
                               "Any of these serves N replicas of the engine behind one endpoint on Ray Serve "
                               "(docs/scaling.md); --threads then counts per replica.")
    rep.add_argument("--replicas", type=int, default=None, metavar="N",
                     help="engine replicas (the initial count when autoscaling); default: one process, no Ray")
    rep.add_argument("--min-replicas", type=int, default=None, metavar="N",
                     help="autoscaling: fewest replicas (turns autoscaling on)")
    rep.add_argument("--max-replicas", type=int, default=None, metavar="N",
                     help="autoscaling: most replicas (turns autoscaling on)")
    rep.add_argument("--target-ongoing-requests", type=float, default=None, metavar="X",
                     help="autoscaling: requests per replica (running + queued) the autoscaler aims at "
                          "(default: --max-batch-size)")
    rep.add_argument("--router", default="power-of-two", choices=("power-of-two", "prefix"),
                     help="power-of-two: Ray Serve's own (two random replicas, the shorter queue wins); prefix: "
                          "requests sharing a prompt prefix or a conversation go to one replica, so its suffix tree "
                          "and caches stay warm (default: %(default)s)")
    rep.add_argument("--prefix-chars", type=int, default=256, metavar="N",
                     help="--router prefix: prompt characters that make the routing key (default: %(default)s)")
    rep.add_argument("--route-imbalance", type=int, default=8, metavar="N",
                     help="--router prefix: leave the preferred replica when its queue is N requests longer than the "
                          "shortest (default: %(default)s)")
    rep.add_argument("--replica-retries", type=int, default=2, metavar="N",
                     help="retries on another replica of a request whose replica failed before any output "
                          "(default: %(default)s)")
    rep.add_argument("--ray-address", metavar="ADDR",
                     help="join a running Ray cluster ('auto', HOST:6379 or ray://HOST:10001) instead of starting a "
                          "local one")
    rep.add_argument("--ray-config", metavar="FILE",
                     help="a Ray Serve config file (YAML, the format of 'serve deploy'): its http_options and the "
                          "settings of the SpecdecodeEngine / SpecdecodeIngress deployments override the flags")
    rep.add_argument("--cpus-per-replica", type=float, default=None, metavar="X",
                     help="Ray CPUs each replica reserves (default: its --threads)")


def add_tune_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``specdecode tune`` (``specdecode.tune.TuneConfig``'s fields; its defaults are these)."""
    models = p.add_argument_group("models")
    models.add_argument("--target", default=DEFAULT_TARGET, metavar="SPEC",
                        help="the model whose output distribution is preserved (default: %(default)s)")
    models.add_argument("--draft", action="append", default=None, metavar="MODEL", dest="drafts",
                        help="a draft model to try (repeatable): the same tokenizer as the target, or another one "
                             "(then it drafts across vocabularies); model-free drafters and a trained head are "
                             "always tried")
    models.add_argument("--drafters", default=None, metavar="LIST",
                        help="which drafters to try, comma-separated, of: ngram, suffix, layer-skip, eagle, "
                             "draft-model (default: all of them; draft-model = every --draft)")
    models.add_argument("--weights", default="auto", choices=WEIGHT_CHOICES,
                        help="precision the target runs in, as 'generate --weights' (default: %(default)s)")
    models.add_argument("--draft-weights", default=None, choices=WEIGHT_PRECISIONS,
                        help="precision of the draft models (default: the target's)")
    models.add_argument("--dtype", default="float32", choices=DTYPES, help="dtype the weights load in "
                        "(default: %(default)s)")
    models.add_argument("--threads", type=threads_arg, default=None, metavar="N",
                        help="torch threads, 1..the cores this process may use, or auto (the default: one per core "
                             "other processes leave idle)")
    models.add_argument("--cache-dir", metavar="DIR",
                        help="model cache (default: $SPECDECODE_CACHE or ~/.cache/specdecode)")
    prompts = p.add_argument_group("prompts (one of --prompts, --dataset)")
    source = prompts.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompts", metavar="FILE", dest="prompts_file",
                        help="your prompts: .jsonl (a string or {\"prompt\": ...} per line), .json (a list of "
                             "them) or text (prompts separated by lines of '---'; else one per line)")
    source.add_argument("--dataset", action="append", metavar="SPEC", dest="datasets",
                        help="prompt sets, comma-separated or repeated: spec-bench[:CATEGORY][:N], humaneval[:N], "
                             "mt-bench[:CATEGORY][:N], gsm8k[:N]")
    prompts.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                         help="chat template on chat prompts (default: on for prompt sets, off for --prompts)")
    runs = p.add_argument_group("measurement")
    runs.add_argument("--budget", type=float, default=600.0, metavar="SECONDS", dest="budget_s",
                      help="wall-clock budget of the whole run, loading included: measuring stops at 60%% of it "
                           "(what was skipped is said), confirming at 100%% (default: %(default)s)")
    runs.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                      help="tokens per prompt in every run (default: %(default)s)")
    runs.add_argument("--temperature", type=float, default=0.0, metavar="T",
                      help="0 = greedy; > 0 samples, the same seed per prompt in every method (default: %(default)s)")
    runs.add_argument("--max-gamma", type=int, default=8, metavar="G",
                      help="gamma of the acceptance runs, and the largest gamma predicted, 1..16 (default: %(default)s)")
    runs.add_argument("--top", type=int, default=3, metavar="N",
                      help="best predicted drafters confirmed by running them against plain decoding "
                           "(default: %(default)s)")
    runs.add_argument("--repeats", type=int, default=2, metavar="N",
                      help="runs of each held-out prompt per method; the fastest counts (default: %(default)s)")
    runs.add_argument("--sample-prompts", type=int, default=4, metavar="N",
                      help="most prompts that measure acceptance (default: %(default)s)")
    runs.add_argument("--confirm-prompts", type=int, default=6, metavar="N",
                      help="most held-out prompts that confirm (default: %(default)s)")
    runs.add_argument("--min-gain", type=float, default=0.05, metavar="X",
                      help="speculate only when measured at least 1 + X times plain decoding (default: %(default)s)")
    runs.add_argument("--tree-nodes", type=int, default=DEFAULT_TREE_NODES, metavar="N",
                      help="node budget of token trees and of suffix decoding (default: %(default)s)")
    runs.add_argument("--layer-search", type=float, default=120.0, metavar="SECONDS", dest="layer_search_s",
                      help="most seconds a layer-skip search may take when no skip set is cached "
                           "(default: %(default)s)")
    runs.add_argument("--seed", type=int, default=0, metavar="N", help="prompt i samples with seed + i "
                      "(default: %(default)s)")
    p.add_argument("--output", default="specdecode-tune.toml", metavar="FILE",
                   help="the settings file to write, for --config (the measurements go beside it as .json) "
                        "(default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
