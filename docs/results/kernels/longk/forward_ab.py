import sys, time, statistics, torch
from specdecode.kv.owned import OwnedRunner
from specdecode.lowbit import load_in_precision, kernel_status
torch.set_num_threads(2)
target = sys.argv[1]; K = [int(x) for x in sys.argv[2].split(",")]; N = int(sys.argv[3])
loaded = load_in_precision(target, "int4", progress=False)
runner = OwnedRunner(loaded.model, 1, 400)
row = runner.row(0)
ids = [1 + (i * 7919) % (runner.vocab_size - 2) for i in range(300)]
row.forward(ids[:256], last_only=True); base = row.num_cached
for k in K:
    ts = []
    for _ in range(N):
        t = time.perf_counter(); row.forward(ids[:k]); row.rollback(base); ts.append(time.perf_counter() - t)
    print(f"{kernel_status()[:12]} k={k}: min {min(ts)*1e3:.2f} ms, median {statistics.median(ts)*1e3:.2f} ms")
