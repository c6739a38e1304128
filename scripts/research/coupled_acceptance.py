"""Per-token acceptance of the coupled sampling mode against standard rejection sampling (a program).

Teacher-forced on real text (Spec-Bench prompts, chat template), at every position the target's p
and the draft's q (after temperature) give:

- standard rejection sampling (Leviathan et al. 2023): alpha = sum_x min(p(x), q(x)) = 1 - TV(p, q);
- the coupled mode (``specdecode.coupled``: both models pick with the same Gumbel noise):
  alpha = P[argmax(log p + G) = argmax(log q + G)] = sum_x 1 / sum_y max(p(y)/p(x), q(y)/q(x)),
  exactly (x wins both Gumbel races iff it wins the race with weights max(p(y)/p(x), q(y)/q(x))),
  computed on the union of the top tokens of p and q that covers all but 1e-6 of both masses (the
  rest is added to the inner sums as its total mass, a bound whose effect the report prints);
- a deterministic drafter (one-hot q on the draft's argmax) is accepted with p(argmax q) in both
  modes, reported once.

    python scripts/research/coupled_acceptance.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --limit 2
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from specdecode.bench.env import describe, environment
from specdecode.models import load_model
from specdecode.precision import quality_texts


def coupled_agreement(p: torch.Tensor, q: torch.Tensor, top: int = 512) -> tuple[float, float]:
    """(coupled acceptance, mass left out) for [V] float64 distributions p and q."""
    idx = torch.unique(torch.cat([p.topk(top).indices, q.topk(top).indices]))
    ps, qs = p[idx], q[idx]
    tail_p, tail_q = float(1 - ps.sum()), float(1 - qs.sum())
    keep = (ps > 0) & (qs > 0)  # x needs p(x) > 0 and q(x) > 0 to win both races
    px, qx = ps[keep], qs[keep]
    ratio = torch.maximum(ps.unsqueeze(0) / px.unsqueeze(1), qs.unsqueeze(0) / qx.unsqueeze(1))  # [X, Y]
    inner = ratio.sum(1) + torch.maximum(tail_p / px, tail_q / qx)
    return float((1.0 / inner).sum()), max(tail_p, tail_q)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--limit", type=int, default=1, help="prompts per Spec-Bench category")
    ap.add_argument("--max-tokens", type=int, default=256, help="tokens kept per text")
    ap.add_argument("--temperatures", default="1.0,0.7")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_model(args.target, dtype=torch.bfloat16, progress=False)
    draft = load_model(args.draft, dtype=torch.bfloat16, progress=False)
    texts = quality_texts(target.tokenizer, per_category=args.limit, max_tokens=args.max_tokens)
    temps = [float(t) for t in args.temperatures.split(",")]
    sums = {t: {"standard": 0.0, "coupled": 0.0, "deterministic": 0.0, "tail": 0.0} for t in temps}
    n = 0
    with torch.inference_mode():
        for ids in texts:
            x = torch.tensor([ids])
            lp = target.model(x).logits[0].double()
            lq = draft.model(x).logits[0].double()
            v = min(lp.shape[-1], lq.shape[-1])
            lp, lq = lp[:, :v], lq[:, :v]
            for t in temps:
                p_all, q_all = torch.softmax(lp / t, -1), torch.softmax(lq / t, -1)
                for p, q in zip(p_all, q_all):
                    s = sums[t]
                    s["standard"] += float(torch.minimum(p, q).sum())
                    c, tail = coupled_agreement(p, q)
                    s["coupled"] += c
                    s["tail"] = max(s["tail"], tail)
                    s["deterministic"] += float(p[q.argmax()])
            n += lp.shape[0]
    rows = {t: {k: (v / n if k != "tail" else v) for k, v in s.items()} for t, s in sums.items()}
    print(f"# {args.target} / {args.draft} (bf16), {len(texts)} Spec-Bench texts, {n} positions, "
          f"threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}")
    print(f"# {describe(environment())}")
    print("| temperature | standard alpha = sum min(p, q) | coupled alpha | coupled / standard | "
          "one-hot draft (argmax q), both modes |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for t, r in rows.items():
        print(f"| {t} | {r['standard']:.4f} | {r['coupled']:.4f} | {r['coupled'] / r['standard']:.3f} | "
              f"{r['deterministic']:.4f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": args.target, "draft": args.draft, "positions": n, "texts": len(texts),
                       "rows": {str(t): r for t, r in rows.items()}}, f, indent=2)


if __name__ == "__main__":
    main()
