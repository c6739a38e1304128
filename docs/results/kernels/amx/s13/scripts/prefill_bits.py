# The prefill's bits, again and again in one process: python prefill_bits.py N
# Command 1's five prompts (chat template) prefilled N times each with the chosen kernel (amx here: the tile products
# run the prefill pieces), then 32 greedy one-token steps; the last logits and the whole float16 KV cache compared
# with the first repetition's, bit for bit. Prints every difference.
import sys, time, hashlib, torch
from specdecode.generator import SpecDecoder
from specdecode.data import load_prompts
from specdecode.kv.owned import OwnedRunner
from specdecode.lowbit import kernel_status
N = int(sys.argv[1])
torch.set_num_threads(2)
dec = SpecDecoder.from_pretrained("smollm2-135m", draft=None, threads=2, progress=False)
prompts = [dec.encode(p.turns[0], chat=True) for p in load_prompts("spec-bench:extraction:5")]
runner = OwnedRunner(dec.target.model, 1, 1024)
row = runner.row(0)
print(kernel_status(), [len(p) for p in prompts], flush=True)
ref, bad, t0 = {}, 0, time.time()
for rep in range(N):
    for i, ids in enumerate(prompts):
        logits = row.forward(ids, last_only=True)[-1]
        toks = []
        for _ in range(32):
            t = int(logits.argmax())
            toks.append(t)
            logits = row.forward([t])[-1]
        n = row.num_cached
        kv = hashlib.sha1(runner.k_cache[..., :n, :].contiguous().numpy().tobytes()
                          + runner.v_cache[..., :n, :].contiguous().numpy().tobytes()).hexdigest() if runner.k_cache.dim() >= 3 else ""
        key = (toks, hashlib.sha1(logits.float().numpy().tobytes()).hexdigest(), kv)
        row.rollback(0)
        if i not in ref:
            ref[i] = key
        elif key != ref[i]:
            bad += 1
            print(f"rep {rep} prompt {i}: DIFF tokens {key[0] != ref[i][0]} logits {key[1] != ref[i][1]} cache {key[2] != ref[i][2]}", flush=True)
    if rep % 20 == 19:
        print(f"rep {rep + 1}: {bad} differences, {time.time() - t0:.0f} s", flush=True)
print("done", bad)
