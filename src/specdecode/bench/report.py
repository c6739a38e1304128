"""Reports of a benchmark run: Markdown (Spec-Bench leaderboard layout), JSON (every raw figure), PNG plots.

``write_reports`` is called by the runner after (and during an interrupted) run; it can
also rebuild the reports of an output directory from its ``records.jsonl`` alone
(``specdecode bench --report-only``).
"""

from __future__ import annotations

import dataclasses

import json
import math
from collections.abc import Sequence
from pathlib import Path

from specdecode.bench import roofline as R
from specdecode.bench import summary as S
from specdecode.bench.records import RecordStore

REPORT_MD = "report.md"
REPORT_JSON = "report.json"
META_JSON = "run.json"
PLOTS = ("speedup_by_category.png", "acceptance_by_position.png", "gamma_sweep.png")


# --------------------------------------------------------------------------- labels and numbers


def label(variant: dict) -> str:
    """A row label: 'ngram γ=4', 'draft-model γ=4 (qwen2.5-coder-0.5b)', 'HF assisted γ=4 (...)', 'plain'."""
    engine, method, gamma = variant["engine"], variant["method"], variant["gamma"]
    if method == "plain":
        return {"hf": "HF plain generate", "specdecode": "plain (specdecode)"}.get(engine, f"{engine} plain")
    extra = variant["family"].split(":", 1)[1] if ":" in variant["family"] and engine == "specdecode" else ""
    extra = ",".join(p for p in extra.split(",") if p and not p.startswith("model="))
    name = {"hf": f"HF {method}", "specdecode": method}.get(engine, f"{engine} {method}")
    text = f"{name} γ={gamma}" + (f" [{extra}]" if extra else "")
    return text + (f" ({variant['draft']})" if variant.get("draft") else "")


def fx(x: float | None, digits: int = 2) -> str:
    """'1.23×' or '–'."""
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}×"


def fn(x: float | None, digits: int = 2) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def fp(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str | None = None) -> str:
    align = align or "l" + "r" * (len(header) - 1)
    sep = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------- markdown


def leaderboard_table(summary: dict, variants: dict[str, dict]) -> str:
    """Methods as rows; categories, tau and overall speedup as columns (Spec-Bench's leaderboard layout)."""
    cats = summary["categories"]
    header = ["Method", *cats, "τ", "Overall"]
    rows = []
    for key in summary["leaderboard"]:
        cells = summary["cells"][key]
        tau = (cells[S.OVERALL].get("metrics") or {}).get("tau")
        rows.append([label(variants[key]), *[fx((cells[c]["speedup"] or {}).get("median")) for c in cats],
                     fn(tau), fx((cells[S.OVERALL]["speedup"] or {}).get("median"))])
    return _table(header, rows)


def details_table(summary: dict, variants: dict[str, dict]) -> str:
    header = ["Method", "speedup median [q1, q3]", "throughput ratio", "decode speedup", "tok/s", "τ",
              "acceptance", "mean draft", "draft cost / token", "prefill / draft / verify / other",
              "outputs = plain"]
    checked = (summary.get("agreement") or {}).get("checked", {})
    bad: dict[str, int] = {}
    for m in (summary.get("agreement") or {}).get("mismatches", []):
        # the first reference of each variant: our plain decoding, or (llama.cpp) its own plain decoding
        if m["reference"] == S.OURS_PLAIN or (m["reference"] == S.baseline_of(variants[m["variant"]])
                                              and variants[m["variant"]]["engine"] not in ("specdecode", "hf")):
            bad[m["variant"]] = bad.get(m["variant"], 0) + 1
    plain = (summary["cells"].get(S.OURS_PLAIN, {}).get(S.OVERALL) or {}).get("metrics") or {}
    t_decode = plain["verify_time_s"] / plain["num_verify_steps"] if plain.get("num_verify_steps") else None
    rows = []
    for key, v in variants.items():
        c = summary["cells"][key][S.OVERALL]
        sp = c["speedup"] or {}
        m = c.get("metrics") or {}
        split = m.get("time_split")
        split_s = " / ".join(fp(split[k]) for k in ("prefill", "draft", "verify", "other")) if split else "–"
        agree = (f"{checked[key] - bad.get(key, 0)}/{checked[key]}" if key in checked else "–")
        rows.append([label(v), f"{fx(sp.get('median'))} [{fn(sp.get('q1'))}, {fn(sp.get('q3'))}]",
                     fx(c["throughput_ratio"]), fx(c["decode_speedup"]), fn(c["tokens_per_s"], 1),
                     fn(m.get("tau")) if m and v["gamma"] else "–",
                     fp(m.get("acceptance_rate")) if m and v["gamma"] else "–",
                     _draft_size(m) if m and v["gamma"] else "–",
                     _draft_cost(m, t_decode) if m and v["gamma"] else "–", split_s, agree])
    return _table(header, rows)


def _draft_cost(m: dict, t_decode: float | None) -> str:
    """Drafting time per target token emitted, in ms and as a fraction of one plain decoding step of the target
    (``t_decode`` seconds); for a draft with another tokenizer this is per target token, not per draft token."""
    per = m.get("draft_s_per_token")
    if per is None:
        return "–"
    step = f" ({per / t_decode:.2f} step)" if t_decode else ""
    return f"{per * 1e3:.1f} ms{step}"


def _draft_size(m: dict) -> str:
    """Mean draft length, or for token trees 'N nodes, depth D'."""
    if m.get("is_tree"):
        return f"{fn(m.get('mean_tree_nodes'), 1)} nodes, depth {fn(m.get('mean_tree_depth'), 1)}"
    return fn(m.get("mean_draft_length"), 1)


def acceptance_table(summary: dict, variants: dict[str, dict]) -> str:
    rows, width = [], 0
    for key, v in variants.items():
        m = summary["cells"][key][S.OVERALL].get("metrics") or {}
        if v["engine"] == "specdecode" and v["gamma"] and m.get("survival"):
            rows.append((label(v), m["survival"], m["conditional_acceptance"]))
            width = max(width, len(m["survival"]))
    if not rows:
        return "_No speculative runs yet._"
    header = ["Method", *[str(i + 1) for i in range(width)]]
    body = [[name, *[f"{fp(s[i])} ({fp(r[i])})" if i < len(s) else "" for i in range(width)]]
            for name, s, r in rows]
    return _table(header, body)


def theory_table(summary: dict, variants: dict[str, dict]) -> str:
    header = ["Method", "α (i.i.d. eq.)", "E[tokens] pred.", "τ meas.", "c = T_draft/T_decode",
              "T_verify(γ)/T_decode probe / run", "ideal", "Leviathan", "overhead-aware", "measured (decode)",
              "efficiency", "best γ (i.i.d.)"]
    rows = []
    for key, p in summary["predictions"].items():
        rows.append([label(variants[key]), fn(p["alpha_iid"]), fn(p["expected_tokens"]), fn(p["measured_tau"]),
                     fn(p["c"], 3), f"{fn(p['verify_ratio_probe'])} / {fn(p['verify_ratio_run'])}",
                     fx(p["ideal_speedup"]), fx(p["leviathan_speedup"]), fx(p["overhead_aware_speedup"]),
                     fx(p["measured_decode_speedup"]), fp(p["efficiency"]), str(p["best_gamma_iid"])])
    return _table(header, rows) if rows else "_No speculative runs yet._"


def sweep_section(summary: dict) -> str:
    parts = []
    for fam, sw in summary["sweeps"].items():
        pred_tau = dict(zip(sw["curve_gammas"], sw.get("predicted_tau", [])))
        pred_sp = dict(zip(sw["curve_gammas"], sw.get("predicted_speedup", [])))
        rows = [[str(g), fn(t), fn(pred_tau.get(g)), fx(ds), fx(pred_sp.get(g)), fx(ms)]
                for g, t, ds, ms in zip(sw["gammas"], sw["measured_tau"], sw["measured_decode_speedup"],
                                        sw["measured_median_speedup"])]
        parts.append(f"**{fam}**\n\n" + _table(["γ", "τ measured", "τ predicted", "decode speedup measured",
                                                "predicted", "median wall speedup"], rows))
        best_p, best_s = sw.get("best_gamma_predicted"), sw.get("best_gamma_predicted_speedup")
        if best_p is None:
            pred = "–"
        elif best_p == 0:
            pred = f"**0**, i.e. do not speculate (no γ in 1..{sw['curve_gammas'][-1]} beats plain; best {fx(best_s)})"
        else:
            pred = f"**{best_p}** ({fx(best_s)}, over γ = 1..{sw['curve_gammas'][-1]})"
        parts.append(f"Best γ predicted by the cost model: {pred}; best γ of the sweep {sw['gammas']} "
                     f"(measured decode speedup): **{sw.get('best_gamma_measured', '–')}**.")
    return "\n\n".join(parts) if parts else "_No sweep._"


def peer_section(summary: dict, variants: dict[str, dict]) -> str:
    parts = []
    pv = summary.get("plain_vs_hf")
    if pv:
        parts.append(f"Plain decoding: ours {fn(pv['ours_tokens_per_s'], 2)} tok/s, HF `generate` "
                     f"{fn(pv['hf_tokens_per_s'], 2)} tok/s (ours / HF = {fx(pv['ratio'])}).")
    if summary["peers"]:
        cats = [*summary["categories"], S.OVERALL]
        rows = []
        for row in summary["peers"]:
            rc = row["categories"]
            rows.append([label(variants[row["ours"]]), label(variants[row["hf"]]),
                         *[f"{fx(rc[c]['ours_speedup'])} / {fx(rc[c]['hf_speedup'])} = {fn(rc[c]['ratio'])}"
                           for c in cats],
                         f"{fn(rc[S.OVERALL]['ours_tokens_per_s'], 2)} / {fn(rc[S.OVERALL]['hf_tokens_per_s'], 2)}"])
        parts.append("Cells: our speedup over our plain / the peer's speedup over its own plain decoding (HF `generate`, "
                     "llama.cpp, OpenVINO, llama-server) = ratio (> 1: ours gains more).")
        parts.append(_table(["Ours", "Peer", *cats, "tok/s ours / peer"], rows))
    ext = external_table(summary, variants)
    if ext:
        parts.append("Other engines (their own weights: GGUF 4-bit for llama.cpp / llama-server, OpenVINO int8 / int4 "
                     "exports): tokens/s, median speedup over the engine's own plain decoding, and how many greedy "
                     "outputs equal its own plain decoding's and ours (other weights give other near-ties: "
                     "'= ours' is information, not a check).")
        parts.append(ext)
    return "\n\n".join(parts) if parts else "_No peer runs._"


def external_table(summary: dict, variants: dict[str, dict]) -> str:
    """One row per variant of an engine other than ours / HF; '' when there is none."""
    counts = (summary.get("agreement") or {}).get("external", {})

    def frac(pair) -> str:
        return f"{pair[0]}/{pair[1]}" if pair else "–"

    rows = []
    for key, v in variants.items():
        if not S.is_external(v):
            continue
        c = summary["cells"][key][S.OVERALL]
        own = key == S.baseline_of(v)
        rows.append([label(v), fn(c["tokens_per_s"], 2), "1.00× (baseline)" if own else
                     fx((c["speedup"] or {}).get("median")), frac(counts.get(key, {}).get("own_plain")),
                     frac(counts.get(key, {}).get("ours"))])
    return _table(["Engine / method", "tok/s", "speedup over own plain", "= own plain", "= ours"], rows) if rows else ""


def agreement_section(summary: dict) -> str:
    ag = summary.get("agreement")
    if ag is None:
        return "_Sampling run (temperature > 0): outputs are not expected to be equal; not checked._"
    n = sum(ag["checked"].values())
    mm = ag["mismatches"]
    if not mm:
        return f"All {n} greedy outputs equal our plain decoding's (and each peer's equal its own plain decoding's)."
    rows = [[m["variant"], m["prompt"], m["reference"], str(m["first_diff"]), f"{m['tokens']} / {m['reference_tokens']}"]
            for m in mm]
    return (f"{len(mm)} mismatch(es) among {n} checked outputs (first differing token position; real models "
            f"can flip near-ties between batched verification and one-token decoding):\n\n"
            + _table(["variant", "prompt", "reference", "first diff", "tokens / reference"], rows))


def probe_section(summary: dict) -> str:
    pr = summary["probe"]
    if not pr.get("target_forward_s"):
        return "_Not measured (--no-probe)._"
    ks = sorted(pr["target_forward_s"], key=int)
    rows = [[str(k), f"{1000 * pr['target_forward_s'][k]:.1f}", fn(pr["verify_ratio"][str(k)])] for k in ks]
    text = _table(["k (draft tokens)", "T_verify(k) ms (k+1 tokens)", "T_verify(k) / T_decode(1)"], rows)
    times = [pr["target_forward_s"][k] for k in ks]
    if any(later < 0.8 * earlier for i, earlier in enumerate(times) for later in times[i + 1:]):
        text += ("\n\n**Noisy probe**: a forward over more tokens ran more than 20% faster than one over fewer; "
                 "the machine was busy. Cost-model predictions built on it are unreliable: rerun on a quiet machine.")
    drafts = pr.get("draft_forward_s") or {}
    if drafts:
        text += "\n\n" + "; ".join(f"draft `{m}`: one step {1000 * t:.1f} ms" for m, t in drafts.items() if t)
    return text


def roofline_section(summary: dict, env: dict) -> str:
    """Per model × precision: weight bytes per step, read bandwidth, byte limit, fractions of it reached."""
    rf = summary.get("roofline")
    if not rf:
        return "_Not measured (a run recorded before the roofline was added; rerun to measure)._"
    bw = rf["bandwidth"]

    def reached(x: dict | None) -> str:
        return "–" if x is None else f"{fp(x['fraction'])} ({1000 * x['step_s']:.1f} ms)"

    rows = [[f"`{r['model']}`", r["role"], r["precision"] or "–", f"{r['weight_bytes'] / 1e6:.1f}",
             f"{r['kv_bytes_per_token'] / 1e3:.1f} ({r['kv_dtype']})" if r["kv_bytes_per_token"] else "–",
             f"{bw['bytes_per_s'] / 1e9:.1f}",
             f"{fn(r['byte_limit_tokens_per_s'], 1)} ({1000 * r['byte_limit_s']:.2f} ms)",
             reached(r["plain"]), reached(r["verification"]), reached(r["drafting"])] for r in rf["rows"]]
    table = _table(["Model", "role", "precision", "weights MB / step", "KV KB / token", "read GB/s",
                    "byte limit tok/s (ms / step)", "plain decoding", f"verification (γ + 1 = {rf['gamma'] + 1})",
                    "drafting"], rows, align="lllrrrrrrr")
    return ("A step reads at least its weights once, so tokens/s ≤ read bandwidth / weight bytes per step: the "
            "byte limit. Cells: the fraction of it reached (byte-limit time / measured time per step, the latter in "
            "brackets) by plain decoding (the plain runs' steps after the prefill, overhead included), one "
            "verification forward over γ + 1 tokens (the probe; without it, the runs) and drafting (draft time per "
            "drafted token of the runs; without them, the probe). KV-cache bytes per token of context come on top, "
            f"outside the limit. Read bandwidth: fastest of {bw.get('repeats', R.READ_REPEATS)} sums of a "
            f"{bw.get('tensor_bytes', R.READ_BYTES) / 2**20:g} MiB float32 tensor, torch threads: "
            f"{bw.get('threads', '?')}, measured once per machine and cached; CPU: {env['cpu_model']} "
            f"({', '.join(env['cpu_flags']) or 'no SIMD flags read'}). MB = 10⁶ bytes.\n\n" + table)


def env_section(meta: dict) -> str:
    env, cfg, models = meta["environment"], meta["config"], meta["models"]
    rows = [["date (UTC)", env["date"]], ["CPU", f"{env['cpu_model']} ({', '.join(env['cpu_flags'])})"],
            ["cores / torch threads", f"{env['usable_cores']} / {env['torch_threads']}"],
            ["memory", f"{env['memory_gib']} GiB"],
            ["software", f"torch {env['torch']}, transformers {env['transformers']}, Python {env['python']}, "
                         f"specdecode {env['specdecode']} ({env['git_commit']})"]]
    t = models["target"]
    rows.append(["target", f"`{t['name']}` {t['architecture']}, {t['parameters'] / 1e6:.1f}M params, {t['dtype']}, "
                           f"sha256 `{t['sha256']}`"])
    for name, d in models["drafts"].items():
        rows.append(["draft", f"`{name}` {d['architecture']}, {d['parameters'] / 1e6:.1f}M params, {d['dtype']}, "
                              f"sha256 `{d['sha256']}`"])
    load = meta.get("load_average")
    if load:
        busy = " (above the core count: other processes competed for the CPU; timings are noisier)" \
            if load["max"] > (env.get("usable_cores") or 1) else ""
        rows.append(["1-min load average during runs", f"median {load['median']:.1f}, max {load['max']:.1f}{busy}"])
    rows += [["decoding", f"{'greedy' if cfg['temperature'] == 0 else 'temperature ' + str(cfg['temperature'])}, "
                          f"batch size 1, max {cfg['max_new_tokens']} new tokens, seed {cfg['seed']}"],
             ["γ", f"{cfg['gamma']} (sweep: {cfg['gammas'] or 'none'}); draft-length policy "
                   f"{cfg.get('policy', 'fixed')}"],
             ["repeats", f"{cfg.get('repeats', 1)} per (prompt, variant), interleaved; the fastest counts"],
             ["linear kernels", cfg.get("kernel", "default")],
             ["low-bit kernel variant", {None: "not recorded", "": "not recorded", "not loaded yet":
                                         "not used (no low-bit weights)"}.get(env.get("lowbit_kernel"),
                                                                               env.get("lowbit_kernel"))],
             ["target weights", cfg.get("weights", "fp32")],
             ["draft weights", cfg.get("draft_weights") or cfg.get("weights") or "fp32"],
             ["prompts", f"{', '.join(cfg['datasets'])}; limit {cfg['limit']} per category; chat template: "
                         f"{'yes where the model has one' if cfg['chat'] else 'no'}"],
             ["preset", cfg["preset"]]]
    return _table(["", ""], rows, align="ll")


def _policy_caveat(cfg: dict) -> str:
    """A sentence for the theory and γ sections when the draft length was not fixed (the theory assumes it was)."""
    policy = cfg.get("policy", "fixed")
    if policy == "fixed":
        return ""
    return (f" These runs drafted under the `{policy}` draft-length policy: a method's γ is its most per step, the "
            "draft length varied (mean draft above) and the per-position acceptance counts only the tokens the "
            "policy kept, so the predictions here, which assume every step drafts γ, describe fixed-γ runs, not "
            "these (`--policy fixed` measures them).")


def markdown(summary: dict, meta: dict) -> str:
    """The whole Markdown report."""
    variants = {v["key"]: v for v in meta["variants"]}
    cfg, env = meta["config"], meta["environment"]
    n_prompts = sum(summary["prompts_per_category"].values())
    decoding = "greedy" if cfg["temperature"] == 0 else f"temperature {cfg['temperature']}"
    head = (f"# specdecode bench: `{cfg['target']}`\n\n"
            f"{n_prompts} prompts ({', '.join(f'{c} {n}' for c, n in summary['prompts_per_category'].items())}), "
            f"{decoding}, batch size 1, max {cfg['max_new_tokens']} new tokens; {env['cpu_model']}, "
            f"{env['usable_cores']} cores, {env['torch_threads']} torch threads; {env['date']}.")
    sections = [
        head,
        "## Speedup over plain decoding\n\nMedian over prompts of the wall-clock speedup (tokens/s over plain "
        "decoding of the same target, same prompt, same process, runs interleaved prompt by prompt; prefill "
        "included). Our rows are over our plain decoding, HF rows over HF plain `generate`, each other engine's rows "
        "(llama.cpp, OpenVINO, llama-server) over its own plain. τ = tokens per target forward pass.\n\n" + leaderboard_table(summary, {**variants}),
        "## Details (all prompts)\n\nThroughput ratio: pooled tokens/s over the baseline's; decode speedup: the "
        "same after the first token (prefill taken out); draft cost / token: drafting time per token the target "
        "emitted (in target tokens, whatever the draft's vocabulary) and as a fraction of one plain decoding "
        "step; time split of wall time.\n\n"
        + details_table(summary, variants),
        "## Acceptance by draft position\n\nP(draft tokens 1..i all kept | the draft reached position i), and in "
        "brackets the conditional rate P(token i kept | tokens before it kept). For token trees, position i is "
        "depth i, and acceptance (table above) is accepted depth over drafted nodes.\n\n"
        + acceptance_table(summary, variants),
        "## Theory vs measurement (Leviathan et al. 2023)\n\nFrom the measured per-position acceptance and "
        "measured costs. Ideal = E[tokens per step] (free drafting, verification as cheap as one decoding step); "
        "Leviathan = E[tokens] / (γc + 1), c = T_draft / T_decode(1) (verification assumed to cost one step); "
        "overhead-aware = E[tokens] · T_plain / (γ·T_draft + T_verify(γ) + T_overhead), with T_verify(γ) from "
        "the probe below and per-step overhead from the run. Efficiency = measured decode speedup / "
        "overhead-aware prediction. (Token-tree methods are left out: the chain model does not describe "
        "them.)" + _policy_caveat(cfg) + "\n\n" + theory_table(summary, variants),
        "## τ and speedup against γ\n\n" + _policy_caveat(cfg).lstrip() + ("\n\n" if _policy_caveat(cfg) else "")
        + sweep_section(summary),
        "## Against the peers (Hugging Face transformers, llama.cpp, OpenVINO, llama-server)\n\n" + peer_section(summary, variants),
        "## Output agreement\n\n" + agreement_section(summary),
        "## Cost of verification\n\nOne cached target forward over k + 1 new tokens at a typical context "
        "(least of the timed repetitions), relative to one decoding step.\n\n" + probe_section(summary),
        "## Roofline: the byte limit of a step\n\n" + roofline_section(summary, env),
        "## Environment\n\n" + env_section({**meta, "load_average": summary.get("load_average")}),
    ]
    return "\n\n".join(sections) + "\n"


# --------------------------------------------------------------------------- plots


def plot_all(summary: dict, meta: dict, out: Path) -> list[Path]:
    """Write the three PNG plots; returns their paths."""
    # lazy: matplotlib, its Agg backend chosen before pyplot (start-up time)
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib, its Agg backend chosen before pyplot (start-up time)
    import matplotlib.pyplot as plt

    variants = {v["key"]: v for v in meta["variants"]}
    paths = [out / name for name in PLOTS]
    _plot_speedups(plt, summary, variants, paths[0], meta["config"]["target"])
    _plot_acceptance(plt, summary, variants, paths[1])
    _plot_sweep(plt, summary, paths[2])
    return paths


def _plot_speedups(plt, summary, variants, path: Path, target: str) -> None:
    cats = [*summary["categories"], S.OVERALL]
    keys = summary["leaderboard"]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(cats) * max(1, len(keys)) ** 0.5 + 3), 4.2))
    width = 0.8 / max(1, len(keys))
    for i, key in enumerate(keys):
        meds, lo, hi = [], [], []
        for c in cats:
            sp = summary["cells"][key][c]["speedup"] or {}
            m = sp.get("median", float("nan"))
            meds.append(m)
            lo.append(max(0.0, m - sp.get("q1", m)) if sp else 0.0)
            hi.append(max(0.0, sp.get("q3", m) - m) if sp else 0.0)
        xs = [j + (i - (len(keys) - 1) / 2) * width for j in range(len(cats))]
        ax.bar(xs, meds, width, yerr=[lo, hi], capsize=2, label=label(variants[key]))
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(range(len(cats)), cats, rotation=30, ha="right")
    ax.set_ylabel("speedup over plain (median, IQR)")
    ax.set_title(f"Speedup by category: {target}")
    if keys:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_acceptance(plt, summary, variants, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, v in variants.items():
        m = summary["cells"][key][S.OVERALL].get("metrics") or {}
        if v["engine"] == "specdecode" and v["gamma"] and m.get("survival"):
            ax.plot(range(1, len(m["survival"]) + 1), m["survival"], marker="o", label=label(v))
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("draft position i")
    ax.set_ylabel("P(tokens 1..i kept)")
    ax.set_ylim(0, 1.02)
    ax.set_title("Acceptance by draft position")
    if ax.lines:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_sweep(plt, summary, path: Path) -> None:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for i, (fam, sw) in enumerate(summary["sweeps"].items()):
        color = f"C{i}"
        ax1.plot(sw["gammas"], sw["measured_tau"], "o", color=color, label=f"{fam} measured")
        ax2.plot(sw["gammas"], [x if x is not None else float("nan") for x in sw["measured_decode_speedup"]], "o",
                 color=color, label=f"{fam} measured")
        if sw.get("predicted_tau"):
            ax1.plot(sw["curve_gammas"], sw["predicted_tau"], "-", color=color, alpha=0.7, label=f"{fam} predicted")
            ax2.plot(sw["curve_gammas"], sw["predicted_speedup"], "-", color=color, alpha=0.7,
                     label=f"{fam} predicted")
    for ax in (ax1, ax2):
        ax.xaxis.get_major_locator().set_params(integer=True)
    ax1.set_xlabel("γ")
    ax1.set_ylabel("τ (tokens per target forward)")
    ax1.set_title("τ against γ")
    ax2.axhline(1.0, color="black", lw=0.8, ls="--")
    ax2.set_xlabel("γ")
    ax2.set_ylabel("decode speedup over plain")
    ax2.set_title("Speedup against γ (points: measured, lines: cost model)")
    for ax in (ax1, ax2):
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- files


def build_meta(*, config, env: dict, models: dict, variants: list[dict], prompts: list[dict],
               main_gammas: dict | None = None, roofline: dict | None = None) -> dict:
    """Everything about the run but its records: config, environment, models, variants, prompts, per
    method family the gamma of its leaderboard row (``runner.main_gamma_of``), and the roofline's inputs
    (read bandwidth, bytes per step of each model: ``bench.roofline``)."""
    cfg = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
    main = main_gammas or {}
    return {"config": {**cfg, "batch_size": 1, "settings_id": config.settings_id()}, "environment": env,
            "models": models, "variants": variants, "prompts": prompts, "main_gammas": main, "roofline": roofline}


def write_reports(out: Path, *, config, env: dict, models: dict, variants: list[dict], prompts: list[dict],
                  records: list[dict], probes: list[dict], main_gammas: dict | None = None,
                  roofline: dict | None = None) -> dict:
    """Summarize and write report.md, report.json, run.json and the PNG plots into ``out``.

    Returns:
        The report.json content: {"environment", "config", "models", "variants", "prompts", "main_gammas",
        "roofline", "summary", "probes", "records"}; the summary's "roofline" holds the fractions.
    """
    meta = build_meta(config=config, env=env, models=models, variants=variants, prompts=prompts,
                      main_gammas=main_gammas, roofline=roofline)
    return write_from_meta(Path(out), meta, records, probes)


def write_from_meta(out: Path, meta: dict, records: list[dict], probes: list[dict]) -> dict:
    """The reports from a run's metadata and records (also used by ``--report-only``)."""
    summ = S.summarize(records, meta["variants"], meta["prompts"], probes, meta["config"]["target"],
                       main_gammas=meta.get("main_gammas"), greedy=meta["config"]["temperature"] == 0)
    summ["roofline"] = R.roofline(meta.get("roofline"), summ, meta["variants"], meta["config"]["gamma"])
    (out / META_JSON).write_text(json.dumps(meta, indent=1), encoding="utf-8")
    (out / REPORT_MD).write_text(markdown(summ, meta), encoding="utf-8")
    plot_all(summ, meta, out)
    result = {**meta, "summary": summ, "probes": probes, "records": records}
    (out / REPORT_JSON).write_text(json.dumps(result, indent=1), encoding="utf-8")
    return result


def rebuild(out: Path) -> dict:
    """Rewrite the reports of an output directory from run.json and records.jsonl (no model is loaded).

    Raises:
        FileNotFoundError: the directory has no run.json (no run was ever reported there).
    """
    out = Path(out)
    meta = json.loads((out / META_JSON).read_text(encoding="utf-8"))
    store = RecordStore(out, meta["config"]["settings_id"])
    return write_from_meta(out, meta, store.of_kind("run"), store.of_kind("probe"))
