"""Why the SmolLM2 head drafts worse on Spec-Bench than in validation: (1) the features the engine captures
equal the Hugging Face hidden states the head was trained on; (2) acceptance when drafting on the last 12
training-distribution prompts (self-distilled sequences of the training set). It reads the working folder
``specdecode train-drafter --target smollm2-135m`` left in ~/.cache/specdecode/eagle/smollm2-135m.

    python scripts/research/eagle_diagnose.py    # output: docs/results/eagle/diagnose_smollm2.txt
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specdecode.build import build_engine
from specdecode.eagle import corpus
from specdecode.lowbit import set_weight_precision
from specdecode.models import load_model
from specdecode.spec import DrafterSpec
from specdecode.types import SamplingParams


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    torch.set_num_threads(1)
    lm = load_model("smollm2-135m", progress=False); set_weight_precision(lm.model, "bf16")
    work = Path.home()/'.cache/specdecode/eagle/smollm2-135m'
    recs=[json.loads(l) for l in open(work/'responses.jsonl')][-12:]
    eng = build_engine(lm, DrafterSpec.parse(f"eagle:k=2,head={work/'head'}")).engine
    prop = eng.proposer
    # 1. features: engine capture vs HF
    r = recs[0]; ids = r['prompt_ids']
    req, _ = eng.add(ids, SamplingParams(max_new_tokens=2))
    f_eng = prop.rows[0].features[0].float()
    d = corpus.extract_features(lm.model, [{"id":"x","prompt_ids":ids[:],"response_ids":[]}], (2,15,27), 1024)
    f_hf = d['features'][:len(ids)].float()
    for i in range(3):
        a=f_eng[:, i*576:(i+1)*576]; b=f_hf[:, i*576:(i+1)*576]
        print('layer block', i, 'max abs diff', float((a-b).abs().max()), 'rel', float((a-b).norm()/b.norm()))
    eng.abort(req)
    # 2. acceptance on training-domain sequences
    tot_d=tot_a=0; pos1=[0,0]
    for r in recs:
        out = eng.generate(r['prompt_ids'], SamplingParams(max_new_tokens=64, eos_token_ids=lm.eos_token_ids))
        m=out.metrics; tot_d+=m.num_drafted_tokens; tot_a+=m.num_accepted_tokens
        pos1[0]+=m.drafted_by_position[0]; pos1[1]+=m.accepted_by_position[0]
    print('train-domain acceptance', tot_a/tot_d, 'pos1', pos1[1]/pos1[0])


if __name__ == "__main__":
    main()
