import sys, torch, numpy as np, time
# python products.py [ROWS,...]: tile products (amx) against the VNNI passes, fastest of 3 x 3, alternated
ROWS = [int(r) for r in (sys.argv[1] if len(sys.argv) > 1 else '16,32,128,512').split(',')]
from specdecode import lowbit, lowbit_kernels
kernel = lowbit.load_kernel()
tabs = {n: lowbit.load_variant(n) for n in ("amx", "avx512vnni")}
torch.set_num_threads(2)
for kind, n, k in [("Q4_K", 8960*2, 1536), ("Q6_K", 1536, 8960), ("Q4_1", 3072, 576), ("Q4_1", 576, 1536), ("Q5_0", 1792, 896), ("Q8_0", 4864, 896)]:
    module = lowbit.QuantLinear(torch.from_numpy(lowbit_kernels._random_raw(kind, n, k, np.random.default_rng(0))), kind, k)
    for rows in ROWS:
        x = torch.randn(rows, k)
        t = {}
        for _ in range(3):
            for name, tab in tabs.items():
                best = 1e9
                for _ in range(3):
                    s = time.perf_counter(); kernel.q_linear(x, module.packed, module.fmt, tab); best = min(best, time.perf_counter() - s)
                t[name] = min(t.get(name, 1e9), best)
        print(f"{kind} {n}x{k} rows {rows:4d}: amx {t['amx']*1e3:7.2f} ms  vnni {t['avx512vnni']*1e3:7.2f} ms  {t['avx512vnni']/t['amx']:.2f}x")
