"""The benchmark matrix: methods x prompts on one target, with plain decoding and the HF peer interleaved.

For every prompt, every variant runs back to back in the same process (the order
rotates from prompt to prompt), so the machine's drift hits all of them alike:

- ``specdecode/plain``: our engine with no proposer (the baseline of our speedups);
- ``specdecode/<method>``: our engine with a proposer, one per method spec and gamma;
- ``hf/plain``, ``hf/assisted``, ``hf/prompt-lookup``: transformers' ``generate`` (peer.py);
- optional external engines, each with its own plain decoding as its baseline: ``llama.cpp/...``
  (llamacpp.py), ``openvino/plain|assisted|prompt-lookup`` (openvino.py, a worker in its own venv),
  ``llama-server/plain|draft|ngram`` (llamaserver.py, llama.cpp's C++ server over HTTP).

Each finished (prompt, variant) run is appended to ``records.jsonl`` at once; a rerun with
the same output directory and settings skips what is there (resume).

Methods are drafter specs in their compact form (:class:`specdecode.spec.DrafterSpec`): ``KIND[:KEY=VALUE,...]``
where KIND is a key of ``specdecode.proposers.PROPOSERS``, ``k`` is gamma (``num_speculative_tokens``), ``model``
names a draft model (for proposers that take one) and any other option is a field of the proposer's config
dataclass (``ngram:k=5,max_ngram=4``; tuples as ``branching=4/2/2``). Each is built by the one builder
(:mod:`specdecode.build`), as ``generate`` and ``serve`` build it. A new proposer registered with
``@register("name")`` whose factory takes ``config=`` (a dataclass) and/or ``model=`` needs no change here.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdecode.bench import report
from specdecode.bench.env import environment
from specdecode.bench.records import RECORDS_FILE, RecordStore  # noqa: F401 - re-exported
from specdecode.build import build_factory
from specdecode.eagle.head import EagleCheckpointError
from specdecode.types import SpecDecodeError
from specdecode.paths import check_output_dir
from specdecode.proposers.factory import other_tokenizer
from specdecode.spec import DrafterSpec

from specdecode.bench.config import (  # noqa: F401 - re-exported: the settings and prompts of a run
    DEFAULT_DATASETS,
    KERNELS,
    BenchConfig,
    BenchPrompt,
    encode_prompt,
    quick_config,
    select_prompts,
    smoke_config,
)
from specdecode.bench.variants import (  # noqa: F401 - re-exported: the matrix's columns
    PROBE_REPS,
    RunOutput,
    Variant,
    engine_runner,
    expand_methods,
    main_gamma_of,
    needs_draft_model,
    peer_runner,
    probe_forward_times,
    registered_methods,
)
from specdecode.lowbit import set_weight_precision
from specdecode.bench.smoke import load_smoke_model
from specdecode.models import default_cache_dir
from specdecode.precision import choose_precision
from specdecode.precision import load_target
from specdecode.lowbit import load_in_precision
from specdecode.kernels import use_small_row_matmul
from specdecode.models import check_compatible
import atexit
import specdecode.models  # gguf_file looked up at call time: the tests stand a fake in for it
from specdecode.bench import roofline

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- the run


@dataclass
class Models:
    """The loaded target and drafts of a run, with their provenance for the report."""

    target: object
    drafts: dict[str, object] = field(default_factory=dict)
    load_seconds: dict[str, float] = field(default_factory=dict)

    def describe(self) -> dict:
        def one(m, seconds):
            cfg = m.model.config
            return {"name": m.name, "source": m.source, "sha256": m.sha256,
                    "parameters": sum(p.numel() for p in m.model.parameters()),
                    "architecture": type(m.model).__name__, "layers": getattr(cfg, "num_hidden_layers", None),
                    "vocab_size": getattr(cfg, "vocab_size", None), "dtype": str(next(m.model.parameters()).dtype),
                    "load_seconds": round(seconds, 2)}

        return {"target": one(self.target, self.load_seconds.get(self.target.name, 0.0)),
                "drafts": {k: one(v, self.load_seconds.get(k, 0.0)) for k, v in self.drafts.items()}}


def load_any(spec: str, dtype: str, kernel: str = "default", weights: str = "fp32", *, target: bool = False,
             status: Callable[[str], None] | None = None):
    """A LoadedModel in ``weights``: ``smoke:*`` built in code, anything else through the loader ``generate``
    and ``serve`` use (``precision.load_target`` for a target, ``lowbit.load_in_precision`` for a draft), so a
    spec and a precision are the same weights in every front end (int4 of a GGUF model: the file's own blocks).

    Returns:
        (LoadedModel, the precision it runs in: ``weights``, or what ``auto`` chose).

    Raises:
        ModelLoadError: the spec names no loadable model; SpecDecodeError: an unknown precision, ``auto`` on a
        built-in model that is not float32, a GGUF tensor without a low-bit layout.
    """

    if spec.startswith("smoke:"):  # the built-in tiny model, built in code (no file behind it)

        loaded = load_smoke_model(spec)
        loaded.model.to(getattr(torch, dtype))
        if weights == "auto":  # load_target's measured choice, on the model built here

            try:
                choice = choose_precision(loaded, default_cache_dir(), status=status)
            except ValueError as exc:  # not a float32 target: nothing to choose from
                raise SpecDecodeError(f"--weights auto: {exc}; give --weights explicitly") from None
            if status is not None:
                status(f"weights {choice.reason}")
            weights = choice.precision
        if weights != "fp32":
            set_weight_precision(loaded.model, weights)
    elif target:

        loaded, choice = load_target(spec, weights, dtype=dtype, status=status)
        if status is not None and weights == "auto":
            status(f"weights {choice.reason}")
        weights = choice.precision
    else:

        loaded = load_in_precision(spec, weights, dtype=getattr(torch, dtype), say=status)
    if kernel == "small-row":

        use_small_row_matmul(loaded.model)
    return loaded, weights


def build_variants(config: BenchConfig, models: Models, dtype: str, status: Callable[[str], None]) -> list[Variant]:
    """Our plain baseline, every method spec, then the HF plain / peer variants (when ``config.peer``)."""
    from specdecode.bench.peer import PEER_OF  # lazy: the peer imports transformers' generation stack

    target = models.target
    eos = target.eos_token_ids
    n, temp = config.max_new_tokens, config.temperature
    ctx_len = target.max_context

    def load_draft(spec: str):
        if spec not in models.drafts:
            status(f"loading draft {spec!r}")
            t0 = time.perf_counter()
            draft, _ = load_any(spec, dtype, config.kernel, config.draft_weights or config.weights, status=status)
            models.load_seconds[spec] = time.perf_counter() - t0
            problem = other_tokenizer(target, draft)
            if problem:
                status(f"draft {spec!r} has another tokenizer ({problem}): it drafts across vocabularies")
            else:
                check_compatible(target, draft)
            models.drafts[spec] = draft
        return models.drafts[spec]

    variants = [Variant("specdecode/plain", "specdecode", "plain", 0, "plain",
                        engine_runner(target, None, 1, n, temp, eos, ctx_len, config.verification))]
    specs = expand_methods(config)
    for spec in list(specs):
        try:
            draft = load_draft(spec.model_spec) if needs_draft_model(spec.kind) and spec.model_spec else None
            proposer = build_factory(spec, target, draft)()
        except EagleCheckpointError as exc:
            if config.methods:  # asked for by name: say why it cannot run
                raise
            print(f"specdecode bench: skipping {spec}: {exc}", file=sys.stderr)  # the default list
            specs.remove(spec)
            continue
        variants.append(Variant(f"specdecode/{spec}", "specdecode", spec.kind, spec.num_speculative_tokens, spec.family,
                                engine_runner(target, proposer, spec.num_speculative_tokens, n, temp, eos, ctx_len,
                                               config.verification, policy=config.policy), draft=spec.model_spec))
    if config.peer:
        variants.append(Variant("hf/plain", "hf", "plain", 0, "hf/plain",
                                peer_runner(target, "plain", 1, None, 3, n, temp, eos)))
        mains = main_gamma_of(specs)
        for spec in specs:
            peer = PEER_OF.get(spec.kind)
            if peer is None or spec.num_speculative_tokens != mains.get(spec.family):
                continue  # the peer mirrors each family at its leaderboard gamma only
            draft_spec = spec.model_spec
            draft = load_draft(draft_spec) if draft_spec else None
            max_ngram = int(spec.option("max_ngram", "3"))
            tail = f":k={spec.num_speculative_tokens}" + (f",model={draft_spec}" if draft_spec else f",max_ngram={max_ngram}")
            variants.append(Variant(f"hf/{peer}{tail}", "hf", peer, spec.num_speculative_tokens, f"hf/{peer}",
                                    peer_runner(target, peer, spec.num_speculative_tokens, draft, max_ngram, n, temp, eos),
                                    peer_of=f"specdecode/{spec}", draft=draft_spec))
    if config.llama_cpp:
        variants += _llama_cpp_variants(config, specs, main_gamma_of(specs), eos, status)
    if config.openvino:
        variants += _openvino_variants(config, specs, main_gamma_of(specs), eos, status)
    if config.llama_server:
        variants += _llama_server_variants(config, specs, main_gamma_of(specs), eos, status)
    return variants


def _peer_methods(config: BenchConfig, specs, mains: dict) -> list[tuple[str, DrafterSpec, str | None, int]]:
    """(kind, our spec, draft spec, max_ngram) for each family an external engine mirrors at its main gamma:
    kind "draft" for draft-model methods with a draft of the same tokenizer, "ngram" for the n-gram method."""
    out = []
    for spec in specs:
        if spec.num_speculative_tokens != mains.get(spec.family):
            continue
        if spec.kind == "draft-model":
            out.append(("draft", spec, spec.model or config.draft, 0))
        elif spec.kind == "ngram":
            out.append(("ngram", spec, None, int(spec.option("max_ngram", "3"))))
    return out


def _external_run(engine, eos: tuple[int, ...], max_new_tokens: int) -> Callable[..., RunOutput]:
    """``run(ids, seed, limit)`` over an external runner's ``generate(ids, n, eos)`` (greedy: seed unused)."""

    def run(ids: list[int], seed: int, limit: int | None = None) -> RunOutput:
        res = engine.generate(ids, limit or max_new_tokens, eos)
        return RunOutput(res.token_ids, res.wall_s, res.finish_reason, None, getattr(res, "timings", None))

    return run


def _openvino_variants(config: BenchConfig, specs, mains: dict, eos: tuple[int, ...], status) -> list[Variant]:
    """OpenVINO GenAI plain, assisted (peer of draft-model) and prompt lookup (peer of ngram): ``bench.openvino``.

    Raises:
        SpecDecodeError: the peer is not set up (names ``--setup-peers``), or its worker failed to load.
    """

    from specdecode.bench import openvino as ov  # lazy: an optional peer engine

    fmt = config.openvino_weights
    target = ov.require_model(config.target, fmt)
    threads = config.threads or torch.get_num_threads()
    peers = _peer_methods(config, specs, mains)
    drafts = {d: ov.require_model(d, fmt) for kind, _, d, _ in peers if kind == "draft" and d}
    status(f"OpenVINO GenAI peer on {target.name} ({threads} threads)")

    def runner(method: str, gamma: int = 4, draft=None, max_ngram: int = 3):
        engine = ov.OpenVinoRunner(target, method, draft=draft, gamma=gamma, max_ngram=max_ngram, threads=threads)
        atexit.register(engine.close)
        return _external_run(engine, eos, config.max_new_tokens)

    return _external_variants(ov.ENGINE, peers, drafts, runner, draft_method="assisted", ngram_method="prompt-lookup")


def _external_variants(e: str, peers, drafts: dict, runner, *, draft_method: str, ngram_method: str) -> list[Variant]:
    """An external engine's variants: ``e/plain``, then for each mirrored family of ``_peer_methods`` its
    draft-model method (``draft_method``) or n-gram method (``ngram_method``), keyed ``e/method:k=..,..``;
    ``runner(method, gamma, draft, max_ngram)`` makes each one's ``run``, ``drafts`` maps draft specs to
    the engine's own files."""
    out = [Variant(f"{e}/plain", e, "plain", 0, f"{e}/plain", runner("plain"))]
    seen: set[tuple] = set()
    for kind, spec, draft, max_ngram in peers:
        if (kind, spec.num_speculative_tokens, draft, max_ngram) in seen:  # two of our families the engine cannot tell apart
            continue
        seen.add((kind, spec.num_speculative_tokens, draft, max_ngram))
        if kind == "draft" and draft:
            out.append(Variant(f"{e}/{draft_method}:k={spec.num_speculative_tokens},model={draft}", e, draft_method, spec.num_speculative_tokens,
                               f"{e}/{draft_method}", runner(draft_method, spec.num_speculative_tokens, drafts[draft]),
                               peer_of=f"specdecode/{spec}", draft=draft))
        elif kind == "ngram":
            out.append(Variant(f"{e}/{ngram_method}:k={spec.num_speculative_tokens},max_ngram={max_ngram}", e, ngram_method,
                               spec.num_speculative_tokens, f"{e}/{ngram_method}", runner(ngram_method, spec.num_speculative_tokens, None, max_ngram),
                               peer_of=f"specdecode/{spec}"))
    return out


def _llama_server_variants(config: BenchConfig, specs, mains: dict, eos: tuple[int, ...], status) -> list[Variant]:
    """llama.cpp's C++ server plain, draft (peer of draft-model) and ngram-simple (peer of ngram):
    ``bench.llamaserver``, on the catalog's GGUF files.

    Raises:
        SpecDecodeError: llama-server is not built (names ``--setup-peers``), or a server did not start.
    """

    from specdecode.bench import llamaserver as ls  # lazy: an optional peer engine

    exe = ls.require_binary()
    target = specdecode.models.gguf_file(config.target)
    threads = config.threads or torch.get_num_threads()
    peers = _peer_methods(config, specs, mains)
    drafts = {d: specdecode.models.gguf_file(d) for kind, _, d, _ in peers if kind == "draft" and d}
    status(f"llama-server peer on {target.name} ({threads} threads)")
    log = Path(config.output) / "llama-server.log"
    Path(config.output).mkdir(parents=True, exist_ok=True)

    def runner(method: str, gamma: int = 4, draft=None, max_ngram: int = 3):
        engine = ls.LlamaServerRunner(target, method, draft=draft, gamma=gamma, max_ngram=max_ngram,
                                      threads=threads, binary_path=exe, log=log)
        atexit.register(engine.close)
        return _external_run(engine, eos, config.max_new_tokens)

    return _external_variants(ls.ENGINE, peers, drafts, runner, draft_method="draft", ngram_method="ngram")


def _llama_cpp_variants(config: BenchConfig, specs, mains: dict, eos: tuple[int, ...], status) -> list[Variant]:
    """llama.cpp plain, and its prompt lookup as the peer of each n-gram family (``bench.llamacpp``)."""
    from specdecode.bench import llamacpp  # lazy: an optional peer engine

    if not llamacpp.available():
        raise SpecDecodeError("--llama-cpp needs llama-cpp-python: pip install llama-cpp-python (it builds "
                              "llama.cpp from source; set CMAKE_ARGS=-DGGML_NATIVE=ON for this CPU)")
    gguf = specdecode.models.gguf_file(config.target)
    status(f"llama.cpp peer on {gguf.name}")

    def runner(method: str, gamma: int, max_ngram: int):
        engine = llamacpp.LlamaCppRunner(str(gguf), method, gamma=gamma, max_ngram=max_ngram,
                                         n_threads=config.threads)

        def run(ids: list[int], seed: int, limit: int | None = None) -> RunOutput:
            res = engine.generate(ids, limit or config.max_new_tokens, eos)
            return RunOutput(res.token_ids, res.wall_s, res.finish_reason, None)

        return run

    out = [Variant(f"{llamacpp.ENGINE}/plain", llamacpp.ENGINE, "plain", 0, f"{llamacpp.ENGINE}/plain",
                   runner("plain", 1, 2))]
    for spec in specs:
        if spec.kind == "ngram" and spec.num_speculative_tokens == mains.get(spec.family):
            max_ngram = int(spec.option("max_ngram", "3"))
            out.append(Variant(f"{llamacpp.ENGINE}/prompt-lookup:k={spec.num_speculative_tokens},max_ngram={max_ngram}",
                               llamacpp.ENGINE, "prompt-lookup", spec.num_speculative_tokens, f"{llamacpp.ENGINE}/prompt-lookup",
                               runner("prompt-lookup", spec.num_speculative_tokens, max_ngram),
                               peer_of=f"specdecode/{spec}"))
    return out


def run_bench(config: BenchConfig, *, progress: bool = True, log: Callable[[str], None] | None = None) -> dict:
    """Run (or resume) the matrix and write the reports into ``config.output``.

    Returns:
        The report dict written to ``report.json`` (environment, config, summary, records).

    Raises:
        SpecDecodeError: bad config, unknown method / dataset, incompatible draft, model load failure.
    """


    status = log or (lambda msg: print(f"specdecode bench: {msg}", file=sys.stderr, flush=True))
    out = check_output_dir(config.output, "--output", default=True)  # before any load: probed, nothing left
    if config.threads:
        torch.set_num_threads(config.threads)
    quiet_transformers()
    expand_methods(config)  # validate method specs before any slow work (a dataset's install included)
    prompts = select_prompts(config.datasets, config.limit)

    status(f"loading target {config.target!r}")
    t0 = time.perf_counter()
    # the loader generate / serve use, the precision choice inside it (auto: what they pick)
    target, weights = load_any(config.target, config.dtype, config.kernel, config.weights, target=True, status=status)
    models = Models(target=target)
    # records are keyed by what ran; drafts run in the target's precision unless --draft-weights says otherwise,
    # as in generate / serve
    config = dataclasses.replace(config, weights=weights, draft_weights=config.draft_weights or weights,
                                 threads=torch.get_num_threads())  # records keyed by the count they ran at
    models.load_seconds[config.target] = time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)  # once the settings, methods and target are known good
    store = RecordStore(out, config.settings_id())
    if store.ignored:
        status(f"{store.ignored} record(s) in {store.path} have other settings and are ignored")
    variants = build_variants(config, models, config.dtype, status)
    roofline = roofline_facts(config, models, variants, status)

    encoded = encode_all(prompts, models.target, config, status)
    runnable = [p for p in prompts if p.key in encoded]
    todo = [(p, v, r) for i, p in enumerate(runnable) for r in range(config.repeats)
            for v in rotate(variants, i + r) if not store.has("run", v.key, p.key, rep=r)]
    total = len(runnable) * len(variants) * config.repeats
    status(f"{len(runnable)} prompts x {len(variants)} variants x {config.repeats} repeat(s); {len(todo)} runs to "
           f"do ({total - len(todo)} already in {store.path.name})")
    if config.probe:
        _probe(config, models, variants, runnable, encoded, store, status)
    if todo and config.warmup:
        warm_up(variants, encoded[runnable[0].key][0], config.seed, status)
    try:
        _run_matrix(todo, runnable, variants, encoded, config, store, progress)
    finally:
        env = environment()
        result = report.write_reports(out, config=config, env=env, models=models.describe(),
                                      variants=[v.info() for v in variants],
                                      prompts=[{"key": p.key, "dataset": p.dataset, "category": p.category,
                                                "prompt_tokens": len(encoded[p.key][0]),
                                                "chat_template": encoded[p.key][1]} for p in runnable],
                                      records=store.of_kind("run"), probes=store.of_kind("probe"),
                                      main_gammas=main_gamma_of(expand_methods(config)), roofline=roofline)
        status(f"reports written to {out}/ (report.md, report.json, *.png)")
    return result


def roofline_facts(config: BenchConfig, models: Models, variants: list[Variant], status) -> dict:
    """The roofline's inputs: the read bandwidth in bytes/s (measured once per machine and thread count,
    cached) and each model's weight bytes per step and KV bytes per token in its runner's cache dtype."""

    runners: dict[int, object] = {}  # id(model) -> its slot runner (target's and drafts')
    for v in variants:
        engine = getattr(v.run, "engine", None)
        for r in (getattr(engine, "runner", None), getattr(getattr(engine, "proposer", None), "runner", None)):
            if r is not None and getattr(r, "model", None) is not None:
                runners.setdefault(id(r.model), r)
    bandwidth = roofline.measure_read_bandwidth(default_cache_dir(), remeasure=config.remeasure_bandwidth,
                                                status=status)

    def facts(name: str, role: str, loaded) -> dict:
        kv_dtype = getattr(runners.get(id(loaded.model)), "cache_dtype", None)
        return roofline.model_facts(name, role, loaded.model, kv_dtype)

    return {"bandwidth": {"bytes_per_s": bandwidth, "tensor_bytes": roofline.READ_BYTES,
                          "repeats": roofline.READ_REPEATS, "threads": torch.get_num_threads()},
            "models": [facts(config.target, "target", models.target),
                       *(facts(spec, "draft", d) for spec, d in models.drafts.items())]}


def rotate(items: list, shift: int) -> list:
    """``items`` rotated left by ``shift``: the order in which prompt ``shift`` runs the variants (drift hits all alike)."""
    s = shift % len(items) if items else 0
    return items[s:] + items[:s]


def encode_all(prompts, target, config, status) -> dict[str, tuple[list[int], bool]]:
    """{prompt key: (ids, templated)} of the prompts that fit the target's context with
    ``config.max_new_tokens`` new tokens (``config``: anything with ``chat`` and ``max_new_tokens``);
    ``status`` hears of each one left out."""
    out = {}
    for p in prompts:
        ids, templated = encode_prompt(target.tokenizer, p, config.chat)
        if not ids:
            bos = target.tokenizer.bos_token_id
            ids = [bos] if bos is not None else []
        if not ids or len(ids) + config.max_new_tokens > target.max_context:
            status(f"skipping {p.key}: {len(ids)} prompt tokens + {config.max_new_tokens} new exceed the "
                   f"context of {target.max_context}")
            continue
        out[p.key] = (ids, templated)
    return out


def _seed(config: BenchConfig, prompt_index: int) -> int:
    return config.seed + prompt_index


def _run_matrix(todo, prompts, variants, encoded, config: BenchConfig, store: RecordStore, progress: bool) -> None:
    from rich.console import Console  # lazy: rich only when printing
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,  # lazy: rich only when printing
                               TimeRemainingColumn)

    index = {p.key: i for i, p in enumerate(prompts)}
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("elapsed"),
               TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
    total = len(prompts) * len(variants) * config.repeats
    console = Console(stderr=True)
    with Progress(*columns, console=console, disable=not progress or not console.is_terminal,
                  transient=False) as bar:  # (a log file would get a cut bar: the status lines below say the rest)
        task = bar.add_task("bench", total=total, completed=total - len(todo))
        failed: set[str] = set()
        plain = progress and not bar.console.is_terminal  # a log or CI: a plain line every 30 s instead of the bar
        start = last = time.monotonic()
        for done, (prompt, variant, rep) in enumerate(todo):
            bar.update(task, description=f"{prompt.key} {variant.key}"[:60])
            if plain and time.monotonic() - last >= 30:
                last, spent = time.monotonic(), time.monotonic() - start
                bar.console.print(f"specdecode bench: {total - len(todo) + done}/{total} runs, {spent:.0f} s, about "
                                  f"{spent / max(done, 1) * (len(todo) - done):.0f} s left ({prompt.key} {variant.key})")
            if variant.key in failed:
                bar.advance(task)
                continue
            ids, templated = encoded[prompt.key]
            seed = _seed(config, index[prompt.key])
            gc.collect()
            load1 = _load_average()
            try:
                res = variant.run(ids, seed)
            except Exception as exc:  # noqa: BLE001 - one broken method must not sink an hour of other runs
                failed.add(variant.key)
                message = f"{type(exc).__name__}: {exc}"
                bar.console.print(f"specdecode bench: {variant.key} failed on {prompt.key}, skipping it from now "
                                  f"on: {message}")
                store.add({"kind": "error", "variant": variant.key, "prompt": prompt.key, "error": message,
                           "time": time.time()})
                bar.advance(task)
                continue
            store.add({
                "kind": "run", "variant": variant.key, "prompt": prompt.key, "rep": rep, **variant.info(),
                "dataset": prompt.dataset, "category": prompt.category, "prompt_tokens": len(ids),
                "chat_template": templated, "seed": seed, "token_ids": res.token_ids,
                "new_tokens": len(res.token_ids), "wall_s": res.wall_s, "finish_reason": res.finish_reason,
                "metrics": res.metrics, "time": time.time(), "load1_before": load1, "load1_after": _load_average(),
                **({"engine_stats": res.engine_stats} if res.engine_stats else {}),
            })
            bar.advance(task)


def _load_average() -> float | None:
    """The 1-minute load average (runnable processes): above the core count, runs compete for CPU."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def warm_up(variants: list[Variant], ids: list[int], seed: int, status) -> None:
    """A short unrecorded run per variant: first-call costs (allocations, lazy init) leave the timings."""
    status("warming up every variant")
    for v in variants:
        v.run(ids[: min(len(ids), 32)], seed, 8)


def probe_context(prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[int]:
    """A typical context to time forwards at: the median prompt length plus half the new tokens, the first
    prompt's ids repeated to that length ([L] token ids)."""
    lengths = sorted(len(p) for p in prompts)
    ctx_len = lengths[len(lengths) // 2] + max_new_tokens // 2
    first = list(prompts[0])
    return (first * (ctx_len // len(first) + 1))[:ctx_len]


def _probe(config, models: Models, variants, prompts, encoded, store: RecordStore, status) -> None:
    """Time T_verify(k) of the target and one step of each draft model at a typical context (recorded once)."""
    first = encoded[prompts[0].key][0]
    context = probe_context([encoded[p.key][0] for p in prompts], config.max_new_tokens)
    ctx_len = len(context)
    max_k = max([v.gamma for v in variants] + [8])
    ks = sorted({0, 1, 2, 3, 4, 6, 8, *[v.gamma for v in variants if v.gamma]} | ({max_k} if max_k <= 16 else set()))
    todo = [("target", config.target, models.target, ks)]
    todo += [("draft", spec, m, [0]) for spec, m in models.drafts.items()]
    for role, spec, loaded, kk in todo:
        if store.has("probe", model=spec):
            continue
        status(f"timing {role} forwards ({spec}, context {ctx_len} tokens, k = {kk})")
        ids = context
        if role == "draft" and loaded.tokenizer is not None and loaded.tokenizer is not models.target.tokenizer:
            # a draft with another tokenizer reads its own ids: the prompt's text in them, to the same length
            own = loaded.tokenizer(models.target.tokenizer.decode(first), add_special_tokens=False)["input_ids"] or [0]
            ids = (own * (ctx_len // len(own) + 1))[:ctx_len]
        times = probe_forward_times(loaded.model, ids, kk, reps=PROBE_REPS)
        store.add({"kind": "probe", "model": spec, "role": role, "context_tokens": ctx_len, "reps": PROBE_REPS,
                   "forward_s": {str(k): t for k, t in times.items()}})


def quiet_transformers() -> None:
    """Keep transformers' generation warnings (flags, deprecations) out of the progress display."""
    try:
        from transformers.utils import logging as hf_logging  # lazy: transformers only to quiet it

        hf_logging.set_verbosity_error()
    except ImportError:
        pass
