import sys, time, statistics, torch, collections
from specdecode.kv.owned import OwnedRunner, _mm
from specdecode.lowbit import load_in_precision
torch.set_num_threads(2)
loaded = load_in_precision(sys.argv[1], "int4", progress=False)
runner = OwnedRunner(loaded.model, 1, 400)
mods = [(n, getattr(l, n)) for l in runner.layers for n in ("qkv", "o", "gate_up", "down")] + [("lm_head", runner.lm_head)]
def parts(m):
    return m.parts if hasattr(m, "parts") else [m]
def desc(m):
    return "+".join(f"{p.kind if hasattr(p,'kind') else ''}{tuple(p.packed.shape) if hasattr(p,'packed') else ''}" for p in parts(m))
def width(m):
    return getattr(m, "in_features", None) or m.parts[0].in_features
tot = collections.defaultdict(lambda: [0.0, 0.0, 0, 0])
for k in (1, 4):
    xs = [torch.randn(k, width(m)) for _, m in mods]
    best = None
    for rep in range(5):
        ts = []
        for (n, m), x in zip(mods, xs):
            t = time.perf_counter(); _mm(m, x, runner.row_kernel); ts.append(time.perf_counter() - t)
        best = ts if best is None else [min(a, b) for a, b in zip(best, ts)]
    for (n, m), t in zip(mods, best):
        key = (n, desc(m))
        tot[key][0 if k == 1 else 1] += t
        tot[key][2] = sum(p.packed.numel() for p in parts(m) if hasattr(p, 'packed'))
        tot[key][3] += 1 if k == 1 else 0
for key, (t1, t4, nbytes, cnt) in sorted(tot.items(), key=lambda kv: -kv[1][1]):
    print(f"{key[0]:8s} {key[1]:60s} x{cnt:2d}: 1 row {t1*1e3:6.2f} ms ({nbytes*cnt/t1/1e9:5.1f} GB/s) | 4 rows {t4*1e3:6.2f} ms ({t4/t1:.2f}x)")
