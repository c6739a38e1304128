import sys, time, torch
from specdecode.kv.owned import OwnedRunner
from specdecode.lowbit import load_in_precision
torch.set_num_threads(2)
loaded = load_in_precision(sys.argv[1], "int4", progress=False)
runner = OwnedRunner(loaded.model, 1, 400)
row = runner.row(0)
ids = [1 + (i * 7919) % (runner.vocab_size - 2) for i in range(300)]
row.forward(ids[:256], last_only=True); base = row.num_cached
k = int(sys.argv[2]); N = int(sys.argv[3])
ts = []
for _ in range(N):
    t = time.perf_counter(); row.forward(ids[:k]); row.rollback(base); ts.append(time.perf_counter() - t)
print(f"k={k}: min {min(ts)*1e3:.2f} ms, median {sorted(ts)[N//2]*1e3:.2f}", flush=True)
