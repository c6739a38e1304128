import sys, time, torch
from specdecode.kv.owned import OwnedRunner
from specdecode.lowbit import load_in_precision, kernel_status
torch.set_num_threads(2)
target = sys.argv[1]; L = [int(x) for x in sys.argv[2].split(",")]; N = int(sys.argv[3])
loaded = load_in_precision(target, "int4", progress=False)
runner = OwnedRunner(loaded.model, 1, 2100)
row = runner.row(0)
ids = [1 + (i * 7919) % (runner.vocab_size - 2) for i in range(2000)]
for n in L:
    ts = []
    for _ in range(N):
        t = time.perf_counter(); row.forward(ids[:n], last_only=True); ts.append(time.perf_counter() - t); row.rollback(0)
    print(f"{kernel_status()[:10]} prefill {n}: min {min(ts)*1e3:.1f} ms ({n/min(ts):.0f} tok/s)", flush=True)
