"""``specdecode generate`` (and the prompt reading ``audit`` shares): read the jobs, load the decoder through the
builder, run each prompt, print the metrics (``specdecode.cli`` parses the flags)."""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from specdecode.cliargs import SAMPLING_MODES, check_drafter_flags, check_threads, set_threads
from specdecode.cliargs import status as _status
from specdecode.errors import SpecDecodeError, json_problem
from specdecode.spec import DrafterSpec
from specdecode.data import SharedDataMissing, load_prompts, read_prompt_text
from specdecode.validate import (  # the library's own checks, without torch
    check_engine,
    check_sampling,
    check_stops,
    check_token_ids,
)


#: The default prompts: Spec-Bench's first five extraction questions (pull facts, names and figures out of a
#: text given in the prompt), the work prompt lookup is for: the answer repeats spans of the prompt. On prompts
#: whose answer copies little (a 135M model's news summaries, open questions) it gains about nothing.
DEFAULT_DATASET = "spec-bench:extraction:5"
#: Used instead when ../shared/data is not beside the project: HumanEval ships in a registry package.
FALLBACK_DATASET = "humaneval:1"


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
    notes: list[str] = []  # the default prompts' notice: said after the checks, so a bad flag stays one line
    jobs = read_jobs(args, say=notes.append)  # a bad dataset or prompt file: refused before torch is imported
    from specdecode.build import choose_skip_layers  # lazy, as every import of torch here: --help answers at once
    from specdecode.generator import SpecDecoder  # lazy: torch and the model stack load only when the command runs

    set_threads(args.threads, say=_status)
    _preflight(args, jobs)
    for note in notes:
        _status(note)
    spec = DrafterSpec.from_settings(vars(args))
    if spec.kind == "none" and args.policy != "auto":
        _status(f"--policy {args.policy} has no effect with --draft none (plain decoding drafts nothing)")
    _status(f"loading target {args.target!r}" + (f" and draft model {spec.model_spec!r}" if spec.model_spec else ""))
    t0 = time.perf_counter()
    decoder = SpecDecoder.from_pretrained(
        args.target, spec, num_speculative_tokens=args.num_speculative_tokens,
        dtype=args.dtype, cache_dir=args.cache_dir, weights=args.weights, draft_weights=args.draft_weights,
        policy=args.policy, verification=args.verification, status=_status,
    )
    drafter = "no draft (plain decoding)" if spec.kind == "none" else f"drafter {spec.describe()}"
    chosen = getattr(decoder.policy, "name", "") if decoder.policy is not None else ""
    policy = f"{args.policy} ({chosen})" if args.policy == "auto" and chosen else args.policy
    gamma = "" if spec.kind == "none" else f", gamma {decoder.num_speculative_tokens}, policy {policy}"
    _status(f"loaded in {time.perf_counter() - t0:.1f} s: target {decoder.target.source}, {drafter}{gamma}, "
            f"context {decoder.target.max_context} tokens")
    if decoder.precision is not None:
        p = decoder.precision
        _status(f"weights {p.reason}" + (f" (measured once on this machine, cached in {p.cache_file}: delete it to "
                                         "measure again)" if p.cached and p.cache_file else ""))
    _check_token_ids(args, decoder.engine.vocab_size)
    with naming_flags():  # an invalid schema or regex: refused before any output
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
    """Range-check every number before any model is loaded (SpecDecodeError on the first bad one): the checks of
    SamplingParams, EngineConfig and the drafter factory (``specdecode.validate``), and a --regex's syntax and
    a --json-schema's keywords (llguidance, without a tokenizer)."""
    with naming_flags():
        check_sampling(args.temperature, args.top_k, args.top_p, args.max_new_tokens, args.seed,
                       **sampling_kwargs(args))
        check_engine(num_speculative_tokens=args.num_speculative_tokens, verification=args.verification)
        DrafterSpec.from_settings(vars(args)).check()
        check_stops(args.stop)
    args.json_schema_text = _read_json_schema(args.json_schema)
    if args.regex is not None and not args.regex:
        raise SpecDecodeError("--regex: the pattern is empty")
    if args.regex is not None or args.json_schema_text is not None:
        from specdecode.grammar import StructuredOutput

        with naming_flags():  # llguidance's checks (syntax, schema keywords), before the model loads
            if args.regex is not None:
                StructuredOutput.regex(args.regex)
            if args.json_schema_text is not None:
                StructuredOutput.json_schema(args.json_schema_text)


def _read_json_schema(path: str | None) -> str | None:
    """The text of --json-schema FILE, checked to be a JSON object (the schema itself: by llguidance in
    _check_generate_args, before the model loads)."""
    if path is None:
        return None
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        what = getattr(exc, "strerror", None) or exc
        raise SpecDecodeError(f"--json-schema: cannot read {path!r}: {what}; give a JSON schema file (or - for "
                              "standard input)") from None
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecDecodeError(f"--json-schema: {path!r} is not valid JSON ({json_problem(exc)})") from None
    if not isinstance(schema, dict):
        raise SpecDecodeError(f"--json-schema: {path!r} holds a JSON {type(schema).__name__}, not a schema object")
    return text


def sampling_kwargs(args: argparse.Namespace) -> dict:
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
    with naming_flags():
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
    "regex": "--regex", "draft": "--draft",
    # specdecode audit
    "num_samples": "-N/--num-samples", "num_tokens": "--tokens", "alpha": "--alpha", "power": "--power",
    "min_cell_mass": "--min-cell-mass", "null_simulations": "--null-simulations", "tie_margin": "--tie-margin",
    "concurrency": "--concurrency",
}


@contextlib.contextmanager
def naming_flags():
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
    from specdecode.lowbit_kernels import check_forced_variant  # lazy: torch loads only when the command runs
    from specdecode.preflight import check_models, check_prompts  # lazy: torch and the model stack load only when the command runs

    check_forced_variant()  # a wrong SPECDECODE_KERNEL_ISA: one line before anything resolves or loads
    target = check_models(args.target, DrafterSpec.from_settings(vars(args)).model_spec, cache_dir=args.cache_dir,
                          cross_vocab=True, tree=args.tree)  # the cross-vocabulary line is said at load
    chat = [args.chat if args.chat is not None else (None if job.chat_default else False) for job in jobs]
    check_prompts(target, [(job.id, job.text, c) for job, c in zip(jobs, chat)], args.max_new_tokens)


def read_jobs(args: argparse.Namespace, say=None) -> list[_Job]:
    """The prompts to run: ``--prompt``, ``--prompt-file``, ``--dataset`` or the default prompts, which ``say``
    (default: the status line) names. Raises SpecDecodeError: an empty prompt or set, an unreadable file."""
    say = say or _status
    if args.prompt is not None:
        if not args.prompt.strip():
            raise SpecDecodeError("the prompt is empty: give some text with --prompt (or use --dataset)")
        return [_Job("prompt", args.prompt, chat_default=False)]
    if args.prompt_file is not None:
        return [_Job(args.prompt_file, read_prompt_file(args.prompt_file), chat_default=False)]
    spec = args.dataset or DEFAULT_DATASET
    try:
        prompts = load_prompts(spec, say=say)
    except SharedDataMissing as err:
        if args.dataset is not None:
            raise
        spec = FALLBACK_DATASET  # ships in a registry package, so the default runs anywhere
        say(f"{err}; using {spec} instead")
        prompts = load_prompts(spec)
    if not prompts:
        raise SpecDecodeError(f"the prompt set {spec!r} is empty")
    if args.dataset is None:
        p = prompts[0]
        ids = ", ".join(q.id for q in prompts)
        what = f"{p.dataset} {p.category} questions {ids}" if p.category else f"{p.dataset} {ids}"
        why = ""
        if spec == DEFAULT_DATASET:  # (prompt lookup: the default drafter)
            lookup = ", where prompt lookup pays off" if getattr(args, "draft", "ngram") in (None, "ngram") else ""
            why = f" (facts to pull out of a text in the prompt{lookup})"
        say(f"no prompt given: using the default prompts, {what}{why}; the first: {_preview(p.turns[0])}")
    return [
        _Job(f"{p.dataset}/{p.id}" if "/" not in p.id else p.id, p.turns[0], chat_default=not p.is_completion,
             dataset=p.dataset, category=p.category)
        for p in prompts
    ]


def read_prompt_file(path: str) -> str:
    """The text of ``--prompt-file PATH`` (``-``: standard input); SpecDecodeError as ``data.read_prompt_text``."""
    return read_prompt_text(path, "--prompt-file", stdin=True)


def _preview(text: str, width: int = 90) -> str:
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= width else flat[: width - 3] + "...")


def _warm_up(decoder, baseline) -> None:
    """A 2-token generation per decoder on a short prompt, so start-up costs leave the timings."""
    ids = decoder.encode("Hello, world. Hello, world.")[:16]
    for d in (baseline, decoder):
        if d is not None:
            d.generate(ids, max_new_tokens=2, seed=0, ignore_eos=True)


def _encode_job(args, decoder, job: _Job) -> tuple[_Job, bool, list[int]]:
    """(job, chat template used, prompt ids); PromptTooLongError when it cannot fit the context."""
    from specdecode.types import PromptTooLongError  # lazy: torch and the model stack load only when the command runs

    chat = args.chat if args.chat is not None else (job.chat_default and decoder.has_chat_template)
    prompt_ids = decoder.encode(job.text, chat=chat)
    context = decoder.target.max_context
    if len(prompt_ids) + args.max_new_tokens > context:
        from specdecode.request import too_long

        raise PromptTooLongError(too_long(len(prompt_ids), args.max_new_tokens, context, "--max-new-tokens",
                                          f"prompt {job.id!r}"))
    return job, chat, prompt_ids


def _run_job(args, decoder, baseline, job: _Job, chat: bool, prompt_ids: list[int], index: int, total: int) -> dict:
    """Baseline first (when asked), then the speculative run (streamed unless --json); with a baseline and a
    repeatable run (:func:`_repeatable`) each once more, interleaved, keeping the faster; print; return the record."""
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
                  json_schema=args.json_schema_text, regex=args.regex, **sampling_kwargs(args))
    if not args.json:
        where = f" ({job.dataset}, {job.category})" if job.dataset else ""
        _rule(f"prompt {index + 1}/{total}: {job.id}{where}, {len(prompt_ids)} tokens, "
              f"chat template: {'yes' if chat else 'no'}")
    base_out = baseline.generate(prompt_ids, **kwargs) if baseline is not None else None
    on_text = None if args.json else _write_stdout
    repeat = base_out is not None and _repeatable(args, decoder)
    # an adaptive policy starts the repeat from where it started the first run (what it learns carries over)
    policy = decoder.policy
    policy_state = (copy.deepcopy(vars(policy), {id(policy): policy}) if repeat and policy.remembers_requests
                    else None)
    out = decoder.generate(prompt_ids, on_text=on_text, **kwargs)
    runs = [(base_out, out)]
    if repeat:
        # a second run of each, interleaved, and the faster one timed: a run of well under a second on a
        # shared machine varies by 10-20% (a deterministic run repeats its tokens; all four must agree)
        if policy_state is not None:
            vars(decoder.policy).update(policy_state)
        runs.append((baseline.generate(prompt_ids, **kwargs), decoder.generate(prompt_ids, **kwargs)))
        base_out = min((b for b, _ in runs), key=lambda o: o.metrics.wall_time_s)
        out = min((o for _, o in runs), key=lambda o: o.metrics.wall_time_s)
    record = _record(job, chat, out, base_out)
    if base_out is not None:
        record["timed_runs"] = len(runs)  # of each decoder; the faster one's figures are reported
        # every run of either decoder must commit the same tokens: a repeat that differs is a defect to show
        record["matches_baseline"] = all(o.token_ids == out.token_ids for pair in runs for o in pair)
    record["sampled"] = args.temperature > 0
    record["weights"] = None if decoder.precision is None else decoder.precision.precision
    record["policy"] = None if decoder.proposer is None else getattr(decoder.policy, "name", None) or args.policy
    if base_out is not None and not record["matches_baseline"]:
        # a decoder that did not repeat itself is the finding (the fastest runs compared would blame either side);
        # else, greedy, where the speculative output left plain decoding's path and by what margin
        record["difference"] = _unrepeated(runs) or (
            None if record["sampled"] else decoder.explain_difference(prompt_ids, out.token_ids, base_out.token_ids))
    if args.json:
        print(json.dumps(record, ensure_ascii=False), flush=True)
    else:
        _write_stdout("\n")
        _print_summary(record)
    return record


def _unrepeated(runs: list[tuple]) -> str | None:
    """Which decoder gave two different outputs for one prompt in one process, from ``runs`` [(plain output,
    speculative output)] per run of the prompt (None: one run, or each decoder repeated itself): the line that
    tells a decoder that is not deterministic from a speculative run that left plain decoding's path."""
    if len(runs) < 2:
        return None
    odd = [name for k, name in ((0, "plain decoding"), (1, "speculative decoding"))
           if runs[0][k].token_ids != runs[1][k].token_ids]
    if not odd:
        return None
    who = odd[0] if len(odd) == 1 else "plain and speculative decoding each"
    return (f"{who} gave different tokens in two runs of this prompt in one process (a decoder that does not "
            f"repeat itself: a bug, please report it with the command and its status lines)")


def _repeatable(args, decoder) -> bool:
    """Whether a second run of a prompt is the same run as its first: greedy or seeded, and the drafter carries
    nothing from one request to the next (suffix decoding's global tree would start the repeat from what the
    first run left). An adaptive policy's state is put back before the repeat (``_run_job``), but its choices
    follow measured times: a seeded request in the standard sampling mode, whose draws follow the draft lengths,
    is then not repeatable (greedy and coupled requests commit the same tokens whatever the lengths)."""
    proposer = decoder.proposer
    if proposer is not None and proposer.remembers_requests:
        return False
    if args.temperature == 0:
        return True
    standard = SAMPLING_MODES[args.sampling_mode] is False
    return args.seed is not None and not (standard and decoder.policy.remembers_requests)


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
    from rich.console import Console  # lazy: rich only when printing

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
        + (f"tau {r['mean_accepted_length']:.2f} tokens/forward" if r["mean_accepted_length"] > 0
           else "tau - (no forward after the prompt's)"),
        f"acceptance by position: {positions}",
        f"draft length per step (gamma): mean {r['mean_draft_length']:.2f}, histogram "
        + (" ".join(f"{g}:{n}" for g, n in r["draft_length_histogram"].items()) or "-"),
        *([f"token trees: {r['num_tree_steps']} steps, {r['mean_tree_size']:.1f} nodes per tree, accepted depth "
           f"{r['mean_accepted_depth']:.2f}"] if r.get("num_tree_steps") else []),
        f"target forwards {r['num_target_forwards']} | time: prefill {r['prefill_time_s']:.2f} s, "
        f"draft {r['draft_time_s']:.2f} s, verify {r['verify_time_s']:.2f} s, other {r['other_time_s']:.2f} s, "
        f"wall {r['wall_time_s']:.2f} s | {r['tokens_per_s']:.1f} tokens/s",
    ]
    if r["num_generated_tokens"] <= 1 and r["finish_reason"] == "stop" and not r.get("chat", True):
        lines.append("(the model ended at once: an instruct model given raw text without its chat template often "
                     "does; try --chat)")
    if "baseline" in r:
        speedup = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
        lines.append(
            f"baseline (plain decoding, same engine): {r['baseline']['tokens_per_s']:.1f} tokens/s | "
            f"speedup {speedup} | output matches baseline: {'yes' if r['matches_baseline'] else 'NO'}"
            + ("" if r["matches_baseline"] or not r.get("sampled") else
               " (expected when sampling: the distribution is preserved, not the individual sample)")
            + (" | timed once (a second run would not repeat the first: see --compare-baseline in --help)"
               if r.get("timed_runs") == 1 else "")
        )
        if r.get("difference"):
            lines.append(r["difference"])
    console = _console()
    for line in lines:
        console.print(line, markup=False)


def _print_aggregate(records: list[dict], with_baseline: bool) -> None:
    """One table row per prompt and a median row."""
    from rich.table import Table  # lazy: rich only when printing

    from rich import box

    console = _console()
    table = Table(title=f"{len(records)} prompts", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    columns = ["prompt", "tokens", "drafted", "accepted", "accept", "tau", "fwd", "tok/s"]
    if with_baseline:
        columns += ["base tok/s", "speedup", "match"]
    # a narrow terminal (80 columns) keeps every figure whole: the counts each prompt's lines above already gave
    # (drafted, accepted, forwards) leave the table before any cell is cut
    shown = [c for c in columns if console.width >= 110 or c not in ("drafted", "accepted", "fwd")]
    for c in shown:
        table.add_column(c, justify="left" if c == "prompt" else "right", no_wrap=True)

    def row(name, tokens, drafted, accepted, rate, tau, fwd, tps, base=None, speedup=None, match=None):
        cells = [name, str(tokens), str(drafted), str(accepted), f"{rate:.1%}", f"{tau:.2f}", str(fwd), f"{tps:.1f}"]
        if with_baseline:
            cells += [f"{base:.1f}", "-" if speedup is None else f"{speedup:.2f}x", match]
        table.add_row(*(cell for c, cell in zip(columns, cells) if c in shown))

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
    console.print(table)

