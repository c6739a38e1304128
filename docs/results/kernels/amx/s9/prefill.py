"""A prompt prefill of N tokens (last position only), fastest and median of R: python prefill.py MODEL N R."""
import sys, time, torch
from specdecode.kv.owned import OwnedRunner
from specdecode.lowbit import load_in_precision
torch.set_num_threads(2)
loaded = load_in_precision(sys.argv[1], "int4", progress=False)
runner = OwnedRunner(loaded.model, 1, 1200)
row = runner.row(0)
n = int(sys.argv[2]); N = int(sys.argv[3])
ids = [1 + (i * 7919) % (runner.vocab_size - 2) for i in range(n)]
ts = []
for _ in range(N):
    t = time.perf_counter(); row.forward(ids, last_only=True); row.rollback(0); ts.append(time.perf_counter() - t)
print(f"prefill n={n}: min {min(ts)*1e3:.1f} ms ({min(ts)*1e3/n:.3f} ms/tok), median {sorted(ts)[N//2]*1e3:.1f}", flush=True)
