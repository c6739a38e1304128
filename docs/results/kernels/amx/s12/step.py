import sys, time, torch
from specdecode.kv.owned import OwnedRunner
from specdecode.lowbit import load_in_precision
torch.set_num_threads(2)
model = sys.argv[1]; ctx = int(sys.argv[2]); ks = [int(x) for x in sys.argv[3].split(",")]; N = int(sys.argv[4])
loaded = load_in_precision(model, "int4", progress=False)
runner = OwnedRunner(loaded.model, 1, ctx + 64)
row = runner.row(0)
ids = [1 + (i * 7919) % (runner.vocab_size - 2) for i in range(ctx + 40)]
for s in range(0, ctx, 512):
    row.forward(ids[s:min(ctx, s + 512)], last_only=True)
base = row.num_cached
res = {k: [] for k in ks}
for _ in range(N):
    for k in ks:
        t = time.perf_counter(); row.forward(ids[ctx:ctx + k]); row.rollback(base); res[k].append(time.perf_counter() - t)
t1 = min(res[ks[0]])
print(f"{model} ctx={ctx} " + " ".join(f"k={k}:{min(v)*1e3:.2f}ms({min(v)/t1:.2f})" for k, v in res.items()), flush=True)
