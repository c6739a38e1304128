"""The sampled mode of the audit: each prompt's samples against its exact law (chi-square per prompt and pooled,
Holm-adjusted), impossible and unmapped outcomes, and the verdict with its power."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
from tqdm import tqdm

from specdecode.audit import stats
from specdecode.audit.config import AuditConfig
from specdecode.audit.law import BOUNDARY, IMPOSSIBLE, OTHER, STOP, UNMAPPED, ExactLaw, exact_law
from specdecode.audit.results import (
    AUDIT_STRIDE,
    AuditReport,
    MAX_EXAMPLES,
    PromptAudit,
    SEED_STRIDE,
    UNMAPPED_WARNING,
    audit_settings,
    machine_info,
    source_counters,
)
from specdecode.audit.sources import AuditPrompt, Outcome, SampleSource
from specdecode.types import SamplingParams


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
    report = AuditReport("sampled", source.name, "", audit_settings(params, cfg), results, machine=machine_info())
    _decide_sampled(report, cfg)
    report.extra = source_counters(source)
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
