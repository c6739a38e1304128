# command 1's prompts, plain and speculative, with torch's thread count forced past the cores (more preemption
# inside run_fused's parallel region): every run's ids against threads=2 plain
import sys, time, torch
from specdecode.generator import SpecDecoder
from specdecode.data import load_prompts
dec = SpecDecoder.from_pretrained("smollm2-135m", draft="ngram", num_speculative_tokens=5, threads=2, progress=False)
base = dec.plain()
prompts = [dec.encode(p.turns[0], chat=True) for p in load_prompts("spec-bench:extraction:5")]
ref = {i: base.generate(ids, max_new_tokens=128).token_ids for i, ids in enumerate(prompts)}
bad = 0
for T in [int(a) for a in sys.argv[1:]]:
    torch.set_num_threads(T)
    t0 = time.time()
    for i, ids in enumerate(prompts):
        for name, d in (("plain", base), ("spec", dec)):
            out = d.generate(ids, max_new_tokens=128).token_ids
            if out != ref[i]:
                bad += 1
                j = next((k for k, (a, b) in enumerate(zip(out, ref[i])) if a != b), min(len(out), len(ref[i])))
                print(f"threads {T} prompt {i} {name}: DIFF at token {j}", flush=True)
    print(f"threads {T}: {bad} differences so far, {time.time() - t0:.0f} s", flush=True)
print("done", bad)
