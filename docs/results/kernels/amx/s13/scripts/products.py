# One low-bit product alone, 1-8 rows, per variant: python products.py avx2,avxvnni,avx512vnni
# 2 threads; per (kind, rows) the variants alternate, 3 rounds of 100 calls each, the fastest call kept.
import sys, torch, numpy as np, time
from specdecode import lowbit, lowbit_kernels
kernel = lowbit.load_kernel()
names = sys.argv[1].split(",")
tabs = {n: lowbit.load_variant(n) for n in names}
torch.set_num_threads(2)
for kind, n, k in [("Q4_1", 1536 * 8, 576), ("Q8_0", 4096, 576)]:
    module = lowbit.QuantLinear(torch.from_numpy(lowbit_kernels._random_raw(kind, n, k, np.random.default_rng(0))), kind, k)
    best = {}
    for _ in range(3):
        for rows in (1, 2, 3, 4, 6, 8):
            x = torch.randn(rows, k)
            for name, tab in tabs.items():
                for _ in range(100):
                    s = time.perf_counter(); kernel.q_linear(x, module.packed, module.fmt, tab)
                    best[name, rows] = min(best.get((name, rows), 1e9), time.perf_counter() - s)
    for name in names:
        print(f"{kind} {n}x{k} ({n * k / 1e6:.2f} M multiply-adds a row) {name:10s} "
              + " ".join(f"{r}:{best[name, r] * 1e6:5.0f}us" for r in (1, 2, 3, 4, 6, 8)), flush=True)
