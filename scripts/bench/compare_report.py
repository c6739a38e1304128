"""Table of ``compare_engines.py`` runs: old vs new code, per target / drafter / dataset.

Reads ``DIR/old_TAG.jsonl`` and ``DIR/new_TAG.jsonl`` (one JSON line per run), keeps each prompt's
fastest run per code version (other work on a shared machine only slows a run down), and prints a
Markdown row per tag and method: median decode tokens/s of old and new, the median per-prompt ratio
new / old, tau, and whether the outputs are identical.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("directory", type=Path)
    args = ap.parse_args()
    print("| runs | target, weights | data | method | old tok/s | new tok/s | new / old (median) | τ | outputs equal |")
    print("| ---: | --- | --- | --- | ---: | ---: | ---: | ---: | --- |")
    for old_file in sorted(args.directory.glob("old_*.jsonl")):
        tag = old_file.stem[4:]
        new_file = args.directory / f"new_{tag}.jsonl"
        old = [json.loads(line) for line in old_file.read_text().splitlines() if line.strip()]
        new = [json.loads(line) for line in new_file.read_text().splitlines() if line.strip()] if new_file.exists() else []
        runs = min(len(old), len(new))
        if not runs:
            continue
        old, new = old[:runs], new[:runs]
        for method in old[0]["methods"]:
            k = len(old[0]["methods"][method])
            best_old = [max(r["methods"][method][i]["tokens_per_s"] for r in old) for i in range(k)]
            best_new = [max(r["methods"][method][i]["tokens_per_s"] for r in new) for i in range(k)]
            same = all(o["methods"][method][i]["ids"] == n["methods"][method][i]["ids"]
                       for o, n in zip(old, new) for i in range(k))
            tau = statistics.median(r["tau"] for r in new[0]["methods"][method])
            ratio = statistics.median(b / a for a, b in zip(best_old, best_new))
            print(f"| {runs} | {old[0]['target']}, {old[0]['weights']} | {old[0]['dataset']} | {method} | "
                  f"{statistics.median(best_old):.1f} | {statistics.median(best_new):.1f} | {ratio:.2f}x | {tau:.2f} | "
                  f"{'yes' if same else 'NO'} |")
    loads = [json.loads(line)["load"][0] for f in sorted(args.directory.glob("*.jsonl"))
             for line in f.read_text().splitlines() if line.strip()]
    if loads:
        print(f"\n1-min load average at the runs: {min(loads):.1f} to {max(loads):.1f} (2 cores)")


if __name__ == "__main__":
    main()
