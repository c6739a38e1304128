"""An audit's report: a rich table on the terminal; report.json, report.md and a plot under an output folder.

The plot (sampled mode, ``worst_prompt.png``) shows, for the prompt with the smallest chi-square p-value, the
observed and the exact frequencies of its most likely outcomes (matplotlib, Agg backend).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # annotations only: the runner imports this module to write its report
    from specdecode.audit.results import AuditReport

#: Outcomes in the plot.
PLOT_CELLS = 24


def _fmt(x, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def _sampled_rows(report: AuditReport) -> tuple[list[str], list[list[str]]]:
    head = ["prompt", "N", "tested", "cells", "bins", "chi2", "dof", "p", "Holm p", "TV", "TV null 95/99%",
            "impossible", "detectable TV"]
    rows = []
    for p in report.prompts:
        c = p.chi2
        rows.append([p.id, str(p.num_samples), str(p.num_tested), str(len(p.labels)), str(c.num_bins),
                     f"{c.statistic:.1f}", str(c.dof), _fmt(c.pvalue), _fmt(p.adjusted_p), f"{p.tv:.4f}",
                     f"{p.tv_null_95:.4f} / {p.tv_null_99:.4f}", str(p.num_impossible), _fmt(p.detectable_tv, ".4f")])
    q = report.pooled
    chi = q["chi2"]
    null = "-" if q["tv_null_95"] is None else f"{q['tv_null_95']:.4f} / {q['tv_null_99']:.4f}"
    rows.append(["pooled", str(q["num_samples"]), str(q["num_tested"]), "", "", f"{chi['statistic']:.1f}",
                 str(chi["dof"]), _fmt(chi["pvalue"]), _fmt(chi["adjusted_pvalue"]), f"{q['tv']:.4f}", null,
                 str(q["num_impossible"]), _fmt(q["detectable_tv_max"], ".4f")])
    return head, rows


def _greedy_rows(report: AuditReport, tokenizer=None) -> tuple[list[str], list[list[str]]]:
    head = ["prompt", "tokens", "status", "position", "plain token", "source token", "margin (logits)"]

    def tok(t):
        if t is None:
            return "(ended)"
        return f"{tokenizer.convert_ids_to_tokens(int(t))!r} ({t})" if tokenizer is not None else str(t)

    rows = [[r.id, str(r.num_compared), r.status, _fmt(r.position, "d"),
             "" if r.position is None else tok(r.plain_token), "" if r.position is None else tok(r.source_token),
             _fmt(r.margin, ".4f")] for r in report.prompts]
    return head, rows


def rows(report: AuditReport, tokenizer=None) -> tuple[list[str], list[list[str]]]:
    """(column names, rows) of the report's table (sampled: one row per prompt and a pooled row)."""
    return _sampled_rows(report) if report.mode == "sampled" else _greedy_rows(report, tokenizer)


def summary_lines(report: AuditReport) -> list[str]:
    """The verdict, its reasons and the power, one line each."""
    lines = [f"verdict: {report.verdict} ({report.mode} mode, source {report.source}, target {report.target})"]
    lines += [f"  {r}" for r in report.reasons]
    if report.power:
        lines.append(f"power: {report.power}")
    if report.extra:
        e = report.extra
        lines.append(f"source counters: drafted {e['drafted_tokens']}, accepted {e['accepted_tokens']} "
                     f"(acceptance rate {e['acceptance_rate']:.1%})")
    return lines


def print_report(report: AuditReport, console=None, tokenizer=None) -> None:
    """The table and the verdict on the terminal (``console``: a rich Console; default stdout)."""
    # lazy: rich (start-up time)
    from rich.console import Console
    from rich.table import Table

    console = console or Console(file=sys.stdout, highlight=False, soft_wrap=True,
                                 width=None if sys.stdout.isatty() else 180)
    head, body = rows(report, tokenizer)
    table = Table(title=f"audit, {report.mode} mode: {report.source}", title_justify="left")
    for h in head:
        table.add_column(h, justify="left" if h == "prompt" else "right", overflow="fold")
    for i, r in enumerate(body):
        if report.mode == "sampled" and i == len(body) - 1:
            table.add_section()
        table.add_row(*r)
    console.print(table)
    for line in summary_lines(report):
        style = "bold green" if line.startswith("verdict: PASS") else "bold red" if line.startswith("verdict") else None
        console.print(line, style=style, markup=False)


def markdown(report: AuditReport, tokenizer=None, command: str | None = None) -> str:
    """The report as Markdown: settings, the table, the verdict and the power."""
    head, body = rows(report, tokenizer)
    s = report.settings
    out = [f"# specdecode audit: {report.verdict}", ""]
    if command:
        out += ["```", command, "```", ""]
    sampling = ", ".join(f"{k} {v}" for k, v in s["sampling"].items() if v not in (None, (), 0.0, False, 1.0) or
                         k == "temperature")
    a = s["audit"]
    m = report.machine
    out += [f"- source: {report.source}", f"- target (exact law computed here): {report.target}",
            f"- mode: {report.mode}; sampling: {sampling}",
            f"- samples per prompt N = {a['num_samples']}, tokens per sample n = {a['num_tokens']}, alpha = "
            f"{a['alpha']} (Holm over prompts + pooled), cells down to mass {a['cell_mass']:.2g}"
            if report.mode == "sampled" else f"- tokens compared: {a['max_new_tokens']}, near-tie margin "
            f"{a['tie_margin']} logits",
            f"- machine: {m.get('processor')}, {m.get('cpus')} CPUs, load {_fmt(m.get('load_1min'), '.2f')}, "
            f"{m.get('platform')}, torch {m.get('torch')}; {report.seconds:.0f} s", ""]
    out += ["| " + " | ".join(head) + " |", "| " + " | ".join("---" if h == "prompt" else "---:" for h in head) + " |"]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in body]
    out += [""] + [f"**{line}**" if line.startswith("verdict") else line for line in summary_lines(report)[:1]]
    out += [f"- {r}" for r in report.reasons]
    if report.power:
        out += ["", f"Power: {report.power}."]
    if report.mode == "sampled" and report.prompts:
        out += ["", "![observed vs exact frequencies of the worst prompt](worst_prompt.png)"]
    return "\n".join(out) + "\n"


def plot_worst(report: AuditReport, path: Path) -> Path | None:
    """Observed vs exact frequencies of the most likely outcomes of the prompt with the smallest p-value."""
    if report.mode != "sampled" or not report.prompts:
        return None
    # lazy: matplotlib, its Agg backend chosen before pyplot (start-up time)
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib, its Agg backend chosen before pyplot (start-up time)
    import matplotlib.pyplot as plt

    worst = min(report.prompts, key=lambda p: p.chi2.pvalue)
    n = max(1, worst.num_tested)
    order = np.argsort(-worst.expected)[:PLOT_CELLS]
    x = np.arange(len(order))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(order) + 2), 4.5))
    ax.bar(x - 0.2, worst.expected[order], 0.4, label="exact (target, processed)")
    ax.bar(x + 0.2, worst.observed[order] / n, 0.4, label=f"observed (N = {worst.num_tested})")
    ax.set_xticks(x, [worst.labels[i][:24] for i in order], rotation=70, ha="right", fontsize=7)
    ax.set_ylabel("frequency")
    ax.set_title(f"{worst.id}: chi-square p = {worst.chi2.pvalue:.3g}, TV {worst.tv:.4f} (null 99%: "
                 f"{worst.tv_null_99:.4f})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(report: AuditReport, out_dir: str | Path, tokenizer=None, command: str | None = None) -> list[Path]:
    """Write report.json, report.md (and worst_prompt.png in sampled mode) under ``out_dir``; returns the paths."""
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    data = report.to_json()
    if command:
        data["command"] = command
    paths = [out / "report.json", out / "report.md"]
    paths[0].write_text(json.dumps(data, indent=1, default=_jsonable) + "\n")
    paths[1].write_text(markdown(report, tokenizer, command))
    png = plot_worst(report, out / "worst_prompt.png")
    return paths + ([png] if png else [])


def _jsonable(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (set, frozenset, tuple)):
        return list(x)
    raise TypeError(f"not JSON: {type(x).__name__}")


__all__ = ["markdown", "plot_worst", "print_report", "rows", "summary_lines", "write_report"]
