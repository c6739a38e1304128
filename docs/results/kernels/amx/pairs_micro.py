import sys, time, ctypes, torch, numpy as np
from specdecode import lowbit, lowbit_kernels as lk
for _, flags, _ in lk.VARIANTS.values(): flags.append("-DSD_PAIR_AB")
kernel = lowbit.load_kernel()
tab = lowbit.load_variant("amx")
lib = lk._variants["amx"][0]
arr = (ctypes.c_int * 6).in_dll(lib, "sd_pair_min_rows")
torch.set_num_threads(2)
for kind, n, k in [("Q4_K", 17920, 1536), ("Q6_K", 1536, 8960), ("Q4_K", 1536, 1536), ("Q6_K", 256, 1536)]:
    # several copies so the weights stream from memory (L3 300 MB): 400 MB in all
    m0 = lowbit.QuantLinear(torch.from_numpy(lk._random_raw(kind, n, k, np.random.default_rng(0))), kind, k)
    copies = max(1, int(400e6 / m0.packed.numel()))
    mods = [m0.packed.clone() for _ in range(copies)]
    for rows in (4, 8):
        x = torch.randn(rows, k); t = {}
        for _ in range(3):
            for name, v in (("pairs", 1), ("single", 99)):
                for i in range(6): arr[i] = v
                s = time.perf_counter()
                for w in mods: kernel.q_linear(x, w, m0.fmt, tab)
                t[name] = min(t.get(name, 1e9), (time.perf_counter() - s) / copies)
                # L3-resident: the same weight again and again
                best = 1e9
                for _ in range(20):
                    s = time.perf_counter(); kernel.q_linear(x, m0.packed, m0.fmt, tab); best = min(best, time.perf_counter() - s)
                t[name + "-l3"] = min(t.get(name + "-l3", 1e9), best)
        print(f"{kind} {n}x{k} rows {rows}: stream pairs {t['pairs']*1e3:.3f} single {t['single']*1e3:.3f} ms ({t['single']/t['pairs']:.2f}x) | cached pairs {t['pairs-l3']*1e3:.3f} single {t['single-l3']*1e3:.3f} ({t['single-l3']/t['pairs-l3']:.2f}x)", flush=True)
