"""What ``specdecode tune`` prints and writes: the report table and the ``--config`` settings file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from specdecode.tune.config import PLAIN
from specdecode.tune.decide import TuneResult, variant_label, times_text, best_per_drafter
from specdecode.configfile import write_toml


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
        rows.append({"method": variant_label(p.key, p.gamma, p.policy), "key": p.key, "gamma": p.gamma, "policy": p.policy,
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
    from rich.console import Console  # lazy: rich only when printing
    from rich.table import Table  # lazy: rich only when printing

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
        table.add_row(("→ " if is_chosen else "") + r["method"], times_text(r["predicted"]), times_text(r["measured"]),
                      times_text(r["decode_measured"]), f"{r['tau']:.2f}" if r["tau"] else "-",
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
