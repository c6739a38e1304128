"""Choosing which decoder layers the layer-skip draft skips: a SWIFT-style search, cached per model.

Xia et al. 2024 ("SWIFT: On-the-Fly Self-Speculative Decoding") pick the skip
set on the fly from the text being generated, alternating random search with
Bayesian optimisation of how well the skipped model's parallel (teacher-forced)
predictions match the full model's. This module does the same in two stages,
so that the final choice rests on measured speed, not on a proxy alone:

1. **Context.** For each calibration prompt (e.g. the first request's prompt),
   plain greedy decoding through the engine produces ``new_tokens`` of the
   target's own text (timed: the plain-decoding baseline on this machine).
2. **Proxy, guided random search.** A candidate skip set S is scored by
   ``acceptance(S)``, the share of positions j where the skipped model's first
   draft token, drafted from token j on top of the full model's cache of
   tokens < j (as in decoding), equals the full model's argmax. All positions
   are scored in one pass of the kept layers (each query sees the cache before
   its position and itself), and by a timing model measured once
   on this machine (a draft step costs ``a + b * kept_layers``, verifying k
   tokens costs ``T_verify(k)``). The predicted speedup is
   ``max_gamma E(gamma) / (gamma * T_draft(S) + T_verify(gamma)) * T_verify(0)`` with
   ``E(gamma) = (1 - acc^(gamma+1)) / (1 - acc)``. Candidates come from evenly spread
   and random sets at several skip ratios, then mostly from mutations of the
   best so far (swap a skipped and a kept layer, or skip one more / one fewer):
   a (1+1)-evolution with random restarts.
3. **Measurement.** The best few candidates by the proxy are run for real
   (layer-skip speculative decoding through the engine on the same prompts,
   greedy), interleaved with plain decoding, twice, best round kept; the one
   with the highest measured tokens/s wins.

The budget (``SearchConfig.time_budget_s``) holds on a slow or busy machine too: the
calibration prompts are cut to what a quarter of it can decode, the proxy stage
leaves the time the timed runs are estimated to need (from the plain decoding of
stage 1), and a timed run starts only when its estimated cost fits in what is left
(the first always runs, on fewer prompts when time is short). Progress goes to the
``progress`` callback (:class:`SearchProgress`: steps done / planned, an ETA from
the measured cost of each kind of step), by default a bar on stderr.

The winner is stored in ``<cache_dir>/layer_skip.json`` under a key naming the
model (path, family, layer count, dtype and a digest of some weights), so later
runs reuse it at no cost, unless it measured slower than plain decoding: such a
set is not used (the proposer drafts nothing: plain decoding) and not stored for
every later run on the machine (:attr:`SearchResult.loses`). Greedy outputs never depend on the choice (it only
changes speed); sampled outputs keep the target's distribution whatever it is.

The forward over a subset of layers and the proxy's scorer are :mod:`specdecode.skip_forward`; the progress
display is :mod:`specdecode.search_progress`.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specdecode.engine import EngineConfig, SpeculativeEngine
from specdecode.models import default_cache_dir
from specdecode.proposers.layer_skip import LayerSkipConfig, LayerSkipProposer
from specdecode.search_progress import SearchProgress, progress_reporter
from specdecode.skip_forward import ProxyScorer, SkipForward
from specdecode.types import SamplingParams


CACHE_FILE = "layer_skip.json"
CACHE_FORMAT = 2  # 2: timed with the batch-invariant forward


@dataclass(frozen=True)
class SearchConfig:
    """Search settings.

    Attributes:
        new_tokens: target tokens generated per calibration prompt (the context the proxy scores,
            and the length of each timed run).
        max_prompt_tokens: keep only the last this many tokens of each prompt.
        skip_ratios: fractions of the skippable layers tried by the initial candidates.
        proxy_evaluations: most candidates scored by the proxy.
        measured_candidates: best proxy candidates timed by real decoding.
        max_gamma: largest draft length the speed model considers.
        protect_first, protect_last: layers at either end that are never skipped.
        time_budget_s: limit on the whole search: the calibration prompts get at most a quarter of it, the
            proxy stage stops when what is left is what the timed runs are estimated to need (at the latest
            at 60% of it), and a timed run starts only if its estimated cost fits; at least one candidate
            is always scored and one measured (on fewer prompts when time is short).
        seed: seeds the random search.
    """

    new_tokens: int = 32
    max_prompt_tokens: int = 256
    skip_ratios: tuple[float, ...] = (0.25, 0.35, 0.45, 0.55)
    proxy_evaluations: int = 48
    measured_candidates: int = 3
    max_gamma: int = 8
    protect_first: int = 1
    protect_last: int = 1
    time_budget_s: float = 120.0
    seed: int = 0


@dataclass
class SearchResult:
    """The chosen skip set and how it was found.

    Attributes:
        skip_layers: decoder layer indices to skip.
        gamma: the draft length the speed model predicted best for it.
        tokens_per_s: measured layer-skip decoding speed on the calibration prompts (None if not measured).
        plain_tokens_per_s: measured plain decoding speed on the same prompts.
        acceptance: proxy acceptance (teacher-forced argmax agreement) of the set.
        num_layers: decoder layers of the model.
        candidates: every candidate scored: skip_layers, acceptance, predicted_speedup, (measured) tokens_per_s.
        key: the model key in the cache file.
        from_cache: True when read from the cache file instead of searched.
        seconds: time the search took.
    """

    skip_layers: tuple[int, ...]
    gamma: int
    tokens_per_s: float | None
    plain_tokens_per_s: float | None
    acceptance: float
    num_layers: int
    candidates: list[dict] = field(default_factory=list)
    key: str = ""
    from_cache: bool = False
    seconds: float = 0.0

    @property
    def speedup(self) -> float | None:
        if self.tokens_per_s and self.plain_tokens_per_s:
            return self.tokens_per_s / self.plain_tokens_per_s
        return None

    @property
    def loses(self) -> bool:
        """Measured slower than plain decoding on the calibration prompts: not to be used, nor cached."""
        return self.speedup is not None and self.speedup < 1.0

    def line(self) -> str:
        """One line for people: the set used and what it measured, or why none is used."""
        layers = ",".join(map(str, self.skip_layers))
        measured = (f"{self.tokens_per_s:.1f} vs plain {self.plain_tokens_per_s:.1f} tokens/s" if self.speedup
                    else "-")
        if self.loses:
            return (f"no skip set was faster than plain decoding here (the best, layers {layers} of "
                    f"{self.num_layers}, measured {measured} = {self.speedup:.2f}x): drafting nothing, i.e. plain "
                    f"decoding; not cached, so a later run searches again (--skip-layers {layers} uses it anyway, "
                    "or choose another --draft)")
        how = "cached" if self.from_cache else f"searched in {self.seconds:.0f} s"
        return (f"skipping layers {layers} of {self.num_layers} ({how}; measured on the calibration prompts: "
                f"{measured})")

# --------------------------------------------------------------------------- cache file


def model_key(model: torch.nn.Module) -> str:
    """A key naming the model's weights: source path, family, layers, dtype, digest of a few tensors."""
    cfg = model.config
    name = Path(str(getattr(cfg, "_name_or_path", "") or "unnamed")).name
    emb = model.get_input_embeddings().weight
    digest = hashlib.sha256()
    for t in (emb[:8], emb[-8:], model.model.norm.weight):
        digest.update(t.detach().float().contiguous().numpy().tobytes())
    layers = len(model.model.layers)
    weights = getattr(cfg, "specdecode_weights", None) or str(emb.dtype).removeprefix("torch.")  # int8 runs differ
    return f"{name}|{getattr(cfg, 'model_type', '?')}|L{layers}|{weights}|{digest.hexdigest()[:16]}"


def cache_path(cache_dir: str | Path | None = None) -> Path:
    """``<cache_dir or models.default_cache_dir()>/layer_skip.json``."""
    if cache_dir is None:
        cache_dir = default_cache_dir()
    return Path(cache_dir).expanduser() / CACHE_FILE


def load_cached(model: torch.nn.Module, cache_dir: str | Path | None = None) -> SearchResult | None:
    """The stored choice for this model, or None (no file, no entry, unreadable file, or a set measured slower
    than plain decoding, which older versions stored)."""
    path = cache_path(cache_dir)
    key = model_key(model)
    try:
        entry = json.loads(path.read_text())["models"][key]
        known = {k: v for k, v in entry.items() if k in SearchResult.__dataclass_fields__}
        result = SearchResult(**{**known, "skip_layers": tuple(entry["skip_layers"]), "from_cache": True})
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if result.num_layers != len(model.model.layers) or result.loses:  # a losing set (stored by older versions)
        return None
    result.key = key
    return result


def store(model: torch.nn.Module, result: SearchResult, cache_dir: str | Path | None = None) -> Path:
    """Write ``result`` for this model into the cache file (atomically; other models' entries kept)."""
    path = cache_path(cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        data = json.loads(path.read_text())
        if data.get("format") != CACHE_FORMAT:
            data = {}
    except (OSError, ValueError):
        data = {}
    data.setdefault("format", CACHE_FORMAT)
    entry = asdict(result)
    entry.pop("from_cache")
    entry["skip_layers"] = list(result.skip_layers)
    entry["created"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    entry["cpu_count"] = os.cpu_count()
    entry["load_average"] = list(os.getloadavg())  # a search on a busy machine measures noise: this shows it
    data.setdefault("models", {})[model_key(model)] = entry
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".layer_skip.", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)
    return path


def choose_skip_layers(model: torch.nn.Module, prompts: Sequence[Sequence[int]],
                       config: SearchConfig | float | None = None, *, cache_dir: str | Path | None = None, refresh: bool = False) -> SearchResult:
    """The cached skip set for ``model``, or a fresh search on ``prompts`` (stored for next time unless it
    measured slower than plain decoding: :attr:`SearchResult.loses`).

    Args:
        model: the target (Llama / Qwen2 family), eval mode.
        prompts: calibration prompts as token id lists (at least one, each non-empty).
        config: SearchConfig, or a time budget in seconds.
        cache_dir: where ``layer_skip.json`` lives (default ``models.default_cache_dir()``).
        refresh: search even if a cached choice exists.

    Raises:
        LayerSkipError: unsupported model. ValueError: no usable prompt.
    """
    if not refresh:
        cached = load_cached(model, cache_dir)
        if cached is not None:
            return cached
    if isinstance(config, (int, float)):
        config = SearchConfig(time_budget_s=float(config))
    result = search_skip_layers(model, prompts, config)
    if not result.loses:  # a set slower than plain decoding is no choice to hand every later run
        store(model, result, cache_dir)
    return result


# --------------------------------------------------------------------------- search


def search_skip_layers(model: torch.nn.Module, prompts: Sequence[Sequence[int]],
                       config: SearchConfig | None = None,
                       progress: Callable[[SearchProgress], None] | bool | None = None) -> SearchResult:
    """Search for the skip set with the best measured layer-skip decoding speed (see the module docstring).

    Args:
        model: the target (Llama / Qwen2 family), eval mode.
        prompts: calibration prompts, token id lists.
        config: SearchConfig.
        progress: called with a :class:`SearchProgress` after every step; None or True: a bar on
            stderr (one line per estimate elsewhere); False: nothing.

    Returns:
        SearchResult (not stored; :func:`choose_skip_layers` stores).

    Raises:
        LayerSkipError: unsupported model. ValueError: no usable prompt.
    """
    config = config or SearchConfig()
    plan = _Plan(config, progress_reporter(progress))
    skip = SkipForward(model)
    prompts = [list(p)[-config.max_prompt_tokens:] for p in prompts if len(p)]
    if not prompts:
        raise ValueError("the layer-skip search needs at least one non-empty calibration prompt")
    try:
        contexts, plain_tps = _contexts(model, prompts, config.new_tokens, plan)
        prompts = prompts[: len(contexts)]
        plan.enter("timing")
        scorer = ProxyScorer(skip, contexts, [len(p) for p in prompts], config.max_gamma)
        ranked = _proxy_stage(scorer, skip.num_layers, config, plan, plain_tps)
        rows = ranked[: max(1, config.measured_candidates)]
        plain_tps = _measure_round_robin(model, prompts, rows, config, plan, plain_tps)
    finally:
        plan.enter("done")
    measured = [row for row in ranked if row["tokens_per_s"] is not None]
    winner = max(measured, key=lambda r: r["tokens_per_s"])
    return SearchResult(
        skip_layers=tuple(winner["skip_layers"]), gamma=winner["gamma"], tokens_per_s=winner["tokens_per_s"],
        plain_tokens_per_s=plain_tps, acceptance=winner["acceptance"], num_layers=skip.num_layers,
        candidates=ranked, key=model_key(model), seconds=plan.elapsed(),
    )


def _proxy_stage(scorer: ProxyScorer, num_layers: int, config: SearchConfig, plan: _Plan,
                 plain_tps: float) -> list[dict]:
    """Score the initial candidates, then mutations of the best, until the time the timed runs need; ranked."""
    rng = random.Random(config.seed)
    space = list(range(config.protect_first, num_layers - config.protect_last))
    if not space:  # too few layers to protect the ends
        space = list(range(num_layers))
    runs = max(1, config.measured_candidates)
    proxy_deadline = min(plan.started + 0.6 * config.time_budget_s, plan.deadline - runs * plan.run_cost())
    at_least = len(config.skip_ratios)  # one set per skip ratio, whatever the time
    plan.enter("proxy")
    scored: dict[tuple[int, ...], dict] = {}

    def evaluate(cand: tuple[int, ...]) -> None:
        if cand in scored or len(cand) >= num_layers:
            return
        t0 = time.perf_counter()
        scored[cand] = scorer.score(cand)
        cost = time.perf_counter() - t0
        each = statistics.mean([*plan.costs["proxy"], cost])
        fits = int(max(0.0, proxy_deadline - time.perf_counter()) // max(each, 1e-6))
        plan.planned["proxy"] = max(at_least, min(config.proxy_evaluations, len(scored) + fits))
        plan.step("proxy", cost)
        if len(scored) == 1:
            plan.announce(plain_tps)

    initial = _initial_candidates(space, config.skip_ratios, rng)
    for cand in initial:
        if len(scored) >= at_least and time.perf_counter() >= proxy_deadline:
            break
        evaluate(cand)
    attempts = 0  # mutations of a small layer space repeat: stop when nothing new turns up
    while (len(scored) < config.proxy_evaluations and attempts < 4 * config.proxy_evaluations
           and time.perf_counter() < proxy_deadline and space):
        attempts += 1
        best = max(scored.values(), key=lambda r: r["predicted_speedup"])["skip_layers"] if scored else ()
        evaluate(_mutate(tuple(best), space, config.skip_ratios, rng))
    plan.planned["proxy"] = len(scored)
    return sorted(scored.values(), key=lambda r: -r["predicted_speedup"])


def _initial_candidates(space: list[int], ratios: Sequence[float], rng: random.Random) -> list[tuple[int, ...]]:
    """Layers spread evenly over the skippable span at each ratio, then the deepest block, then a random set
    (so that a search stopped early has tried every ratio once)."""
    even, deep, rand = [], [], []
    for r in ratios:
        m = max(1, min(len(space) - 1, round(r * len(space))))
        even.append(tuple(sorted({space[int(i * len(space) / m + len(space) / (2 * m))] for i in range(m)})))
        deep.append(tuple(space[-m:]))
        rand.append(tuple(sorted(rng.sample(space, m))))
    return even + deep + rand


def _mutate(best: tuple[int, ...], space: list[int], ratios: Sequence[float], rng: random.Random) -> tuple[int, ...]:
    """A neighbour of ``best`` (swap one skipped and one kept layer, or grow / shrink by one), or a random restart."""
    if not best or rng.random() < 0.2:
        m = max(1, round(rng.choice(ratios) * len(space)))
        return tuple(sorted(rng.sample(space, min(m, len(space)))))
    skipped = set(best)
    kept = [i for i in space if i not in skipped]
    move = rng.random()
    if move < 0.6 and kept:
        skipped.remove(rng.choice(sorted(skipped)))
        skipped.add(rng.choice(kept))
    elif move < 0.8 and kept:
        skipped.add(rng.choice(kept))
    elif len(skipped) > 1:
        skipped.remove(rng.choice(sorted(skipped)))
    return tuple(sorted(skipped))


def _contexts(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int,
              plan: _Plan) -> tuple[list[list[int]], float]:
    """Greedy plain continuations of the prompts (the target's own text) and plain decoding tokens/s.

    Prompts after the first are decoded only while a quarter of the budget covers them (at the
    measured cost per prompt), so a slow machine calibrates on fewer prompts instead of overrunning.
    """
    engine = SpeculativeEngine(model, None)
    contexts, tokens, seconds = [], 0, 0.0
    plan.planned["contexts"] = len(prompts)
    share = 0.25 * plan.config.time_budget_s
    for p in prompts:
        if contexts and plan.elapsed() + plan.unit_cost("contexts") > share:
            break
        t0 = time.perf_counter()
        out = engine.generate(p, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
        contexts.append(p + out.token_ids)
        tokens += len(out.token_ids) - 1  # the first token comes from the prefill
        seconds += out.metrics.wall_time_s - out.metrics.prefill_time_s
        cost = time.perf_counter() - t0
        plan.planned["contexts"] = min(len(prompts), max(len(contexts), int(share // max(cost, 1e-9))))
        plan.step("contexts", cost)
    plan.planned["contexts"] = len(contexts)
    return contexts, tokens / seconds if seconds > 0 else 0.0


def _measure_round_robin(model: torch.nn.Module, prompts: list[list[int]], rows: list[dict], config: SearchConfig,
                         plan: _Plan, plain_tps: float, rounds: int = 2) -> float:
    """Time each candidate in turn, ``rounds`` times, with plain decoding between; keep each one's best round.

    Best-of-rounds because other work on a shared machine only ever slows a run
    down; interleaving keeps slow spells from favouring whichever ran first. The
    first round's plain run is stage 1's (the same prompts and tokens). Sets
    ``row["tokens_per_s"]``; returns the best plain tokens/s. A run starts only if
    its estimated cost fits in the budget left; the first candidate always runs,
    on as many prompts as fit (at least one).
    """
    plan.enter("measure")
    plain = plain_tps
    plan.planned["measure"] = max(1, min(len(rows), int(plan.left() // plan.run_cost())))
    for r in range(rounds):
        if r:
            if plan.left() < (len(rows) + 1) * plan.run_cost():
                break
            plan.planned["measure"] = plan.done["measure"] + len(rows) + 1
            plain = max(plain, _timed_run(model, prompts, None, 1, config.new_tokens, plan))
        for i, row in enumerate(rows):
            first = r == 0 and i == 0
            if not first and plan.left() < plan.run_cost():
                break
            use = prompts
            if first:  # as many prompts as the time left covers, at least one
                per_prompt = plan.run_cost() / len(prompts)
                use = prompts[: max(1, min(len(prompts), int(plan.left() // max(per_prompt, 1e-9))))]
            tps = _timed_run(model, use, tuple(row["skip_layers"]), row["gamma"], config.new_tokens, plan,
                             scale=len(prompts) / len(use))
            row["tokens_per_s"] = max(row["tokens_per_s"] or 0.0, tps)
    plan.planned["measure"] = plan.done["measure"]
    return plain


def _timed_run(model: torch.nn.Module, prompts: list[list[int]], skip_layers: tuple[int, ...] | None, gamma: int,
               new_tokens: int, plan: _Plan, scale: float = 1.0) -> float:
    """:func:`_measure`, its wall time recorded as a "measure" step (scaled to all calibration prompts)."""
    t0 = time.perf_counter()
    tps = _measure(model, prompts, skip_layers, gamma, new_tokens)
    plan.step("measure", (time.perf_counter() - t0) * scale)
    return tps


class _Plan:
    """The search's clock: steps done and planned per kind, their measured costs, the deadline; reports progress."""

    KINDS = ("contexts", "proxy", "measure")

    def __init__(self, config: SearchConfig, report: Callable[[SearchProgress], None]) -> None:
        self.config, self.report = config, report
        self.started = time.perf_counter()
        self.deadline = self.started + config.time_budget_s
        self.done = dict.fromkeys(self.KINDS, 0)
        self.planned = {"contexts": 1, "proxy": config.proxy_evaluations, "measure": max(1, config.measured_candidates)}
        self.costs: dict[str, list[float]] = {k: [] for k in self.KINDS}
        self.stage = "contexts"

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def unit_cost(self, kind: str) -> float:
        """Mean measured seconds of one step of ``kind`` (0.0 before any)."""
        return statistics.mean(self.costs[kind]) if self.costs[kind] else 0.0

    def run_cost(self) -> float:
        """Seconds of one timed run on all calibration prompts: the slowest so far, else stage 1's plain decoding."""
        return max(self.costs["measure"]) if self.costs["measure"] else sum(self.costs["contexts"])

    def eta(self) -> float | None:
        total = 0.0
        for kind in self.KINDS:
            rest = max(0, self.planned[kind] - self.done[kind])
            cost = self.run_cost() if kind == "measure" else self.unit_cost(kind)
            if rest and not cost:
                return None
            total += rest * cost
        return total

    def step(self, kind: str, seconds: float) -> None:
        self.done[kind] += 1
        self.costs[kind].append(seconds)
        self.emit()

    def enter(self, stage: str) -> None:
        self.stage = stage
        self.emit()

    def emit(self, message: str = "") -> None:
        done = sum(self.done.values())
        total = sum(max(self.planned[k], self.done[k]) for k in self.KINDS)
        eta = 0.0 if self.stage == "done" else self.eta()
        self.report(SearchProgress(self.stage, done, total, self.elapsed(), eta, message))

    def announce(self, plain_tps: float) -> None:
        """The estimate, once every kind of step has a measured cost (after the first candidate is scored)."""
        eta = self.eta() or 0.0
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        self.emit(f"plain decoding {plain_tps:.1f} tokens/s here (1-min load {load:.1f}, {os.cpu_count()} CPUs); "
                  f"about {self.planned['proxy']} candidates at {self.unit_cost('proxy'):.1f} s each and "
                  f"{self.planned['measure']} timed run(s) at about {self.run_cost():.0f} s: about {eta:.0f} s "
                  f"left, {self.elapsed() + eta:.0f} s in all (budget {self.config.time_budget_s:.0f} s)")


def _measure(model: torch.nn.Module, prompts: list[list[int]], skip_layers: tuple[int, ...] | None, gamma: int,
             new_tokens: int) -> float:
    """Measured greedy decoding tokens/s (prefill excluded) on the prompts: layer-skip, or plain (None)."""
    proposer = None if skip_layers is None else LayerSkipProposer(model, LayerSkipConfig(skip_layers=skip_layers))  # noqa: E501
    engine = SpeculativeEngine(model, proposer, EngineConfig(num_speculative_tokens=gamma))
    tokens, seconds = 0, 0.0
    for p in prompts:
        out = engine.generate(p, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
        tokens += len(out.token_ids) - 1
        seconds += out.metrics.wall_time_s - out.metrics.prefill_time_s
    return tokens / seconds if seconds > 0 else 0.0


__all__ = ["SearchConfig", "SearchProgress", "SearchResult", "cache_path", "choose_skip_layers", "load_cached", "model_key",
           "search_skip_layers", "store"]
