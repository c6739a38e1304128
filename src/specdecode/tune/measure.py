"""The measuring of ``specdecode tune``: the budget's clock, the loaded models and every timed run
(:func:`run_tune` is the interface). It imports torch and the model stack; ``specdecode.tune`` loads it on
first use of ``run_tune``, so the command line reads and checks a tune's settings without them."""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from specdecode import layer_search
from specdecode.bench.env import environment
from specdecode.bench.runner import (
    PROBE_REPS,
    encode_all,
    engine_runner,
    probe_context,
    probe_forward_times,
    quiet_transformers,
    rotate,
)
from specdecode.bench.summary import cell, fastest_runs, first_difference, pool_metrics
from specdecode.build import build_factory, load_draft_for
from specdecode.threads import set_threads
from specdecode.eagle.head import EagleCheckpointError
from specdecode.errors import SpecDecodeError
from specdecode.kv.owned import supports
from specdecode.precision import load_target
from specdecode.preflight import check_models
from specdecode.proposers.eagle import find_head
from specdecode.proposers.factory import other_tokenizer
from specdecode.spec import DrafterSpec
from specdecode.tune.config import MEASURE_SHARE, PLAIN, TREE_KIND, TuneConfig, select_tune_prompts, split_prompts
from specdecode.tune.decide import (
    Candidate,
    Confirmation,
    Prediction,
    Skipped,
    TuneResult,
    check_output,
    choose,
    confirmation_plan,
    decision_lines,
    drafter_spec,
    load_average_1m,
    predict,
    variant_label,
)
from specdecode.tune.report import print_report, write_settings


# --------------------------------------------------------------------------- measuring


class _Clock:
    """Seconds since the run began, against the budget."""

    def __init__(self, budget_s: float) -> None:
        self.budget = budget_s
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self, share: float = 1.0) -> float:
        return share * self.budget - self.elapsed()


def run_tune(config: TuneConfig, *, progress: bool = True, log: Callable[[str], None] | None = None,
             console=None) -> TuneResult:
    """Measure, predict, confirm, decide, and write the settings file (and its JSON report).

    Args:
        config: the run. progress: show progress bars on stderr. log: status lines (default: stderr).
        console: a ``rich.console.Console`` for the report table (default: stdout).

    Returns:
        the :class:`TuneResult` (also written to ``config.output`` and its ``.json``).

    Raises:
        SpecDecodeError: a bad prompt source, a model that cannot load, a draft that cannot draft for it.
    """
    status = log or (lambda msg: print(f"specdecode tune: {msg}", file=sys.stderr, flush=True))
    clock = _Clock(config.budget_s)
    check_output(config.output)  # before any measuring: a path that cannot be written would lose the run
    prompts = select_tune_prompts(config)  # a bad file or dataset: refused before torch loads a model

    for draft in config.drafts or (None,):  # every model resolves (and a draft's tokenizer is read) before weights
        check_models(config.target, draft, cache_dir=config.cache_dir, cross_vocab=True)

    quiet_transformers()
    result = TuneResult(config=config)
    result.load_start = load_average_1m()
    result.threads = set_threads(config.threads, say=status)
    status(f"loading target {config.target!r} (weights {config.weights})")
    target, choice = load_target(config.target, config.weights, dtype=config.dtype, cache_dir=config.cache_dir,
                                 progress=progress, status=status)
    result.weights, result.weights_reason = choice.precision, choice.reason
    status(f"weights {choice.reason}")
    chat = config.chat if config.chat is not None else not config.prompts_file
    enc_cfg = replace(config, chat=chat)
    encoded = encode_all(prompts, target, enc_cfg, status)
    keys = [p.key for p in prompts if p.key in encoded]
    if not keys:
        raise SpecDecodeError("no prompt fits the target's context with --max-new-tokens "
                              f"{config.max_new_tokens}")
    result.sample, result.held_out = split_prompts(keys, config.sample_prompts, config.confirm_prompts)
    status(f"{len(keys)} prompts: {len(result.sample)} to measure acceptance, {len(result.held_out)} held out to "
           "confirm" + (" (one prompt: it serves both)" if len(keys) == 1 else ""))
    ids = {k: encoded[k][0] for k in keys}
    session = _Session(config, target, result, ids, clock, status, progress)
    try:
        session.measure_costs()
        session.measure_drafters()
        if not result.measured:  # no decision rests on nothing: a file pinning plain decoding would be a guess
            raise SpecDecodeError(session.nothing_measured())
        result.predictions = predict(result.plain, result.measured, result.ratio(), config.max_gamma)
        session.confirm(confirmation_plan(result.predictions, config.top))
    finally:
        session.close()
    result.choice = choose(result.predictions, result.confirmations, config.min_gain)
    result.load_end = load_average_1m()
    result.decision = decision_lines(result)
    result.seconds = clock.elapsed()
    result.environment = environment()
    try:

        result.load_average = list(os.getloadavg())
    except (AttributeError, OSError):
        pass
    print_report(result, console)
    path = write_settings(result, config.output)
    status(f"settings written to {path} (use: specdecode generate --config {path}); measurements in "
           f"{path.with_suffix('.json')}")
    return result


class _Session:
    """The loaded models and the runs of one tune (private: :func:`run_tune` is the interface)."""

    def __init__(self, config: TuneConfig, target, result: TuneResult, ids: dict[str, list[int]], clock: _Clock,
                 status, progress: bool) -> None:
        self.config, self.target, self.result, self.ids = config, target, result, ids
        self.clock, self.status, self.progress = clock, status, progress
        self.drafts: dict[str, object] = {}
        self.seeds = {k: config.seed + i for i, k in enumerate(ids)}
        self.plain_sample_s = 0.0
        self.eos = target.eos_token_ids
        #: seconds into the run at which a skipped drafter would have finished measuring (budget permitting)
        self.would_end: list[float] = []

    # Runs ------------------------------------------------------------------------

    def runner(self, cand: Candidate | None, gamma: int, policy: str = "fixed"):

        factory = None
        if cand is not None:
            factory = build_factory(cand.spec, self.target, self.drafts.get(cand.model) if cand.model else None,
                                    cache_dir=self.config.cache_dir)
        return engine_runner(self.target, None, max(1, gamma), self.config.max_new_tokens, self.config.temperature,
                             self.eos, self.target.max_context, policy=policy, new_proposer=factory)

    def record(self, key: str, prompt: str, out, rep: int = 0) -> dict:
        return {"kind": "run", "variant": key, "prompt": prompt, "rep": rep, "token_ids": out.token_ids,
                "new_tokens": len(out.token_ids), "wall_s": out.wall_s, "finish_reason": out.finish_reason,
                "metrics": out.metrics}

    def warm(self, run) -> None:
        first = next(iter(self.ids.values()))
        run(first[: min(len(first), 32)], 0, 8)

    def _bar(self):

        return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("elapsed"),
                        TimeElapsedColumn(), console=Console(stderr=True), disable=not self.progress,
                        transient=False)

    # 1. costs of the target ---------------------------------------------------------

    def measure_costs(self) -> None:

        sample = self.result.sample
        context = probe_context([self.ids[k] for k in sample], self.config.max_new_tokens)
        ks = list(range(self.config.max_gamma + 1))
        self.status(f"timing target forwards T_verify(k), k = 0..{ks[-1]}, at a context of {len(context)} tokens")
        self.result.verify_forward_s = probe_forward_times(self.target.model, context, ks, reps=PROBE_REPS)
        run = self.runner(None, 1)
        self.warm(run)
        recs = []
        t0 = time.perf_counter()
        with self._bar() as bar:
            task = bar.add_task("plain decoding (sample prompts)", total=len(sample))
            for k in sample:
                recs.append(self.record(PLAIN, k, run(self.ids[k], self.seeds[k])))
                bar.advance(task)
        self.plain_sample_s = time.perf_counter() - t0
        self.result.plain = pool_metrics(recs)
        run.engine.release()

    # 2. acceptance per drafter ----------------------------------------------------------

    def candidates(self) -> list[Candidate]:
        """The drafters to try, cheapest to measure first; what cannot run is recorded as skipped."""

        cfg, out = self.config, []
        kinds = set(cfg.drafters)
        if "ngram" in kinds:
            out.append(Candidate("ngram", self._spec("ngram")))
        if "suffix" in kinds:
            out.append(Candidate("suffix", self._spec("suffix"), trees=True))
        if "draft-model" in kinds:
            for spec in cfg.drafts:
                out += self._draft_candidates(spec)
        if "eagle" in kinds:
            out += self._eagle_candidates()
        if "layer-skip" in kinds:
            layers = len(getattr(self.target.model.model, "layers", []))
            if not supports(self.target.model):
                self.skip("layer-skip", "the target's family runs on the Hugging Face forward, which cannot skip layers")
            elif layers < 3:
                self.skip("layer-skip", f"the target has {layers} decoder layers: none to skip (first and last kept)")
            else:
                out.append(Candidate("layer-skip", self._spec("layer-skip")))
        return out

    def _spec(self, draft: str, tree: str = "none") -> DrafterSpec:
        return drafter_spec(draft, tree, self.config.tree_nodes)

    def _draft_candidates(self, spec: str) -> list[Candidate]:

        if spec not in self.drafts:
            self.status(f"loading draft {spec!r}")
            self.drafts[spec] = load_draft_for(self._spec(spec), self.target, self.config.target,
                                               weights=self.result.weights, draft_weights=self.config.draft_weights,
                                               dtype=self.config.dtype, cache_dir=self.config.cache_dir,
                                               progress=self.progress)
        draft = self.drafts[spec]
        other = other_tokenizer(self.target, draft)
        if other:
            self.skip(f"tree:{spec}", "its tokenizer differs from the target's: it drafts chains across "
                                      "vocabularies, not token trees")
            return [Candidate(f"draft-model:{spec}", self._spec(spec),
                              note=f"another tokenizer: cross-vocabulary, {other}")]
        return [Candidate(f"draft-model:{spec}", self._spec(spec), note="same tokenizer"),
                Candidate(f"tree:{spec}", self._spec(spec, TREE_KIND), trees=True,
                          note=f"{TREE_KIND} trees of {self.config.tree_nodes} nodes")]

    def _eagle_candidates(self) -> list[Candidate]:

        try:
            path = find_head(self.target.model, None, self.config.cache_dir)
        except EagleCheckpointError as exc:
            self.skip("eagle", str(exc))
            return []
        return [Candidate("eagle", self._spec("eagle"), note=str(path)),
                Candidate("eagle-tree", self._spec("eagle", TREE_KIND), trees=True, note=str(path))]

    def skip(self, what: str, why: str) -> None:
        self.result.skipped.append(Skipped(what, why))
        self.status(f"{what} skipped: {why}")

    def measure_drafters(self) -> None:

        cands = self.candidates()
        self.result.candidates = {c.key: c for c in cands}
        gamma = self.config.max_gamma
        sample = self.result.sample
        with self._bar() as bar:
            task = bar.add_task("acceptance per drafter", total=len(cands) * len(sample))
            for cand in cands:
                left = self.clock.left(MEASURE_SHARE)
                need = self.plain_sample_s * (2.0 if cand.model else 1.2)
                if left <= 0 or need > left:
                    self.would_end.append(self.clock.elapsed() + need)
                    self.skip(cand.key, f"the budget's measuring share is spent (~{need:.0f} s needed, "
                                        f"{max(left, 0):.0f} s left of {MEASURE_SHARE:.0%} of --budget "
                                        f"{self.config.budget_s:.0f} s)")
                    bar.advance(task, len(sample))
                    continue
                if cand.key == "layer-skip":
                    cand = self._layer_set(cand)
                    if cand is None:
                        bar.advance(task, len(sample))
                        continue
                    self.result.candidates[cand.key] = cand
                bar.update(task, description=f"acceptance: {cand.key} γ={gamma}"[:60])
                run = self.runner(cand, gamma)
                self.warm(run)
                recs = []
                for k in sample:
                    recs.append(self.record(cand.key, k, run(self.ids[k], self.seeds[k])))
                    bar.advance(task)
                run.engine.release()
                self.result.measured[cand.key] = (cand, gamma, pool_metrics(recs))

    def _layer_set(self, cand: Candidate) -> Candidate | None:
        """layer-skip with its skip set: the one cached for this target, else a search that fits the budget."""

        cached = layer_search.load_cached(self.target.model, self.config.cache_dir)
        if cached is not None:
            self.status(f"layer-skip: the cached skip set {list(cached.skip_layers)}")
            return replace(cand, spec=_skipping(cand.spec, cached.skip_layers), note="cached skip set")
        left = self.clock.left(MEASURE_SHARE) - 2.0 * self.plain_sample_s
        allowed = min(self.config.layer_search_s, left)
        if allowed < 30.0:
            self.would_end.append(self.clock.elapsed() + 30.0 + 2.0 * self.plain_sample_s)
            self.skip("layer-skip", f"no skip set is cached for this target and a search needs at least 30 s; "
                                    f"{max(allowed, 0):.0f} s of the budget are left for it (raise --budget or "
                                    "--layer-search, or run 'specdecode generate --draft layer-skip' once)")
            return None
        self.status(f"layer-skip: searching a skip set ({allowed:.0f} s at most; cached for next time)")
        prompts = [self.ids[k] for k in self.result.sample[:3]]
        found = layer_search.choose_skip_layers(self.target.model, prompts,
                                                layer_search.SearchConfig(time_budget_s=allowed),
                                                cache_dir=self.config.cache_dir)
        if found.loses:  # measured slower than plain decoding: nothing to confirm (and nothing was cached)
            self.skip("layer-skip", f"the search's best skip set {list(found.skip_layers)} measured "
                                    f"{found.speedup:.2f}x plain decoding")
            return None
        return replace(cand, spec=_skipping(cand.spec, found.skip_layers), note=f"searched in {found.seconds:.0f} s")

    def nothing_measured(self) -> str:
        """The refusal of a run that measured no drafter: the budget it needs, or why nothing could run."""
        cfg = self.config
        nothing = f"no decision made, nothing written to {cfg.output}"
        if not self.would_end:
            why = "; ".join(f"{s.what}: {s.why}" for s in self.result.skipped) or "no drafter to try"
            return f"no drafter could be measured ({why}): {nothing}"
        need = math.ceil(min(self.would_end) / MEASURE_SHARE / 10.0) * 10  # measuring ends at 60% of the budget
        return (f"--budget {cfg.budget_s:g} s measured no drafter: loading the target and timing plain decoding took "
                f"{self.clock.elapsed():.0f} s, and measuring must end at {MEASURE_SHARE:.0%} of the budget "
                f"({MEASURE_SHARE * cfg.budget_s:.0f} s); the cheapest drafter needs about "
                f"{min(self.would_end):.0f} s in all: give --budget {need} or more ({nothing})")

    # 4. confirmation -----------------------------------------------------------------------

    def confirm(self, plan: Sequence[Prediction]) -> None:

        if not plan:
            return
        keys = self.result.held_out
        methods = [(PLAIN, None, 0, "fixed")] + [(variant_label(p.key, p.gamma, p.policy), self.result.candidates[p.key],
                                                 p.gamma, p.policy) for p in plan]
        runs = {}
        for label, cand, gamma, policy in methods:
            runs[label] = self.runner(cand, gamma, policy)
            self.warm(runs[label])
        records: list[dict] = []
        done: list[str] = []
        with self._bar() as bar:
            task = bar.add_task("confirming on held-out prompts", total=len(keys) * len(methods) * self.config.repeats)
            for i, k in enumerate(keys):
                if done and self.clock.left() <= 0:
                    self.skip(f"confirmation on {len(keys) - len(done)} more held-out prompt(s)",
                              f"the --budget of {self.config.budget_s:.0f} s is spent")
                    break
                for rep in range(self.config.repeats):
                    for label, _, _, _ in rotate(methods, i + rep):
                        records.append(self.record(label, k, runs[label](self.ids[k], self.seeds[k]), rep))
                        bar.advance(task)
                done.append(k)
        for run in runs.values():
            run.engine.release()
        best = fastest_runs(records)
        base = {p: best[(PLAIN, p)] for p in done}
        plain_cell = cell({"key": PLAIN}, base, base)
        self.result.plain_confirmed_tokens_per_s = plain_cell["tokens_per_s"]
        for (label, cand, gamma, policy), p in zip(methods[1:], plan):
            recs = {q: best[(label, q)] for q in done if (label, q) in best}
            c = cell({"key": label}, recs, base)
            pooled = pool_metrics(list(recs.values())) or {}
            mism = 0
            if self.config.temperature == 0:
                mism = sum(first_difference(recs[q]["token_ids"], base[q]["token_ids"]) is not None for q in recs)
            self.result.confirmations.append(Confirmation(
                p.key, gamma, policy, c["throughput_ratio"], c["decode_speedup"], (c["speedup"] or {}).get("median"),
                pooled.get("tau", 0.0), pooled.get("acceptance_rate", 0.0), c["tokens_per_s"], c["n_paired"], mism))

    def close(self) -> None:
        self.drafts.clear()


def _skipping(spec: DrafterSpec, layers) -> DrafterSpec:
    """A layer-skip spec with its skip set."""
    return DrafterSpec.parse(f"layer-skip:skip_layers={'/'.join(map(str, layers))}").with_gamma(spec.num_speculative_tokens)
