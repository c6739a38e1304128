"""The audit itself: sampled mode (the law of the first n tokens) and greedy mode (token equality).

:func:`audit_sampled` and :func:`audit_greedy` take a target module, prompts as ids, the request's
SamplingParams and a :class:`~specdecode.audit.sources.SampleSource`; they return an :class:`AuditReport`.
:func:`run_audit` is what ``specdecode audit`` runs: it loads the target (and, with ``local``, builds the
speculative engine with its drafter), encodes the prompts, picks the mode from the temperature, prints the
report and writes it.

Verdict (sampled): FAIL when any sample is an impossible output, or when any Holm-adjusted p-value (each
prompt's chi-square and the pooled one, one family) is below alpha; PASS otherwise. The power stated with
it: per prompt, the smallest TV error detected with probability ``power`` at level alpha / (prompts + 1)
(Bonferroni's level, which Holm's first step uses), see :func:`specdecode.audit.stats.detectable_tv`.
Verdict (greedy): FAIL when any prompt's output differs from plain greedy decoding at a position where the
target's top-1 minus top-2 logit is at least ``tie_margin`` (a smaller margin is a near-tie: a rounding flip
between two forwards, reported, not failed).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from specdecode.audit import stats
from specdecode.audit.config import AuditConfig, AuditError
from specdecode.audit.law import BOUNDARY, IMPOSSIBLE, OTHER, STOP, UNMAPPED, ExactLaw, exact_law
from specdecode.audit.sources import AuditPrompt, EngineSource, Outcome, SampleSource
from specdecode.types import SamplingParams
from specdecode.paths import check_output_dir

#: Sample i of prompt p is seeded ``SEED_STRIDE * (AUDIT_STRIDE * seed + p + 1) + i`` (i < N <= 1e6): no
#: two samples share a seed, within an audit or across audits of other seeds (up to AUDIT_STRIDE prompts).
SEED_STRIDE, AUDIT_STRIDE = 1_000_003, 10_007
#: Impossible / unmapped outcomes listed per prompt in the report.
MAX_EXAMPLES = 5
#: Unmapped fraction above which the sampled verdict carries a warning.
UNMAPPED_WARNING = 0.01


@dataclass
class PromptAudit:
    """One prompt's sampled-mode result.

    Attributes:
        id, num_prompt_tokens: the prompt. num_samples: N drawn. num_tested: samples in a cell of the law.
        num_impossible, num_boundary, num_unmapped: samples outside the law's support, at a cut-off's
            boundary, or not mappable to tokens (all three left out of the test); ``examples``: a few of them.
        num_unmatched_text: text-only samples that re-tokenize to no known continuation (tested in the rest
            cell, see ``_CellMap``).
        labels, expected, observed: per cell (group of cells with the same text, for text-only sources) its
            label, exact probability (float64) and observed count.
        chi2: the chi-square test. tv: observed total variation; tv_null_95 / tv_null_99: the null's
            percentiles; tv_pvalue: fraction of null draws with a TV at least the observed one.
        detectable_tv: smallest TV error detected with probability ``power`` (None: nothing testable).
        adjusted_p: Holm-adjusted chi-square p-value.
        law_s, sample_s: seconds spent enumerating the law and drawing samples.
    """

    id: str
    num_prompt_tokens: int
    num_samples: int
    num_tested: int = 0
    num_impossible: int = 0
    num_boundary: int = 0
    num_unmapped: int = 0
    num_unmatched_text: int = 0
    examples: list[dict] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    expected: np.ndarray | None = None
    observed: np.ndarray | None = None
    chi2: stats.ChiSquare | None = None
    tv: float = 0.0
    tv_null: np.ndarray | None = None
    tv_null_95: float = 0.0
    tv_null_99: float = 0.0
    tv_pvalue: float = 1.0
    detectable_tv: float | None = None
    adjusted_p: float = 1.0
    law_s: float = 0.0
    sample_s: float = 0.0

    def to_json(self) -> dict:
        order = np.argsort(-self.expected)[:50] if self.expected is not None else []
        return {
            "id": self.id, "num_prompt_tokens": self.num_prompt_tokens, "num_samples": self.num_samples,
            "num_tested": self.num_tested, "num_impossible": self.num_impossible, "num_boundary": self.num_boundary,
            "num_unmapped": self.num_unmapped, "num_unmatched_text": self.num_unmatched_text, "examples": self.examples, "num_cells": len(self.labels),
            "chi2": None if self.chi2 is None else {"statistic": self.chi2.statistic, "dof": self.chi2.dof,
                                                    "pvalue": self.chi2.pvalue, "bins": self.chi2.num_bins},
            "adjusted_pvalue": self.adjusted_p, "tv": self.tv, "tv_null_95": self.tv_null_95,
            "tv_null_99": self.tv_null_99, "tv_pvalue": self.tv_pvalue, "detectable_tv": self.detectable_tv,
            "law_s": self.law_s, "sample_s": self.sample_s,
            "top_cells": [{"label": self.labels[i], "expected": float(self.expected[i]),
                           "observed": int(self.observed[i])} for i in order],
        }


@dataclass
class GreedyAudit:
    """One prompt's greedy-mode result.

    Attributes:
        id, num_prompt_tokens: the prompt. num_compared: tokens of plain greedy decoding compared.
        status: "equal", "near-tie" (differs where the target's top-2 margin < tie_margin) or "DIVERGES".
        position: the first differing generated token (None when equal); plain_token / source_token: the
            two tokens there (None: that output had ended); margin: the target's top-1 minus top-2
            (processed) logit there; gap: its logit of plain's token minus of the source's.
        plain_text / source_text: the two outputs' text (when a tokenizer is known).
    """

    id: str
    num_prompt_tokens: int
    num_compared: int
    status: str = "equal"
    position: int | None = None
    plain_token: int | None = None
    source_token: int | None = None
    margin: float | None = None
    gap: float | None = None
    plain_text: str | None = None
    source_text: str | None = None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class AuditReport:
    """What an audit found.

    Attributes:
        mode: "sampled" or "greedy". source: the source's name. target: the local reference's name.
        settings: the sampling settings and the AuditConfig. prompts: PromptAudit or GreedyAudit per prompt.
        pooled: sampled mode: the pooled chi-square, TV and null, totals. verdict: "PASS" or "FAIL".
        reasons: why (one line each). power: one line stating the power (sampled mode).
        machine: where it ran. extra: the source's own counters (drafted / accepted tokens in-process).
    """

    mode: str
    source: str
    target: str
    settings: dict
    prompts: list
    pooled: dict = field(default_factory=dict)
    verdict: str = "PASS"
    reasons: list[str] = field(default_factory=list)
    power: str = ""
    machine: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.verdict == "PASS"

    def to_json(self) -> dict:
        return {"mode": self.mode, "verdict": self.verdict, "reasons": self.reasons, "power": self.power,
                "source": self.source, "target": self.target, "settings": self.settings, "pooled": self.pooled,
                "prompts": [p.to_json() for p in self.prompts], "machine": self.machine, "extra": self.extra,
                "seconds": self.seconds}


def machine_info() -> dict:
    """The machine, for the report: platform, Python, torch, CPU count and the 1-minute load."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "load_1min": load, "python": sys.version.split()[0], "torch": torch.__version__}


# --------------------------------------------------------------------------- sampled mode


class _CellMap:
    """Samples -> cells of a law. A sample with token ids is walked down the law (``ExactLaw.classify``).

    Text-only samples (a server that returns no ids) are mapped on a coarser partition: the enumerated
    completions merged by their text (a text cannot tell two tokenizations apart), and every "other" cell merged
    into one *rest* cell. A text that is no enumerated completion's goes to the rest; if it also re-tokenizes to
    no known continuation it is counted as *unmatched* (still in the rest, so the test stays a test of the
    partition). Without any rest mass (the law fully enumerated) such a text is unmapped (left out)."""

    REST = ("<rest>",)

    def __init__(self, law: ExactLaw, tokenizer=None) -> None:
        self.law = law
        self.tokenizer = tokenizer
        self.group = np.arange(len(law.cells))
        self._by_text: dict | None = None
        self._rest: int | None = None
        self.unmatched = 0

    def text_groups(self) -> None:
        """Switch to the text partition (see the class)."""
        by_key: dict = {}
        for c in range(len(self.law.cells)):
            if self.law.is_other(c):
                key = self.REST
            else:
                toks, stopped = self.law.cell_tokens(c)
                key = (self._decode(toks), stopped or len(toks) < self.law.num_tokens)
            self.group[c] = by_key.setdefault(key, c)
        self._rest = by_key.pop(self.REST, None)
        self._by_text = by_key
        _, self.group = np.unique(self.group, return_inverse=True)

    def _decode(self, toks) -> str:
        return self.tokenizer.decode(list(toks), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def cell(self, out: Outcome) -> int:
        if out.token_ids is not None:
            return self.law.classify(out.token_ids, out.stopped)
        if self.tokenizer is None or out.text is None:
            return UNMAPPED
        if self._by_text is None:
            self.text_groups()
        hit = self._by_text.get((out.text, out.stopped))
        if hit is not None:
            return hit
        ids = self.tokenizer(out.text, add_special_tokens=False)["input_ids"]
        c = self.law.classify(ids, out.stopped)
        if c < 0 or not self.law.is_other(c):
            self.unmatched += 1
        if self._rest is not None:
            return self._rest
        return BOUNDARY if c == BOUNDARY else UNMAPPED

    def label(self, group: int) -> str:
        c = int(np.flatnonzero(self.group == group)[0])
        key = self.law.cells[c]
        if self._by_text is not None and self.law.is_other(c):
            return "<rest: every other completion>"
        toks = [t for t in key if t >= 0]
        text = repr(self._decode(toks)) if self.tokenizer is not None else " ".join(map(str, toks)) or "(start)"
        if key and key[-1] == STOP:
            return f"{text} <stop>"
        if key and key[-1] == OTHER:
            return f"{text} <other>" if toks else "<other>"
        return text


def _describe(out: Outcome, tokenizer) -> dict:
    text = out.text
    if text is None and out.token_ids is not None and tokenizer is not None:
        text = tokenizer.decode(list(out.token_ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return {"token_ids": None if out.token_ids is None else list(out.token_ids), "text": text,
            "finish_reason": out.finish_reason}


def _prompt_seeds(cfg: AuditConfig, index: int) -> list[int]:
    start = (SEED_STRIDE * (AUDIT_STRIDE * cfg.seed + index + 1)) % 2**62
    return list(range(start, start + cfg.num_samples))


def audit_sampled(model: torch.nn.Module, prompts: Sequence[AuditPrompt], params: SamplingParams,
                  source: SampleSource, cfg: AuditConfig, *, tokenizer=None, forward: str = "auto",
                  progress: bool = False, say: Callable[[str], None] | None = None) -> AuditReport:
    """Sampled mode: N completions per prompt from ``source`` against the target's exact law of n tokens.

    Args:
        model: the target (the weights the source decodes, in its precision).
        prompts: the prompts (ids). params: a sampled request's settings (temperature > 0; its seed and
            max_new_tokens are set per sample).
        source: where samples come from. cfg: N, n, alpha, power, the enumeration threshold, seeds.
        tokenizer: labels cells and maps text-only samples (None: ids only).
        forward: the law's runner backend. progress: a tqdm bar per prompt. say: status lines.

    Returns:
        AuditReport (mode "sampled").

    Raises:
        ValueError: a greedy ``params``. AuditError / SpecDecodeError: from the source.
    """
    if params.greedy:
        raise ValueError("audit_sampled needs temperature > 0 (greedy mode: audit_greedy)")
    t0 = time.perf_counter()
    rng = np.random.default_rng(cfg.seed)
    level = cfg.alpha / (len(prompts) + 1)  # Bonferroni's level: Holm's first step
    results = []
    for index, prompt in enumerate(prompts):
        results.append(_audit_prompt(model, prompt, index, len(prompts), params, source, cfg, tokenizer, forward,
                                     progress, say, rng, level))
    report = AuditReport("sampled", source.name, "", _settings(params, cfg), results, machine=machine_info())
    _decide_sampled(report, cfg)
    report.extra = _source_counters(source)
    report.seconds = time.perf_counter() - t0
    return report


def _audit_prompt(model, prompt: AuditPrompt, index: int, total: int, params: SamplingParams, source, cfg,
                  tokenizer, forward, progress, say, rng, level) -> PromptAudit:
    t0 = time.perf_counter()
    law = exact_law(model, prompt.token_ids, params, cfg.num_tokens, cfg.cell_mass, forward)
    t1 = time.perf_counter()
    if say is not None:
        say(f"prompt {index + 1}/{total} {prompt.id}: exact law of {cfg.num_tokens} tokens, {len(law.cells)} "
            f"outcomes from {len(law.nodes)} prefixes in {t1 - t0:.1f} s; drawing {cfg.num_samples} samples from "
            f"{source.name}")
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.num_samples, desc=f"{index + 1}/{total} {prompt.id}"[:40], unit="sample",
                   file=sys.stderr, leave=False, dynamic_ncols=True)
    try:
        outcomes = source.draw(prompt, params, cfg.num_tokens, _prompt_seeds(cfg, index),
                               None if bar is None else bar.update)
    finally:
        if bar is not None:
            bar.close()
    t2 = time.perf_counter()
    cells = _CellMap(law, tokenizer)
    if any(o.token_ids is None for o in outcomes):
        cells.text_groups()
    res = PromptAudit(prompt.id, len(prompt.token_ids), len(outcomes), law_s=t1 - t0, sample_s=t2 - t1)
    num_groups = int(cells.group.max()) + 1
    observed = np.zeros(num_groups, dtype=np.int64)
    for out in outcomes:
        c = cells.cell(out)
        if c >= 0:
            observed[cells.group[c]] += 1
            continue
        kind = {IMPOSSIBLE: "impossible", BOUNDARY: "boundary", UNMAPPED: "unmapped"}[c]
        setattr(res, f"num_{kind}", getattr(res, f"num_{kind}") + 1)
        if sum(e["kind"] == kind for e in res.examples) < MAX_EXAMPLES:
            res.examples.append({"kind": kind, **_describe(out, tokenizer)})
    res.expected = np.bincount(cells.group, law.probs, minlength=num_groups)
    res.observed = observed
    res.labels = [cells.label(g) for g in range(num_groups)]
    res.num_tested = int(observed.sum())
    res.num_unmatched_text = cells.unmatched
    _test(res, cfg, rng, level)
    return res


def _test(res: PromptAudit, cfg: AuditConfig, rng, level: float) -> None:
    """Chi-square, TV and its null, power (on the tested samples)."""
    n = res.num_tested
    res.chi2 = stats.chi_square(res.observed, res.expected)
    if n == 0:
        return
    res.tv = stats.total_variation(res.observed, res.expected)
    res.tv_null = stats.null_tv(res.expected, n, cfg.null_simulations, rng)
    res.tv_null_95, res.tv_null_99 = (float(x) for x in np.quantile(res.tv_null, [0.95, 0.99]))
    res.tv_pvalue = float((1 + (res.tv_null >= res.tv).sum()) / (1 + len(res.tv_null)))
    res.detectable_tv = stats.detectable_tv(res.expected, n, level, cfg.power, res.chi2, rng)


def _decide_sampled(report: AuditReport, cfg: AuditConfig) -> None:
    prompts: list[PromptAudit] = report.prompts
    stat, dof, pooled_p = stats.pooled_chi_square([p.chi2 for p in prompts])
    adjusted = stats.holm([p.chi2.pvalue for p in prompts] + [pooled_p])
    for p, a in zip(prompts, adjusted):
        p.adjusted_p = a
    tested = sum(p.num_tested for p in prompts)
    weights = [p.num_tested / tested if tested else 0.0 for p in prompts]
    tv = float(sum(w * p.tv for w, p in zip(weights, prompts)))
    nulls = [p.tv_null for p in prompts if p.tv_null is not None]
    null = sum(w * p.tv_null for w, p in zip(weights, prompts) if p.tv_null is not None) if nulls else None
    detectable = [p.detectable_tv for p in prompts if p.detectable_tv is not None]
    report.pooled = {
        "chi2": {"statistic": stat, "dof": dof, "pvalue": pooled_p, "adjusted_pvalue": adjusted[-1]},
        "tv": tv, "tv_null_95": None if null is None else float(np.quantile(null, 0.95)),
        "tv_null_99": None if null is None else float(np.quantile(null, 0.99)),
        "num_samples": sum(p.num_samples for p in prompts), "num_tested": tested,
        "num_impossible": sum(p.num_impossible for p in prompts),
        "num_boundary": sum(p.num_boundary for p in prompts), "num_unmapped": sum(p.num_unmapped for p in prompts),
        "num_unmatched_text": sum(p.num_unmatched_text for p in prompts),
        "detectable_tv_max": max(detectable) if detectable else None,
        "detectable_tv_median": float(np.median(detectable)) if detectable else None,
    }
    reasons = []
    for p in prompts:
        if p.num_impossible:
            reasons.append(f"{p.id}: {p.num_impossible} impossible output(s): tokens the processed target gives "
                           "probability 0")
        if p.adjusted_p < cfg.alpha:
            reasons.append(f"{p.id}: chi-square p = {p.chi2.pvalue:.3g} (Holm-adjusted {p.adjusted_p:.3g} < alpha "
                           f"{cfg.alpha:g}); TV {p.tv:.4f} vs null 99th percentile {p.tv_null_99:.4f}")
    if adjusted[-1] < cfg.alpha:
        reasons.append(f"pooled: chi-square {stat:.1f} on {dof} dof, p = {pooled_p:.3g} (Holm-adjusted "
                       f"{adjusted[-1]:.3g} < alpha {cfg.alpha:g})")
    report.verdict = "FAIL" if reasons else "PASS"
    if not reasons:
        reasons.append(f"no impossible output; every Holm-adjusted p-value >= alpha {cfg.alpha:g} (smallest "
                       f"{min(adjusted):.3g})")
    unmapped = report.pooled["num_unmapped"]
    if unmapped > UNMAPPED_WARNING * max(1, report.pooled["num_samples"]):
        reasons.append(f"warning: {unmapped} samples could not be mapped to the target's tokens (another tokenizer, "
                       "or text that re-tokenizes differently): they are left out of the test")
    if report.pooled["num_unmatched_text"]:
        reasons.append(f"note: {report.pooled['num_unmatched_text']} text-only samples re-tokenize to no known "
                       "continuation (tested in the rest cell)")
    if report.pooled["num_boundary"]:
        reasons.append(f"note: {report.pooled['num_boundary']} samples took a token at a top-p / min-p cut-off that "
                       "rounding can include (left out of the test)")
    report.reasons = reasons
    n = prompts[0].num_samples if prompts else 0
    if detectable:
        report.power = (f"N = {n} samples per prompt detect a TV error of {max(detectable):.3f} (worst prompt; median "
                        f"{np.median(detectable):.3f}) with probability {cfg.power:g} at level alpha / "
                        f"{len(prompts) + 1} = {cfg.alpha / (len(prompts) + 1):.2g} (chi-square; simulated along "
                        "tempered laws p^beta, the harder of spreading and sharpening)")
    else:
        report.power = "nothing testable: every prompt's law is one outcome (raise the temperature or N)"


def _settings(params: SamplingParams, cfg: AuditConfig) -> dict:
    sampling = {k: v for k, v in dataclasses.asdict(params).items() if k not in ("seed", "max_new_tokens")}
    if sampling.get("logit_bias"):
        sampling["logit_bias"] = {str(k): v for k, v in sampling["logit_bias"].items()}
    audit = dataclasses.asdict(cfg)
    audit["cell_mass"] = cfg.cell_mass
    return {"sampling": sampling, "audit": audit}


def _source_counters(source) -> dict:
    drafted = getattr(source, "drafted", None)
    if drafted is None:
        return {}
    accepted = source.accepted
    return {"drafted_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0}


# --------------------------------------------------------------------------- greedy mode


def audit_greedy(model: torch.nn.Module, prompts: Sequence[AuditPrompt], params: SamplingParams,
                 source: SampleSource, cfg: AuditConfig, *, tokenizer=None, forward: str = "auto",
                 progress: bool = False, say: Callable[[str], None] | None = None) -> AuditReport:
    """Greedy mode: the source's greedy output of ``cfg.max_new_tokens`` tokens against plain greedy decoding
    of the target here (same engine code, no proposer), with the margin at the first divergence.

    Args: as :func:`audit_sampled` (``params``' temperature is ignored: greedy).

    Returns:
        AuditReport (mode "greedy").
    """
    from specdecode.engine import EngineConfig, SpeculativeEngine

    t0 = time.perf_counter()
    greedy = dataclasses.replace(params, temperature=0.0, seed=None, coupled=None, max_new_tokens=cfg.max_new_tokens)
    plain = SpeculativeEngine(model, None, EngineConfig(forward=forward))
    results = []
    iterator = prompts
    if progress:
        from tqdm import tqdm

        iterator = tqdm(prompts, desc="greedy", unit="prompt", file=sys.stderr, leave=False)
    for prompt in iterator:
        want = plain.generate(list(prompt.token_ids), greedy)
        got = source.greedy(prompt, greedy, cfg.max_new_tokens)
        results.append(_compare(model, prompt, greedy, want, got, cfg, tokenizer, forward))
    report = AuditReport("greedy", source.name, "", _settings(greedy, cfg), results, machine=machine_info())
    bad = [r for r in results if r.status == "DIVERGES"]
    ties = [r for r in results if r.status == "near-tie"]
    report.verdict = "FAIL" if bad else "PASS"
    report.reasons = [f"{r.id}: differs at generated token {r.position} where the target's top-2 margin is "
                      f"{r.margin:.4f} logits (>= {cfg.tie_margin:g}): not a near-tie" for r in bad]
    report.reasons += [f"{r.id}: differs at generated token {r.position}, a near-tie (margin {r.margin:.2g} < "
                       f"{cfg.tie_margin:g}): a rounding flip between two forwards, not counted" for r in ties]
    if not bad and not ties:
        report.reasons.append(f"every output equals plain greedy decoding ({sum(r.num_compared for r in results)} "
                              "tokens)")
    report.extra = _source_counters(source)
    report.seconds = time.perf_counter() - t0
    return report


def _with_stop(ids: Sequence[int], stopped: bool, stops: Sequence[int]) -> list[int]:
    """The ids with the stop token that ended them as STOP (whichever stop token it was; a source may also
    leave EOS out of its ids)."""
    out = [int(t) for t in ids]
    if out and out[-1] in stops:
        out[-1] = STOP
    elif stopped:
        out.append(STOP)
    return out


def _compare(model, prompt: AuditPrompt, params: SamplingParams, want, got: Outcome, cfg: AuditConfig, tokenizer,
             forward) -> GreedyAudit:
    stops = list(params.stop_ids)
    plain = _with_stop(want.token_ids, want.finish_reason == "stop", stops)
    if got.token_ids is not None:
        ids = list(got.token_ids)
    elif tokenizer is not None and got.text is not None:
        ids = tokenizer(got.text, add_special_tokens=False)["input_ids"]
    else:
        raise AuditError("the source returned neither token ids nor text")
    source = _with_stop(ids, got.stopped, stops)
    res = GreedyAudit(prompt.id, len(prompt.token_ids), len(plain))
    if tokenizer is not None:
        res.plain_text = tokenizer.decode(want.token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        res.source_text = got.text if got.text is not None else tokenizer.decode(
            list(got.token_ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)
        if got.token_ids is None and res.source_text == res.plain_text:
            return res  # a text-only source: the same text is the same output
    n = min(len(plain), len(source))
    i = next((j for j in range(n) if plain[j] != source[j]), None)
    if i is None:
        if len(plain) == len(source) or (len(source) > len(plain) and want.finish_reason == "length"):
            return res  # equal over the tokens compared
        i = n
    res.position = i

    def real(t):  # STOP: the first stop token stands for it
        return None if t is None else (int(stops[0]) if t == STOP and stops else t)

    res.plain_token = real(plain[i] if i < len(plain) else None)
    res.source_token = real(source[i] if i < len(source) else None)
    res.margin, res.gap = _margin(model, prompt, [real(t) for t in plain[:i]], params, res.plain_token,
                                  res.source_token, forward)
    res.status = "near-tie" if res.margin < cfg.tie_margin else "DIVERGES"
    return res


@torch.inference_mode()
def _margin(model, prompt: AuditPrompt, prefix: list[int], params: SamplingParams, a: int | None, b: int | None,
            forward: str) -> tuple[float, float | None]:
    """(top-1 minus top-2 of the target's processed logits after prompt + prefix, logit(a) - logit(b))."""
    from specdecode.kv import make_runner
    from specdecode.sampling import RequestSampler

    runner = make_runner(model, forward, num_slots=1)
    logits = runner.forward(slice(0, 1), [list(prompt.token_ids) + prefix], last_only=True)[0, -1:].float()
    sampler = RequestSampler(params, prompt.token_ids, logits.shape[-1])
    sampler.commit(prefix)
    logits = sampler.process(logits, [[]])[0]
    top2 = logits.topk(2).values
    gap = None if a is None or b is None else float(logits[a] - logits[b])
    return float(top2[0] - top2[1]), gap





# --------------------------------------------------------------------------- the command


def _status(line: str) -> None:
    print(f"specdecode: {line}", file=sys.stderr, flush=True)


def run_audit(setup, say: Callable[[str], None] = _status, progress: bool = True) -> AuditReport:
    """What ``specdecode audit`` runs: check the endpoint (before any weights load), load the target here,
    build the source, encode the prompts, audit in the mode the temperature picks, print, write.

    Args:
        setup: a :class:`specdecode.audit.config.AuditSetup`.
        say: status lines (stderr). progress: tqdm bars while sampling.

    Returns:
        the AuditReport (``passed``: the verdict).

    Raises:
        AuditError: unreachable endpoint, model not served, another tokenizer, a refused request.
        SpecDecodeError / ModelLoadError: bad settings, a model that does not load.
    """
    from specdecode.audit.report import print_report, write_report
    from specdecode.audit.sources import EndpointSource

    cfg = setup.config
    if setup.output is not None:  # before any request or load: the report is what the run is for

        check_output_dir(setup.output, "--output", default=True)
    source = None
    if setup.endpoint is not None:
        source = EndpointSource(setup.endpoint, setup.model, api_key=setup.api_key, concurrency=setup.concurrency,
                                timeout=setup.timeout, prompt_format=setup.prompt_format)
        card = source.check()  # unreachable, or another model: said before any weight is read
        say(f"endpoint {source.base} serves {setup.model!r}" + (f" (specdecode, draft {card.get('draft')}, gamma "
                                                                 f"{card.get('num_speculative_tokens')})"
                                                                 if source.is_specdecode else ""))
        if source.is_specdecode and setup.sampling_mode != "auto":
            source.extra["speculative"] = {"sampling_mode": setup.sampling_mode}
    decoder, engine_source = _load(setup, say)
    if source is None:
        source = engine_source
    loaded = decoder.target
    prompts = _encode(decoder, setup.prompts)
    params = SamplingParams(**setup.sampling, eos_token_ids=loaded.eos_token_ids)
    if setup.endpoint is not None:
        _check_tokenizer(source, prompts[0], params, decoder, say)
    else:
        _choose_skip_layers(decoder, prompts, say)
    precision = decoder.precision.precision if decoder.precision is not None else "fp32"
    audit = audit_greedy if params.greedy else audit_sampled
    say(f"{audit.__name__.removeprefix('audit_')} mode: {len(prompts)} prompt(s)" +
        ("" if params.greedy else f", N = {cfg.num_samples} samples of {cfg.num_tokens} tokens each"))
    report = audit(loaded.model, prompts, params, source, cfg, tokenizer=loaded.tokenizer, forward=setup.forward,
                   progress=progress, say=say)
    report.target = f"{loaded.name} ({precision} weights)"
    if hasattr(source, "close"):
        source.close()
    print_report(report, tokenizer=loaded.tokenizer)
    if setup.output is not None:
        paths = write_report(report, setup.output, loaded.tokenizer, setup.command)
        say("wrote " + ", ".join(str(p) for p in paths))
    return report


def _load(setup, say):
    """(a SpecDecoder over the target, the in-process EngineSource or None): the target in ``setup.weights``;
    in-process, the engine with its drafter and ``batch_size`` rows."""
    from specdecode.build import assemble
    from specdecode.generator import SpecDecoder
    from specdecode.options import SAMPLING_MODES

    say(f"loading target {setup.target!r} (the exact law is computed from it here)")
    if setup.endpoint is not None:
        from specdecode.precision import load_target

        loaded, choice = load_target(setup.target, setup.weights, dtype=setup.dtype, cache_dir=setup.cache_dir,
                                     status=say, forward=setup.forward)
        decoder = SpecDecoder(loaded, None)
        decoder.precision = choice
        say(f"weights {choice.reason}: give the server's precision with --weights if it runs another")
        return decoder, None
    decoder = SpecDecoder.from_pretrained(
        setup.target, setup.draft, num_speculative_tokens=setup.num_speculative_tokens, ngram_min=setup.ngram_min,
        ngram_max=setup.ngram_max, dtype=setup.dtype, cache_dir=setup.cache_dir, weights=setup.weights,
        draft_weights=setup.draft_weights, tree=setup.tree, tree_nodes=setup.tree_nodes, policy=setup.policy,
        skip_layers=setup.skip_layers, verification=setup.verification, status=say)
    engine = assemble(decoder.target, decoder.proposer, num_speculative_tokens=decoder.num_speculative_tokens,
                      policy=decoder.policy, max_batch_size=setup.batch_size, forward=setup.forward,
                      verification=setup.verification)
    name = (f"specdecode engine in-process (draft {setup.draft}, gamma {setup.num_speculative_tokens}, "
            f"{setup.sampling_mode} sampling, {setup.batch_size} rows)")
    return decoder, EngineSource(engine, name, coupled=SAMPLING_MODES[setup.sampling_mode])


def _encode(decoder, prompts) -> list[AuditPrompt]:
    out = []
    for pid, text, chat in prompts:
        chat = decoder.has_chat_template if chat is None else chat
        ids = decoder.encode(text, chat=chat)
        sent = text
        if chat:
            sent = decoder.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                         add_generation_prompt=True, tokenize=False)
        out.append(AuditPrompt(pid, tuple(ids), sent))
    return out


def _check_tokenizer(source, prompt: AuditPrompt, params: SamplingParams, decoder, say) -> None:
    """One short greedy completion: the server's ids must be the local tokenizer's ids of its text.

    Raises:
        AuditError: ids outside the local vocabulary, or ids whose local text is not the server's text.
    """
    probe = source.greedy(prompt, params, 8)
    vocab = decoder.engine.vocab_size
    if probe.token_ids is None:
        say("the server returns text, not token ids: samples are mapped to the target's tokens by their text and, "
            "failing that, by re-tokenization (an outcome that maps to no known continuation counts as unmapped)")
        return
    if any(not 0 <= t < vocab for t in probe.token_ids):
        raise AuditError(f"the server returned token ids outside the vocabulary of {decoder.target.name!r} "
                         f"({vocab} tokens): it runs another tokenizer; give --target the model the server runs")
    text = decoder.decode(probe.token_ids)
    if probe.text is not None and text != probe.text:
        raise AuditError(f"the server's token ids decode here to {text!r}, but it returned {probe.text!r}: it runs "
                         f"another tokenizer than {decoder.target.name!r}; give --target the model the server runs")


def _choose_skip_layers(decoder, prompts: Sequence[AuditPrompt], say) -> None:
    """--draft layer-skip without --skip-layers: the set cached for the model, else a search on the prompts."""
    from specdecode.proposers import LayerSkipProposer

    proposer = decoder.proposer
    if isinstance(proposer, LayerSkipProposer) and proposer.config.skip_layers is None:
        r = proposer.calibrate([list(p.token_ids) for p in prompts[:3]])
        if r.loses:  # slower than plain decoding here, but the audit tests the drafter's losslessness, not speed
            proposer.set_skip_layers(r.skip_layers)
            say(f"layer-skip: skipping layers {','.join(map(str, r.skip_layers))} of {r.num_layers} (measured "
                f"{r.speedup:.2f}x plain decoding: slower, used anyway, as the audit tests losslessness)")
        else:
            say(f"layer-skip: {r.line()}")
__all__ = ["AuditReport", "GreedyAudit", "PromptAudit", "audit_greedy", "audit_sampled", "machine_info", "run_audit"]
