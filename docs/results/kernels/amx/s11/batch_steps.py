import sys, time, collections, torch
sys.argv = ["x", "4", "2", "1"]
exec(open("docs/results/kernels/amx/s11/batch_trim.py").read().split("best = {k:")[0])
for name in ("plain", "together"):
    eng = engines[name]
    for b in batches[:3]: run(eng, b)
for name in ("plain", "together", "plain", "together"):
    eng = engines[name]
    runner = eng.runner
    rec = collections.defaultdict(list)
    orig = type(runner)._run
    def _run(self, rows, ids, positions, columns, mask, kv_len, layers, last, _o=orig, _r=rec):
        t = time.perf_counter(); out = _o(self, rows, ids, positions, columns, mask, kv_len, layers, last)
        _r[(tuple(ids.shape), last is not None)].append(time.perf_counter() - t); return out
    type(runner)._run = _run
    t, _ = run(eng, batches[4])
    type(runner)._run = orig
    print(name, f"{t*1e3:.0f} ms", {k: (len(v), round(1e3 * sorted(v)[len(v)//2], 2)) for k, v in sorted(rec.items())})
