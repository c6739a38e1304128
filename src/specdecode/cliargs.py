"""The drafter and precision flags shared by ``specdecode generate`` and ``specdecode serve`` (one copy).

Both front ends run the same engine with the same drafters, so they take the same flags with the same
meaning; only their defaults may differ (``policy_default``). argparse lives at the edges (DESIGN.md
rule 5): this module and ``cli.py`` / ``server/launch.py`` are its only users. It stays light (no
model code is imported), so ``--help`` answers at once.
"""

from __future__ import annotations

import argparse

from specdecode.kernels import WEIGHT_PRECISIONS

#: What ``--draft`` takes, for help texts.
DRAFT_CHOICES_HELP = ("'ngram' (prompt lookup, no model), 'none' (plain decoding), 'layer-skip' (self-speculation: "
                      "the target drafts with some decoder layers skipped, no second model), 'suffix' (suffix decoding, "
                      "no model), 'suffix:ngram' or 'suffix:MODEL' (suffix decoding, falling back to that drafter "
                      "when the suffix match is weak), or a draft model spec")

#: Draft-length policies (``specdecode.policy.POLICIES``; a test keeps the two in step).
POLICY_NAMES = ("fixed", "heuristic", "confidence", "cost-model")


def add_drafter_arguments(group: argparse._ArgumentGroup, *, policy_default: str = "fixed",
                          gamma_help: str = "gamma: tokens drafted per step, 1..64") -> None:
    """Add --draft, -k, --ngram-min/max, --skip-layers, --policy, --tree, --tree-nodes, --dtype, --weights,
    --draft-weights and --cache-dir to ``group``."""
    group.add_argument("--draft", default="ngram", metavar="SPEC",
                       help=f"the proposer: {DRAFT_CHOICES_HELP}; a draft model must share the target's "
                            "tokenizer (default: %(default)s)")
    group.add_argument("-k", "--num-speculative-tokens", type=int, default=5, metavar="N",
                       help=f"{gamma_help} (default: %(default)s)")
    group.add_argument("--ngram-min", type=int, default=1, metavar="N",
                       help="shortest n-gram the ngram drafter matches (default: %(default)s)")
    group.add_argument("--ngram-max", type=int, default=3, metavar="N",
                       help="longest n-gram the ngram drafter matches, tried first (default: %(default)s)")
    group.add_argument("--skip-layers", default=None, metavar="LIST",
                       help="with --draft layer-skip: decoder layers to skip, e.g. 3,5,7 (default: the set cached for "
                            "the model, else a search on the first prompts, cached in the --cache-dir)")
    group.add_argument("--policy", default=policy_default, choices=POLICY_NAMES,
                       help="draft-length policy: fixed gamma (-k); heuristic (+2 after a fully accepted step, -1 "
                            "otherwise); confidence (draft up to max(2k, 8) while the draft is sure); cost-model "
                            "(gamma maximising tokens/s measured online per batch size, 0 = plain decoding when "
                            "speculation loses) (default: %(default)s)")
    group.add_argument("--tree", default="none", choices=("none", "static", "dynamic"),
                       help="token trees from the draft model, verified in one target pass: 'static' (top-k "
                            "branching per depth) or 'dynamic' (EAGLE-2: expand the most probable nodes, keep the "
                            "best N); -k caps the depth (default: %(default)s = chains)")
    group.add_argument("--tree-nodes", type=int, default=16, metavar="N",
                       help="node budget N of --tree and of suffix decoding, 1..64 (default: %(default)s)")
    group.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                       help="dtype the weights are loaded in; bfloat16 halves the bytes and verifies k tokens at "
                            "about one step's cost on AVX512-BF16 CPUs (see also --weights) (default: %(default)s)")
    group.add_argument("--weights", default="fp32", choices=WEIGHT_PRECISIONS,
                       help="precision the target's weights execute in; plain decoding uses the same target, so "
                            "output stays lossless with respect to it. bf16: half the bytes, fast few-row products "
                            "on AVX512-BF16 CPUs; int8: a quarter of the bytes (fbgemm, int8 weights per channel, "
                            "activations per token), token-for-token lossless with the owned Llama/Qwen2 forward "
                            "(default: %(default)s)")
    group.add_argument("--draft-weights", default=None, choices=WEIGHT_PRECISIONS,
                       help="precision of the draft model's weights (default: same as --weights). int8 = fbgemm "
                            "int8 linear layers: 4x fewer bytes per draft step; a draft's precision changes speed "
                            "only, never the output distribution")
    group.add_argument("--cache-dir", metavar="DIR",
                       help="where converted GGUF models (and layer-skip sets) are cached (default: "
                            "$SPECDECODE_CACHE or ~/.cache/specdecode)")
