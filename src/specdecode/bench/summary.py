"""From raw run records to the figures of the reports (pure functions over JSON-ready dicts).

Definitions (DESIGN.md vocabulary):

- speedup of a run: its tokens/s over the tokens/s of its baseline on the same prompt (ours
  over our plain decoding; Hugging Face variants over HF plain ``generate``), wall clock of the
  whole call, prefill included; per category and overall: median and spread over prompts.
- throughput ratio: pooled tokens / pooled seconds, over the baseline's on the same prompts.
- decode speedup: the same ratio after the first token (prefill time taken out of both);
  the cost model predicts this one, so efficiency = measured decode speedup / predicted.
- tau: tokens committed per verification forward, pooled; acceptance rate: accepted / drafted.
- survival[i]: P(draft tokens 0..i all kept | the draft reached position i), pooled counters.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from specdecode import costmodel

OURS_PLAIN = "specdecode/plain"
HF_PLAIN = "hf/plain"
OVERALL = "overall"


def baseline_of(variant: dict) -> str:
    """The plain decoding a variant's speedup is over: its own engine's (ours, HF, llama.cpp)."""
    return OURS_PLAIN if variant["engine"] == "specdecode" else f"{variant['engine']}/plain"


def spread(values: Sequence[float]) -> dict | None:
    """median, quartiles, min, max, mean and geometric mean of positive values (None when empty)."""
    vals = sorted(float(v) for v in values)
    if not vals:
        return None
    q1, _, q3 = statistics.quantiles(vals, n=4, method="inclusive") if len(vals) > 1 else (vals[0],) * 3
    return {"n": len(vals), "median": statistics.median(vals), "q1": q1, "q3": q3, "min": vals[0], "max": vals[-1],
            "mean": statistics.fmean(vals), "geomean": math.exp(statistics.fmean(math.log(v) for v in vals))}


def _tps(rec: dict) -> float | None:
    return rec["new_tokens"] / rec["wall_s"] if rec["new_tokens"] and rec["wall_s"] > 0 else None


def _decode_time(rec: dict) -> tuple[float, int]:
    """(seconds after the first token, tokens after the first); HF records have no prefill split -> wall."""
    m = rec.get("metrics")
    prefill = m["prefill_time_s"] if m else 0.0
    return max(rec["wall_s"] - prefill, 0.0), max(rec["new_tokens"] - (1 if m else 0), 0)


def fastest_runs(records: Sequence[dict]) -> dict[tuple[str, str], dict]:
    """{(variant, prompt): record}: of repeated runs (``--repeats``), the one with the least wall time."""
    best: dict[tuple[str, str], dict] = {}
    for r in records:
        key = (r["variant"], r["prompt"])
        if key not in best or r["wall_s"] < best[key]["wall_s"]:
            best[key] = r
    return best


# --------------------------------------------------------------------------- pooled counters


def pool_metrics(records: Sequence[dict]) -> dict | None:
    """Sum RunMetrics counters over records and derive tau, acceptance, survival, time split."""
    ms = [r["metrics"] for r in records if r.get("metrics")]
    if not ms:
        return None
    keys = ("num_generated_tokens", "num_drafted_tokens", "num_accepted_tokens", "num_verify_steps",
            "num_step_tokens", "prefill_time_s", "draft_time_s", "verify_time_s", "wall_time_s")
    tot = {k: sum(m[k] for m in ms) for k in keys}
    for k in ("num_tree_steps", "num_tree_nodes", "tree_depth_sum"):  # token-tree runs (absent in older records)
        tot[k] = sum(m.get(k, 0) for m in ms)
    width = max((len(m["drafted_by_position"]) for m in ms), default=0)
    drafted = [sum(m["drafted_by_position"][i] for m in ms if i < len(m["drafted_by_position"])) for i in range(width)]
    accepted = [sum(m["accepted_by_position"][i] for m in ms if i < len(m["accepted_by_position"])) for i in range(width)]
    lengths = [k for m in ms for k in m["draft_lengths"]]
    wall = sum(r["wall_s"] for r in records if r.get("metrics"))
    other = max(wall - tot["prefill_time_s"] - tot["draft_time_s"] - tot["verify_time_s"], 0.0)
    steps = tot["num_verify_steps"]
    survival = [a / d if d else 0.0 for a, d in zip(accepted, drafted)]
    return {
        **tot,
        "wall_s": wall,
        "other_time_s": other,
        "tau": tot["num_step_tokens"] / steps if steps else 0.0,
        "acceptance_rate": tot["num_accepted_tokens"] / tot["num_drafted_tokens"] if tot["num_drafted_tokens"] else 0.0,
        "drafted_by_position": drafted,
        "accepted_by_position": accepted,
        "survival": survival,
        "conditional_acceptance": costmodel.rates_from_survival(survival),
        "mean_draft_length": statistics.fmean(lengths) if lengths else 0.0,
        # the draft's cost per target token: drafting seconds over the tokens the target emitted (accepted,
        # recovered and bonus tokens, in the target's vocabulary), whatever the drafter's own vocabulary
        "draft_s_per_token": (tot["draft_time_s"] / tot["num_generated_tokens"]
                              if tot["num_generated_tokens"] else 0.0),
        "is_tree": tot["num_tree_steps"] > 0,
        "mean_tree_nodes": tot["num_tree_nodes"] / tot["num_tree_steps"] if tot["num_tree_steps"] else None,
        "mean_tree_depth": tot["tree_depth_sum"] / tot["num_tree_steps"] if tot["num_tree_steps"] else None,
        "draft_lengths": lengths,
        "time_split": {k: (v / wall if wall else 0.0) for k, v in
                       (("prefill", tot["prefill_time_s"]), ("draft", tot["draft_time_s"]),
                        ("verify", tot["verify_time_s"]), ("other", other))},
        "per_step_s": {k: (v / steps if steps else 0.0) for k, v in
                       (("draft", tot["draft_time_s"]), ("verify", tot["verify_time_s"]), ("other", other))},
    }


# --------------------------------------------------------------------------- cells


def cell(variant: dict, recs: dict[str, dict], base: dict[str, dict]) -> dict:
    """Figures of one variant over a set of prompts: {prompt: record} and its baseline's {prompt: record}."""
    paired = [p for p in recs if p in base and _tps(recs[p]) and _tps(base[p])]
    speedups = [_tps(recs[p]) / _tps(base[p]) for p in paired]
    tok = sum(recs[p]["new_tokens"] for p in paired)
    sec = sum(recs[p]["wall_s"] for p in paired)
    btok = sum(base[p]["new_tokens"] for p in paired)
    bsec = sum(base[p]["wall_s"] for p in paired)
    d_sec, d_tok = map(sum, zip(*[_decode_time(recs[p]) for p in paired])) if paired else (0.0, 0)
    b_sec, b_tok = map(sum, zip(*[_decode_time(base[p]) for p in paired])) if paired else (0.0, 0)
    all_tok = sum(r["new_tokens"] for r in recs.values())
    all_sec = sum(r["wall_s"] for r in recs.values())
    out = {
        "n": len(recs),
        "n_paired": len(paired),
        "speedup": spread(speedups),
        "throughput_ratio": (tok / sec) / (btok / bsec) if sec and bsec and btok else None,
        "decode_speedup": (d_tok / d_sec) / (b_tok / b_sec) if d_sec and b_sec and b_tok and d_tok else None,
        "tokens_per_s": all_tok / all_sec if all_sec else None,
        "new_tokens": all_tok,
        "wall_s": all_sec,
    }
    pooled = pool_metrics(list(recs.values()))
    if pooled is not None:
        out["metrics"] = {k: v for k, v in pooled.items() if k != "draft_lengths"}
    return out


def agreement(runs: dict[tuple[str, str], dict], variants: Sequence[dict], prompts: Sequence[str]) -> dict:
    """Greedy outputs of every variant against our plain decoding (and HF's against HF plain).

    Returns:
        {"checked": {variant: n}, "mismatches": [{variant, prompt, reference, first_diff, ...}],
         "external": {variant: {"own_plain": [equal, n], "ours": [equal, n]}}} (engines other than ours / HF)
    """
    checked: dict[str, int] = {}
    mismatches = []
    external: dict[str, dict[str, list[int]]] = {}  # other engines: {key: {"own_plain"|"ours": [equal, checked]}}
    for v in variants:
        if is_external(v):
            external[v["key"]] = _equal_counts(runs, v, prompts)
        # llama.cpp runs the 4-bit GGUF, not our converted weights: checked against its own plain only
        refs = [OURS_PLAIN] if v["key"] != OURS_PLAIN and v["engine"] in ("specdecode", "hf") else []
        if v["engine"] != "specdecode" and v["key"] != baseline_of(v):
            refs.append(baseline_of(v))
        for p in prompts:
            rec = runs.get((v["key"], p))
            if rec is None:
                continue
            for ref_key in refs:
                ref = runs.get((ref_key, p))
                if ref is None:
                    continue
                checked[v["key"]] = checked.get(v["key"], 0) + (ref_key == refs[0])
                pos = first_difference(rec["token_ids"], ref["token_ids"])
                if pos is not None:
                    mismatches.append({"variant": v["key"], "prompt": p, "reference": ref_key, "first_diff": pos,
                                       "tokens": len(rec["token_ids"]), "reference_tokens": len(ref["token_ids"])})
    return {"checked": checked, "mismatches": mismatches, "external": external}


def is_external(variant: dict) -> bool:
    """An engine other than ours and HF's (llama.cpp, openvino, llama-server): its own weights, its own baseline."""
    return variant["engine"] not in ("specdecode", "hf")


def _equal_counts(runs: dict[tuple[str, str], dict], v: dict, prompts: Sequence[str]) -> dict[str, list[int]]:
    """[equal, checked] greedy outputs of an external engine's variant against its own plain and against ours
    (information only: other weights give other near-ties, so these never count as mismatches)."""
    out = {}
    for name, ref_key in (("own_plain", baseline_of(v)), ("ours", OURS_PLAIN)):
        if ref_key == v["key"]:
            continue
        pairs = [(runs[(v["key"], p)], runs[(ref_key, p)]) for p in prompts
                 if (v["key"], p) in runs and (ref_key, p) in runs]
        out[name] = [sum(first_difference(a["token_ids"], b["token_ids"]) is None for a, b in pairs), len(pairs)]
    return out


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (the shorter length when one is a prefix of the other), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# --------------------------------------------------------------------------- theory


def verify_ratio_of(probes: Sequence[dict], target: str):
    """T_verify(k) / T_decode(1) from the target's probe record, or None without one."""
    for p in probes:
        if p.get("role") == "target" and p.get("model") == target:
            samples = {int(k): float(v) for k, v in p["forward_s"].items()}
            return costmodel.verify_ratio_from_samples(samples), samples
    return None, None


def iid_equivalent_alpha(expected: float, gamma: int) -> float:
    """The i.i.d. alpha whose E[tokens] at this gamma equals ``expected`` (bisection)."""
    if gamma <= 0:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if costmodel.expected_tokens_iid(mid, gamma) < expected:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def step_costs(plain: dict, spec: dict, ratio) -> costmodel.StepCosts | None:
    """The cost model's measured costs from pooled metrics (:func:`pool_metrics`) of a plain and a speculative run.

    T_decode(1) and T_plain are per plain step (verify seconds; verify + other seconds), T_draft per
    drafted token, T_overhead the speculative run's other seconds per step; ``ratio(k)`` is
    T_verify(k) / T_decode(1) (the probe's, else the run's own mean at every k). None when either
    run has no verification step.
    """
    steps_p = plain["num_verify_steps"]
    if not steps_p or not spec["num_verify_steps"]:
        return None
    t_decode = plain["verify_time_s"] / steps_p
    t_plain = (plain["verify_time_s"] + plain["other_time_s"]) / steps_p
    drafted = spec["num_drafted_tokens"]
    t_draft = spec["draft_time_s"] / drafted if drafted else 0.0
    if ratio is None:  # no probe: take the run's own mean verify cost at every k
        run_ratio = (spec["verify_time_s"] / spec["num_verify_steps"]) / t_decode if t_decode else 1.0
        ratio = lambda k: 1.0 if k == 0 else run_ratio  # noqa: E731
    return costmodel.StepCosts(t_plain=t_plain, t_draft=t_draft, verify_ratio=ratio, t_decode=t_decode,
                            t_overhead=spec["other_time_s"] / spec["num_verify_steps"])


def _scaled_lengths(lengths: Sequence[int], cap: int, gamma: int) -> list[int]:
    """Draft lengths a run at ``cap`` would have had at ``gamma``: full drafts become gamma, short ones stay."""
    return [gamma if k == cap else min(k, gamma) for k in lengths]


def predict(plain: dict, spec: dict, gamma: int, ratio, lengths: Sequence[int]) -> dict | None:
    """The cost model at the run's own gamma: ideal, Leviathan, overhead-aware speedups and their inputs."""
    costs = step_costs(plain, spec, ratio)
    if costs is None or not spec["survival"]:
        return None
    s = costmodel.extend_survival(spec["survival"], max(max(lengths, default=0), gamma))
    e_tok = costmodel.expected_tokens_mixture(s, lengths)
    mean_k = statistics.fmean(lengths) if lengths else 0.0
    c = costs.t_draft / costs.t_decode if costs.t_decode else 0.0
    return {
        "expected_tokens": e_tok,
        "expected_accepted": e_tok - 1.0,
        "alpha_iid": iid_equivalent_alpha(costmodel.expected_tokens(s, gamma), gamma),
        "c": c,
        "t_decode_s": costs.t_decode,
        "t_plain_s": costs.t_plain,
        "t_draft_s": costs.t_draft,
        "t_overhead_s": costs.t_overhead,
        "verify_ratio_probe": costs.verify_ratio(gamma),
        "verify_ratio_run": (spec["verify_time_s"] / spec["num_verify_steps"]) / costs.t_decode,
        "ideal_speedup": e_tok,
        "leviathan_speedup": e_tok / (mean_k * c + 1.0),
        "overhead_aware_speedup": costmodel.overhead_aware_speedup_mixture(s, lengths, costs),
        "best_gamma_iid": costmodel.best_gamma_iid(iid_equivalent_alpha(costmodel.expected_tokens(s, gamma), gamma), c),
    }


def predicted_curve(plain: dict, spec: dict, cap: int, ratio, gammas: Sequence[int]
                    ) -> tuple[list[float], list[float]] | None:
    """Predicted tau and decode speedup at each gamma of ``gammas``, from one chain run at gamma ``cap``.

    The run's per-position survival (continued past its longest draft at the last conditional rate),
    its draft lengths (full drafts become gamma, shorter ones stay) and its measured costs
    (:func:`step_costs`) go through :func:`costmodel.overhead_aware_speedup_mixture`.

    Args:
        plain, spec: pooled metrics (:func:`pool_metrics`) of plain decoding and of the run.
        cap: the gamma the run drafted at. ratio: T_verify(k) / T_decode(1), or None (the run's own).

    Returns:
        ([tau per gamma], [speedup per gamma]), or None without costs or acceptance.
    """
    costs = step_costs(plain, spec, ratio)
    if costs is None or not spec["survival"] or not gammas:
        return None
    lengths = spec["draft_lengths"]
    s = costmodel.extend_survival(spec["survival"], max(max(gammas), max(lengths, default=0)))
    tau, speed = [], []
    for g in gammas:
        lg = _scaled_lengths(lengths, cap, g)
        tau.append(costmodel.expected_tokens_mixture(s, lg))
        speed.append(costmodel.overhead_aware_speedup_mixture(s, lg, costs))
    return tau, speed


def sweep(family_variants: Sequence[dict], pooled: dict[str, dict], plain: dict, cells: dict, ratio,
          max_curve: int = 8) -> dict | None:
    """tau and speedup against gamma for one method family: measured points and predicted curves.

    The prediction uses the per-position acceptance, draft lengths and costs of the family's
    largest-gamma run (acceptance past its length continues at its last conditional rate).
    """
    points = sorted(((v["gamma"], v["key"]) for v in family_variants
                     if v["key"] in pooled and not pooled[v["key"]]["is_tree"]), key=lambda t: t[0])
    if not points:
        return None
    cap, cap_key = points[-1]
    top = pooled[cap_key]
    g_max = max(max_curve, cap)
    out = {
        "gammas": [g for g, _ in points],
        "measured_tau": [pooled[k]["tau"] for _, k in points],
        "measured_decode_speedup": [cells[k][OVERALL]["decode_speedup"] for _, k in points],
        "measured_median_speedup": [(cells[k][OVERALL]["speedup"] or {}).get("median") for _, k in points],
        "curve_gammas": list(range(1, g_max + 1)),
    }
    measured = [(s, g) for g, s in zip(out["gammas"], out["measured_decode_speedup"]) if s is not None]
    out["best_gamma_measured"] = max(measured)[1] if measured else None
    curve = predicted_curve(plain, top, cap, ratio, out["curve_gammas"])
    if curve is None:
        return out
    tau, speed = curve
    out["predicted_tau"] = tau
    out["predicted_speedup"] = speed
    best = max(range(len(speed)), key=lambda i: (speed[i], -i))
    out["best_gamma_predicted"] = out["curve_gammas"][best] if speed[best] > 1.0 else 0
    out["best_gamma_predicted_speedup"] = speed[best]
    return out


# --------------------------------------------------------------------------- the summary


def summarize(records: Sequence[dict], variants: Sequence[dict], prompts: Sequence[dict], probes: Sequence[dict],
              target: str, main_gammas: dict[str, int] | None = None, greedy: bool = True) -> dict:
    """Everything the reports show, from raw records.

    Args:
        records: run records (``kind == "run"``) of the current settings.
        variants: variant infos (key, engine, method, gamma, family, peer_of, draft).
        prompts: prompt infos in run order (key, category, ...).
        probes: probe records (T_verify(k) of the target, draft step times).
        target: the target spec (finds its probe).
        main_gammas: family -> gamma of the leaderboard row (default: the smallest gamma run).
        greedy: check that outputs agree (greedy decoding only).
    """
    runs = fastest_runs(records)
    categories = list(dict.fromkeys(p["category"] for p in prompts))
    by_cat = {c: [p["key"] for p in prompts if p["category"] == c] for c in categories}
    all_prompts = [p["key"] for p in prompts]

    def recs_of(key: str, keys: Sequence[str]) -> dict[str, dict]:
        return {p: runs[(key, p)] for p in keys if (key, p) in runs}

    cells: dict[str, dict] = {}
    for v in variants:
        base = baseline_of(v)
        cells[v["key"]] = {c: cell(v, recs_of(v["key"], ks), recs_of(base, ks))
                           for c, ks in [*by_cat.items(), (OVERALL, all_prompts)]}

    ratio, probe_samples = verify_ratio_of(probes, target)
    pooled = {v["key"]: pool_metrics(list(recs_of(v["key"], all_prompts).values())) for v in variants
              if v["engine"] == "specdecode"}
    plain = pooled.get(OURS_PLAIN)
    predictions = {}
    for v in variants:
        if v["engine"] != "specdecode" or v["key"] == OURS_PLAIN or not pooled.get(v["key"]) or not plain:
            continue
        spec = pooled[v["key"]]
        if spec["is_tree"]:
            continue  # the chain cost model does not describe token trees (nodes != depth)
        pred = predict(plain, spec, v["gamma"], ratio, spec["draft_lengths"])
        if pred is None:
            continue
        measured = cells[v["key"]][OVERALL]
        pred["measured_decode_speedup"] = measured["decode_speedup"]
        pred["measured_median_speedup"] = (measured["speedup"] or {}).get("median")
        pred["measured_tau"] = spec["tau"]
        pred["efficiency"] = (measured["decode_speedup"] / pred["overhead_aware_speedup"]
                              if measured["decode_speedup"] and pred["overhead_aware_speedup"] else None)
        pred["fraction_of_ideal"] = (measured["decode_speedup"] / pred["ideal_speedup"]
                                     if measured["decode_speedup"] else None)
        predictions[v["key"]] = pred

    families: dict[str, list[dict]] = {}
    for v in variants:
        if v["engine"] == "specdecode" and v["key"] != OURS_PLAIN:
            families.setdefault(v["family"], []).append(v)
    sweeps = {}
    if plain:
        for fam, vs in families.items():
            sw = sweep(vs, {k: p for k, p in pooled.items() if p}, plain, cells, ratio,
                       max_curve=max(8, *(v["gamma"] for v in vs)))
            if sw:
                sweeps[fam] = sw

    mains = dict(main_gammas or {})
    for fam, vs in families.items():
        mains.setdefault(fam, min(v["gamma"] for v in vs))
    leaderboard = [v["key"] for v in variants if v["engine"] == "specdecode" and v["key"] != OURS_PLAIN
                   and v["gamma"] == mains.get(v["family"])]
    leaderboard += [v["key"] for v in variants if v["engine"] != "specdecode" and v["key"] != baseline_of(v)]

    peers = []
    for v in variants:
        if v.get("peer_of") and v["peer_of"] in cells:
            row = {"ours": v["peer_of"], "hf": v["key"], "categories": {}}
            for c in [*categories, OVERALL]:
                o, h = cells[v["peer_of"]][c], cells[v["key"]][c]
                om = (o["speedup"] or {}).get("median")
                hm = (h["speedup"] or {}).get("median")
                row["categories"][c] = {"ours_speedup": om, "hf_speedup": hm,
                                        "ratio": om / hm if om and hm else None,
                                        "ours_tokens_per_s": o["tokens_per_s"], "hf_tokens_per_s": h["tokens_per_s"]}
            peers.append(row)

    plain_vs_hf = None
    if OURS_PLAIN in cells and HF_PLAIN in cells:
        o, h = cells[OURS_PLAIN][OVERALL]["tokens_per_s"], cells[HF_PLAIN][OVERALL]["tokens_per_s"]
        plain_vs_hf = {"ours_tokens_per_s": o, "hf_tokens_per_s": h, "ratio": o / h if o and h else None}

    loads = [r[k] for r in records for k in ("load1_before", "load1_after") if r.get(k) is not None]
    return {
        "load_average": spread([x for x in loads if x > 0]) if loads else None,
        "categories": categories,
        "prompts_per_category": {c: len(ks) for c, ks in by_cat.items()},
        "cells": cells,
        "leaderboard": leaderboard,
        "main_gammas": mains,
        "predictions": predictions,
        "sweeps": sweeps,
        "probe": {"target_forward_s": probe_samples,
                  "verify_ratio": {str(k): v / probe_samples[0] for k, v in probe_samples.items()}
                  if probe_samples else None,
                  "draft_forward_s": {p["model"]: p["forward_s"].get("0") for p in probes if p.get("role") == "draft"}},
        "peers": peers,
        "plain_vs_hf": plain_vs_hf,
        "agreement": agreement(runs, variants, all_prompts) if greedy else None,
        "pooled": {k: ({kk: vv for kk, vv in p.items() if kk != "draft_lengths"} if p else None)
                   for k, p in pooled.items()},
    }
