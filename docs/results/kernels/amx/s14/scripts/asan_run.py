# Command 1's sequence (plain, speculative n-gram γ 5, plain, speculative per prompt), γ 1, 2, 3, 7, 11 and 15
# (verification widths 2-16), and the batched engine (4 slots), with the C++ layer loop and the kernels built with AddressSanitizer (a separate SPECDECODE_CACHE, so the
# cached builds are untouched): any read or write past a buffer aborts with a report. Run:
#   SPECDECODE_CACHE=/tmp/asan_cache LD_PRELOAD=$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 python asan_run.py
import sys, hashlib
import specdecode.lowbit_kernels as lk
ASAN = ["-fsanitize=address", "-fno-omit-frame-pointer", "-g"]
lk._COMMON_CFLAGS = lk._COMMON_CFLAGS + ASAN
import torch.utils.cpp_extension as ce
_load = ce.load
def load(*a, **k):
    k["extra_cflags"] = list(k.get("extra_cflags", [])) + ASAN
    k["extra_ldflags"] = list(k.get("extra_ldflags", [])) + ["-fsanitize=address"]
    return _load(*a, **k)
ce.load = load
import torch
from specdecode.generator import SpecDecoder
from specdecode.data import load_prompts
from specdecode.lowbit import kernel_status
dec = SpecDecoder.from_pretrained("smollm2-135m", draft="ngram", num_speculative_tokens=5, threads=2, progress=False)
base = dec.plain()
prompts = [dec.encode(p.turns[0], chat=True) for p in load_prompts("spec-bench:extraction:5")]
hashes = []
for ids in prompts:
    outs = [d.generate(ids, max_new_tokens=128).token_ids for d in (base, dec, base, dec)]
    assert all(o == outs[0] for o in outs), "outputs differ"
    hashes.append(hashlib.sha1(str(outs[0]).encode()).hexdigest()[:8])
print(kernel_status().split(" with")[0], hashes, flush=True)
for g in (1, 2, 3, 7, 11, 15):  # verification widths 2..16 rows
    d = SpecDecoder(dec.target, dec.proposer, num_speculative_tokens=g)
    outs = [d.generate(ids, max_new_tokens=48).token_ids for ids in prompts[:2]]
    ref = [base.generate(ids, max_new_tokens=48).token_ids for ids in prompts[:2]]
    print(f"gamma {g}: equal {outs == ref}", flush=True)
# the batched engine: 4 slots, 5 prompts (continuous batching: rows join, leave and move between slots)
from specdecode.build import assemble
from specdecode.proposers import build_proposer
from specdecode.types import SamplingParams
for proposer in (None, "ngram"):
    eng = assemble(dec.target, build_proposer(proposer) if proposer else None, num_speculative_tokens=5,
                   max_batch_size=4)
    outs = [o.token_ids for o in eng.generate_batch(prompts, SamplingParams(max_new_tokens=64, eos_token_ids=dec.target.eos_token_ids))]
    ref = [base.generate(ids, max_new_tokens=64).token_ids for ids in prompts]
    print(f"batch of 4 slots, {proposer or 'plain'}: equal {outs == ref}", flush=True)
print("done: no AddressSanitizer report")
