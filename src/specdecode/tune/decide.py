"""The decision of ``specdecode tune``, pure: candidates (drafter specs), the predicted speedups, the choice, the
result and its reasoning in words."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specdecode.options import DEFAULT_TREE_NODES
from specdecode.paths import check_output_file
from specdecode.spec import DrafterSpec
from specdecode.tune.config import PLAIN, REPETITIVE_ACCEPTANCE, TuneConfig
import os


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
    from specdecode.bench.summary import predicted_curve  # lazy: numpy, not at the command line's start

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
                          f"{variant_label(best.key, best.gamma, best.policy)}: measured {best.speedup:.2f}x plain "
                          f"decoding on the held-out prompts (predicted {times_text(pred)})")
        return Choice(PLAIN, 0, "fixed", 1.0, None,
                      f"plain decoding: the fastest confirmed drafter, {variant_label(best.key, best.gamma, best.policy)}, "
                      f"measured {best.speedup:.2f}x, is not {need:.2f}x plain decoding (speculation would not pay "
                      "here)")
    best_pred = best_per_drafter(predictions)
    if best_pred and best_pred[0].speedup >= need:
        p = best_pred[0]
        return Choice(p.key, p.gamma, p.policy, None, p.speedup,
                      f"{variant_label(p.key, p.gamma, p.policy)}: predicted {p.speedup:.2f}x (not confirmed: no time was "
                      "left to run it)")
    if not best_pred:
        return Choice(PLAIN, 0, "fixed", None, None, "plain decoding: no drafter could be measured")
    return Choice(PLAIN, 0, "fixed", None, None,
                  f"plain decoding: every drafter predicted < {need:.2f}x (best {best_pred[0].key} "
                  f"{best_pred[0].speedup:.2f}x): speculation would be slower here")


def variant_label(key: str, gamma: int, policy: str) -> str:
    return f"{key} γ={gamma}" + ("" if policy == "fixed" else f" (policy {policy})")


def times_text(v: float | None) -> str:
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

        from specdecode.costmodel import verify_ratio_from_samples  # lazy: numpy, not at the command line's start

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
        parts = [f"{variant_label(c.key, c.gamma, c.policy)} {times_text(c.speedup)}" for c in result.confirmations]
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


def load_average_1m() -> float | None:
    """The 1-minute load average, None where the platform has none."""

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

    cores = cores or os.cpu_count() or 1
    loads = [x for x in (load_start, load_end) if x is not None]
    if not loads or max(loads) <= max(threads, cores) + 0.5:
        return None
    return (f"the machine was busy (1-min load {max(loads):.1f} on {cores} cores, this run uses {threads}): "
            "other processes shared the cores, so the times above are noisy; rerun tune when the machine is quiet")
