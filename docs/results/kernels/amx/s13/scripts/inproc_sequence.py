# In one process: command 1's sequence (plain, speculative, plain, speculative per prompt) repeated R times;
# every run's ids compared with the first plain run of its prompt. Prints any difference at once.
import sys, time, hashlib
from specdecode.generator import SpecDecoder
from specdecode.data import load_prompts
R = int(sys.argv[1])
dec = SpecDecoder.from_pretrained("smollm2-135m", draft="ngram", num_speculative_tokens=5, threads=2, progress=False)
base = dec.plain()
prompts = [dec.encode(p.turns[0], chat=True) for p in load_prompts("spec-bench:extraction:5")]
ref = {}
bad = 0
t0 = time.time()
for rep in range(R):
    for i, ids in enumerate(prompts):
        for name, d in (("plain", base), ("spec", dec), ("plain", base), ("spec", dec)):
            out = d.generate(ids, max_new_tokens=128).token_ids
            if i not in ref:
                ref[i] = out
            elif out != ref[i]:
                bad += 1
                j = next((k for k, (a, b) in enumerate(zip(out, ref[i])) if a != b), min(len(out), len(ref[i])))
                print(f"rep {rep} prompt {i} {name}: DIFF at token {j}", flush=True)
    if rep % 10 == 9:
        print(f"rep {rep + 1}: {bad} differences, {time.time() - t0:.0f} s", flush=True)
print("done", bad)
