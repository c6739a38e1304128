"""What a weight precision does to the model itself (a program, not a test).

Speculative decoding is lossless with respect to the target *as loaded*; choosing bf16 or int8
weights changes that target. This measures by how much, teacher-forced on real text (the
Spec-Bench prompts, chat template applied): per precision, the mean negative log-likelihood of
the text's tokens (nats/token, and its perplexity) and how often the precision's next-token
argmax equals float32's; and whether it passes the quality gate of ``--weights auto``
(``specdecode.precision.quality_gate``: agreement >= 97%, perplexity within 1%).

    python scripts/bench/precision_quality.py --target qwen2.5-coder-1.5b --limit 2
"""

from __future__ import annotations

import argparse
import copy
import json
import math
from dataclasses import replace

import torch

from specdecode.lowbit import set_weight_precision
from specdecode.lowbit import quantize_loaded
from specdecode.models import load_model
from specdecode.precision import measure_quality, quality_gate, quality_texts, teacher_forced


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--precisions", default="bf16,int8,int4", help="compared with float32 (the reference)")
    ap.add_argument("--limit", type=int, default=2, help="prompts per Spec-Bench category")
    ap.add_argument("--max-tokens", type=int, default=512, help="tokens kept per text")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json")
    args = ap.parse_args()
    precisions = [x for x in args.precisions.split(",") if x and x != "fp32"]
    unknown = [x for x in precisions if x not in ("bf16", "int8", "int4")]
    if unknown:
        ap.error(f"unknown precision(s) {unknown}; choose from bf16, int8, int4, e.g. --precisions bf16,int8,int4")
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(args.target, progress=False)
    texts = quality_texts(lm.tokenizer, per_category=args.limit, max_tokens=args.max_tokens)
    ref_argmax, ref_nll, n = teacher_forced(lm.model, texts)
    rows = {"fp32": {"nll": ref_nll / n, "perplexity": math.exp(ref_nll / n), "argmax_agreement_with_fp32": 1.0,
                     "perplexity_change": 0.0, "tokens": n, "passes": True}}
    for precision in precisions:
        if precision in ("int8", "int4"):  # int4: the GGUF file's own blocks (as --weights int4 loads them)
            model = quantize_loaded(replace(lm, model=copy.deepcopy(lm.model)), precision)
        else:
            model = set_weight_precision(copy.deepcopy(lm.model), precision)
        report = measure_quality(lm.model, model, precision, texts, (ref_argmax, ref_nll, n))
        rows[precision] = {"nll": report.nll, "perplexity": math.exp(report.nll),
                           "argmax_agreement_with_fp32": report.argmax_agreement,
                           "perplexity_change": report.perplexity_change, "tokens": n,
                           "passes": quality_gate(report)[0]}
        del model
    print(f"# {args.target}: {len(texts)} Spec-Bench prompts ({args.limit} per category), chat template, "
          f"teacher-forced, {n} positions")
    print("| precision | NLL (nats/token) | perplexity | change | next-token argmax = fp32 | keeps the model |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for name, r in rows.items():
        print(f"| {name} | {r['nll']:.4f} | {r['perplexity']:.3f} | {100 * r['perplexity_change']:+.1f}% | "
              f"{100 * r['argmax_agreement_with_fp32']:.1f}% | {'yes' if r['passes'] else 'no'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": args.target, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    from specdecode.types import SpecDecodeError

    try:
        main()
    except SpecDecodeError as exc:  # a wrong model name or path: one line, like the CLI
        raise SystemExit(f"error: {exc}") from None
