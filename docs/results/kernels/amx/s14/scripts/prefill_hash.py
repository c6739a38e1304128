# One process: command 1's five prompts prefilled (the kernel's prefill pieces: AMX tiles on the amx variant), 32
# greedy steps; prints one hash per prompt of (tokens, last logits, the whole float16 KV cache)
import hashlib, torch
from specdecode.generator import SpecDecoder
from specdecode.data import load_prompts
from specdecode.kv.owned import OwnedRunner
from specdecode.lowbit import kernel_status
torch.set_num_threads(2)
dec = SpecDecoder.from_pretrained("smollm2-135m", draft=None, threads=2, progress=False)
prompts = [dec.encode(p.turns[0], chat=True) for p in load_prompts("spec-bench:extraction:5")]
runner = OwnedRunner(dec.target.model, 1, 1024)
row = runner.row(0)
out = []
for ids in prompts:
    logits = row.forward(ids, last_only=True)[-1]
    h = hashlib.sha1()
    n = row.num_cached
    h.update(runner.k_cache[..., :n, :].contiguous().numpy().tobytes() + runner.v_cache[..., :n, :].contiguous().numpy().tobytes())
    pre = h.hexdigest()[:8]
    toks = []
    for _ in range(32):
        t = int(logits.argmax()); toks.append(t)
        logits = row.forward([t])[-1]
    n = row.num_cached
    h.update(str(toks).encode() + logits.float().numpy().tobytes()
             + runner.k_cache[..., :n, :].contiguous().numpy().tobytes() + runner.v_cache[..., :n, :].contiguous().numpy().tobytes())
    out.append(f"{pre}/{h.hexdigest()[:8]}")
    row.rollback(0)
print(kernel_status().split(" (")[0], *out)
