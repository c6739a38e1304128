"""Library speed of one code version per process: plain decoding and one drafter, interleaved prompt by prompt.

Run it once per code version (``PYTHONPATH=<checkout>/src``) and compare the JSON lines it prints;
it uses only the public library API (``SpecDecoder.from_pretrained(...).generate`` and ``.plain()``),
which both versions share. Greedy, batch size 1, chat template for chat prompts, ``ignore_eos`` so
every run decodes ``--max-new-tokens``; tokens/s exclude the prefill. Prints one JSON line with the
machine's load average, per method and prompt the decode tokens/s, tau and the output ids.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", default="smollm2-135m", help="target model spec")
    ap.add_argument("--draft", default="ngram", help="the drafter measured beside plain decoding")
    ap.add_argument("--weights", default="fp32", help="target precision: fp32, bf16, int8")
    ap.add_argument("--draft-weights", default=None, help="draft-model precision (default: --weights)")
    ap.add_argument("--dataset", default="spec-bench:summarization:3", help="prompts, e.g. humaneval:3")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens decoded per prompt")
    ap.add_argument("--gamma", type=int, default=5, help="num_speculative_tokens")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from specdecode.data import load_prompts
    from specdecode.generator import SpecDecoder

    prompts = load_prompts(args.dataset)
    spec = SpecDecoder.from_pretrained(args.target, draft=args.draft, num_speculative_tokens=args.gamma,
                                       weights=args.weights, draft_weights=args.draft_weights, progress=False)
    decoders = {"none": spec.plain(), args.draft: spec}
    out = {"code": os.environ.get("PYTHONPATH", "installed"), "load": os.getloadavg(), "target": args.target,
           "weights": args.weights, "dataset": args.dataset, "methods": {m: [] for m in decoders}}
    for p in prompts:
        for method, dec in decoders.items():
            t0 = time.perf_counter()
            r = dec.generate(p.turns[0], chat=not p.is_completion, max_new_tokens=args.max_new_tokens,
                             ignore_eos=True)
            m = r.metrics
            out["methods"][method].append({
                "prompt": p.id, "tokens_per_s": (len(r.token_ids) - 1) / (m.wall_time_s - m.prefill_time_s),
                "wall_s": time.perf_counter() - t0, "tau": m.mean_accepted_length, "ids": r.token_ids})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
