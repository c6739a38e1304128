"""What an audit finds: per-prompt results of either mode, the report with its verdict, and the settings,
source counters and machine recorded with it."""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
from dataclasses import dataclass, field

import numpy as np
import torch

from specdecode.audit import stats
from specdecode.audit.config import AuditConfig
from specdecode.types import SamplingParams


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


def audit_settings(params: SamplingParams, cfg: AuditConfig) -> dict:
    sampling = {k: v for k, v in dataclasses.asdict(params).items() if k not in ("seed", "max_new_tokens")}
    if sampling.get("logit_bias"):
        sampling["logit_bias"] = {str(k): v for k, v in sampling["logit_bias"].items()}
    audit = dataclasses.asdict(cfg)
    audit["cell_mass"] = cfg.cell_mass
    return {"sampling": sampling, "audit": audit}


def source_counters(source) -> dict:
    drafted = getattr(source, "drafted", None)
    if drafted is None:
        return {}
    accepted = source.accepted
    return {"drafted_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0}
