"""Library speed, one code version per process: SmolLM2-135M on Spec-Bench prompts, greedy, batch size 1.

Run it once per code version (``PYTHONPATH=<checkout>/src``) and compare the JSON it prints; the
engine's public API (``SpecDecoder.from_pretrained(...).generate``) is the same in both.
Prints one JSON line: per method, per prompt, decode tokens/s (prefill excluded) and the outputs.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--methods", default="none,ngram,suffix", help="drafters, comma-separated")
    ap.add_argument("--dataset", default="spec-bench:summarization:3")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from specdecode.data import load_prompts
    from specdecode.generator import SpecDecoder

    prompts = load_prompts(args.dataset)
    out = {"code": os.environ.get("PYTHONPATH", "installed"), "load": os.getloadavg(), "methods": {}}
    for method in args.methods.split(","):
        dec = SpecDecoder.from_pretrained("smollm2-135m", draft=method, num_speculative_tokens=args.gamma)
        rows = []
        for p in prompts:
            text = p.turns[0]
            t0 = time.perf_counter()
            r = dec.generate(text, chat=True, max_new_tokens=args.max_new_tokens, ignore_eos=True)
            m = r.metrics
            decode_s = m.wall_time_s - m.prefill_time_s
            rows.append({"tokens_per_s": (len(r.token_ids) - 1) / decode_s, "wall_s": time.perf_counter() - t0,
                         "tau": m.mean_accepted_length, "ids": r.token_ids})
        out["methods"][method] = rows
    print(json.dumps(out))


if __name__ == "__main__":
    main()
