"""What a better draft head would buy: the per-step cost model over acceptance rates a head could reach.

speedup(alpha, gamma) = E[tokens](alpha, gamma) / (gamma * c + T_verify(gamma) / T_decode), i.i.d. acceptance
alpha per draft position (specdecode.costmodel), c = the head's cost per draft token over a target step,
T_verify from the bench's probe. Defaults: the SmolLM2-135M bf16 run of docs/results/eagle/smollm2_greedy.md
(c = 0.085, the probe's T_verify(k) / T_decode(1)).

    python scripts/research/eagle_cost_model.py [--c 0.085] [--verify 1.00,1.02,1.01,1.01,1.01,1.04,1.06,1.08,1.09]
"""

from __future__ import annotations

import argparse

from specdecode.costmodel import expected_tokens, survival_iid


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--c", type=float, default=0.085, help="head cost per draft token / target step")
    ap.add_argument("--verify", default="1.00,1.02,1.01,1.01,1.01,1.04,1.06,1.08,1.09",
                    help="T_verify(k) / T_decode(1) for k = 0, 1, 2, ... (the bench's probe)")
    ap.add_argument("--alphas", default="0.27,0.4,0.5,0.6,0.7,0.8")
    args = ap.parse_args()
    verify = [float(v) for v in args.verify.split(",")]
    print(f"c = {args.c}; T_verify(k)/T_decode = {verify}")
    print("| alpha | best gamma | tau at best gamma | predicted speedup |")
    print("| ---: | ---: | ---: | ---: |")
    for alpha in (float(a) for a in args.alphas.split(",")):
        best = max(range(1, len(verify)), key=lambda g: expected_tokens(survival_iid(alpha, g), g)
                   / (g * args.c + verify[g]))
        tau = expected_tokens(survival_iid(alpha, best), best)
        print(f"| {alpha:.2f} | {best} | {tau:.2f} | {tau / (best * args.c + verify[best]):.2f}x |")


if __name__ == "__main__":
    main()
