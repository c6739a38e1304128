"""What a weight precision does to the model itself (a program, not a test).

Speculative decoding is lossless with respect to the target *as loaded*; choosing bf16 or int8
weights changes that target. This measures by how much, teacher-forced on real text (the
Spec-Bench prompts, chat template applied): per precision, the mean negative log-likelihood of
the text's tokens (nats/token, and its perplexity) and how often the precision's next-token
argmax equals float32's.

    python scripts/precision_quality.py --target qwen2.5-coder-1.5b --limit 2
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from specdecode.data import load_prompts
from specdecode.kv import make_runner
from specdecode.kernels import set_weight_precision
from specdecode.models import load_model

DTYPE_OF = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.float32}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--precisions", default="fp32,bf16,int8", help="fp32 first: the others are compared to it")
    ap.add_argument("--limit", type=int, default=2, help="prompts per Spec-Bench category")
    ap.add_argument("--max-tokens", type=int, default=512, help="tokens kept per text")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json")
    args = ap.parse_args()
    unknown = [x for x in args.precisions.split(",") if x not in DTYPE_OF]
    if unknown:
        ap.error(f"unknown precision(s) {unknown}; choose from {', '.join(DTYPE_OF)}, e.g. --precisions fp32,bf16,int8")
    if not args.precisions.startswith("fp32"):
        ap.error("--precisions must start with fp32 (the reference)")
    if args.threads:
        torch.set_num_threads(args.threads)
    texts = None
    logits_fp32: list[torch.Tensor] = []
    rows = {}
    for precision in args.precisions.split(","):
        lm = load_model(args.target, dtype=DTYPE_OF[precision], progress=False)
        if precision == "int8":
            set_weight_precision(lm.model, "int8")
        if texts is None:
            texts = []
            for p in load_prompts("spec-bench"):
                if sum(1 for t in texts if t[0] == p.category) >= args.limit:
                    continue
                chat = lm.tokenizer.apply_chat_template([{"role": "user", "content": p.turns[0]}], tokenize=False,
                                                        add_generation_prompt=True) if lm.tokenizer.chat_template \
                    else p.turns[0]
                texts.append((p.category, lm.tokenizer(chat, add_special_tokens=False)["input_ids"][: args.max_tokens]))
        runner = make_runner(lm.model).row(0)
        nll, n, agree = 0.0, 0, 0
        for i, (_, ids) in enumerate(texts):
            runner.reset()
            logits = runner.forward(ids).float()[:-1]
            logp = torch.log_softmax(logits, -1)
            target = torch.tensor(ids[1:])
            nll -= float(logp.gather(1, target[:, None]).sum())
            n += len(ids) - 1
            if precision == "fp32" or not logits_fp32:
                logits_fp32.append(logits.argmax(-1))
            agree += int((logits.argmax(-1) == logits_fp32[i]).sum())
        rows[precision] = {"nll": nll / n, "perplexity": math.exp(nll / n), "argmax_agreement_with_fp32": agree / n,
                           "tokens": n}
        del runner, lm
    print(f"# {args.target}: {len(texts)} Spec-Bench prompts ({args.limit} per category), teacher-forced, "
          f"{next(iter(rows.values()))['tokens']} tokens")
    print("| precision | NLL (nats/token) | perplexity | next-token argmax = fp32 |")
    print("| --- | ---: | ---: | ---: |")
    for name, r in rows.items():
        print(f"| {name} | {r['nll']:.4f} | {r['perplexity']:.3f} | {100 * r['argmax_agreement_with_fp32']:.1f}% |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": args.target, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    from specdecode.types import SpecDecodeError

    try:
        main()
    except SpecDecodeError as exc:  # a wrong model name or path: one line, like the CLI
        raise SystemExit(f"error: {exc}") from None
