"""``specdecode tune``: choose the drafter, gamma and draft-length policy for a workload by measuring it.

On the user's own prompts and machine, in this order (each stage stops at the time budget and says what
it skipped):

1. **costs of the target**: T_decode (one plain step) and T_verify(k) for k = 0..max_gamma, timed the
   way the benchmark times them (``bench.runner.probe_forward_times``), and plain decoding of the
   sample prompts (T_plain per token, the loop's overhead included);
2. **acceptance per drafter**: every candidate drafter (none, n-gram, suffix, layer-skip with its cached
   or searched skip set, each draft model given (same tokenizer or cross-vocabulary), its token trees,
   a trained EAGLE head when one exists for the target, and its trees) runs the sample prompts at a
   generous gamma (``max_gamma``, fixed policy); its run metrics give the per-position acceptance
   (survival), the draft lengths, T_draft per token and the per-step overhead (``bench.summary.pool_metrics``);
3. **prediction**: the cost model (``costmodel.overhead_aware_speedup_mixture`` through
   ``bench.summary.predicted_curve``) predicts the decode speedup of every drafter at every gamma
   1..max_gamma (token trees: at their own gamma, from their measured tau and per-step time);
   the ``cost-model`` policy (gamma chosen online, 0 = plain decoding) is predicted to reach the best
   fixed gamma, or plain decoding when every gamma loses;
4. **confirmation**: the best predicted candidates (``top``, distinct drafters, at their best gamma; the
   best chain drafter also with the ``cost-model`` policy) run against plain decoding on held-out
   prompts, interleaved prompt by prompt (the order rotates), ``repeats`` times, the fastest run of
   each counting (noise on a shared machine only adds time);
5. **decision**: the fastest measured candidate when it beats plain decoding by ``min_gain`` (default
   5%), else plain decoding; every step of the reasoning is a line made of measurements.

The chosen settings are written as a TOML file for ``--config`` (:mod:`specdecode.configfile`), with the
measurements in its ``[tune]`` table, and the full measurements as JSON beside it.

Speedup is decode speedup in the prediction (prefill is the same target pass either way) and wall-clock
tokens/s over plain decoding's in the confirmation (DESIGN.md's definition). Times are seconds.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from specdecode.errors import SpecDecodeError
from specdecode.options import DEFAULT_TREE_NODES
from specdecode.paths import check_output_file
from specdecode.spec import DrafterSpec

#: Drafter kinds ``--drafters`` may name (``draft-model``: every ``--draft`` model given).
DRAFTER_KINDS = ("ngram", "suffix", "layer-skip", "eagle", "draft-model")
#: Token trees of the drafters that make them on request (draft models, EAGLE heads).
TREE_KIND = "dynamic"
PLAIN = "plain"
#: Share of the budget the measurement stages may use; the rest is kept for the confirmation.
MEASURE_SHARE = 0.6
#: n-gram acceptance at which a workload counts as repetitive (for the decision's wording only).
REPETITIVE_ACCEPTANCE = 0.3


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class TuneConfig:
    """One ``specdecode tune`` run.

    Attributes:
        target: the target's model spec (``models.load_model``).
        drafts: draft-model specs to try (same tokenizer, or another: cross-vocabulary drafting).
        datasets: prompt sets (``spec-bench:coding:2``, ``humaneval:5``, ...); or ``prompts_file``.
        prompts_file: a file of the user's own prompts (:func:`read_prompts_file`).
        budget_s: wall-clock seconds for the whole run, loading included (> 0).
        max_new_tokens: tokens per prompt in every run.
        temperature: 0 = greedy; > 0 samples (the same seed per prompt in every method).
        threads: torch threads (None: one per idle core, as ``generate``).
        weights, draft_weights, dtype: precisions, as ``generate``'s flags (``auto`` measures once per machine).
        max_gamma: the generous gamma the acceptance runs draft at, and the largest gamma predicted.
        drafters: which kinds of :data:`DRAFTER_KINDS` to try.
        top: candidates confirmed by running them (besides plain decoding).
        repeats: runs of each (prompt, method) in the confirmation; the fastest counts.
        sample_prompts, confirm_prompts: most prompts for the acceptance runs / the confirmation.
        min_gain: speculation is chosen only when measured at least ``1 + min_gain`` times plain decoding.
        tree_nodes: node budget of token trees (and of suffix decoding).
        layer_search_s: most seconds a layer-skip search may take when no skip set is cached.
        chat: chat template on chat prompts (None: on for prompt sets, off for a prompts file).
        seed: prompt i samples with seed + i.
        cache_dir: model cache (None: ``$SPECDECODE_CACHE`` or ~/.cache/specdecode).
        output: the TOML settings file to write (the JSON report goes beside it, ``.json``).

    Raises:
        SpecDecodeError: a value out of range, no prompt source or two, an unknown drafter kind.
    """

    target: str
    drafts: tuple[str, ...] = ()
    datasets: tuple[str, ...] = ()
    prompts_file: str | None = None
    budget_s: float = 600.0
    max_new_tokens: int = 128
    temperature: float = 0.0
    threads: int | None = None
    weights: str = "auto"
    draft_weights: str | None = None
    dtype: str = "float32"
    max_gamma: int = 8
    drafters: tuple[str, ...] = DRAFTER_KINDS
    top: int = 3
    repeats: int = 2
    sample_prompts: int = 4
    confirm_prompts: int = 6
    min_gain: float = 0.05
    tree_nodes: int = DEFAULT_TREE_NODES
    layer_search_s: float = 120.0
    chat: bool | None = None
    seed: int = 0
    cache_dir: str | None = None
    output: str = "specdecode-tune.toml"

    def __post_init__(self) -> None:
        from specdecode.options import WEIGHT_CHOICES, WEIGHT_PRECISIONS
        from specdecode.validate import check_sampling, check_threads

        if bool(self.datasets) == bool(self.prompts_file):
            raise SpecDecodeError("give the prompts with one of --prompts FILE or --dataset SPEC")
        if not (isinstance(self.budget_s, (int, float)) and math.isfinite(self.budget_s) and self.budget_s > 0):
            raise SpecDecodeError(f"--budget must be a number of seconds > 0, got {self.budget_s!r}")
        check_sampling(self.temperature, 0, 1.0, self.max_new_tokens, None)
        for name, value, low, high in (("--max-gamma", self.max_gamma, 1, 16), ("--top", self.top, 1, 8),
                                       ("--repeats", self.repeats, 1, 10), ("--tree-nodes", self.tree_nodes, 1, 64),
                                       ("--sample-prompts", self.sample_prompts, 1, 100),
                                       ("--confirm-prompts", self.confirm_prompts, 1, 100)):
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise SpecDecodeError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
        check_threads(self.threads)  # 1..the cores this process may use
        if not 0.0 <= self.min_gain < 1.0:
            raise SpecDecodeError(f"--min-gain must be in [0, 1), got {self.min_gain!r}")
        if self.weights not in WEIGHT_CHOICES:
            raise SpecDecodeError(f"unknown weight precision {self.weights!r}; choose one of {', '.join(WEIGHT_CHOICES)}")
        if self.draft_weights is not None and self.draft_weights not in WEIGHT_PRECISIONS:
            raise SpecDecodeError(f"unknown draft weight precision {self.draft_weights!r}; choose one of "
                                  f"{', '.join(WEIGHT_PRECISIONS)}")
        unknown = [d for d in self.drafters if d not in DRAFTER_KINDS]
        if unknown or not self.drafters:
            raise SpecDecodeError(f"unknown drafter {unknown[0]!r}; --drafters takes {', '.join(DRAFTER_KINDS)}"
                                  if unknown else "--drafters is empty; name at least one of "
                                  f"{', '.join(DRAFTER_KINDS)}")
        if "draft-model" in self.drafters and not self.drafts and self.drafters != DRAFTER_KINDS:
            raise SpecDecodeError("--drafters draft-model needs --draft MODEL")
        if not self.layer_search_s >= 0:
            raise SpecDecodeError(f"--layer-search must be >= 0 seconds, got {self.layer_search_s!r}")


# --------------------------------------------------------------------------- prompts


def read_prompts_file(path: str | Path):
    """The user's prompts as ``bench.runner.BenchPrompt`` s, in file order.

    Formats, by extension: ``.jsonl``: one JSON string, or object with ``prompt`` (or ``text``, or
    ``turns`` whose first is used) and optional ``category`` / ``id``, per line; ``.json``: a list of the
    same; anything else: plain text, prompts separated by lines holding only ``---`` (without such a
    line, one prompt per non-empty line).

    Raises:
        SpecDecodeError: no such file, unreadable, malformed (the line named), or no prompt in it.
    """
    from specdecode.bench.runner import BenchPrompt

    file = Path(path).expanduser()
    if not file.is_file():
        raise SpecDecodeError(f"--prompts {path}: no such file")
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecDecodeError(f"--prompts {path}: cannot read it: {exc}") from None
    items: list[tuple[str, str, str | None]] = []  # (text, category, id)
    if file.suffix.lower() in (".jsonl", ".json"):
        if file.suffix.lower() == ".json":
            try:
                rows = json.loads(text)
            except json.JSONDecodeError as exc:
                raise SpecDecodeError(f"--prompts {path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
            if not isinstance(rows, list):
                raise SpecDecodeError(f"--prompts {path}: a .json prompts file holds a list of prompts")
            numbered = [(i + 1, r) for i, r in enumerate(rows)]
        else:
            numbered = []
            for n, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    try:
                        numbered.append((n, json.loads(line)))
                    except json.JSONDecodeError as exc:
                        raise SpecDecodeError(f"--prompts {path}: line {n} is not JSON ({exc.msg})") from None
        for n, row in numbered:
            items.append(_prompt_of(row, n, path))
    else:
        lines = text.splitlines()
        if any(line.strip() == "---" for line in lines):
            chunks, cur = [], []
            for line in lines:
                if line.strip() == "---":
                    chunks.append("\n".join(cur))
                    cur = []
                else:
                    cur.append(line)
            chunks.append("\n".join(cur))
        else:
            chunks = lines
        items = [(c.strip("\n"), "prompts", None) for c in chunks if c.strip()]
    if not items:
        raise SpecDecodeError(f"--prompts {path}: no prompt in the file")
    return [BenchPrompt(f"prompts/{pid or i}", "prompts", cat, t, False) for i, (t, cat, pid) in enumerate(items)]


def _prompt_of(row, n: int, path) -> tuple[str, str, str | None]:
    if isinstance(row, str):
        text, cat, pid = row, "prompts", None
    elif isinstance(row, dict):
        text = row.get("prompt", row.get("text"))
        if text is None and isinstance(row.get("turns"), list) and row["turns"]:
            text = row["turns"][0]
        cat, pid = str(row.get("category", "prompts")), row.get("id")
    else:
        text = None
    if not isinstance(text, str) or not text.strip():
        raise SpecDecodeError(f"--prompts {path}: entry {n} has no prompt text (a string, or an object with "
                              f"'prompt', 'text' or 'turns')")
    return text, cat, None if pid is None else str(pid)


def select_tune_prompts(config: TuneConfig):
    """All prompts of the run: the file's, or the prompt sets' (round-robin over categories)."""
    from specdecode.bench.runner import select_prompts

    if config.prompts_file:
        return read_prompts_file(config.prompts_file)
    return select_prompts(config.datasets, None)


def split_prompts(keys: Sequence[str], sample: int, confirm: int) -> tuple[list[str], list[str]]:
    """(sample keys, held-out keys): the first half (at most ``sample``) measures acceptance, the rest (at most
    ``confirm``) confirms; a single prompt serves both. Prompt sets come round-robin over categories, so both
    halves cover the categories."""
    keys = list(keys)
    if len(keys) <= 1:
        return keys, keys
    half = min(sample, (len(keys) + 1) // 2)
    return keys[:half], keys[half:][:confirm]


# --------------------------------------------------------------------------- candidates


@dataclass(frozen=True)
class Candidate:
    """One drafter to try: a drafter spec (without γ: tune searches it) and what the decision says of it.

    Attributes:
        key: identity in tables and records (``ngram``, ``draft-model:SPEC``, ``tree:SPEC``, ``eagle``, ...).
        spec: the drafter, built by the one builder as ``generate`` / ``serve`` / ``bench`` build it; its
            ``settings()`` are what the settings file says, its compact form is ``bench --methods``.
        trees: whether it drafts token trees (suffix decoding, ``--tree``): no chain cost model then.
        note: a word on it for the decision (cross-vocabulary, the head's path, ...).
    """

    key: str
    spec: DrafterSpec
    trees: bool = False
    note: str = ""

    @property
    def model(self) -> str | None:
        """The draft-model spec loaded (None for model-free drafters and heads)."""
        return self.spec.model_spec

    @property
    def tree(self) -> str:
        """The token-tree kind ("none" = chains)."""
        return self.spec.tree

    def label(self, gamma: int | None = None, policy: str = "fixed") -> str:
        g = "" if gamma is None else f" γ={gamma}"
        return self.key + g + ("" if policy == "fixed" else f" {policy}")


def drafter_spec(draft: str, tree: str = "none", tree_nodes: int = DEFAULT_TREE_NODES) -> DrafterSpec:
    """The spec of ``--draft draft --tree tree --tree-nodes tree_nodes`` without γ (tune chooses it).

    Raises:
        SpecDecodeError: as :meth:`DrafterSpec.from_settings`.
    """
    return DrafterSpec.from_settings({"draft": draft, "tree": tree, "tree_nodes": tree_nodes}).with_gamma(None)


@dataclass
class Skipped:
    """Something not measured, and why (budget, no head, unsupported model, ...)."""

    what: str
    why: str


# --------------------------------------------------------------------------- prediction (pure)


@dataclass(frozen=True)
class Prediction:
    """The cost model's figure for one drafter at one gamma and policy.

    Attributes:
        key: the candidate's key. gamma: draft length. policy: "fixed" or "cost-model".
        speedup: predicted decode speedup over plain decoding (x).
        tau: predicted tokens per target forward.
        acceptance: measured acceptance rate (accepted / drafted) of the drafter's sample runs.
        basis: "cost model" (chains: survival, T_draft, T_verify(k)) or "tree run" (a tree's measured
            tau and per-step time at its own gamma) or "policy" (cost-model: the best fixed gamma, or plain).
    """

    key: str
    gamma: int
    policy: str
    speedup: float
    tau: float
    acceptance: float
    basis: str


def predict(plain: dict, measured: dict[str, tuple[Candidate, int, dict]], ratio, max_gamma: int
            ) -> list[Prediction]:
    """Predicted speedup of every measured drafter at every gamma 1..max_gamma (trees at their own gamma), plus
    the ``cost-model`` policy of each chain drafter, best first.

    Args:
        plain: pooled metrics (``bench.summary.pool_metrics``) of plain decoding on the sample prompts.
        measured: {key: (candidate, gamma its sample runs drafted at, pooled metrics of those runs)}.
        ratio: T_verify(k) / T_decode(1) as a function of k (``costmodel.verify_ratio_from_samples``), or None.
        max_gamma: the largest gamma predicted.

    Returns:
        predictions sorted by predicted speedup, highest first (ties: the smaller gamma first).
    """
    from specdecode.bench.summary import predicted_curve

    out: list[Prediction] = []
    for key, (cand, cap, pooled) in measured.items():
        if not pooled or not pooled["num_verify_steps"]:
            continue
        acc = pooled["acceptance_rate"]
        if cand.trees or pooled["is_tree"]:
            out.append(Prediction(key, cap, "fixed", tree_speedup(plain, pooled), pooled["tau"], acc, "tree run"))
            continue
        gammas = list(range(1, max_gamma + 1))
        curve = predicted_curve(plain, pooled, cap, ratio, gammas)
        if curve is None:  # nothing drafted at all: every step was a plain one
            out.append(Prediction(key, cap, "fixed", tree_speedup(plain, pooled), pooled["tau"], acc, "run"))
            continue
        rows = [Prediction(key, g, "fixed", s, t, acc, "cost model") for g, t, s in zip(gammas, *curve)]
        out += rows
        best = max(rows, key=lambda p: (p.speedup, -p.gamma))
        out.append(Prediction(key, best.gamma, "cost-model", max(best.speedup, 1.0), max(best.tau, 1.0), acc,
                              "policy"))
    return sorted(out, key=lambda p: (-p.speedup, p.gamma, p.policy != "fixed"))


def tree_speedup(plain: dict, spec: dict) -> float:
    """tau * T_plain / (measured seconds per speculative step): the per-step model with a run's own costs."""
    steps, steps_p = spec["num_verify_steps"], plain["num_verify_steps"]
    if not steps or not steps_p:
        return 0.0
    t_plain = (plain["verify_time_s"] + plain["other_time_s"]) / steps_p
    t_step = (spec["draft_time_s"] + spec["verify_time_s"] + spec["other_time_s"]) / steps
    return spec["tau"] * t_plain / t_step if t_step > 0 else 0.0


def best_per_drafter(predictions: Sequence[Prediction], policy: str = "fixed") -> list[Prediction]:
    """The best prediction of each drafter under ``policy``, best first."""
    seen: dict[str, Prediction] = {}
    for p in predictions:
        if p.policy == policy and p.key not in seen:
            seen[p.key] = p
    return sorted(seen.values(), key=lambda p: -p.speedup)


def confirmation_plan(predictions: Sequence[Prediction], top: int, floor: float = 0.9) -> list[Prediction]:
    """What to run on the held-out prompts: the ``top`` drafters at their best fixed gamma (those predicted at
    least ``floor`` x, and always the best one, to check the prediction), then the ``cost-model`` policy of the
    best chain drafter among them."""
    best = best_per_drafter(predictions)
    plan = [p for p in best[:top] if p.speedup >= floor] or best[:1]
    chains = {p.key for p in predictions if p.basis == "cost model"}
    lead = next((p for p in plan if p.key in chains), None)
    if lead is not None:
        policy = next(p for p in predictions if p.key == lead.key and p.policy == "cost-model")
        plan.append(policy)
    return plan


@dataclass(frozen=True)
class Confirmation:
    """A candidate measured against plain decoding on the held-out prompts (the fastest of the repeats).

    Attributes:
        key, gamma, policy: what ran. speedup: wall-clock tokens/s over plain decoding's, pooled over the
        prompts (x). decode_speedup: the same after the first token (what the cost model predicts).
        median_speedup: median over prompts of per-prompt speedups. tau: tokens per target forward.
        acceptance: accepted / drafted. tokens_per_s: its pooled tokens/s. prompts: prompts paired with plain.
        mismatches: greedy runs whose tokens differ from plain decoding's (0 = lossless, as it must be).
    """

    key: str
    gamma: int
    policy: str
    speedup: float | None
    decode_speedup: float | None
    median_speedup: float | None
    tau: float
    acceptance: float
    tokens_per_s: float | None
    prompts: int
    mismatches: int = 0


@dataclass(frozen=True)
class Choice:
    """The decision: a drafter at gamma and policy, or plain decoding (``key`` = "plain").

    Attributes:
        key, gamma, policy: the settings chosen. measured: its confirmed speedup (None if not confirmed).
        predicted: its predicted speedup. reason: the last line of the decision.
    """

    key: str
    gamma: int
    policy: str
    measured: float | None
    predicted: float | None
    reason: str


def choose(predictions: Sequence[Prediction], confirmations: Sequence[Confirmation], min_gain: float) -> Choice:
    """Choose: the fastest confirmed candidate if it beats plain decoding by ``min_gain``; without confirmations,
    the best prediction under the same rule; else plain decoding.

    Args:
        predictions: from :func:`predict`. confirmations: measured on held-out prompts (may be empty).
        min_gain: speculation must be at least ``1 + min_gain`` times plain decoding.
    """
    need = 1.0 + min_gain
    pred_of = {(p.key, p.gamma, p.policy): p.speedup for p in predictions}
    measured = [c for c in confirmations if c.speedup is not None]
    if measured:
        best = max(measured, key=lambda c: (c.speedup, c.policy == "fixed", -c.gamma))
        pred = pred_of.get((best.key, best.gamma, best.policy))
        if best.speedup >= need:
            return Choice(best.key, best.gamma, best.policy, best.speedup, pred,
                          f"{_label(best.key, best.gamma, best.policy)}: measured {best.speedup:.2f}x plain "
                          f"decoding on the held-out prompts (predicted {_x(pred)})")
        return Choice(PLAIN, 0, "fixed", 1.0, None,
                      f"plain decoding: the fastest confirmed drafter, {_label(best.key, best.gamma, best.policy)}, "
                      f"measured {best.speedup:.2f}x, is not {need:.2f}x plain decoding (speculation would not pay "
                      "here)")
    best_pred = best_per_drafter(predictions)
    if best_pred and best_pred[0].speedup >= need:
        p = best_pred[0]
        return Choice(p.key, p.gamma, p.policy, None, p.speedup,
                      f"{_label(p.key, p.gamma, p.policy)}: predicted {p.speedup:.2f}x (not confirmed: no time was "
                      "left to run it)")
    if not best_pred:
        return Choice(PLAIN, 0, "fixed", None, None, "plain decoding: no drafter could be measured")
    return Choice(PLAIN, 0, "fixed", None, None,
                  f"plain decoding: every drafter predicted < {need:.2f}x (best {best_pred[0].key} "
                  f"{best_pred[0].speedup:.2f}x): speculation would be slower here")


def _label(key: str, gamma: int, policy: str) -> str:
    return f"{key} γ={gamma}" + ("" if policy == "fixed" else f" (policy {policy})")


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


# --------------------------------------------------------------------------- the result


@dataclass
class TuneResult:
    """Everything a tune run measured and decided (JSON-ready through :meth:`to_dict`)."""

    config: TuneConfig
    environment: dict = field(default_factory=dict)
    weights: str = "fp32"
    weights_reason: str = ""
    threads: int = 1
    sample: list[str] = field(default_factory=list)
    held_out: list[str] = field(default_factory=list)
    verify_forward_s: dict[int, float] = field(default_factory=dict)
    plain: dict | None = None
    candidates: dict[str, Candidate] = field(default_factory=dict)
    measured: dict[str, tuple[Candidate, int, dict]] = field(default_factory=dict)
    predictions: list[Prediction] = field(default_factory=list)
    confirmations: list[Confirmation] = field(default_factory=list)
    plain_confirmed_tokens_per_s: float | None = None
    choice: Choice | None = None
    decision: list[str] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    seconds: float = 0.0
    load_average: list[float] = field(default_factory=list)
    #: 1-minute load average when the run began and when it ended (``os.getloadavg``), None where unknown
    load_start: float | None = None
    load_end: float | None = None

    def ratio(self):
        """T_verify(k) / T_decode(1) from the probe (None without one)."""
        from specdecode.costmodel import verify_ratio_from_samples

        return verify_ratio_from_samples(self.verify_forward_s) if self.verify_forward_s.get(0) else None

    def chosen_settings(self) -> dict:
        """The generate / serve settings of the choice (config-file keys)."""
        c = self.choice
        out = {"target": self.config.target}
        if c is None or c.key == PLAIN:
            out["draft"] = "none"
        else:
            out.update(self.candidates[c.key].spec.with_gamma(c.gamma).settings(), policy=c.policy)
        out["weights"] = self.weights
        cand = self.candidates.get(c.key) if c is not None else None
        if cand is not None and cand.model is not None:
            out["draft_weights"] = self.config.draft_weights or self.weights
        if self.config.dtype != "float32":
            out["dtype"] = self.config.dtype
        if self.config.threads:  # a thread count chosen by the user; else each run samples the idle cores itself
            out["threads"] = self.threads
        return out

    def to_dict(self) -> dict:
        return {
            "config": asdict(self.config), "environment": self.environment, "weights": self.weights,
            "weights_reason": self.weights_reason, "threads": self.threads, "sample_prompts": self.sample,
            "held_out_prompts": self.held_out,
            "target_forward_s": {str(k): v for k, v in self.verify_forward_s.items()},
            "plain": _slim(self.plain),
            "measured": {k: {"candidate": asdict(c), "gamma": g, "pooled": _slim(p)}
                         for k, (c, g, p) in self.measured.items()},
            "predictions": [asdict(p) for p in self.predictions],
            "confirmations": [asdict(c) for c in self.confirmations],
            "plain_confirmed_tokens_per_s": self.plain_confirmed_tokens_per_s,
            "choice": asdict(self.choice) if self.choice else None, "settings": self.chosen_settings(),
            "decision": self.decision, "skipped": [asdict(s) for s in self.skipped], "seconds": self.seconds,
            "load_average": self.load_average, "load1_start": self.load_start, "load1_end": self.load_end,
        }


def _slim(pooled: dict | None) -> dict | None:
    return None if pooled is None else {k: v for k, v in pooled.items() if k != "draft_lengths"}


# --------------------------------------------------------------------------- the decision in words (pure)


def decision_lines(result: TuneResult) -> list[str]:
    """The decision tree the run took, one line per branch, each made of measurements."""
    lines = []
    plain = result.plain
    if plain and plain["num_verify_steps"]:
        steps = plain["num_verify_steps"]
        t_decode = plain["verify_time_s"] / steps
        tps = (plain["num_generated_tokens"] / plain["wall_s"]) if plain["wall_s"] else 0.0
        ratio = result.ratio()
        vr = ", ".join(f"T_verify({k})/T_decode {ratio(k):.2f}" for k in (1, 4, result.config.max_gamma)
                       if ratio is not None and k <= result.config.max_gamma)
        lines.append(f"target {result.config.target}, weights {result.weights}, {result.threads} thread(s): plain "
                     f"decoding {tps:.1f} tokens/s, T_decode {1e3 * t_decode:.1f} ms" + (f"; {vr}" if vr else ""))
    models = [c for c in result.candidates.values() if c.model is not None and c.tree == "none"]
    if not result.config.drafts:
        tried = [k for k in ("ngram", "suffix", "layer-skip", "eagle") if k in result.config.drafters]
        lines.append(f"no draft model given → model-free drafters and a trained head: {', '.join(tried)}")
    else:
        lines.append("draft models given → " + ", ".join(f"{c.model} ({c.note or 'same tokenizer'})" for c in models))
    eagle = [s for s in result.skipped if s.what.startswith("eagle")]
    if "eagle" in result.candidates:
        lines.append(f"a trained head exists for this target ({result.candidates['eagle'].note}) → eagle chains "
                     "and trees tried")
    elif eagle:
        lines.append(f"eagle skipped: {eagle[0].why}")
    ng = result.measured.get("ngram")
    if ng and ng[2]:
        acc, tau = ng[2]["acceptance_rate"], ng[2]["tau"]
        lines.append(f"n-gram acceptance {acc:.2f} (τ {tau:.2f} at γ={ng[1]}) → " +
                     ("the prompts are repetitive: lookup drafters pay" if acc >= REPETITIVE_ACCEPTANCE else
                      "not repetitive: lookup drafters find little to copy"))
    for p in best_per_drafter(result.predictions):
        pooled = result.measured[p.key][2] if p.key in result.measured else None
        cost = ""
        if pooled and pooled["num_drafted_tokens"] and plain and plain["num_verify_steps"]:
            t_draft = pooled["draft_time_s"] / pooled["num_drafted_tokens"]
            t_decode = plain["verify_time_s"] / plain["num_verify_steps"]
            cost = f", T_draft {1e3 * t_draft:.2f} ms/token = {t_draft / t_decode:.2f} T_decode"
        lines.append(f"{p.key}: acceptance {p.acceptance:.2f}{cost} → best γ={p.gamma}, predicted {p.speedup:.2f}x "
                     f"(τ {p.tau:.2f}, {p.basis})")
    for s in result.skipped:
        if not s.what.startswith("eagle"):
            lines.append(f"{s.what} skipped: {s.why}")
    if result.confirmations:
        n = max(c.prompts for c in result.confirmations)
        parts = [f"{_label(c.key, c.gamma, c.policy)} {_x(c.speedup)}" for c in result.confirmations]
        lines.append(f"confirmed on {n} held-out prompt(s), {result.config.repeats} repeat(s) each, fastest counts: "
                     + ", ".join(parts))
    if not result.measured:
        lines.append(f"no drafter was measured within --budget {result.config.budget_s:g} s, so plain decoding is "
                     "kept by default, not by measurement: raise --budget (the skipped lines above say how long "
                     "each stage needs)")
    busy = busy_line(result.load_start, result.load_end, result.threads)
    if busy:
        lines.append(busy)
    if result.choice is not None:
        lines.append("→ " + result.choice.reason)
    return lines


def check_output(path: str | Path, *, default: bool = True) -> None:
    """Refuse a settings file (or the ``.json`` report beside it) that cannot be written, before anything is
    measured (``specdecode.paths.check_output_file``: probed for real, nothing left behind).

    Args:
        path: the TOML file. default: its missing parent folders may be made (a library caller's path); the
            command line passes False for a path the user named (its folder must exist).

    Raises:
        SpecDecodeError: the path is a folder, its folder is missing or a file, or a file cannot be written there.
    """

    check_output_file(path, "--output", default=default)
    check_output_file(Path(path).expanduser().with_suffix(".json"), "--output (its .json report)", default=default)


def _load1() -> float | None:
    """The 1-minute load average, None where the platform has none."""
    import os

    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def busy_line(load_start: float | None, load_end: float | None, threads: int,
              cores: int | None = None) -> str | None:
    """A warning when other processes shared the cores during the run, else None.

    The run itself keeps about ``threads`` cores busy; a 1-minute load average (at the start or the end)
    above ``max(threads, cores) + 0.5`` means something else ran too, so every time measured (and the
    prediction made of them) is noisy. ``cores`` defaults to ``os.cpu_count()``.
    """
    import os

    cores = cores or os.cpu_count() or 1
    loads = [x for x in (load_start, load_end) if x is not None]
    if not loads or max(loads) <= max(threads, cores) + 0.5:
        return None
    return (f"the machine was busy (1-min load {max(loads):.1f} on {cores} cores, this run uses {threads}): "
            "other processes shared the cores, so the times above are noisy; rerun tune when the machine is quiet")


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
    from specdecode.preflight import check_models

    for draft in config.drafts or (None,):  # every model resolves (and a draft's tokenizer is read) before weights
        check_models(config.target, draft, cache_dir=config.cache_dir, cross_vocab=True)
    from specdecode.bench.env import environment
    from specdecode.bench.runner import _quiet_transformers, encode_all
    from specdecode.cliargs import set_threads
    from specdecode.precision import load_target

    _quiet_transformers()
    result = TuneResult(config=config)
    result.load_start = _load1()
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
    result.load_end = _load1()
    result.decision = decision_lines(result)
    result.seconds = clock.elapsed()
    result.environment = environment()
    try:
        import os

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
        # lazy, as every torch-side import of this module: the command line reads TuneConfig without torch
        from specdecode.bench.runner import engine_runner
        from specdecode.build import build_factory

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
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("elapsed"),
                        TimeElapsedColumn(), console=Console(stderr=True), disable=not self.progress,
                        transient=False)

    # 1. costs of the target ---------------------------------------------------------

    def measure_costs(self) -> None:
        from specdecode.bench.runner import PROBE_REPS, probe_context, probe_forward_times
        from specdecode.bench.summary import pool_metrics

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
        from specdecode.kv.owned import supports

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
        from specdecode.build import load_draft_for  # lazy: torch (see runner)
        from specdecode.proposers.factory import other_tokenizer

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
        from specdecode.eagle.head import EagleCheckpointError
        from specdecode.proposers.eagle import find_head

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
        from specdecode.bench.summary import pool_metrics

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
        from specdecode import layer_search

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
        from specdecode.bench.runner import rotate
        from specdecode.bench.summary import cell, fastest_runs, first_difference, pool_metrics

        if not plan:
            return
        keys = self.result.held_out
        methods = [(PLAIN, None, 0, "fixed")] + [(_label(p.key, p.gamma, p.policy), self.result.candidates[p.key],
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


# --------------------------------------------------------------------------- report and settings file


def report_rows(result: TuneResult) -> list[dict]:
    """The ranked table: each drafter's best fixed gamma (and the confirmed policy rows), best measured first,
    then by prediction; plain decoding last."""
    conf = {(c.key, c.gamma, c.policy): c for c in result.confirmations}
    rows = []
    preds = best_per_drafter(result.predictions)
    for c in result.confirmations:
        if c.policy != "fixed":
            preds.append(next(p for p in result.predictions if (p.key, p.gamma, p.policy) == (c.key, c.gamma,
                                                                                                c.policy)))
    for p in preds:
        c = conf.get((p.key, p.gamma, p.policy))
        rows.append({"method": _label(p.key, p.gamma, p.policy), "key": p.key, "gamma": p.gamma, "policy": p.policy,
                     "predicted": p.speedup, "measured": c.speedup if c else None,
                     "decode_measured": c.decode_speedup if c else None, "tau": c.tau if c else p.tau,
                     "tau_source": "confirmed" if c else "sample", "acceptance": c.acceptance if c else p.acceptance,
                     "tokens_per_s": c.tokens_per_s if c else None, "mismatches": c.mismatches if c else None,
                     "basis": p.basis})
    rows.sort(key=lambda r: (r["measured"] is None, -(r["measured"] or 0.0), -r["predicted"]))
    tps = result.plain_confirmed_tokens_per_s
    if tps is None and result.plain and result.plain["wall_s"]:  # not confirmed: its sample runs' figure
        tps = result.plain["num_generated_tokens"] / result.plain["wall_s"]
    rows.append({"method": PLAIN, "key": PLAIN, "gamma": 0, "policy": "fixed", "predicted": 1.0, "measured": 1.0,
                 "decode_measured": 1.0, "tau": 1.0, "tau_source": "", "acceptance": None,
                 "tokens_per_s": tps, "mismatches": None, "basis": ""})
    return rows


def print_report(result: TuneResult, console=None) -> None:
    """The ranked table (rich) and the decision, on ``console`` (default stdout)."""
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console(file=sys.stdout, highlight=False, soft_wrap=True,
                          width=None if sys.stdout.isatty() else 160)
    cfg = result.config
    source = cfg.prompts_file or ",".join(cfg.datasets)
    table = Table(title=f"specdecode tune: {cfg.target} ({result.weights}, {result.threads} threads), {source}, "
                        f"{cfg.max_new_tokens} tokens, temperature {cfg.temperature}", title_justify="left")
    for col in ("method", "predicted", "measured", "decode", "τ", "acceptance", "tok/s", "greedy = plain"):
        table.add_column(col, justify="left" if col == "method" else "right", no_wrap=col != "method")
    chosen = result.choice
    for r in report_rows(result):
        is_chosen = chosen is not None and (r["key"], r["gamma"], r["policy"]) == (chosen.key, chosen.gamma,
                                                                                   chosen.policy)
        same = "-" if r["mismatches"] is None or cfg.temperature > 0 else ("yes" if r["mismatches"] == 0 else
                                                                           f"NO ({r['mismatches']})")
        table.add_row(("→ " if is_chosen else "") + r["method"], _x(r["predicted"]), _x(r["measured"]),
                      _x(r["decode_measured"]), f"{r['tau']:.2f}" if r["tau"] else "-",
                      "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}",
                      "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.1f}", same)
    console.print(table)
    console.print("predicted: the cost model's decode speedup from the sample prompts (trees: their own tau and step "
                  "time); measured: wall-clock tokens/s over plain decoding on the held-out prompts; decode: the same "
                  "after the first token", markup=False)
    console.print("decision:", markup=False)
    for line in result.decision:
        console.print(f"  {line}", markup=False)


def write_settings(result: TuneResult, path: str | Path) -> Path:
    """Write the chosen settings as a ``--config`` TOML file, the measurements in its ``[tune]`` table, and the
    full report as JSON beside it (same name, ``.json``). Returns the TOML path."""
    from specdecode.configfile import write_toml

    cfg = result.config
    settings = result.chosen_settings()
    choice = result.choice
    bench = {"target": cfg.target, "weights": result.weights,
             "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature}
    if cfg.threads:
        bench["threads"] = result.threads
    if choice is not None and choice.key != PLAIN:
        cand = result.candidates[choice.key]
        bench["methods"] = str(cand.spec.with_gamma(choice.gamma))
        if cand.model:
            bench["draft"] = cand.model
            bench["draft_weights"] = settings.get("draft_weights")
    source = cfg.prompts_file or ",".join(cfg.datasets)
    tune = {"chosen": choice.key if choice else PLAIN, "gamma": choice.gamma if choice else 0,
            "policy": choice.policy if choice else "fixed",
            "measured_speedup": choice.measured if choice else None,
            "predicted_speedup": choice.predicted if choice else None,
            "prompts": source, "sample_prompts": len(result.sample), "held_out_prompts": len(result.held_out),
            "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature, "repeats": cfg.repeats,
            "max_gamma": cfg.max_gamma, "seconds": round(result.seconds, 1),
            "date": result.environment.get("date", ""), "cpu": result.environment.get("cpu_model", ""),
            "load_average": [round(x, 2) for x in result.load_average],
            "weights_reason": result.weights_reason,
            "target_forward_ms": {f"k{k}": round(1e3 * v, 3) for k, v in result.verify_forward_s.items()},
            "skipped": [f"{s.what}: {s.why}" for s in result.skipped]}
    rows = [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k != "key"}
            for r in report_rows(result)]
    comments = ["specdecode tune: settings chosen by measuring this workload on this machine.",
                "Use: specdecode generate --config FILE (or serve / bench); flags given override these.",
                *(f"  {line}" for line in result.decision)]
    # no [generate] table: what tune measured with (--max-new-tokens, --temperature) is in [tune] and [bench]
    # (bench reproduces the measurement), never a default of generate or serve
    out = write_toml(path, settings, {"bench": bench, "tune": tune},
                     comments=comments, arrays={"tune.candidates": rows})
    out.with_suffix(".json").write_text(json.dumps(result.to_dict(), indent=1, default=str) + "\n", encoding="utf-8")
    return out


__all__ = ["Candidate", "Choice", "Confirmation", "DRAFTER_KINDS", "Prediction", "Skipped", "TuneConfig",
           "TuneResult", "best_per_drafter", "choose", "confirmation_plan", "decision_lines", "predict",
           "print_report", "read_prompts_file", "report_rows", "run_tune", "split_prompts", "tree_speedup",
           "write_settings"]
